"""Vision layers: Convolution, Deconvolution, Pooling, Im2col, Crop.

The arithmetic lives in caffepy.kernels.vision (im2col + sgemm without the GIL,
OpenMP over images); these classes read parameters, check shapes and own buffers.
Windows and output sizes (kernel, pad, stride, dilation, Caffe's rounding) come from
caffepy.geometry, which the blocked versions (layers/intel.py) read too.
"""
import numpy as np

from .. import geometry
from ..errors import ShapeError
from ..kernels import vision as kv
from ..layer import Layer, canonical_axis, register
from ..proto import caffe_pb2
from .common import param_wanted

_NO_BUFFER = np.zeros(0, np.float32)


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
        window = geometry.conv_window(self)
        self.window = window
        self.kernel, self.pad, self.stride, self.dilation = window
        self.channels = bottom[0].shape[1]
        self.num_output, self.group = geometry.conv_channels(self, self.channels)
        self.bias_term = p.bias_term
        kh, kw = self.kernel
        specs = [(self.weight_shape(kh, kw), p.weight_filler)]
        if self.bias_term:
            specs.append(((self.top_channels(),), p.bias_filler))
        self.init_param_blobs(specs)
        self.col_buffer = _NO_BUFFER

    def conv_args(self):
        return (*self.pad, *self.stride, *self.dilation, self.group)

    def reshape(self, bottom, top):
        first = bottom[0].shape
        for i, b in enumerate(bottom):
            if b.num_axes != 4 or b.shape[1] != self.channels or b.shape != first:
                raise self.error(f"bottom[{i}]", f"needs shape {first} with {self.channels} channels",
                                 b.shape, cls=ShapeError)
        n, _, h, w = first
        oh, ow = self.output_size(h, w)
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
        return geometry.conv_output(self, self.window, h, w)

    def workspace(self, h, w, oh, ow):
        return kv.conv_workspace_size(self.channels, *self.kernel, oh, ow,
                                      self.blobs[0].count, self.phase == caffe_pb2.TRAIN)

    def forward(self, bottom, top):
        for b, t in zip(bottom, top):
            kv.conv_forward(b.data, self.blobs[0].data, self._bias(), t.data, self.col_buffer,
                            *self.conv_args())

    def backward(self, top, propagate_down, bottom):
        wdiff, bdiff = self.param_diffs()
        for t, down, b in zip(top, propagate_down, bottom):
            kv.conv_backward(t.diff, b.data, self.blobs[0].data, wdiff, bdiff,
                             b.diff if down else None, self._ensure_backward_buffer(b), *self.conv_args())

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
        return geometry.deconv_output(self, self.window, h, w)

    def workspace(self, h, w, oh, ow):
        # the geometry of the convolution it inverts: top channels and the bottom's size
        return kv.conv_workspace_size(self.num_output, *self.kernel, h, w, self.blobs[0].count, True)

    def forward(self, bottom, top):
        for b, t in zip(bottom, top):
            kv.deconv_forward(b.data, self.blobs[0].data, self._bias(), t.data, self.col_buffer,
                              *self.conv_args())

    def backward(self, top, propagate_down, bottom):
        wdiff, bdiff = self.param_diffs()
        for t, down, b in zip(top, propagate_down, bottom):
            kv.deconv_backward(t.diff, b.data, self.blobs[0].data, wdiff, bdiff,
                               b.diff if down else None, self.col_buffer, *self.conv_args())


@register
class Pooling(Layer):
    """MAX or AVE pooling over kernel windows, with Caffe's ceil rounding of the output size.

    pooling_param: pool, kernel_size | kernel_h/w, stride | stride_h/w, pad | pad_h/w,
    global_pooling, round_mode, avg_include_pad. MAX keeps the argmax for backward (and as an
    optional second top); AVE divides by the window clipped to the padded image, or with
    avg_include_pad false by the window clipped to the image.
    """
    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def setup(self, bottom, top):
        p = self.param.pooling_param
        if bottom[0].num_axes != 4:
            raise self.error("bottom", "needs a 4-axis (N, C, H, W) blob", bottom[0].shape, cls=ShapeError)
        self.pool = pool_method(self)
        if len(top) == 2 and self.pool != p.MAX:
            raise self.error("top", "only MAX pooling has a second (mask) top", len(top))
        self.window_param = geometry.pool_window(self)
        self.ceil = p.round_mode == p.CEIL
        self.mask = None

    def reshape(self, bottom, top):
        n, c, h, w = bottom[0].shape
        self.window = self.window_param.sized(h, w)
        self.kernel, self.pad, self.stride, _ = self.window
        oh, ow = geometry.pool_output(self, self.window, h, w, self.ceil)
        for t in top:
            t.reshape(n, c, oh, ow)
        if self.pool == caffe_pb2.PoolingParameter.MAX and (self.mask is None or self.mask.shape != top[0].shape):
            self.mask = np.zeros(top[0].shape, np.int32)
        self.pad_ratio = geometry.pool_pad_ratio(self.param.pooling_param, self.window, h, w, oh, ow)

    def forward(self, bottom, top):
        args = (*self.kernel, *self.stride, *self.pad)
        if self.pool == caffe_pb2.PoolingParameter.MAX:
            kv.max_pool_forward(bottom[0].data, top[0].data, self.mask, *args)
            if len(top) == 2:
                top[1].data[...] = self.mask
        else:
            kv.ave_pool_forward(bottom[0].data, top[0].data, *args)
            if self.pad_ratio is not None:
                top[0].data[...] *= self.pad_ratio

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.pool == caffe_pb2.PoolingParameter.MAX:
            kv.max_pool_backward(top[0].diff, self.mask, bottom[0].diff)
        else:
            kv.ave_pool_backward(scaled_top_diff(self, top[0]), bottom[0].diff,
                                 *self.kernel, *self.stride, *self.pad)


def pool_method(layer):
    """pooling_param.pool, MAX or AVE (STOCHASTIC is refused on every path)."""
    p = layer.param.pooling_param
    if p.pool not in (p.MAX, p.AVE):
        raise layer.error("pooling_param.pool", "only MAX and AVE are supported",
                          p.PoolMethod.Name(p.pool))
    return p.pool


def scaled_top_diff(layer, t):
    """The top diff the AVE kernels' backward gets: as is, or times the layer's pad_ratio
    (avg_include_pad false; the blocked Pooling uses it too)."""
    if layer.pad_ratio is None:
        return t.diff
    ratio = layer.pad_ratio if t.num_axes == 4 else layer.pad_ratio[:, :, None]
    scaled = getattr(layer, "_scaled", None)
    if scaled is None or scaled.shape != t.shape:
        scaled = layer._scaled = np.empty(t.shape, np.float32)
    np.multiply(t.diff, ratio, out=scaled)
    return scaled


@register
class Im2col(Layer):
    """Unfold image patches into channels: top[N, C*kh*kw, oh, ow] (reads convolution_param)."""
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self.window = geometry.conv_window(self)
        self.kernel = self.window.kernel

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error("bottom", "needs a 4-axis (N, C, H, W) blob", bottom[0].shape, cls=ShapeError)
        n, c, h, w = bottom[0].shape
        oh, ow = geometry.conv_output(self, self.window, h, w)
        top[0].reshape(n, c * self.kernel[0] * self.kernel[1], oh, ow)

    def forward(self, bottom, top):
        n, k = top[0].shape[:2]
        kv.im2col_batch(bottom[0].data, *self.window.args(), top[0].data.reshape(n, k, -1))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n, k = top[0].shape[:2]
        cols = top[0].diff.reshape(n, k, -1)
        for i in range(n):
            kv.col2im(cols[i], *self.window.args(), bottom[0].diff[i])


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
