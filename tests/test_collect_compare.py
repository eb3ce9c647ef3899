"""`caffepy collect` / `caffepy compare` (caffepy/compare.py): the files collect writes load back
with the right shapes and values; compare passes between the fast path and engine CAFFE, names
the first layer that differs when one is perturbed (its weights, or its kernel), and exits 1."""
import os

import numpy as np
import pytest
from click.testing import CliRunner

from caffepy import compare as tool
from caffepy import log, rng, upgrade
from caffepy.cli import main
from caffepy.layers import nhwc
from caffepy.net import TRAIN, Net

NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 dim: 10 dim: 10 } shape { dim: 2 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool1" type: "Pooling" bottom: "sum" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "drop" type: "Dropout" bottom: "pool1" top: "pool1" }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.fixture
def small(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    return tmp_path


def caffepy(*args):
    return CliRunner().invoke(main, list(args))


def test_collect_writes_records_that_load_back_as_the_net_holds_them(small):
    assert tool.collect("net.prototxt", "out", engine="CAFFE") > 0
    index = tool.read_index("out")
    lines = [line.split("\t") for line in open("out/index.txt") if not line.startswith("#")]
    assert len(lines) == len(index) == len(os.listdir("out")) - 1
    # the same seed, the same engine: a net built here holds what collect recorded
    rng.seed(tool.SEED)
    param = upgrade.read_net("net.prototxt")
    param.engine = "CAFFE"
    plain = Net(param, phase=TRAIN)
    names = plain._layer_names
    conv1 = names.index("conv1")
    weights = np.load(f"out/{conv1:04d}_param0.npy")
    assert weights.shape == (16, 3, 3, 3) and np.array_equal(weights, plain.params["conv1"][0].data)
    plain.forward()
    data = np.load("out/0000_top0.npy")
    assert data.shape == (2, 3, 10, 10) and np.array_equal(data, plain.blobs["data"].data)
    ip = names.index("ip")
    assert np.allclose(np.load(f"out/{ip:04d}_top0.npy"), plain.blobs["ip"].data, atol=1e-6)
    assert np.load(f"out/{names.index('loss'):04d}_top0.npy").shape == ()
    row = next(line for line in lines if line[0] == f"{conv1:04d}_param0.npy")
    assert row[1:] == [str(conv1), "conv1", "Convolution", "param[0]", "conv1", "16x3x3x3\n"]
    # the backward records: every gradient a Caffe step computes
    plain.backward()
    assert np.allclose(np.load(f"out/{ip:04d}_param_diff0.npy"), plain.params["ip"][0].diff, atol=1e-6)
    kinds = {kind for (_, kind, _) in index}
    assert kinds == {"param", "bottom", "top", "top_diff", "bottom_diff", "param_diff"}


@pytest.mark.parametrize("first, then", [("CAFFE", "MKLDNN"), ("MKLDNN", "CAFFE")])
def test_the_fast_path_matches_caffes_algorithms(small, first, then):
    log.set_quiet(False)
    try:
        assert caffepy("collect", "-model", "net.prototxt", "-engine", first).exit_code == 0
        result = caffepy("compare", "-model", "net.prototxt", "-engine", then, "-epsilon", "1e-4")
    finally:
        log.set_quiet(True)
    assert result.exit_code == 0, result.output
    assert "No layer differs beyond epsilon 0.0001" in result.stderr
    report = open("compare_out/report.txt").read()
    assert "conv1 (Convolution)" in report and "bottom_diff[0]" in report and "param_diff[0]" in report
    assert report.count("success") >= 30 and "beyond epsilon" not in report


def test_compare_names_a_layer_whose_weights_differ(small):
    rng.seed(tool.SEED)
    net = Net("net.prototxt", phase=TRAIN)
    net.save("a.caffemodel")
    net.params["conv2"][0].data[0, 0, 0, 0] += 0.5
    net.save("b.caffemodel")
    assert caffepy("collect", "-model", "net.prototxt", "-weights", "a.caffemodel").exit_code == 0
    result = caffepy("compare", "-model", "net.prototxt", "-weights", "b.caffemodel", "-compare_output_dir", "cmp")
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.startswith("caffepy: error:")]
    assert len(lines) == 1
    assert "layer 'conv2' (Convolution) is the first that differs beyond epsilon 0.001: param[0] 'conv2', " \
           "max difference 0.5 in 1 value(s)" in lines[0]
    # each layer runs on the collected inputs: the difference does not spread past conv2's unit
    report = open("cmp/report.txt").read()
    differing = {line.split(" (")[0] for line in report.splitlines() if "beyond epsilon" in line}
    assert differing == {"conv2"}, report
    conv2 = [name for name in os.listdir("cmp") if name.endswith("_param0.txt")]
    assert len(conv2) == 1
    values = open(os.path.join("cmp", conv2[0])).read().splitlines()
    assert values[0] == "index;collected;now;difference" and values[1].startswith("0;")
    assert float(values[1].split(";")[3]) == pytest.approx(0.5, abs=1e-6)


def test_compare_names_a_layer_whose_kernel_misbehaves(small, monkeypatch):
    assert caffepy("collect", "-model", "net.prototxt", "-engine", "CAFFE").exit_code == 0
    forward = nhwc.NHWCPooling.forward

    def off_by_a_bit(self, bottom, top):
        forward(self, bottom, top)
        top[0].data[0, 0, 0, 0] += 0.25
    monkeypatch.setattr(nhwc.NHWCPooling, "forward", off_by_a_bit)
    with pytest.raises(tool.CompareError) as e:
        tool.compare("net.prototxt", "collect_out", "compare_out")
    assert "layer 'pool1' (Pooling) is the first that differs" in str(e.value)
    assert "top[0] 'pool1', max difference 0.25 in 1 value(s)" in str(e.value)
    assert [entry[1] for entry in e.value.found] == ["top[0] 'pool1'"]     # only it, once


def test_compare_refuses_another_nets_records_in_one_line(small):
    assert tool.collect("net.prototxt", "out") > 0
    (small / "other.prototxt").write_text(NET.replace('name: "conv2"', 'name: "convX"'))
    result = caffepy("compare", "-model", "other.prototxt", "-collect_dir", "out")
    assert result.exit_code == 1
    assert "out holds another net: its layer 6 is 'conv2', other.prototxt has 'convX' there" in result.output
    result = caffepy("compare", "-model", "net.prototxt", "-collect_dir", "nowhere")
    assert result.exit_code == 2 and "no index.txt in 'nowhere'; run caffepy collect" in result.output


def test_differences_follow_intels_float_rule():
    a = np.array([1.0, 1.0, 1e6, np.nan, np.nan, 0.0], np.float32)
    b = np.array([1.0005, 1.01, np.nextafter(np.float32(1e6), np.float32(2e6)), np.nan, 1.0, 0.0],
                 np.float32)
    assert tool.differences(a, b, 1e-3).tolist() == [False, True, False, False, True, False]


def test_fast_compare_lists_at_most_fast_compare_max_values(small):
    rng.seed(tool.SEED)
    net = Net("net.prototxt", phase=TRAIN)
    net.save("a.caffemodel")
    net.params["ip"][0].data[...] += 1.0
    net.save("b.caffemodel")
    assert caffepy("collect", "-model", "net.prototxt", "-weights", "a.caffemodel").exit_code == 0
    result = caffepy("compare", "-model", "net.prototxt", "-weights", "b.caffemodel", "-fast_compare",
                     "-fast_compare_max", "3")
    assert result.exit_code == 1 and "layer 'ip' (InnerProduct) is the first" in result.output
    listed = [name for name in os.listdir("compare_out") if name.endswith("_param0.txt")]
    assert len(listed) == 1 and len(open(os.path.join("compare_out", listed[0])).read().splitlines()) == 4
