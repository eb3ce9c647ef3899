"""The rules every kernel module shares (cext/rules.pxd): one message shape for an argument
that does not fit, `<kernel>: <argument>: <problem>, got <value>`; dtype and contiguity refused
by the kernels' signatures."""
import re

import numpy as np
import pytest

from caffepy.kernels import common, intel, loss, neuron, normalization, solver, vision, winograd

SHAPE = re.compile(r"^(\w+): ([\w, ]+): .+, got .+$")


def f32(*shape):
    return np.zeros(shape, np.float32)


# one refused call per kernel module, and the kernel and argument its message names
CALLS = [
    (lambda: neuron.relu_forward(f32(10), f32(9), 0.0), "relu_forward", "y"),
    (lambda: neuron.prelu_forward(f32(2, 3, 4), f32(2, 3, 4), f32(2)), "prelu_forward", "slope"),
    (lambda: common.scale_forward(f32(2, 3, 4), f32(2), None, f32(2, 3, 4), None),
     "scale_forward", "scale"),
    (lambda: normalization.channel_affine(f32(2, 3, 4), f32(3), f32(3), f32(2, 3, 5)),
     "channel_affine", "out"),
    (lambda: normalization.lrn_across_forward(f32(1, 3, 2, 2), f32(1, 3, 2, 2), f32(1, 3, 2, 1),
                                              3, 1.0, 0.75, 1.0), "lrn_across_forward", "scale"),
    (lambda: loss.softmax_loss_forward(f32(2, 3, 4), np.zeros((2, 5), np.int32), f32(2, 3, 4)),
     "softmax_loss_forward", "labels"),
    (lambda: solver.step("SGD", f32(5), f32(5), f32(4), f32(5), 1, 0, False, 0.1, 0.9),
     "step", "h"),
    (lambda: vision.conv_forward(f32(1, 4, 6, 6), f32(2, 4, 3, 3), None, f32(1, 2, 5, 4),
                                 f32(999), 0, 0, 1, 1, 1, 1, 1), "conv_forward", "top"),
    (lambda: intel.pack(f32(1, 3, 2, 2), f32(1, 1, 2, 1, 4)), "pack", "y"),
    (lambda: winograd.weight_transform(f32(4, 2, 3, 3), f32(4, 3), f32(16, 4, 3)),
     "weight_transform", "u"),
]


@pytest.mark.parametrize("call,kernel,arg", CALLS, ids=[c[1] for c in CALLS])
def test_refusals_have_one_shape(call, kernel, arg):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    match = SHAPE.match(message)
    assert match, message
    assert match.groups() == (kernel, arg), message


def test_shape_messages_give_the_wanted_shape():
    with pytest.raises(ValueError, match=r"^relu_forward: y: needs shape \(10,\), got \(9,\)$"):
        neuron.relu_forward(f32(10), f32(9), 0.0)


def test_dtype_and_contiguity_are_the_signatures():
    with pytest.raises(ValueError, match="dtype"):
        neuron.relu_forward(np.zeros(4), f32(4), 0.0)
    with pytest.raises(ValueError, match="contiguous"):
        neuron.relu_forward(f32(8)[::2], f32(4), 0.0)
