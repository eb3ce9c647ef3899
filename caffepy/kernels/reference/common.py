"""NumPy references of the common kernels (cext/common.pyx, caffepy.kernels.common): the Scale
layer's passes over (outer, dim, inner) views; add and copy."""
import numpy as np


def scale_forward(x, scale, bias=None):
    """y[o, d, :] = x[o, d, :] * scale[d] (+ bias[d])."""
    y = x * scale[:, None]
    return y if bias is None else y + bias[:, None]


def scale_backward(x, dy, scale):
    """(dx, scale_diff, bias_diff): dx = dy * scale[d]; the diffs summed in float64 per d."""
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    return dy * scale[:, None], (dy64 * x64).sum(axis=(0, 2)), dy64.sum(axis=(0, 2))


def add(a, b):
    """a + b (the Eltwise sum and the Split backward, threaded in the kernel)."""
    return a + b


def copy(src):
    return src.copy()
