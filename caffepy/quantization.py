"""Intel Caffe's int8 inference: `quantization_param` on a Convolution or an InnerProduct.

Intel Caffe (its MKL-DNN layers, TEST phase only) runs such a layer on 8-bit integers after its
net compilation folded the BatchNorm and Scale after a convolution into its weights and fused
the ReLU, and the Eltwise SUM (+ ReLU) of ResNet's shortcut, into it. caffepy runs the same as
one unit of layers (net_rules.Int8Unit), in NCHW:

    xq   = saturate(rint(x * scale_in))         u8 [0, 255], or s8 [-128, 127] when
                                                is_negative_input; scale 1 when force_u8_input
    Wq   = saturate_s8(rint(W' * sp[o]))        W', b': the weights with BatchNorm and Scale
    bq   = rint(b' * scale_in * sp[o])  (int32)  folded in as Intel does (float32)
    acc  = sum xq * Wq + bq                     exact, in int32
    y    = float32(acc) * scale_out / (scale_in * sp[o])     (sp[o] = 0: y = acc * scale_out,
                                                              bq = rint(b'))
    y   += summand * scale_out                  an Eltwise SUM folded in (Intel: the summand's
                                                8-bit value times scale_out / its scale)
    y    = ReLU(y) (negative_slope)             a ReLU folded in
    top  = saturate(rint(y)) / scale_out        bw_layer_out 8: u8 after a ReLU of slope 0,
                                                else s8; bw_layer_out 32: top = y / scale_out
sp = scale_params: one value, or one per output channel. Ties round to even (rint, MKL-DNN's
round_nearest); saturation clamps before rounding. Layers without quantization_param, TRAIN
nets and `engine: CAFFE` run float32 (Intel's other engines ignore the field). Where results
may differ from Intel's: the summand is taken as float (Intel multiplies its 8-bit value by
scale_out / its scale: the same product up to float32 rounding), the bias is added in int32
(Intel adds it in float32, which rounds sums beyond 2^24), a requantization between two
layers' scales goes through float32 (x / s1 * s2, Intel's reorder: x * (s2 / s1)), and the
layers between quantized ones (pooling, concat, an unfused Eltwise) run in float32 on the
dequantized values, where Intel's 8-bit average pooling rounds its means to integers.

int8 kernels, by measurement: a channels-last 3 x 3 convolution of stride 1 (group 1) has two
that give the same integers, the direct implicit GEMM and integer Winograd F(2x2, 3x3)
(cext/int8_nhwc.h: every transform integer, 16 products per 2 x 2 outputs instead of 36); it
runs Winograd unless the direct kernel measured FALLBACK_MARGIN times faster.

Float32 fallback, by measurement (beyond Intel): a quantized convolution on the channels-last
path also has its float32 algorithms (Winograd, GEMM, direct, depthwise: the float32 layer's,
chosen per shape), and on CPUs without VNNI those can beat the int8 kernels (AVX2's vpmaddwd
makes 16 products an instruction, float32's FMA 8, but float32's Winograd F(4,3) makes a
quarter of the products and F(4,5) fewer still). So on its first forward at a shape the unit
times its int8 kernels and float32 (caffepy/autotune.py: kept per machine and shape, like the
algorithms) and runs float32 when that was at least FALLBACK_MARGIN times faster. A unit that
falls back runs as Intel Caffe runs a convolution it leaves in float32 (one without
quantization_param, as its calibrator's fallback writes it): the layers in float32 as a
float32 net's rules run them (the BatchNorm and Scale folded, the sum and the ReLU after), on
the input as the layer before wrote it (an int8 layer's top holds its dequantized 8-bit
values), and a float32 top that the next int8 layer quantizes at its own scale_in. It is then
no longer integer arithmetic, and its top differs from the int8 top by the int8 path's
roundings: with x^ the input rounded to the 8-bit grid (x itself when the layer
before is int8 at the same scale), W' and b' the folded weights and bias, for each output
    |float32 top - int8 top| <= sum |x^| * 0.5 / sp + sum |W'| * |x - x^| + 0.5 / (scale_in * sp)
                                + 0.5 / scale_out (bw_layer_out 8) + float32 rounding
(sums over the output's window: the weights', the input's and the bias's rounding, then the
output's), while y stays within the 8-bit range (the int8 top saturates, the float32 one does
not); tests/test_quantization.py checks it. `caffepy time` names each unit's path (`int8
winograd F(2,3) (avx2)`, `int8 direct (avx2)`, `float32 fallback: ...`).
Between int8 layers whose scales meet, the 8-bit tops pass as bytes (Bytes; the floats
written only where something reads them, the same values; CAFFEPY_INT8_BYTES=0 writes floats).
AVX2 on bytes, opt-in (CAFFEPY_INT8_ISA=avx2bytes; cext/int8_avxvnni.h): the byte paths' kernels
with AVX2's vpmaddubsw for the products, which sums each pair of u8 x s8 products into int16
with saturation. To keep every sum exact its weights are quantized at half the scale,
Wq = saturate(rint(W' * sp / 2)) in [-64, 64] (with mult and bq at sp / 2), as MKL-DNN quantizes
them on CPUs without VNNI: exact integer arithmetic again, but of weights with one bit fewer, so
not the other paths' bits (benchmarks/bench_int8.py measures what it costs in accuracy).
CAFFEPY_INT8_FALLBACK=0 keeps every quantized layer on 8-bit integers, by rule (Winograd where
it applies, no measurement; as does CAFFEPY_AUTOTUNE=0: measuring off), and is the default on
the VNNI and AMX paths (fallback_enabled says why; CAFFEPY_INT8_FALLBACK=1 measures); the NCHW int8
convolutions (grouped ones other than depthwise) and the InnerProducts always run int8.
"""
import functools
import math

import numpy as np

from .blob import Seen
from .engine import caffe_engine
from .proto import caffe_pb2

U8 = (0.0, 255.0)
S8 = (-128.0, 127.0)
INT32_FLOAT_MAX = 2147483520.0      # the largest float32 below 2^31
_kernels = None


def kernels():
    """caffepy.kernels.int8, imported when first needed."""
    global _kernels
    if _kernels is None:
        from .kernels import int8
        _kernels = int8
    return _kernels


def isa():
    """The ISA the int8 kernels run here ('amx', 'vnni', 'avxvnni', 'avx2' or 'generic': the
    best the CPU has); CAFFEPY_INT8_ISA names another this CPU has to run instead (generic: the
    portable C; the same integers on every path)."""
    import os
    k = kernels()
    wanted = os.environ.get("CAFFEPY_INT8_ISA", "")
    return wanted if wanted in k.available_isas() else k.best_isa()


# the paths that hold quantized values as bytes in quads (their products: VNNI's vpdpbusd or
# AMX's tiles, 4x AVX2's rate at least; AVX2's vpmaddubsw) and hand 8-bit tops between int8
# layers as bytes
BYTE_PATHS = ("vnni", "amx", "avxvnni", "avx2bytes")
# the paths whose weights are quantized at half the scale (7 bits: |w| <= 64), as MKL-DNN
# quantizes them on CPUs without VNNI, so that AVX2's vpmaddubsw sums exactly: opt-in only
# (CAFFEPY_INT8_ISA=avx2bytes), as its integers are not Intel Caffe's (cext/int8_avxvnni.h)
HALF_SCALE_PATHS = ("avx2bytes",)
# the byte paths with VNNI's (or AMX's) products
VNNI_PATHS = ("vnni", "amx", "avxvnni")

# what each int8 path runs, for device_query and the logs
_PATHS = {
    "amx": "AMX-INT8 tiles for the channels-last convolutions and InnerProduct, AVX2 for the rest; "
           "8-bit tops passed between int8 layers as bytes",
    "vnni": "AVX-512 VNNI for the channels-last convolutions and InnerProduct, AVX2 for the rest; "
            "8-bit tops passed between int8 layers as bytes",
    "avxvnni": "AVX-VNNI (256-bit) for the channels-last convolutions and InnerProduct, AVX2 for "
               "the rest; 8-bit tops passed between int8 layers as bytes",
    "avx2": "AVX2 (16-bit pair products)",
    "avx2bytes": "AVX2's vpmaddubsw on bytes for the channels-last convolutions and InnerProduct "
                 "with the weights quantized at half the scale (7 bits, MKL-DNN's rule without "
                 "VNNI), AVX2 for the rest; 8-bit tops passed between int8 layers as bytes",
    "generic": "portable C",
}


def describe():
    """One line: the int8 path in use, what it runs, and the others this machine has."""
    k, path = kernels(), isa()
    if path in HALF_SCALE_PATHS:
        same = "exact int32 sums of other weights: not the other paths' bits"
    else:
        same = "exact int32 sums, the same bits on every path"
        others = [p for p in k.available_isas() if p in HALF_SCALE_PATHS]
        if others:
            same += f" but {', '.join(others)} (opt-in: weights at half the scale)"
    return (f"{path}: {_PATHS[path]} ({same}; "
            f"CAFFEPY_INT8_ISA={'|'.join(k.available_isas())} names one)")


INT8, FLOAT32 = "int8", "float32"        # the paths a quantized convolution may run
INT8_WINOGRAD = "int8 winograd"          # int8 by the integer Winograd kernel (the same bits)
# float32 runs only when measured this many times faster than int8 alone: inside a net it
# also pays for the switch between the int8 kernels' threads and the BLAS's, which a unit timed
# alone barely sees (ResNet-50 b1 on AVX2: every 3x3 layer in float32 looked 1.1-1.3x faster
# alone, ran 1.0-1.5x slower in the net; b16: 1.2-2.3x faster in the net)
FALLBACK_MARGIN = 1.25


def fallback_enabled(path):
    """CAFFEPY_INT8_FALLBACK: 1 lets a quantized convolution run in float32 where that is
    measured faster, 0 keeps every one on 8-bit integers; unset, 1 on the AVX2 and portable
    paths and 0 on the byte paths (BYTE_PATHS). There int8 with 8-bit tops passed as
    bytes (Bytes) ran faster than the measured mix on nearly every net tried, while the
    measure, a layer alone on float inputs, cannot see the bytes: on AMX (2-core Xeon, busy)
    Inception-v3 b1 measured 77 of 93 layers into float32 and ran 57.6 ms against 19.1 all
    int8, MobileNet b16 46.0 against 37.8; on AVX-VNNI ResNet-50 b1 30.8 against 21.6 (its
    MobileNet b1 6.8 against 7.4, the one row the mix won)."""
    import os
    value = os.environ.get("CAFFEPY_INT8_FALLBACK", "").strip().lower()
    if not value:
        return path not in BYTE_PATHS
    return value not in ("0", "off", "no", "false")


def bytes_enabled():
    """CAFFEPY_INT8_BYTES: unset or 1 lets an int8 layer hand its 8-bit top to the int8 layers
    after it as bytes (Bytes); 0 writes every top as floats."""
    import os
    value = os.environ.get("CAFFEPY_INT8_BYTES", "1").strip().lower()
    return value not in ("0", "off", "no", "false")


class Bytes:
    """An 8-bit channels-last top as the bytes the byte paths' kernels read (the VNNI and AMX
    convolutions' quantized pixels): pixel p's channel c at array[p * row + c], its integer
    value plus zp (128 for a signed top, so every byte is unsigned), row = 4 ceil(C / 4), then
    the zero points that the readers' taps outside the image read. The top's floats are value *
    inv (1 / scale_out, as the writer computes them): `fill` writes them, the same bits.

    Between two int8 layers whose scales meet (the writer's scale_out is the reader's
    scale_in: Intel's calibrator writes them so) the reader's quantization of those floats
    gives the values back, so it reads the bytes instead: no pass over the floats, and the
    writer stores a quarter of the bytes. In Intel's ResNet-50 52 of the 53 int8 convolutions
    hand their tops on so (not the last, which a float average pooling reads): on AMX its
    forward took 148 -> 104 ms at b16, 23.6 -> 18.6 at b1 (51 of them, one run alternating).
    The blob holds them (Blob.hold) until something reads its floats.

    A concat's input may be a slot of the concat's own Bytes (`slot`: `whole` the concat's,
    `offset` its first channel), written there by its int8 layer so the concat copies nothing.
    """
    whole, offset = None, 0

    def __init__(self, shape, lo, scale):
        n, h, w, c = shape
        self.shape, self.count = tuple(shape), n * h * w * c
        self.row = 4 * ((c + 3) // 4)
        self.zp = 128 if lo < 0 else 0
        self.scale = np.float32(scale)
        self.inv = np.float32(1.0 / float(self.scale))
        # the zero points past the pixels stay as made: the kernels write only pixels' channels
        self.array = np.full(kernels().staged_bytes(*shape), self.zp, np.uint8)

    @classmethod
    def reused(cls, old, shape, lo, scale):
        """`old` when it holds a top of this shape, range and scale (a layer's buffer kept from
        forward to forward), else new Bytes."""
        if old is not None and old.shape == tuple(shape) and old.zp == (128 if lo < 0 else 0) \
                and old.scale == np.float32(scale):
            return old
        return cls(shape, lo, scale)

    @classmethod
    def slot(cls, whole, offset, channels):
        """Channels [offset, offset + channels) of `whole`'s pixels as Bytes of their own: the
        same array from that offset on, whole's row, scale and zero point."""
        part = cls.__new__(cls)
        n, h, w, _ = whole.shape
        part.shape, part.count = (n, h, w, channels), n * h * w * channels
        part.row, part.zp, part.scale, part.inv = whole.row, whole.zp, whole.scale, whole.inv
        part.array, part.whole, part.offset = whole.array[offset:], whole, offset
        return part

    def fill(self, flat):
        """flat[: count] = the floats, channels-last."""
        kernels().fill_floats(self, flat[:self.count])


def quantized(layer_param, phase, net_param=None, source=None):
    """Whether a layer runs in int8: a Convolution or InnerProduct with quantization_param in a
    TEST net, running caffepy's algorithms."""
    return (layer_param.type in ("Convolution", "InnerProduct")
            and layer_param.HasField("quantization_param") and phase == caffe_pb2.TEST
            and not caffe_engine(layer_param, net_param, source))


def channels_last(layer_param, channels):
    """Whether a quantized convolution has a channels-last int8 kernel (cext/int8_nhwc.h): one
    group, or a group per channel (depthwise); other grouped ones run in NCHW."""
    p = layer_param.convolution_param
    return p.group == 1 or p.group == channels == p.num_output


class Spec:
    """A layer's quantization_param, checked (Intel Caffe's DYNAMIC_FIXED_POINT with scales):
    scale_in and scale_out one positive value each, scale_params one or one per output channel
    (each positive, or 0 for a channel of zero weights as Intel's calibrator writes it),
    bw_layer_in and bw_params 8, bw_layer_out 8 or 32; the fl_* (Ristretto's fixed point
    lengths) are not read by Intel's int8 layers and are refused."""

    def __init__(self, layer, num_output):
        q = layer.param.quantization_param
        field = "quantization_param."
        for name in ("fl_layer_in", "fl_layer_out", "fl_params"):
            if len(getattr(q, name)):
                raise layer.error(field + name, "fixed point lengths are not supported (Intel's "
                                  "int8 layers read the scales)", list(getattr(q, name)),
                                  hint="Give scale_in, scale_out and scale_params")
        for name, allowed in (("bw_layer_in", (8,)), ("bw_params", (8,)), ("bw_layer_out", (8, 32))):
            value = getattr(q, name)
            if value not in allowed:
                bits = " or ".join(map(str, allowed))
                raise layer.error(field + name, f"Intel Caffe's int8 layers take {bits} bits",
                                  value)
        for name in ("scale_in", "scale_out"):
            values = list(getattr(q, name))
            if len(values) != 1:
                raise layer.error(field + name, "needs exactly one value", values)
            if not (math.isfinite(values[0]) and values[0] > 0):
                raise layer.error(field + name, "must be positive and finite", values[0])
        sp = list(q.scale_params)
        if len(sp) not in (1, num_output):
            raise layer.error(field + "scale_params", f"needs 1 value or one per output channel "
                              f"({num_output})", f"{len(sp)} values")
        bad = [v for v in sp if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise layer.error(field + "scale_params", "must be positive and finite (0 for a "
                              "channel of zero weights)", bad[0])
        self.scale_in = np.float32(q.scale_in[0])
        self.scale_out = np.float32(q.scale_out[0])
        self.scale_params = np.asarray(sp, np.float32)
        self.signed_input = q.is_negative_input
        self.force_u8 = q.force_u8_input
        self.bits_out = q.bw_layer_out


def fold_batchnorm(weights, bias, bn, scale):
    """Intel's folding of a BatchNorm (and the Scale after it, or None) into the convolution
    before it, in float32 as Intel computes it: alpha = s / sqrt(var + eps), W' = W alpha,
    b' = b alpha + (beta - mean alpha), with mean and var the stored sums over blobs[2] (a
    factor 0 taken as 1)."""
    f32 = np.float32
    factor = f32(bn.blobs[2].read_data.reshape(-1)[0])
    factor = f32(1) if factor == 0 else f32(1) / factor
    mean, var = bn.blobs[0].read_data.reshape(-1), bn.blobs[1].read_data.reshape(-1)
    c = weights.shape[0]
    s = scale.blobs[0].read_data.reshape(-1) if scale is not None else np.ones(c, f32)
    beta = (scale.blobs[1].read_data.reshape(-1) if scale is not None and scale.bias_term
            else np.zeros(c, f32))
    alpha = s / np.sqrt(var * factor + f32(bn.eps))
    b = np.zeros(c, f32) if bias is None else bias
    folded_bias = b * alpha + (beta - mean * factor * alpha)
    return weights * alpha.reshape((c,) + (1,) * (weights.ndim - 1)), folded_bias.astype(f32)


class Int8:
    """The int8 computation of one Convolution or InnerProduct: its checked Spec, the weights
    quantized (redone when any float they come from changes), and the forward."""

    def __init__(self, layer):
        self.layer = layer
        self.spec = Spec(layer, layer.num_output)
        self.seen = Seen()
        self.wq = self.wu = self.wn = self.bias_q = self.mult = None
        self._epilogues = {}    # (relu, slope, coeff) -> the kernels' epilogue arguments
        self.isa = isa()
        # the weights' scale: scale_params, halved on a HALF_SCALE_PATHS path
        self.weight_factor = 0.5 if self.isa in HALF_SCALE_PATHS else 1.0
        # the channels-last Convolution (caffepy/layers/nhwc.py) runs the int8_nhwc.h kernels
        self.channels_last = getattr(layer, "layout", None) == "nhwc"
        # it has float32 algorithms too: the path by measurement (the module docstring)
        self.may_fall_back = self.channels_last and fallback_enabled(self.isa)
        self.path, self.forced, self.winograd = INT8, None, False
        self._path_for = None
        # net_rules.byte_tops: every reader of the top takes it as Bytes (the int8 convolutions
        # among them, which must run their int8 kernels to: byte_readers); the buffer, reused
        self.byte_top, self.byte_readers, self._bytes = False, [], None
        # (concat layer, bottom index, the concat's top) when the top is a concat's input that
        # only the concat reads: the bytes are written into the concat's (NHWCConcat.slot_bytes)
        self.byte_slot = None

    def decided(self, shape):
        """Whether this layer runs its int8 kernels at input `shape`, as chosen at an earlier
        forward (the first forward at a shape chooses, on floats)."""
        return self._path_for == shape and self.path == INT8

    def takes_bytes(self):
        """Whether this layer reads an input held as Bytes, as its path stands (chosen at the
        first forward: a float32 fallback or Winograd's int16 rows read floats, which the
        bytes would then be filled into on every forward)."""
        return self._path_for is not None and self.path == INT8 and not self.winograd

    def top_bytes(self, shape, relu, slope):
        """The Bytes this layer's 8-bit top is written into at top `shape` (N, H, W, C): its own,
        or its run of a concat's (byte_slot)."""
        lo = self._ranges(relu, slope)[3]
        if self.byte_slot is not None:
            concat, j, whole = self.byte_slot
            return concat.slot_bytes(whole, j, lo, self.spec.scale_out)
        self._bytes = Bytes.reused(self._bytes, shape, lo, self.spec.scale_out)
        return self._bytes

    def reads(self, held, shape):
        """Whether this layer's kernel reads `held` (a blob's held values) in place of
        quantizing its input at `shape`: Bytes of its own input scale and range, on a byte path's
        direct or depthwise kernel (not Winograd's int16 rows)."""
        spec, L = self.spec, self.layer
        return (isinstance(held, Bytes) and self.isa in BYTE_PATHS and self.channels_last
                and self._path_for == shape and self.takes_bytes()
                and held.scale == spec.scale_in and not spec.force_u8
                and held.zp == (128 if spec.signed_input else 0)
                and not (L.channels & 1 and L.channels < 8))

    def force_path(self, path):
        """Run `path` (INT8: the direct kernel, INT8_WINOGRAD: the Winograd one where it
        applies, FLOAT32; None: measure again) from the next forward on, whatever the
        measurement says: tests and benchmarks."""
        assert path in (INT8, INT8_WINOGRAD, FLOAT32, None)
        self.forced, self._path_for = path, None

    def winograd_applies(self):
        """Whether the channels-last integer Winograd F(2x2, 3x3) kernel takes this layer (the
        same integers as the direct kernel: cext/int8_nhwc.h)."""
        L = self.layer
        return (self.channels_last and L.group == 1
                and kernels().winograd_applies(L.kernel, L.stride, L.dilation, L.channels))

    def run(self, key, shape, int8, float32):
        """Run the unit by its path for input `shape`: `int8(winograd)` or `float32()`
        (functions running the unit each way), chosen once per shape (autotune.choose under
        `key()`: the unit's parts, made only then) and named in the layer's algorithm for the
        log and `caffepy time`. Where the integer Winograd kernel applies, int8 runs it or the
        direct kernel, whichever measured faster (Winograd by rule)."""
        if self._path_for != shape:
            self._path_for = shape
            self._choose(key(), shape, int8, float32)
        if self.path == FLOAT32:
            float32()
        else:
            int8(self.winograd)

    def _choose(self, key, shape, int8, float32):
        from . import autotune
        from .kernels import nhwc
        L = self.layer
        ways = {INT8: lambda: int8(False)}
        if self.winograd_applies():
            # the integer Winograd kernel makes 2.25x fewer products at AVX2's rate; the direct
            # kernel's VNNI products are 4x AVX2's (AMX's many more), vpmaddubsw's 1.6x: the
            # default is the faster by that count
            winograd = {INT8_WINOGRAD: lambda: int8(True)}
            ways = ({**ways, **winograd} if self.isa in VNNI_PATHS else {**winograd, **ways})
        default = next(iter(ways))
        if self.forced is not None:
            choice, L.tuning = (self.forced if self.forced in ways or self.forced == FLOAT32
                                else INT8), "forced"
        elif not self.may_fall_back:
            choice, L.tuning = default, "CAFFEPY_INT8_FALLBACK=0"
        else:
            ways[FLOAT32] = float32
            def key_at(batches):
                return f"{key} {batches}x{'x'.join(map(str, shape[1:]))} {self.isa}"
            # another way than the default (Winograd where it applies) must be the margin faster
            choice = autotune.choose(L, key_at(autotune.batch_class(shape[0])), ways, default,
                                     nhwc.max_threads(), margin=FALLBACK_MARGIN,
                                     kin=autotune.kin_keys(shape[0], key_at))
        self.path = FLOAT32 if choice == FLOAT32 else INT8
        self.winograd = choice == INT8_WINOGRAD
        kind = "winograd F(2,3)" if self.winograd else "direct"
        L.algorithm = (f"int8 {kind} ({self.isa})" if self.path == INT8
                       else f"float32 fallback: {L.algos['forward'].name}")

    def _prepare(self, sources, fold):
        """Quantize the weights from `sources` (the blobs they depend on) unless those are what
        the last call saw."""
        if self.seen.changed(*sources):
            self._quantize(fold)        # its arrays gone before the keep (blob.Seen.keep)
            self._epilogues.clear()
            self.seen.keep(*sources)

    def _quantize(self, fold):
        L, spec, f32 = self.layer, self.spec, np.float32
        w = L.blobs[0].read_data
        b = L.blobs[1].read_data if L.bias_term else None
        if getattr(L, "transpose", False):
            w = w.T
        if fold is not None:
            w, b = fold_batchnorm(w, b, *fold)
        n = w.shape[0]
        # (times 0.5, exact in float32: half the scale quantizes w * sp to half its integer)
        scales = (np.asarray(spec.scale_params, f32) * f32(self.weight_factor)).astype(f32)
        sp = np.broadcast_to(scales, (n,)).astype(f32)
        w2 = np.ascontiguousarray(w.reshape(n, -1), f32)
        k = kernels()
        wq = np.empty((n, k.padded(w2.shape[1])), np.int16)
        k.quantize_weights(w2, scales, wq)
        if self.weight_factor != 1.0:       # saturated at 7 bits, its kernels' exact range
            np.clip(wq, -k.HALF_WEIGHT_MAX, k.HALF_WEIGHT_MAX, out=wq)
        self.wq = k.conv_weights(wq[:, :w2.shape[1]].reshape(w.shape)) if w.ndim == 4 else wq
        # an InnerProduct on the byte paths runs as a 1 x 1 channels-last convolution
        self.wn = (k.nhwc_weights(wq, w2.shape[1], isa=self.isa)
                   if w.ndim == 2 and self.isa in BYTE_PATHS else None)
        if w.ndim == 4 and self.channels_last:
            self.wu = k.winograd_nhwc_weights(self.wq) if self.winograd_applies() else None
            self.wq = (k.depthwise_nhwc_weights(self.wq, *L.kernel) if L.group > 1
                       else k.nhwc_weights(self.wq, w.shape[1], L.kernel, L.dilation,
                                           self.isa, L.stride))
        in_scale = (spec.scale_in * sp).astype(f32)
        zero = sp == 0
        self.mult = np.where(zero, spec.scale_out, spec.scale_out / np.where(zero, 1, in_scale)).astype(f32)
        if b is None:
            self.bias_q = None
        else:
            bias_scale = np.where(zero, f32(1), in_scale).astype(f32)
            scaled = np.clip(b.astype(f32) * bias_scale, -INT32_FLOAT_MAX, INT32_FLOAT_MAX)
            self.bias_q = np.rint(scaled).astype(np.int32)

    def _ranges(self, relu, slope):
        spec = self.spec
        lo_in, hi_in = S8 if spec.signed_input else U8
        lo, hi = U8 if relu and slope == 0 else S8
        scale = np.float32(1) if spec.force_u8 else spec.scale_in
        return scale, lo_in, hi_in, lo, hi, spec.bits_out == 8, np.float32(1.0 / float(spec.scale_out))

    def sources(self, fold):
        """The blobs the quantized weights come from (blob.Seen's sources)."""
        blobs = list(self.layer.blobs)
        if fold is not None:
            bn, scale = fold
            blobs += list(bn.blobs) + (list(scale.blobs) if scale else [])
        return blobs

    def conv_forward(self, x, top, summand=None, relu=False, slope=0.0, fold=None, coeff=(1, 1),
                     winograd=False, staged=None, out_bytes=None, summand_bytes=None):
        """top (float32, NCHW, or NHWC for the channels-last layer) = the int8 convolution of x
        (float32, the same layout); summand (float32 of top's shape) added as an Eltwise SUM
        would; fold = (BatchNorm, Scale or None); winograd: by the integer Winograd kernel
        (where winograd_applies; the same bits). Channels-last only: staged, the input as Bytes
        (`reads`; x then its shape), out_bytes, the top written as Bytes instead of floats,
        summand_bytes, the summand as Bytes."""
        L = self.layer
        self._prepare(self.sources(fold), fold)
        k = kernels()
        if not self.channels_last:
            run = functools.partial(k.conv_forward, group=L.group)
        else:
            run = k.depthwise_nhwc if L.group > 1 else k.conv_forward_nhwc
        weights = self.wq
        if winograd:
            run, weights = k.winograd_nhwc, self.wu
        mult, epilogue = self._epilogue(relu, slope, coeff)
        if staged is not None:
            epilogue = dict(epilogue, staged=staged, shape=x)
            x = None
        if out_bytes is not None or summand_bytes is not None:
            epilogue = dict(epilogue, out_bytes=out_bytes, summand_bytes=summand_bytes)
        run(x, weights, self.bias_q, mult, top, summand, kernel=L.kernel, pad=L.pad,
            stride=L.stride, dilation=L.dilation, **epilogue)

    def _epilogue(self, relu, slope, coeff):
        """The convolution kernels' epilogue: (mult, the keywords after the geometry), made
        once per weights and (relu, slope, coeff): a batch-1 layer of 0.1 ms felt the NumPy
        scalars and arrays made anew on every call."""
        key = (relu, slope, tuple(coeff))
        made = self._epilogues.get(key)
        if made is None:
            scale, lo_in, hi_in, lo, hi, quantize, inv = self._ranges(relu, slope)
            mult = (self.mult if coeff[1] == 1
                    else (self.mult * np.float32(coeff[1])).astype(np.float32))
            sum_scale = np.float32(self.spec.scale_out * np.float32(coeff[0]))
            made = self._epilogues[key] = (mult, dict(
                scale_in=scale, lo_in=lo_in, hi_in=hi_in, sum_scale=sum_scale, relu=relu,
                slope=slope, quantize=quantize, lo=lo, hi=hi, inv_scale_out=inv, isa=self.isa))
        return made

    def inner_product_forward(self, x, top, relu=False, slope=0.0):
        """top [M, N] = the int8 inner product of x [M, K]."""
        self._prepare(self.sources(None), None)
        scale, lo_in, hi_in, lo, hi, quantize, inv = self._ranges(relu, slope)
        kernels().inner_product(x, self.wq, self.bias_q, self.mult, top, scale, lo_in, hi_in,
                                relu, slope, quantize, lo, hi, inv, self.isa, self.wn)

