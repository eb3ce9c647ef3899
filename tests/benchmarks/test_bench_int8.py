"""int8's accuracy goals (benchmarks/bench_int8.py --parts accuracy) on the held-out digits:
after `caffepy calibrate` with every Convolution and InnerProduct quantized, int8 loses at most
0.5 points of top-1 against float32 and agrees with its top-1 on at least 99% of the digits
(296: three digits that change their answer miss it).
LeNet (a short float32 run) is the fast case; the CIFAR-style net and the ResNet are slow."""
import os
import sys

import pytest

from paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import digits_nets  # noqa: E402


@pytest.fixture(scope="module")
def digits():
    return digits_nets.digits()


def _calibrated_goals(name, digits, iterations=None, layers=None):
    weights = digits_nets.train(name, digits, "f32", iterations)
    (base, acc, agree, names), quantized = digits_nets.calibrate(name, weights, digits,
                                                                 first_conv=True, fc_int8=True)
    top32, top8 = 100 * base[0], 100 * acc[0]
    assert top32 > 90, f"{name}: float32 top-1 {top32:.2f}: the net did not learn"
    assert top32 - top8 <= 0.5, f"{name}: int8 top-1 {top8:.2f} against float32's {top32:.2f}"
    assert agree >= 0.99, f"{name}: int8 and float32 agree on {100 * agree:.2f}% of the digits"
    if layers is not None:       # none left float32 by calibrate's fallback
        assert names == layers
    assert [lp.name for lp in quantized.layer if lp.HasField("quantization_param")] == names


def test_lenet_calibrated_to_int8_keeps_float32s_answers(digits):
    _calibrated_goals("lenet", digits, iterations=300, layers=["conv1", "conv2", "ip1", "ip2"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cifar", "resnet"])
def test_calibrated_to_int8_keeps_float32s_answers(name, digits):
    _calibrated_goals(name, digits)
