"""The per-channel sums behind BatchNorm on channels-last blobs (caffepy.kernels.nhwc):
channel_moments against float64 NumPy, with channels in whole blocks of 32, past the last block
and fewer than one, and pixels in whole and part row blocks and tasks."""
import numpy as np
import pytest

from caffepy.kernels import nhwc


@pytest.mark.parametrize("M", [1, 9, 64, 130, 50176 // 16])
@pytest.mark.parametrize("C", [7, 32, 64, 100, 2048])
def test_channel_moments_against_float64(M, C):
    rng = np.random.default_rng(M * 7 + C)
    x = (rng.standard_normal((M, C)) * 3 + 5).astype(np.float32)
    shift = x[0].copy()
    threads = nhwc.max_threads()
    work = np.full((threads, 2 * C), np.nan, np.float32)
    partial = np.full((threads, 2 * C), np.nan)
    s1, s2 = np.full(C, np.nan), np.full(C, np.nan)
    nhwc.channel_moments(x, shift, s1, s2, work, partial)
    d = x.astype(np.float64) - shift
    np.testing.assert_allclose(s1, d.sum(0), rtol=1e-5, atol=1e-5 * np.abs(d).sum(0).max())
    np.testing.assert_allclose(s2, (d * d).sum(0), rtol=1e-5)
