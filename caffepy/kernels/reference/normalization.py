"""NumPy references of the normalization kernels (cext/normalization.pyx,
caffepy.kernels.normalization).

- LRN across channels and within a channel: written for clarity in float64, returning new
  arrays (top, scale) / the bottom diff, as the vision references are.
- The per-channel passes of BatchNorm and MVN (normalize_forward, normalize_backward,
  channel_affine): with the kernels' signatures, writing into the caller's arrays, and fast
  enough to be what those layers run when the kernels are not built.
"""
import numpy as np

from .vision import ave_pool_backward, ave_pool_forward, pool_out_size

# The kernels' `mode`: how normalize_forward turns the variance into the factor `inv`.
MODE_BATCH_NORM = 0      # inv = 1 / sqrt(var + eps)
MODE_MVN = 1             # inv = 1 / (sqrt(var) + eps)
MODE_MEAN_ONLY = 2       # inv = 1


def _channel_window_sum(v, size):
    """s[:, c] = sum of v[:, c - pre .. c + pre], zero past the channel ends."""
    pre = (size - 1) // 2
    C = v.shape[1]
    s = np.zeros_like(v)
    for c in range(C):
        s[:, c] = v[:, max(c - pre, 0):min(c + pre + 1, C)].sum(axis=1)
    return s


def lrn_across_forward(bottom, size, alpha, beta, k):
    """(top, scale): scale = k + alpha/size * window sum of x^2 over channels, top = x*scale^-b."""
    x = bottom.astype(np.float64)
    scale = k + alpha / size * _channel_window_sum(x * x, size)
    return x * scale ** -beta, scale


def lrn_across_backward(bottom, top, scale, top_diff, size, alpha, beta):
    x, y, s, dy = (a.astype(np.float64) for a in (bottom, top, scale, top_diff))
    ratio = _channel_window_sum(dy * y / s, size)
    return dy * s ** -beta - 2.0 * alpha * beta / size * x * ratio


def lrn_within_forward(bottom, size, alpha, beta):
    """(top, scale) as Caffe composes it: AVE pooling of x^2 (kernel size, pad (size-1)/2,
    stride 1), then power(shift 1, scale alpha, power -beta), then product with x."""
    x = bottom.astype(np.float64)
    H, W = x.shape[2:]
    pre = (size - 1) // 2
    avg = ave_pool_forward(x * x, size, size, 1, 1, pre, pre,
                           pool_out_size(H, size, pre, 1), pool_out_size(W, size, pre, 1))
    scale = 1.0 + alpha * avg
    return x * scale ** -beta, scale


def lrn_within_backward(bottom, top, scale, top_diff, size, alpha, beta):
    """Chain rule through the same composition: d(avg) = -alpha*beta * dy * y / scale."""
    x, y, s, dy = (a.astype(np.float64) for a in (bottom, top, scale, top_diff))
    H, W = x.shape[2:]
    pre = (size - 1) // 2
    d_avg = -alpha * beta * dy * y / s
    return dy * s ** -beta + 2.0 * x * ave_pool_backward(d_avg, H, W, size, size, 1, 1, pre, pre)


def normalize_forward(x, y, keep, mean, var, inv, mode, eps):
    """Per channel c of the (N, C, S) views: mean[c], biased var[c] (float64), inv[c]
    (float32) by `mode`, then y = (x - mean) * inv and, when `keep` is given, keep = y.
    y may be x."""
    C = x.shape[1]
    m = x.shape[0] * x.shape[2]
    mean[...], var[...] = 0.0, 0.0
    if m:
        mean[...] = x.sum(axis=(0, 2), dtype=np.float64) / m
        centred = x - mean.astype(np.float32)[None, :, None]
        var[...] = np.einsum("ncs,ncs->c", centred, centred, dtype=np.float64) / m
    if mode == MODE_BATCH_NORM:
        inv[...] = 1.0 / np.sqrt(var + eps)
    elif mode == MODE_MVN:
        inv[...] = 1.0 / (np.sqrt(var) + eps)
    else:
        inv[...] = np.ones(C)
    channel_affine(x, mean, inv, y)
    if keep is not None:
        np.copyto(keep, y)


def normalize_backward(dy, y, inv, inv_y, dx):
    """dx = inv (dy - mean(dy)) - inv_y mean(dy y) y per channel; dx may be dy."""
    m = max(dy.shape[0] * dy.shape[2], 1)
    sum_dy = dy.sum(axis=(0, 2), dtype=np.float64)
    sum_dy_y = np.einsum("ncs,ncs->c", dy, y, dtype=np.float64)
    p = inv.astype(np.float32)[None, :, None]
    q = (-np.asarray(inv_y, np.float64) * sum_dy_y / m).astype(np.float32)[None, :, None]
    r = (-inv * sum_dy / m).astype(np.float32)[None, :, None]
    dx[...] = p * dy + q * y + r


def channel_affine(x, sub, mul, out):
    """out[:, c, :] = (x[:, c, :] - sub[c]) * mul[c]; out may be x."""
    sub, mul = np.asarray(sub, np.float32), np.asarray(mul, np.float32)
    np.subtract(x, sub[None, :, None], out=out)
    out *= mul[None, :, None]
