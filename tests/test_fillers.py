"""Fillers: the msra standard deviation, with Intel Caffe's scale factor."""
import numpy as np
import pytest

from caffepy import fillers, rng
from caffepy.proto import caffe_pb2


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_msra_std_is_scale_times_sqrt_2_over_fan_in(scale):
    rng.seed(7)
    p = caffe_pb2.FillerParameter(type="msra", scale=scale)
    w = fillers.fill(p, (400, 50, 1, 1))                     # fan_in 50
    assert w.std() == pytest.approx(scale * np.sqrt(2 / 50), rel=0.02)
    rng.seed(-1)
