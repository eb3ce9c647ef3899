"""NumPy references of the channels-last layout of the fast path's kernels (cext/nhwc.pyx,
caffepy.kernels.nhwc): pack, unpack and reverse_axes. The channels-last convolution (GEMM, depthwise, the
Winograd of cext/winograd.pyx), pooling, BatchNorm, Scale and LRN are compared, unpacked, with
the NCHW references of reference/vision.py, reference/normalization.py and reference/common.py.
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
