"""caffepy.kernels.common.skinny_gemm (cext/common_skinny.h), the product InnerProduct runs at
small batch: against a float64 NumPy product on every row tail of its blocks (6 rows), every
column width of its vectors, reductions below and past its blocks (512 steps down A's columns,
256 along its rows), A stored either way, and products large enough to split over threads."""
import numpy as np
import pytest

from caffepy.kernels import common

RNG = np.random.default_rng(11)
W = common.SKINNY_WIDTH


def product(M, N, K, trans):
    stored = RNG.standard_normal((K, M) if trans else (M, K), dtype=np.float32)
    a = stored.T if trans else stored
    b = RNG.standard_normal((K, N), dtype=np.float32)
    c = np.full((M, N), np.nan, np.float32)
    common.skinny_gemm(a, b, c)
    return c, a.astype(np.float64) @ b.astype(np.float64)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("M", [1, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("cols", [1, 2, 3, 4, 5, 9])
def test_rows_and_columns(M, cols, trans):
    c, want = product(M, cols * W, 37, trans)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("cols", [2, 5])
@pytest.mark.parametrize("K", [1, 255, 256, 257, 511, 512, 513, 1500])
def test_reductions(K, cols, trans):
    """Blocks of 512 steps down A's columns, and of 256 along its rows when C has several
    blocks of columns (5 vectors: more than one block at either vector width)."""
    c, want = product(11, cols * W, K, trans)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("trans", [False, True])
def test_threaded(trans):
    """Large enough for every thread the rule allows: each writes its own rows."""
    c, want = product(1003, 4 * W, 700, trans)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)


def test_a_padding_column_reaches_only_its_own():
    a = RNG.standard_normal((9, 20), dtype=np.float32)
    b = RNG.standard_normal((20, 2 * W), dtype=np.float32)
    b[:, W + 3] = np.nan
    c = np.zeros((9, 2 * W), np.float32)
    common.skinny_gemm(a, b, c)
    assert np.isnan(c[:, W + 3]).all()
    keep = np.arange(2 * W) != W + 3
    np.testing.assert_allclose(c[:, keep], (a.astype(np.float64) @ b.astype(np.float64))[:, keep],
                               rtol=1e-5, atol=1e-4)


def test_refuses_a_width_off_the_vectors():
    with pytest.raises(ValueError, match=f"skinny_gemm: b: needs a multiple of {W} columns"):
        common.skinny_gemm(np.zeros((3, 4), np.float32), np.zeros((4, W + 1), np.float32),
                           np.zeros((3, W + 1), np.float32))
