"""The kernels' instruction-set paths (caffepy/isa.py): the rule that picks one, and every path
this machine can run against the NumPy references. A path the CPU lacks, or that was not built,
is skipped with the reason ("AVX-512 path: CPU lacks avx512f, ...")."""
import numpy as np
import pytest

from caffepy import isa
from caffepy.kernels.reference import nhwc as ref_nhwc
from caffepy.kernels.reference import normalization as ref_norm
from caffepy.kernels.reference import vision as ref
from caffepy.layers import conv_algorithms

V3 = {"avx", "avx2", "fma"}
V4 = V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
INTEL, AMD = ("GenuineIntel", 6), ("AuthenticAMD", 0x19)
ZEN5 = ("AuthenticAMD", 0x1A)


@pytest.fixture
def both_built(monkeypatch):
    monkeypatch.setattr(isa, "built", lambda path: ["winograd"])


def never(*_):
    raise AssertionError("measured where the rule needs no measurement")


@pytest.mark.parametrize("flags,cpu,want", [(V3, INTEL, "avx2"), (V4, INTEL, "avx512"),
                                            (V4, ZEN5, "avx512"), (V3, AMD, "avx2")])
def test_the_widest_path_the_cpu_has(both_built, flags, cpu, want):
    assert isa.choose(flags, *cpu, "", never)[0] == want


@pytest.mark.parametrize("ratio,want", [(1.02, "avx2"), (1.3, "avx512")])
def test_zen4_takes_avx512_only_when_measured_faster(both_built, ratio, want):
    path, how = isa.choose(V4, *AMD, "", lambda: ratio)
    assert path == want and f"{ratio:.2f}x" in how


def test_an_avx512_cpu_without_the_avx512_build_runs_avx2(monkeypatch):
    monkeypatch.setattr(isa, "built", lambda path: [] if path == "avx512" else ["winograd"])
    assert isa.choose(V4, *INTEL, "", never)[0] == "avx2"
    assert isa.unavailable("avx512", V4).startswith("not built")


def test_env_forces_a_path_it_can_run(both_built):
    assert isa.choose(V4, *INTEL, "avx2", never) == ("avx2", "CAFFEPY_ISA")
    assert isa.choose(V4, *AMD, "avx512", lambda: 0.5) == ("avx512", "CAFFEPY_ISA")


@pytest.mark.parametrize("env,warning", [("avx512", "CAFFEPY_ISA=avx512: AVX-512 path CPU lacks avx512f"),
                                         ("sse", "CAFFEPY_ISA: must be one of avx2, avx512, got 'sse'")])
def test_env_asking_for_what_cannot_run_warns_and_runs_the_rule(both_built, capsys, env, warning):
    assert isa.choose(V3, *INTEL, env, never)[0] == "avx2"
    assert warning in capsys.readouterr().err


def test_block_width_follows_the_path_in_use(monkeypatch):
    monkeypatch.delenv("CAFFEPY_BLOCK_WIDTH", raising=False)
    assert conv_algorithms.block_width() == isa.LANES[isa.selected()[0]]


def test_device_query_says_the_path_and_the_skipped_ones(capsys):
    from caffepy import device, log
    log.set_quiet(False)
    device.query()
    err = capsys.readouterr().err
    assert f"Kernels: {isa.NAMES[isa.selected()[0]]} (" in err
    for path in isa.PATHS:
        assert (f"{isa.NAMES[path]} path: " in err) == bool(isa.unavailable(path))


# ---- every path against the references -------------------------------------------------------

def path_params():
    return [pytest.param(p, marks=pytest.mark.skipif(bool(isa.unavailable(p)), reason=str(isa.skip_reason(p))))
            for p in isa.PATHS]


@pytest.fixture(params=path_params())
def path(request):
    return request.param


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_kernels_come_from_the_paths_build(path):
    for name in isa.built(path):
        assert isa.load(name, path).__file__.startswith(isa.directory(path))


@pytest.mark.parametrize("m,r", [(m, r) for r, ms in conv_algorithms.WINOGRAD_TILES.items() for m in ms])
@pytest.mark.parametrize("layout", ["nhwc", "blocked"])
def test_winograd_forward(path, m, r, layout):
    """Every tile the layers choose, at the path's block width (its unrolled code) and at a
    width it is not unrolled for (the generic code), against the float64 direct sum."""
    wg, intel = isa.load("winograd", path), isa.load("intel", path)
    N, C, O, H, pad = 2, 20, 24, 11, r // 2
    x, w, b = rand(N, C, H, H, seed=1), rand(O, C, r, r, seed=2) * 0.2, rand(O, seed=3)
    want = ref.conv_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                            (pad, pad), (1, 1), (1, 1), 1)
    at, g, bt = wg.matrices(m, r)
    u = np.empty(((m + r - 1) ** 2, C, O), np.float32)
    wg.weight_transform(w, g, u, 1)
    for v in (isa.LANES[path], 4):
        vshape, mshape = wg.scratch_shapes(1, N, C, O, H, H, v, m, r, pad, pad)
        vb, mb = np.empty(vshape, np.float32), np.empty(mshape, np.float32)
        bp = np.zeros(-(-O // v) * v, np.float32)       # the kernels take the bias padded to V
        bp[:O] = b
        if layout == "nhwc":
            y = np.empty((N, H, H, O), np.float32)
            wg.conv_forward_nhwc(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), u, bp, y, vb, mb, at,
                                 bt, v, O, m, r, pad, pad, 1)
            got = y.transpose(0, 3, 1, 2)
        else:
            xb = np.empty((N, -(-C // v), H, H, v), np.float32)
            intel.pack(x, xb)
            yb = np.empty((N, -(-O // v), H, H, v), np.float32)
            wg.conv_forward(xb, u, bp, yb, vb, mb, at, bt, C, O, m, r, pad, pad, 1)
            got = np.empty((N, O, H, H), np.float32)
            intel.unpack(yb, got)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=f"V={v}")


@pytest.mark.parametrize("C", [37, 107])     # whole vectors and a tail; runs of 64, 32, 8, 3
def test_channels_last_pooling_and_depthwise(path, C):
    k = isa.load("nhwc", path)
    N, H = 2, 9
    x = rand(N, H, H, C, seed=4)
    xc = x.transpose(0, 3, 1, 2).astype(np.float64)
    oh = ref.pool_out_size(H, 3, 1, 2)
    y, mask = np.empty((N, oh, oh, C), np.float32), np.empty((N, oh, oh, C), np.int32)
    k.pool_max_forward(x, y, mask, 3, 3, 2, 2, 1, 1)
    want, want_mask = ref.max_pool_forward(xc, 3, 3, 2, 2, 1, 1, oh, oh)
    np.testing.assert_array_equal(y.transpose(0, 3, 1, 2), want)
    np.testing.assert_array_equal(mask.transpose(0, 3, 1, 2), want_mask)
    alone = np.empty_like(y)                    # a TEST net's: the maxima without positions
    k.pool_max_forward(x, alone, None, 3, 3, 2, 2, 1, 1)
    np.testing.assert_array_equal(alone, y)
    k.pool_ave_forward(x, y, 3, 3, 2, 2, 1, 1)
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), ref.ave_pool_forward(xc, 3, 3, 2, 2, 1, 1, oh, oh),
                               rtol=1e-6, atol=1e-6)
    w, b = rand(9, C, seed=5), rand(C, seed=6)
    yd = np.empty((N, H, H, C), np.float32)
    k.dw_forward(x, w, b, yd, 3, 3, 1, 1, 1, 1, 1, 1)
    wref = w.T.reshape(C, 1, 3, 3).astype(np.float64)
    want = ref.conv_forward(xc, wref, b.astype(np.float64), (1, 1), (1, 1), (1, 1), C)
    np.testing.assert_allclose(yd.transpose(0, 3, 1, 2), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("geometry", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (1, 0, 1)],
                         ids=["s1", "s2", "dilated", "no-pad"])
@pytest.mark.parametrize("C", [16, 48, 64, 80])
def test_depthwise_tiles_sum_as_the_pixel_by_pixel_rows(path, C, geometry):
    """nhwc_dw_rows.h: the interior of a row runs in tiles of 8 pixels (4 at 8 lanes) by one or
    two vectors of channels, the borders and channel counts that are not whole vectors pixel by
    pixel: each pixel's sums in the same order. Channels [0, C) of a C + 1 channel run (all
    pixel by pixel) give the same floats, forward (with and without bias and ReLU) and the
    stride-1 data gradient; and both match float64."""
    k = isa.load("nhwc", path)
    s, p, d = geometry
    N, H, W = 2, 5, 23
    x = rand(N, H, W, C + 1, seed=7)
    w, b = rand(9, C + 1, seed=8), rand(C + 1, seed=9)
    oh, ow = ref.conv_out_size(H, 3, p, s, d), ref.conv_out_size(W, 3, p, s, d)
    args = (3, 3, p, p, s, s, d, d)
    for bias in (b, np.empty(0, np.float32)):
        for relu in (False, True):
            tiled, whole = np.empty((N, oh, ow, C), np.float32), np.empty((N, oh, ow, C + 1), np.float32)
            k.dw_forward(np.ascontiguousarray(x[..., :C]), np.ascontiguousarray(w[:, :C]),
                         bias[:C].copy(), tiled, *args, relu)
            k.dw_forward(x, w, bias, whole, *args, relu)
            np.testing.assert_array_equal(tiled, whole[..., :C])
    want = ref.conv_forward(x[..., :C].transpose(0, 3, 1, 2).astype(np.float64),
                            w[:, :C].T.reshape(C, 1, 3, 3).astype(np.float64),
                            b[:C].astype(np.float64), (p, p), (s, s), (d, d), C)
    k.dw_forward(np.ascontiguousarray(x[..., :C]), np.ascontiguousarray(w[:, :C]), b[:C].copy(),
                 tiled, *args, False)
    np.testing.assert_allclose(tiled.transpose(0, 3, 1, 2), want, rtol=1e-5, atol=1e-5)
    if s == 1:
        dy = rand(N, oh, ow, C + 1, seed=10)
        dx_tiled, dx_whole = np.empty((N, H, W, C), np.float32), np.empty_like(x)
        acc, db = np.zeros((k.max_threads(), 9, C + 1), np.float32), np.zeros((k.max_threads(), C + 1), np.float32)
        k.dw_backward(np.ascontiguousarray(x[..., :C]), np.ascontiguousarray(w[:, :C]),
                      np.ascontiguousarray(dy[..., :C]), dx_tiled, acc[:, :, :C].copy(),
                      db[:, :C].copy(), *args, True, False, False)
        k.dw_backward(x, w, dy, dx_whole, acc, db, *args, True, False, False)
        np.testing.assert_array_equal(dx_tiled, dx_whole[..., :C])


@pytest.mark.parametrize("kk", [5, 7])
@pytest.mark.parametrize("o", [5, 20, 37, 64, 70, 100])   # 1-4 vectors of outputs; 4 + 1, 4 + 3
def test_channels_last_direct_forward(path, o, kk):
    """The direct kernel's register tiles (nhwc_direct.h: up to 4 vectors of outputs by 6 pixels),
    pixel counts that leave a short tile, against float64. 7 x 7 x 3 taps: at 16 lanes their
    weights for 4 vectors outgrow 60% of an L1 of 32 or 48 KB, so the blocks take 2 vectors
    (cd_forward_vectors)."""
    k = isa.load("nhwc", path)
    n, c, h, w, stride, pad = 2, 3, 9, 7, 2, 2     # 5 x 4 outputs at 5 x 5: not whole tiles
    x = rand(n, h, w, c, seed=8)
    weights = rand(o, c, kk, kk, seed=9)
    bias = rand(o, seed=10)
    v, _ = k.direct_widths()
    op = -(-o // v) * v
    wp = np.zeros((kk * kk * c, op), np.float32)
    wp[:, :o] = weights.transpose(2, 3, 1, 0).reshape(-1, o)
    bp = np.zeros(op, np.float32)
    bp[:o] = bias
    oh, ow = (h + 2 * pad - kk) // stride + 1, (w + 2 * pad - kk) // stride + 1
    geometry = (kk, kk, pad, pad, stride, stride, 1, 1)
    xpad = np.zeros((k.max_threads(), k.conv_direct_plane(h, w, c, *geometry)), np.float32)
    y = np.empty((n, oh, ow, o), np.float32)
    k.conv_direct_forward(x, c, wp, bp, y.reshape(n, -1), o, o, o, 0, xpad, *geometry)
    want = ref.conv_forward(x.transpose(0, 3, 1, 2).astype(np.float64),
                            weights.astype(np.float64), bias.astype(np.float64), (pad, pad),
                            (stride, stride), (1, 1), 1)
    np.testing.assert_allclose(y.transpose(0, 3, 1, 2), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("c", [3, 16, 37, 48])     # one short vector, one whole, a tail, whole
@pytest.mark.parametrize("size,beta", [(5, 0.75), (5, 0.5), (3, 0.75), (5, 1.0)])
def test_channels_last_lrn(path, c, size, beta):
    """The window of 5 from shifted vectors and the inverse roots by estimate and a Newton step
    (nhwc_lrn_rows.h): within a few ulp of the float64 reference, forward and backward."""
    k = isa.load("nhwc", path)
    x = rand(2 * 3 * 4, c, seed=11) * 3
    xc = x.reshape(2, 3, 4, c).transpose(0, 3, 1, 2).astype(np.float64)
    y = np.empty_like(x)
    work = np.empty((k.max_threads(), k.lrn_work_size(c, size)), np.float32)
    k.lrn_forward(x, y, size, 0.9, beta, 1.5, work)
    want, scale = ref_norm.lrn_across_forward(xc, size, 0.9, beta, 1.5)
    np.testing.assert_allclose(y.reshape(2, 3, 4, c).transpose(0, 3, 1, 2), want, rtol=2e-6,
                               atol=1e-7)
    dy = rand(2 * 3 * 4, c, seed=12)
    dx = np.empty_like(x)
    k.lrn_backward(x, dy, dx, size, 0.9, beta, 1.5, work)
    dyc = dy.reshape(2, 3, 4, c).transpose(0, 3, 1, 2).astype(np.float64)
    want_dx = ref_norm.lrn_across_backward(xc, want, scale, dyc, size, 0.9, beta)
    np.testing.assert_allclose(dx.reshape(2, 3, 4, c).transpose(0, 3, 1, 2), want_dx, rtol=1e-5,
                               atol=1e-6)


def test_channels_last_batchnorm_scale_relu_and_transposes(path):
    k = isa.load("nhwc", path)
    M, C = 50, 48
    x = rand(M, C, seed=7)
    sub, mul, gamma, beta = (rand(C, seed=s) for s in (8, 9, 10, 11))
    y, xn = np.empty_like(x), np.empty_like(x)
    k.bn_scale_forward(x, sub, mul, gamma, beta, y, xn, relu=0.1)
    z = (x.astype(np.float64) - sub) * mul
    v = z * gamma + beta
    np.testing.assert_allclose(xn, z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, np.where(v > 0, v, 0.1 * v), rtol=1e-5, atol=1e-5)
    s1, s2 = np.empty(C), np.empty(C)
    k.channel_moments(x, sub, s1, s2, np.empty((k.max_threads(), 2 * C), np.float32),
                      np.empty((k.max_threads(), 2 * C)))
    d = x.astype(np.float64) - sub
    np.testing.assert_allclose(s1, d.sum(0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(s2, (d * d).sum(0), rtol=1e-5)
    src = rand(13, 17, 9, seed=12)
    dst = np.empty((9, 17, 13), np.float32)
    k.reverse_axes(src, dst)
    np.testing.assert_array_equal(dst, ref_nhwc.reverse_axes(src))
    img = rand(2, 5, 6, 7, seed=13)
    packed = np.empty((2, 6, 7, 5), np.float32)
    k.pack(img, packed)
    np.testing.assert_array_equal(packed, ref_nhwc.pack(img))


def test_nchw_batchnorm(path):
    k = isa.load("normalization", path)
    x = rand(3, 21, 10, seed=14)
    sub, mul = rand(21, seed=15), rand(21, seed=16)
    out = np.empty_like(x)
    k.channel_affine(x, sub, mul, out)
    np.testing.assert_allclose(out, (x - sub[None, :, None]) * mul[None, :, None], rtol=1e-6, atol=1e-6)


def test_blocked_pooling(path):
    k = isa.load("intel", path)
    v = isa.LANES[path]
    N, C, H = 2, v + 3, 8
    x = rand(N, C, H, H, seed=17)
    xb = np.empty((N, 2, H, H, v), np.float32)
    k.pack(x, xb)
    oh = ref.pool_out_size(H, 3, 0, 2)
    yb, mask = np.empty((N, 2, oh, oh, v), np.float32), np.empty((N, 2, oh, oh, v), np.int32)
    k.pool_max_forward(xb, yb, mask, 3, 3, 2, 2, 0, 0)
    y = np.empty((N, C, oh, oh), np.float32)
    k.unpack(yb, y)
    want, _ = ref.max_pool_forward(x.astype(np.float64), 3, 3, 2, 2, 0, 0, oh, oh)
    np.testing.assert_array_equal(y, want)
