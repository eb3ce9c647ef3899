"""Solvers against hand-computed updates, and the loop's bookkeeping (Caffe's solver tests).

The scalar problem: x = 1, label = 0, one InnerProduct weight w (no bias) and a
EuclideanLoss, so loss = w^2 / 2 and dloss/dw = w.  Every rule's first steps are
then a few lines of arithmetic, written out below in float64.
"""
import math
import os

import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng, upgrade
from caffepy.blobproto import blobproto_to_array
from caffepy.context import SINGLE, RunContext
from caffepy.errors import PrototxtError, SolverError
from caffepy.proto import caffe_pb2
from caffepy.solvers import Solver, get_solver, updates
from caffepy.solvers.solver import Hooks
from caffepy.solvers.snapshot import (RNG_STATE_FIELD, find_extension, read_solver_state,
                                      write_solver_state)

SCALAR_NET = """
net_param {{
  name: "scalar"
  layer {{ name: "data" type: "DummyData" top: "x" top: "y"
    dummy_data_param {{ shape {{ dim: 1 dim: 1 }} shape {{ dim: 1 dim: 1 }}
      data_filler {{ type: "constant" value: 1 }} data_filler {{ type: "constant" value: 0 }} }} }}
  layer {{ name: "ip" type: "InnerProduct" bottom: "x" top: "ip" {param}
    inner_product_param {{ num_output: 1 bias_term: {bias}
      weight_filler {{ type: "constant" value: 1 }} bias_filler {{ type: "constant" value: {b0} }} }} }}
  layer {{ name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "y" top: "loss" }}
}}
"""


def make_solver(text, param="", bias="false", b0=0, context=SINGLE):
    p = caffe_pb2.SolverParameter()
    text_format.Parse(SCALAR_NET.format(param=param, bias=bias, b0=b0) + text, p)
    p.snapshot_after_train = False
    return Solver(p, context=context)


def weight(solver, layer="ip", index=0):
    return float(solver.net.layer_dict[layer].blobs[index].data.ravel()[0])


def run(text, iters=3, **kw):
    s = make_solver(text, **kw)
    out = []
    for _ in range(iters):
        s.step(1)
        out.append(weight(s))
    return out


BASE = 'lr_policy: "fixed" base_lr: 0.1 max_iter: 100 display: 0 '


# -- update rules, by hand --------------------------------------------------------
def test_sgd_with_momentum():
    # h = 0.9 h + 0.1 w; w -= h:  w: 1 -> 0.9 -> 0.72 -> 0.486
    assert run(BASE + "momentum: 0.9") == pytest.approx([0.9, 0.72, 0.486], rel=1e-6)


def test_sgd_l2_weight_decay():
    # g = w + 0.1 w
    assert run(BASE + "momentum: 0.9 weight_decay: 0.1", 2) == pytest.approx([0.89, 0.6931], rel=1e-6)


def test_sgd_l1_weight_decay():
    # g = w + 0.1 sign(w)
    assert run(BASE + 'momentum: 0.9 weight_decay: 0.1 regularization_type: "L1"', 2) == \
        pytest.approx([0.89, 0.692], rel=1e-6)


def test_lr_mult_and_decay_mult_scale_the_step():
    # local rate 0.2, no decay (decay_mult 0): w -= 0.2 w
    out = run(BASE + "weight_decay: 0.5", 2, param="param { lr_mult: 2 decay_mult: 0 }")
    assert out == pytest.approx([0.8, 0.64], rel=1e-6)


def test_lr_mult_zero_freezes_the_weight():
    assert run(BASE + "momentum: 0.9 weight_decay: 0.1", 2, param="param { lr_mult: 0 }") == [1.0, 1.0]


def test_nesterov():
    # h' = 0.9 h + 0.1 g; step = 1.9 h' - 0.9 h
    assert run(BASE + 'type: "Nesterov" momentum: 0.9', 2) == pytest.approx([0.81, 0.5751], rel=1e-6)


def test_deprecated_solver_type_enum_selects_the_rule():
    assert run(BASE + "solver_type: NESTEROV momentum: 0.9", 1) == pytest.approx([0.81], rel=1e-6)


def by_hand(rule, iters, lr=0.1, momentum=0.0, delta=1e-8, rms_decay=0.99, momentum2=0.999):
    w, h, h2 = 1.0, 0.0, 0.0
    out = []
    for it in range(iters):
        g = w
        if rule == "AdaGrad":
            h += g * g
            step = lr * g / (math.sqrt(h) + delta)
        elif rule == "RMSProp":
            h = rms_decay * h + (1 - rms_decay) * g * g
            step = lr * g / (math.sqrt(h) + delta)
        elif rule == "AdaDelta":
            h = momentum * h + (1 - momentum) * g * g
            u = g * math.sqrt((h2 + delta) / (h + delta))
            h2 = momentum * h2 + (1 - momentum) * u * u
            step = lr * u
        elif rule == "Adam":
            h = momentum * h + (1 - momentum) * g
            h2 = momentum2 * h2 + (1 - momentum2) * g * g
            t = it + 1
            step = lr * math.sqrt(1 - momentum2 ** t) / (1 - momentum ** t) * h / (math.sqrt(h2) + delta)
        w -= step
        out.append(w)
    return out


def test_adagrad():
    assert run(BASE + 'type: "AdaGrad"') == pytest.approx(by_hand("AdaGrad", 3), rel=1e-5)
    assert run(BASE + 'type: "AdaGrad"', 1) == pytest.approx([0.9], rel=1e-6)


def test_rmsprop():
    want = by_hand("RMSProp", 3, rms_decay=0.9)
    assert run(BASE + 'type: "RMSProp" rms_decay: 0.9') == pytest.approx(want, rel=1e-5)
    assert want[0] == pytest.approx(1 - 0.1 / math.sqrt(0.1))


def test_adadelta():
    text = 'lr_policy: "fixed" base_lr: 1.0 display: 0 type: "AdaDelta" momentum: 0.95 delta: 1e-6'
    want = by_hand("AdaDelta", 3, lr=1.0, momentum=0.95, delta=1e-6)
    assert run(text) == pytest.approx(want, rel=1e-5)
    assert want[0] == pytest.approx(1 - math.sqrt(1e-6 / 0.050001))


def test_adam_bias_correction():
    want = by_hand("Adam", 3, momentum=0.9)
    got = run(BASE + 'type: "Adam" momentum: 0.9 momentum2: 0.999')
    assert got == pytest.approx(want, rel=1e-5)
    # with Caffe's correction the first step is lr * sign(g)
    assert got[0] == pytest.approx(0.9, rel=1e-6)


def test_adam_and_adadelta_keep_two_histories_per_parameter():
    s = make_solver(BASE + 'type: "Adam"', bias="true")
    assert [len(s.rule.state(i)) for i in range(2)] == [2, 2]


def test_adagrad_refuses_momentum():
    with pytest.raises(SolverError, match=r"momentum: cannot be used with AdaGrad, got 0.9"):
        make_solver(BASE + 'type: "AdaGrad" momentum: 0.9')


def test_unknown_solver_type_lists_known_types():
    with pytest.raises(SolverError, match=r"type: unknown solver type, got 'Adamax'.*Known types: SGD"):
        make_solver(BASE + 'type: "Adamax"')


# -- gradient handling ------------------------------------------------------------
def test_iter_size_accumulates_then_normalizes():
    one = run(BASE + "momentum: 0.9 weight_decay: 0.1", 3)
    two = run(BASE + "momentum: 0.9 weight_decay: 0.1 iter_size: 2", 3)
    assert two == pytest.approx(one, rel=1e-6)


def test_iter_size_reports_the_mean_loss():
    s = make_solver(BASE + "iter_size: 3")
    s.step(1)
    assert s.smoothed_loss == pytest.approx(0.5)


def test_clip_gradients_on_the_global_norm():
    # w = b = 1: out = 2, g_w = g_b = 2, |g| = 2 sqrt 2 > 1: both scaled to 1/sqrt 2
    s = make_solver(BASE + "clip_gradients: 1", bias="true", b0=1)
    s.step(1)
    assert weight(s, index=0) == pytest.approx(1 - 0.1 / math.sqrt(2), rel=1e-6)
    assert weight(s, index=1) == pytest.approx(1 - 0.1 / math.sqrt(2), rel=1e-6)


def test_clip_gradients_leaves_small_gradients_alone():
    assert run(BASE + "clip_gradients: 10", 1) == pytest.approx([0.9], rel=1e-6)


def test_lars_with_warmup_and_momentum_correction():
    text = ('lr_policy: "fixed" base_lr: 0.1 display: 0 momentum: 0.9 weight_decay: 0.1 '
            'local_lr_auto: true local_gw_ratio: 0.5 warmup_iter: 2 warmup_start_lr: 0.02')
    w, h, out = 1.0, 0.0, []
    for it in range(3):
        rate = (it * 0.1 + (2 - it) * 0.02) / 2 if it < 2 else 0.1
        momentum = 0.9
        if it < 2:
            prev = (max(it - 1, 0) * 0.1 + (2 - max(it - 1, 0)) * 0.02) / 2
            momentum *= rate / prev
        g = w + 0.1 * w                                      # regularized gradient
        local = 0.5 * abs(w) / (abs(g) + 0.1 * abs(w))       # LARS replaces lr_mult
        h = momentum * h + rate * local * g
        w -= h
        out.append(w)
    assert out[0] == pytest.approx(1 - 0.02 * (0.5 / 1.2) * 1.1)
    assert run(text) == pytest.approx(out, rel=1e-5)


def test_lars_uses_rate_one_for_a_zero_weight():
    # bias starts at 0: w_norm = 0, so its local rate is 1 (not lr_mult 5)
    text = BASE + "local_lr_auto: true local_gw_ratio: 0.5"
    s = make_solver(text, bias="true", b0=0, param="param { lr_mult: 1 } param { lr_mult: 5 }")
    s.step(1)
    assert weight(s, index=1) == pytest.approx(-0.1, rel=1e-6)     # g_b = 1, step = 0.1 * 1 * 1


def test_hooks_see_every_stage():
    calls = []

    class Hook:
        def on_start(self, solver):
            calls.append(("start", solver.iter))

        def on_layer_done(self, solver, layer):
            calls.append(("layer", solver.net.layers[layer].name))

        def before_update(self, solver):
            calls.append(("update", weight(solver)))

        def reduce_loss(self, solver, loss):
            return loss * 2

        def sumsq(self, solver, index, array):
            calls.append(("sumsq", index))
            return float(np.dot(array.ravel(), array.ravel()))

    s = make_solver(BASE + "clip_gradients: 100")
    s.hooks.append(Hook())
    s.step(1)
    assert calls == [("start", 0), ("layer", "ip"), ("update", 1.0), ("sumsq", 0)]
    assert s.smoothed_loss == pytest.approx(1.0)


def test_the_hooks_base_class_changes_nothing():
    text = BASE + "momentum: 0.9 clip_gradients: 100 test_iter: 1 test_interval: 2"
    want = run(text)
    s = make_solver(text)
    s.hooks.append(Hooks())
    got = []
    for _ in range(3):
        s.step(1)
        got.append(weight(s))
    assert got == want


def test_the_agreed_action_is_the_one_taken(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = []

    class Agree(Hooks):
        def agree_action(self, solver, request):
            seen.append((solver.iter, request))
            return "snapshot_stop" if solver.iter == 2 else "none"     # as if another rank asked

    s = make_solver(BASE + 'snapshot_prefix: "agreed"')
    s.action_fn = lambda: "snapshot"          # this rank's request, overruled at iteration 1
    s.hooks.append(Agree())
    s.step(10)
    assert s.iter == 2 and s.requested_early_exit
    assert seen == [(1, "snapshot"), (2, "snapshot")]
    assert sorted(os.listdir(tmp_path)) == ["agreed_iter_2.caffemodel", "agreed_iter_2.solverstate"]


class Late(Hooks):
    """Settles each iteration's record one iteration late, as the MPI strategy does (one rank:
    nothing to average); this rank asks for a snapshot at iteration `ask`."""
    lags_records = True

    def __init__(self, ask=None):
        self.held, self.ask, self.shown, self.posted = None, ask, [], []

    def post_record(self, solver, record):
        self.posted.append(record.iteration)
        if record.iteration == self.ask:
            record.request = "snapshot"
        previous, self.held = self.held, record
        return previous

    def settle_record(self, solver):
        previous, self.held = self.held, None
        return previous

    def record_display(self, solver, stats):
        self.shown.append((solver.iter, stats["iteration"], stats["loss"], stats["learning_rate"]))


def test_records_settled_late_change_only_when_they_show(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = 'lr_policy: "step" gamma: 0.5 stepsize: 2 base_lr: 0.1 max_iter: 100 display: 2 average_loss: 3 '

    class Now(Late):
        lags_records = False

    now, late = make_solver(text), make_solver(text + 'snapshot_prefix: "late"')
    now.hooks.append(Now())
    late.hooks.append(Late(ask=2))
    now.step(5)
    late.step(5)
    assert weight(late) == weight(now) and late.smoothed_loss == now.smoothed_loss
    # the same display figures, each shown one iteration later; the last one by the end of step
    assert [s[1:] for s in late.hooks[0].shown] == [s[1:] for s in now.hooks[0].shown]
    assert [s[0] for s in now.hooks[0].shown] == [0, 2, 4]
    assert [s[0] for s in late.hooks[0].shown] == [1, 3, 5]
    # iteration 2's request acts after iteration 3
    assert sorted(os.listdir(tmp_path)) == ["late_iter_4.caffemodel", "late_iter_4.solverstate"]
    assert late.hooks[0].held is None and late.hooks[0].posted == [0, 1, 2, 3, 4]
    # the plateau policy reads the smoothed loss for the rate: its records settle at once
    plateau = make_solver('lr_policy: "plateau" gamma: 0.5 plateau_winsize: 2 base_lr: 0.1 max_iter: 100 ')
    plateau.hooks.append(Late())
    plateau.step(3)
    assert plateau.hooks[0].posted == []


def test_snapshots_write_what_the_gather_hook_gives(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class Whole(Hooks):
        def gather(self, solver, index, array):
            return np.full_like(array, 7 + index)

    write_files(tmp_path, "Adam", max_iter=2)
    s = get_solver("solver.prototxt")
    s.step(2)
    s.hooks.append(Whole())
    model, state = s.snapshot()
    assert [float(a.mean()) for a in model_arrays(model)] == [7, 8]          # ip weights, bias
    history = [blobproto_to_array(b) for b in read_solver_state(state).history]
    assert [float(h.mean()) for h in history] == [7, 8, 7, 8]               # m of each, then v of each
    assert not (s.net.layer_dict["ip"].blobs[0].data == 7).all()             # the solver's own: untouched
    assert not (s.rule.state(0)[0] == 7).all()


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_tests_its_share_of_the_batches(tmp_path, monkeypatch, rank):
    """Rank r of N runs test batches r, r+N, ... in the run's context; a batch past test_iter
    is run (layers that communicate meet) but not counted; the hooks sum the scores."""
    monkeypatch.chdir(tmp_path)
    calls, sums = [], []

    class Record(Hooks):
        def before_test(self, solver):
            calls.append(solver.iter)

        def reduce_scores(self, solver, values):
            sums.append(values.tolist())
            return values * 2                     # as if the other rank had the same

    context = RunContext(rank, 2)
    s = make_solver(BASE + 'test_iter: 3 test_interval: 2 test_compute_loss: true snapshot_prefix: "r"',
                    context=context)
    assert s.net.context is context and all(layer.context is context for layer in s.net.layers)
    assert s.test_context is context and all(layer.context is context for layer in s.test_nets[0].layers)
    forwards = []
    net = s.test_nets[0]
    forward = net.forward_from_to
    net.forward_from_to = lambda *a, **k: forwards.append(1) or forward(*a, **k)
    s.hooks.append(Record())
    s.step(1)
    assert calls == [0] and len(forwards) == 2              # ceil(3 / 2) on either rank
    counted = 2 if rank == 0 else 1                         # batches 0, 2 / batch 1 (3 not counted)
    assert sums == [[0.5 * counted, 0.5 * counted]]         # loss output w^2 / 2 with w = 1; test loss
    assert s.test_scores == [[("loss", pytest.approx(2 * 0.5 * counted / 3))]]
    paths = s.snapshot()
    assert (paths is not None) == (rank == 0)
    assert sorted(os.listdir(tmp_path)) == (["r_iter_1.caffemodel", "r_iter_1.solverstate"] if rank == 0 else [])


def test_a_single_process_context_tests_in_the_same_context():
    s = make_solver(BASE + "test_iter: 1 test_interval: 2", context=RunContext(0, 1))
    assert s.test_context is s.context


def test_each_rank_seeds_with_random_seed_plus_its_rank():
    make_solver(BASE + "random_seed: 5", context=RunContext(1, 2))
    drawn = rng.generator().random()
    rng.seed(6)
    assert drawn == rng.generator().random()
    rng.seed(-1)


def test_a_rules_history_is_per_parameter_and_may_shrink_to_a_slice():
    p = caffe_pb2.SolverParameter(type="Adam", momentum=0.9, momentum2=0.999, delta=1e-8)
    rule = updates.make_rule(p, [(4, 3), (4,)])
    assert [[h.shape for h in rule.state(i)] for i in range(2)] == [[(4, 3), (4, 3)], [(4,), (4,)]]
    rule.state(0)[0][...] = np.arange(12).reshape(4, 3)
    rule.set_state(0, [h[1:3].copy() for h in rule.state(0)])       # a rank's rows
    np.testing.assert_array_equal(rule.state(0)[0], np.arange(3, 9).reshape(2, 3))
    g = np.ones((2, 3), np.float32)
    rule.compute(0, g, 0.1, 0, 0.9)                                  # scratch follows the new shape
    assert g.shape == (2, 3) and np.isfinite(g).all()
    assert rule.state(0)[1].shape == (2, 3) and (rule.state(0)[1] > 0).all()


# -- loop bookkeeping ---------------------------------------------------------------
def test_smoothed_loss_averages_the_last_average_loss_iterations():
    s = make_solver('lr_policy: "fixed" base_lr: 0.1 display: 0 average_loss: 2')
    s.step(3)
    # losses w^2/2 for w = 1, 0.9, 0.81: the last two averaged
    assert s.smoothed_loss == pytest.approx((0.81 + 0.6561) / 4, rel=1e-5)


def test_test_nets_share_the_train_weights_and_average_outputs():
    s = make_solver(BASE + "test_iter: 3 test_interval: 1 test_initialization: false")
    s.step(1)
    s.test_all()
    assert s.test_scores == [[("loss", pytest.approx(0.9 ** 2 / 2, rel=1e-6))]]


def test_random_seed_makes_runs_identical():
    text = BASE + "random_seed: 5"
    gauss = ("net_param { name: 'g' layer { name: 'data' type: 'DummyData' top: 'x' top: 'y' "
             "dummy_data_param { shape { dim: 3 dim: 2 } shape { dim: 3 dim: 1 } "
             "data_filler { type: 'gaussian' std: 1 } } } "
             "layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'ip' inner_product_param { "
             "num_output: 1 weight_filler { type: 'gaussian' std: 1 } } } "
             "layer { name: 'loss' type: 'EuclideanLoss' bottom: 'ip' bottom: 'y' top: 'loss' } }")

    def train():
        p = caffe_pb2.SolverParameter()
        text_format.Parse(gauss + text, p)
        p.snapshot_after_train = False
        s = Solver(p)
        s.step(4)
        return s.net.layer_dict["ip"].blobs[0].data.copy()

    a, b = train(), train()
    assert np.array_equal(a, b)
    rng.seed(-1)


def test_solver_without_a_net_is_an_error():
    p = caffe_pb2.SolverParameter(base_lr=0.1, lr_policy="fixed")
    with pytest.raises(PrototxtError, match="specifies no net"):
        Solver(p)


# -- snapshots ----------------------------------------------------------------------
SOLVER_FILE = """
net: "net.prototxt"
base_lr: 0.05 momentum: 0.9 weight_decay: 0.01
lr_policy: "multistep" gamma: 0.5 stepvalue: 3 stepvalue: 7
type: "{type}" display: 0 max_iter: {max_iter}
snapshot: 5 snapshot_prefix: "out/run" random_seed: 3
"""

NET_FILE = """
name: "noisy"
layer { name: "data" type: "DummyData" top: "x" top: "y"
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: -1 max: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "y" top: "loss" }
"""


def write_files(tmp_path, type_="SGD", max_iter=10):
    (tmp_path / "net.prototxt").write_text(NET_FILE)
    (tmp_path / "solver.prototxt").write_text(SOLVER_FILE.format(type=type_, max_iter=max_iter))
    (tmp_path / "out").mkdir(exist_ok=True)


def model_arrays(path):
    net = upgrade.read_binary_net(path)
    return [blobproto_to_array(b) for layer in net.layer for b in layer.blobs]


def test_solver_state_round_trip(tmp_path):
    state = caffe_pb2.SolverState(iter=100, learned_net="x_iter_100.caffemodel", current_step=2)
    state.history.add().data.extend([0.5, 1.5])
    write_solver_state(state, tmp_path / "x.solverstate")
    assert read_solver_state(tmp_path / "x.solverstate") == state


@pytest.mark.parametrize("type_", ["SGD", "Adam"])
def test_snapshot_restore_continue_is_bit_identical(tmp_path, monkeypatch, type_):
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, type_)
    full = get_solver("solver.prototxt")
    full.solve()
    want = model_arrays("out/run_iter_10.caffemodel")
    os.rename("out/run_iter_10.caffemodel", "out/full.caffemodel")

    resumed = get_solver("solver.prototxt")
    resumed.solve("out/run_iter_5.solverstate")
    assert resumed.iter == 10 and resumed.current_step == 2
    got = model_arrays("out/run_iter_10.caffemodel")
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    rng.seed(-1)


def test_solverstate_is_caffes_shape(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, "Adam", max_iter=5)
    get_solver("solver.prototxt").solve()
    state = read_solver_state("out/run_iter_5.solverstate")
    assert state.iter == 5 and state.learned_net == "out/run_iter_5.caffemodel"
    assert state.current_step == 1 and len(state.history) == 4
    assert find_extension(state.SerializeToString(), RNG_STATE_FIELD) is not None
    assert sorted(os.listdir("out")) == ["run_iter_5.caffemodel", "run_iter_5.solverstate"]


def test_restore_finds_the_caffemodel_next_to_the_solverstate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, max_iter=5)
    get_solver("solver.prototxt").solve()
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in ("run_iter_5.caffemodel", "run_iter_5.solverstate"):
        os.rename(tmp_path / "out" / name, moved / name)
    s = get_solver("solver.prototxt")
    s.restore(str(moved / "run_iter_5.solverstate"))
    assert s.iter == 5
    want = model_arrays(moved / "run_iter_5.caffemodel")
    assert np.array_equal(s.net.layer_dict["ip"].blobs[0].data, want[0])


def test_restore_with_another_solver_type_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, "SGD", max_iter=5)
    get_solver("solver.prototxt").solve()
    write_files(tmp_path, "Adam", max_iter=5)
    with pytest.raises(SolverError, match=r"history: incorrect number of history blobs .*expected 4\), got 2"):
        get_solver("solver.prototxt").restore("out/run_iter_5.solverstate")


def test_default_snapshot_prefix_is_the_solver_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, max_iter=2)
    text = (tmp_path / "solver.prototxt").read_text().replace('snapshot_prefix: "out/run"', "")
    (tmp_path / "solver.prototxt").write_text(text)
    s = get_solver("solver.prototxt")
    assert s.param.snapshot_prefix == "solver"
    s.solve()
    assert os.path.exists("solver_iter_2.caffemodel")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_non_finite_loss_stops_with_the_layer_and_keeps_the_last_snapshot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # w <- w - 3 w = -2 w: the loss w^2 / 2 overflows float32 at iteration 65
    p = caffe_pb2.SolverParameter()
    text_format.Parse(SCALAR_NET.format(param="", bias="false", b0=0)
                      + 'lr_policy: "fixed" base_lr: 3 display: 0 max_iter: 100 snapshot: 10 '
                        'snapshot_prefix: "nan"', p)
    s = Solver(p)
    with pytest.raises(SolverError) as err:
        s.solve()
    msg = str(err.value)
    assert "layer 'loss' (EuclideanLoss): top 'loss': went non-finite at iteration 65, got loss = inf" in msg
    assert "nan_iter_60.solverstate, was kept" in msg
    assert sorted(os.listdir(tmp_path))[-2:] == ["nan_iter_60.caffemodel", "nan_iter_60.solverstate"]
    assert np.isfinite(model_arrays("nan_iter_60.caffemodel")[0]).all()


def test_pycaffe_typed_solver_classes(tmp_path, monkeypatch):
    import caffepy
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, max_iter=2)
    s = caffepy.NesterovSolver("solver.prototxt")
    assert s.type == "Nesterov" and len(s.test_nets) == 0
    s.step(2)
    assert s.iter == 2
    paths = s.snapshot()
    assert paths == ("out/run_iter_2.caffemodel", "out/run_iter_2.solverstate")


def test_every_solver_type_has_its_pycaffe_class(tmp_path, monkeypatch):
    import caffepy
    from caffepy.solvers.updates import RULES
    monkeypatch.chdir(tmp_path)
    for name in RULES:
        cls = getattr(caffepy, f"{name}Solver")
        assert cls.forced_type == name and cls.__name__ == f"{name}Solver"
        write_files(tmp_path, name, max_iter=1)
        text = (tmp_path / "solver.prototxt").read_text()
        if name in ("AdaGrad", "RMSProp"):
            text = text.replace("momentum: 0.9", "")
        (tmp_path / "solver.prototxt").write_text(text)
        assert type(get_solver("solver.prototxt")) is cls
    rng.seed(-1)


@pytest.mark.parametrize("extra", [
    "weight_decay: 0.01", 'weight_decay: 0.01 regularization_type: "L1"', "iter_size: 2 weight_decay: 0.01",
    "weight_decay: 0.01 local_lr_auto: true local_gw_ratio: 0.1 warmup_iter: 2 warmup_start_lr: 0.01",
    'type: "Nesterov" weight_decay: 0.01', 'type: "AdaGrad" momentum: 0 weight_decay: 0.01',
    'type: "RMSProp" momentum: 0 rms_decay: 0.9', 'type: "AdaDelta" iter_size: 2 delta: 1e-6',
    'type: "Adam" weight_decay: 0.01 iter_size: 2'])
def test_compiled_updates_match_numpy(tmp_path, monkeypatch, extra):
    pytest.importorskip("caffepy.kernels.solver")
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, max_iter=4)
    text = (tmp_path / "solver.prototxt").read_text().replace('type: "SGD"', "").replace("weight_decay: 0.01", "")
    if "momentum: 0 " in extra:
        text = text.replace("momentum: 0.9", "")
    text += extra
    (tmp_path / "solver.prototxt").write_text(text)
    results = []
    for use in (False, True):
        monkeypatch.setattr(Solver, "use_kernels", use)
        s = get_solver("solver.prototxt")
        s.step(4)
        results.append([b.data.copy() for b in s.net.learnable_params])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    rng.seed(-1)


# -- net forms and states -------------------------------------------------------------
STATED_NET = NET_FILE + """
layer { name: "only_a" type: "Power" bottom: "loss" top: "a_out" include { stage: "a" } }
layer { name: "only_b" type: "Power" bottom: "loss" top: "b_out" include { stage: "b" } }
layer { name: "deep" type: "Power" bottom: "loss" top: "deep_out" include { phase: TRAIN min_level: 2 } }
"""


def test_train_net_test_nets_and_their_states(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(STATED_NET)
    p = caffe_pb2.SolverParameter()
    text_format.Parse('train_net: "net.prototxt" test_net: "net.prototxt" test_net: "net.prototxt" '
                      'test_iter: 1 test_iter: 2 test_interval: 10 test_compute_loss: true '
                      'test_state { stage: "a" } test_state { stage: "b" } '
                      'lr_policy: "fixed" base_lr: 0.01 display: 0 max_iter: 1', p)
    s = Solver(p, level=2, stages=["a"])
    assert set(s.net.outputs) == {"a_out", "deep_out"}
    assert [set(n.outputs) for n in s.test_nets] == [{"a_out"}, {"b_out"}]
    s.test_all()
    assert [name for name, _ in s.test_scores[1]] == ["b_out"]
    assert Solver(p).net.outputs == ["loss"]      # level 0 and no stage: no extra layer


def test_test_iter_must_match_the_test_nets():
    p = caffe_pb2.SolverParameter()
    text_format.Parse(SCALAR_NET.format(param="", bias="false", b0=0)
                      + 'test_net_param { name: "t" } lr_policy: "fixed" base_lr: 0.1', p)
    with pytest.raises(PrototxtError, match="test_iter: one is needed per test net"):
        Solver(p)


def test_snapshot_directory_is_checked_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path)
    text = (tmp_path / "solver.prototxt").read_text().replace('"out/run"', '"missing/run"')
    (tmp_path / "solver.prototxt").write_text(text)
    with pytest.raises(SolverError, match=r"snapshot_prefix: the directory 'missing' does not exist, "
                                          r"got 'missing/run'"):
        get_solver("solver.prototxt")


def test_non_finite_weights_stop_training_at_a_display_iteration():
    # ip2's top is an output without loss weight: its NaN weights never reach the loss
    p = caffe_pb2.SolverParameter()
    net = SCALAR_NET.format(param="", bias="false", b0=0).replace(
        '  layer {{ name: "loss"'.replace("{{", "{"),
        '  layer { name: "ip2" type: "InnerProduct" bottom: "x" top: "ip2" '
        'inner_product_param { num_output: 1 bias_term: false } }\n  layer { name: "loss"')
    text_format.Parse(net + 'lr_policy: "fixed" base_lr: 0.1 display: 2 max_iter: 10', p)
    p.snapshot_after_train = False
    s = Solver(p)
    assert [layer.name for layer in s.net.layers][-2:] == ["ip2", "loss"]
    s.step(1)
    s.net.layer_dict["ip2"].blobs[0].data[...] = np.nan
    with pytest.raises(SolverError, match=r"layer 'ip2' \(InnerProduct\): blobs\[0\]: weights went non-finite "
                                          r"by iteration 2, got a sum of nan"):
        s.step(3)
    assert s.iter == 2


@pytest.mark.parametrize("offset,tested", [(0, [0, 3, 6]), (1, [1, 4]), (5, [2, 5])])
def test_intel_test_offset_shifts_the_test_iterations(offset, tested):
    s = make_solver(BASE + f"test_iter: 1 test_interval: 3 test_offset: {offset}")
    seen = []
    s.test_all = lambda: seen.append(s.iter)
    s.step(7)
    assert seen == tested


# -- updates the hooks defer (gradients still being reduced) ------------------------
class DeferWeight(Hooks):
    """Says the ip weight's gradient is still on its way; records when it is awaited and the
    weight at that moment (its previous update must not have happened yet)."""

    def __init__(self):
        self.awaited = []

    def pending_gradients(self, solver):
        return [0]

    def await_gradients(self, solver, indices):
        self.awaited.append((solver.iter, list(indices), weight(solver)))


def test_a_deferred_update_happens_before_the_next_forward_needs_it():
    s = make_solver(BASE + "momentum: 0.9")
    hook = DeferWeight()
    s.hooks.append(hook)
    out = []
    s.step(3)
    out.append(weight(s))
    # the same weights as without deferring: 1 -> 0.9 -> 0.72 -> 0.486
    assert out == pytest.approx([0.486], rel=1e-6)
    # iteration k's update waits until iteration k+1's forward reaches the ip layer; the last
    # one is applied when step() returns
    assert hook.awaited == [(1, [0], 1.0), (2, [0], pytest.approx(0.9)), (3, [0], pytest.approx(0.72))]


def test_a_deferred_update_is_applied_before_a_test_and_a_snapshot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = make_solver(BASE + 'momentum: 0.9 test_iter: 1 test_interval: 2 snapshot: 1 snapshot_prefix: "d"')
    hook = DeferWeight()
    s.hooks.append(hook)
    s.step(2)
    # the snapshot after iteration 0 awaits (iter 1), as does each later one
    assert [a[0] for a in hook.awaited] == [1, 2]
    from caffepy import upgrade
    from caffepy.blobproto import blobproto_to_array
    saved = upgrade.read_binary_net(str(tmp_path / "d_iter_1.caffemodel"))
    assert float(blobproto_to_array(saved.layer[1].blobs[0]).ravel()[0]) == pytest.approx(0.9)


def test_clip_gradients_awaits_every_gradient_before_the_update():
    s = make_solver(BASE + "momentum: 0.9 clip_gradients: 100")
    hook = DeferWeight()
    s.hooks.append(hook)
    s.step(2)
    assert hook.awaited == [(0, [0], 1.0), (1, [0], pytest.approx(0.9))]
    assert weight(s) == pytest.approx(0.72, rel=1e-6)


def test_train_outputs_are_the_mean_over_ranks(monkeypatch):
    """Like the loss line, "Train net output" shows the mean over the ranks."""
    from caffepy import log
    lines = []
    monkeypatch.setattr(log, "info", lambda msg, everyone=False: lines.append(msg))

    class OtherRankTriples(Hooks):            # the other rank's output is 3x this one's
        def reduce_scores(self, solver, values):
            return values * 4

    s = make_solver(BASE.replace("display: 0", "display: 1"), context=RunContext(0, 2))
    s.hooks.append(OtherRankTriples())
    s.step(1)
    shown = [line for line in lines if "Train net output" in line]
    assert shown == ["    Train net output #0: loss = 1 (* 1 = 1 loss)"]      # (0.5 + 1.5) / 2


def test_solver_start_removes_its_prefix_s_stale_snapshot_temporaries(tmp_path, monkeypatch):
    """A kill -9 mid-snapshot leaves `.run_iter_N.<ext>.<pid>@<host>.*.tmp`: the next run with
    this prefix removes those of dead writers, and nothing else."""
    import socket
    import subprocess
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, max_iter=0)
    proc = subprocess.Popen(["true"])
    proc.wait()
    host, dead = socket.gethostname(), proc.pid
    stale = [f".run_iter_5.caffemodel.{dead}@{host}.abcdefgh.tmp", f".run_iter_10.solverstate.{dead}@{host}.a_b_c_d_.tmp"]
    kept = [f".run_iter_5.caffemodel.{os.getpid()}@{host}.abcdefgh.tmp", f".other_iter_5.caffemodel.{dead}@{host}.abcdefgh.tmp",
            f".run_iter_5.caffemodel.{dead}@elsewhere.abcdefgh.tmp", f".run_iter_x.caffemodel.{dead}@{host}.abcdefgh.tmp",
            "run_iter_3.caffemodel"]
    for name in stale + kept:
        (tmp_path / "out" / name).write_bytes(bytes(1000))
    get_solver("solver.prototxt")
    assert sorted(os.listdir("out")) == sorted(kept)


def test_a_late_non_finite_loss_names_its_own_iteration():
    """Another rank's non-finite loss arrives with the settled record: the error names that
    iteration (the tops here are of the next one, so no layer)."""
    class NaNAt1(Late):
        def post_record(self, solver, record):
            if record.iteration == 1:
                record.loss = float("nan")             # as the mean over ranks would be
            return super().post_record(solver, record)

    s = make_solver(BASE)
    s.hooks.append(NaNAt1())
    with pytest.raises(SolverError, match=r"iteration 1: loss is not finite, got nan") as caught:
        s.step(5)
    assert s.iter == 2 and "layer" not in str(caught.value)
