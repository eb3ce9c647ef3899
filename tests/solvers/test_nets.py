"""solvers/nets: the nets a solver trains and tests and their NetStates (InitTrainNet / InitTestNets)."""
import pytest

from caffepy.errors import PrototxtError
from caffepy.proto import caffe_pb2
from caffepy.solvers.nets import solver_test_net_params, solver_train_net_param
from caffepy.upgrade import parse_solver_text, read_solver


NET = """
name: "n"
state { stage: "from_net" }
layer { name: "data" type: "Input" top: "data" }
"""


def test_solver_net_file_resolved_from_cwd(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.prototxt").write_text(NET)
    solver_path = str(tmp_path / "models" / "solver.prototxt")
    with open(solver_path, "w") as f:
        f.write('net: "models/net.prototxt" test_iter: 5 test_iter: 7 test_interval: 10\n'
                'train_state { level: 2 } test_state { stage: "x" } test_state { level: 4 }')
    monkeypatch.chdir(tmp_path)
    solver = read_solver(solver_path)
    train = solver_train_net_param(solver, solver_path, level=1, stages=["cli"])
    param, state = train
    assert train.origin == "net file: models/net.prototxt"
    assert state.phase == caffe_pb2.TRAIN and state.level == 1
    assert list(state.stage) == ["from_net", "cli"]
    assert param.state == state
    tests = solver_test_net_params(solver, solver_path)
    assert [t.state.phase for t in tests] == [caffe_pb2.TEST] * 2
    assert list(tests[0].state.stage) == ["from_net", "x"] and tests[1].state.level == 4

    monkeypatch.chdir(tmp_path / "models")
    with pytest.raises(PrototxtError, match=r"net: cannot open 'models/net\.prototxt' \(paths are relative to "
                                            r"the current directory"):
        solver_train_net_param(solver, solver_path)


def test_solver_without_net():
    with pytest.raises(PrototxtError, match=r"^solver\.prototxt: solver specifies no net \(set 'net' or 'train_net'\)$"):
        solver_train_net_param(caffe_pb2.SolverParameter(base_lr=0.1), "solver.prototxt")


def test_solver_with_two_train_nets():
    solver = parse_solver_text('net: "a" train_net: "b"', "s")
    with pytest.raises(PrototxtError, match=r"more than one train net \(net, train_net\)"):
        solver_train_net_param(solver, "s")


def test_inline_nets_and_test_counts():
    solver = parse_solver_text(f'train_net_param {{ {NET} }} test_net_param {{ {NET} }} '
                                 f'test_iter: 3 test_interval: 100', "s")
    train = solver_train_net_param(solver, "s")
    assert train.origin == "train_net_param" and train.param.layer[0].name == "data"
    tests = solver_test_net_params(solver, "s")
    assert len(tests) == 1 and tests[0].origin == "test_net_param"

    bad = parse_solver_text(f'train_net_param {{ {NET} }} test_net_param {{ {NET} }} test_interval: 1', "s")
    with pytest.raises(PrototxtError, match=r"test_iter: one is needed per test net \(1 test nets\), got 0"):
        solver_test_net_params(bad, "s")

    no_interval = parse_solver_text(f'net_param {{ {NET} }} test_iter: 1', "s")
    with pytest.raises(PrototxtError, match="test_interval: must be > 0"):
        solver_test_net_params(no_interval, "s")

    states = parse_solver_text(f'net_param {{ {NET} }} test_iter: 1 test_iter: 1 test_interval: 1 '
                                 f'test_state {{ }}', "s")
    with pytest.raises(PrototxtError, match=r"test_state: must be unspecified or given once per test net \(2\), got 1"):
        solver_test_net_params(states, "s")


def test_generic_net_gives_one_test_net_per_remaining_test_iter():
    solver = parse_solver_text(f'net_param {{ {NET} }} test_iter: 1 test_iter: 2 test_interval: 5', "s")
    tests = solver_test_net_params(solver, "s")
    assert [t.origin for t in tests] == ["net_param", "net_param"]
    tests[0].param.name = "changed"
    assert tests[1].param.name == "n", "each test net is its own copy"
    assert solver_test_net_params(parse_solver_text('net: "x"', "s"), "s") == []
