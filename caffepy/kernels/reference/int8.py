"""NumPy references of the int8 kernels (cext/int8.pyx): Intel Caffe's int8 convolution and
inner product, computed on integers in int64 (exact), with the float32 epilogue in the kernels'
order of operations."""
import numpy as np


def quantize(x, scale, lo, hi):
    """saturate(rint(x * scale)) into [lo, hi] as int64: float32 product, ties to even."""
    s = np.asarray(x, np.float32) * np.float32(scale)
    return np.rint(np.clip(s, np.float32(lo), np.float32(hi))).astype(np.int64)


def quantize_weights(w, scales):
    """Signed 8-bit weights: row o of w [O, K] times scales[o] (or the one scale)."""
    w = np.asarray(w, np.float32)
    s = np.asarray(scales, np.float32).reshape(-1, 1)
    return np.rint(np.clip(w * s, np.float32(-128), np.float32(127))).astype(np.int64)


def conv_sums(xq, wq, group, kernel, pad, stride, dilation):
    """int64 sums of the convolution of integer xq [N, C, H, W] with wq [O, C / group, kh, kw]."""
    n, c, h, w = xq.shape
    o = wq.shape[0]
    (kh, kw), (ph, pw), (sh, sw), (dh, dw) = kernel, pad, stride, dilation
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    xp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), np.int64)
    xp[:, :, ph:ph + h, pw:pw + w] = xq
    cg, og = c // group, o // group
    out = np.zeros((n, o, oh, ow), np.int64)
    for g in range(group):
        xs = xp[:, g * cg:(g + 1) * cg]
        ws = wq[g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                           j * dw:j * dw + sw * (ow - 1) + 1:sw]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    return out


def finish(sums, bias, mult, summand, sum_scale, relu, slope, quantize_out, lo, hi,
           inv_scale_out, axis=1):
    """The epilogue: float32((sums + bias) * mult) (+ summand * sum_scale) (ReLU) (rounded and
    saturated) * inv_scale_out; bias and mult run along `axis` (the output channels)."""
    shape = [1] * sums.ndim
    shape[axis] = -1
    acc = sums + (0 if bias is None else np.asarray(bias, np.int64).reshape(shape))
    y = acc.astype(np.float32) * np.asarray(mult, np.float32).reshape(shape)
    if summand is not None:
        y = y + np.asarray(summand, np.float32) * np.float32(sum_scale)
    if relu:
        y = np.where(y > 0, y, y * np.float32(slope))
    if quantize_out:
        y = np.rint(np.clip(y, np.float32(lo), np.float32(hi))) + np.float32(0)     # no -0
    return (y * np.float32(inv_scale_out)).astype(np.float32)


def conv_forward(x, wq, bias, mult, summand, group, kernel, pad, stride, dilation, scale_in,
                 lo_in, hi_in, sum_scale, relu, slope, quantize_out, lo, hi, inv_scale_out):
    """cext/int8.pyx conv_forward, with wq [O, C / group, kh, kw] integers."""
    sums = conv_sums(quantize(x, scale_in, lo_in, hi_in), np.asarray(wq, np.int64), group,
                     kernel, pad, stride, dilation)
    return finish(sums, bias, mult, summand, sum_scale, relu, slope, quantize_out, lo, hi,
                  inv_scale_out)


def inner_product(x, wq, bias, mult, scale_in, lo_in, hi_in, relu, slope, quantize_out, lo, hi,
                  inv_scale_out):
    """cext/int8.pyx inner_product, with wq [N, K] integers."""
    sums = quantize(x, scale_in, lo_in, hi_in) @ np.asarray(wq, np.int64).T
    return finish(sums, bias, mult, None, 0, relu, slope, quantize_out, lo, hi, inv_scale_out)
