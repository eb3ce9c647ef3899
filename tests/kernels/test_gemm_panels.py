"""caffepy's own matrix product (cext/gemm_panels.h), which cext/blas.pxd runs instead of the BLAS
for thin products: against float64 NumPy at every edge of its blocking (rows past a tile or a
block, columns past a vector or a panel, reduction steps past a pass), both layouts of B, and
the scalars; and through gemm, where the rule sends a shape to it, against the BLAS."""
import numpy as np
import pytest

from caffepy.kernels import common, nhwc

W = common.SKINNY_WIDTH                 # floats per vector; a panel is 2 (AVX2) or 4 of them
MR, MB, KC = 6, 192, 512                # the tile's rows, a block's rows, a pass's steps


def _reference(a, b, c0, alpha, beta):
    return alpha * (a.astype(np.float64) @ b.astype(np.float64)) + beta * c0


@pytest.mark.parametrize("m", [1, MR - 1, MR + 1, MB + MR + 1])
@pytest.mark.parametrize("n", [1, W - 1, W + 3, 2 * W, 4 * W + 5])
@pytest.mark.parametrize("k", [1, 7, KC + 3])
@pytest.mark.parametrize("trans_b", [False, True])
def test_edges_against_numpy(m, n, k, trans_b):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a = rng.standard_normal((m, k), dtype=np.float32)
    stored = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    b = stored.T if trans_b else stored
    c = np.full((m, n), np.nan, np.float32)          # beta 0 never reads C
    common.panel_gemm(a, b, c)
    np.testing.assert_allclose(c, _reference(a, b, 0, 1, 0), rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, -2.0), (-3.0, 0.25)])
def test_alpha_and_beta(alpha, beta):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((MB + 10, KC + 20), dtype=np.float32)
    b = rng.standard_normal((KC + 20, 3 * W + 1), dtype=np.float32)
    c0 = rng.standard_normal((MB + 10, 3 * W + 1), dtype=np.float32)
    c = c0.copy()
    common.panel_gemm(a, b, c, alpha, beta)
    np.testing.assert_allclose(c, _reference(a, b, c0, alpha, beta), rtol=1e-5, atol=2e-3)


@pytest.mark.parametrize("m, n, k, trans_b", [(50176 // 8, 256, 64, True), (3000, 64, 256, False),
                                              (400, 128, 128, False), (144, 256, 256, True)])
def test_gemm_routes_thin_products_here_and_matches_the_blas(m, n, k, trans_b):
    """ResNet-50's kinds of thin products go to the panels (the rule), threaded by gemm's split,
    and agree with the BLAS on the same threads to float rounding."""
    assert common.panels_wanted(m, n, k)
    rng = np.random.default_rng(7)
    a = rng.standard_normal((m, k), dtype=np.float32)
    stored = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    b = stored.T if trans_b else stored
    ours, blas = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
    common.gemm(a, b, ours)
    common.gemm(a, b, blas, panels=False)
    np.testing.assert_allclose(ours, blas, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    np.testing.assert_allclose(ours, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_rule_keeps_wide_and_small_products_on_the_blas():
    assert not common.panels_wanted(2048, 2048, 2048)
    assert not common.panels_wanted(784, 512, 2048)        # long reductions: the BLAS is faster
    assert not common.panels_wanted(64, 512, 512)          # res5's Winograd: slower in the net
    assert not common.panels_wanted(8, 256, 64)            # too few rows to repay the packing


# The weights packed once (a TEST net's convolutions: cext/nhwc.pyx conv_forward's `packed`)

@pytest.mark.parametrize("m", [1, MR - 1, MR + 1, 49, MB + MR + 1])
@pytest.mark.parametrize("n", [1, W - 1, 2 * W + 3, 8 * W + 5])
@pytest.mark.parametrize("k", [1, KC + 3])
@pytest.mark.parametrize("trans_b", [False, True])
def test_packed_product_against_numpy(m, n, k, trans_b):
    """Every edge again, on B packed once: against float64 NumPy, and bit for bit what the
    product that packs on every call computes (the same sums in the same order)."""
    rng = np.random.default_rng(m * 1000 + n * 10 + k + 1)
    a = rng.standard_normal((m, k), dtype=np.float32)
    stored = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    b = stored.T if trans_b else stored
    packed = common.pack_panels(b)
    c = np.full((m, n), np.nan, np.float32)
    common.gemm_packed(a, packed, c)
    np.testing.assert_allclose(c, _reference(a, b, 0, 1, 0), rtol=1e-5, atol=1e-4 * np.sqrt(k))
    unpacked = np.empty_like(c)
    common.panel_gemm(a, b, unpacked)
    np.testing.assert_array_equal(c, unpacked)


@pytest.mark.parametrize("m, n, k", [(1, 2 * W + 3, KC + 3), (7, 5 * W + 1, 2 * KC + 9)])
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.5, -2.0), (-3.0, 0.0)])
def test_packed_product_folds_alpha_and_takes_beta(m, n, k, alpha, beta):
    rng = np.random.default_rng(11)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c0 = rng.standard_normal((m, n), dtype=np.float32)
    c = c0.copy()
    common.gemm_packed(a, common.pack_panels(b, alpha), c, beta)
    np.testing.assert_allclose(c, _reference(a, b, c0, alpha, beta), rtol=1e-5,
                               atol=1e-4 * np.sqrt(k) * abs(alpha))


@pytest.mark.parametrize("m, n, k", [(49, 40 * W + 3, 600), (1, 64 * W, 2048),
                                     (700, 4 * W + 1, 600), (196, 16 * W, 1024)])
def test_packed_product_split_over_threads_computes_the_one_thread_sums(m, n, k):
    """Big enough for the thread rule's two threads (where the machine has them free): few rows
    split the panels between them, many rows the rows, and so do few rows that give each thread
    64 or more at 16 lanes (ResNet-50 b1's 196); each element the same sums either way."""
    rng = np.random.default_rng(12)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    common.gemm_packed(a, common.pack_panels(b), c)
    one = np.empty_like(c)
    common.panel_gemm(a, b, one)
    np.testing.assert_array_equal(c, one)


def test_packed_product_refuses_panels_of_another_shape():
    a = np.zeros((3, 10), np.float32)
    packed = common.pack_panels(np.zeros((9, 5), np.float32))
    with pytest.raises(ValueError, match="gemm_packed: packed: needs"):
        common.gemm_packed(a, packed, np.zeros((3, 5), np.float32))


@pytest.mark.parametrize("n", [1, 3, 4, 7, 1000])
@pytest.mark.parametrize("k", [1, W - 1, 2 * W, 2 * W + 3, 2048])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5])
def test_one_row_products_read_b_once_and_match_numpy(n, k, trans_b, beta):
    """A product of one row (an InnerProduct at batch 1) runs caffepy_row_gemm, not the BLAS,
    which copies all of B for it: every remainder of rows and vectors, both layouts of B, beta
    (0 never reads C), on gemm's threads; and agrees with the BLAS."""
    rng = np.random.default_rng(n * 100 + k)
    a = rng.standard_normal((1, k), dtype=np.float32)
    stored = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    b = stored.T if trans_b else stored
    c0 = rng.standard_normal((1, n), dtype=np.float32)
    c = np.full((1, n), np.nan, np.float32) if beta == 0 else c0.copy()
    common.gemm(a, b, c, beta)
    np.testing.assert_allclose(c, _reference(a, b, c0, 1.0, beta), rtol=1e-5,
                               atol=1e-5 * np.sqrt(k))
    blas = c0.copy()
    common.gemm(a, b, blas, beta, panels=False)
    np.testing.assert_allclose(c, blas, rtol=1e-5, atol=1e-5 * np.sqrt(k))


# The panels at the width of the build that runs the nets (nhwc's: AVX-512 where the CPU has it,
# whose blocks and passes differ from the AVX2 build's that `common` serves)

@pytest.mark.parametrize("m", [1, 5, 49, 385, 785])
@pytest.mark.parametrize("n", [1, 17, 3 * 64 + 5])
@pytest.mark.parametrize("k", [1, 129, 2 * 128 + 3, KC + 3])
def test_packed_product_of_the_nets_build_against_numpy(m, n, k):
    """A 1 x 1 convolution on packed weights (a TEST net's) is one packed product over its
    pixels: rows past a tile and past blocks of equal heights (385, 785 rows), reduction steps
    past one pass and several of either build's."""
    rng = np.random.default_rng(m + 7 * n + 13 * k)
    x = rng.standard_normal((1, 1, m, k), dtype=np.float32)
    wt = rng.standard_normal((1, n, k), dtype=np.float32)
    packed = np.empty(nhwc.packed_floats(1, n, k), np.float32)
    nhwc.pack_weights(wt, True, packed)
    y = np.full((1, 1, m, n), np.nan, np.float32)
    nhwc.conv_forward(x, wt, np.zeros(0, np.float32), y, np.zeros((2, 0), np.float32), n, 1, 1,
                      0, 0, 1, 1, 1, 1, 1, m, True, None, False, None, packed)
    want = x[0, 0].astype(np.float64) @ wt[0].T.astype(np.float64)
    np.testing.assert_allclose(y[0, 0], want, rtol=1e-5, atol=1e-4 * np.sqrt(k))
