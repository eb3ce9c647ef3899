"""`caffepy train / test / time` end to end: Caffe's log lines, snapshots, resume,
fine-tune, signals, and the exit codes and one-line errors of bad cases."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from caffepy import log, logtools, prototxt, upgrade
from caffepy.blobproto import blobproto_to_array
from caffepy.cli import main
from caffepy.solvers import snapshot

from paths import REFERENCE_MODELS, REPO

NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 4 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

SOLVER = """
net: "net.prototxt"
test_iter: 2 test_interval: 3
base_lr: 0.1 momentum: 0.9 weight_decay: 0.0005
lr_policy: "inv" gamma: 0.0001 power: 0.75
display: 2 max_iter: {max_iter}
snapshot: 3 snapshot_prefix: "snap"
random_seed: 11
solver_mode: GPU
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text(SOLVER.format(max_iter=6))
    return tmp_path


@pytest.fixture
def loud():
    log.set_quiet(False)
    yield
    log.set_quiet(True)


def caffepy(*args):
    return CliRunner().invoke(main, list(args))


def arrays(path):
    net = upgrade.read_binary_net(path)
    return [blobproto_to_array(b) for layer in net.layer for b in layer.blobs]


def test_train_logs_caffes_lines_and_snapshots(tiny, loud):
    result = caffepy("train", "-solver", "solver.prototxt")
    assert result.exit_code == 0, result.output
    err = result.stderr
    for line in ("solver_mode: GPU requested; caffepy runs on the CPU", "Solving tiny",
                 "Learning Rate Policy: inv", "Iteration 0, Testing net (#0)",
                 "    Test net output #0: accuracy = ", "    Test net output #1: loss = ",
                 "Iteration 2 (", "iter/s, ", "s/2 iters), loss = ",
                 "    Train net output #0: loss = ", " (* 1 = ", "Iteration 2, lr = 0.0999",
                 "Snapshotting to binary proto file snap_iter_3.caffemodel",
                 "Snapshotting solver state to binary proto file snap_iter_3.solverstate",
                 "Iteration 6, loss = ", "Iteration 6, Testing net (#0)", "Optimization Done."):
        assert line in err, line
    assert sorted(p for p in os.listdir(tiny) if p.startswith("snap")) == [
        "snap_iter_3.caffemodel", "snap_iter_3.solverstate", "snap_iter_6.caffemodel", "snap_iter_6.solverstate"]
    (tiny / "train.log").write_text(err)
    train_rows, test_rows = logtools.parse_log(str(tiny / "train.log"))
    assert [r["NumIters"] for r in train_rows] == [0, 2, 4]
    assert [r["NumIters"] for r in test_rows] == [0, 3, 6]
    assert list(test_rows[0]) == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    # as in Caffe's parse_log, a row carries the last "lr =" printed before it
    assert train_rows[2]["LearningRate"] == pytest.approx(0.1 * (1 + 0.0001 * 2) ** -0.75, rel=1e-5)


def test_resume_gives_the_uninterrupted_weights(tiny):
    assert caffepy("train", "-solver", "solver.prototxt").exit_code == 0
    want = arrays("snap_iter_6.caffemodel")
    os.remove("snap_iter_6.caffemodel")
    result = caffepy("train", "-solver", "solver.prototxt", "-snapshot", "snap_iter_3.solverstate")
    assert result.exit_code == 0, result.output
    got = arrays("snap_iter_6.caffemodel")
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_finetune_starts_from_the_given_weights(tiny):
    assert caffepy("train", "-solver", "solver.prototxt").exit_code == 0
    (tiny / "zero.prototxt").write_text(SOLVER.format(max_iter=0).replace('"snap"', '"ft"')
                                        .replace("snapshot: 3", "snapshot: 0"))
    result = caffepy("train", "-solver", "zero.prototxt", "-weights", "snap_iter_6.caffemodel")
    assert result.exit_code == 0, result.output
    want, got = arrays("snap_iter_6.caffemodel"), arrays("ft_iter_0.caffemodel")
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_test_command_prints_batches_and_means(tiny, loud):
    assert caffepy("train", "-solver", "solver.prototxt").exit_code == 0
    result = caffepy("test", "-model", "net.prototxt", "-weights", "snap_iter_6.caffemodel", "-iterations", "3")
    assert result.exit_code == 0, result.output
    err = result.stderr
    for line in ("Running for 3 iterations.", "Batch 0, accuracy = ", "Batch 2, loss = ", "Loss: ",
                 "] accuracy = ", "] loss = "):
        assert line in err, line
    assert "Batch 3," not in err
    means = [line for line in err.splitlines() if "] loss = " in line]
    assert means and "(* 1 = " in means[-1]


def test_time_command_reports_caffes_figures(tiny, loud):
    result = caffepy("time", "-model", "net.prototxt", "-iterations", "3")
    assert result.exit_code == 0, result.output
    err = result.stderr
    for line in ("Initial loss: ", "Iteration: 3 forward-backward time: ", "        ip\tforward: ",
                 "        ip\tbackward: ", "Average Forward pass: ", "Average Backward pass: ",
                 "Average Forward-Backward: ", "Total Time: ", "*** Benchmark ends ***"):
        assert line in err, line
    # Caffe's time runs and reports every layer's backward in either phase
    result = caffepy("time", "-model", "net.prototxt", "-iterations", "2", "-phase", "TEST")
    assert result.exit_code == 0, result.output
    assert "  accuracy\tforward: " in result.stderr and "  accuracy\tbackward: " in result.stderr
    assert "Average Backward pass: " in result.stderr


DEPLOY = """
name: "deploy"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" param { lr_mult: 0 } param { lr_mult: 0 }
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_time_runs_every_backward_of_a_deploy_net(tmp_path, monkeypatch, phase):
    """No layer of a deploy net reaches a loss, yet Caffe's time calls each layer's Backward:
    parameter gradients where lr_mult != 0, no bottom diff."""
    from caffepy import actions, net as net_module

    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    calls = []
    create = net_module.create_layer

    def counting_create(lp, *args, **kwargs):
        layer = create(lp, *args, **kwargs)
        backward = layer.backward

        def counted(top, propagate_down, bottom):
            calls.append((lp.name, tuple(propagate_down), tuple(layer.param_propagate_down)))
            return backward(top, propagate_down, bottom)
        layer.backward = counted
        return layer

    monkeypatch.setattr(net_module, "create_layer", counting_create)
    result = actions.time(str(tmp_path / "deploy.prototxt"), iterations=3, phase=phase)
    timed = {name: backward_ms for name, _, backward_ms in result["layers"]}
    assert sorted(timed) == ["conv", "data", "ip", "prob", "relu"]
    for name in timed:
        assert sum(1 for c in calls if c[0] == name) == 3, (name, calls)
    assert ("conv", (False,), (True, True)) in calls            # its weight and bias gradients
    assert ("ip", (False,), (False, False)) in calls            # lr_mult 0: none
    assert result["backward_ms"] > 0


def test_missing_solver_file(tiny):
    result = caffepy("train", "-solver", "nope.prototxt")
    assert result.exit_code == 1
    assert "caffepy: error: nope.prototxt: cannot open" in result.stderr
    assert "Traceback" not in result.output


def test_solver_without_a_net(tiny):
    (tiny / "bad.prototxt").write_text('base_lr: 0.1 lr_policy: "fixed"')
    result = caffepy("train", "-solver", "bad.prototxt")
    assert result.exit_code == 1
    assert "bad.prototxt: solver specifies no net" in result.stderr


def test_snapshot_and_weights_together_is_a_usage_error(tiny):
    result = caffepy("train", "-solver", "solver.prototxt", "-snapshot", "a.solverstate", "-weights", "b.caffemodel")
    assert result.exit_code == 2
    assert "not both" in result.output


def test_unknown_layer_type(tiny):
    (tiny / "net.prototxt").write_text(NET.replace('type: "InnerProduct"', 'type: "InnerProdcut"'))
    result = caffepy("train", "-solver", "solver.prototxt")
    assert result.exit_code == 1
    assert "layer 'ip' (InnerProdcut): type: unknown layer type 'InnerProdcut'" in result.stderr
    assert "Known types: " in result.stderr and "Traceback" not in result.output


def test_test_without_weights_is_a_usage_error(tiny):
    result = caffepy("test", "-model", "net.prototxt")
    assert result.exit_code == 2 and "--weights: needed to score a model" in result.stderr


def test_resume_from_a_missing_solverstate(tiny):
    result = caffepy("train", "-solver", "solver.prototxt", "-snapshot", "gone.solverstate")
    assert result.exit_code == 1 and "gone.solverstate: cannot open" in result.stderr


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_loss_is_one_line_naming_iteration_and_layer(tiny):
    # EuclideanLoss: NaN scores give a NaN loss (a softmax loss may clamp them to a finite one)
    net = NET.replace('type: "gaussian" std: 1', 'type: "constant" value: nan').replace(
        "shape { dim: 8 }", "shape { dim: 8 dim: 3 }").replace(
        'type: "SoftmaxWithLoss"', 'type: "EuclideanLoss"').replace(
        'layer { name: "accuracy"', '# layer { name: "accuracy"')
    (tiny / "net.prototxt").write_text(net)
    result = caffepy("train", "-solver", "solver.prototxt")
    assert result.exit_code == 1
    lines = [l for l in result.stderr.splitlines() if l.startswith("caffepy: error:")]
    assert lines == ["caffepy: error: net.prototxt: layer 'data' (DummyData): top 'data': went non-finite at "
                     "iteration 0, got loss = nan. Training stopped; no snapshot was written. Lower base_lr "
                     "or set clip_gradients"]
    assert "Traceback" not in result.output


def _spawn(args, cwd):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "caffepy.cli", *args], cwd=cwd, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_sigint_with_snapshot_saves_and_exits_cleanly(tiny):
    (tiny / "solver.prototxt").write_text(
        SOLVER.format(max_iter=10_000_000).replace("snapshot: 3", "snapshot: 0").replace("display: 2", "display: 1")
        .replace("test_interval: 3", "test_interval: 1000000"))
    proc = _spawn(["train", "-solver", "solver.prototxt", "-sigint_effect", "snapshot"], tiny)
    seen = []
    deadline = time.time() + 60
    for line in proc.stderr:
        seen.append(line)
        if "Train net output" in line and len(seen) > 5:
            proc.send_signal(signal.SIGINT)
            break
        assert time.time() < deadline, "".join(seen)
    out, err = proc.communicate(timeout=60)
    log_text = "".join(seen) + err
    assert proc.returncode == 0, log_text
    assert "Snapshotting solver state to binary proto file snap_iter_" in log_text
    assert "Optimization stopped early." in log_text
    states = [p for p in os.listdir(tiny) if p.endswith(".solverstate")]
    assert len(states) == 1
    state = snapshot.read_solver_state(tiny / states[0])
    assert state.iter > 0 and os.path.exists(tiny / state.learned_net)


# -- Caffe's reference solvers, Data layers swapped for DummyData ----------------
def _dummy_data(net, batch):
    """Replace each Data layer by DummyData of the same tops (images gaussian, labels 1)."""
    from caffepy.proto import caffe_pb2
    shapes = {"mnist": (1, 28, 28), "cifar": (3, 32, 32)}
    for layer in net.layer:
        if layer.type != "Data":
            continue
        c, h, w = shapes["mnist" if "mnist" in layer.data_param.source else "cifar"]
        layer.type = "DummyData"
        layer.ClearField("data_param")
        layer.ClearField("transform_param")
        p = layer.dummy_data_param
        p.shape.add().dim.extend([batch, c, h, w])
        p.data_filler.add().CopyFrom(caffe_pb2.FillerParameter(type="gaussian", std=1))
        if len(layer.top) > 1:
            p.shape.add().dim.extend([batch])
            p.data_filler.add().CopyFrom(caffe_pb2.FillerParameter(type="constant", value=1))
    return net


@pytest.mark.skipif(not os.path.isdir(REFERENCE_MODELS), reason="../shared/reference-models not present")
@pytest.mark.parametrize("name", ["mnist__lenet", "cifar10__cifar10_quick"])
def test_reference_solver_runs_and_its_log_parses(tmp_path, monkeypatch, loud, name):
    monkeypatch.chdir(tmp_path)
    solver = upgrade.read_solver(os.path.join(REFERENCE_MODELS, "bvlc", f"{name}_solver.prototxt"))
    net = upgrade.read_net(os.path.join(REFERENCE_MODELS, "bvlc", f"{name}_train_test.prototxt"))
    prototxt.write_text(_dummy_data(net, 8), "net.prototxt")
    solver.net = "net.prototxt"
    solver.max_iter, solver.display, solver.test_interval = 4, 1, 2
    del solver.test_iter[:]
    solver.test_iter.append(1)
    solver.snapshot_prefix = "ref"
    prototxt.write_text(solver, "solver.prototxt")
    result = caffepy("train", "-solver", "solver.prototxt")
    assert result.exit_code == 0, result.output
    (tmp_path / "ref.log").write_text(result.stderr)
    assert caffepy("parse_log", "ref.log", "tables").exit_code == 0
    train = (tmp_path / "tables" / "ref.log.train").read_text().splitlines()
    test = (tmp_path / "tables" / "ref.log.test").read_text().splitlines()
    assert train[0] == "NumIters,Seconds,LearningRate,loss" and len(train) == 5
    assert test[0] == "NumIters,Seconds,LearningRate,accuracy,loss" and len(test) == 4
    assert os.path.exists("ref_iter_4.caffemodel")


@pytest.mark.skipif(not os.path.isdir(REFERENCE_MODELS), reason="../shared/reference-models not present")
def test_reference_autoencoder_trains_with_its_two_loss_layers_and_two_test_stages(tmp_path, monkeypatch,
                                                                                 loud):
    """BVLC's mnist_autoencoder: two layers named "loss" (Caffe allows a repeated name) and two
    test nets chosen by stage; each test net reports both its losses."""
    monkeypatch.chdir(tmp_path)
    solver = upgrade.read_solver(os.path.join(REFERENCE_MODELS, "bvlc",
                                              "mnist__mnist_autoencoder_solver_nesterov.prototxt"))
    net = upgrade.read_net(os.path.join(REFERENCE_MODELS, "bvlc", "mnist__mnist_autoencoder.prototxt"))
    prototxt.write_text(_dummy_data(net, 8), "net.prototxt")
    solver.net = "net.prototxt"
    solver.max_iter, solver.display, solver.test_interval, solver.snapshot = 4, 1, 2, 0
    solver.test_iter[:] = [1, 1]
    solver.snapshot_prefix = "ae"
    prototxt.write_text(solver, "solver.prototxt")
    result = caffepy("train", "-solver", "solver.prototxt")
    assert result.exit_code == 0, result.output
    for test_net in (0, 1):
        for i, top in enumerate(("cross_entropy_loss", "l2_error")):
            assert re.search(rf"Test net output #{i}: {top} = -?[\d.]+", result.stderr.split(
                f"Testing net (#{test_net})")[-1]), result.stderr[-2000:]
    assert "Train net output #0: cross_entropy_loss" in result.stderr
    assert os.path.exists("ae_iter_4.caffemodel")
    tested = caffepy("test", "-model", "net.prototxt", "-weights", "ae_iter_4.caffemodel", "-iterations", "1",
                     "-stage", "test-on-test")
    assert tested.exit_code == 0 and "l2_error = " in tested.stderr, tested.output


def test_signal_effects():
    from caffepy.actions import SignalHandler
    with SignalHandler("snapshot", "snapshot") as handler:
        assert handler.action() == "none"
        os.kill(os.getpid(), signal.SIGHUP)
        assert handler.action() == "snapshot"          # SIGHUP: save and carry on, as Caffe
        os.kill(os.getpid(), signal.SIGINT)
        assert handler.action() == "snapshot_stop"     # Ctrl-C: save, then stop
        assert handler.action() == "none"
    with SignalHandler("none", "stop") as handler:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGHUP)
        assert handler.action() == "stop"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_test_compute_loss_line(tiny, loud):
    (tiny / "solver.prototxt").write_text(SOLVER.format(max_iter=1) + "test_compute_loss: true\n")
    result = caffepy("train", "-solver", "solver.prototxt")
    assert result.exit_code == 0 and "] Test loss: " in result.stderr


def test_time_reports_the_data_wait_of_a_data_layer(tmp_path, monkeypatch, loud):
    from data_helpers import data_net_text, make_db
    monkeypatch.chdir(tmp_path)
    make_db(tmp_path / "db", 16, shape=(1, 2, 2))
    text = data_net_text(str(tmp_path / "db"), 4) + NET.split("\n", 5)[5].replace("num_output: 3", "num_output: 16")
    (tmp_path / "net.prototxt").write_text('name: "d"\n' + text)
    result = caffepy("time", "-model", "net.prototxt", "-iterations", "2")
    assert result.exit_code == 0, result.output
    assert "Data wait (data): " in result.stderr and "% of the forward pass" in result.stderr


# Caffe prints the iter/s line at each display, and sums test scores in float, so 100 batches
# of 0.9 average to 0.900001 (the real caffe binary's line). The loss is 0: nothing trains.
FLOAT_SUMS = """
name: "sums"
layer { name: "data" type: "DummyData" top: "score" top: "a" top: "b"
  dummy_data_param { shape { dim: 1 } data_filler { type: "constant" value: 0.9 }
    data_filler { type: "constant" value: 0 } data_filler { type: "constant" value: 0 } } }
layer { name: "p" type: "Power" bottom: "score" top: "out" }
layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" }
"""


def test_log_has_caffes_lines_and_float_sums(tmp_path, monkeypatch, loud):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(FLOAT_SUMS)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" test_iter: 100 test_interval: 2 base_lr: 0.01 lr_policy: "fixed" '
        'max_iter: 4 display: 2 snapshot_after_train: false')
    result = caffepy("train", "-solver", "solver.prototxt")
    assert result.exit_code == 0, result.output
    lines = [line.split("] ", 1)[1] for line in result.stderr.splitlines() if "] " in line]
    shown = [line for line in lines if line.startswith("Iteration ") and "iter/s" in line]
    assert [line.split(" (")[0] for line in shown] == ["Iteration 0", "Iteration 2"]
    # Caffe's CPU timer counts whole milliseconds: the lapse has at most 3 decimals
    lapse = float(shown[1].split(", ")[1].split("s/")[0])
    assert round(lapse, 3) == lapse and shown[1].endswith("s/2 iters), loss = 0")
    assert "    Test net output #1: out = 0.900001" in lines
    assert "    Train net output #1: out = 0.9" in lines
    (tmp_path / "w.caffemodel").write_bytes(b"\x0a\x04sums")
    result = caffepy("test", "-model", "net.prototxt", "-weights", "w.caffemodel", "-iterations", "100")
    assert result.exit_code == 0, result.output
    assert result.stderr.rstrip().endswith("] out = 0.900001")


def test_a_rank_outlives_a_signal_arriving_after_its_run():
    """Under MPI the ranks stop together when the first one has a signal; the launcher's
    copy for a slower rank can come after that rank left the solver, and must not kill it
    (SIGUSR1's default) or raise KeyboardInterrupt (SIGINT's) in a finished job."""
    code = ("import os, signal\n"
            "from caffepy.actions import SignalHandler\n"
            "with SignalHandler(mpi=True) as h:\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    assert h.action() == 'snapshot'\n"
            "for signum in (signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):\n"
            "    os.kill(os.getpid(), signum)\n"
            "print('alive')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "alive\n", (run.returncode, run.stderr)
