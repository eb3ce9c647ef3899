"""The channels-last bf16 convolution on AMX tiles (cext/bf16_nhwc.h, kernels.bf16
conv_forward_nhwc) against a NumPy reference: operands rounded by caffepy/kernels/reference/
bf16.py, float64 sums, then the epilogue (scale, bias, summand, ReLU) in float64. Skipped where
the CPU (or Linux) gives no AMX-BF16.

Tolerance: test_bf16.py's float32-summation bound, K 2^-24 (|x| (*) |w|) elementwise over the
K = C kh kw products of an output, times |scale|, plus four float32 roundings of the epilogue's
terms (a multiply and up to three adds, each within 2^-24 of its magnitude).
"""
import numpy as np
import pytest

from caffepy import device
from caffepy.kernels import bf16
from caffepy.kernels.reference import bf16 as ref

FLAGS = device.cpu_flags()
AMX_HERE = all(f in FLAGS for f in ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw",
                                    "avx512vl")) and bf16.amx_permitted()
pytestmark = pytest.mark.skipif(not AMX_HERE, reason="this CPU (or its kernel) gives no AMX-BF16")


def _out(n, k, p, s, d):
    return (n + 2 * p - (d * (k - 1) + 1)) // s + 1


def _conv64(x, w, ph, pw, sh, sw, dh, dw, group=1):
    """float64 convolution of x [N, H, W, C] by w [O, C / group, kh, kw] -> [N, OH, OW, O]."""
    if group > 1:
        cg, og = x.shape[3] // group, w.shape[0] // group
        return np.concatenate([_conv64(x[..., g * cg:(g + 1) * cg], w[g * og:(g + 1) * og], ph,
                                       pw, sh, sw, dh, dw) for g in range(group)], axis=3)
    n, h, wd, c = x.shape
    o, _, kh, kw = w.shape
    oh, ow = _out(h, kh, ph, sh, dh), _out(wd, kw, pw, sw, dw)
    xp = np.zeros((n, h + 2 * ph, wd + 2 * pw, c))
    xp[:, ph:ph + h, pw:pw + wd] = x
    y = np.zeros((n, oh, ow, o))
    for i in range(kh):
        for j in range(kw):
            taps = xp[:, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
            y += taps @ w[:, :, i, j].T
    return y


def run(x, w, bias, ph=0, pw=0, sh=1, sw=1, dh=1, dw=1, scale=None, relu=False, add=None,
        y=None, threads=0, group=1):
    o, _, kh, kw = w.shape
    n, h, wd, c = x.shape
    packed = np.empty(bf16.nhwc_packed_size(o, c, kh, kw, group), np.uint16)
    bf16.nhwc_pack_weights(np.ascontiguousarray(w), packed, group)
    if y is None:
        y = np.full((n, _out(h, kh, ph, sh, dh), _out(wd, kw, pw, sw, dw), o), np.nan, np.float32)
    t = threads or 2
    scratch = np.empty(bf16.nhwc_scratch_bytes(n, h, wd, c, o, kh, kw, t, group) + 64, np.uint8)
    off = -scratch.ctypes.data % 64
    bf16.conv_forward_nhwc(x, packed, bias, y, scratch[off:], kh, kw, ph, pw, sh, sw, dh, dw,
                           scale, relu, add, t, group)
    return y


def check(x, w, bias, got, ph=0, pw=0, sh=1, sw=1, dh=1, dw=1, scale=None, relu=False,
          add=None, group=1):
    xr, wr = ref.round_bf16(x).astype(np.float64), ref.round_bf16(w).astype(np.float64)
    conv = _conv64(xr, wr, ph, pw, sh, sw, dh, dw, group)
    mag = _conv64(np.abs(xr), np.abs(wr), ph, pw, sh, sw, dh, dw, group)
    s = np.ones(w.shape[0]) if scale is None else scale.astype(np.float64)
    b = np.zeros(w.shape[0]) if not len(bias) else bias.astype(np.float64)
    a = 0.0 if add is None else add.astype(np.float64)
    want = conv * s + b + a
    k = w.shape[1] * w.shape[2] * w.shape[3]
    bound = (k * 2.0 ** -24 * mag * np.abs(s)
             + 4 * 2.0 ** -24 * (np.abs(conv * s) + np.abs(b) + np.abs(a)) + 1e-30)
    if relu:
        want = np.maximum(want, 0)
    err = np.abs(got - want)
    assert np.all(err <= bound), (err.max(), err[err > bound][:5], bound[err > bound][:5])


# (N, H, W, C, O, kh, kw, ph, pw, sh, sw, dh, dw): 1x1 (stride 1 with whole chunks: rows read
# in place; odd C; strided), 3x3 pad 1, 7x7 stride 2 on 3 channels, dilation, odd C and O, O not
# a multiple of 16 or 32, pixel counts with tails of 32-pixel blocks (and of 16)
SHAPES = [
    (1, 7, 7, 64, 64, 1, 1, 0, 0, 1, 1, 1, 1),
    (2, 5, 5, 256, 40, 1, 1, 0, 0, 1, 1, 1, 1),
    (1, 6, 6, 33, 17, 1, 1, 0, 0, 1, 1, 1, 1),
    (2, 9, 9, 64, 48, 1, 1, 0, 0, 2, 2, 1, 1),
    (1, 8, 8, 32, 32, 3, 3, 1, 1, 1, 1, 1, 1),
    (2, 7, 9, 19, 33, 3, 3, 1, 1, 1, 1, 1, 1),
    (1, 23, 23, 3, 64, 7, 7, 3, 3, 2, 2, 1, 1),
    (1, 12, 12, 16, 20, 3, 3, 2, 2, 1, 1, 2, 2),
    (1, 11, 10, 5, 7, 3, 2, 1, 0, 2, 1, 1, 3),
    (3, 4, 4, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1),
    (1, 3, 3, 64, 100, 3, 3, 0, 0, 1, 1, 1, 1),
    (1, 20, 20, 48, 16, 5, 5, 2, 2, 1, 1, 1, 1),
    # groups (the last field): AlexNet's conv2, odd channels a group, pointwise, strided
    (1, 13, 13, 96, 64, 5, 5, 2, 2, 1, 1, 1, 1, 2),
    (2, 6, 7, 6, 10, 3, 3, 1, 1, 1, 1, 1, 1, 2),
    (1, 8, 8, 64, 96, 1, 1, 0, 0, 1, 1, 1, 1, 4),
    (1, 9, 9, 48, 36, 3, 3, 0, 0, 2, 2, 1, 1, 3),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_against_the_reference(shape):
    n, h, w_, c, o, kh, kw, ph, pw, sh, sw, dh, dw, *group = shape
    group = group[0] if group else 1
    gen = np.random.default_rng(sum(shape))
    x = gen.standard_normal((n, h, w_, c)).astype(np.float32)
    w = gen.standard_normal((o, c // group, kh, kw)).astype(np.float32)
    bias = gen.standard_normal(o).astype(np.float32)
    geo = dict(ph=ph, pw=pw, sh=sh, sw=sw, dh=dh, dw=dw, group=group)
    check(x, w, bias, run(x, w, bias, **geo), **geo)
    # the rounding is what the reference sees: float32 operands land far outside the bound
    if c // group * kh * kw >= 32:
        exact = _conv64(x.astype(np.float64), w.astype(np.float64), **geo) + bias
        assert np.abs(run(x, w, bias, **geo) - exact).max() > 1e-3


@pytest.mark.parametrize("threads", [1, 2])
def test_epilogue_scale_bias_summand_relu(threads):
    gen = np.random.default_rng(7)
    x = gen.standard_normal((2, 6, 5, 24)).astype(np.float32)
    w = gen.standard_normal((37, 24, 3, 3)).astype(np.float32)
    bias = gen.standard_normal(37).astype(np.float32)
    scale = gen.uniform(0.5, 2, 37).astype(np.float32)
    add = gen.standard_normal((2, 6, 5, 37)).astype(np.float32)
    y = run(x, w, bias, 1, 1, scale=scale, relu=True, add=add, threads=threads)
    check(x, w, bias, y, 1, 1, scale=scale, relu=True, add=add)
    assert (y == 0).any() and (y > 0).any()
    # no bias at all
    empty = np.zeros(0, np.float32)
    check(x, w, empty, run(x, w, empty, 1, 1), 1, 1)


def test_writes_a_run_of_a_wider_blobs_channels():
    gen = np.random.default_rng(8)
    x = gen.standard_normal((1, 5, 5, 32)).astype(np.float32)
    w = gen.standard_normal((24, 32, 1, 1)).astype(np.float32)
    bias = gen.standard_normal(24).astype(np.float32)
    wide = np.full((1, 5, 5, 64), 7.0, np.float32)
    run(x, w, bias, y=wide[..., 10:34])
    check(x, w, bias, wide[..., 10:34])
    assert np.all(wide[..., :10] == 7) and np.all(wide[..., 34:] == 7)


def test_nan_and_infinity_stay_where_they_are():
    x = np.ones((1, 4, 4, 64), np.float32)
    x[0, 1, 1, 5] = np.nan
    x[0, 3, 3, 0] = np.inf
    w = np.ones((16, 64, 1, 1), np.float32)
    y = run(x, w, np.zeros(16, np.float32))
    assert np.isnan(y[0, 1, 1]).all() and np.isposinf(y[0, 3, 3]).all()
    finite = np.ones((4, 4), bool)
    finite[1, 1] = finite[3, 3] = False
    assert np.all(y[0][finite] == 64)


def test_wrong_arguments_are_refused_in_one_line():
    x = np.zeros((1, 4, 4, 8), np.float32)
    w = np.zeros((4, 8, 3, 3), np.float32)
    packed = np.empty(bf16.nhwc_packed_size(4, 8, 3, 3), np.uint16)
    scratch = np.empty(1 << 20, np.uint8)
    with pytest.raises(ValueError, match="y: needs the convolution's output shape"):
        bf16.conv_forward_nhwc(x, packed, np.zeros(0, np.float32), np.zeros((1, 4, 4, 4), np.float32),
                               scratch, 3, 3, 0, 0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="out: needs"):
        bf16.nhwc_pack_weights(w, packed[1:])
