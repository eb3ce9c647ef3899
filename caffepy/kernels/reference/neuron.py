"""NumPy references of the neuron kernels (cext/neuron.pyx, caffepy.kernels.neuron): flat
elementwise maps, and PReLU over (num, channels, inner) views.

The float32 results (ReLU, PReLU, Dropout, AbsVal, Clip) are what the kernels must match
exactly; the others are float64.
"""
import numpy as np


def relu_forward(x, slope):
    return np.where(x > 0, x, x * np.float32(slope))


def relu_backward(x, dy, slope):
    return dy * np.where(x > 0, 1, np.float32(slope))


def elu_forward(x, alpha):
    x64 = x.astype(np.float64)
    return np.where(x64 > 0, x64, alpha * np.expm1(x64))


def elu_backward(x, y, dy, alpha):
    """y is the forward's output: the negative side's slope is y + alpha."""
    return dy.astype(np.float64) * np.where(x > 0, 1, y + alpha)


def exp_forward(x):
    return np.exp(x.astype(np.float64))


def sigmoid_forward(x):
    return 1 / (1 + np.exp(-x.astype(np.float64)))


def sigmoid_backward(y, dy):
    return dy.astype(np.float64) * y * (1 - y.astype(np.float64))


def tanh_forward(x):
    return np.tanh(x.astype(np.float64))


def tanh_backward(y, dy):
    return dy.astype(np.float64) * (1 - y.astype(np.float64) ** 2)


def swish_forward(x, beta):
    """(s, y): s = sigmoid(beta x), y = x s."""
    s = sigmoid_forward(beta * x.astype(np.float64))
    return s, x * s


def swish_backward(y, s, dy, beta):
    y64 = y.astype(np.float64)
    return dy.astype(np.float64) * (beta * y64 + s * (1 - beta * y64))


def dropout_forward(x, u, ratio, scale):
    """(mask, y) from uniform draws u: mask = scale where u >= ratio else 0, y = x * mask."""
    mask = np.where(u >= ratio, np.float32(scale), 0).astype(np.float32)
    return mask, x * mask


def absval_backward(x, dy):
    return dy * np.sign(x)


def clip_backward(x, dy, lo, hi):
    return np.where((x >= lo) & (x <= hi), dy, 0)


def prelu_forward(x, slope):
    return np.where(x > 0, x, x * slope[None, :, None])


def prelu_backward(x, dy, slope):
    """(dx, slope_diff): slope_diff[c] = the float64 sum of x * dy over x <= 0 in channel c."""
    dx = np.where(x > 0, dy, dy * slope[None, :, None])
    return dx, (np.minimum(x, 0).astype(np.float64) * dy).sum(axis=(0, 2))
