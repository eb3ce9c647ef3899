"""Intel Caffe's multi-phase solver files (caffepy/solvers/multiphase.py) through `caffepy train`:
phase 1 then phase 2, each with its batch size and learning rate, the weights carried over, the
same result as the phases run one by one; malformed files in one line."""
import os
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from caffepy import actions, log, upgrade
from caffepy.blobproto import blobproto_to_array
from caffepy.cli import main

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_helpers import make_db  # noqa: E402

NET = """
name: "tiny"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  data_param {{ source: "{db}" batch_size: 8 backend: LMDB }} transform_param {{ scale: 0.01 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""

PHASE = 'base_lr: {lr} lr_policy: "fixed" momentum: 0.9 max_iter: {iters} display: 1 random_seed: 3\n'

MULTI = """
params_pair {{ solver_params {{ net: "net.prototxt" snapshot_prefix: "snap" {first} }} batch_size: 4 }}
params_pair {{ solver_params {{ {second} }} batch_size: 2 }}
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, (1, 3, 3), dtype=np.uint8) for _ in range(10)]
    make_db(str(tmp_path / "db"), 10, shape=(1, 3, 3), values=values)
    (tmp_path / "net.prototxt").write_text(NET.format(db=tmp_path / "db"))
    (tmp_path / "multi.prototxt").write_text(MULTI.format(first=PHASE.format(lr=0.1, iters=2),
                                                          second=PHASE.format(lr=0.01, iters=3)))
    log.set_quiet(False)
    yield tmp_path
    log.set_quiet(True)


def caffepy(*args):
    return CliRunner().invoke(main, list(args))


def weights(path):
    net = upgrade.read_binary_net(path)
    return [blobproto_to_array(b) for layer in net.layer for b in layer.blobs]


def test_two_phases_train_one_after_the_other(tiny):
    result = caffepy("train", "-solver", "multi.prototxt")
    assert result.exit_code == 0, result.output
    err = result.stderr
    phase0, phase1 = err.index("Phase 0: snapshot_prefix snap_phase_0"), err.index("Phase 1: snapshot_prefix snap_phase_1")
    assert "Running multiphase solver: 2 phases." in err
    assert phase0 < err.index("Iteration 0, lr = 0.1") < phase1 < err.index("Iteration 0, lr = 0.01")
    assert "params_pair[0].batch_size: batch_size 4 for Data layer 'data'" in err
    assert "params_pair[1].batch_size: batch_size 2 for Data layer 'data'" in err
    assert err.index("Top shape: 4 1 3 3 (36)", phase0) < phase1 and err.index("Top shape: 2 1 3 3 (18)") > phase1
    assert sorted(p for p in os.listdir(tiny) if p.endswith(".caffemodel")) == [
        "snap_phase_0_iter_2.caffemodel", "snap_phase_1_iter_3.caffemodel"]
    assert err.count("Optimization Done.") == 3     # each phase's solver, then train, as Intel's


def test_phase_two_starts_from_phase_ones_weights(tiny):
    solver = actions.train("multi.prototxt")
    assert solver.net.blobs["data"].shape[0] == 2 and solver.iter == 3
    # the same phases as two plain solver files, the second fine-tuned from the first's weights
    net = (tiny / "net.prototxt").read_text()
    (tiny / "one.prototxt").write_text(net.replace("batch_size: 8", "batch_size: 4"))
    (tiny / "two.prototxt").write_text(net.replace("batch_size: 8", "batch_size: 2"))
    (tiny / "s1.prototxt").write_text('net: "one.prototxt" snapshot_prefix: "a"\n' + PHASE.format(lr=0.1, iters=2))
    (tiny / "s2.prototxt").write_text('net: "two.prototxt" snapshot_prefix: "b"\n' + PHASE.format(lr=0.01, iters=3))
    actions.train("s1.prototxt")
    for a, b in zip(weights("a_iter_2.caffemodel"), weights("snap_phase_0_iter_2.caffemodel")):
        assert np.array_equal(a, b)
    actions.train("s2.prototxt", weights="a_iter_2.caffemodel")
    final = weights("snap_phase_1_iter_3.caffemodel")
    for a, b in zip(weights("b_iter_3.caffemodel"), final):
        assert np.array_equal(a, b)
    assert not np.array_equal(final[0], weights("snap_phase_0_iter_2.caffemodel")[0])


def test_a_phase_without_solver_params_reuses_the_previous_ones(tiny):
    (tiny / "multi.prototxt").write_text(
        MULTI.format(first=PHASE.format(lr=0.1, iters=2), second="").replace(
            "params_pair { solver_params {  } batch_size: 2 }", "params_pair { batch_size: 2 }"))
    result = caffepy("train", "-solver", "multi.prototxt")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("Iteration 0, lr = 0.1") == 2
    assert os.path.exists("snap_phase_1_iter_2.caffemodel")


@pytest.mark.parametrize("text, message", [
    ('params_pair { batch_size: 4 }', "multi.prototxt: params_pair[0]: solver_params: the first phase "
                                      "needs its solver parameters, got none"),
    ('params_pair { solver_params { base_lr: 0.1 } }', "multi.prototxt: params_pair[0].solver_params.net: "
                                                       "a multi-phase solver trains the net file"),
    ('params_pair { solver_params { net: "net.prototxt" base_lr: 0.1 } batch_size: 0 }',
     "multi.prototxt: params_pair[0].batch_size: must be at least 1, got 0"),
    ('params_pair { solver_params { net: "dummy.prototxt" base_lr: 0.1 } batch_size: 4 }',
     "multi.prototxt: params_pair[0].batch_size: Intel Caffe gives it to the first Data layer, and "
     "dummy.prototxt has none"),
    ('params_pair { solver_parms { net: "net.prototxt" } }', "solver_parms"),
])
def test_malformed_multiphase_files_are_one_line_errors(tiny, text, message):
    (tiny / "dummy.prototxt").write_text('layer { name: "d" type: "DummyData" top: "d" '
                                         'dummy_data_param { shape { dim: 1 } } }')
    (tiny / "multi.prototxt").write_text(text)
    result = caffepy("train", "-solver", "multi.prototxt")
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("caffepy: error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_multiphase_run_cannot_resume(tiny):
    result = caffepy("train", "-solver", "multi.prototxt", "-snapshot", "x.solverstate")
    assert result.exit_code == 2
    assert "multi.prototxt is a multi-phase solver (params_pair), whose runs cannot be resumed" in result.output
