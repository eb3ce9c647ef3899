"""Vision layers: Convolution, Deconvolution, Pooling, Im2col, Crop.

The arithmetic lives in caffepy.kernels.vision (im2col + sgemm without the GIL,
OpenMP over images); these classes read parameters, check shapes and own buffers.
"""
import numpy as np

from ..errors import ShapeError
from ..kernels import vision as kv
from ..layer import Layer, canonical_axis, register
from ..proto import caffe_pb2
from .common import param_wanted

_NO_BUFFER = np.zeros(0, np.float32)


def _pair(layer, repeated, h, w, has_h, default, name):
    """Caffe's 2-D geometry: `name: v` (one or two values) or `name_h`/`name_w`."""
    if has_h:
        if len(repeated):
            raise layer.error(name, f"give either {name} or {name}_h/{name}_w, not both")
        return int(h), int(w)
    if len(repeated) == 0:
        return default, default
    if len(repeated) == 1:
        return int(repeated[0]), int(repeated[0])
    if len(repeated) == 2:
        return int(repeated[0]), int(repeated[1])
    raise layer.error(name, "caffepy supports 2-D spatial geometry (1 or 2 values)", len(repeated))


class _ConvBase(Layer):
    """Shared parameter handling of Convolution and Deconvolution."""
    min_bottoms = 1
    min_tops = 1
    equal_bottom_top = True

    def setup(self, bottom, top):
        p = self.param.convolution_param
        if p.axis not in (1, -3) and not (p.axis < 0 and p.axis + bottom[0].num_axes == 1):
            raise self.error("convolution_param.axis", "caffepy supports the channel axis 1", p.axis)
        if bottom[0].num_axes != 4:
            raise self.error("bottom", "needs a 4-axis (N, C, H, W) blob", bottom[0].shape, cls=ShapeError)
        self.kernel = _pair(self, p.kernel_size, p.kernel_h, p.kernel_w,
                            p.HasField("kernel_h") or p.HasField("kernel_w"), None, "kernel_size")
        if self.kernel[0] is None or min(self.kernel) < 1:
            raise self.error("convolution_param.kernel_size", "must be set and positive", self.kernel)
        self.pad = _pair(self, p.pad, p.pad_h, p.pad_w, p.HasField("pad_h") or p.HasField("pad_w"), 0, "pad")
        self.stride = _pair(self, p.stride, p.stride_h, p.stride_w,
                            p.HasField("stride_h") or p.HasField("stride_w"), 1, "stride")
        self.dilation = _pair(self, p.dilation, 1, 1, False, 1, "dilation")
        if min(self.stride) < 1 or min(self.dilation) < 1:
            raise self.error("convolution_param.stride", "stride and dilation must be positive",
                             self.stride + self.dilation)
        if not p.HasField("num_output") or p.num_output < 1:
            raise self.error("convolution_param.num_output", "must be set and positive", p.num_output)
        self.group = p.group
        self.channels = bottom[0].shape[1]
        self.num_output = p.num_output
        if self.group < 1 or self.channels % self.group or self.num_output % self.group:
            raise self.error("convolution_param.group", f"must divide the input channels ({self.channels}) "
                             f"and num_output ({self.num_output})", self.group)
        self.bias_term = p.bias_term
        kh, kw = self.kernel
        specs = [(self.weight_shape(kh, kw), p.weight_filler)]
        if self.bias_term:
            specs.append(((self.top_channels(),), p.bias_filler))
        self.init_param_blobs(specs)
        self.col_buffer = _NO_BUFFER

    def geometry(self):
        return (*self.pad, *self.stride, *self.dilation, self.group)

    def reshape(self, bottom, top):
        first = bottom[0].shape
        for i, b in enumerate(bottom):
            if b.num_axes != 4 or b.shape[1] != self.channels or b.shape != first:
                raise self.error(f"bottom[{i}]", f"needs shape {first} with {self.channels} channels",
                                 b.shape, cls=ShapeError)
        n, _, h, w = first
        oh, ow = self.output_size(h, w)
        if oh < 1 or ow < 1:
            raise self.error("kernel_size", f"kernel {self.kernel} (pad {self.pad}, dilation "
                             f"{self.dilation}) does not fit the {h}x{w} input", cls=ShapeError)
        for t in top:
            t.reshape(n, self.top_channels(), oh, ow)
        need = self.workspace(h, w, oh, ow)
        if self.col_buffer.size < need:
            self.col_buffer = np.zeros(need, np.float32)

    def top_channels(self):
        return self.num_output

    def _bias(self):
        return self.blobs[1].data if self.bias_term else None

    def param_diffs(self):
        """(weight diff, bias diff) to accumulate into; None where lr_mult 0 wants none."""
        wdiff = self.blobs[0].diff if param_wanted(self, 0) else None
        bdiff = self.blobs[1].diff if self.bias_term and param_wanted(self, 1) else None
        return wdiff, bdiff


@register
class Convolution(_ConvBase):
    """top = W (*) bottom + b, with groups, padding, stride and dilation.

    convolution_param: num_output, kernel_size | kernel_h/w, pad | pad_h/w, stride | stride_h/w,
    dilation, group, bias_term, weight_filler, bias_filler.
    """

    def weight_shape(self, kh, kw):
        return (self.num_output, self.channels // self.group, kh, kw)

    def output_size(self, h, w):
        return kv.conv_output_shape(h, w, *self.kernel, *self.pad, *self.stride, *self.dilation)

    def workspace(self, h, w, oh, ow):
        return kv.conv_workspace_size(self.channels, *self.kernel, oh, ow,
                                      self.blobs[0].count, self.phase == caffe_pb2.TRAIN)

    def forward(self, bottom, top):
        for b, t in zip(bottom, top):
            kv.conv_forward(b.data, self.blobs[0].data, self._bias(), t.data, self.col_buffer,
                            *self.geometry())

    def backward(self, top, propagate_down, bottom):
        wdiff, bdiff = self.param_diffs()
        for t, down, b in zip(top, propagate_down, bottom):
            kv.conv_backward(t.diff, b.data, self.blobs[0].data, wdiff, bdiff,
                             b.diff if down else None, self._ensure_backward_buffer(b), *self.geometry())

    def _ensure_backward_buffer(self, b):
        # TEST-phase nets size the buffer without weight partials; grow it on first backward
        n, c, h, w = b.shape
        oh, ow = self.output_size(h, w)
        need = kv.conv_workspace_size(c, *self.kernel, oh, ow, self.blobs[0].count, True)
        if self.col_buffer.size < need:
            self.col_buffer = np.zeros(need, np.float32)
        return self.col_buffer


@register
class Deconvolution(_ConvBase):
    """The transpose of Convolution: top = W^T (*) bottom + b (learned upsampling).

    Weight shape [C_in, num_output / group, kh, kw]; output size s(H-1) + d(k-1)+1 - 2p.
    """

    def weight_shape(self, kh, kw):
        return (self.channels, self.num_output // self.group, kh, kw)

    def output_size(self, h, w):
        return kv.deconv_output_shape(h, w, *self.kernel, *self.pad, *self.stride, *self.dilation)

    def workspace(self, h, w, oh, ow):
        # the geometry of the convolution it inverts: top channels and the bottom's size
        return kv.conv_workspace_size(self.num_output, *self.kernel, h, w, self.blobs[0].count, True)

    def forward(self, bottom, top):
        for b, t in zip(bottom, top):
            kv.deconv_forward(b.data, self.blobs[0].data, self._bias(), t.data, self.col_buffer,
                              *self.geometry())

    def backward(self, top, propagate_down, bottom):
        wdiff, bdiff = self.param_diffs()
        for t, down, b in zip(top, propagate_down, bottom):
            kv.deconv_backward(t.diff, b.data, self.blobs[0].data, wdiff, bdiff,
                               b.diff if down else None, self.col_buffer, *self.geometry())


@register
class Pooling(Layer):
    """MAX or AVE pooling over kernel windows, with Caffe's ceil rounding of the output size.

    pooling_param: pool, kernel_size | kernel_h/w, stride | stride_h/w, pad | pad_h/w,
    global_pooling, round_mode. MAX keeps the argmax for backward (and as an optional
    second top); AVE divides by the window clipped to the padded image.
    """
    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        p = self.param.pooling_param
        if bottom[0].num_axes != 4:
            raise self.error("bottom", "needs a 4-axis (N, C, H, W) blob", bottom[0].shape, cls=ShapeError)
        if p.pool == p.STOCHASTIC:
            raise self.error("pooling_param.pool", "STOCHASTIC pooling is not supported", hint="use MAX or AVE")
        self.pool = p.pool
        if len(top) == 2 and self.pool != p.MAX:
            raise self.error("top", "only MAX pooling has a second (mask) top", len(top))
        self.global_pooling = p.global_pooling
        has_kernel = p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w")
        if self.global_pooling:
            if has_kernel:
                raise self.error("pooling_param.kernel_size", "global_pooling sets the kernel; remove it")
        elif p.HasField("kernel_size") and (p.HasField("kernel_h") or p.HasField("kernel_w")):
            raise self.error("pooling_param.kernel_size", "give kernel_size or kernel_h/kernel_w, not both")
        elif not has_kernel:
            raise self.error("pooling_param.kernel_size", "must be set (or use global_pooling)")
        elif not p.HasField("kernel_size") and not (p.HasField("kernel_h") and p.HasField("kernel_w")):
            raise self.error("pooling_param.kernel_h", "kernel_h and kernel_w go together")
        self.kernel_param = (p.kernel_size, p.kernel_size) if p.HasField("kernel_size") else (p.kernel_h, p.kernel_w)
        self.pad = (p.pad_h, p.pad_w) if (p.HasField("pad_h") or p.HasField("pad_w")) else (p.pad, p.pad)
        self.stride = (p.stride_h, p.stride_w) if (p.HasField("stride_h") or p.HasField("stride_w")) \
            else (p.stride, p.stride)
        if self.global_pooling and (self.pad != (0, 0) or self.stride != (1, 1)):
            raise self.error("pooling_param", "global pooling needs pad 0 and stride 1",
                             f"pad {self.pad}, stride {self.stride}")
        if min(self.kernel_param) < 1 and not self.global_pooling:
            raise self.error("pooling_param.kernel_size", "must be positive", self.kernel_param)
        if self.pad[0] >= max(self.kernel_param[0], 1) and not self.global_pooling \
                or self.pad[1] >= max(self.kernel_param[1], 1) and not self.global_pooling:
            raise self.error("pooling_param.pad", "must be smaller than the kernel", self.pad)
        self.ceil = p.round_mode == p.CEIL
        self.mask = None

    def reshape(self, bottom, top):
        n, c, h, w = bottom[0].shape
        self.kernel = (h, w) if self.global_pooling else self.kernel_param
        try:
            oh, ow = kv.pool_output_shape(h, w, *self.kernel, *self.stride, *self.pad, self.ceil)
        except ValueError as e:
            raise self.error("pooling_param", str(e), cls=ShapeError) from None
        for t in top:
            t.reshape(n, c, oh, ow)
        if self.pool == caffe_pb2.PoolingParameter.MAX and (self.mask is None or self.mask.shape != top[0].shape):
            self.mask = np.zeros(top[0].shape, np.int32)

    def forward(self, bottom, top):
        geometry = (*self.kernel, *self.stride, *self.pad)
        if self.pool == caffe_pb2.PoolingParameter.MAX:
            kv.max_pool_forward(bottom[0].data, top[0].data, self.mask, *geometry)
            if len(top) == 2:
                top[1].data[...] = self.mask
        else:
            kv.ave_pool_forward(bottom[0].data, top[0].data, *geometry)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.pool == caffe_pb2.PoolingParameter.MAX:
            kv.max_pool_backward(top[0].diff, self.mask, bottom[0].diff)
        else:
            kv.ave_pool_backward(top[0].diff, bottom[0].diff, *self.kernel, *self.stride, *self.pad)


@register
class Im2col(Layer):
    """Unfold image patches into channels: top[N, C*kh*kw, oh, ow] (reads convolution_param)."""
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.convolution_param
        self.kernel = _pair(self, p.kernel_size, p.kernel_h, p.kernel_w,
                            p.HasField("kernel_h") or p.HasField("kernel_w"), None, "kernel_size")
        if self.kernel[0] is None or min(self.kernel) < 1:
            raise self.error("convolution_param.kernel_size", "must be set and positive", self.kernel)
        self.pad = _pair(self, p.pad, p.pad_h, p.pad_w, p.HasField("pad_h") or p.HasField("pad_w"), 0, "pad")
        self.stride = _pair(self, p.stride, p.stride_h, p.stride_w,
                            p.HasField("stride_h") or p.HasField("stride_w"), 1, "stride")
        self.dilation = _pair(self, p.dilation, 1, 1, False, 1, "dilation")

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error("bottom", "needs a 4-axis (N, C, H, W) blob", bottom[0].shape, cls=ShapeError)
        n, c, h, w = bottom[0].shape
        oh, ow = kv.conv_output_shape(h, w, *self.kernel, *self.pad, *self.stride, *self.dilation)
        if oh < 1 or ow < 1:
            raise self.error("kernel_size", f"does not fit the {h}x{w} input", self.kernel, cls=ShapeError)
        top[0].reshape(n, c * self.kernel[0] * self.kernel[1], oh, ow)

    def _geometry(self):
        return (*self.kernel, *self.pad, *self.stride, *self.dilation)

    def forward(self, bottom, top):
        n, k = top[0].shape[:2]
        kv.im2col_batch(bottom[0].data, *self._geometry(), top[0].data.reshape(n, k, -1))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n, k = top[0].shape[:2]
        cols = top[0].diff.reshape(n, k, -1)
        for i in range(n):
            kv.col2im(cols[i], *self._geometry(), bottom[0].diff[i])


@register
class Crop(Layer):
    """Crop bottom[0] to the shape of bottom[1] from `axis` on, at the given offsets.

    crop_param: axis (default 2), offset (one for all cropped axes, or one per axis; default 0).
    """
    exact_bottoms = 2
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        p = self.param.crop_param
        src, ref = bottom[0].shape, bottom[1].shape
        if len(src) != len(ref):
            raise self.error("bottom", f"bottom[0] {src} and bottom[1] {ref} need the same number of axes",
                             cls=ShapeError)
        axis = canonical_axis(self, p.axis, len(src), "crop_param.axis")
        n_crop = len(src) - axis
        if len(p.offset) not in (0, 1, n_crop):
            raise self.error("crop_param.offset", f"give 0, 1 or {n_crop} offsets", len(p.offset))
        offsets = [0] * axis + [int(p.offset[0] if len(p.offset) == 1 else (p.offset[i] if p.offset else 0))
                                for i in range(n_crop)]
        shape = list(src[:axis]) + list(ref[axis:])
        for i in range(axis, len(src)):
            if offsets[i] + shape[i] > src[i]:
                raise self.error("crop_param.offset", f"axis {i}: offset {offsets[i]} + size {shape[i]} "
                                 f"exceeds the bottom's {src[i]}", cls=ShapeError)
        self.window = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
        top[0].reshape(shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self.window]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            diff = bottom[0].diff
            diff[...] = 0
            diff[self.window] = top[0].diff
