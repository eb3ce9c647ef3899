"""Caffe's 2-D window geometry, in one place.

How Convolution, Deconvolution, Im2col, Pooling and SPP read their windows (kernel, pad, stride,
dilation: one value for both axes, one per axis, or the `_h` / `_w` pair; global pooling), and
the output sizes with Caffe's rounding:

    convolution     out = (in + 2p - (d(k-1) + 1)) / s + 1          C integer division
    deconvolution   out = s(in - 1) + d(k-1) + 1 - 2p               (the inverse)
    pooling         out = ceil((in + 2p - k) / s) + 1               floor with round_mode FLOOR;
                    with padding, a last window starting at or past in + p is dropped

Every implementation of these layers (plain and SIMD-blocked) reads its parameters here, so two
paths cannot disagree on a field or an error's wording; the kernels receive the sizes.
AVE pooling's divisor is the window clipped to the padded image (Caffe's rule); with
`avg_include_pad: false` (Intel Caffe) it is the window clipped to the image, which
`pool_pad_ratio` turns into a per-output factor on the first.
"""
import typing

import numpy as np

from .errors import ShapeError


class Window(typing.NamedTuple):
    """A 2-D window; every field an (h, w) pair. `kernel` is None for global pooling until
    the input size is known (`sized`)."""
    kernel: tuple
    pad: tuple
    stride: tuple
    dilation: tuple = (1, 1)

    def sized(self, h, w):
        """The window with a global pooling kernel set to the input size."""
        return self if self.kernel is not None else self._replace(kernel=(h, w))

    def args(self):
        """kh, kw, ph, pw, sh, sw, dh, dw: the kernels' argument order."""
        return (*self.kernel, *self.pad, *self.stride, *self.dilation)


def _hw(pair):
    return "x".join(str(v) for v in pair)


def _read_pair(layer, p, where, name, h_name, w_name, default, both_or_none):
    """(h, w) from `name` (repeated or single) or `h_name` / `w_name`; `default` when unset.

    Caffe's convolution takes `_h` or `_w` alone (the other from caffe.proto's default);
    its pooling wants both (`both_or_none`)."""
    field = f"{where}.{name}"
    has_h = h_name is not None and p.HasField(h_name)
    has_w = w_name is not None and p.HasField(w_name)
    raw = getattr(p, name)
    if isinstance(raw, (int, float)):
        values = [int(raw)] if p.HasField(name) else []
    else:
        values = [int(v) for v in raw]
    if has_h or has_w:
        if values:
            raise layer.error(field, f"give either {name} or {h_name} / {w_name}, not both",
                              _hw(values))
        if both_or_none and not (has_h and has_w):
            raise layer.error(f"{where}.{h_name if not has_h else w_name}",
                              f"{h_name} and {w_name} go together")
        return int(getattr(p, h_name)), int(getattr(p, w_name))
    if not values:
        return default
    if len(values) == 1:
        return values[0], values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise layer.error(field, "caffepy supports 2-D spatial geometry: give 1 or 2 values",
                      _hw(values))


def _positive(layer, field, pair):
    if min(pair) < 1:
        raise layer.error(field, "must be positive", _hw(pair))


def conv_window(layer):
    """The window of a Convolution, Deconvolution or Im2col layer (convolution_param)."""
    p, where = layer.param.convolution_param, "convolution_param"
    kernel = _read_pair(layer, p, where, "kernel_size", "kernel_h", "kernel_w", None, False)
    if kernel is None:
        raise layer.error(f"{where}.kernel_size", "is required (or kernel_h and kernel_w)")
    pad = _read_pair(layer, p, where, "pad", "pad_h", "pad_w", (0, 0), False)
    stride = _read_pair(layer, p, where, "stride", "stride_h", "stride_w", (1, 1), False)
    dilation = _read_pair(layer, p, where, "dilation", None, None, (1, 1), False)
    _positive(layer, f"{where}.kernel_size", kernel)
    _positive(layer, f"{where}.stride", stride)
    _positive(layer, f"{where}.dilation", dilation)
    return Window(kernel, pad, stride, dilation)


def conv_channels(layer, channels):
    """(num_output, group) of a convolution over `channels` input channels, checked."""
    p, where = layer.param.convolution_param, "convolution_param"
    if not p.HasField("num_output") or p.num_output < 1:
        raise layer.error(f"{where}.num_output", "must be set and positive", p.num_output)
    num_output, group = int(p.num_output), int(p.group)
    if group < 1 or channels % group or num_output % group:
        raise layer.error(f"{where}.group", f"must divide the input channels ({channels}) and "
                          f"num_output ({num_output})", group)
    return num_output, group


def pool_window(layer):
    """The window of a Pooling layer (pooling_param); kernel None with global_pooling."""
    p, where = layer.param.pooling_param, "pooling_param"
    for name in ("kernel_size_3d", "pad_3d", "stride_3d"):
        if len(getattr(p, name)):
            raise layer.error(f"{where}.{name}", "caffepy supports 2-D pooling (Intel Caffe's 3-D "
                              "pooling is not supported)", list(getattr(p, name)))
    if p.axis != 1:
        raise layer.error(f"{where}.axis", "caffepy pools N x C x H x W blobs (channel axis 1)", p.axis)
    pad = _read_pair(layer, p, where, "pad", "pad_h", "pad_w", (0, 0), True)
    stride = _read_pair(layer, p, where, "stride", "stride_h", "stride_w", (1, 1), True)
    _positive(layer, f"{where}.stride", stride)
    if p.global_pooling:
        if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
            raise layer.error(f"{where}.kernel_size", "global_pooling sets the kernel; remove it")
        if pad != (0, 0) or stride != (1, 1):
            raise layer.error(where, "global pooling needs pad 0 and stride 1",
                              f"pad {_hw(pad)}, stride {_hw(stride)}")
        return Window(None, pad, stride)
    kernel = _read_pair(layer, p, where, "kernel_size", "kernel_h", "kernel_w", None, True)
    if kernel is None:
        raise layer.error(f"{where}.kernel_size", "is required (or kernel_h and kernel_w, or "
                          "global_pooling)")
    _positive(layer, f"{where}.kernel_size", kernel)
    if pad[0] >= kernel[0] or pad[1] >= kernel[1]:
        raise layer.error(f"{where}.pad", f"must be smaller than the kernel ({_hw(kernel)})",
                          _hw(pad))
    return Window(kernel, pad, stride)


def spp_window(level, h, w):
    """The pooling window of level `level` of a spatial pyramid (SPP) over an h x w input:
    2^level bins a side, kernel ceil(size / bins) as stride, and the shortfall of
    kernel * bins over the size split as padding ((shortfall + 1) / 2), as Caffe's SPP."""
    bins = 2 ** level
    kernel = (-(-h // bins), -(-w // bins))
    pad = ((kernel[0] * bins - h + 1) // 2, (kernel[1] * bins - w + 1) // 2)
    return Window(kernel, pad, kernel)


# -- output sizes -------------------------------------------------------------------------------

def _c_div(a, b):
    """C's integer division (toward zero), as Caffe computes convolution sizes."""
    return -(-a // b) if a < 0 else a // b


def conv_output_size(size, k, p, s, d=1):
    return _c_div(size + 2 * p - (d * (k - 1) + 1), s) + 1


def deconv_output_size(size, k, p, s, d=1):
    return s * (size - 1) + d * (k - 1) + 1 - 2 * p


def pool_output_size(size, k, p, s, ceil_mode=True):
    span = size + 2 * p - k
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if p > 0 and (out - 1) * s >= size + p:
        out -= 1
    return out


def conv_output_shape(H, W, kh, kw, pad_h, pad_w, stride_h, stride_w, dil_h=1, dil_w=1):
    """(out_h, out_w) of a convolution."""
    return (conv_output_size(H, kh, pad_h, stride_h, dil_h),
            conv_output_size(W, kw, pad_w, stride_w, dil_w))


def deconv_output_shape(H, W, kh, kw, pad_h, pad_w, stride_h, stride_w, dil_h=1, dil_w=1):
    """(out_h, out_w) of a deconvolution: the input size of the convolution it inverts."""
    return (deconv_output_size(H, kh, pad_h, stride_h, dil_h),
            deconv_output_size(W, kw, pad_w, stride_w, dil_w))


def pool_output_shape(H, W, kh, kw, stride_h, stride_w, pad_h, pad_w, ceil_mode=True):
    """(out_h, out_w) of pooling, with Caffe's rounding."""
    return (pool_output_size(H, kh, pad_h, stride_h, ceil_mode),
            pool_output_size(W, kw, pad_w, stride_w, ceil_mode))


def _fits(layer, where, window, h, w, out):
    if min(out) < 1:
        kh, kw, ph, pw, sh, sw, dh, dw = window.args()
        detail = f"pad {ph}x{pw}, stride {sh}x{sw}" + (f", dilation {dh}x{dw}" if (dh, dw) != (1, 1) else "")
        raise layer.error(f"{where}.kernel_size", f"does not fit the {h}x{w} input ({detail})",
                          f"{kh}x{kw}", cls=ShapeError)
    return out


def conv_output(layer, window, h, w):
    """(out_h, out_w) of a convolution over an h x w input; ShapeError when nothing fits."""
    kh, kw, ph, pw, sh, sw, dh, dw = window.args()
    return _fits(layer, "convolution_param", window, h, w,
                 conv_output_shape(h, w, kh, kw, ph, pw, sh, sw, dh, dw))


def deconv_output(layer, window, h, w):
    kh, kw, ph, pw, sh, sw, dh, dw = window.args()
    return _fits(layer, "convolution_param", window, h, w,
                 deconv_output_shape(h, w, kh, kw, ph, pw, sh, sw, dh, dw))


def pool_output(layer, window, h, w, ceil_mode=True):
    """(out_h, out_w) of pooling `window` (sized) over an h x w input."""
    (kh, kw), (ph, pw), (sh, sw) = window.kernel, window.pad, window.stride
    return _fits(layer, "pooling_param", window, h, w,
                 pool_output_shape(h, w, kh, kw, sh, sw, ph, pw, ceil_mode))


def pool_pad_ratio(p, window, h, w, oh, ow):
    """For AVE pooling with `avg_include_pad: false` and padding (PoolingParameter `p`): the
    (oh, ow) float32 factors that turn the kernels' divisor (the window clipped to the padded
    image) into the window clipped to the image, padded count / in-image count; else None."""
    if p.pool != p.AVE or p.avg_include_pad or window.pad == (0, 0):
        return None
    (kh, kw), (ph, pw), (sh, sw) = window.kernel, window.pad, window.stride
    return np.outer(_pad_ratio(h, oh, kh, ph, sh), _pad_ratio(w, ow, kw, pw, sw)).astype(np.float32)


def _pad_ratio(size, out, k, pad, s):
    start = np.arange(out) * s - pad
    end = np.minimum(start + k, size + pad)
    inside = np.minimum(end, size) - np.maximum(start, 0)
    return (end - start) / inside
