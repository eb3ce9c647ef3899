"""The Intel path: IntelPack / IntelUnpack and the layers that run between them on the
SIMD-blocked layout.

    data (N, C, H, W) -> IntelPack -> (N, ceil(C/V), H, W, V) ... -> IntelUnpack -> (N, C, H, W)

Channel c of a blocked blob lives in block c // V, lane c % V, where V is the vector width of
this CPU (8 floats for AVX2, 16 for AVX-512; CAFFEPY_BLOCK_WIDTH overrides it). Lanes past the
real channel count are padding: IntelPack and every blocked kernel write zeros there, and no
blocked kernel reads them as data, so an elementwise layer that maps 0 elsewhere (Sigmoid) cannot
leak into real channels. The blob records the layout as `blob.layout = Blocked(V, C)`.

The classes here are registered variants of their types (caffepy/layer.py): when a layer's
bottoms are blocked, the factory picks the `blocked` variant (the kernels of
caffepy.kernels.intel: vectorized over the V lanes of a pixel, OpenMP over images and blocks),
the `blocked_via_nchw` one (the NCHW layer between an unpack and a pack), or the plain layer
itself when it is layout-agnostic (`layout = ANY`: the neuron layers, Split, Eltwise, Silence).
Any other type fed a blocked blob is a LayerError naming the layer. Blocked layers compute the
same numbers as their NCHW versions (up to float rounding), windows and output sizes from
caffepy.geometry as the plain ones.
"""
import functools

import numpy as np

from .. import autotune, geometry
from ..blob import Blob, Blocked
from ..errors import CaffepyError, ShapeError
from ..layer import BLOCKED, OWN, VIA_NCHW, Layer, register
from ..proto import caffe_pb2
from .common import FusedOutput, Scale, param_wanted, refuse_concat_fusion
from .conv_algorithms import (DIRECT_RULE_TAPS, WINOGRAD_TILES, BlockedGemm, BlockedWinograd, Direct,
                              block_width, kernels_built, winograd_tile)
from .normalization import LRN, BatchNorm
from .vision import pool_method, scaled_top_diff

try:
    from ..kernels import intel as _k
except ImportError:     # reported when a blocked layer is built, not at import
    _k = None


def _kernels(layer):
    if _k is None:
        raise layer.error("type", "needs the compiled kernels (caffepy.kernels.intel), which are "
                          "not built", hint="Run `make install` or `python setup.py build_ext --inplace`",
                          cls=CaffepyError)
    return _k


def blocks(channels, width):
    return (channels + width - 1) // width


# ---------------------------------------------------------------------------------------------
# Pack / Unpack

@register
class IntelPack(Layer):
    """NCHW -> SIMD-blocked (N, ceil(C/V), H, W, V), padding lanes zero. Backward unpacks the
    diff. No parameters; the width V is the CPU's (see block_width)."""
    reshape_from_shapes = True
    exact_bottoms = exact_tops = 1
    layout = OWN        # a blocked bottom is its reshape's error

    def setup(self, bottom, top):
        _kernels(self)
        self.width = block_width()
        if top[0] is bottom[0]:
            raise self.error("top", "IntelPack cannot run in place", f"'{bottom[0].name}'")

    def reshape(self, bottom, top):
        b = bottom[0]
        if b.layout is not None:
            raise self.error("bottom", f"blob '{b.name}' is already blocked", b.layout)
        if b.num_axes != 4:
            raise self.error("bottom[0]", "needs 4 axes (num, channels, height, width)", b.shape,
                             cls=ShapeError)
        n, c, h, w = b.shape
        top[0].reshape(n, blocks(c, self.width), h, w, self.width)
        top[0].layout = Blocked(self.width, c)

    def forward(self, bottom, top):
        _k.pack(bottom[0].data, top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            _k.unpack(top[0].diff, bottom[0].diff)


@register
class IntelUnpack(Layer):
    """SIMD-blocked -> NCHW (the real channels only). Backward packs the diff (padding lanes
    zero). A 5-axis bottom without a layout record (a blob set from Python) is read as blocked
    with every lane a channel."""
    reshape_from_shapes = True
    exact_bottoms = exact_tops = 1
    layout = OWN

    def setup(self, bottom, top):
        _kernels(self)
        if top[0] is bottom[0]:
            raise self.error("top", "IntelUnpack cannot run in place", f"'{bottom[0].name}'")

    def _layout(self, b):
        if b.num_axes != 5:
            raise self.error("bottom", f"blob '{b.name}' is not in the blocked layout (IntelUnpack "
                             "must come after an IntelPack)", b.shape, cls=ShapeError)
        return b.layout or Blocked(b.shape[4], b.shape[1] * b.shape[4])

    def reshape(self, bottom, top):
        b = bottom[0]
        layout = self._layout(b)
        n, _, h, w, _ = b.shape
        top[0].reshape(n, layout.channels, h, w)
        top[0].layout = None

    def forward(self, bottom, top):
        _k.unpack(bottom[0].data, top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            _k.pack(top[0].diff, bottom[0].diff)


# ---------------------------------------------------------------------------------------------
# Convolution

def _blocked_bottom(layer, b, index=0):
    if b.layout is None or b.num_axes != 5:
        raise layer.error(f"bottom[{index}]", f"blob '{b.name}' should be blocked", b.shape,
                          cls=ShapeError)
    return b.layout


@register(variant=BLOCKED)
class BlockedConvolution(Layer):
    """Convolution on blocked blobs: y[o] = sum over the group's channels and taps of W * x + b.

    Blobs and fields exactly as Caffe's Convolution (weights [O, C/group, kh, kw], bias [O];
    convolution_param: num_output, kernel_size / kernel_h,w, stride, pad, dilation, group,
    bias_term, weight_filler, bias_filler, engine; Intel's relu, negative_slope, fusion_type,
    coeff as the plain Convolution's, common.FusedOutput).

    Algorithms: Caffe's (per image, blocked im2col + one sgemm per group, cext/intel.pyx) for
    every shape; Winograd F(m x m, r x r) for stride-1 undilated 3x3 and 5x5 kernels with at
    least 16 channels in and out per group (cext/winograd.pyx: a*a GEMMs over tiles instead of
    one over pixels; 2.6x fewer multiplies for AlexNet's 13x13 3x3 layers), one per tile size m;
    and for a first layer (its channels one block: 13 of AlexNet's conv1's 16 lanes are padding)
    the channels-last path's direct kernel, which reads only the real channels (its data
    gradient is Caffe's). The forward and the backward each take the fastest by measurement
    (caffepy/autotune.py), per shape; with measuring off, Winograd at the tile with the fewest
    multiplies, else direct, else Caffe's. `engine: CAFFE` runs Caffe's. All agree to float
    rounding. The algorithms live in caffepy/layers/conv_algorithms.py."""
    reshape_from_shapes = True
    type = "Convolution"
    layout = BLOCKED
    winograd_kept = None        # a TEST net's Winograd U (conv_algorithms.winograd_weights)
    min_bottoms = 1
    min_tops = 1
    equal_bottom_top = True

    def check_blob_counts(self, bottom, top):
        if not FusedOutput.check_blob_counts(self, bottom, top):
            super().check_blob_counts(bottom, top)

    def setup(self, bottom, top):
        _kernels(self)
        p = self.param.convolution_param
        if p.axis != 1:
            raise self.error("convolution_param.axis", "the blocked layout convolves axis 1", p.axis)
        self.fused = FusedOutput.of(self, "convolution_param")
        layout = _blocked_bottom(self, bottom[0])
        for i, b in enumerate(bottom[1:len(top)], 1):
            if _blocked_bottom(self, b, i) != layout or b.shape[1:] != bottom[0].shape[1:]:
                raise self.error(f"bottom[{i}]", "all bottoms need one shape", b.shape, cls=ShapeError)
        self.window = geometry.conv_window(self)
        (self.kh, self.kw), (self.ph, self.pw), (self.sh, self.sw), (self.dh, self.dw) = self.window
        self.width, self.channels = layout.width, layout.channels
        self.num_output, self.group = geometry.conv_channels(self, self.channels)
        self.bias_term = bool(p.bias_term)
        cg = self.channels // self.group
        specs = [((self.num_output, cg, self.kh, self.kw), p.weight_filler)]
        if self.bias_term:
            specs.append(((self.num_output,), p.bias_filler))
        self.init_param_blobs(specs)
        self.winograd = (not self.caffe_algorithms
                         and self.kh == self.kw and self.kh in WINOGRAD_TILES
                         and (self.sh, self.sw, self.dh, self.dw) == (1, 1, 1, 1)
                         and min(cg, self.num_output // self.group) >= 16 and kernels_built())
        self.direct = (not self.caffe_algorithms and not self.winograd
                       and self.group == 1 and self.channels <= self.width
                       and self.channels * self.kh * self.kw <= DIRECT_RULE_TAPS
                       and kernels_built())
        self._tuned_for = None

    def reshape(self, bottom, top):
        layout = _blocked_bottom(self, bottom[0])
        if layout != Blocked(self.width, self.channels):
            raise self.error("bottom[0]", f"channels changed after setup (was {self.channels})",
                             layout.channels, cls=ShapeError)
        n, _, h, w, v = bottom[0].shape
        self.oh, self.ow = geometry.conv_output(self, self.window, h, w)
        for b, t in zip(bottom, top):
            if b.shape != bottom[0].shape:
                raise self.error("bottom", "all bottoms need one shape", b.shape, cls=ShapeError)
            t.reshape(n, blocks(self.num_output, v), self.oh, self.ow, v)
            t.layout = Blocked(v, self.num_output)
        if self.fused is not None:
            self.fused.reshape(self, bottom, top)
        if self._tuned_for != bottom[0].shape:
            self._tuned_for = bottom[0].shape
            self._choose(bottom[:len(top)], top)

    def _candidates(self, n, h, w, v):
        """{name: algorithm (caffepy/layers/conv_algorithms.py)} for the current shape, and the
        rule's choice among them."""
        gemm = BlockedGemm(self)
        found = {gemm.name: gemm}
        default = gemm.name
        # a window larger than the padded image (Caffe still gives one output) stays on
        # Caffe's algorithm
        fits = (h + 2 * self.ph >= self.dh * (self.kh - 1) + 1
                and w + 2 * self.pw >= self.dw * (self.kw - 1) + 1)
        if self.direct and fits:
            found["direct"] = Direct(self, n, h, w, gemm, width=v)
            default = "direct"
        if self.winograd:
            for m in WINOGRAD_TILES[self.kh]:
                algo = BlockedWinograd(self, m)
                found[algo.name] = algo
            default = f"winograd F({winograd_tile(self.kh, self.oh, self.ow)},{self.kh})"
        return found, default

    def _choose(self, bottom, top):
        """The forward's algorithm and the backward's (weight, bias and data gradients: Winograd
        computes them from shared transforms), each by measurement."""
        n, _, h, w, v = bottom[0].shape
        found, default = self._candidates(n, h, w, v)
        def key_at(batches):
            return (f"Blocked Convolution {batches}x{self.channels}x{h}x{w} v{v} -> "
                    f"{self.num_output} "
                    f"k{self.kh}x{self.kw} s{self.sh}x{self.sw} p{self.ph}x{self.pw} "
                    f"d{self.dh}x{self.dw} g{self.group}{' b' if self.bias_term else ''}")
        key, kin = key_at(autotune.batch_class(n)), autotune.kin_keys(n, key_at)
        need_x = autotune.trial_propagate_down(self, bottom)
        trials = {"forward": {a: functools.partial(algo.forward, bottom, top)
                              for a, algo in found.items()}}
        if self.phase == caffe_pb2.TRAIN:
            trials["backward"] = {
                a: autotune.keeping_diffs(self, functools.partial(algo.backward, top, need_x, bottom,
                                                                  True, self.bias_term))
                for a, algo in found.items()}
        chosen, tunings = {}, {}
        for name, runs in trials.items():
            chosen[name] = autotune.choose(self, f"{key} {name}", runs, default, _k.max_threads(),
                                           kin=[f"{k} {name}" for k in kin])
            tunings[name] = self.tuning
        chosen.setdefault("backward", chosen["forward"])
        self.algorithms = found
        self._use(chosen, tunings)

    def _use(self, chosen, tunings):
        """Run the algorithms `chosen` ({"forward": name, "backward": name}); `pass_tiles`:
        pass -> the Winograd tile it runs (None: not Winograd), as the channels-last
        Convolution's (the backward's one algorithm runs both gradients)."""
        self.algos = {name: self.algorithms[a] for name, a in chosen.items()}
        tiles = {name: algo.m if isinstance(algo, BlockedWinograd) else None
                 for name, algo in self.algos.items()}
        self.pass_tiles = {"forward": tiles["forward"], "weights": tiles["backward"],
                           "data": tiles["backward"]}
        self.algorithm, self.tuning = autotune.describe(chosen, tunings)

    def force_algorithm(self, name):
        """Run algorithm `name` (a key of `self.algorithms`) forward and backward instead of
        the chosen ones, until the shape changes: tests and benchmarks."""
        if name not in self.algorithms:
            raise self.error("convolution_param", f"no algorithm '{name}' for this shape", name,
                             hint=f"Candidates: {', '.join(self.algorithms)}")
        self._use({"forward": name, "backward": name}, {"forward": "forced"})

    def forward(self, bottom, top):
        self.algos["forward"].forward(bottom, top)
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if self.fused is not None:
            top, propagate_down, bottom = self.fused.backward(top, propagate_down, bottom)
        need_w = param_wanted(self, 0)
        need_b = self.bias_term and param_wanted(self, 1)
        if not (need_w or need_b or any(propagate_down)):
            return
        self.algos["backward"].backward(top, propagate_down, bottom, need_w, need_b)


# ---------------------------------------------------------------------------------------------
# Pooling

@register(variant=BLOCKED)
class BlockedPooling(Layer):
    """MAX or AVE pooling on blocked blobs, windows and output sizes as Caffe's Pooling
    (pooling_param: pool, kernel_size / kernel_h,w, stride, pad, global_pooling, round_mode,
    avg_include_pad). MAX keeps the argmax (h * W + w) per lane for the backward."""
    reshape_from_shapes = True
    type = "Pooling"
    layout = BLOCKED
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        _kernels(self)
        p = self.param.pooling_param
        self.method = pool_method(self)
        if p.axis != 1:
            raise self.error("pooling_param.axis", "the blocked layout pools axes 2, 3", p.axis)
        self.window_param = geometry.pool_window(self)
        self.ceil_mode = p.round_mode == caffe_pb2.PoolingParameter.CEIL

    def reshape(self, bottom, top):
        layout = _blocked_bottom(self, bottom[0])
        n, cb, h, w, v = bottom[0].shape
        self.window = self.window_param.sized(h, w)
        (self.kh, self.kw), (self.ph, self.pw), (self.sh, self.sw), _ = self.window
        self.oh, self.ow = geometry.pool_output(self, self.window, h, w, self.ceil_mode)
        top[0].reshape(n, cb, self.oh, self.ow, v)
        top[0].layout = layout
        if self.method == caffe_pb2.PoolingParameter.MAX:
            if getattr(self, "mask", None) is None or self.mask.shape != top[0].shape:
                self.mask = np.empty(top[0].shape, np.int32)
        self.pad_ratio = geometry.pool_pad_ratio(self.param.pooling_param, self.window, h, w,
                                                 self.oh, self.ow)

    def _geom(self):
        return self.kh, self.kw, self.sh, self.sw, self.ph, self.pw

    def forward(self, bottom, top):
        if self.method == caffe_pb2.PoolingParameter.MAX:
            _k.pool_max_forward(bottom[0].data, top[0].data, self.mask, *self._geom())
        else:
            _k.pool_ave_forward(bottom[0].data, top[0].data, *self._geom())
            if self.pad_ratio is not None:
                top[0].data[...] *= self.pad_ratio[:, :, None]

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.method == caffe_pb2.PoolingParameter.MAX:
            _k.pool_max_backward(top[0].diff, self.mask, bottom[0].diff)
        else:
            _k.pool_ave_backward(scaled_top_diff(self, top[0]), bottom[0].diff, *self._geom())


# ---------------------------------------------------------------------------------------------
# LRN across channels

@register(variant=BLOCKED)
class BlockedLRN(Layer):
    """ACROSS_CHANNELS LRN on blocked blobs: y = x * (k + alpha/size * sum of x^2 over the
    `size` channels centred on c)^-beta, the window crossing blocks (lrn_param: local_size,
    alpha, beta, k). The backward recomputes the scale rather than keeping it.
    WITHIN_CHANNEL runs the NCHW layer through unpack / pack (BlockedLRNWithinChannel)."""
    type = "LRN"
    layout = BLOCKED
    exact_bottoms = exact_tops = 1

    @classmethod
    def wanted(cls, request):
        return request.param.lrn_param.norm_region == caffe_pb2.LRNParameter.ACROSS_CHANNELS

    def setup(self, bottom, top):
        _kernels(self)
        p = self.param.lrn_param
        self.size, self.alpha, self.beta, self.k = int(p.local_size), float(p.alpha), float(p.beta), float(p.k)
        max_c, max_size = _k.lrn_max_channels()
        if self.size < 1 or self.size % 2 == 0 or self.size > max_size:
            raise self.error("lrn_param.local_size", f"must be odd, positive and at most {max_size}",
                             self.size)
        if top[0] is bottom[0]:
            raise self.error("top", "LRN cannot run in place (its backward needs the input)",
                             f"'{bottom[0].name}'")
        layout = _blocked_bottom(self, bottom[0])
        if blocks(layout.channels, layout.width) * layout.width > max_c:
            raise self.error("bottom[0]", f"the blocked LRN takes at most {max_c} channels",
                             layout.channels)

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)
        top[0].layout = _blocked_bottom(self, bottom[0])

    def forward(self, bottom, top):
        _k.lrn_forward(bottom[0].data, top[0].data, bottom[0].layout.channels, self.size,
                       self.alpha, self.beta, self.k)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            _k.lrn_backward(bottom[0].data, top[0].diff, bottom[0].diff, bottom[0].layout.channels,
                            self.size, self.alpha, self.beta, self.k)


# ---------------------------------------------------------------------------------------------
# Concat

@register(variant=BLOCKED)
class BlockedConcat(Layer):
    """Concat of blocked blobs (concat_param.axis / concat_dim). Along channels, bottoms whose
    channel counts fill their blocks are copied block by block; otherwise lane by lane."""
    reshape_from_shapes = True
    type = "Concat"
    layout = BLOCKED
    min_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        refuse_concat_fusion(self)
        p = self.param.concat_param
        axis = p.axis if p.HasField("axis") or not p.HasField("concat_dim") else p.concat_dim
        if not -5 <= axis < 4:
            raise self.error("concat_param.axis", "out of range for a 4-axis blob", axis)
        self.axis = axis % 4
        for i, b in enumerate(bottom):
            _blocked_bottom(self, b, i)

    def reshape(self, bottom, top):
        first = bottom[0]
        width = first.layout.width
        shape = list(first.shape)
        channels = 0
        for i, b in enumerate(bottom):
            lay = _blocked_bottom(self, b, i)
            if lay.width != width:
                raise self.error(f"bottom[{i}]", f"block width differs from bottom[0]'s ({width})",
                                 lay.width, cls=ShapeError)
            for ax in range(4):
                if ax != self.axis and ax != 1 and b.shape[ax] != first.shape[ax]:
                    raise self.error(f"bottom[{i}]", f"shape differs from bottom[0]'s outside axis "
                                     f"{self.axis}", b.shape, cls=ShapeError)
            if self.axis != 1 and lay.channels != first.layout.channels:
                raise self.error(f"bottom[{i}]", f"channels differ from bottom[0]'s "
                                 f"({first.layout.channels})", lay.channels, cls=ShapeError)
            channels += lay.channels
        if self.axis == 1:
            shape[1] = blocks(channels, width)
            layout = Blocked(width, channels)
        else:
            shape[self.axis] = sum(b.shape[self.axis] for b in bottom)
            layout = first.layout
        top[0].reshape(shape)
        top[0].layout = layout
        # along channels, block copies work while every bottom but the last fills its blocks
        self.by_block = self.axis != 1 or all(b.layout.channels % width == 0 for b in bottom[:-1])

    def _pieces(self, bottom):
        """(bottom, index expression into the top) for block copies."""
        off = 0
        for b in bottom:
            n = b.shape[self.axis] if self.axis != 1 else b.shape[1]
            sl = [slice(None)] * 5
            sl[self.axis] = slice(off, off + n)
            yield b, tuple(sl)
            off += n

    def _lanes(self, bottom):
        """(bottom, its channel, top channel) for lane copies."""
        off = 0
        for b in bottom:
            for c in range(b.layout.channels):
                yield b, c, off + c
            off += b.layout.channels

    def forward(self, bottom, top):
        y = top[0].data
        if self.by_block:
            for b, sl in self._pieces(bottom):
                y[sl] = b.data
            return
        v = top[0].layout.width
        y[...] = 0
        for b, c, tc in self._lanes(bottom):
            y[:, tc // v, :, :, tc % v] = b.data[:, c // v, :, :, c % v]

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        if self.by_block:
            for (b, sl), pd in zip(self._pieces(bottom), propagate_down):
                if pd:
                    b.diff[...] = dy[sl]
            return
        v = top[0].layout.width
        for b, pd in zip(bottom, propagate_down):
            if pd:
                b.diff[...] = 0
        for b, c, tc in self._lanes(bottom):
            if propagate_down[bottom.index(b)]:
                b.diff[:, c // v, :, :, c % v] = dy[:, tc // v, :, :, tc % v]


# ---------------------------------------------------------------------------------------------
# Per-channel layers run through NCHW

class _ViaPlain(Layer):
    """A per-channel NCHW layer (BatchNorm, Scale, WITHIN_CHANNEL LRN) run on blocked blobs by
    unpacking the bottoms and packing the tops around it. Correct, not fast: the copies cost
    about as much as these layers themselves. Subclasses name the NCHW class in `plain`."""
    plain = None
    layout = BLOCKED

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("exact_bottoms", "min_bottoms", "max_bottoms", "exact_tops", "min_tops",
                     "max_tops", "differentiable"):
            setattr(cls, name, getattr(cls.plain, name))

    def __init__(self, param, phase=0, source=None):
        super().__init__(param, phase, source)
        self.inner = self.plain(param, phase, source)
        self.blobs = self.inner.blobs

    def setup(self, bottom, top):
        _kernels(self)
        self.inner.context, self.inner.net_param = self.context, self.net_param
        for i, b in enumerate(bottom):
            _blocked_bottom(self, b, i)
        self.width = bottom[0].layout.width
        self._bottom = [Blob(name=b.name) for b in bottom]
        self._top = []
        for t in top:
            same = [i for i, b in enumerate(bottom) if b is t]
            self._top.append(self._bottom[same[0]] if same else Blob(name=t.name))
        self._shape_inner(bottom)
        self.inner.layer_setup(self._bottom, self._top)
        self.param_propagate_down = list(self.inner.param_propagate_down)

    def _shape_inner(self, bottom):
        for b, ib in zip(bottom, self._bottom):
            n, _, h, w, _ = b.shape
            ib.reshape(n, b.layout.channels, h, w)

    def reshape(self, bottom, top):
        self._shape_inner(bottom)
        self.inner.reshape(self._bottom, self._top)
        for t, it in zip(top, self._top):
            if it.num_axes != 4:
                raise self.error("top", "the blocked layout needs 4-axis tops", it.shape,
                                 cls=ShapeError)
            n, c, h, w = it.shape
            if not any(t is b for b in bottom):
                t.reshape(n, blocks(c, self.width), h, w, self.width)
            t.layout = Blocked(self.width, c)

    def forward(self, bottom, top):
        for b, ib in zip(bottom, self._bottom):
            _k.unpack(b.data, ib.data)
        self.inner.forward(self._bottom, self._top)
        for t, it in zip(top, self._top):
            _k.pack(it.data, t.data)

    def backward(self, top, propagate_down, bottom):
        self.inner.param_propagate_down = self.param_propagate_down
        for t, it in zip(top, self._top):
            _k.unpack(t.diff, it.diff)
        self.inner.backward(self._top, propagate_down, self._bottom)
        for b, ib, pd in zip(bottom, self._bottom, propagate_down):
            if pd:
                _k.pack(ib.diff, b.diff)


@register(variant=VIA_NCHW)
class BlockedBatchNorm(_ViaPlain):
    type = "BatchNorm"
    plain = BatchNorm


@register(variant=VIA_NCHW)
class BlockedScale(_ViaPlain):
    type = "Scale"
    plain = Scale


@register(variant=VIA_NCHW)
class BlockedLRNWithinChannel(_ViaPlain):
    type = "LRN"
    plain = LRN

    @classmethod
    def wanted(cls, request):
        return request.param.lrn_param.norm_region == caffe_pb2.LRNParameter.WITHIN_CHANNEL
