"""Shared activation memory (Net(..., keep_blobs=False), caffepy/net_memory.py): a net whose
blobs between inputs and outputs share a few arenas computes the outputs of the same net with
every blob kept, bit for bit, on nets whose units write past their own tops (ResNet's block
ends, their sums written over the shortcuts, GoogLeNet's concats written in place,
MobileNet's depthwise layers, int8 tops held as bytes), across a change of batch size; it keeps
fewer bytes; and it refuses what would read a blob it did not keep."""
import os
import re

import numpy as np
import pytest

import caffepy
from caffepy import net_rules, rng, upgrade
from caffepy.errors import CaffepyError
from caffepy.net import TEST, TRAIN, Net

from paths import REFERENCE_MODELS, REPO

ZOO = os.path.join(REPO, "models", "zoo")


def _param(path, batch):
    param = upgrade.read_net(path)
    param.layer[0].input_param.shape[0].dim[0] = batch
    return param


def _twins(param, **kwargs):
    """(every blob kept, blobs sharing memory): the same net, weights and plausible BatchNorm
    statistics (var > 0: the fresh zeros would scale by 1 / sqrt(eps))."""
    nets = []
    for keep in (True, False):
        rng.seed(3)
        net = Net(param, phase=TEST, keep_blobs=keep, **kwargs)
        r = np.random.default_rng(4)
        for layer in net.layers:
            if layer.type == "BatchNorm":
                c = layer.blobs[0].count
                layer.blobs[0].data[...] = r.normal(0, 0.5, c)
                layer.blobs[1].data[...] = r.uniform(0.5, 2, c)
                layer.blobs[2].data[...] = 1
        nets.append(net)
    return nets


def _same_outputs(kept, shared, seed):
    x = np.random.default_rng(seed).standard_normal(kept.blobs["data"].shape).astype(np.float32)
    want = {k: v.copy() for k, v in kept.forward(data=x).items()}
    got = shared.forward(data=x)
    assert set(got) == set(want)
    for name in want:
        assert np.isfinite(want[name]).all()
        np.testing.assert_array_equal(got[name], want[name], name)


def _kept_bytes(net):
    return sum(b.count for b in {id(b._data_buf): b for b in net._blobs.values()}.values()) * 4


NETS = [
    pytest.param(os.path.join(ZOO, "resnet50_deploy.prototxt"), id="resnet50"),
    pytest.param(os.path.join(ZOO, "googlenet_deploy.prototxt"), id="googlenet"),
    pytest.param(os.path.join(ZOO, "mobilenet_v1_deploy.prototxt"), id="mobilenet_v1"),
    pytest.param(os.path.join(REFERENCE_MODELS, "bvlc", "bvlc_alexnet__deploy.prototxt"),
                 id="alexnet"),
]


@pytest.mark.parametrize("path", NETS)
def test_shared_memory_gives_the_kept_nets_outputs_bit_for_bit(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this machine")
    kept, shared = _twins(_param(path, 1))
    for seed in (1, 2):             # the second forward finds the arenas as the first left them
        _same_outputs(kept, shared, seed)
    arenas = sum(a.size for a in shared._activations.arenas) * 4
    assert 0 < arenas < _kept_bytes(kept) / 2, (arenas, _kept_bytes(kept))
    # the input and the output keep their own memory
    for name in ("data", "prob"):
        assert shared._activations.kept(shared.blobs[name])
        assert not any(np.shares_memory(shared.blobs[name].raw_data, a)
                       for a in shared._activations.arenas)


@pytest.mark.parametrize("name", ["mobilenet_v1", "resnet50"])
def test_a_larger_batch_plans_the_arenas_again_a_smaller_one_fits(capsys, name):
    """The input reshaped and forward called, as pycaffe code does (no net.reshape()): every
    layer of a unit takes the new batch before the unit writes their tops (ResNet's block ends
    write the Eltwise's top)."""
    from caffepy import log
    log.set_quiet(False)
    kept, shared = _twins(_param(os.path.join(ZOO, f"{name}_deploy.prototxt"), 1))
    _same_outputs(kept, shared, 1)
    small = sum(a.size for a in shared._activations.arenas)
    for net in (kept, shared):
        net.blobs["data"].reshape(3, 3, 224, 224)
    _same_outputs(kept, shared, 2)      # the blobs grew past their arenas: own buffers
    _same_outputs(kept, shared, 3)      # planned again, at batch 3
    assert sum(a.size for a in shared._activations.arenas) == pytest.approx(3 * small, rel=0.01)
    for net in (kept, shared):
        net.blobs["data"].reshape(1, 3, 224, 224)
    _same_outputs(kept, shared, 4)      # smaller: in the same places, not planned again
    _same_outputs(kept, shared, 5)
    assert sum(a.size for a in shared._activations.arenas) == pytest.approx(3 * small, rel=0.01)
    assert capsys.readouterr().err.count("Sharing activation memory") == 2


def _block():
    from test_quantization import block_net
    from google.protobuf import text_format
    from caffepy.proto import caffe_pb2
    return text_format.Parse(block_net(8), caffe_pb2.NetParameter())


def test_int8_tops_held_as_bytes_share_memory_too():
    kept, shared = _twins(_block())
    for seed in (1, 2, 3):
        _same_outputs(kept, shared, seed)
    assert len(shared._activations.shared) >= 3


def test_what_would_read_a_blob_not_kept_is_refused_in_one_line():
    kept, shared = _twins(_block())
    with pytest.raises(CaffepyError, match=r"forward: blob 'sum' is not kept"):
        shared.forward(blobs=["sum"])           # before any plan too
    unwritten = shared.unwritten_blobs()
    assert "conv1" in unwritten and "sum" in unwritten
    assert "data" not in unwritten and "fc" not in unwritten
    shared.forward()
    with pytest.raises(CaffepyError, match=r"forward: blob 'conv1' is not kept: .*keep_blobs=True"):
        shared.forward(blobs=["conv1"])
    with pytest.raises(CaffepyError, match=r"backward: this net shares its activations' memory"):
        shared.backward()
    assert kept.forward(blobs=["conv1"])["conv1"].shape == kept.blobs["conv1"].shape
    with pytest.raises(CaffepyError, match="keep_blobs=False is for a TEST net"):
        Net(_block(), phase=TRAIN, keep_blobs=False)


def test_caffepy_keep_blobs_keeps_every_blob(monkeypatch):
    monkeypatch.setenv("CAFFEPY_KEEP_BLOBS", "1")
    net = Net(_block(), phase=TEST, keep_blobs=False)
    assert net._activations is None
    net.forward()
    assert net.forward(blobs=["conv1"])["conv1"] is not None


def test_classifier_and_detector_take_the_switch():
    path = os.path.join(REFERENCE_MODELS, "bvlc", "bvlc_reference_caffenet__deploy.prototxt")
    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this machine")
    assert caffepy.Classifier(path)._activations is None
    assert caffepy.Classifier(path, keep_blobs=False)._activations is not None
    assert caffepy.Detector(path, keep_blobs=False)._activations is not None


SCORED = """
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 9 dim: 9 } shape { dim: 4 }
    data_filler { type: "uniform" min: -1 max: 1 } data_filler { type: "constant" value: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
"""


def _logs_kept_then_shared(monkeypatch, args):
    """The log (stderr) of the caffepy command `args` run twice, every blob kept
    (CAFFEPY_KEEP_BLOBS=1), then as the command builds its nets; the random state seeded alike
    before each."""
    from click.testing import CliRunner
    from caffepy import log
    from caffepy.cli import main
    log.set_quiet(False)
    logs = []
    try:
        for keep in ("1", "0"):
            monkeypatch.setenv("CAFFEPY_KEEP_BLOBS", keep)
            rng.seed(6)
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, result.output
            logs.append(result.stderr)
    finally:
        log.set_quiet(True)
    return logs


def test_caffepy_test_scores_on_shared_memory_as_on_kept_blobs(tmp_path, monkeypatch):
    """`caffepy test` builds its net with keep_blobs=False: the same scores (the random
    DummyData seeded alike), and the log says so (the channels-last copy of data, conv, pool,
    its NCHW copy and ip share memory)."""
    (tmp_path / "net.prototxt").write_text(SCORED)
    rng.seed(5)
    Net(str(tmp_path / "net.prototxt"), phase=TEST).save(str(tmp_path / "w.caffemodel"))
    monkeypatch.chdir(tmp_path)
    logs = _logs_kept_then_shared(monkeypatch, ["test", "-model", "net.prototxt", "-weights",
                                                "w.caffemodel", "-iterations", "3"])
    scores = [re.findall(r"Batch \d+, (?:loss|accuracy) = \S+", text) for text in logs]
    assert len(scores[0]) == 6 and scores[0] == scores[1]
    assert "Sharing activation memory" not in logs[0]
    assert "Sharing activation memory: 5 blob buffers in 3 arenas" in logs[1]


def test_caffepy_train_tests_on_shared_memory_pycaffes_solver_keeps_blobs(tmp_path, monkeypatch):
    """`caffepy train`'s test nets share memory (it reads their outputs alone): the same test
    scores as with every blob kept; pycaffe's solver keeps their blobs (its users read
    `solver.test_nets[0].blobs[...]`)."""
    (tmp_path / "net.prototxt").write_text(SCORED)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 4 display: 1 '
        'test_iter: 2 test_interval: 2 random_seed: 9 snapshot_prefix: "s"')
    monkeypatch.chdir(tmp_path)
    logs = _logs_kept_then_shared(monkeypatch, ["train", "-solver", "solver.prototxt"])
    scores = [re.findall(r"Test net output #\d+: \S+ = \S+", text) for text in logs]
    assert len(scores[0]) == 6 and scores[0] == scores[1]
    assert "Sharing activation memory" not in logs[0]
    assert "Sharing activation memory" in logs[1]
    monkeypatch.delenv("CAFFEPY_KEEP_BLOBS")
    assert caffepy.get_solver("solver.prototxt").test_nets[0]._activations is None


def test_block_ends_write_their_sum_over_the_shortcut_while_their_convolution_may():
    path = os.path.join(ZOO, "resnet50_deploy.prototxt")
    kept, shared = _twins(_param(path, 1))
    _same_outputs(kept, shared, 1)
    memory = shared._activations
    over = sorted(memory.over)
    assert len(over) >= 3, over         # the 56 x 56 block ends at least (1 x 1, 64 -> 256)
    first = over[0]
    conv = shared.layers[first]
    unit = shared._units[first]
    e, shortcut = net_rules.parts(shared, unit, unit.last)[2:4]
    assert np.shares_memory(shared.top_vecs[e][0].raw_data, shortcut.raw_data)
    _same_outputs(kept, shared, 2)
    # an algorithm that cannot (another shape's choice, a forced one): the sum moves apart for
    # this forward, the next plan leaves it there
    conv.adds_in_place = lambda: False
    _same_outputs(kept, shared, 3)
    assert first not in memory.over
    _same_outputs(kept, shared, 4)
    assert first not in memory.over and len(memory.over) == len(over) - 1
    assert not np.shares_memory(shared.top_vecs[e][0].raw_data, shortcut.raw_data)


FLATTENED = """
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "fa" type: "Flatten" bottom: "a" top: "fa" }
layer { name: "b" type: "Convolution" bottom: "data" top: "b"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "rb" type: "Reshape" bottom: "b" top: "rb" reshape_param { shape { dim: 0 dim: -1 } } }
layer { name: "c" type: "Concat" bottom: "fa" bottom: "rb" top: "c" }
layer { name: "ip" type: "InnerProduct" bottom: "c" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
"""


def test_views_made_by_flatten_and_reshape_are_planned_with_what_they_view():
    """Flatten's and Reshape's tops view their bottoms from the reshape on, so the plan made
    before the first forward keeps a's memory for fa until the Concat has read it (b, written
    in between, would otherwise take it); a forward in two parts plans nothing between them."""
    from google.protobuf import text_format
    from caffepy.proto import caffe_pb2
    kept, shared = _twins(text_format.Parse(FLATTENED, caffe_pb2.NetParameter()))
    for seed in (1, 2):
        _same_outputs(kept, shared, seed)
    for net in (kept, shared):
        net.blobs["data"].reshape(3, 3, 8, 8)
        net.blobs["data"].data[...] = 0.5
    want = kept.forward()["ip"].copy()
    names = [layer.name for layer in shared.layers]
    shared.forward_from_to(0, names.index("rb"))    # the blobs grew: no plan in between
    shared.forward_from_to(names.index("c"))
    np.testing.assert_array_equal(shared.blobs["ip"].data, want)


def test_a_forward_in_parts_through_a_block_end_written_over_its_shortcut():
    """Ending a part inside a block end whose sum the plan put over the shortcut: the layers
    run apart (the Eltwise SUM writing over its own bottom), the same floats."""
    kept, shared = _twins(_param(os.path.join(ZOO, "resnet50_deploy.prototxt"), 1))
    _same_outputs(kept, shared, 1)
    x = kept.blobs["data"].data.copy()
    want = kept.forward()["prob"].copy()
    first = sorted(shared._activations.over)[0]
    shared.blobs["data"].data[...] = x
    shared.forward_from_to(0, first + 1)            # the convolution and its BatchNorm
    shared.forward_from_to(first + 2)
    np.testing.assert_array_equal(shared.blobs["prob"].data, want)
