"""Caffe's and Intel Caffe's flags on every action: gflags are global, so each action takes them
all (type-checked) and ignores with a warning those that mean nothing for it; -engine,
`time -forward_only`, `test -sampling`."""
import re

import pytest
from click.testing import CliRunner

from caffepy import log
from caffepy.cli import CAFFE_FLAGS, main

NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

DEPLOY = """
name: "deploy"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "prob" type: "Softmax" bottom: "conv" top: "prob" }
"""

SOLVER = 'net: "net.prototxt"\nbase_lr: 0.01 lr_policy: "fixed" max_iter: 1 display: 1\n' \
         'snapshot_prefix: "snap" random_seed: 1\n'


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "deploy.prototxt").write_text(DEPLOY)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    log.set_quiet(False)
    yield tmp_path
    log.set_quiet(True)


def caffepy(*args):
    return CliRunner().invoke(main, list(args))


def warning(err, action, flag):
    return re.search(rf"^W\d{{4}} .*\] caffepy {action}: -{flag}\S* .*means nothing for {action}; ignored",
                     err, re.M)


@pytest.mark.parametrize("args, flag", [
    (["train", "-solver", "solver.prototxt", "-iterations", "5"], "iterations"),
    (["train", "-solver", "solver.prototxt", "-model", "x.prototxt", "-epsilon", "0.5"], "epsilon"),
    (["time", "-model", "net.prototxt", "-iterations", "1", "-snapshot", "x.solverstate"], "snapshot"),
    (["time", "-model", "net.prototxt", "-iterations", "1", "-n_group", "2"], "n_group"),
])
def test_a_flag_that_means_nothing_runs_with_a_warning(tiny, args, flag):
    result = caffepy(*args)
    assert result.exit_code == 0, result.output
    assert warning(result.stderr, args[0], flag), result.stderr


def test_test_ignores_phase_as_caffe_does_and_scores_the_test_phase(tiny):
    assert caffepy("train", "-solver", "solver.prototxt").exit_code == 0
    result = caffepy("test", "-model", "net.prototxt", "-weights", "snap_iter_1.caffemodel",
                     "-iterations", "1", "-phase", "TRAIN", "-sigint_effect", "none", "-detection=false")
    assert result.exit_code == 0, result.output
    for flag in ("phase", "sigint_effect"):
        assert warning(result.stderr, "test", flag), flag
    assert not warning(result.stderr, "test", "detection")      # test's own flag (SSD's mAP)
    assert "Batch 0, loss = " in result.stderr


def test_every_caffe_flag_is_accepted_by_every_action():
    for action in ("train", "test", "time", "collect", "compare", "device_query"):
        command = main.get_command(None, action)
        names = {p.name for p in command.params}
        assert set(CAFFE_FLAGS) <= names, (action, set(CAFFE_FLAGS) - names)


@pytest.mark.parametrize("args, message", [
    (["train", "-solver", "s", "-iterations", "abc"], "'abc' is not a valid integer"),
    (["test", "-model", "m", "-epsilon", "small"], "'small' is not a valid float"),
    (["time", "-model", "m", "-detection=maybe"], "expected true or false"),
    (["device_query", "-level", "x"], "'x' is not a valid integer"),
])
def test_an_ignored_flag_is_still_type_checked(args, message):
    result = caffepy(*args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_help_shows_the_flags_that_mean_something_only():
    text = caffepy("time", "--help").output
    assert "--engine" in text and "--forward_only" in text and "--phase" in text
    assert "--snapshot" not in text and "--epsilon" not in text and "--n_group" not in text


@pytest.mark.parametrize("action", ["train", "test", "time", "collect", "compare"])
def test_an_unknown_engine_flag_is_a_usage_error_naming_it(action):
    flag = "--solver" if action == "train" else "--model"
    result = caffepy(action, flag, "x", "-engine", "BOGUS_ENGINE")
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line]
    assert len(lines) == 1 and "unknown engine, got 'BOGUS_ENGINE'" in lines[0]
    assert "CAFFE" in lines[0] and "MKLDNN" in lines[0] and "MKL2017" in lines[0]


def _algorithms(result):
    return dict(re.findall(r"\] +(\w+)\t(\S+) \(", result.stderr))


def test_engine_flag_selects_caffes_algorithms_or_the_fast_path(tiny):
    fast = caffepy("time", "-model", "net.prototxt", "-iterations", "1", "-engine", "MKLDNN:CPU")
    assert fast.exit_code == 0, fast.output
    assert "Layout plan: 1 channels-last region" in fast.stderr
    plain = caffepy("time", "-model", "net.prototxt", "-iterations", "1", "-engine", "CAFFE")
    assert plain.exit_code == 0, plain.output
    assert "Layout plan" not in plain.stderr and _algorithms(plain).get("conv") in (None, "im2col+gemm")
    # the flag is the net's engine: a layer's own still wins (Intel's Net::Init)
    (tiny / "own.prototxt").write_text(NET.replace('type: "Convolution"', 'type: "Convolution" engine: "MKLDNN"'))
    own = caffepy("time", "-model", "own.prototxt", "-iterations", "1", "-engine", "CAFFE")
    assert own.exit_code == 0 and "Layout plan: 1 channels-last region" in own.stderr


def test_train_engine_flag_overwrites_the_solvers(tiny):
    (tiny / "solver.prototxt").write_text(SOLVER + 'engine: "CAFFE"\n')
    assert "Layout plan" not in caffepy("train", "-solver", "solver.prototxt").stderr
    result = caffepy("train", "-solver", "solver.prototxt", "-engine", "MKL2017")
    assert result.exit_code == 0, result.output
    assert "Layout plan: 1 channels-last region" in result.stderr


def test_time_forward_only_on_a_deploy_net_in_the_test_phase(tiny):
    result = caffepy("time", "-model", "deploy.prototxt", "-iterations", "2", "-phase", "TEST",
                     "-forward_only")
    assert result.exit_code == 0, result.output
    err = result.stderr
    for line in ("Performing Forward", "Iteration: 2 forward time: ", "      conv\tforward: ",
                 "Average Forward pass: ", "Total Time: "):
        assert line in err, line
    for absent in ("Performing Backward", "backward", "Average Forward-Backward"):
        assert absent not in err, absent


def test_test_sampling_loads_the_weights_and_stops(tiny):
    assert caffepy("train", "-solver", "solver.prototxt").exit_code == 0
    result = caffepy("test", "-model", "net.prototxt", "-weights", "snap_iter_1.caffemodel", "-sampling")
    assert result.exit_code == 0, result.output
    assert "Running for" not in result.stderr and "Batch 0" not in result.stderr
    missing = caffepy("test", "-model", "net.prototxt", "-weights", "nope.caffemodel", "-sampling")
    assert missing.exit_code == 1 and "nope.caffemodel" in missing.output
