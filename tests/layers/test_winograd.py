"""Winograd convolution on the blocked layout (cext/winograd.pyx): the transform matrices, and
the blocked Convolution layer on its Winograd path against the NCHW reference, forward and
backward, with a numerical gradient check; the blocked layer's choice among its algorithms by
measurement."""
import json

import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import autotune
from caffepy.blob import Blob, Blocked
from caffepy.errors import CaffepyError
from caffepy.kernels import winograd
from caffepy.kernels.reference import vision as ref
from caffepy.layer import BLOCKED, create_layer
from caffepy.layers import conv_algorithms, intel
from caffepy.proto import caffe_pb2
from gradient_checker import check_gradient
from layer_cases import randn

FLAVOURS = [(2, 3), (3, 3), (4, 3), (5, 3), (6, 3), (2, 5), (3, 5), (4, 5)]


@pytest.mark.parametrize("m,r", FLAVOURS)
def test_matrices_compute_a_tile_correlation(m, r):
    at, g, bt = (t.astype(np.float64) for t in winograd.matrices(m, r))
    a = m + r - 1
    assert at.shape == (m, a) and g.shape == (a, r) and bt.shape == (a, a)
    rng = np.random.default_rng(m * 10 + r)
    d, w = rng.standard_normal((a, a)), rng.standard_normal((r, r))
    y = at @ ((g @ w @ g.T) * (bt @ d @ bt.T)) @ at.T
    want = np.array([[(d[i:i + r, j:j + r] * w).sum() for j in range(m)] for i in range(m)])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)   # the matrices are float32


@pytest.mark.parametrize("m,r", [(m, r) for r, ms in conv_algorithms.WINOGRAD_TILES.items() for m in ms])
def test_float32_error_stays_small(m, r):
    """Every tile the layers may choose, in float32 over 256 channels, within 2e-5 of the float64
    direct sum (relative to its largest value): larger tiles lose precision fast."""
    N, C, O, H, pad, width = 2, 256, 16, 13, r // 2, 16
    rng = np.random.default_rng(r * 10 + m)
    x = rng.standard_normal((N, C, H, H)).astype(np.float32)
    w = (rng.standard_normal((O, C, r, r)) * 0.05).astype(np.float32)
    at, g, bt = winograd.matrices(m, r)
    u = np.empty(((m + r - 1) ** 2, C, O), np.float32)        # the forward's layout
    winograd.weight_transform(w, g, u, 1)
    vshape, mshape = winograd.scratch_shapes(1, N, C, O, H, H, width, m, r, pad, pad)
    y = np.empty((N, H, H, O), np.float32)
    winograd.conv_forward_nhwc(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), u, np.zeros(O, np.float32),
                               y, np.empty(vshape, np.float32), np.empty(mshape, np.float32), at, bt,
                               width, O, m, r, pad, pad, 1)
    want = ref.conv_forward(x.astype(np.float64), w.astype(np.float64), np.zeros(O), (pad, pad),
                            (1, 1), (1, 1), 1)
    assert np.abs(y.transpose(0, 3, 1, 2) - want).max() <= 2e-5 * np.abs(want).max()


@pytest.mark.parametrize("group", [1, 3])
def test_weight_transform_layouts_hold_the_same_values(group):
    """The forward's layout [a*a, group * Cg, Og] is each group's block of the backward's
    [a*a, O, Cg] transposed."""
    O, Cg, m, r = 12, 5, 4, 3
    w = randn(O, Cg, r, r, seed=21)
    _, g, _ = winograd.matrices(m, r)
    u = np.empty(((m + r - 1) ** 2, O, Cg), np.float32)
    ut = np.full(((m + r - 1) ** 2, group * Cg, O // group), np.nan, np.float32)
    winograd.weight_transform(w, g, u)
    winograd.weight_transform(w, g, ut, group)
    og = O // group
    want = u.reshape(-1, group, og, Cg).transpose(0, 1, 3, 2).reshape(ut.shape)
    np.testing.assert_array_equal(ut, want)


@pytest.mark.parametrize("group", [0, 1, 2])
@pytest.mark.parametrize("O,Cg", [(64, 48), (24, 267), (12, 5)])
def test_weight_transform_streamed_holds_the_same_bits(group, O, Cg):
    """U written past the cache (stream=1, the default from STREAM_U bytes on) holds the bits
    of the plain stores, in both layouts, whole vectors or not, and on a U that starts off a
    32-byte boundary (where the streaming path falls back to plain stores)."""
    from caffepy import memory
    m, r = 4, 3
    a2 = (m + r - 1) ** 2
    w = randn(O, Cg, r, r, seed=25)
    _, g, _ = winograd.matrices(m, r)
    shape = (a2, O, Cg) if group == 0 else (a2, group * Cg, O // group)
    size = a2 * O * Cg
    for offset in (0, 1):
        plain = np.full(shape, np.nan, np.float32)
        winograd.weight_transform(w, g, plain, group, 0)
        streamed = memory.line_empty(size + 1)[offset:offset + size].reshape(shape)
        streamed[...] = np.nan
        winograd.weight_transform(w, g, streamed, group, 1)
        np.testing.assert_array_equal(streamed, plain)
    assert np.isfinite(plain).all()


def test_weight_transform_default_on_a_large_u_holds_the_same_bits():
    """A U of STREAM_U bytes or more on a cache line, as the layers' workspaces give it: the
    default streams it, with the plain stores' bits."""
    from caffepy import memory
    O, Cg, m, r = 256, 256, 5, 3
    w = randn(O, Cg, r, r, seed=26)
    _, g, _ = winograd.matrices(m, r)
    plain = np.empty((49, O, Cg), np.float32)
    assert plain.nbytes >= winograd.STREAM_U
    winograd.weight_transform(w, g, plain, 0, 0)
    u = memory.line_empty(plain.size).reshape(plain.shape)
    winograd.weight_transform(w, g, u)
    np.testing.assert_array_equal(u, plain)


@pytest.mark.parametrize("m,r,cg", [(4, 3, 267), (2, 5, 131), (3, 3, 7)])
def test_weight_transforms_against_their_formulas(m, r, cg):
    """U = G W G^T per (o, c), and dW += G^T dU G, against NumPy, with input channels over
    several of the weight gradient's runs of 128 and a part run (267 = 2 * 128 + 11), one run
    with a part lane block (131), and fewer than a lane block (7)."""
    O = 3
    w = randn(O, cg, r, r, seed=22)
    _, g, _ = winograd.matrices(m, r)
    a = m + r - 1
    u = np.empty((a * a, O, cg), np.float32)
    winograd.weight_transform(w, g, u)
    want = np.einsum("ik,ockl,jl->ijoc", g, w, g).reshape(a * a, O, cg)
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    du = randn(a * a, O, cg, seed=23)
    dw = randn(O, cg, r, r, seed=24)
    expected = dw + np.einsum("ik,ijoc,jl->ockl", g, du.reshape(a, a, O, cg), g)
    winograd.weight_grad_add(du, g, dw)
    np.testing.assert_allclose(dw, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("m,r", FLAVOURS)
def test_tile_tables_are_the_matrices(m, r):
    """The tile transforms' compile-time tables hold matrices()' values exactly, for every tile
    a layer may choose (so the layers run on them)."""
    at, _, bt = winograd.matrices(m, r)
    tables = winograd.tables(m, m + r - 1)
    if tables is None:
        assert m not in conv_algorithms.WINOGRAD_TILES.get(r, ())
        return
    np.testing.assert_array_equal(tables[0], at)
    np.testing.assert_array_equal(tables[1], bt)


def _nhwc_pass(x, w, dy, m, r, width, at, bt, g):
    """conv_forward_nhwc and conv_backward_nhwc with the matrices given: (y, dx, dW), NCHW."""
    N, C, H, W = x.shape
    O = w.shape[0]
    pad = r // 2
    u = np.empty(((m + r - 1) ** 2, O, C), np.float32)
    winograd.weight_transform(w, g, u)
    ut = np.empty(((m + r - 1) ** 2, C, O), np.float32)
    winograd.weight_transform(w, g, ut, 1)
    vshape, mshape = winograd.scratch_shapes(1, N, C, O, H, W, width, m, r, pad, pad)
    vbuf, mbuf = np.empty(vshape, np.float32), np.empty(mshape, np.float32)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    y = np.empty((N, H, W, O), np.float32)
    winograd.conv_forward_nhwc(xl, ut, np.zeros(-(-O // width) * width, np.float32), y, vbuf, mbuf,
                               at, bt, width, O, m, r, pad, pad, 1)
    dx, du = np.empty_like(xl), np.empty((1,) + u.shape, np.float32)
    winograd.conv_backward_nhwc(xl, u, np.ascontiguousarray(dy.transpose(0, 2, 3, 1)), dx, du, vbuf,
                                mbuf, at, bt, width, O, m, r, pad, pad, 1, True, True)
    dw = np.zeros_like(w)
    winograd.weight_grad_add(du[0], g, dw)
    return y.transpose(0, 3, 1, 2), dx.transpose(0, 3, 1, 2), dw


@pytest.mark.parametrize("m,r", [(4, 3), (5, 3), (2, 5)])
@pytest.mark.parametrize("width", [8, 16])
def test_tables_and_the_callers_matrices_agree(m, r, width):
    """Given other valid matrices (AT doubled and BT halved: the same correlation), the
    kernels run on them instead of the tables, and both give the reference's values, forward
    and backward, with channels that leave a part lane block."""
    N, C, O, H, W = 2, width + 3, width + 5, 11, 9
    x, w = randn(N, C, H, W, seed=41), randn(O, C, r, r, seed=42)
    dy = randn(N, O, H, W, seed=43)
    at, g, bt = winograd.matrices(m, r)
    tabled = _nhwc_pass(x, w, dy, m, r, width, at, bt, g)
    other = _nhwc_pass(x, w, dy, m, r, width, at * 2, bt * 0.5, g)
    pad = r // 2
    want_y = ref.conv_forward(x, w, np.zeros(O), (pad, pad), (1, 1), (1, 1), 1)
    want_dw, _, want_dx = ref.conv_backward(dy, x, w, (pad, pad), (1, 1), (1, 1), 1)
    for got in (tabled, other):
        for value, want in zip(got, (want_y, want_dx, want_dw)):
            np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_matrices_refuse_a_tile_too_large():
    with pytest.raises(ValueError, match="tile side"):
        winograd.matrices(6, 5)


@pytest.mark.parametrize("r,oh,ow,m", [(3, 13, 13, 5), (3, 7, 7, 4), (3, 28, 28, 4), (3, 3, 3, 3),
                                       (3, 2, 2, 2), (5, 27, 27, 4), (5, 2, 2, 2)])
def test_tile_choice_minimises_multiplies(r, oh, ow, m):
    assert conv_algorithms.winograd_tile(r, oh, ow) == m


def _layer(C, O, k, pad, group, width, engine="DEFAULT", bias=True):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(f"""name: "conv" type: "Convolution" bottom: "b" top: "t"
        convolution_param {{ num_output: {O} kernel_size: {k} pad: {pad} group: {group}
        engine: {engine} bias_term: {str(bias).lower()}
        weight_filler {{ type: "gaussian" std: 0.2 }} bias_filler {{ type: "gaussian" std: 0.2 }} }}""", lp)
    layer = create_layer(lp, caffe_pb2.TRAIN, variant=BLOCKED)
    return layer


def _blocked(x, width):
    n, c, h, w = x.shape
    b = Blob(name="b")
    b.reshape(n, -(-c // width), h, w, width)
    intel._k.pack(np.ascontiguousarray(x, np.float32), b.data)
    b.layout = Blocked(width, c)
    return b


def _unpack(data, channels):
    n, cb, h, w, v = data.shape
    out = np.empty((n, channels, h, w), np.float32)
    intel._k.unpack(np.ascontiguousarray(data), out)
    return out


def _padding_lanes(data, channels):
    n, cb, h, w, v = data.shape
    return data.transpose(0, 1, 4, 2, 3).reshape(n, cb * v, h, w)[:, channels:]


# (N, C, O, kernel, pad, group, H, W): odd channel counts, groups, edges, small and large images
SHAPES = [
    (3, 16, 16, 3, 1, 1, 13, 13),       # AlexNet conv3-like: F(5x5, 3x3)
    (3, 16, 16, 3, 1, 1, 7, 7),         # F(4x4, 3x3)
    (5, 20, 36, 3, 1, 1, 9, 11),        # channels past a block, images not a whole tile count
    (4, 32, 48, 3, 1, 2, 13, 13),       # groups, AlexNet conv4/5-like
    (2, 16, 24, 3, 0, 1, 8, 7),         # no padding
    (2, 16, 17, 3, 2, 1, 5, 6),         # padding wider than the tile overlap
    (3, 16, 16, 3, 1, 1, 3, 3),         # one tile: F(3x3, 3x3)
    (2, 32, 32, 5, 2, 2, 14, 13),       # AlexNet conv2-like: F(4x4, 5x5)
    (2, 16, 16, 5, 2, 1, 9, 9),         # F(3x3, 5x5)
    (2, 16, 16, 5, 2, 1, 2, 2),         # one output tile: F(2x2, 5x5)
]


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("spec", SHAPES, ids=[f"N{s[0]}C{s[1]}O{s[2]}k{s[3]}p{s[4]}g{s[5]}_{s[6]}x{s[7]}"
                                             for s in SHAPES])
def test_winograd_convolution_matches_reference(spec, width):
    N, C, O, k, pad, group, H, W = spec
    layer = _layer(C, O, k, pad, group, width)
    x = randn(N, C, H, W, seed=3)
    bottom, top = [_blocked(x, width)], [Blob(name="t")]
    layer.layer_setup(bottom, top)
    layer.param_propagate_down = [True, True]
    assert layer.winograd, "this shape should take the Winograd path"
    w, b = layer.blobs[0].data.copy(), layer.blobs[1].data.copy()
    layer.forward(bottom, top)
    want = ref.conv_forward(x, w, b, (pad, pad), (1, 1), (1, 1), group)
    got = _unpack(top[0].data, O)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not _padding_lanes(top[0].data, O).any()

    dy = randn(*want.shape, seed=4)
    top[0].diff[...] = _blocked(dy, width).data
    for blob in layer.blobs:
        blob.diff[...] = 0
    bottom[0].diff[...] = np.nan          # overwritten, never read
    layer.backward(top, [True], bottom)
    dw, db, dx = ref.conv_backward(dy, x, w, (pad, pad), (1, 1), (1, 1), group)
    np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-4, atol=1e-4 * np.abs(dw).max())
    np.testing.assert_allclose(layer.blobs[1].diff, db, rtol=1e-4, atol=1e-4 * np.abs(db).max())
    np.testing.assert_allclose(_unpack(bottom[0].diff, C), dx, rtol=1e-4, atol=1e-4 * np.abs(dx).max())
    assert not _padding_lanes(bottom[0].diff, C).any()


def test_engine_caffe_keeps_the_im2col_path():
    layer = _layer(16, 16, 3, 1, 1, 8, engine="CAFFE")
    layer.layer_setup([_blocked(randn(1, 16, 5, 5), 8)], [Blob(name="t")])
    assert not layer.winograd


@pytest.mark.parametrize("k,stride,dilation,channels", [(3, 2, 1, 16), (3, 1, 2, 16), (1, 1, 1, 16),
                                                         (3, 1, 1, 8)])
def test_winograd_only_where_it_applies(k, stride, dilation, channels):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(f"""name: "conv" type: "Convolution" convolution_param {{ num_output: 16
        kernel_size: {k} stride: {stride} dilation: {dilation} pad: 1 }}""", lp)
    layer = create_layer(lp, caffe_pb2.TRAIN, variant=BLOCKED)
    layer.layer_setup([_blocked(randn(1, channels, 9, 9), 8)], [Blob(name="t")])
    assert not layer.winograd


def test_winograd_weight_diffs_accumulate():
    layer = _layer(16, 16, 3, 1, 1, 8)
    bottom, top = [_blocked(randn(2, 16, 6, 6), 8)], [Blob(name="t")]
    layer.layer_setup(bottom, top)
    layer.param_propagate_down = [True, True]
    layer.forward(bottom, top)
    top[0].diff[...] = _blocked(randn(2, 16, 6, 6, seed=5), 8).data
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, [True], bottom)
    once = [blob.diff.copy() for blob in layer.blobs]
    layer.backward(top, [False], bottom)
    for blob, first in zip(layer.blobs, once):
        np.testing.assert_allclose(blob.diff, 2 * first, rtol=1e-5, atol=1e-6)


def test_winograd_gradient_is_numerically_right():
    layer = _layer(32, 32, 3, 1, 2, 8)
    bottom, top = [_blocked(randn(1, 32, 4, 5, seed=6), 8)], [Blob(name="t")]
    layer.layer_setup(bottom, top)
    layer.param_propagate_down = [True, True]
    assert layer.winograd
    # the layer is linear, so a wide step is exact and keeps float32 rounding out of the quotient
    check_gradient(layer, bottom, top, eps=0.5, max_checks=60)


@pytest.mark.parametrize("budget,spread", [(1, False), (1 << 40, False), (1, True)],
                         ids=["short-passes", "one-pass", "spread"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("spaced", [False, True], ids=["contiguous", "spaced"])
def test_passes_split_and_span_images(budget, spread, threads, group, spaced):
    """A thread's task (whole images) runs in passes of scratch_shapes' size. With a tiny budget
    and one thread a pass is 30 tiles (MIN_ROWS, evened out): it ends inside an image (4 x 6 =
    24 tiles) and runs on into the next. With a huge one it is the whole task. Spread, the
    threads share one pass over the batch (each GEMM over every tile). All give the
    reference's values; the data gradient sums the tiles of one image across passes. Spaced,
    the buffers are the layers' (scratch_view), with NaN between the tile positions. The
    forward again on U packed once (pack_u: a TEST net's)."""
    N, C, O, H, W, m, r, pad, width = 5, 20, 36, 14, 22, 4, 3, 1, 8
    x, w = randn(N, C, H, W, seed=11), randn(O, C // group, r, r, seed=12)
    at, g, bt = winograd.matrices(m, r)
    u = np.empty(((m + r - 1) ** 2, O, C // group), np.float32)      # the backward's layout
    winograd.weight_transform(w, g, u)
    ut = np.empty(((m + r - 1) ** 2, C, O // group), np.float32)     # the forward's
    winograd.weight_transform(w, g, ut, group)
    vshape, mshape = winograd.scratch_shapes(threads, N, C, O, H, W, width, m, r, pad, pad, group, budget,
                                             spread)
    task_tiles = -(-N // threads) * 4 * 6
    if spread:
        assert vshape[0] == 1 and vshape[2] == N * 4 * 6
    else:
        assert vshape[0] == threads and (vshape[2] < task_tiles) == (budget == 1)
    if spaced:
        vbuf, mbuf = (winograd.scratch_view(np.full(winograd.scratch_floats(s), np.nan, np.float32), s)
                      for s in (vshape, mshape))
        assert not vbuf.flags.c_contiguous and not mbuf.flags.c_contiguous
    else:
        vbuf, mbuf = np.empty(vshape, np.float32), np.empty(mshape, np.float32)
    bias = np.zeros(-(-O // width) * width, np.float32)
    bias[:O] = randn(O, seed=13)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    y = np.empty((N, H, W, O), np.float32)
    winograd.conv_forward_nhwc(xl, ut, bias, y, vbuf, mbuf, at, bt, width, O, m, r, pad, pad, group)
    want = ref.conv_forward(x, w, bias[:O], (pad, pad), (1, 1), (1, 1), group)
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # U packed once (a TEST net's): the same passes on the panels
    packed = np.full(winograd.packed_u_floats(ut.shape[0], group, C // group, O // group), np.nan,
                     np.float32)
    winograd.pack_u(ut, group, packed)
    y_packed = np.full_like(y, np.nan)
    winograd.conv_forward_nhwc(xl, ut, bias, y_packed, vbuf, mbuf, at, bt, width, O, m, r, pad,
                               pad, group, packed)
    np.testing.assert_allclose(y_packed.transpose(0, 3, 1, 2), want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())

    dy = randn(*want.shape, seed=14)
    dyl = np.ascontiguousarray(dy.transpose(0, 2, 3, 1))
    dx = np.full_like(xl, np.nan)                   # overwritten, never read
    du = np.full((vshape[0],) + u.shape, np.nan, np.float32)        # overwritten
    winograd.conv_backward_nhwc(xl, u, dyl, dx, du, vbuf, mbuf, at, bt, width, O, m, r, pad, pad, group,
                                True, True)
    dw = np.zeros_like(w)
    winograd.weight_grad_add(du[0], g, dw)
    want_dw, _, want_dx = ref.conv_backward(dy, x, w, (pad, pad), (1, 1), (1, 1), group)
    np.testing.assert_allclose(dx.transpose(0, 3, 1, 2), want_dx, rtol=1e-4,
                               atol=1e-4 * np.abs(want_dx).max())
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4 * np.abs(want_dw).max())


@pytest.mark.parametrize("rows,cols", [(44, 256), (44, 96), (1, 16), (64, 64), (3, 5)])
def test_tile_positions_are_spaced_off_page_multiples(rows, cols):
    """Positions one cache line past a multiple of 4 KB: the a*a positions of a tile (a*a <= 64)
    then fall in different cache sets; a view of the buffer is cache-line aligned."""
    s = winograd.position_stride(rows, cols)
    assert rows * cols <= s < rows * cols + 1024 and s % 1024 == 16
    shape = (2, 64, rows, cols)
    view = winograd.scratch_view(np.zeros(winograd.scratch_floats(shape), np.float32), shape)
    assert view.shape == shape and view.strides[1] == 4 * s and view.ctypes.data % 64 == 0
    with pytest.raises(ValueError, match="scratch_view: raw"):
        winograd.scratch_view(np.zeros(rows * cols, np.float32), shape)


def test_overlapping_tile_positions_are_refused():
    N, C, O, H, m, r, width = 1, 8, 8, 6, 2, 3, 8
    at, g, bt = winograd.matrices(m, r)
    vshape, mshape = winograd.scratch_shapes(1, N, C, O, H, H, width, m, r, 1, 1)
    raw = np.zeros(vshape[2] * vshape[3] * 2, np.float32)
    squeezed = np.lib.stride_tricks.as_strided(raw, vshape, (0, 4 * width, 4 * vshape[3], 4))
    with pytest.raises(ValueError, match="vbuf, mbuf: need contiguous rows"):
        winograd.conv_forward_nhwc(np.zeros((N, H, H, C), np.float32), np.zeros((16, C, O), np.float32),
                                   np.zeros(O, np.float32), np.zeros((N, H, H, O), np.float32),
                                   squeezed, np.zeros(mshape, np.float32), at, bt, width, O, m, r, 1,
                                   1, 1)


@pytest.mark.parametrize("C,k,pad,names", [
    (16, 3, 1, {"im2col+gemm", "winograd F(2,3)", "winograd F(3,3)", "winograd F(4,3)",
                "winograd F(5,3)"}),
    (3, 5, 2, {"im2col+gemm", "direct"}),           # a first layer: its channels one block
], ids=["winograd", "first-layer"])
def test_blocked_convolution_measures_its_algorithms(tmp_path, monkeypatch, C, k, pad, names):
    """With measuring on, the forward and the backward each take the fastest candidate, stored
    in the cache under the blocked layer's keys; every candidate, forced, gives the reference's
    values forward and backward (the direct one's data gradient is Caffe's)."""
    from caffepy import autotune
    monkeypatch.setenv("CAFFEPY_AUTOTUNE", "1")
    monkeypatch.setenv("CAFFEPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_cache", None)
    N, O, H, W, width = 2, 16, 9, 11, 8
    layer = _layer(C, O, k, pad, 1, width)
    x = randn(N, C, H, W, seed=31)
    bottom, top = [_blocked(x, width)], [Blob(name="t")]
    layer.layer_setup(bottom, top)
    layer.param_propagate_down = [True, True]
    assert set(layer.algorithms) == names
    assert [p.split(" ")[:2] for p in layer.tuning.split("; ")] == [["forward", "measured"],
                                                                   ["backward", "measured"]]
    stored = json.loads((tmp_path / "autotune.json").read_text())
    keys = [key for section in stored.values() for key in section]
    assert sorted(key.rsplit(" ", 1)[1] for key in keys) == ["backward", "forward"]
    assert all(key.startswith(f"Blocked Convolution {autotune.batch_class(N)}x{C}x{H}x{W} v{width} -> "
                              f"{O} k{k}x{k}")
               for key in keys)
    for b in layer.blobs:                   # the trials leave the parameter gradients alone
        assert not b.diff.any()
    w, bias = layer.blobs[0].data.copy(), layer.blobs[1].data.copy()
    want = ref.conv_forward(x, w, bias, (pad, pad), (1, 1), (1, 1), 1)
    dy = randn(*want.shape, seed=32)
    dw, db, dx = ref.conv_backward(dy, x, w, (pad, pad), (1, 1), (1, 1), 1)
    for name in sorted(names):
        layer.force_algorithm(name)
        assert layer.algorithm == name
        layer.forward(bottom, top)
        np.testing.assert_allclose(_unpack(top[0].data, O), want, rtol=1e-4,
                                   atol=1e-4 * np.abs(want).max(), err_msg=name)
        top[0].diff[...] = _blocked(dy, width).data
        for blob in layer.blobs:
            blob.diff[...] = 0
        bottom[0].diff[...] = np.nan
        layer.backward(top, [True], bottom)
        for got, expected, what in ((layer.blobs[0].diff, dw, "dw"), (layer.blobs[1].diff, db, "db"),
                                    (_unpack(bottom[0].diff, C), dx, "dx")):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(),
                                       err_msg=f"{name} {what}")
    with pytest.raises(CaffepyError, match="no algorithm"):
        layer.force_algorithm("winograd F(9,3)")


def test_tile_buffer_views_are_kept_until_the_workspace_grows():
    shapes = winograd.scratch_shapes(1, 1, 8, 8, 6, 6, 8, 2, 3, 1, 1, 1)
    work = conv_algorithms._workspace
    first = conv_algorithms.winograd_buffers(*shapes, work)
    again = conv_algorithms.winograd_buffers(*shapes, work)
    assert all(a is b for a, b in zip(first, again))        # kept: no view made again
    for name in ("wino_v", "wino_m"):                       # both buffers grow
        work(name, (work(name, (1,)).base.size + 1,))
    after = conv_algorithms.winograd_buffers(*shapes, work)
    for view, old, name in zip(after, first, ("wino_v", "wino_m")):
        assert view is not old and not np.shares_memory(view, old)
        assert np.shares_memory(view, work(name, (1,)))     # made over the new buffer


def test_a_batch_smaller_than_the_threads_is_spread():
    # a task is whole images: one image on two threads would leave one idle, so the threads
    # share its tiles (U here, 36 x 64 x 64 floats, is not large enough to spread for its own sake)
    vshape, mshape = winograd.scratch_shapes(2, 1, 64, 64, 28, 28, 8, 4, 3, 1, 1)
    assert vshape[0] == mshape[0] == 1 and vshape[2] == 7 * 7
    vshape, _ = winograd.scratch_shapes(2, 2, 64, 64, 28, 28, 8, 4, 3, 1, 1)
    assert vshape[0] == 2                           # an image a thread
    vshape, _ = winograd.scratch_shapes(1, 1, 64, 64, 28, 28, 8, 4, 3, 1, 1)
    assert vshape[0] == 1 and vshape[2] <= 7 * 7    # one thread: its own passes


@pytest.mark.parametrize("m,r,threads,spread", [(4, 3, 2, False), (2, 3, 1, False),
                                                 (2, 5, 2, True)])
def test_a_forward_into_a_run_of_a_wider_blobs_channels(m, r, threads, spread):
    """y a slice of a wider channels-last array's last axis (a concat's top written in place):
    the same bits in its channels as into an array of its own (with a part lane block: 11
    outputs in blocks of 8), the other channels untouched, per-thread tasks and spread alike."""
    N, C, O, H, W, lo, wide, width, pad = 3, 6, 11, 9, 10, 5, 23, 8, r // 2
    x, w = randn(N, C, H, W, seed=51), randn(O, C, r, r, seed=52)
    at, g, bt = conv_algorithms.winograd_matrices(m, r)
    ut = np.empty(((m + r - 1) ** 2, C, O), np.float32)
    winograd.weight_transform(w, g, ut, 1)
    vshape, mshape = winograd.scratch_shapes(threads, N, C, O, H, W, width, m, r, pad, pad,
                                             spread=spread)
    vbuf, mbuf = np.empty(vshape, np.float32), np.empty(mshape, np.float32)
    bias = np.zeros(-(-O // width) * width, np.float32)
    bias[:O] = randn(O, seed=53)
    xl = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    own = np.empty((N, H, W, O), np.float32)
    args = (vbuf, mbuf, at, bt, width, O, m, r, pad, pad, 1, None, True)
    winograd.conv_forward_nhwc(xl, ut, bias, own, *args)
    full = np.full((N, H, W, wide), -3.25, np.float32)
    winograd.conv_forward_nhwc(xl, ut, bias, full[..., lo:lo + O], *args)
    np.testing.assert_array_equal(full[..., lo:lo + O].view(np.int32), own.view(np.int32))
    assert (full[..., :lo] == -3.25).all() and (full[..., lo + O:] == -3.25).all()
    assert (own == 0).any()                                     # the ReLU cut something
