"""caffepy.kernels.intel.channel_sums, the blocked Winograd convolution's bias gradient: per-lane
sums of a blocked blob against its NumPy reference, on one-thread and threaded sizes."""
import numpy as np
import pytest

from caffepy.kernels import intel
from caffepy.kernels.reference import intel as ref


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 8), (3, 5, 7, 9, 16), (64, 16, 27, 27, 16),
                                   (2, 3, 4, 4, 64)], ids=lambda s: "x".join(map(str, s)))
def test_channel_sums_match_the_reference(shape):
    x = np.random.default_rng(sum(shape)).standard_normal(shape, dtype=np.float32) + 0.5
    out = np.full(shape[1] * shape[4], np.nan)
    intel.channel_sums(x, out)
    np.testing.assert_allclose(out, ref.channel_sums(x), rtol=1e-5, atol=1e-5 * np.abs(x).sum() / out.size)


def test_channel_sums_refuse_a_wrong_output():
    with pytest.raises(ValueError, match="channel_sums: out: needs shape"):
        intel.channel_sums(np.zeros((1, 2, 3, 3, 8), np.float32), np.zeros(8))
