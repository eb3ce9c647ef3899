"""Which BLAS the kernels' matrix products call (cext/blas_threads.h): NumPy's own OpenBLAS
when NumPy ships one, in every module alike (each binds its own), and the products right in
every transposition."""
import numpy as np
import pytest

from caffepy import device
from caffepy.blas import gemm_into
from caffepy.kernels import common, intel, nhwc, vision, winograd

MODULES = [common, intel, nhwc, vision, winograd]


def test_every_module_calls_numpys_openblas_when_numpy_has_one():
    config = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    if "openblas" not in str(config.get("name", "")).lower():
        pytest.skip(f"NumPy's BLAS is {config.get('name')}: scipy's serves")
    assert {m.blas_in_use() for m in MODULES} == {"numpy"}
    assert device.blas_name().startswith("numpy: ")


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True),
                                              (True, True)])
def test_products_in_every_transposition(trans_a, trans_b):
    """Big enough for the split over threads, beta kept: sizes, leading dimensions and scalars
    go through the 64-bit interface right (a transposed operand is a Fortran-ordered view)."""
    rng = np.random.default_rng(3)
    m, n, k = 300, 200, 170
    a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    a, b = (a.T if trans_a else a), (b.T if trans_b else b)
    start = rng.standard_normal((m, n), dtype=np.float32)
    c = start.copy()
    gemm_into(a, b, c, beta=0.5)
    want = a.astype(np.float64) @ b.astype(np.float64) + 0.5 * start
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)
