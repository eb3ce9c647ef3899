"""train --tensorboard and caffe.tensorboard.attach: the event files, read back with TensorBoard's
own reader, hold what the solver displayed and tested, at the iterations Caffe's log shows."""
import numpy as np
import pytest
from click.testing import CliRunner

import caffepy as caffe
from caffepy.cli import main
from caffepy.solvers.solver import Hooks

pytest.importorskip("tensorboardX", reason="the tensorboard extra (tensorboardX) is not installed")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="TensorBoard (its reader) is not installed")

NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 4 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  param { lr_mult: 1 } param { lr_mult: 2 }
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "constant" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

SOLVER = """
net: "net.prototxt"
test_iter: 2 test_interval: 4 test_compute_loss: true
base_lr: 0.1 momentum: 0.9 lr_policy: "step" gamma: 0.5 stepsize: 3
display: 2 max_iter: 8 iter_size: 2
snapshot_after_train: false
random_seed: 3
"""


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    return tmp_path


def read_events(logdir):
    events = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def scalars(events, tag):
    return [(e.step, e.value) for e in events.Scalars(tag)]


class Recorder(Hooks):
    """What the solver hands its hooks, to compare the events with."""

    def __init__(self):
        self.displays, self.tests = [], []

    def on_display(self, solver, stats):
        self.displays.append(dict(stats))

    def on_test(self, solver, index, outputs, loss):
        self.tests.append((solver.iter, index, outputs, loss))


def test_events_hold_what_the_solver_displayed_and_tested(run_dir):
    solver = caffe.get_solver("solver.prototxt")
    recorder = Recorder()
    solver.hooks.append(recorder)
    writer = caffe.tensorboard.attach(solver, str(run_dir / "runs"), histogram_interval=4)
    solver.solve()
    writer.close()
    events = read_events(run_dir / "runs")
    tags = set(events.Tags()["scalars"])
    assert tags == {"train/smoothed_loss", "train/learning_rate", "train/accuracy", "train/loss",
                    "speed/seconds_per_iter", "speed/items_per_second", "test/accuracy", "test/loss",
                    "test/total_loss"}
    # every display (iterations 0, 2, 4, 6): Caffe's smoothed loss, the outputs, the step policy's rate
    shown = recorder.displays
    assert [d["iteration"] for d in shown] == [0, 2, 4, 6]
    assert scalars(events, "train/smoothed_loss") == [(d["iteration"], pytest.approx(d["loss"])) for d in shown]
    assert scalars(events, "train/learning_rate") == [(0, pytest.approx(0.1)), (2, pytest.approx(0.1)),
                                                       (4, pytest.approx(0.05)), (6, pytest.approx(0.025))]
    assert scalars(events, "train/accuracy") == [(d["iteration"], pytest.approx(dict(d["outputs"])["accuracy"]))
                                                 for d in shown]
    # timed from the second display on: 2 iterations of 2 passes of 8 items each
    speed = scalars(events, "speed/items_per_second")
    assert [step for step, _ in speed] == [2, 4, 6]
    for (step, items), (_, seconds) in zip(speed, scalars(events, "speed/seconds_per_iter")):
        assert seconds > 0 and items == pytest.approx(16 / seconds, rel=1e-5)
    # every test: 0 (test_initialization), 4 and 8 (the one solve() runs after the last iteration)
    assert [t[0] for t in recorder.tests] == [0, 4, 8]
    assert scalars(events, "test/accuracy") == [(it, pytest.approx(dict(out)["accuracy"])) for it, _, out, _ in recorder.tests]
    assert scalars(events, "test/total_loss") == [(it, pytest.approx(loss)) for it, _, _, loss in recorder.tests]
    # histograms every 4 iterations: each weight blob and its gradient
    assert set(events.Tags()["histograms"]) == {"weights/ip/0", "weights/ip/1", "gradients/ip/0", "gradients/ip/1"}
    weights = events.Histograms("weights/ip/0")
    assert [h.step for h in weights] == [0, 4]
    assert weights[0].histogram_value.num == 12        # 3 x 4 values


def test_gradient_histograms_see_the_gradient_before_the_update(run_dir):
    solver = caffe.get_solver("solver.prototxt")
    seen = {}

    class Peek(Hooks):
        def on_gradients(self, solver):
            seen[solver.iter] = solver.net.params["ip"][0].diff.copy()

    writer = caffe.tensorboard.attach(solver, str(run_dir / "runs"), histogram_interval=4)
    solver.hooks.append(Peek())
    solver.step(5)
    writer.close()
    assert sorted(seen) == [0, 4]
    hist = read_events(run_dir / "runs").Histograms("gradients/ip/0")[1].histogram_value
    assert hist.num == 12
    assert hist.min == pytest.approx(seen[4].min()) and hist.max == pytest.approx(seen[4].max())
    assert hist.sum == pytest.approx(float(seen[4].sum()), abs=1e-6)
    assert np.abs(seen[4]).sum() > 0


def test_scalars_hooks_add_at_display_are_recorded_whatever_the_hook_order(run_dir):
    """A hook attached after the writer (as a user of the Python API may attach an MPI strategy)
    still has its display figures recorded, under its tags, at the display's iteration."""

    class RankFigures(Hooks):
        def on_display(self, solver, stats):
            stats["scalars"]["mpi/slowest_rank"] = solver.iter % 3
            stats["scalars"]["mpi/communication_wait_fraction"] = 0.25 + solver.iter / 100

    solver = caffe.get_solver("solver.prototxt")
    writer = caffe.tensorboard.attach(solver, str(run_dir / "runs"))
    solver.hooks.append(RankFigures())
    solver.step(7)
    writer.close()
    events = read_events(run_dir / "runs")
    assert scalars(events, "mpi/slowest_rank") == [(0, 0), (2, 2), (4, 1), (6, 0)]
    assert scalars(events, "mpi/communication_wait_fraction") == [
        (it, pytest.approx(0.25 + it / 100)) for it in (0, 2, 4, 6)]


def test_train_command_writes_events(run_dir):
    result = CliRunner().invoke(main, ["train", "--solver", "solver.prototxt", "--tensorboard", "tb",
                                       "--tensorboard_histograms", "8"])
    assert result.exit_code == 0, result.output
    events = read_events(run_dir / "tb")
    assert [step for step, _ in scalars(events, "train/smoothed_loss")] == [0, 2, 4, 6]
    assert [step for step, _ in scalars(events, "test/loss")] == [0, 4, 8]
    assert [h.step for h in events.Histograms("gradients/ip/1")] == [0]
    result = CliRunner().invoke(main, ["train", "--solver", "solver.prototxt", "--tensorboard_histograms", "8"])
    assert result.exit_code == 2 and "--tensorboard_histograms needs --tensorboard DIR" in result.output


@pytest.mark.mpi
def test_two_ranks_write_one_run_counting_the_global_batch(tmp_path):
    import os

    from mpi_helpers import MPIEXEC, make_lmdb, train, write_job
    from paths import REPO
    if not os.path.exists(MPIEXEC):
        pytest.skip("no mpiexec in the venv")
    job = write_job(tmp_path, "job", make_lmdb(tmp_path / "db"), batch=8, max_iter=4)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    result = train(job, ranks=2, args=["--tensorboard", str(tmp_path / "tb")], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(os.listdir(tmp_path / "tb")) == 1          # rank 0's event file alone
    events = read_events(tmp_path / "tb")
    assert [step for step, _ in scalars(events, "train/smoothed_loss")] == [0, 1, 2, 3]
    for (_, items), (_, seconds) in zip(scalars(events, "speed/items_per_second"),
                                        scalars(events, "speed/seconds_per_iter")):
        assert items == pytest.approx(2 * 8 / seconds, rel=1e-5)     # both ranks' batches
    # the strategy's per-rank figures, from the second display on (the first has no interval)
    assert [step for step, _ in scalars(events, "mpi/slowest_rank")] == [1, 2, 3]
    assert {value for _, value in scalars(events, "mpi/slowest_rank")} <= {0, 1}
    for _, share in scalars(events, "mpi/communication_wait_fraction"):
        assert 0 <= share <= 1
