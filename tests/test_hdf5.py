"""HDF5 snapshots (snapshot_format: HDF5) and .h5 weights, in Caffe's dataset layout:
written, read back, resumed bit for bit, given to --weights / --snapshot / copy_from, and
the one-line answers without h5py.  tests/test_caffe_binary.py exchanges them with Caffe."""
import builtins
import os

import numpy as np
import pytest
from click.testing import CliRunner

from caffepy import Net, rng
from caffepy.cli import main
from caffepy.errors import CaffepyError
from caffepy.solvers import get_solver

h5py = pytest.importorskip("h5py")

SOLVER = """
net: "net.prototxt"
base_lr: 0.05 momentum: 0.9 weight_decay: 0.01
lr_policy: "plateau" gamma: 0.5 plateau_winsize: 2 plateau_winsize: 3
type: "{type}" display: 0 max_iter: 10
snapshot: 5 snapshot_prefix: "out/run" random_seed: 3
snapshot_format: {format}
"""

NET = """
name: "noisy"
layer { name: "data" type: "DummyData" top: "x" top: "y"
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: -1 max: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "y" top: "loss" }
"""


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "out").mkdir()

    def solver(type_="SGD", format_="HDF5"):
        (tmp_path / "solver.prototxt").write_text(SOLVER.format(type=type_, format=format_))
        return "solver.prototxt"
    yield solver
    rng.seed(-1)


def weights(path):
    with h5py.File(path, "r") as f:
        return {f"{layer}/{i}": f["data"][layer][i][()] for layer in f["data"] for i in f["data"][layer]}


def test_hdf5_snapshot_has_caffes_layout(files):
    get_solver(files("Adam")).solve()
    assert sorted(os.listdir("out")) == ["run_iter_10.caffemodel.h5", "run_iter_10.solverstate.h5",
                                         "run_iter_5.caffemodel.h5", "run_iter_5.solverstate.h5"]
    with h5py.File("out/run_iter_5.caffemodel.h5", "r") as f:
        assert list(f) == ["data"] and sorted(f["data"]) == ["data", "ip", "loss"]
        assert f["data/ip/0"].shape == (2, 3) and f["data/ip/0"].dtype == np.float32
    with h5py.File("out/run_iter_5.solverstate.h5", "r") as f:
        # SGDSolver::SnapshotSolverStateToHDF5, plus Intel's plateau fields and our generator state
        assert sorted(f) == ["caffepy_rng_state", "caffepy_run_state", "current_step", "history", "iter",
                             "iter_last_event", "learned_net", "minimum_loss"]
        assert f["iter"].shape == (1,) and f["iter"].dtype == np.int32 and f["iter"][0] == 5
        assert f["current_step"].shape == (1,) and f["current_step"].dtype == np.int32
        assert f["minimum_loss"].shape == (1,) and f["minimum_loss"].dtype == np.float32
        assert sorted(f["history"]) == ["0", "1", "2", "3"]            # Adam: m and v per parameter
        assert f["history/2"].shape == (2, 3) and f["history/2"].dtype == np.float32
        # H5LTmake_dataset_string: a scalar, NUL-terminated, one byte longer than the text
        kind = f["learned_net"].id.get_type()
        assert f["learned_net"].shape == () and kind.get_size() == len("out/run_iter_5.caffemodel.h5") + 1
        assert kind.get_strpad() == h5py.h5t.STR_NULLTERM
        assert f["learned_net"][()] == b"out/run_iter_5.caffemodel.h5"


@pytest.mark.parametrize("type_", ["SGD", "Adam"])
def test_hdf5_resume_is_bit_identical(files, type_):
    get_solver(files(type_)).solve()
    want = weights("out/run_iter_10.caffemodel.h5")
    os.remove("out/run_iter_10.caffemodel.h5")
    resumed = get_solver(files(type_))
    resumed.solve("out/run_iter_5.solverstate.h5")
    assert resumed.iter == 10
    got = weights("out/run_iter_10.caffemodel.h5")
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)


HDF5_NET = """
name: "rows"
layer { name: "in" type: "HDF5Data" top: "x" top: "y" hdf5_data_param { source: "list.txt" batch_size: 3 shuffle: true } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "y" top: "loss" }
"""


@pytest.mark.parametrize("format_", ["HDF5", "BINARYPROTO"])
def test_hdf5data_run_resumes_exactly(files, tmp_path, format_):
    """Shuffled rows of two files: resumed at 5, the run reads the very rows it would have."""
    gen = np.random.default_rng(0)
    for name, rows in (("a.h5", 5), ("b.h5", 4)):
        with h5py.File(tmp_path / name, "w") as f:
            f["x"] = gen.normal(size=(rows, 3))
            f["y"] = gen.normal(size=(rows, 2))
    (tmp_path / "list.txt").write_text("a.h5\nb.h5\n")
    (tmp_path / "net.prototxt").write_text(HDF5_NET)
    files("SGD", format_)
    ext = ".h5" if format_ == "HDF5" else ""
    get_solver("solver.prototxt").solve()
    model = f"out/run_iter_10.caffemodel{ext}"
    net = Net("net.prototxt", model, 1)
    want = [b.data.copy() for b in net.params["ip"]]
    os.remove(model)
    get_solver("solver.prototxt").solve(f"out/run_iter_5.solverstate{ext}")
    got = Net("net.prototxt", model, 1).params["ip"]
    assert all(np.array_equal(w, g.data) for w, g in zip(want, got))


def test_either_format_resumes_and_loads_weights(files):
    get_solver(files("SGD", "BINARYPROTO")).solve()
    binary = get_solver(files("SGD", "HDF5"))        # writes .h5, resumes from a .solverstate
    binary.restore("out/run_iter_5.solverstate")
    assert binary.iter == 5
    net = Net("net.prototxt", "out/run_iter_5.caffemodel", 1)
    np.testing.assert_array_equal(binary.net.params["ip"][0].data, net.params["ip"][0].data)
    binary.snapshot()
    h5 = Net("net.prototxt", 1)
    h5.copy_from("out/run_iter_5.caffemodel.h5")     # copy_from knows HDF5 by its signature
    np.testing.assert_array_equal(h5.params["ip"][0].data, net.params["ip"][0].data)
    os.rename("out/run_iter_5.caffemodel.h5", "out/weights.bin")
    Net("net.prototxt", "out/weights.bin", 1)


def test_cli_snapshot_and_weights_take_h5(files):
    files("SGD", "HDF5")
    run = CliRunner()
    assert run.invoke(main, ["train", "-solver", "solver.prototxt"]).exit_code == 0
    os.remove("out/run_iter_10.caffemodel.h5")
    result = run.invoke(main, ["train", "-solver", "solver.prototxt", "-snapshot", "out/run_iter_5.solverstate.h5"])
    assert result.exit_code == 0, result.output
    assert os.path.exists("out/run_iter_10.caffemodel.h5")
    result = run.invoke(main, ["train", "-solver", "solver.prototxt", "-weights", "out/run_iter_5.caffemodel.h5"])
    assert result.exit_code == 0, result.output
    result = run.invoke(main, ["train", "-solver", "solver.prototxt", "-snapshot", "out/run_iter_5.caffemodel.h5"])
    assert result.exit_code == 2 and "holds weights" in result.output and "--weights" in result.output
    result = run.invoke(main, ["test", "-model", "net.prototxt", "-weights", "out/run_iter_5.solverstate.h5",
                               "-iterations", "1"])
    assert result.exit_code == 1
    assert result.output.strip().endswith("no 'data' group: a solver state (.solverstate.h5)")


def test_damaged_hdf5_states_are_one_line(files, tmp_path):
    get_solver(files("SGD")).solve()
    with h5py.File("out/run_iter_5.solverstate.h5", "a") as f:
        del f["history/1"]
    result = CliRunner().invoke(main, ["train", "-solver", "solver.prototxt", "-snapshot",
                                       "out/run_iter_5.solverstate.h5"])
    assert result.exit_code == 1
    assert "history: incorrect number of history blobs for a SGD solver over this net (expected 2), got 1" \
        in result.output
    (tmp_path / "bad.solverstate.h5").write_bytes(b"not hdf5 at all")
    result = CliRunner().invoke(main, ["train", "-solver", "solver.prototxt", "-snapshot", "bad.solverstate.h5"])
    assert result.exit_code == 1 and "bad.solverstate.h5: not an HDF5 file" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_interrupted_hdf5_snapshot_leaves_no_file(files, monkeypatch):
    solver = get_solver(files("SGD"))
    solver.step(1)
    real = h5py.File

    def failing(name, mode="r", *args, **kwargs):
        f = real(name, mode, *args, **kwargs)
        if mode == "w" and "solverstate" in str(name):
            f.close()
            raise OSError(28, "No space left on device")
        return f
    monkeypatch.setattr(h5py, "File", failing)
    with pytest.raises(CaffepyError, match=r"out/run_iter_1.solverstate.h5: cannot write: No space left on device"):
        solver.snapshot()
    assert sorted(os.listdir("out")) == ["run_iter_1.caffemodel.h5"]


def test_without_h5py_each_hdf5_use_names_the_extra(files, monkeypatch):
    get_solver(files("SGD")).solve()
    real_import = builtins.__import__

    def no_h5py(name, *args, **kwargs):
        if name == "h5py":
            raise ImportError("No module named 'h5py'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_h5py)
    extra = r"needs h5py, which is not installed. Install it with: pip install h5py \(or pip install 'caffepy\[hdf5\]'\)"
    with pytest.raises(CaffepyError, match=r"solver.prototxt: snapshot_format: HDF5: " + extra):
        get_solver("solver.prototxt")
    with pytest.raises(CaffepyError, match=r"run_iter_5.caffemodel.h5: HDF5 weights: " + extra):
        Net("net.prototxt", "out/run_iter_5.caffemodel.h5", 1)
    files("SGD", "BINARYPROTO")
    with pytest.raises(CaffepyError, match=r"run_iter_5.solverstate.h5: HDF5 solver state: " + extra):
        get_solver("solver.prototxt").restore("out/run_iter_5.solverstate.h5")
    result = CliRunner().invoke(main, ["train", "-solver", "solver.prototxt", "-weights",
                                       "out/run_iter_5.caffemodel.h5"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "pip install 'caffepy[hdf5]'" in result.output
