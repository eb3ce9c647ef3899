"""The threaded whole-blob kernels: caffepy.kernels.common.add and copy (Eltwise, Split) and
caffepy.kernels.nhwc.copy_columns (the channels-last Concat), against their NumPy references on
sizes below and above one task, in place and at the edges of the columns."""
import numpy as np
import pytest

from caffepy.kernels import common, nhwc
from caffepy.kernels.reference import common as ref_common
from caffepy.kernels.reference import nhwc as ref_nhwc

RNG = np.random.default_rng(5)


@pytest.mark.parametrize("n", [1, 1000, 16384, 16384 * 3 + 7, 1 << 20])
def test_add_and_copy(n):
    a, b = RNG.standard_normal(n, dtype=np.float32), RNG.standard_normal(n, dtype=np.float32)
    out = np.full(n, np.nan, np.float32)
    common.add(a, b, out)
    np.testing.assert_array_equal(out, ref_common.add(a, b))
    common.add(a, b, a)                                 # in place
    np.testing.assert_array_equal(a, out)
    dst = np.full(n, np.nan, np.float32)
    common.copy(b, dst)
    np.testing.assert_array_equal(dst, ref_common.copy(b))


@pytest.mark.parametrize("rows", [1, 9, 5000])
@pytest.mark.parametrize("s0,d0,n", [(0, 0, 7), (3, 10, 5), (0, 12, 8), (2, 0, 6)])
def test_copy_columns(rows, s0, d0, n):
    src = RNG.standard_normal((rows, 8), dtype=np.float32)
    dst = RNG.standard_normal((rows, 20), dtype=np.float32)
    want = ref_nhwc.copy_columns(src, s0, dst, d0, n)
    nhwc.copy_columns(src, s0, dst, d0, n)
    np.testing.assert_array_equal(dst, want)


def test_copy_columns_refuses_runs_outside_the_arrays():
    src, dst = np.zeros((4, 8), np.float32), np.zeros((4, 10), np.float32)
    with pytest.raises(ValueError, match="copy_columns: d0, n: must lie within"):
        nhwc.copy_columns(src, 0, dst, 5, 8)
    with pytest.raises(ValueError, match="copy_columns: s0, n: must lie within"):
        nhwc.copy_columns(src, 4, dst, 0, 5)
    with pytest.raises(ValueError, match="copy_columns: dst rows"):
        nhwc.copy_columns(src, 0, np.zeros((3, 10), np.float32), 0, 8)
