"""The Intel path: IntelPack / IntelUnpack and the blocked layers, against NumPy references of
the layout (caffepy/kernels/reference/intel.py) and of the NCHW computation
(reference/vision.py, reference/normalization.py), for block widths 8 and 16 on any CPU; a
gradient case for every blocked variant; the plain and blocked paths read one geometry."""
import numpy as np
import pytest

from caffepy.blob import Blob, Blocked
from caffepy.errors import LayerError
from caffepy.kernels.reference import normalization as ref_norm
from caffepy.kernels.reference import vision as ref
from caffepy.layer import VIA_NCHW
from caffepy.layers import intel
from caffepy.proto import caffe_pb2
from layer_cases import (Case, blocked_blob, case_tests, distinct, make_layer, pool_expected, randn,
                         ref_pack, ref_unpack, setup_layer)

WIDTHS = [8, 16]


def blocked_layer(type_, params, bottoms, width, n_top=1, phase=caffe_pb2.TRAIN):
    """Build the implementation the factory picks for blocked bottoms (NCHW arrays)."""
    bottom = [blocked_blob(x, width, f"b{i}") for i, x in enumerate(bottoms)]
    layer = make_layer(type_, params, phase, n_bottom=len(bottoms), n_top=n_top, bottoms=bottom)
    top = [Blob(name=f"t{i}") for i in range(n_top)]
    layer.layer_setup(bottom, top)
    layer.param_propagate_down = [True] * len(layer.blobs)
    return layer, bottom, top


def run_backward(layer, bottom, top, top_diff_nchw):
    for t, d in zip(top, top_diff_nchw):
        t.diff[...] = ref_pack(d.astype(np.float32), t.layout.width)
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True] * len(bottom), bottom)


# ---------------------------------------------------------------------------------------------
# Pack / Unpack

@pytest.mark.parametrize("width", WIDTHS + [4])
@pytest.mark.parametrize("channels", [1, 3, 8, 13, 17, 32])
def test_pack_unpack_round_trip(channels, width):
    x = randn(2, channels, 5, 7, seed=channels)
    y = np.full((2, -(-channels // width), 5, 7, width), np.nan, np.float32)
    intel._k.pack(x, y)
    np.testing.assert_array_equal(y, ref_pack(x, width))
    back = np.full_like(x, np.nan)
    intel._k.unpack(y, back)
    np.testing.assert_array_equal(back, x)


def test_pack_layer_uses_block_width(monkeypatch):
    monkeypatch.setenv("CAFFEPY_BLOCK_WIDTH", "16")
    case = Case("IntelPack", "", [randn(2, 3, 4, 5)])
    layer, bottom, top = case.build()
    assert top[0].shape == (2, 1, 4, 5, 16) and top[0].layout == Blocked(16, 3)


def test_block_width_rejects_bad_values(monkeypatch):
    monkeypatch.setenv("CAFFEPY_BLOCK_WIDTH", "12")
    with pytest.raises(Exception, match="CAFFEPY_BLOCK_WIDTH: must be 4, 8, 16 or 32, got '12'"):
        intel.block_width()


# ---------------------------------------------------------------------------------------------
# Convolution: (C, O, group, kernel, stride, pad, dilation, H, W)

CONVS = [
    (3, 10, 1, 3, 1, 1, 1, 7, 6),       # conv1-like: 3 channels, plain column order
    (16, 16, 2, 3, 1, 1, 1, 6, 6),      # groups of 8 channels: vector order at width 8
    (6, 8, 2, 5, 2, 2, 1, 9, 8),        # groups of 3: plain order, stride and pad
    (3, 5, 1, 11, 4, 0, 1, 23, 19),     # conv1's kernel and stride
    (32, 24, 2, 3, 1, 1, 2, 7, 7),      # dilation, vector order at 8 and 16
    (8, 7, 1, 2, 3, 1, 1, 8, 9),        # stride past the kernel, output channels not a block
    (3, 12, 1, 3, 1, 1, 1, 12, 12),     # plain order, enough work to run the images on threads
    (3, 40, 1, 5, 2, 2, 1, 31, 30),     # direct: outputs over two vectors, rows split at batch 3
]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("spec", CONVS, ids=[f"C{c[0]}O{c[1]}g{c[2]}k{c[3]}s{c[4]}p{c[5]}d{c[6]}" for c in CONVS])
def test_blocked_convolution_matches_reference(spec, width):
    C, O, group, k, s, p, d, H, W = spec
    params = (f"convolution_param {{ num_output: {O} kernel_size: {k} stride: {s} pad: {p} "
              f"dilation: {d} group: {group} weight_filler {{ type: 'gaussian' std: 0.3 }} "
              f"bias_filler {{ type: 'gaussian' std: 0.3 }} }}")
    x = randn(3, C, H, W, seed=1)
    layer, bottom, top = blocked_layer("Convolution", params, [x], width)
    # one channel block: the direct kernel (its data gradient is Caffe's algorithm)
    assert layer.direct == (group == 1 and C <= width and not layer.winograd)
    w, b = layer.blobs[0].data.copy(), layer.blobs[1].data.copy()
    layer.forward(bottom, top)
    want = ref.conv_forward(x, w, b, (p, p), (s, s), (d, d), group)
    assert top[0].layout == Blocked(width, O)
    np.testing.assert_allclose(ref_unpack(top[0].data, O), want, rtol=1e-4, atol=1e-4)
    assert not ref_unpack(top[0].data, top[0].shape[1] * width)[:, O:].any()

    dy = randn(*want.shape, seed=2)
    run_backward(layer, bottom, top, [dy])
    dw, db, dx = ref.conv_backward(dy, x, w, (p, p), (s, s), (d, d), group)
    np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(layer.blobs[1].diff, db, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(ref_unpack(bottom[0].diff, C), dx, rtol=1e-4, atol=1e-4)
    assert not ref_unpack(bottom[0].diff, bottom[0].shape[1] * width)[:, C:].any()


def test_blocked_convolution_param_diffs_accumulate():
    params = "convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: 'gaussian' std: 1 } }"
    x = randn(2, 8, 5, 5)
    layer, bottom, top = blocked_layer("Convolution", params, [x], 8)
    layer.forward(bottom, top)
    run_backward(layer, bottom, top, [randn(2, 8, 3, 3, seed=3)])
    once = layer.blobs[0].diff.copy()
    layer.backward(top, [False], bottom)
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * once, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Pooling: (method, kernel, stride, pad, H, W) with windows over the edge (ceil rounding)

POOLS = [("MAX", 3, 2, 0, 13, 13), ("MAX", 3, 2, 1, 8, 9), ("MAX", 2, 2, 0, 7, 5),
         ("AVE", 3, 2, 1, 8, 9), ("AVE", 3, 3, 0, 10, 11), ("AVE", 2, 1, 1, 4, 4)]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("spec", POOLS, ids=[f"{m}k{k}s{s}p{p}_{h}x{w}" for m, k, s, p, h, w in POOLS])
def test_blocked_pooling_matches_reference(spec, width):
    method, k, s, p, H, W = spec
    x = randn(2, 11, H, W, seed=4)
    params = f"pooling_param {{ pool: {method} kernel_size: {k} stride: {s} pad: {p} }}"
    layer, bottom, top = blocked_layer("Pooling", params, [x], width)
    layer.forward(bottom, top)
    oh, ow = ref.pool_out_size(H, k, p, s), ref.pool_out_size(W, k, p, s)
    if method == "MAX":
        want, mask = ref.max_pool_forward(x, k, k, s, s, p, p, oh, ow)
    else:
        want = ref.ave_pool_forward(x, k, k, s, s, p, p, oh, ow)
    np.testing.assert_allclose(ref_unpack(top[0].data, 11), want, rtol=1e-5, atol=1e-6)
    dy = randn(*want.shape, seed=5)
    run_backward(layer, bottom, top, [dy])
    if method == "MAX":
        dx = ref.max_pool_backward(dy, mask, H, W)
    else:
        dx = ref.ave_pool_backward(dy, H, W, k, k, s, s, p, p)
    np.testing.assert_allclose(ref_unpack(bottom[0].diff, 11), dx, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width", WIDTHS + [4])
def test_blocked_max_pooling_ties_keep_first_maximum(width):
    # few distinct values, so most windows tie: the mask is the first maximum in row-major
    # order (Caffe's strict '>'), lane by lane, as in the NCHW kernel
    x = np.random.default_rng(15).integers(-2, 3, (2, 11, 9, 8)).astype(np.float32)
    layer, bottom, top = blocked_layer("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 }",
                                       [x], width)
    layer.forward(bottom, top)
    oh, ow = ref.pool_out_size(9, 3, 0, 2), ref.pool_out_size(8, 3, 0, 2)
    want, mask = ref.max_pool_forward(x, 3, 3, 2, 2, 0, 0, oh, ow)
    np.testing.assert_array_equal(ref_unpack(top[0].data, 11), want)
    np.testing.assert_array_equal(ref_unpack(layer.mask, 11), mask)


def test_blocked_global_pooling():
    x = randn(2, 9, 5, 6)
    layer, bottom, top = blocked_layer("Pooling", "pooling_param { pool: AVE global_pooling: true }", [x], 8)
    layer.forward(bottom, top)
    np.testing.assert_allclose(ref_unpack(top[0].data, 9)[:, :, 0, 0], x.mean(axis=(2, 3)), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# LRN across channels: the window crosses blocks

# beta 0.75 with local_size <= 9 and widths 8 / 16 take the vectorized path of the kernels (full
# and partial blocks, windows reaching 0-4 lanes into the neighbours), the others the generic one
LRNS = [(13, 5, 0.75, 1.0), (20, 5, 0.75, 2.0), (17, 3, 0.6, 1.5), (9, 7, 0.5, 1.0), (24, 5, 1.0, 1.0),
        (40, 9, 0.75, 1.0), (11, 1, 0.75, 1.0), (32, 3, 0.75, 0.5), (19, 7, 0.75, 1.0),
        (21, 11, 0.75, 1.0)]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("spec", LRNS, ids=[f"C{c}n{n}b{b}k{k}" for c, n, b, k in LRNS])
def test_blocked_lrn_matches_reference(spec, width):
    C, size, beta, k = spec
    x = randn(2, C, 4, 5, seed=6, scale=3.0)
    params = f"lrn_param {{ local_size: {size} alpha: 0.3 beta: {beta} k: {k} }}"
    layer, bottom, top = blocked_layer("LRN", params, [x], width)
    layer.forward(bottom, top)
    want, scale = ref_norm.lrn_across_forward(x, size, 0.3, beta, k)
    np.testing.assert_allclose(ref_unpack(top[0].data, C), want, rtol=1e-5, atol=1e-6)
    dy = randn(*x.shape, seed=7)
    run_backward(layer, bottom, top, [dy])
    dx = ref_norm.lrn_across_backward(x, want, scale, dy, size, 0.3, beta)
    np.testing.assert_allclose(ref_unpack(bottom[0].diff, C), dx, rtol=1e-4, atol=1e-5)
    assert not ref_unpack(bottom[0].diff, bottom[0].shape[1] * width)[:, C:].any()


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("beta", [0.75, 0.6])
def test_blocked_lrn_many_tiles(width, beta):
    # more pixels than one task takes (1188 > 1024), AlexNet's parameters
    C, size, alpha = 35, 5, 1e-2
    x = randn(2, C, 36, 33, seed=11, scale=4.0)
    params = f"lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} }}"
    layer, bottom, top = blocked_layer("LRN", params, [x], width)
    layer.forward(bottom, top)
    want, scale = ref_norm.lrn_across_forward(x, size, alpha, beta, 1.0)
    np.testing.assert_allclose(ref_unpack(top[0].data, C), want, rtol=1e-5, atol=1e-6)
    dy = randn(*x.shape, seed=12)
    run_backward(layer, bottom, top, [dy])
    dx = ref_norm.lrn_across_backward(x, want, scale, dy, size, alpha, beta)
    np.testing.assert_allclose(ref_unpack(bottom[0].diff, C), dx, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("beta", [0.75, 0.6])
def test_blocked_lrn_backward_ignores_padding_lanes(width, beta):
    # whatever sits in the padding lanes of x and of the top diff (even inf) stays out of the
    # real lanes, and the bottom diff's padding lanes come out 0
    C = 13
    x = randn(2, C, 3, 4, seed=13)
    params = f"lrn_param {{ local_size: 5 alpha: 0.5 beta: {beta} }}"
    layer, bottom, top = blocked_layer("LRN", params, [x], width)
    bottom[0].data[:, -1, :, :, C % width:] = np.inf
    layer.forward(bottom, top)
    want, scale = ref_norm.lrn_across_forward(x, 5, 0.5, beta, 1.0)
    np.testing.assert_allclose(ref_unpack(top[0].data, C), want, rtol=1e-5, atol=1e-6)
    assert not top[0].data[:, -1, :, :, C % width:].any()
    dy = randn(*x.shape, seed=14)
    top[0].diff[...] = ref_pack(dy, width)
    top[0].diff[:, -1, :, :, C % width:] = 0.5
    layer.backward(top, [True], bottom)
    dx = ref_norm.lrn_across_backward(x, want, scale, dy, 5, 0.5, beta)
    np.testing.assert_allclose(ref_unpack(bottom[0].diff, C), dx, rtol=1e-4, atol=1e-5)
    assert not bottom[0].diff[:, -1, :, :, C % width:].any()


def test_blocked_lrn_ignores_padding_lanes():
    # a Sigmoid before it would leave 0.5 in the padding lanes: they must not enter the window
    x = randn(2, 13, 3, 3, seed=8)
    layer, bottom, top = blocked_layer("LRN", "lrn_param { local_size: 5 alpha: 0.5 }", [x], 8)
    bottom[0].data[:, 1, :, :, 5:] = 0.5
    layer.forward(bottom, top)
    want, _ = ref_norm.lrn_across_forward(x, 5, 0.5, 0.75, 1.0)
    np.testing.assert_allclose(ref_unpack(top[0].data, 13), want, rtol=1e-5, atol=1e-6)
    assert not top[0].data[:, 1, :, :, 5:].any()


# ---------------------------------------------------------------------------------------------
# Concat along channels: by blocks when the channels fill them, lane by lane otherwise

@pytest.mark.parametrize("channels", [(8, 16, 5), (3, 13, 8)])
def test_blocked_concat(channels):
    xs = [randn(2, c, 3, 4, seed=c) for c in channels]
    layer, bottom, top = blocked_layer("Concat", "", xs, 8)
    layer.forward(bottom, top)
    assert layer.by_block == all(c % 8 == 0 for c in channels[:-1])
    total = sum(channels)
    np.testing.assert_array_equal(ref_unpack(top[0].data, total), np.concatenate(xs, axis=1))
    dy = randn(2, total, 3, 4, seed=9)
    run_backward(layer, bottom, top, [dy])
    offs = np.cumsum((0,) + channels)
    for b, c, lo in zip(bottom, channels, offs):
        np.testing.assert_array_equal(ref_unpack(b.diff, c), dy[:, lo:lo + c])


# ---------------------------------------------------------------------------------------------
# Gradient cases (the shared checker): IntelPack / IntelUnpack and every blocked variant, with
# NCHW references (the case unpacks the blocked tops)

def _pack_expected(x):
    return [ref_pack(x, intel.block_width())]


FILL = "weight_filler { type: 'gaussian' std: 0.3 } bias_filler { type: 'gaussian' std: 0.3 }"


def _conv_expected(pad, stride, group=1):
    def expected(x, layer):
        w, b = (blob.data.astype(np.float64) for blob in layer.blobs)
        return [ref.conv_forward(x, w, b, (pad, pad), (stride, stride), (1, 1), group)]
    return expected


def _lrn_expected(size, alpha, beta, k):
    return lambda x: [ref_norm.lrn_across_forward(x, size, alpha, beta, k)[0]]


def _batch_norm_expected(x):
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    return [(x - mean) / np.sqrt(var + 1e-5)]


def _scale_expected(x, layer):
    s, b = (blob.data.astype(np.float64).reshape(1, -1, 1, 1) for blob in layer.blobs)
    return [x * s + b]


def _lrn_within_expected(x):
    pre = 1
    padded = np.pad(x ** 2, ((0, 0), (0, 0), (pre, pre), (pre, pre)))
    box = sum(padded[:, :, i:i + x.shape[2], j:j + x.shape[3]] for i in range(3) for j in range(3))
    return [x * (1.0 + 0.8 / 9 * box) ** -0.75]


def _winograd(layer):
    assert layer.winograd, "this case is for the Winograd path"


CASES = [
    Case("IntelPack", "", [randn(2, 3, 4, 5)], expected=_pack_expected, atol=0, rtol=0),
    Case("IntelPack", "", [randn(1, 11, 3, 2, seed=1)], expected=_pack_expected, atol=0, rtol=0,
         id="IntelPack:11ch"),
    Case("IntelUnpack", "", [randn(2, 2, 3, 3, 8)],
         expected=lambda y: [y.transpose(0, 1, 4, 2, 3).reshape(2, 16, 3, 3)], atol=0, rtol=0),
    Case("Convolution", f"convolution_param {{ num_output: 5 kernel_size: 3 stride: 2 pad: 1 {FILL} }}",
         [randn(2, 3, 7, 6)], layout="blocked", expected=_conv_expected(1, 2), atol=1e-4,
         eps=0.5, id="blocked-conv-im2col"),
    Case("Convolution", f"convolution_param {{ num_output: 6 kernel_size: 1 group: 2 {FILL} }}",
         [randn(2, 4, 3, 3)], layout="blocked", expected=_conv_expected(0, 1, 2), atol=1e-4,
         eps=0.5, id="blocked-conv-group"),
    Case("Convolution", f"convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {FILL} }}",
         [randn(1, 16, 4, 5, scale=0.5)], layout="blocked", expected=_conv_expected(1, 1), atol=1e-4,
         init=_winograd, eps=0.5, id="blocked-conv-winograd"),   # linear: a wide step is exact
    Case("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }", [distinct(2, 11, 7, 8)],
         layout="blocked", expected=pool_expected("MAX", (3, 3), (2, 2), (1, 1)), id="blocked-max-pad"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }", [randn(2, 11, 7, 6)],
         layout="blocked", expected=pool_expected("AVE", (3, 3), (2, 2), (1, 1)), id="blocked-ave-pad"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 avg_include_pad: false }",
         [randn(2, 11, 7, 6)], layout="blocked",
         expected=pool_expected("AVE", (3, 3), (2, 2), (1, 1), include_pad=False),
         id="blocked-ave-pad-excluded"),
    Case("Pooling", "pooling_param { pool: AVE global_pooling: true }", [randn(2, 9, 5, 4)],
         layout="blocked", expected=pool_expected("AVE", None, (1, 1), (0, 0), global_pooling=True),
         id="blocked-ave-global"),
    Case("LRN", "lrn_param { local_size: 5 alpha: 0.8 beta: 0.75 k: 2 }", [randn(2, 11, 4, 3)],
         layout="blocked", expected=_lrn_expected(5, 0.8, 0.75, 2.0), id="blocked-lrn-across"),
    Case("LRN", "lrn_param { local_size: 3 alpha: 0.8 beta: 0.75 norm_region: WITHIN_CHANNEL }",
         [randn(2, 5, 4, 3)], layout="blocked", variant=VIA_NCHW, expected=_lrn_within_expected,
         id="blocked-lrn-within"),
    Case("Concat", "", [randn(2, 3, 3, 2), randn(2, 13, 3, 2, seed=1)], layout="blocked",
         expected=lambda a, b: [np.concatenate([a, b], axis=1)], id="blocked-concat-lanes"),
    Case("Concat", "concat_param { axis: 2 }", [randn(2, 5, 3, 2), randn(2, 5, 1, 2, seed=1)],
         layout="blocked", expected=lambda a, b: [np.concatenate([a, b], axis=2)],
         id="blocked-concat-height"),
    Case("BatchNorm", "", [randn(4, 3, 2, 3, seed=20, scale=2.0)], layout="blocked", variant=VIA_NCHW,
         expected=_batch_norm_expected, id="blocked-batchnorm"),
    Case("Scale", "scale_param { bias_term: true filler { type: 'gaussian' } bias_filler { type: 'gaussian' } }",
         [randn(2, 5, 3, 3)], layout="blocked", variant=VIA_NCHW, expected=_scale_expected,
         id="blocked-scale"),
]

test_forward, test_gradient = case_tests(CASES)


# ---------------------------------------------------------------------------------------------
# One geometry: the plain and blocked paths read the same fields with the same errors

BAD_GEOMETRY = [
    ("Convolution", "convolution_param { num_output: 4 kernel_size: 3 kernel_h: 3 kernel_w: 3 }", (8, 8)),
    ("Convolution", "convolution_param { num_output: 4 kernel_size: 3 stride: 0 }", (8, 8)),
    ("Convolution", "convolution_param { num_output: 4 kernel_size: 3 dilation: 1 dilation: 2 dilation: 1 }",
     (8, 8)),
    ("Convolution", "convolution_param { num_output: 4 }", (8, 8)),
    ("Convolution", "convolution_param { num_output: 4 kernel_size: 5 pad: 1 }", (2, 2)),
    ("Convolution", "convolution_param { num_output: 3 kernel_size: 1 group: 2 }", (4, 4)),
    ("Pooling", "pooling_param { pool: MAX kernel_size: 2 pad: 2 }", (6, 6)),
    ("Pooling", "pooling_param { pool: MAX kernel_h: 2 }", (6, 6)),
    ("Pooling", "pooling_param { pool: AVE kernel_size: 2 pad: 1 pad_h: 1 pad_w: 1 }", (6, 6)),
    ("Pooling", "pooling_param { pool: AVE global_pooling: true kernel_size: 2 }", (6, 6)),
    ("Pooling", "pooling_param { pool: AVE global_pooling: true stride: 2 }", (6, 6)),
    ("Pooling", "pooling_param { pool: STOCHASTIC kernel_size: 2 }", (6, 6)),
    ("Pooling", "pooling_param { pool: MAX kernel_size: 7 stride: 1 }", (4, 4)),
]


@pytest.mark.parametrize("type_,params,hw", BAD_GEOMETRY, ids=[p for _, p, _ in BAD_GEOMETRY])
def test_plain_and_blocked_paths_give_one_error(type_, params, hw):
    x = randn(2, 4, *hw)
    with pytest.raises(LayerError) as plain:
        setup_layer(type_, params, [x])
    with pytest.raises(LayerError) as blocked:
        setup_layer(type_, params, [x], layout="blocked")
    assert str(blocked.value) == str(plain.value)
    assert str(plain.value).startswith(f"layer 'layer' ({type_}): ") and "\n" not in str(plain.value)


@pytest.mark.parametrize("width", WIDTHS)
def test_avg_include_pad_false_gives_the_same_numbers_on_both_paths(width):
    params = "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 avg_include_pad: false }"
    x = randn(2, 11, 8, 9, seed=4)
    plain, pb, pt = setup_layer("Pooling", params, [x])
    plain.forward(pb, pt)
    layer, bottom, top = blocked_layer("Pooling", params, [x], width)
    layer.forward(bottom, top)
    np.testing.assert_allclose(ref_unpack(top[0].data, 11), pt[0].data, rtol=1e-6, atol=1e-7)
    dy = randn(*pt[0].shape, seed=5)
    pt[0].diff[...] = dy
    plain.backward(pt, [True], pb)
    run_backward(layer, bottom, top, [dy])
    np.testing.assert_allclose(ref_unpack(bottom[0].diff, 11), pb[0].diff, rtol=1e-6, atol=1e-7)


def test_unpack_refuses_a_plain_blob():
    case = Case("IntelUnpack", "", [randn(2, 3, 4, 5)])
    with pytest.raises(LayerError, match=r"layer 'layer' \(IntelUnpack\): bottom: blob 'b0' is not "
                                         r"in the blocked layout"):
        case.build()
