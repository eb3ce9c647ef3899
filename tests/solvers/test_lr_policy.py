"""Learning-rate policies against Caffe's formulas, computed by hand."""
import math

import pytest

from caffepy.errors import SolverError
from caffepy.proto import caffe_pb2
from caffepy.solvers import lr_policy


def solver(**fields):
    p = caffe_pb2.SolverParameter(base_lr=0.1)
    for k, v in fields.items():
        if isinstance(v, list):
            getattr(p, k).extend(v)
        else:
            setattr(p, k, v)
    return p


def rates(p, iters):
    out, step = [], 0
    for it in iters:
        r, step, _ = lr_policy.learning_rate(p, it, step)
        out.append(r)
    return out


def test_fixed():
    assert rates(solver(lr_policy="fixed"), [0, 5, 1000]) == pytest.approx([0.1, 0.1, 0.1])


def test_step_drops_by_gamma_every_stepsize():
    p = solver(lr_policy="step", gamma=0.5, stepsize=3)
    assert rates(p, [0, 2, 3, 5, 6, 9]) == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.0125])


def test_exp():
    p = solver(lr_policy="exp", gamma=0.9)
    assert rates(p, [0, 1, 2]) == pytest.approx([0.1, 0.09, 0.081])


def test_inv_lenet_numbers():
    # lenet_solver.prototxt: base_lr 0.01, gamma 1e-4, power 0.75
    p = solver(lr_policy="inv", gamma=0.0001, power=0.75)
    p.base_lr = 0.01
    assert rates(p, [0, 100, 10000]) == pytest.approx(
        [0.01, 0.01 * 1.01 ** -0.75, 0.01 * 2.0 ** -0.75])
    assert rates(p, [100])[0] == pytest.approx(0.00992565, rel=1e-6)


def test_multistep_advances_at_each_stepvalue():
    p = solver(lr_policy="multistep", gamma=0.1, stepvalue=[2, 4])
    assert rates(p, range(6)) == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_multistep_reports_the_advance_once():
    p = solver(lr_policy="multistep", gamma=0.1, stepvalue=[1])
    _, step, status = lr_policy.learning_rate(p, 1, 0)
    assert (step, status) == (1, ["MultiStep Status: Iteration 1, step = 1"])
    _, step, status = lr_policy.learning_rate(p, 1, step)
    assert (step, status) == (1, [])


def test_plateau_steps_when_the_loss_stops_improving():
    # Intel Caffe: a new minimum (or a step) is an event; plateau_winsize[k] iterations
    # without one move to step k + 1
    p = solver(lr_policy="plateau", gamma=0.5, plateau_winsize=[2, 3])
    state = lr_policy.Plateau()
    losses = [1.0, 0.9, 0.95, 0.92, 0.91, 0.93, 0.94, 0.96, 0.2, 0.3]
    out, step = [], 0
    for it, loss in enumerate(losses):
        state.smoothed_loss = loss
        rate, step, _ = lr_policy.learning_rate(p, it, step, state)
        out.append(rate)
    # minimum 0.9 at 1; step 1 at 3 (= 1 + 2); step 2 at 6 (= 3 + 3); 0.2 is a new minimum, no more steps
    assert out == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025])
    assert (state.minimum_loss, state.iter_last_event) == (pytest.approx(0.2), 8)


def test_poly_reaches_zero_at_max_iter():
    p = solver(lr_policy="poly", power=2.0, max_iter=10)
    assert rates(p, [0, 5, 10]) == pytest.approx([0.1, 0.025, 0.0])


def test_sigmoid_is_half_at_stepsize():
    p = solver(lr_policy="sigmoid", gamma=-0.5, stepsize=4)
    assert rates(p, [4, 0]) == pytest.approx([0.05, 0.1 / (1 + math.exp(-2.0))])


def test_warmup_ramps_linearly_to_base_lr_then_the_policy_takes_over():
    p = solver(lr_policy="step", gamma=0.5, stepsize=2, warmup_iter=4, warmup_start_lr=0.02)
    # Intel Caffe: (it * base_lr + (warmup_iter - it) * warmup_start_lr) / warmup_iter
    assert rates(p, [0, 1, 2, 3]) == pytest.approx([0.02, 0.04, 0.06, 0.08])
    assert rates(p, [4, 5]) == pytest.approx([0.1 * 0.25, 0.1 * 0.25])


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(SolverError, match=r"s.prototxt: lr_policy: unknown .*got 'cosine'.*multistep"):
        lr_policy.check(solver(lr_policy="cosine"), "s.prototxt")


def test_missing_policy_and_bad_stepsize_are_errors():
    with pytest.raises(SolverError, match="lr_policy: missing"):
        lr_policy.check(solver(), "s")
    with pytest.raises(SolverError, match="stepsize: .*got 0"):
        lr_policy.check(solver(lr_policy="step"), "s")
    with pytest.raises(SolverError, match="max_iter"):
        lr_policy.check(solver(lr_policy="poly"), "s")


def test_intel_multifixed_holds_each_stage_rate_up_to_its_iteration():
    p = solver(lr_policy="multifixed", stagelr=[0.01, 0.1, 0.001], stageiter=[2, 5, 8])
    assert rates(p, [0, 2, 3, 5, 6, 8, 9, 100]) == pytest.approx([0.01, 0.01, 0.1, 0.1, 0.001, 0.001, 0.001, 0.001])
    lr_policy.check(p)
    with pytest.raises(SolverError, match=r"stagelr: the multifixed policy needs one stagelr per stageiter, "
                                          r"got 3 stagelr and 2 stageiter"):
        lr_policy.check(solver(lr_policy="multifixed", stagelr=[1, 2, 3], stageiter=[1, 2]))


# Rates the real caffe binary (BVLC, CPU) used, read back bit for bit from the weights one
# SGD step moved (tests/test_caffe_binary.py repeats this live when CAFFE_BIN is set).
CAFFE_RATES = [
    ('lr_policy: "step" gamma: 0.1 stepsize: 1', 7, 1.0000001e-09),
    ('lr_policy: "exp" gamma: 0.9999', 15, 0.009985007),
    ('lr_policy: "inv" gamma: 0.0001 power: 0.75', 43, 0.00996787),
    ('lr_policy: "poly" power: 0.5 max_iter: 100', 99, 0.0009999995),
    ('lr_policy: "sigmoid" gamma: 0.001 stepsize: 2000', 1, 0.0011930793),
]


@pytest.mark.parametrize("text, it, caffe", CAFFE_RATES, ids=[c[0].split('"')[1] for c in CAFFE_RATES])
def test_rates_are_caffes_float_arithmetic(text, it, caffe):
    import numpy as np
    from google.protobuf import text_format
    p = text_format.Parse(text, caffe_pb2.SolverParameter(base_lr=0.01))
    rate = lr_policy.learning_rate(p, it, 0)[0]
    assert np.float32(rate) == np.float32(caffe) and rate == float(np.float32(rate))


def test_double_arithmetic_would_differ():
    # the cases above are chosen where double arithmetic rounds to another float
    import numpy as np
    assert np.float32(0.01 * 0.1 ** 7) != np.float32(1.0000001e-09)
    assert np.float32(0.01 / (1 + math.exp(-0.001 * (1 - 2000)))) != np.float32(0.0011930793)
