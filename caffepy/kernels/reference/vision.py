"""NumPy references of the vision kernels (cext/vision.pyx, caffepy.kernels.vision): im2col,
col2im, convolution, deconvolution, MAX and AVE pooling, ROI pooling.

Written for clarity, not speed: direct sums over kernel taps and windows in float64, sharing
no code with the kernels (no im2col inside the convolution reference). Each function returns
new arrays; the accumulate-vs-overwrite conventions of the kernels are the tests' business.
"""
import math

import numpy as np


def conv_out_size(size, k, pad, stride, dil=1):
    return (size + 2 * pad - (dil * (k - 1) + 1)) // stride + 1


def pool_out_size(size, k, pad, stride, ceil_mode=True):
    """Caffe's pooled size: ceil rounding, then drop a last window starting at or past size+pad."""
    span = (size + 2 * pad - k) / stride
    out = (math.ceil(span) if ceil_mode else math.floor(span)) + 1
    if pad > 0 and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _taps(x, kh, kw, pad, stride, dil, out_hw):
    """Yield (i, j, view) with view[..., oy, ox] = padded x at (oy*s + i*d, ox*s + j*d)."""
    (ph, pw), (sh, sw), (dh, dw), (oh, ow) = pad, stride, dil, out_hw
    xp = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(ph, ph), (pw, pw)])
    for i in range(kh):
        for j in range(kw):
            y0, x0 = i * dh, j * dw
            yield i, j, xp[..., y0:y0 + sh * (oh - 1) + 1:sh, x0:x0 + sw * (ow - 1) + 1:sw]


def im2col(im, kh, kw, pad=(0, 0), stride=(1, 1), dil=(1, 1)):
    """[C, H, W] -> [C*kh*kw, oh*ow], row (c*kh + i)*kw + j, zero outside the image."""
    C, H, W = im.shape
    oh = conv_out_size(H, kh, pad[0], stride[0], dil[0])
    ow = conv_out_size(W, kw, pad[1], stride[1], dil[1])
    col = np.zeros((C, kh, kw, oh, ow), np.float64)
    for i, j, view in _taps(im.astype(np.float64), kh, kw, pad, stride, dil, (oh, ow)):
        col[:, i, j] = view
    return col.reshape(C * kh * kw, oh * ow)


def col2im(col, C, H, W, kh, kw, pad=(0, 0), stride=(1, 1), dil=(1, 1)):
    """Adjoint of im2col: every column entry added back onto its image pixel."""
    (ph, pw), (sh, sw), (dh, dw) = pad, stride, dil
    oh = conv_out_size(H, kh, ph, sh, dh)
    ow = conv_out_size(W, kw, pw, sw, dw)
    col = col.astype(np.float64).reshape(C, kh, kw, oh, ow)
    xp = np.zeros((C, H + 2 * ph, W + 2 * pw))
    for i in range(kh):
        for j in range(kw):
            y0, x0 = i * dh, j * dw
            xp[:, y0:y0 + sh * (oh - 1) + 1:sh, x0:x0 + sw * (ow - 1) + 1:sw] += col[:, i, j]
    return xp[:, ph:ph + H, pw:pw + W]


def conv_forward(bottom, weight, bias, pad=(0, 0), stride=(1, 1), dil=(1, 1), group=1):
    """top[n, o] = sum over taps and the group's channels of weight * bottom, + bias[o]."""
    N, C, H, W = bottom.shape
    O, Cg, kh, kw = weight.shape
    Og = O // group
    oh = conv_out_size(H, kh, pad[0], stride[0], dil[0])
    ow = conv_out_size(W, kw, pad[1], stride[1], dil[1])
    w = weight.astype(np.float64)
    top = np.zeros((N, O, oh, ow))
    for i, j, view in _taps(bottom.astype(np.float64), kh, kw, pad, stride, dil, (oh, ow)):
        for g in range(group):
            top[:, g * Og:(g + 1) * Og] += np.einsum(
                "nchw,oc->nohw", view[:, g * Cg:(g + 1) * Cg], w[g * Og:(g + 1) * Og, :, i, j])
    if bias is not None:
        top += bias.astype(np.float64)[None, :, None, None]
    return top


def conv_backward(top_diff, bottom, weight, pad=(0, 0), stride=(1, 1), dil=(1, 1), group=1):
    """(weight_diff, bias_diff, bottom_diff) of conv_forward for the loss sum(top * top_diff)."""
    N, C, H, W = bottom.shape
    O, Cg, kh, kw = weight.shape
    Og = O // group
    (ph, pw), (sh, sw), (dh, dw) = pad, stride, dil
    oh, ow = top_diff.shape[2:]
    dy = top_diff.astype(np.float64)
    w = weight.astype(np.float64)
    weight_diff = np.zeros((O, Cg, kh, kw))
    for i, j, view in _taps(bottom.astype(np.float64), kh, kw, pad, stride, dil, (oh, ow)):
        for g in range(group):
            weight_diff[g * Og:(g + 1) * Og, :, i, j] = np.einsum(
                "nohw,nchw->oc", dy[:, g * Og:(g + 1) * Og], view[:, g * Cg:(g + 1) * Cg])
    bias_diff = dy.sum(axis=(0, 2, 3))
    dxp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    for i in range(kh):
        for j in range(kw):
            y0, x0 = i * dh, j * dw
            for g in range(group):
                dxp[:, g * Cg:(g + 1) * Cg, y0:y0 + sh * (oh - 1) + 1:sh,
                    x0:x0 + sw * (ow - 1) + 1:sw] += np.einsum(
                        "nohw,oc->nchw", dy[:, g * Og:(g + 1) * Og], w[g * Og:(g + 1) * Og, :, i, j])
    return weight_diff, bias_diff, dxp[:, :, ph:ph + H, pw:pw + W]


def deconv_forward(bottom, weight, bias, top_hw, pad=(0, 0), stride=(1, 1), dil=(1, 1), group=1):
    """Caffe's Deconvolution: the bottom-gradient of the conv from top[.., *top_hw] to bottom.

    weight is [C_bottom, C_top / group, kh, kw], as the conv it inverts sees it.
    """
    N = bottom.shape[0]
    Ci, Cog, kh, kw = weight.shape
    probe = np.zeros((N, Cog * group) + tuple(top_hw))
    _, _, top = conv_backward(bottom, probe, weight, pad, stride, dil, group)
    if bias is not None:
        top = top + bias.astype(np.float64)[None, :, None, None]
    return top


def deconv_backward(top_diff, bottom, weight, pad=(0, 0), stride=(1, 1), dil=(1, 1), group=1):
    """(weight_diff, bias_diff, bottom_diff) of deconv_forward."""
    weight_diff, _, _ = conv_backward(bottom, top_diff, weight, pad, stride, dil, group)
    bottom_diff = conv_forward(top_diff, weight, None, pad, stride, dil, group)
    return weight_diff, top_diff.astype(np.float64).sum(axis=(0, 2, 3)), bottom_diff


def _windows(H, W, oh, ow, kh, kw, sh, sw, ph, pw):
    """Yield (py, px, rows, cols, padded_count) per output: the clipped window and AVE divisor."""
    for py in range(oh):
        hs = py * sh - ph
        he = min(hs + kh, H + ph)
        for px in range(ow):
            ws = px * sw - pw
            we = min(ws + kw, W + pw)
            count = (he - hs) * (we - ws)
            yield (py, px, slice(max(hs, 0), min(he, H)), slice(max(ws, 0), min(we, W)), count)


def max_pool_forward(bottom, kh, kw, sh, sw, ph, pw, oh, ow):
    """(top, mask): window max and its first argmax as h * W + w, padding ignored."""
    N, C, H, W = bottom.shape
    top = np.empty((N, C, oh, ow), np.float64)
    mask = np.empty((N, C, oh, ow), np.int32)
    for py, px, rows, cols, _ in _windows(H, W, oh, ow, kh, kw, sh, sw, ph, pw):
        win = bottom[:, :, rows, cols].reshape(N, C, -1)
        arg = win.argmax(axis=2)  # first maximum, as the kernel's strict '>' scan
        top[:, :, py, px] = np.take_along_axis(win, arg[..., None], 2)[..., 0]
        r, c = np.unravel_index(arg, (rows.stop - rows.start, cols.stop - cols.start))
        mask[:, :, py, px] = (r + rows.start) * W + (c + cols.start)
    return top, mask


def max_pool_backward(top_diff, mask, H, W):
    N, C = top_diff.shape[:2]
    bottom_diff = np.zeros((N, C, H * W))
    flat_mask = mask.reshape(N, C, -1)
    flat_dy = top_diff.reshape(N, C, -1).astype(np.float64)
    for n in range(N):
        for c in range(C):
            np.add.at(bottom_diff[n, c], flat_mask[n, c], flat_dy[n, c])
    return bottom_diff.reshape(N, C, H, W)


def ave_pool_forward(bottom, kh, kw, sh, sw, ph, pw, oh, ow):
    N, C, H, W = bottom.shape
    x = bottom.astype(np.float64)
    top = np.empty((N, C, oh, ow))
    for py, px, rows, cols, count in _windows(H, W, oh, ow, kh, kw, sh, sw, ph, pw):
        top[:, :, py, px] = x[:, :, rows, cols].sum(axis=(2, 3)) / count
    return top


def ave_pool_backward(top_diff, H, W, kh, kw, sh, sw, ph, pw):
    N, C, oh, ow = top_diff.shape
    dy = top_diff.astype(np.float64)
    bottom_diff = np.zeros((N, C, H, W))
    for py, px, rows, cols, count in _windows(H, W, oh, ow, kh, kw, sh, sw, ph, pw):
        bottom_diff[:, :, rows, cols] += (dy[:, :, py, px] / count)[:, :, None, None]
    return bottom_diff


def roi_pool_forward(bottom, batch, hstart, hend, wstart, wend):
    """(top, argmax) of ROI max pooling over the given bins: the first maximum in row-major
    order, argmax h * W + w; an empty bin gives 0 and -1."""
    N, C, H, W = bottom.shape
    R, PH, PW = len(batch), hstart.shape[1], wstart.shape[1]
    top = np.zeros((R, C, PH, PW))
    argmax = np.full((R, C, PH, PW), -1, np.int64)
    for r in range(R):
        plane = bottom[batch[r]].reshape(C, H * W)
        for i in range(PH):
            for j in range(PW):
                cells = (np.arange(hstart[r, i], hend[r, i])[:, None] * W
                         + np.arange(wstart[r, j], wend[r, j])).ravel()
                if len(cells):
                    arg = cells[np.argmax(plane[:, cells], axis=1)]
                    argmax[r, :, i, j] = arg
                    top[r, :, i, j] = plane[np.arange(C), arg]
    return top, argmax
