"""The LRN kernels of caffepy.kernels.normalization against the NumPy references in
caffepy.kernels.reference.normalization. (BatchNorm's and MVN's kernels are compared with their
references through the layers, in tests/layers/test_normalization.py.)

Buffers the kernels overwrite start as NaN, so a kernel that reads what it should overwrite (or
skips an element) fails.
"""
import numpy as np
import pytest

from caffepy.kernels import normalization
from caffepy.kernels.reference import normalization as ref

RNG = np.random.default_rng(1234)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def nans(*shape):
    return np.full(shape, np.nan, np.float32)


def close(got, want, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- LRN
# (N, C, H, W, size, alpha, beta, k): 17x19 positions span two 256-wide blocks
LRN_ACROSS_CASES = [
    (2, 7, 17, 19, 5, 0.5, 0.75, 1.0),
    (2, 5, 3, 4, 3, 1.0, 0.75, 2.0),
    (1, 3, 4, 3, 5, 0.8, 0.75, 1.0),     # window wider than the channels
    (2, 9, 5, 5, 5, 0.3, 0.6, 1.5),      # general beta (powf)
    (1, 6, 7, 3, 3, 0.4, 0.5, 1.0),
    (1, 5, 2, 3, 3, 0.4, 1.0, 1.0),
    (1, 4, 2, 2, 1, 0.4, 0.75, 1.0),     # size 1: no neighbours
    (2, 9, 30, 31, 5, 0.5, 0.75, 1.0),   # large enough to split blocks over threads
]


@pytest.mark.parametrize("case", LRN_ACROSS_CASES)
def test_lrn_across_channels(case):
    N, C, H, W, size, alpha, beta, k = case
    bottom = rand(N, C, H, W)
    top, scale = nans(N, C, H, W), nans(N, C, H, W)
    normalization.lrn_across_forward(bottom, top, scale, size, alpha, beta, k)
    want_top, want_scale = ref.lrn_across_forward(bottom, size, alpha, beta, k)
    close(scale, want_scale)
    close(top, want_top)

    top_diff = rand(N, C, H, W)
    bottom_diff = nans(N, C, H, W)
    normalization.lrn_across_backward(bottom, scale, top_diff, bottom_diff, size, alpha, beta)
    close(bottom_diff, ref.lrn_across_backward(bottom, top, scale, top_diff, size, alpha, beta))


# (N, C, H, W, size, alpha, beta)
LRN_WITHIN_CASES = [
    (2, 3, 7, 6, 3, 0.8, 0.75),
    (1, 2, 9, 11, 5, 1.5, 0.75),
    (1, 2, 2, 3, 5, 1.0, 0.6),           # window larger than the image
    (2, 1, 5, 4, 3, 0.5, 1.3),
    (2, 5, 32, 31, 3, 0.5, 0.75),        # large enough to split planes over threads
]


@pytest.mark.parametrize("case", LRN_WITHIN_CASES)
def test_lrn_within_channel(case):
    N, C, H, W, size, alpha, beta = case
    bottom = rand(N, C, H, W)
    top, scale = nans(N, C, H, W), nans(N, C, H, W)
    normalization.lrn_within_forward(bottom, top, scale, size, alpha, beta)
    want_top, want_scale = ref.lrn_within_forward(bottom, size, alpha, beta)
    close(scale, want_scale)
    close(top, want_top)

    top_diff = rand(N, C, H, W)
    bottom_diff = nans(N, C, H, W)
    normalization.lrn_within_backward(bottom, scale, top_diff, bottom_diff, size, alpha, beta)
    close(bottom_diff, ref.lrn_within_backward(bottom, top, scale, top_diff, size, alpha, beta))


@pytest.mark.parametrize("region", ["across", "within"])
def test_lrn_reference_backward_matches_finite_differences(region):
    x = RNG.standard_normal((1, 5, 4, 3))
    dy = RNG.standard_normal(x.shape)
    size, alpha, beta, k = 3, 0.7, 0.75, 1.3
    if region == "across":
        def forward(v):
            return ref.lrn_across_forward(v, size, alpha, beta, k)
        backward = ref.lrn_across_backward
    else:
        def forward(v):
            return ref.lrn_within_forward(v, size, alpha, beta)
        backward = ref.lrn_within_backward
    y, s = forward(x)
    analytic = backward(x, y, s, dy, size, alpha, beta)
    eps = 1e-6
    for idx in [(0, 0, 0, 0), (0, 2, 1, 1), (0, 4, 3, 2), (0, 1, 2, 0)]:
        e = np.zeros_like(x)
        e[idx] = eps
        numeric = (np.vdot(forward(x + e)[0], dy) - np.vdot(forward(x - e)[0], dy)) / (2 * eps)
        assert analytic[idx] == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_lrn_rejects_even_sizes():
    x = rand(1, 3, 2, 2)
    with pytest.raises(ValueError, match="odd"):
        normalization.lrn_across_forward(x, nans(1, 3, 2, 2), nans(1, 3, 2, 2), 4, 1.0, 0.75, 1.0)
