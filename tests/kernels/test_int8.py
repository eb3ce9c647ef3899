"""The int8 kernels (cext/int8.pyx) against hand-worked cases and the NumPy reference
(caffepy/kernels/reference/int8.py): the same bits on every ISA."""
import functools

import numpy as np
import pytest

from caffepy.kernels import int8 as k
from caffepy.kernels.reference import int8 as ref

# every path, those this CPU (or build) lacks skipped with the reason
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    isa not in k.available_isas(), reason=f"int8 {isa} path: this CPU or build lacks it"))
    for isa in k.ISAS]
U8, S8 = (0.0, 255.0), (-128.0, 127.0)
# the paths whose weights span all of s8: avx2bytes takes [-64, 64] (int8_avxvnni.h)
ISAS_S8 = [p for p in ISAS if p.values[0] != "avx2bytes"]


def _wq(rng, isa, shape):
    """Random integer weights of `shape` over the range path `isa` takes."""
    top = k.HALF_WEIGHT_MAX if isa == "avx2bytes" else 127
    return rng.integers(-top - 1 if top == 127 else -top, top + 1, shape).astype(np.int16)


def _weights(wq):
    """Integer weights [O, K] as the kernels hold them (rows padded to even)."""
    wq = np.asarray(wq, np.int16)
    out = np.zeros((wq.shape[0], k.padded(wq.shape[1])), np.int16)
    out[:, :wq.shape[1]] = wq
    return out


def _ip(x, wq, bias, mult, relu, quantize, inv, isa, lo_in=0.0, hi_in=255.0, scale_in=2.0):
    top = np.empty((x.shape[0], wq.shape[0]), np.float32)
    lo, hi = U8 if relu else S8
    k.inner_product(np.asarray(x, np.float32), _weights(wq), bias, np.asarray(mult, np.float32),
                    top, scale_in, lo_in, hi_in, relu, 0.0, quantize, lo, hi, inv, isa)
    return top


@pytest.mark.parametrize("isa", ISAS_S8)
def test_inner_product_by_hand(isa):
    # x = [1.25, 1.75] at scale_in 2: 2.5 and 3.5 round to even, 2 and 4. Weights at scale 10:
    # [0.5, -0.25] -> [5, -2] (-2.5 to even), [-1, 0] -> [-10, 0], [20, 20] -> saturated [127, 127];
    # bias 0.3 at 2 * 10 -> 6. mult = scale_out 4 / (2 * 10) = 0.2, top = integer / 4.
    x = np.array([[1.25, 1.75]], np.float32)
    w = np.array([[0.5, -0.25], [-1.0, 0.0], [20.0, 20.0]], np.float32)
    wq = np.empty((3, 2), np.int16)
    k.quantize_weights(w, np.array([10.0], np.float32), wq)
    assert wq.tolist() == [[5, -2], [-10, 0], [127, 127]]
    bias = np.array([6, 0, 0], np.int32)
    mult = [0.2, 0.2, 0.2]
    # sums: 2*5 + 4*-2 + 6 = 8 -> 1.6 -> 2; -20 -> -4; 6 * 127 = 762 -> 152.4 -> s8 127, u8 152
    signed = _ip(x, wq, bias, mult, relu=False, quantize=True, inv=0.25, isa=isa)
    assert signed.tolist() == [[0.5, -1.0, 31.75]]
    unsigned = _ip(x, wq, bias, mult, relu=True, quantize=True, inv=0.25, isa=isa)
    assert unsigned.tolist() == [[0.5, 0.0, 38.0]]
    wide = _ip(x, wq, bias, mult, relu=False, quantize=False, inv=0.25, isa=isa)  # bw_layer_out 32
    # the float32 epilogue: sums times float32(0.2), times 1 / scale_out
    np.testing.assert_array_equal(wide, np.float32([[8, -20, 762]]) * np.float32(0.2) * np.float32(0.25))


@pytest.mark.parametrize("isa", ISAS)
def test_input_saturates_and_signed_input_keeps_negatives(isa):
    x = np.array([[-3.0, 200.0]], np.float32)           # at scale 2: -6 and 400
    wq = np.array([[1, 1]], np.int16)
    got_u8 = _ip(x, wq, None, [1.0], False, False, 1.0, isa)
    assert got_u8.tolist() == [[255.0]]                  # 0 + 255
    got_s8 = _ip(x, wq, None, [1.0], False, False, 1.0, isa, lo_in=-128.0, hi_in=127.0)
    assert got_s8.tolist() == [[121.0]]                  # -6 + 127


@pytest.mark.parametrize("isa", ISAS_S8)
def test_extreme_products_do_not_saturate(isa):
    # 255 x -128 over 4608 products (ResNet's 3 x 3 x 512): vpmaddubsw's int16 pair sums would
    # saturate at 32767; the int32 sums are exact
    K = 4608
    x = np.full((3, K), 1000.0, np.float32)
    wq = np.stack([np.full(K, -128), np.full(K, 127), np.tile([127, -128], K // 2)]).astype(np.int16)
    got = _ip(x, wq, None, [1.0] * 3, False, False, 1.0, isa)
    want = np.float32([255 * -128 * K, 255 * 127 * K, 255 * -1 * K // 2])
    np.testing.assert_array_equal(got, np.tile(want, (3, 1)))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m,k_,n", [(1, 9216, 37), (33, 7, 20), (70, 130, 5), (2, 64, 64)])
@pytest.mark.parametrize("signed_in,relu", [(False, True), (True, False)])
def test_inner_product_matches_reference_bit_for_bit(isa, m, k_, n, signed_in, relu):
    # the byte paths run it as a 1 x 1 channels-last convolution of m pixels: one row, odd K
    # (quads cut short), blocks of 32 and 6 pixels cut short, K above one tile chunk
    rng = np.random.default_rng(11)
    x = rng.normal(0, 1, (m, k_)).astype(np.float32)
    wq = _wq(rng, isa, (n, k_))
    bias = rng.integers(-5000, 5000, n).astype(np.int32)
    mult = rng.uniform(0.001, 0.01, n).astype(np.float32)
    lo_in, hi_in = S8 if signed_in else U8
    lo, hi = U8 if relu else S8
    want = ref.inner_product(x, wq, bias, mult, 60.0, lo_in, hi_in, relu, 0.0, True, lo, hi,
                             np.float32(1 / 9.5))
    top = np.empty((m, n), np.float32)
    k.inner_product(x, _weights(wq), bias, mult, top, 60.0, lo_in, hi_in, relu, 0.0, True, lo,
                    hi, np.float32(1 / 9.5), isa)
    np.testing.assert_array_equal(top, want)


CONVS = [  # (N, C, H, W, O, group, kernel, pad, stride, dilation)
    (2, 3, 9, 7, 5, 1, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 4, 8, 8, 6, 2, (3, 2), (0, 1), (2, 1), (1, 1)),
    (1, 6, 7, 7, 6, 6, (3, 3), (1, 1), (1, 1), (1, 1)),          # depthwise
    (2, 5, 9, 8, 5, 5, (3, 3), (1, 1), (2, 2), (1, 1)),          # depthwise, stride 2
    (1, 3, 21, 19, 3, 3, (3, 3), (2, 2), (1, 1), (2, 2)),        # depthwise, dilated, 16+ wide
    # depthwise on bytes (int8_vnni.h i8v_dw_*): 16-channel groups and a tail, a kernel row of
    # two tap quads, strides apart
    (1, 40, 9, 11, 40, 40, (5, 5), (2, 2), (1, 2), (1, 1)),
    (2, 5, 10, 9, 20, 1, (1, 1), (0, 0), (1, 1), (1, 1)),        # odd channels, 20 rows
    (1, 6, 5, 5, 4, 2, (1, 1), (0, 0), (1, 1), (1, 1)),          # odd channels per group
    (1, 3, 11, 11, 4, 1, (3, 3), (2, 2), (1, 1), (2, 2)),        # dilated
    # an odd count of channels under 8 (int8_nhwc.h i8n_wide): a tap is a kernel row
    (2, 3, 23, 22, 20, 1, (7, 7), (3, 3), (2, 2), (1, 1)),       # ResNet-50's conv1, smaller
    (1, 1, 12, 12, 7, 1, (5, 5), (0, 0), (1, 1), (1, 1)),        # LeNet's conv1
    (1, 5, 10, 13, 17, 1, (3, 4), (1, 2), (2, 3), (2, 1)),       # dilated rows only
    (1, 17, 6, 6, 7, 1, (7, 7), (3, 3), (2, 2), (1, 1)),         # K 833 > one k block
    # AMX: few channels' taps loaded where they lie (int8_amx.h i8a_wide_rows) past 32 pixels
    # of a row, rows of the image and its padding; a stride wider than the kernel copies them
    (2, 3, 9, 75, 40, 1, (5, 5), (2, 2), (2, 1), (1, 1)),
    (1, 3, 8, 20, 20, 1, (3, 2), (1, 0), (1, 3), (1, 1)),
    # column tiles of 16 in register tiles of up to 4 (the VNNI path): 5 = 4 + 1, and 3
    (1, 9, 7, 7, 70, 1, (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, 12, 5, 6, 40, 1, (1, 1), (0, 0), (1, 1), (1, 1)),
    # AMX taps loaded in place (int8_nhwc.h i8n_amx_taps): a chunk of 64 channels a tap, rows
    # of 28-32 or 56-64 pixels; halves that touch the padding copied, a dilated kernel, a
    # stride of 2, two images
    (2, 64, 9, 30, 40, 1, (3, 3), (1, 1), (1, 1), (1, 1)),
    (1, 64, 9, 115, 24, 1, (3, 3), (1, 1), (2, 2), (1, 1)),
    (1, 64, 6, 56, 20, 1, (3, 3), (2, 2), (1, 1), (2, 2)),
    # the byte epilogue's runs of 64 channels packed into one store, twice, then a tail
    (1, 8, 6, 7, 150, 1, (3, 3), (1, 1), (1, 1), (1, 1)),
    # 1 x 1 without padding (int8_nhwc.h i8n_conv1x1): chunks of 96 pixels at 512 channels,
    # the last cut short; a stride's gathered pixels, odd channels
    (1, 512, 20, 20, 20, 1, (1, 1), (0, 0), (1, 1), (1, 1)),
    (2, 512, 19, 17, 20, 1, (1, 1), (0, 0), (2, 2), (1, 1)),
    (1, 7, 9, 9, 5, 1, (1, 1), (0, 0), (2, 3), (1, 1)),
    # depthwise in bands of 2 and of 1 output rows (int8_nhwc.h i8n_dw_band), rows shared
    (1, 512, 9, 20, 512, 512, (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, 256, 11, 40, 256, 256, (3, 3), (1, 1), (2, 2), (1, 1)),
]


@pytest.mark.parametrize("shape", CONVS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("relu,summed,quantize,signed_in,slope", [
    (True, False, True, False, 0.0), (False, True, True, True, 0.0),
    (True, True, False, False, 0.0), (False, False, True, False, 0.0),
    (True, True, True, True, 0.25)])         # a leaky ReLU: an s8 top
def test_conv_matches_reference_bit_for_bit(shape, isa, relu, summed, quantize, signed_in, slope):
    n, c, h, w, o, g, kernel, pad, stride, dilation = shape
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (n, c, h, w)).astype(np.float32)
    wq = _wq(rng, isa, (o, c // g) + kernel)
    bias = rng.integers(-5000, 5000, o).astype(np.int32)
    mult = rng.uniform(0.001, 0.01, o).astype(np.float32)
    oh = (h + 2 * pad[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + 2 * pad[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    summand = rng.normal(0, 2, (n, o, oh, ow)).astype(np.float32) if summed else None
    lo_in, hi_in = S8 if signed_in else U8
    lo, hi = U8 if relu and slope == 0 else S8
    args = dict(scale_in=60.0, lo_in=lo_in, hi_in=hi_in, sum_scale=9.5, relu=relu, slope=slope,
                quantize_out=quantize, lo=lo, hi=hi, inv_scale_out=np.float32(1 / 9.5))
    want = ref.conv_forward(x, wq, bias, mult, summand, g, kernel, pad, stride, dilation, **args)
    top = np.empty_like(want)
    k.conv_forward(x, k.conv_weights(wq), bias, mult, top, summand, g, kernel, pad,
                   stride, dilation, 60.0, lo_in, hi_in, 9.5, relu, slope, quantize, lo, hi,
                   np.float32(1 / 9.5), isa)
    np.testing.assert_array_equal(top, want)
    if g not in (1, c):
        return                  # grouped convolutions have no channels-last int8 kernel
    # the channels-last kernels (int8_nhwc.h): the same bits
    nhwc = np.ascontiguousarray(want.transpose(0, 2, 3, 1))
    got = np.empty_like(nhwc)
    last = (lambda a: None if a is None else np.ascontiguousarray(a.transpose(0, 2, 3, 1)))
    wc = k.conv_weights(wq)
    run = (functools.partial(k.depthwise_nhwc, last(x), k.depthwise_nhwc_weights(wc, *kernel))
           if g > 1 else functools.partial(k.conv_forward_nhwc, last(x),
                                          k.nhwc_weights(wc, c, kernel, dilation, isa, stride)))
    run(bias, mult, got, last(summand), kernel, pad, stride, dilation, 60.0, lo_in, hi_in, 9.5,
        relu, slope, quantize, lo, hi, np.float32(1 / 9.5), isa)
    np.testing.assert_array_equal(got, nhwc)


def _extreme_conv_sums(isa, lo_w, hi_w, lo_in=0.0, hi_in=255.0):
    """The channels-last 3 x 3 convolution (512 channels) and depthwise one (16) of inputs at
    hi_in, the output channels' weights all lo_w or all hi_w in turn: each sum exact."""
    for c, g in ((512, 1), (16, 16)):
        x = np.full((1, 3, 3, c), 1000.0, np.float32)
        o = 17 if g == 1 else c
        wq = np.full((o, c // g, 3, 3), lo_w, np.int16)
        wq[1::2] = hi_w
        wc = k.conv_weights(wq)
        top = np.empty((1, 1, 1, o), np.float32)
        args = ((3, 3), (0, 0), (1, 1), (1, 1), 1.0, lo_in, hi_in, 1.0, False, 0.0, False,
                -128.0, 127.0, 1.0, isa)
        if g == 1:
            k.conv_forward_nhwc(x, k.nhwc_weights(wc, c, (3, 3), isa=isa), None,
                                np.ones(o, np.float32), top, None, *args)
        else:
            k.depthwise_nhwc(x, k.depthwise_nhwc_weights(wc, 3, 3), None, np.ones(o, np.float32),
                             top, None, *args)
        want = np.where(np.arange(o) % 2, hi_w, lo_w) * hi_in * 9 * (c // g)
        np.testing.assert_array_equal(top.reshape(-1), want.astype(np.float32))


@pytest.mark.parametrize("isa", ISAS_S8)
def test_channels_last_extreme_sums_stay_exact(isa):
    # 255 x -128 over 3 x 3 x 512 taps in the implicit GEMM, and the depthwise float sums at
    # their largest (9 products of 255 x -128: exact in float32 below 2^24)
    _extreme_conv_sums(isa, -128, 127)


AVX2BYTES = [p for p in ISAS if p.values[0] == "avx2bytes"]


@pytest.mark.parametrize("isa", AVX2BYTES)
@pytest.mark.parametrize("signed_in", [False, True])
def test_avx2bytes_largest_pair_sums_stay_exact(isa, signed_in):
    # vpmaddubsw sums each pair of u8 x s8 products into int16 with saturation: at the ends of
    # the range it takes (x 255 after a signed input's shift, weights +-64) a pair is
    # +-255 * 128 = +-32640, just inside int16; 3 x 3 x 512 taps of them, the depthwise sums of
    # 9, and an inner product of 4608
    lo_in, hi_in = S8 if signed_in else U8
    m = k.HALF_WEIGHT_MAX
    _extreme_conv_sums(isa, -m, m, lo_in, hi_in)
    K = 4608
    wq = np.stack([np.full(K, -m), np.full(K, m), np.tile([m, -m], K // 2)]).astype(np.int16)
    got = _ip(np.full((3, K), 1000.0, np.float32), wq, None, [1.0] * 3, False, False, 1.0, isa,
              lo_in=lo_in, hi_in=hi_in)
    want = np.float32([-m * hi_in * K, m * hi_in * K, 0])
    np.testing.assert_array_equal(got, np.tile(want, (3, 1)))


@pytest.mark.parametrize("isa", AVX2BYTES)
def test_avx2bytes_refuses_weights_past_its_exact_range(isa):
    m = k.HALF_WEIGHT_MAX
    wc = k.conv_weights(np.full((4, 8, 1, 1), m + 1, np.int16))
    with pytest.raises(ValueError, match=rf"nhwc_weights: wq: needs weights in \[-{m}, {m}\]"):
        k.nhwc_weights(wc, 8, (1, 1), isa=isa)
    k.nhwc_weights(wc, 8, (1, 1), isa="avx2")           # the int16 pairs take any s8
    x = np.zeros((1, 3, 3, 4), np.float32)
    w = k.depthwise_nhwc_weights(k.conv_weights(np.full((4, 1, 3, 3), -m - 1, np.int16)), 3, 3)
    with pytest.raises(ValueError, match="depthwise_nhwc: w: needs weights in"):
        k.depthwise_nhwc(x, w, None, np.ones(4, np.float32), np.empty((1, 1, 1, 4), np.float32),
                         None, (3, 3), (0, 0), (1, 1), (1, 1), 1.0, 0.0, 255.0, 1.0, False, 0.0,
                         False, -128.0, 127.0, 1.0, isa)


def test_negative_slope_and_ties_to_even():
    # sums -3 and 5 at mult 0.5: -1.5 * slope 1 -> rint(-1.5) = -2; 2.5 -> 2 (ties to even)
    x = np.array([[1.0]], np.float32)
    wq = np.array([[-3], [5]], np.int16)
    top = np.empty((1, 2), np.float32)
    k.inner_product(x, _weights(wq), None, np.float32([0.5, 0.5]), top, 1.0, 0.0, 255.0, True,
                    1.0, True, -128.0, 127.0, 1.0, "generic")
    assert top.tolist() == [[-2.0, 2.0]]


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="int8: isa: must be one of"):
        _ip(np.ones((1, 2), np.float32), np.ones((1, 2), np.int16), None, [1.0], False, False, 1.0,
            "sse")


@pytest.mark.parametrize("kernel", ["conv_forward", "conv_forward_nhwc", "depthwise_nhwc"])
@pytest.mark.parametrize("arg", ["mult", "bias", "summand"])
def test_every_convolution_checks_its_epilogue(kernel, arg):
    # one check for all (int8.pyx _check_epilogue): depthwise_nhwc read past a short mult
    c, depthwise = 4, kernel == "depthwise_nhwc"
    wc = k.conv_weights(np.ones((c, 1 if depthwise else c, 3, 3), np.int16))
    nchw = kernel == "conv_forward"
    x = np.ones((1, c, 5, 5) if nchw else (1, 5, 5, c), np.float32)
    top = np.empty_like(x)
    bias, mult = np.zeros(c, np.int32), np.ones(c, np.float32)
    summand = np.zeros_like(top)
    bad = {"mult": np.ones(c - 1, np.float32), "bias": np.zeros(c + 1, np.int32),
           "summand": np.zeros((1, 5, 5, c - 1) if not nchw else (1, c - 1, 5, 5), np.float32)}
    bias, mult, summand = [bad[a] if a == arg else v
                           for a, v in (("bias", bias), ("mult", mult), ("summand", summand))]
    args = ((3, 3), (1, 1), (1, 1), (1, 1), 1.0, 0.0, 255.0, 1.0, True, 0.0, True, 0.0, 255.0,
            1.0, "generic")
    with pytest.raises(ValueError, match=f"{kernel}: {arg}: needs shape"):
        if nchw:
            k.conv_forward(x, wc, bias, mult, top, summand, 1, *args)
        elif depthwise:
            k.depthwise_nhwc(x, k.depthwise_nhwc_weights(wc, 3, 3), bias, mult, top, summand, *args)
        else:
            k.conv_forward_nhwc(x, k.nhwc_weights(wc, c, (3, 3)), bias, mult, top, summand,
                                *args)


WINOGRAD = [  # (N, C, H, W, O, pad): 3 x 3, stride 1 (its only shape)
    (2, 3, 9, 7, 5, (1, 1)),            # odd channels and sizes: tiles cut at both edges
    (1, 17, 6, 11, 33, (0, 2)),         # 17 channels (a 16-wide input transform + a tail), 3 column tiles
    (1, 32, 13, 13, 16, (1, 1)),        # odd output size: the last tile half outside
    (3, 8, 4, 5, 7, (2, 2)),            # padding beyond the kernel's reach of the image
]


@pytest.mark.parametrize("shape", WINOGRAD)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("relu,summed,quantize,signed_in", [
    (True, False, True, False), (False, True, True, True), (True, True, False, False)])
def test_winograd_matches_reference_bit_for_bit(shape, isa, relu, summed, quantize, signed_in):
    # integer Winograd F(2x2, 3x3) (int8_nhwc.h): the reference's (direct) integers exactly
    n, c, h, w, o, pad = shape
    rng = np.random.default_rng(11)
    x = rng.normal(0, 1, (n, c, h, w)).astype(np.float32)
    wq = rng.integers(-128, 128, (o, c, 3, 3)).astype(np.int16)
    bias = rng.integers(-5000, 5000, o).astype(np.int32)
    mult = rng.uniform(0.001, 0.01, o).astype(np.float32)
    oh, ow = h + 2 * pad[0] - 2, w + 2 * pad[1] - 2
    summand = rng.normal(0, 2, (n, o, oh, ow)).astype(np.float32) if summed else None
    lo_in, hi_in = S8 if signed_in else U8
    lo, hi = U8 if relu else S8
    geometry = ((3, 3), pad, (1, 1), (1, 1))
    want = ref.conv_forward(x, wq, bias, mult, summand, 1, *geometry, scale_in=60.0, lo_in=lo_in,
                            hi_in=hi_in, sum_scale=9.5, relu=relu, slope=0.0, quantize_out=quantize,
                            lo=lo, hi=hi, inv_scale_out=np.float32(1 / 9.5))
    last = (lambda a: None if a is None else np.ascontiguousarray(a.transpose(0, 2, 3, 1)))
    nhwc = last(want)
    got = np.full_like(nhwc, np.nan)
    assert k.winograd_applies((3, 3), (1, 1), (1, 1), c)
    k.winograd_nhwc(last(x), k.winograd_nhwc_weights(k.conv_weights(wq)), bias, mult, got,
                    last(summand), *geometry, 60.0, lo_in, hi_in, 9.5, relu, 0.0, quantize, lo, hi,
                    np.float32(1 / 9.5), isa)
    np.testing.assert_array_equal(got, nhwc)


@pytest.mark.parametrize("isa", ISAS_S8)
def test_winograd_extreme_sums_stay_exact(isa):
    # the largest transformed values (|V| 4 * 255, |U'| 9 * 128) over the most channels the
    # kernel takes: the int32 sums wrap on the way, 4 acc does not, and acc is exact
    c = k.WINOGRAD_MAX_C - 1
    x = np.full((1, 3, 3, c), 1000.0, np.float32)
    o = 17
    wq = np.full((o, c, 3, 3), -128, np.int16)
    wq[1::2] = 127
    top = np.empty((1, 1, 1, o), np.float32)
    k.winograd_nhwc(x, k.winograd_nhwc_weights(k.conv_weights(wq)), None, np.ones(o, np.float32),
                    top, None, (3, 3), (0, 0), (1, 1), (1, 1), 1.0, 0.0, 255.0, 1.0, False, 0.0,
                    False, -128.0, 127.0, 1.0, isa)
    want = np.where(np.arange(o) % 2, 255 * 127, 255 * -128) * 9 * c
    np.testing.assert_array_equal(top.reshape(-1), want.astype(np.float32))
    x = np.where(np.indices((1, 4, 4, c)).sum(axis=0) % 2, 1000.0, -1000.0).astype(np.float32)
    wq = np.where(np.indices((o, c, 3, 3))[2:].sum(axis=0) % 2, 127, -128).astype(np.int16)
    top = np.empty((1, 2, 2, o), np.float32)
    args = ((3, 3), (0, 0), (1, 1), (1, 1), 1.0, -128.0, 127.0, 1.0, False, 0.0, False, -128.0,
            127.0, 1.0, isa)
    k.conv_forward_nhwc(x, k.nhwc_weights(k.conv_weights(wq), c, (3, 3), isa=isa), None,
                        np.ones(o, np.float32), top, None, *args)
    got = np.empty_like(top)
    k.winograd_nhwc(x, k.winograd_nhwc_weights(k.conv_weights(wq)), None, np.ones(o, np.float32),
                    got, None, *args)
    np.testing.assert_array_equal(got, top)


def test_winograd_refuses_what_it_cannot_run():
    assert not k.winograd_applies((3, 3), (2, 2), (1, 1), 8)
    assert not k.winograd_applies((5, 5), (1, 1), (1, 1), 8)
    assert not k.winograd_applies((3, 3), (1, 1), (2, 2), 8)
    assert not k.winograd_applies((3, 3), (1, 1), (1, 1), k.WINOGRAD_MAX_C)


BYTE_ISAS = [p for p in ISAS if p.values[0] in k.BYTE_ISAS]


def _as_bytes(values, lo, scale):
    """quantization.Bytes holding the integers `values` [N, H, W, C] of a top of range lo."""
    from caffepy.quantization import Bytes
    b = Bytes(values.shape, lo, scale)
    n, h, w, c = values.shape
    rows = b.array[:n * h * w * b.row].reshape(-1, b.row)
    rows[:, :c] = values.reshape(-1, c) + b.zp
    return b


@pytest.mark.parametrize("shape", [s for s in CONVS if s[5] == 1 and not (s[1] & 1 and s[1] < 8)]
                         + [s for s in CONVS if s[5] == s[1] > 1][:2])
@pytest.mark.parametrize("isa", BYTE_ISAS)
@pytest.mark.parametrize("relu,signed_in", [(True, False), (False, True)])
def test_bytes_in_and_out_are_the_floats_bits(shape, isa, relu, signed_in):
    """The byte paths' 8-bit input, summand and top as quantization.Bytes (what one int8 layer
    hands the next): the same bits as the float path's quantization of them."""
    n, c, h, w, o, g, kernel, pad, stride, dilation = shape
    rng = np.random.default_rng(11)
    lo_in, hi_in = S8 if signed_in else U8
    lo, hi = U8 if relu else S8
    x_int = rng.integers(lo_in, hi_in + 1, (n, h, w, c)).astype(np.float32)
    x_int[0, 0, 0, 0], x_int[-1, -1, -1, -1] = lo_in, hi_in     # the range's ends
    scale_in = np.float32(7.25)
    x = x_int * np.float32(1 / scale_in)          # floats as the layer before writes them
    wq = _wq(rng, isa, (o, c // g) + kernel)
    bias = rng.integers(-5000, 5000, o).astype(np.int32)
    mult = rng.uniform(0.001, 0.01, o).astype(np.float32)
    oh = (h + 2 * pad[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + 2 * pad[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    s_int = rng.integers(-128, 128, (n, oh, ow, o)).astype(np.float32)
    s_scale = np.float32(3.5)
    summand = s_int * np.float32(1 / s_scale)
    args = (kernel, pad, stride, dilation, scale_in, lo_in, hi_in, 9.5, relu, 0.0, True, lo, hi,
            np.float32(1 / 9.5), isa)
    wc = k.conv_weights(wq)
    depthwise = g > 1
    if depthwise:
        run = functools.partial(k.depthwise_nhwc, w=k.depthwise_nhwc_weights(wc, *kernel))
    else:
        run = functools.partial(k.conv_forward_nhwc, w=k.nhwc_weights(wc, c, kernel, dilation, isa,
                                                                  stride))
    want = np.empty((n, oh, ow, o), np.float32)
    run(x, bias=bias, mult=mult, top=want, summand=summand, kernel=kernel, pad=pad, stride=stride,
        dilation=dilation, scale_in=scale_in, lo_in=lo_in, hi_in=hi_in, sum_scale=9.5,
        relu=relu, slope=0.0, quantize=True, lo=lo, hi=hi, inv_scale_out=np.float32(1 / 9.5),
        isa=isa)
    out = _as_bytes(np.zeros((n, oh, ow, o), np.float32), lo, 9.5)
    got = np.full_like(want, np.nan)
    staged = dict(staged=_as_bytes(x_int, lo_in, scale_in), shape=(n, h, w, c))
    run(None, bias=bias, mult=mult, top=got, summand=None, kernel=kernel,
        pad=pad, stride=stride, dilation=dilation, scale_in=scale_in, lo_in=lo_in, hi_in=hi_in,
        sum_scale=9.5, relu=relu, slope=0.0, quantize=True, lo=lo, hi=hi,
        inv_scale_out=np.float32(1 / 9.5), isa=isa, out_bytes=out,
        summand_bytes=_as_bytes(s_int, -128, s_scale), **staged)
    assert np.isnan(got).all()          # the floats are left to Bytes.fill
    flat = np.empty(want.size, np.float32)
    out.fill(flat)
    np.testing.assert_array_equal(flat.reshape(want.shape), want)
    assert (out.array[want.size // o * out.row:] == out.zp).all()     # the zero points kept


@pytest.mark.parametrize("isa", BYTE_ISAS)
def test_bytes_are_refused_where_they_cannot_be_read(isa):
    x = np.zeros((1, 4, 4, 8), np.float32)
    top = np.zeros((1, 4, 4, 16), np.float32)
    wq = np.zeros((16, 8, 1, 1), np.int16)
    w = k.nhwc_weights(k.conv_weights(wq), 8, (1, 1), (1, 1), isa)
    common = dict(bias=None, mult=np.ones(16, np.float32), summand=None, kernel=(1, 1),
                  pad=(0, 0), stride=(1, 1), dilation=(1, 1), scale_in=1.0, lo_in=0.0,
                  hi_in=255.0, sum_scale=1.0, relu=True, slope=0.0, lo=0.0, hi=255.0,
                  inv_scale_out=1.0, isa=isa)
    with pytest.raises(ValueError, match="out_bytes"):     # a float top has no bytes
        k.conv_forward_nhwc(x, w, top=top, quantize=False, out_bytes=_as_bytes(
            np.zeros((1, 4, 4, 16), np.float32), 0, 1.0), **common)
    with pytest.raises(ValueError, match="staged"):        # signed bytes for an unsigned input
        k.conv_forward_nhwc(None, w, top=top, quantize=True, shape=(1, 4, 4, 8),
                            staged=_as_bytes(np.zeros((1, 4, 4, 8), np.float32), -128, 1.0),
                            **common)


@pytest.mark.parametrize("isa", BYTE_ISAS)
@pytest.mark.parametrize("n,h,w,c,kernel,stride,pad,oh,ow", [
    (2, 9, 8, 64, (3, 3), (2, 2), (0, 0), 4, 4),        # ResNet's pool1, ceil mode's last window
    (1, 7, 7, 70, (3, 3), (1, 1), (1, 1), 7, 7),        # an inception branch's, rows not 64s
    (1, 5, 6, 4, (2, 3), (2, 1), (1, 1), 3, 6),         # windows clipped on every side
])
@pytest.mark.parametrize("lo", [0, -128])
def test_byte_max_pooling_is_the_float_pooling(isa, n, h, w, c, kernel, stride, pad, oh, ow, lo):
    from caffepy.kernels import nhwc
    from caffepy.quantization import Bytes
    rng = np.random.default_rng(3)
    values = rng.integers(lo, lo + 256, (n, h, w, c)).astype(np.float32)
    x = _as_bytes(values, lo, 5.5)
    floats = np.empty(values.size, np.float32)
    x.fill(floats)
    want = np.empty((n, oh, ow, c), np.float32)
    nhwc.pool_max_forward(floats.reshape(values.shape), want, None, *kernel, *stride, *pad)
    y = Bytes((n, oh, ow, c), lo, 5.5)
    k.pool_max_bytes(x, y, kernel, stride, pad, isa)
    got = np.empty(want.size, np.float32)
    y.fill(got)
    np.testing.assert_array_equal(got.reshape(want.shape), want)
