"""The bf16 matrix product (cext/bf16_gemm.h, kernels.bf16.gemm) against its NumPy reference
(caffepy/kernels/reference/bf16.py: operands rounded to bf16, float64 sums), on every path this
CPU runs (AMX-BF16, AVX512_BF16; skipped with the reason where it has neither).

Tolerance: the products of bf16 values are exact in float32, so the kernel differs from the
reference only by rounding its float32 sums. Summing K terms in float32, in any order (the
hardware adds pairs, then the tiles' or vectors' partial sums), rounds at most K times, each
time by at most 2^-24 of a partial sum no larger than sum |a_k b_k|: |c - ref| <= K 2^-24
(|a| |b|) elementwise (the classic recursive-summation bound, to first order).
"""
import numpy as np
import pytest

from caffepy import device
from caffepy.kernels import bf16
from caffepy.kernels.reference import bf16 as ref

FLAGS = device.cpu_flags()
AVX512_HERE = all(f in FLAGS for f in ("avx512_bf16", "avx512bw", "avx512vl"))
AMX_HERE = AVX512_HERE and "amx_tile" in FLAGS and "amx_bf16" in FLAGS and bf16.amx_permitted()
PATHS = [pytest.param(bf16.AMX, id="amx", marks=pytest.mark.skipif(
             not AMX_HERE, reason="this CPU (or its kernel) gives no AMX-BF16")),
         pytest.param(bf16.AVX512, id="avx512_bf16", marks=pytest.mark.skipif(
             not AVX512_HERE, reason="this CPU has no AVX512_BF16 with AVX-512 BW and VL"))]


def _operands(m, n, k, trans_a, trans_b, seed=0):
    """a [m, k] and b [k, n] as views: transposed ones are the .T of a C-ordered array."""
    gen = np.random.default_rng(seed)
    a = gen.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = gen.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    return (a.T if trans_a else a), (b.T if trans_b else b)


def _check(a, b, c, want, k):
    bound = k * 2.0 ** -24 * (np.abs(ref.round_bf16(a)).astype(np.float64)
                              @ np.abs(ref.round_bf16(b)).astype(np.float64))
    assert np.all(np.abs(c - want) <= bound + 1e-30), np.abs(c - want).max()


# sizes around the tiles (16, 32), the k pair, and the blocks (k 512, rows 256, columns 1024)
SIZES = [(1, 1, 1), (1, 7, 1), (3, 5, 2), (16, 16, 32), (17, 33, 31), (31, 15, 65),
         (1, 300, 700), (300, 1, 513), (257, 40, 1025), (40, 1100, 70), (64, 49, 576)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("trans_a", [False, True], ids=["a", "aT"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("m,n,k", SIZES)
def test_product_against_the_reference(path, trans_a, trans_b, m, n, k):
    a, b = _operands(m, n, k, trans_a, trans_b)
    c = np.full((m, n), np.nan, np.float32)          # overwritten, never read
    bf16.gemm(a, b, c, False, path)
    want = ref.gemm(a, b)
    _check(a, b, c, want, k)
    # the rounding is what the reference sees: float32 operands land far outside the bound
    if k >= 16:
        assert np.abs(c - a.astype(np.float64) @ b.astype(np.float64)).max() > 1e-3


@pytest.mark.parametrize("path", PATHS)
def test_accumulate_adds_to_c_and_strided_views_are_read(path):
    a, b = _operands(37, 45, 600, False, False, seed=3)
    a, b = a[:, ::2], b[::2, :]                      # no unit stride along k in a, b
    c0 = np.random.default_rng(4).standard_normal((37, 45)).astype(np.float32)
    c = c0.copy()
    bf16.gemm(a, b, c, True, path)
    _check(a, b, c - c0, ref.gemm(a, b), 300 + 1)


@pytest.mark.parametrize("path", PATHS)
def test_k_zero_writes_zeros_or_leaves_c(path):
    a, b = np.empty((3, 0), np.float32), np.empty((0, 4), np.float32)
    c = np.ones((3, 4), np.float32)
    bf16.gemm(a, b, c, True, path)
    assert np.all(c == 1)
    bf16.gemm(a, b, c, False, path)
    assert np.all(c == 0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("trans_a", [False, True], ids=["a", "aT"])
def test_nan_and_infinity_propagate(path, trans_a):
    a, b = _operands(20, 40, 70, trans_a, False, seed=5)
    a = np.array(a)
    b = np.abs(b) + 0.5                              # positive: inf times it stays +inf
    a[2, 10] = np.nan
    a[5, 3] = np.inf
    a[7, 60] = 3.4e38                                # past bf16's largest: rounds to infinity
    a[9, 1] = -np.inf
    a[9, 2] = np.inf                                 # inf - inf
    if trans_a:
        a = np.asfortranarray(a)
    c = np.zeros((20, 40), np.float32)
    bf16.gemm(a, b, c, False, path)
    assert np.isnan(c[2]).all() and np.isnan(c[9]).all()
    assert np.isposinf(c[5]).all() and np.isposinf(c[7]).all()
    finite = np.setdiff1d(np.arange(20), [2, 5, 7, 9])
    assert np.isfinite(c[finite]).all()
    _check(a[finite], b, c[finite], ref.gemm(a[finite], b), 70)


@pytest.mark.parametrize("path", PATHS)
def test_both_paths_and_the_threads_agree_with_the_reference_on_a_large_product(path):
    a, b = _operands(520, 1500, 1100, False, True, seed=6)   # split over threads, 3 k blocks
    c = np.empty((520, 1500), np.float32)
    bf16.gemm(a, b, c, False, path)
    _check(a, b, c, ref.gemm(a, b), 1100)


def test_bad_arguments_are_one_clear_error():
    a, b = _operands(3, 4, 5, False, False)
    with pytest.raises(ValueError, match=r"bf16.gemm: b: needs 5 rows \(a's columns\)"):
        bf16.gemm(a, b[:4], np.empty((3, 4), np.float32), False, bf16.AVX512)
    with pytest.raises(ValueError, match=r"bf16.gemm: c: needs shape \(3, 4\)"):
        bf16.gemm(a, b, np.empty((4, 3), np.float32), False, bf16.AVX512)
    with pytest.raises(ValueError, match="bf16.gemm: path: must be AVX512"):
        bf16.gemm(a, b, np.empty((3, 4), np.float32), False, 7)
