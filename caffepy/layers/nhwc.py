"""The fast path's channels-last family: NHWCPack / NHWCUnpack and the layers that run on the
channels-last layout (caffepy.blob.CHANNELS_LAST: N, H, W, C in memory).

A net gets this layout from its layout plan (caffepy/layout_plan.py), not from its prototxt:
the plan runs every layer that has a channels-last implementation in that layout once a
convolution has started a region, and puts an NHWCPack / NHWCUnpack where the region starts and
ends. The blobs keep Caffe's shapes and values (`data` is an N, C, H, W view), so a net reads and
saves as ever; the kernels (caffepy.kernels.nhwc) take the arrays as stored.

The classes are registered `nhwc` variants of their types and subclass the plain ones, whose
setup (fields, checks, parameter blobs) they keep:
    Convolution   the algorithm per shape by measurement (caffepy/autotune.py): GEMM over the
                  pixels (pointwise: no im2col, a strided one takes its pixels first; else
                  im2col in runs of kw * C floats), Winograd
                  F(m, r) for stride-1 3x3 and 5x5 kernels (cext/winograd.pyx), direct
                  depthwise (group = channels), or direct for few input channels
                  (cext/nhwc_direct.h), all in caffepy/layers/conv_algorithms.py;
                  `layer.algorithm` names the one chosen
    Pooling       MAX (one top) and AVE, global too
    BatchNorm     batch statistics (train; Intel's statistics groups) and global statistics,
                  Intel's fused ReLU
    Scale, Bias   a learned per-channel scale (and bias) / bias
    Concat        along channels
    LRN           ACROSS_CHANNELS
The layout-agnostic plain layers (ReLU and the other neurons, Split, Eltwise, Dropout, Silence)
run on it as they are. All compute Caffe's numbers up to float rounding.
"""
import numpy as np

from .. import autotune, geometry, memory, precision, quantization
from ..blob import CHANNELS_LAST, Seen
from ..errors import CaffepyError, ShapeError
from ..layer import NHWC, OWN, Layer, register
from ..proto import caffe_pb2
from .common import Bias, Concat, Scale, param_wanted
from .conv_algorithms import (DIRECT_MAX_TAPS, DIRECT_RULE_TAPS, WINOGRAD_TILES, Depthwise, Direct,
                              Gemm, Winograd, channel_sums, kernels_built, winograd_tile)
from .normalization import LRN, BatchNorm, kept_buffer
from .vision import Convolution, Pooling

try:
    from ..kernels import nhwc as _k
except ImportError:     # reported when a channels-last layer is built, not at import
    _k = None

TRAIN = caffe_pb2.TRAIN
PASSES = ("forward", "weights", "data")     # what a Convolution chooses an algorithm for
_EMPTY = np.zeros(0, np.float32)
_EMPTY2 = np.zeros((0, 0), np.float32)


def _kernels(layer):
    if _k is None:
        raise layer.error("type", "needs the compiled kernels (caffepy.kernels.nhwc), which are "
                          "not built", hint="Run `make install`", cls=CaffepyError)
    return _k


def _workspace(name, shape, dtype=np.float32):
    """Scratch shared by the channels-last layers (they run one at a time)."""
    return memory.grown(_WORKSPACE, (name, dtype), shape, dtype, _WORKSPACE_VIEWS)


_WORKSPACE, _WORKSPACE_VIEWS = {}, {}


def nhwc_top(top, shape):
    """Shape `top` (Caffe's N, C, H, W) in the channels-last layout."""
    top.reshape(shape)
    if top.layout != CHANNELS_LAST:
        top.layout = CHANNELS_LAST


def rows(blob, diff=False):
    """A channels-last blob as its [N * H * W, C] matrix of pixels (data or diff)."""
    raw = blob.raw_diff if diff else blob.raw_data
    return raw.reshape(-1, blob.shape[1])


def _four_axes(request):
    return all(b.num_axes == 4 for b in request.bottoms)


# ---------------------------------------------------------------------------------------------
# Pack / Unpack

@register
class NHWCPack(Layer):
    """NCHW -> channels-last; backward the other way. The layout plan inserts it where a
    channels-last region starts (caffepy/layout_plan.py); no parameters."""
    reshape_from_shapes = True
    exact_bottoms = exact_tops = 1
    layout = OWN

    def setup(self, bottom, top):
        _kernels(self)
        if top[0] is bottom[0]:
            raise self.error("top", "NHWCPack cannot run in place", f"'{bottom[0].name}'")

    def reshape(self, bottom, top):
        b = bottom[0]
        if b.layout is not None or b.num_axes != 4:
            raise self.error("bottom[0]", "needs a plain 4-axis (N, C, H, W) blob",
                             f"{b.shape} {b.layout or ''}".strip(), cls=ShapeError)
        nhwc_top(top[0], b.shape)

    def forward(self, bottom, top):
        _k.pack(bottom[0].data, top[0].raw_data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            _k.unpack(top[0].raw_diff, bottom[0].diff)


@register
class NHWCUnpack(Layer):
    """Channels-last -> NCHW; backward the other way (where a channels-last region ends)."""
    reshape_from_shapes = True
    exact_bottoms = exact_tops = 1
    layout = OWN

    def setup(self, bottom, top):
        _kernels(self)
        if top[0] is bottom[0]:
            raise self.error("top", "NHWCUnpack cannot run in place", f"'{bottom[0].name}'")

    def reshape(self, bottom, top):
        b = bottom[0]
        if b.layout != CHANNELS_LAST:
            raise self.error("bottom[0]", "needs a channels-last blob", b.layout, cls=ShapeError)
        top[0].reshape(b.shape)
        top[0].layout = None

    def forward(self, bottom, top):
        _k.unpack(bottom[0].raw_data, top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            _k.pack(top[0].diff, bottom[0].raw_diff)


# ---------------------------------------------------------------------------------------------
# Convolution

@register(variant=NHWC)
class NHWCConvolution(Convolution):
    """Convolution on channels-last blobs: Caffe's fields and blobs (the plain Convolution's
    setup), the algorithm chosen per shape (see the module docstring; `engine: CAFFE` keeps a
    layer off this path altogether), Intel's fused ReLU and SUM as the plain one's."""
    type = "Convolution"
    layout = NHWC
    fuses = frozenset({"Convolution+BatchNorm(+Scale)(+ReLU)",
                       "Convolution+BatchNorm(+Scale)+Eltwise+ReLU(+Split)"})
    winograd_kept = None        # a TEST net's Winograd U (conv_algorithms.winograd_weights)

    @classmethod
    def fits(cls, request):
        """Whether the request's bottoms are 4-axis blobs convolved along axis 1."""
        return _four_axes(request) and request.param.convolution_param.axis in (1, -3)

    @classmethod
    def wanted(cls, request):
        # int8 layers join the channels-last region where their kernels have it (quantization.py);
        # bf16 ones run BF16NHWCConvolution where it is wanted, else in NCHW (layers/bf16.py)
        return (cls.fits(request) and precision.current() != precision.BF16
                and (not quantization.quantized(request.param, request.phase, request.net,
                                                request.source)
                     or quantization.channels_last(request.param, request.bottoms[0].shape[1])))

    def setup(self, bottom, top):
        _kernels(self)
        super().setup(bottom, top)
        self.oh = self.ow = None
        self.algorithm = None
        self._tuned_for = None

    def _candidates(self, n, h, w):
        """{name: algorithm} that can run this shape, and the rule's choice among them."""
        (kh, kw), _, stride, dilation = self.window
        cg, og = self.channels // self.group, self.num_output // self.group
        found = {}
        gemm = Gemm(self, n, h, w)
        found[gemm.name] = gemm
        default = gemm.name
        # not for a strided pointwise convolution: alone, direct and the strided GEMM run alike
        # there (16 x 512 x 28 x 28 -> 256, stride 2: 6.0-6.3 ms each), but inside
        # ResNet-50 a trial chose direct for two such layers, which then ran 1.6-2.6x slower
        # than the strided GEMM (res4a_branch2a 9.3 vs 5.8 ms, res5a_branch1 50.3 vs 19.4 ms).
        # The cause is not found; the GEMM is the steadier.
        if self.group == 1 and self.channels * kh * kw <= DIRECT_MAX_TAPS and not gemm.stride:
            found["direct"] = Direct(self, n, h, w, gemm)
            if self.channels * kh * kw <= DIRECT_RULE_TAPS and not gemm.direct:
                default = "direct"
        if self.group == self.channels == self.num_output and self.group > 1:
            found["depthwise"] = Depthwise(self, n, h, w)
            default = "depthwise"
        if kh == kw and kh in WINOGRAD_TILES and stride == (1, 1) and dilation == (1, 1) \
                and min(cg, og) >= 4 and kernels_built():
            for m in WINOGRAD_TILES[kh]:
                algo = Winograd(self, n, h, w, m)
                found[algo.name] = algo
            if min(cg, og) >= 16:
                default = f"winograd F({winograd_tile(kh, self.oh, self.ow)},{kh})"
        return found, default

    def reshape(self, bottom, top):
        first = bottom[0].shape
        inputs = bottom[:len(top)]          # a SUM_FUSION's summand aside
        for i, b in enumerate(inputs):
            if b.num_axes != 4 or b.shape[1] != self.channels or b.shape != first:
                raise self.error(f"bottom[{i}]", f"needs shape {first} with {self.channels} channels",
                                 b.shape, cls=ShapeError)
        n, _, h, w = first
        self.oh, self.ow = self.output_size(h, w)
        for t in top:
            nhwc_top(t, (n, self.num_output, self.oh, self.ow))
        if self.fused is not None:
            self.fused.reshape(self, bottom, top)
        if self._tuned_for != first:
            self._tuned_for = first
            self._choose(inputs, top, n, h, w)

    def _choose(self, bottom, top, n, h, w):
        """An algorithm per pass (forward; weight and bias gradients; data gradient), each by
        measurement: the fastest weight gradient is often not the fastest forward's."""
        found, default = self._candidates(n, h, w)
        need_x = autotune.trial_propagate_down(self, bottom)
        passes = ["forward"]
        if self.phase == TRAIN:
            passes += ["weights"] + (["data"] if any(need_x) else [])
        (kh, kw), (ph, pw), (sh, sw), (dh, dw) = self.window
        def key_at(batches):
            return (f"Convolution {batches}x{self.channels}x{h}x{w} -> {self.num_output} "
                    f"k{kh}x{kw} s{sh}x{sw} p{ph}x{pw} d{dh}x{dw} g{self.group}"
                    f"{' b' if self.bias_term else ''}")
        key, kin = key_at(autotune.batch_class(n)), autotune.kin_keys(n, key_at)
        chosen, tunings = {}, {}
        for name in passes:
            # the direct algorithm's data gradient is the GEMM's: no candidate of its own
            trials = {a: self._trial(algo, name, bottom, top, need_x) for a, algo in found.items()
                      if not (name == "data" and a == "direct")}
            rule = default if default in trials else next(iter(trials))
            chosen[name] = autotune.choose(self, f"{key} {name}", trials, rule, _k.max_threads(),
                                           kin=[f"{k} {name}" for k in kin])
            tunings[name] = self.tuning
        if "data" in chosen and chosen["weights"] != chosen["data"]:
            one = self._one_backward(found, chosen["weights"], chosen["data"], bottom, top,
                                     need_x, key)
            if one is not None:
                chosen["weights"] = chosen["data"] = one
                tunings["weights"] = tunings["data"] = self.tuning
        for name in PASSES:             # a pass not measured (TEST; no data gradient wanted)
            chosen.setdefault(name, chosen["forward"])
        self.algorithms = found
        self._use({name: found[a] for name, a in chosen.items()}, tunings)

    def _one_backward(self, found, weights, data, bottom, top, need_x, key):
        """Whether the weight and data gradients, chosen apart, run faster as they are or both
        by one of the two algorithms: one algorithm's backward computes both from shared work
        (Winograd transforms dy once), which the passes' separate trials cannot see (ResNet-50's
        res2 3x3: F(5,3) weights + F(4,3) data, each first by 1%, took 22.6 ms; F(4,3) for both
        16.8). Returns the name to run both with, or None to keep them apart."""
        def both(algo):
            return autotune.keeping_diffs(
                self, lambda: algo.backward(top, need_x, bottom, True, self.bias_term))

        def apart():
            self._pass(found[weights], "weights", bottom, top, need_x)()
            self._pass(found[data], "data", bottom, top, need_x)()

        trials = {"apart": autotune.keeping_diffs(self, apart)}
        trials.update({a: both(found[a]) for a in (weights, data) if a != "direct"})
        choice = autotune.choose(self, f"{key} backward {weights} + {data}", trials, "apart",
                                 _k.max_threads())
        return None if choice == "apart" else choice

    def _use(self, algos, tunings):
        """Run pass -> algorithm `algos`; name them (one name when one algorithm runs them all);
        `pass_tiles`: pass -> the Winograd tile it runs (None: not Winograd)."""
        self.algos = algos
        self.pass_tiles = {name: algo.m if isinstance(algo, Winograd) else None
                           for name, algo in algos.items()}
        self.algorithm, self.tuning = autotune.describe(
            {name: algos[name].name for name in PASSES}, tunings)

    def force_algorithm(self, name):
        """Run algorithm `name` (a key of `self.algorithms`, the candidates for the current
        shape) for every pass instead of the chosen ones, until the shape changes: tests and
        benchmarks."""
        if name not in self.algorithms:
            raise self.error("convolution_param", f"no algorithm '{name}' for this shape", name,
                             hint=f"Candidates: {', '.join(self.algorithms)}")
        self._use(dict.fromkeys(PASSES, self.algorithms[name]), {"forward": "forced"})

    def _trial(self, algo, name, bottom, top, need_x):
        """A function running pass `name` of `algo` for timing (parameter diffs restored)."""
        run = self._pass(algo, name, bottom, top, need_x)
        return run if name == "forward" else autotune.keeping_diffs(self, run)

    def _pass(self, algo, name, bottom, top, need_x):
        """A function running pass `name` (one of PASSES) of `algo` alone."""
        if name == "forward":
            return lambda: algo.forward(bottom, top)
        if name == "weights":
            return lambda: algo.backward(top, [False] * len(bottom), bottom, True, self.bias_term)
        return lambda: algo.backward(top, need_x, bottom, False, False)

    def forward(self, bottom, top):
        self.algos["forward"].forward(bottom, top)
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def forward_folded(self, bottom, top, bn, scale=None, relu=False, add=None, out=None):
        """This layer's forward with the BatchNorm `bn` (global statistics, in place on the top;
        None: none), the Scale `scale` after it (in place too, or None) and, with `relu`, a
        ReLU after them, as a TEST net's unit runs it (caffepy/net_rules.py). An algorithm with
        an epilogue (has_epilogue) applies them per output channel to the rows its GEMMs just
        wrote, and adds the blob `add` (an Eltwise SUM's other bottom; only with an epilogue)
        before the ReLU; another computes with the BatchNorm and Scale folded into its weights
        and bias, and the ReLU is left to the caller (returns False; True when it ran) unless
        the algorithm `fuses_relu`. `out`: the array to write in place of the top's (see
        writes_slice)."""
        algo = self.algos["forward"]
        if self.has_epilogue():
            if bn is None:
                s, t = None, self.blobs[1].read_data if self.bias_term else None
            else:
                if self._affine is None:
                    self._affine = Folded(weights=False)
                s, t = self._affine.params(self, bn, scale)
            algo.forward(bottom, top, epilogue=(s, t, relu, add), **_out(out))
            return True
        assert add is None, "a sum needs an epilogue"
        if self._folded is None:
            self._folded = Folded(weights=True)
        params = self._folded.params(self, bn, scale)
        if relu and getattr(algo, "fuses_relu", False):
            algo.forward(bottom, top, params, relu=True, **_out(out))
            return True
        algo.forward(bottom, top, params, **_out(out))
        return not relu

    def forward_relu(self, bottom, top, out=None):
        """This layer's forward with a ReLU (no slope) in place after it, taken into the
        algorithm's stores where it `fuses_relu` (True: done); False: nothing ran. `out` as in
        forward_folded."""
        algo = self.algos["forward"]
        if self.fused is not None or not getattr(algo, "fuses_relu", False):
            return False
        algo.forward(bottom, top, relu=True, **_out(out))
        return True

    def writes_slice(self, relu):
        """Whether a TEST unit's forward (forward_folded or forward_relu, with a ReLU of no
        slope if `relu`) can write its output into `out`, a run of a wider channels-last
        blob's channels, with nothing left to run on the top after it."""
        algo = self.algos["forward"]
        return (self.fused is None and getattr(algo, "writes_slices", False)
                and (not relu or self.has_epilogue() or getattr(algo, "fuses_relu", False)))

    def has_epilogue(self):
        """Whether the forward's algorithm applies a per-channel scale, bias and ReLU to its
        output as it writes it (Gemm)."""
        return getattr(self.algos["forward"], "epilogue", False)

    def adds_in_place(self):
        """Whether the forward's algorithm may write its output over the epilogue's add (a
        block end's sum over its shortcut: caffepy/net_memory.py)."""
        algo = self.algos["forward"]
        return getattr(algo, "adds_in_place", None) is not None and algo.adds_in_place()

    _folded = _affine = None

    def backward(self, top, propagate_down, bottom):
        if self.fused is not None:
            top, propagate_down, bottom = self.fused.backward(top, propagate_down, bottom)
        need_w = param_wanted(self, 0)
        need_b = self.bias_term and param_wanted(self, 1)
        weights, data = self.algos["weights"], self.algos["data"]
        if any(propagate_down) and weights is data:
            weights.backward(top, propagate_down, bottom, need_w, need_b)
            return
        if need_w or need_b:
            weights.backward(top, [False] * len(bottom), bottom, need_w, need_b)
        if any(propagate_down):
            data.backward(top, propagate_down, bottom, False, False)


def _out(out):
    """The keyword that hands an algorithm's forward its output array, if there is one (an
    algorithm that does not write slices takes no such keyword)."""
    return {} if out is None else {"out": out}


def batchnorm_affine(bias, mean, var, eps, gamma=None, beta=None):
    """(s, t) float32 per channel such that conv * s + t is a convolution's output (bias: its
    bias, or None) through y = (x - mean) / sqrt(var + eps) (BatchNorm, its statistics already
    divided by their factor) and y * gamma + beta (Scale; None: 1 and 0): s = gamma /
    sqrt(var + eps), t = (bias - mean) * s + beta; in float64, rounded once. Also the float64 s."""
    s = 1.0 / np.sqrt(np.asarray(var, np.float64) + eps)
    if gamma is not None:
        s = s * gamma
    t = -np.asarray(mean, np.float64) if bias is None else bias - np.asarray(mean, np.float64)
    t = t * s + (0.0 if beta is None else beta)
    return s.astype(np.float32), t.astype(np.float32), s


def fold_batchnorm(weights, bias, mean, var, eps, gamma=None, beta=None):
    """(weights, bias) of one convolution computing what the convolution (weights, bias) then
    the BatchNorm and Scale of batchnorm_affine compute: W'[o] = W[o] * s[o], b' = t."""
    _, t, s = batchnorm_affine(bias, mean, var, eps, gamma, beta)
    w = weights.astype(np.float64) * s.reshape((-1,) + (1,) * (weights.ndim - 1))
    return w.astype(np.float32), t


class Folded:
    """A convolution's BatchNorm and Scale (a TEST net's unit) as its algorithm takes them:
    folded into the weights and bias (`weights`: fold_batchnorm), or as the per-channel (s, t)
    of an epilogue (batchnorm_affine), recomputed when a blob they come from may have changed
    (blob.Seen; the weights only when they are folded). What it returns is read-only, so that
    the algorithm's own Seen knows it by identity.
    """

    def __init__(self, weights):
        self.weights = weights
        self.seen = Seen()
        self.folded = self.eps = None

    def params(self, conv, bn, scale):
        sources = [conv.blobs[1] if conv.bias_term else None, *bn.blobs[:3],
                   scale.blobs[0] if scale is not None else None,
                   scale.blobs[1] if scale is not None and scale.bias_term else None]
        if self.weights:
            sources.append(conv.blobs[0])
        # the check before any array of theirs is taken (conv_algorithms.weight_source)
        if bn.eps != self.eps or self.seen.changed(*sources):
            gamma = beta = None
            if scale is not None:
                gamma = scale.blobs[0].read_data
                beta = scale.blobs[1].read_data if scale.bias_term else None
            bias = conv.blobs[1].read_data if conv.bias_term else None
            factor = float(bn.blobs[2].read_data[0])
            factor = 0.0 if factor == 0 else 1.0 / factor
            stats = (bn.blobs[0].read_data.astype(np.float64) * factor,
                     bn.blobs[1].read_data.astype(np.float64) * factor, bn.eps, gamma, beta)
            if self.weights:
                self.folded = fold_batchnorm(conv.blobs[0].read_data, bias, *stats)
            else:
                self.folded = batchnorm_affine(bias, *stats)[:2]
            for a in self.folded:       # never written: blob.Seen knows them by identity
                a.flags.writeable = False
            del gamma, beta, bias, stats
            self.seen.keep(*sources)
            self.eps = bn.eps
        return self.folded


# ---------------------------------------------------------------------------------------------
# Pooling

@register(variant=NHWC)
class NHWCPooling(Pooling):
    """MAX (without the mask top) or AVE pooling on channels-last blobs; windows and sizes as
    the plain Pooling's (caffepy.geometry). A TEST net's MAX forward writes the maxima alone,
    not the argmax the backward routes the gradient by (as many int32 as the top has floats,
    and a blend of positions per compare: GoogLeNet b16's 14 pooling layers took 20 ms); a
    backward through it (pycaffe's net.backward on a TEST net) first finds the argmax in the
    bottom, which no layer of a deploy net writes after the pooling has read it."""
    type = "Pooling"
    layout = NHWC

    @classmethod
    def wanted(cls, request):
        p = request.param.pooling_param
        return _four_axes(request) and len(request.param.top) == 1 and p.pool in (p.MAX, p.AVE)

    def setup(self, bottom, top):
        _kernels(self)
        super().setup(bottom, top)

    def reshape(self, bottom, top):
        n, c, h, w = bottom[0].shape
        self.window = self.window_param.sized(h, w)
        self.kernel, self.pad, self.stride, _ = self.window
        oh, ow = geometry.pool_output(self, self.window, h, w, self.ceil)
        nhwc_top(top[0], (n, c, oh, ow))
        if self.phase != caffe_pb2.TEST:
            self._mask_for(top[0])
        ratio = geometry.pool_pad_ratio(self.param.pooling_param, self.window, h, w, oh, ow)
        self.pad_ratio = None if ratio is None else ratio[:, :, None].astype(np.float32)

    def _args(self):
        return (*self.kernel, *self.stride, *self.pad)

    _masked = False         # whether self.mask holds the last forward's argmax

    def _mask_for(self, y):
        """self.mask, shaped as y's channels-last array (a TEST net's only once a backward
        wants it: VGG-16 b16's would hold 98 MB)."""
        n, c, oh, ow = y.shape
        shape = (n, oh, ow, c)
        if self.pool == caffe_pb2.PoolingParameter.MAX and (self.mask is None
                                                             or self.mask.shape != shape):
            self.mask = np.empty(shape, np.int32)
            self._masked = False
        return self.mask

    # net_rules.byte_tops: a TEST net's MAX pooling between int8 layers, which pools their 8-bit
    # tops as bytes (quantization.Bytes) when its bottom holds them
    byte_pool = False
    byte_isa = None         # the int8 path of the bytes it pools (net_rules.byte_tops)
    _bytes = None

    def forward(self, bottom, top):
        held = bottom[0].held() if self.byte_pool else None
        if isinstance(held, quantization.Bytes):
            n, c, oh, ow = top[0].shape
            out = self._bytes = quantization.Bytes.reused(self._bytes, (n, oh, ow, c), -held.zp,
                                                          held.scale)
            quantization.kernels().pool_max_bytes(held, out, self.kernel, self.stride, self.pad,
                                                  self.byte_isa)
            top[0].overwrite()
            top[0].hold(out)
            return
        if self.pool == caffe_pb2.PoolingParameter.MAX:
            self._masked = self.phase != caffe_pb2.TEST
            _k.pool_max_forward(bottom[0].raw_data, top[0].raw_data,
                                self.mask if self._masked else None, *self._args())
        else:
            _k.pool_ave_forward(bottom[0].raw_data, top[0].raw_data, *self._args())
            if self.pad_ratio is not None:
                top[0].raw_data[...] *= self.pad_ratio

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].raw_diff
        if self.pool == caffe_pb2.PoolingParameter.MAX:
            if not self._masked:
                _k.pool_max_forward(bottom[0].raw_data, _workspace("pool_y", dy.shape),
                                    self._mask_for(top[0]), *self._args())
                self._masked = True
            _k.pool_max_backward(dy, self.mask, bottom[0].raw_diff)
            return
        if self.pad_ratio is not None:
            dy = _workspace("pool_dy", dy.shape)
            np.multiply(top[0].raw_diff, self.pad_ratio, out=dy)
        _k.pool_ave_backward(dy, bottom[0].raw_diff, *self._args())


# ---------------------------------------------------------------------------------------------
# Per-channel layers over the [N * H * W, C] matrix of pixels

def _reduce(a, b=None, shift=None, relu=None):
    """Per-channel float64 sums of a [M, C]: (sum a, sum a * b) (a through a fused ReLU's
    gradient if relu: nhwc.channel_dots), or with `shift` the moments (sum a - shift,
    sum (a - shift)^2)."""
    c = a.shape[1]
    threads = _k.max_threads()
    work = _workspace("reduce_work", (threads, 2 * c))
    partial = _workspace("reduce_partial", (threads, 2 * c), np.float64)
    s1, s2 = np.empty(c), np.empty(c)
    if b is None:
        _k.channel_moments(a, shift, s1, s2, work, partial)
    else:
        _k.channel_dots(a, b, s1, s2, work, partial, relu)
    return s1, s2


@register(variant=NHWC)
class NHWCBatchNorm(BatchNorm):
    """BatchNorm on channels-last blobs (the plain layer's fields, blobs, statistics groups,
    updates and fused ReLU): batch moments of each group (a run of its images' pixels) in one
    pass from a shift (the group's first pixel's values, so the variance keeps its precision),
    then y = (x - mean) / sqrt(var + eps), and max(y, 0) with relu."""
    type = "BatchNorm"
    layout = NHWC
    fuses = frozenset({"BatchNorm+Scale(+ReLU)", "Convolution+BatchNorm(+Scale)(+ReLU)",
                       "Convolution+BatchNorm(+Scale)+Eltwise+ReLU(+Split)"})

    @classmethod
    def wanted(cls, request):
        return _four_axes(request)

    def setup(self, bottom, top):
        _kernels(self)
        super().setup(bottom, top)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if top[0] is not bottom[0]:
            nhwc_top(top[0], bottom[0].shape)

    def _statistics(self, x):
        """Per group, the mean and 1/std to normalize x [M, C] with ([G, C] float32; one row
        from the stored statistics), the running statistics updated when they come from the
        batch; also kept as self.inv_std."""
        if self.use_global_stats:
            mean, inv = self.global_statistics()
            self.inv_std = inv[None]
            return mean[None], self.inv_std
        c = x.shape[1]
        means = np.empty((self.groups, c), np.float32)
        self.inv_std = np.empty((self.groups, c), np.float32)
        for g, r in enumerate(self.group_rows()):
            xg = x[r]
            m = xg.shape[0]
            shift = xg[0].copy() if m else np.zeros(c, np.float32)
            s1, s2 = _reduce(xg, shift=shift)
            d = s1 / max(m, 1)
            mean = shift + d
            var = np.maximum(s2 / max(m, 1) - d * d, 0.0)
            self.inv_std[g] = 1.0 / np.sqrt(var + self.eps)
            means[g] = mean
            self.update_statistics(mean, var, m)
        return means, self.inv_std

    def _relu_args(self):
        """The kernels' fused ReLU (gamma, beta, slope) that is this layer's own: max(xn, 0)."""
        c = self.dims[1]
        return np.ones(c, np.float32), np.zeros(c, np.float32), 0.0

    def group_rows(self):
        """The statistics groups as row slices of the [N * H * W, C] pixels (one slice of all
        of them with global statistics): row g of inv_std belongs to slice g."""
        return [slice(None)] if self.use_global_stats else self.group_slices(self.dims[2])

    def forward(self, bottom, top):
        x, y = rows(bottom[0]), rows(top[0])
        means, inv = self._statistics(x)
        if self.use_global_stats and not self.relu:
            _k.channel_affine(x, means[0], inv[0], _EMPTY, y, _EMPTY2)
            self.x_norm = None
            return
        self.x_norm = kept_buffer(self, "_x_norm_buf", x.shape)
        for g, r in enumerate(self.group_rows()):
            if self.relu:
                ones, zeros, slope = self._relu_args()
                _k.bn_scale_forward(x[r], means[g], inv[g], ones, zeros, y[r], self.x_norm[r], slope)
            else:
                _k.channel_affine(x[r], means[g], inv[g], _EMPTY, y[r], self.x_norm[r], True)

    def forward_with_scale(self, bottom, top, scale, relu=None):
        """This layer's forward and that of `scale` (an NHWCScale working in place on this
        layer's top, see Net.fusions), and of `relu` (a ReLU in place after it) if given, in one
        pass per statistics group: the top gets the last one's output, the normalized values
        stay in x_norm for the backward (NHWCScale.backward_with_bn). Not for a layer with its
        own ReLU (the Net does not fuse it): that one comes before the Scale."""
        x, y = rows(bottom[0]), rows(top[0])
        means, inv = self._statistics(x)
        self.x_norm = kept_buffer(self, "_x_norm_buf", x.shape)
        gamma = scale.blobs[0].data
        beta = scale.blobs[1].data if scale.bias_term else np.zeros_like(gamma)
        for g, r in enumerate(self.group_rows()):
            _k.bn_scale_forward(x[r], means[g], inv[g], gamma, beta, y[r], self.x_norm[r],
                                None if relu is None else relu.slope)
        scale.fused_input = self.x_norm

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = rows(top[0], diff=True), rows(bottom[0], diff=True)
        relu = self._relu_args() if self.relu else None
        if self.use_global_stats:
            inv = self.inv_std[0]
            zero = np.zeros_like(inv)
            if relu is None:
                _k.channel_affine(dy, zero, inv, _EMPTY, dx, _EMPTY2)
            else:
                _k.bn_backward_apply(dy, self.x_norm, inv, zero, zero, dx, relu)
            return
        for g, r in enumerate(self.group_rows()):
            inv = self.inv_std[g]
            m = max(dy[r].shape[0], 1)
            sa, sab = _reduce(dy[r], self.x_norm[r], relu=relu)
            q = (-inv * sab / m).astype(np.float32)
            b = (-inv * sa / m).astype(np.float32)
            _k.bn_backward_apply(dy[r], self.x_norm[r], inv, q, b, dx[r], relu)


class _PerChannel:
    """What NHWCScale and NHWCBias share: a learned per-channel blob over a 4-axis bottom (one
    bottom, axis 1, num_axes 1; `param_field` names the layer's *_param), a channels-last top."""
    param_field = None

    @classmethod
    def wanted(cls, request):
        p = getattr(request.param, cls.param_field)
        return (_four_axes(request) and len(request.bottoms) == 1 and p.axis in (1, -3)
                and p.num_axes == 1)

    def setup(self, bottom, top):
        _kernels(self)
        super().setup(bottom, top)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if top[0] is not bottom[0]:
            nhwc_top(top[0], bottom[0].shape)


@register(variant=NHWC)
class NHWCScale(_PerChannel, Scale):
    """Scale with a learned per-channel scale (and bias) on channels-last blobs: y = x * s + b."""
    type = "Scale"
    layout = NHWC
    param_field = "scale_param"
    fuses = frozenset({"BatchNorm+Scale(+ReLU)", "Convolution+BatchNorm(+Scale)(+ReLU)",
                       "Convolution+BatchNorm(+Scale)+Eltwise+ReLU(+Split)"})

    fused_input = None      # the BatchNorm's x_norm when the last forward was fused with it

    def forward(self, bottom, top):
        x, y = rows(bottom[0]), rows(top[0])
        keep = kept_buffer(self, "_saved_rows", x.shape) if top[0] is bottom[0] else _EMPTY2
        add = self.blobs[1].data if self.bias_term else np.zeros(x.shape[1], np.float32)
        _k.channel_affine(x, _EMPTY, self.blobs[0].data, add, y, keep)
        self.fused_input = None

    def _input(self, top, bottom, shape):
        """The bottom's values of the last forward (an in-place layer overwrote them)."""
        if self.fused_input is not None:
            return self.fused_input
        if top[0] is bottom[0]:
            return self._saved_rows[:int(np.prod(shape))].reshape(shape)
        return rows(bottom[0])

    def _param_grads(self, sums, dots):
        """Add the scale and bias gradients from the per-channel sums of dy and of dy * x."""
        if self.bias_term and param_wanted(self, 1):
            self.blobs[1].diff[...] += sums
        if param_wanted(self, 0):
            self.blobs[0].diff[...] += dots

    def backward_with_bn(self, top, bn, bn_bottom, bn_propagate, relu=None):
        """This layer's backward and that of the BatchNorm `bn` whose forward it was fused with
        (forward_with_scale), and of the fused `relu` if given (top is then the ReLU's), from
        one reduction per statistics group: with dxn = gamma * dy, BatchNorm's sums are
        gamma * sum dy and gamma * sum dy * xn; the Scale's gradients are those sums over the
        groups; the ReLU's gradient is taken on the way, its input recomputed from xn. The
        BatchNorm's bottom diff (if bn_propagate) is written here; the Net then skips the
        other layers' own backward."""
        dy = rows(top[0], diff=True)
        xn = self.fused_input
        gamma = self.blobs[0].data
        fused = None
        if relu is not None:
            beta = self.blobs[1].data if self.bias_term else np.zeros_like(gamma)
            fused = (gamma, beta, relu.slope)
        groups = bn.group_rows()
        reduced = [_reduce(dy[r], xn[r], relu=fused) for r in groups]
        self._param_grads(sum(s for s, _ in reduced), sum(d for _, d in reduced))
        if not bn_propagate:
            return
        dx = rows(bn_bottom, diff=True)
        if bn.use_global_stats:
            p = (bn.inv_std[0].astype(np.float64) * gamma).astype(np.float32)
            zero = np.zeros(len(p), np.float32)
            if fused is None:
                _k.channel_affine(dy, zero, p, _EMPTY, dx, _EMPTY2)
            else:
                _k.bn_backward_apply(dy, xn, p, zero, zero, dx, fused)
            return
        for r, (sums, dots), inv in zip(groups, reduced, bn.inv_std):
            p = inv.astype(np.float64) * gamma       # d x / d dy: gamma / std
            m = max(dy[r].shape[0], 1)
            _k.bn_backward_apply(dy[r], xn[r], p.astype(np.float32),
                                 (-p * dots / m).astype(np.float32),
                                 (-p * sums / m).astype(np.float32), dx[r], fused)

    def backward(self, top, propagate_down, bottom):
        dy = rows(top[0], diff=True)
        want_scale = param_wanted(self, 0)
        want_bias = self.bias_term and param_wanted(self, 1)
        if want_scale or want_bias:
            self._param_grads(*_reduce(dy, self._input(top, bottom, dy.shape)))
        if propagate_down[0]:
            scale = self.blobs[0].data
            _k.channel_affine(dy, np.zeros_like(scale), scale, _EMPTY, rows(bottom[0], diff=True), _EMPTY2)


@register(variant=NHWC)
class NHWCBias(_PerChannel, Bias):
    """Bias with a learned per-channel bias on channels-last blobs: y = x + b."""
    type = "Bias"
    layout = NHWC
    param_field = "bias_param"

    def forward(self, bottom, top):
        x = rows(bottom[0])
        _k.channel_affine(x, _EMPTY, np.ones(x.shape[1], np.float32), self.blobs[0].data,
                          rows(top[0]), _EMPTY2)

    def backward(self, top, propagate_down, bottom):
        dy = rows(top[0], diff=True)
        if param_wanted(self, 0):
            self.blobs[0].diff[...] += channel_sums(dy)
        if propagate_down[0] and bottom[0] is not top[0]:
            np.copyto(rows(bottom[0], diff=True), dy)


@register(variant=NHWC)
class NHWCConcat(Concat):
    """Concat of channels-last blobs along channels: each pixel's channels are the bottoms'
    runs in order. In a TEST net the convolution units that feed it may write their runs
    straight into its top (net_rules.ConcatSlot): `placed[j]` says that bottom j's run is in
    place for this forward, which then copies only the others."""
    type = "Concat"
    layout = NHWC
    placed = None
    # net_rules.byte_tops: a TEST net's concat of int8 layers' 8-bit tops of one scale, which
    # concatenates their bytes (quantization.Bytes) when every bottom holds them; the int8
    # units whose top only it reads write their bytes into its own (slot_bytes), not copied
    byte_concat = False
    _bytes = None

    def top_bytes(self, top, lo, scale):
        """This concat's Bytes for `top` (its top blob) of 8-bit range lo and scale, kept from
        forward to forward."""
        n, c, height, width = top.shape
        self._bytes = quantization.Bytes.reused(self._bytes, (n, height, width, c), lo, scale)
        return self._bytes

    def slot_bytes(self, top, j, lo, scale):
        """Bottom j's channels of top_bytes: where bottom j's unit writes its bytes."""
        lo_j, hi_j = self.runs[j]
        return quantization.Bytes.slot(self.top_bytes(top, lo, scale), int(lo_j),
                                       int(hi_j - lo_j))

    @classmethod
    def wanted(cls, request):
        p = request.param.concat_param
        axis = p.concat_dim if p.HasField("concat_dim") and not p.HasField("axis") else p.axis
        return _four_axes(request) and axis in (1, -3) and not p.per_fla_fuse

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        nhwc_top(top[0], top[0].shape)
        bounds = np.cumsum([0] + [b.shape[1] for b in bottom])
        self.runs = list(zip(bounds[:-1], bounds[1:]))

    def forward(self, bottom, top):
        held = [b.held() for b in bottom] if self.byte_concat else [None]
        if all(isinstance(h, quantization.Bytes) and (h.scale, h.zp) == (held[0].scale, held[0].zp)
               for h in held):
            out = self.top_bytes(top[0], -held[0].zp, held[0].scale)
            quantization.kernels().concat_bytes(held, out)
            top[0].overwrite()
            top[0].hold(out)
            return
        y = rows(top[0])
        placed = self.placed
        for j, (b, (lo, hi)) in enumerate(zip(bottom, self.runs)):
            if placed is not None and placed[j]:
                placed[j] = False           # written by its unit in this forward
                continue
            _k.copy_columns(rows(b), 0, y, int(lo), int(hi - lo))

    def backward(self, top, propagate_down, bottom):
        dy = rows(top[0], diff=True)
        for b, (lo, hi), down in zip(bottom, self.runs, propagate_down):
            if down:
                _k.copy_columns(dy, int(lo), rows(b, diff=True), 0, int(hi - lo))


@register(variant=NHWC)
class NHWCLRN(LRN):
    """ACROSS_CHANNELS LRN on channels-last blobs: a pixel's channel window is contiguous.
    The backward recomputes the scale rather than keeping it."""
    type = "LRN"
    layout = NHWC

    @classmethod
    def wanted(cls, request):
        return (_four_axes(request)
                and request.param.lrn_param.norm_region == caffe_pb2.LRNParameter.ACROSS_CHANNELS)

    def setup(self, bottom, top):
        _kernels(self)
        super().setup(bottom, top)

    def reshape(self, bottom, top):
        nhwc_top(top[0], bottom[0].shape)

    def _work(self, c):
        return _workspace("lrn_work", (_k.max_threads(), _k.lrn_work_size(c, self.size)))

    def forward(self, bottom, top):
        x = rows(bottom[0])
        _k.lrn_forward(x, rows(top[0]), self.size, self.alpha, self.beta, self.k, self._work(x.shape[1]))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            x = rows(bottom[0])
            _k.lrn_backward(x, rows(top[0], diff=True), rows(bottom[0], diff=True), self.size,
                            self.alpha, self.beta, self.k, self._work(x.shape[1]))
