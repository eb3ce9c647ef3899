"""Vision layers: Convolution, Deconvolution, Pooling, Im2col, Crop, SPP (spatial pyramid
pooling), and Intel Caffe's ROIPooling (Fast R-CNN), PSROIPooling (R-FCN) and Reorg (YOLO v2).

The arithmetic lives in caffepy.kernels.vision (im2col + sgemm without the GIL,
OpenMP over images); these classes read parameters, check shapes and own buffers.
Windows and output sizes (kernel, pad, stride, dilation, Caffe's rounding) come from
caffepy.geometry, which the blocked versions (layers/intel.py) read too.
"""
import numpy as np

from .. import geometry, quantization
from ..errors import ShapeError
from ..kernels import vision as kv
from ..layer import Layer, canonical_axis, count_from, register
from ..proto import caffe_pb2
from .common import FusedOutput, param_wanted

_NO_BUFFER = np.zeros(0, np.float32)


def refuse_fusions(layer):
    """Intel Caffe's fusions in convolution_param (a ReLU or an Eltwise SUM done by the layer)
    belong to Convolution (FusedOutput); a Deconvolution is refused them."""
    p = layer.param.convolution_param
    if p.relu:
        raise layer.error("convolution_param.relu", f"a fused ReLU is run by Convolution, not "
                          f"{layer.type}", True, hint=f"Use a ReLU layer after the {layer.type}")
    if p.fusion_type != p.NONE_FUSION or len(p.coeff):
        raise layer.error("convolution_param.fusion_type", f"a fused Eltwise SUM is run by "
                          f"Convolution, not {layer.type}", p.FusionType.Name(p.fusion_type),
                          hint=f"Use an Eltwise layer after the {layer.type}")


class _ConvBase(Layer):
    """Shared parameter handling of Convolution and Deconvolution."""
    takes_fusions = False       # Intel's fused ReLU and Eltwise SUM (Convolution only)
    reshape_from_shapes = True
    min_bottoms = 1
    min_tops = 1
    equal_bottom_top = True

    fused = None                # Convolution's FusedOutput (Intel's relu, fusion_type)

    def check_blob_counts(self, bottom, top):
        if not (self.takes_fusions and FusedOutput.check_blob_counts(self, bottom, top)):
            super().check_blob_counts(bottom, top)

    def setup(self, bottom, top):
        if self.takes_fusions:
            self.fused = FusedOutput.of(self, "convolution_param")
        else:
            refuse_fusions(self)
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
        for i, b in enumerate(bottom[:len(top)]):
            if b.num_axes != 4 or b.shape[1] != self.channels or b.shape != first:
                raise self.error(f"bottom[{i}]", f"needs shape {first} with {self.channels} channels",
                                 b.shape, cls=ShapeError)
        n, _, h, w = first
        oh, ow = self.output_size(h, w)
        for t in top:
            t.reshape(n, self.top_channels(), oh, ow)
        if self.fused is not None:
            self.fused.reshape(self, bottom, top)
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
    dilation, group, bias_term, weight_filler, bias_filler, and Intel's fusions: relu,
    negative_slope, fusion_type, coeff (common.FusedOutput: then bottom[1] is the summand).
    """
    takes_fusions = True
    products = 0         # the products' kernel: float32; layers/bf16.py's variant sets a bf16 path

    def setup(self, bottom, top):
        super().setup(bottom, top)
        # run by net_rules.Int8Unit; the layer's own forward stays float32
        self.int8 = quantization.Int8(self) if quantization.quantized(
            self.param, self.phase, self.net_param, self.source) else None

    def weight_shape(self, kh, kw):
        return (self.num_output, self.channels // self.group, kh, kw)

    def output_size(self, h, w):
        return geometry.conv_output(self, self.window, h, w)

    def workspace(self, h, w, oh, ow):
        return kv.conv_workspace_size(self.channels, *self.kernel, oh, ow,
                                      self.blobs[0].count, self.phase == caffe_pb2.TRAIN)

    def operand(self, role, a):
        """A GEMM operand as the GEMM reads it (role "w" the weights, "x" a bottom's data, "dy"
        a top's diff): itself; layers/bf16.py's variant rounds it to bf16."""
        return a

    def forward(self, bottom, top):
        w = self.operand("w", self.blobs[0].data)
        for b, t in zip(bottom, top):
            kv.conv_forward(self.operand("x", b.data), w, self._bias(), t.data, self.col_buffer,
                            *self.conv_args(), bf16=self.products)
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if self.fused is not None:
            top, propagate_down, bottom = self.fused.backward(top, propagate_down, bottom)
        wdiff, bdiff = self.param_diffs()
        w = self.operand("w", self.blobs[0].data)
        for t, down, b in zip(top, propagate_down, bottom):
            kv.conv_backward(self.operand("dy", t.diff), self.operand("x", b.data), w, wdiff, bdiff,
                             b.diff if down else None, self._ensure_backward_buffer(b), *self.conv_args(),
                             bf16=self.products)

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
    reshape_from_shapes = True
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


@register
class SPP(Layer):
    """Spatial pyramid pooling: MAX or AVE pooling of the whole image into 1, 2x2, 4x4, ...
    bins (pyramid_height levels; geometry.spp_window gives each level's kernel and padding),
    each level flattened and all concatenated: top N x C * (1 + 4 + 16 + ...). With
    pyramid_height 1 the top is the single level unflattened, N x C x 1 x 1 (as in Caffe).

    spp_param { pyramid_height pool }.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.spp_param
        if p.pyramid_height < 1:
            raise self.error("spp_param.pyramid_height", "must be at least 1", p.pyramid_height)
        if p.pool not in (p.MAX, p.AVE):
            raise self.error("spp_param.pool", "only MAX and AVE are supported", p.PoolMethod.Name(p.pool))
        self.levels = int(p.pyramid_height)
        self.max = p.pool == p.MAX

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error("bottom", "needs a 4-axis (N, C, H, W) blob", bottom[0].shape, cls=ShapeError)
        n, c, h, w = bottom[0].shape
        self.windows, self.outputs, self.masks = [], [], []
        for level in range(self.levels):
            window = geometry.spp_window(level, h, w)
            if window.pad[0] >= window.kernel[0] or window.pad[1] >= window.kernel[1]:
                raise self.error("spp_param.pyramid_height", f"level {level} ({2 ** level}x{2 ** level} "
                                 f"bins) does not fit the {h}x{w} input", self.levels, cls=ShapeError)
            oh, ow = geometry.pool_output_shape(h, w, *window.kernel, *window.stride, *window.pad)
            self.windows.append(window)
            self.outputs.append(np.zeros((n, c, oh, ow), np.float32))
            self.masks.append(np.zeros((n, c, oh, ow), np.int32) if self.max else None)
        if self.levels == 1:
            top[0].reshape(self.outputs[0].shape)
        else:
            top[0].reshape(n, sum(o[0].size for o in self.outputs))

    def _args(self, window):
        return (*window.kernel, *window.stride, *window.pad)

    def forward(self, bottom, top):
        n = bottom[0].shape[0]
        y = top[0].data.reshape(n, -1)
        start = 0
        for window, out, mask in zip(self.windows, self.outputs, self.masks):
            if self.max:
                kv.max_pool_forward(bottom[0].data, out, mask, *self._args(window))
            else:
                kv.ave_pool_forward(bottom[0].data, out, *self._args(window))
            y[:, start:start + out[0].size] = out.reshape(n, -1)
            start += out[0].size

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n = bottom[0].shape[0]
        dy = top[0].diff.reshape(n, -1)
        dx = bottom[0].diff
        scratch = np.empty_like(dx) if self.levels > 1 else dx
        start = 0
        for level, (window, out, mask) in enumerate(zip(self.windows, self.outputs, self.masks)):
            part = np.ascontiguousarray(dy[:, start:start + out[0].size].reshape(out.shape))
            start += out[0].size
            into = dx if level == 0 else scratch
            if self.max:
                kv.max_pool_backward(part, mask, into)
            else:
                kv.ave_pool_backward(part, into, *self._args(window))
            if level:
                dx += scratch


def round_half_away(x):
    """C's round(): halves away from zero (NumPy's rint rounds them to even)."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


@register
class ROIPooling(Layer):
    """Max pooling of each region of interest into a fixed pooled_h x pooled_w grid (Fast
    R-CNN; Intel Caffe's layer).

    Bottoms: features N x C x H x W, rois R x 5 (batch index, x1, y1, x2, y2 in input-image
    coordinates). Top R x C x pooled_h x pooled_w. A region is scaled by spatial_scale and
    rounded to the feature grid (ends inclusive, at least 1 x 1); bin (ph, pw) covers rows
    [floor(ph * h / pooled_h), ceil((ph + 1) * h / pooled_h)) of it, clipped to the map; an
    empty bin gives 0. Backward routes each bin's diff to its maximum; none to the rois. The
    maxima come from caffepy.kernels.vision.roi_pool_forward.

    roi_pooling_param { pooled_h pooled_w (or pooled_size: one or two values) spatial_scale }.
    """
    exact_bottoms = 2
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom, top):
        p = self.param.roi_pooling_param
        if bottom[0].num_axes != 4:
            raise self.error("bottom[0]", "caffepy supports 2-D ROI pooling: needs N x C x H x W",
                             bottom[0].shape, cls=ShapeError)
        if len(p.pooled_size):
            if len(p.pooled_size) > 2:
                raise self.error("roi_pooling_param.pooled_size", "give one value or two (h, w)",
                                 list(p.pooled_size))
            self.pooled = (p.pooled_size[0], p.pooled_size[-1])
        else:
            self.pooled = (p.pooled_h, p.pooled_w)
        if min(self.pooled) < 1:
            raise self.error("roi_pooling_param.pooled_h", "pooled_h and pooled_w must be positive",
                             f"{self.pooled[0]}x{self.pooled[1]}")
        self.scale = np.float32(p.spatial_scale)

    def reshape(self, bottom, top):
        rois = bottom[1]
        if rois.num_axes < 2 or count_from(rois.shape, 1) != 5:
            raise self.error("bottom[1]", "rois must be R x 5 (batch index, x1, y1, x2, y2)", rois.shape,
                             cls=ShapeError)
        top[0].reshape(rois.shape[0], bottom[0].shape[1], *self.pooled)

    def _bins(self, start, end, pooled, limit):
        """[start, end) of each of `pooled` bins (R x pooled int32 arrays) over each ROI's cells
        from `start` to `end` inclusive (at least one), clipped to the map."""
        size = (np.maximum(end - start + 1, 1).astype(np.float32) / np.float32(pooled))[:, None]
        steps = np.arange(pooled + 1, dtype=np.float32)
        lo = np.floor(steps[:-1] * size).astype(np.int64) + start[:, None]
        hi = np.ceil(steps[1:] * size).astype(np.int64) + start[:, None]
        return np.clip(lo, 0, limit).astype(np.int32), np.clip(hi, 0, limit).astype(np.int32)

    def forward(self, bottom, top):
        x = bottom[0].data
        n, c, h, w = x.shape
        rois = bottom[1].data.reshape(-1, 5)
        ph_n, pw_n = self.pooled
        self.batch = rois[:, 0].astype(np.int64)
        bad = (self.batch < 0) | (self.batch >= n)
        if np.any(bad):
            raise self.error("bottom[1]", f"roi batch indices must lie in [0, {n})", float(rois[bad, 0][0]),
                             cls=ShapeError)
        corners = round_half_away(rois[:, 1:] * self.scale).astype(np.int64)   # x1, y1, x2, y2
        rows = self._bins(corners[:, 1], corners[:, 3], ph_n, h)
        cols = self._bins(corners[:, 0], corners[:, 2], pw_n, w)
        self.argmax = np.empty(top[0].shape, np.int32)
        kv.roi_pool_forward(x, self.batch.astype(np.int32), *rows, *cols, top[0].data, self.argmax)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            bottom[1].diff[...] = 0
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        n, c, h, w = dx.shape
        found = self.argmax >= 0
        plane = (self.batch[:, None, None, None] * c + np.arange(c)[None, :, None, None])
        flat = np.broadcast_to(plane, self.argmax.shape)[found] * (h * w) + self.argmax[found]
        dx.reshape(-1)[...] = np.bincount(flat, top[0].diff[found], dx.size)


@register
class PSROIPooling(Layer):
    """R-FCN's position-sensitive ROI pooling (Intel Caffe's layer): average pooling of each
    region of interest into a k x k grid (k = group_size) where each bin reads its own
    channel of the score maps.

    Bottoms: score maps N x (output_dim k^2) x H x W, rois R x 5 (batch index, x1, y1, x2, y2
    in input-image coordinates). Top R x output_dim x k x k: bin (i, j) of output channel c
    averages input channel (c k + i) k + j over the bin's cells. The ROI's corners are rounded
    (halves away from zero), its ends moved one pixel out, then scaled by spatial_scale and not
    rounded again; it is at least 0.1 wide and high; bin i covers rows [floor(y1 + i h / k),
    ceil(y1 + (i + 1) h / k)) clipped to the map (float32 arithmetic, as Intel's); an empty bin
    gives 0. Backward spreads each bin's diff evenly over its cells; none to the rois.

    The sums come from a summed-area table of the maps (float64), so a bin costs four reads
    whatever its size. psroi_pooling_param { spatial_scale output_dim group_size } (required).
    """
    exact_bottoms = 2
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom, top):
        p = self.param.psroi_pooling_param
        for field in ("spatial_scale", "output_dim", "group_size"):
            if not p.HasField(field):
                raise self.error(f"psroi_pooling_param.{field}", "is required", "none")
        if p.output_dim <= 0 or p.group_size <= 0:
            field = "output_dim" if p.output_dim <= 0 else "group_size"
            raise self.error(f"psroi_pooling_param.{field}", "must be positive", getattr(p, field))
        self.dim, self.k = int(p.output_dim), int(p.group_size)
        self.scale = np.float32(p.spatial_scale)

    def reshape(self, bottom, top):
        x, rois = bottom
        need = self.dim * self.k * self.k
        if x.num_axes != 4 or x.shape[1] != need:
            raise self.error("bottom[0]", f"needs N x {need} x H x W score maps (output_dim {self.dim} x "
                             f"group_size {self.k}^2 channels)", x.shape, cls=ShapeError)
        if rois.num_axes < 2 or count_from(rois.shape, 1) != 5:
            raise self.error("bottom[1]", "rois must be R x 5 (batch index, x1, y1, x2, y2)", rois.shape,
                             cls=ShapeError)
        top[0].reshape(rois.shape[0], self.dim, self.k, self.k)

    def _bins(self, rois, h, w):
        """[start, end) rows and columns of every bin: four R x k int arrays."""
        corners = round_half_away(rois[:, 1:]).astype(np.float32)
        start = corners[:, :2] * self.scale
        end = (corners[:, 2:] + np.float32(1)) * self.scale
        size = np.maximum(end - start, np.float32(0.1)) / np.float32(self.k)     # (R, [x, y])
        steps = np.arange(self.k + 1, dtype=np.float32)
        edges = steps[None, :, None] * size[:, None, :] + start[:, None, :]         # (R, k + 1, 2)
        lo = np.floor(edges[:, :-1]).astype(np.int64)
        hi = np.ceil(edges[:, 1:]).astype(np.int64)
        return (np.clip(lo[..., 1], 0, h), np.clip(hi[..., 1], 0, h),
                np.clip(lo[..., 0], 0, w), np.clip(hi[..., 0], 0, w))

    def _corners(self, bottom):
        """Flat indices into an N x C x (H + 1) x (W + 1) table of each bin's four corners
        (each R x output_dim x k x k), and the bins' areas (0 when empty)."""
        n, c, h, w = bottom[0].shape
        rois = bottom[1].data.reshape(-1, 5)
        batch = rois[:, 0].astype(np.int64)
        bad = (batch < 0) | (batch >= n)
        if np.any(bad):
            raise self.error("bottom[1]", f"roi batch indices must lie in [0, {n})", float(rois[bad, 0][0]),
                             cls=ShapeError)
        hs, he, ws, we = self._bins(rois, h, w)
        k = self.k
        channel = (np.arange(self.dim)[:, None, None] * k + np.arange(k)[:, None]) * k + np.arange(k)
        plane = (batch[:, None, None, None] * c + channel[None]) * (h + 1)
        rows = [r[:, None, :, None] for r in (hs, he)]
        cols = [q[:, None, None, :] for q in (ws, we)]
        corner = [[(plane + r) * (w + 1) + q for q in cols] for r in rows]
        area = np.maximum(he - hs, 0)[:, None, :, None] * np.maximum(we - ws, 0)[:, None, None, :]
        return corner, np.broadcast_to(area, (len(rois), self.dim, k, k))

    def forward(self, bottom, top):
        n, c, h, w = bottom[0].shape
        table = np.zeros((n, c, h + 1, w + 1))
        np.cumsum(np.cumsum(bottom[0].data, axis=2, dtype=np.float64), axis=3, out=table[:, :, 1:, 1:])
        flat = table.reshape(-1)
        self._saved = self._corners(bottom)          # the backward's bins are the forward's
        (top_left, top_right), (bottom_left, bottom_right) = self._saved[0]
        area = self._saved[1]
        total = flat[bottom_right] - flat[bottom_left] - flat[top_right] + flat[top_left]
        top[0].data[...] = np.where(area > 0, total / np.maximum(area, 1), 0)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[1]:
            bottom[1].diff[...] = 0
        if not propagate_down[0]:
            return
        n, c, h, w = bottom[0].shape
        (top_left, top_right), (bottom_left, bottom_right) = self._saved[0]
        area = self._saved[1]
        share = np.where(area > 0, top[0].diff / np.maximum(area, 1), 0).reshape(-1)
        # each bin adds its share to a rectangle: four signed corners, summed up both axes
        size = n * c * (h + 1) * (w + 1)
        spread = (np.bincount(top_left.reshape(-1), share, size) - np.bincount(top_right.reshape(-1), share, size)
                  - np.bincount(bottom_left.reshape(-1), share, size)
                  + np.bincount(bottom_right.reshape(-1), share, size))
        spread = spread.reshape(n, c, h + 1, w + 1).cumsum(axis=2).cumsum(axis=3)
        bottom[0].diff[...] = spread[:, :, :h, :w]


@register
class Reorg(Layer):
    """YOLO v2's reorganisation, in darknet's element order (Intel Caffe's layer). With
    stride s and a bottom N x C x H x W:

        reverse false: top N x C s^2 x H/s x W/s (space to depth)
        reverse true:  top N x C/s^2 x H s x W s (depth to space)

    Both read the bottom's values as a N x C/s^2 x H s x W s array X (the bottom's own
    shape when reversed, a reinterpretation of its memory otherwise) and pair X[n, c, h s + dy,
    w s + dx] with element (n, (dy s + dx) C/s^2 + c, h, w) of a N x C x H x W array (the top's
    memory without reverse, the bottom with it). reorg_param { stride reverse }.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        _no_in_place_top(self, bottom, top)
        p = self.param.reorg_param
        if not p.HasField("stride") or p.stride < 1:
            raise self.error("reorg_param.stride", "is required and must be positive", p.stride)
        self.stride, self.reverse = int(p.stride), bool(p.reverse)

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error("bottom", "needs a 4-axis (N, C, H, W) blob", bottom[0].shape, cls=ShapeError)
        n, c, h, w = bottom[0].shape
        s = self.stride
        if c % (s * s) or (not self.reverse and (h % s or w % s)):
            need = f"channels divisible by {s * s}" + ("" if self.reverse else f" and height, width by {s}")
            raise self.error("reorg_param.stride", f"needs {need}", f"{s} for a {c}x{h}x{w} bottom",
                             cls=ShapeError)
        # the N x C x H x W grid of the pairing (see the docstring): the bottom's shape either way
        self.grid = (n, c, h, w)
        if self.reverse:
            top[0].reshape(n, c // (s * s), h * s, w * s)
        else:
            top[0].reshape(n, c * s * s, h // s, w // s)

    def _space(self, a):
        """A (the N x C x H x W side) as N x s x s x C/s^2 x H x W, X's order."""
        n, c, h, w = self.grid
        s = self.stride
        return a.reshape(n, s, s, c // (s * s), h, w)

    def _x(self, a):
        """X as N x C/s^2 x H x s x W x s."""
        n, c, h, w = self.grid
        s = self.stride
        return a.reshape(n, c // (s * s), h, s, w, s)

    def _move(self, src, dst, to_grid):
        """Copy src into dst through the pairing: X -> grid side (to_grid) or back."""
        if to_grid:
            self._space(dst)[...] = self._x(src).transpose(0, 3, 5, 1, 2, 4)
        else:
            self._x(dst)[...] = self._space(src).transpose(0, 3, 4, 1, 5, 2)

    def forward(self, bottom, top):
        # without reverse the bottom's memory is X and the top's the grid; with reverse, the other way
        self._move(bottom[0].data, top[0].data, to_grid=not self.reverse)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self._move(top[0].diff, bottom[0].diff, to_grid=self.reverse)


def _no_in_place_top(layer, bottom, top):
    if top[0] is bottom[0]:
        raise layer.error("top", "cannot be computed in place", f"'{layer.param.top[0]}'",
                          "Give the top its own name")
