"""Fillers: the msra standard deviation, with Intel Caffe's scale factor; the chunked refill."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import fillers, rng
from caffepy.fillers import fill, fill_into
from caffepy.proto import caffe_pb2


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_msra_std_is_scale_times_sqrt_2_over_fan_in(scale):
    rng.seed(7)
    p = caffe_pb2.FillerParameter(type="msra", scale=scale)
    w = fillers.fill(p, (400, 50, 1, 1))                     # fan_in 50
    assert w.std() == pytest.approx(scale * np.sqrt(2 / 50), rel=0.02)
    rng.seed(-1)


def gabor_kernel(k, lam, sigma, omega, phi, theta, rgb):
    """One Gabor kernel the long way: 3 x k x k, (y, x) spaced evenly over [-1, 1]."""
    out = np.zeros((3, k, k))
    for ky in range(k):
        for kx in range(k):
            x, y = 2 * kx / (k - 1) - 1, 2 * ky / (k - 1) - 1
            envelope = np.exp(-(x * x + y * y) / (2 * sigma * sigma))
            value = lam * envelope * np.cos((x * np.cos(theta) - y * np.sin(theta)) * omega + phi)
            out[:, ky, kx] = [c * value for c in rgb]
    return out


PI = np.pi


# (kernels, size), kernel index, its parameters written out (Intel Caffe's gabor.hpp tables)
@pytest.mark.parametrize("bank,i,params", [
    ((96, 11), 0, (1 / 3, 0.5, 5 * PI, 0.375 * PI, 0, (1, 1, 1))),
    ((96, 11), 13, ((1 / 3) / 1.625, 0.625, 5 * PI / 3.5, 1.375 * PI, PI / 6, (1, 1, 1))),
    ((96, 11), 61, (1 / 9, 2, 5 * PI / 8, PI / 2, 5 * PI / 8, (1, -0.5, -0.75))),
    ((96, 11), 90, (1 / 3, 0.6, 5 * PI / 16, PI / 2, PI + PI / 16, (1, 1, 1))),
    ((32, 5), 3, (0.5, 0.6, 2 * PI, 0, 3 * PI / 8, (1, 1, 1))),
    ((32, 5), 31, (0.5, 0.6, PI / 2, PI / 2, 7 * PI / 8, (1, 1, 0))),
    ((64, 7), 41, (2 / 3, 0.5, PI / 4, 13 * PI, 0, (0.25, -1, 1))),
    ((64, 3), 41, (2 / 3, 1, PI / 4, 13 * PI, 0, (0.25, -1, 1))),
])
def test_gabor_kernels_follow_intel_caffes_bank(bank, i, params):
    n, k = bank
    w = fillers.fill(caffe_pb2.FillerParameter(type="gabor", std=0.01), (n, 3, k, k))   # std: unused
    assert w.dtype == np.float32 and w.shape == (n, 3, k, k)
    np.testing.assert_allclose(w[i], gabor_kernel(k, *params), rtol=1e-5, atol=1e-7)


def test_gabor_bank_is_fixed_and_bounded():
    p = caffe_pb2.FillerParameter(type="gabor")
    rng.seed(1)
    a = fillers.fill(p, (96, 3, 11, 11))
    rng.seed(2)
    b = fillers.fill(p, (96, 3, 11, 11))
    assert np.array_equal(a, b)
    assert 0 < np.abs(a).max() <= 1 / 3            # AlexNet's envelopes peak at lam <= 1/3
    rng.seed(-1)


@pytest.mark.parametrize("shape,sparse,message", [
    ((48, 3, 5, 5), -1, r"no Gabor bank for 48 kernels of 5x5; Intel Caffe defines 32 of 5x5, 64 of 7x7, "
                        r"64 of 3x3, 96 of 11x11"),
    ((96, 1, 11, 11), -1, r"needs a kernels x 3 x k x k blob .*got shape \(96, 1, 11, 11\)"),
    ((96, 3, 11, 9), -1, r"needs a kernels x 3 x k x k blob"),
    ((96, 3, 11, 11), 5, r"sparse is not supported, got 5"),
])
def test_gabor_refuses_what_it_does_not_define(shape, sparse, message):
    with pytest.raises(fillers.CaffepyError, match="^gabor filler: " + message):
        fillers.fill(caffe_pb2.FillerParameter(type="gabor", sparse=sparse), shape)


@pytest.mark.parametrize("text", ['type: "gaussian" mean: 0.5 std: 2', 'type: "uniform" min: -3 max: 0.7',
                                  'type: "gaussian" std: 1 sparse: 2', 'type: "xavier"'])
def test_fill_into_gives_fill_s_numbers(text):
    """DummyData's refill draws in chunks into its top: the same floats, draw for draw, as a
    whole draw (the chunked fillers), or through fill itself (the others)."""
    p = text_format.Parse(text, caffe_pb2.FillerParameter())
    for shape in [(1, 3), (5, 70001), (2, 3, 227, 227)]:     # within one chunk, across, many
        rng.seed(7)
        want = [fill(p, shape) for _ in range(2)]
        rng.seed(7)
        got = [np.empty(shape, np.float32) for _ in range(2)]
        for out in got:
            fill_into(p, out)
        for w, g in zip(want, got):
            assert np.array_equal(w.view(np.int32), g.view(np.int32)), (text, shape)
    strided = np.zeros((4, 6), np.float32)[:, ::2]
    rng.seed(7)
    fill_into(p, strided)
    rng.seed(7)
    assert np.array_equal(strided, fill(p, (4, 3)))
