"""NumPy references of the channels-last layout of the fast path's kernels (cext/nhwc.pyx,
caffepy.kernels.nhwc): pack, unpack, reverse_axes and copy_columns. The channels-last
convolution (GEMM, depthwise, the Winograd of cext/winograd.pyx), pooling, BatchNorm, Scale and
LRN are compared, unpacked, with the NCHW references of reference/vision.py,
reference/normalization.py and reference/common.py.
"""
import numpy as np


def pack(x):
    """[N, C, H, W] -> [N, H, W, C]."""
    return np.ascontiguousarray(np.asarray(x).transpose(0, 2, 3, 1))


def unpack(y):
    """[N, H, W, C] -> [N, C, H, W]."""
    return np.ascontiguousarray(np.asarray(y).transpose(0, 3, 1, 2))


def reverse_axes(src):
    """[A, B, S] -> [S, B, A]: convolution weights between Caffe's [O, C, kh * kw] and the
    channels-last GEMMs' [kh * kw, C, O]."""
    return np.ascontiguousarray(np.asarray(src).transpose(2, 1, 0))


def copy_columns(src, s0, dst, d0, n):
    """dst with dst[:, d0:d0 + n] = src[:, s0:s0 + n] (the channels-last Concat), a new array."""
    out = dst.copy()
    out[:, d0:d0 + n] = src[:, s0:s0 + n]
    return out
