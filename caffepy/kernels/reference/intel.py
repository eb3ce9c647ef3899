"""NumPy references of the SIMD-blocked layout of the Intel kernels (cext/intel.pyx,
caffepy.kernels.intel): pack, unpack and channel_sums. The blocked convolution, pooling and LRN (and the
Winograd convolution of cext/winograd.pyx) are compared, unpacked, with the NCHW
references of reference/vision.py and reference/normalization.py; channel_sums is the bias
gradient of the blocked Winograd convolution.
"""
import numpy as np


def pack(x, width):
    """[N, C, H, W] -> [N, ceil(C/V), H, W, V], zero lanes past C."""
    n, c, h, w = x.shape
    cb = -(-c // width)
    padded = np.zeros((n, cb * width, h, w), x.dtype)
    padded[:, :c] = x
    return np.ascontiguousarray(padded.reshape(n, cb, width, h, w).transpose(0, 1, 3, 4, 2))


def unpack(y, channels):
    """[N, Cb, H, W, V] -> [N, channels, H, W]: the first `channels` lanes in order."""
    n, cb, h, w, v = y.shape
    return y.transpose(0, 1, 4, 2, 3).reshape(n, cb * v, h, w)[:, :channels]


def channel_sums(y):
    """[N, Cb, H, W, V] -> [Cb * V] float64 sums per lane, padding lanes included."""
    return y.astype(np.float64).sum(axis=(0, 2, 3)).reshape(-1)
