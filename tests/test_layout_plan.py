"""The fast path of whole nets (caffepy/layout_plan.py): an unmodified prototxt runs its
convolutions, pooling, BatchNorm, Scale, Concat, LRN channels-last, computes what the plain NCHW
path computes (forward, backward, parameter gradients), keeps pycaffe's view of the net, and
`engine: CAFFE` (layer, net, solver) or CAFFEPY_ENGINE=CAFFE keeps Caffe's NCHW algorithms."""
import os

import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import actions, log, upgrade
from caffepy.blob import CHANNELS_LAST
from caffepy.layer import NHWC
from caffepy.net import TEST, TRAIN, Net
from caffepy.proto import caffe_pb2

ZOO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "zoo")

SMALL = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.2 } } }
"""


def _net(text=SMALL, phase=TRAIN, engine=None, layer_engine=None):
    param = caffe_pb2.NetParameter()
    text_format.Parse(text, param)
    if engine is not None:
        param.engine = engine
    if layer_engine is not None:
        param.layer[1].engine = layer_engine
    return Net(param, phase=phase)


def _layouts(net):
    return {name: blob.layout for name, blob in net.blobs.items()}


def test_a_plain_prototxt_gets_the_fast_path_with_caffes_view():
    net = _net()
    assert [layer.type for layer in net.layers] == ["Input", "Convolution", "BatchNorm", "ReLU",
                                                    "Pooling", "InnerProduct"]
    assert [layer.variant for layer in net.layers[1:5]] == [NHWC] * 4 or \
        [type(layer).__name__ for layer in net.layers[1:3]] == ["NHWCConvolution", "NHWCBatchNorm"]
    assert list(net.blobs) == ["data", "conv1", "pool1", "ip"]
    assert net.blobs["conv1"].layout == CHANNELS_LAST and net.blobs["pool1"].layout == CHANNELS_LAST
    assert net.blobs["data"].layout is None and net.blobs["ip"].layout is None
    assert net.outputs == ["ip"] and net.bottom_names["conv1"] == ["data"]
    assert net.blobs["conv1"].shape == (2, 8, 9, 9)


@pytest.mark.parametrize("how", ["net", "layer", "env", "param"])
def test_engine_caffe_keeps_caffes_layout(how, monkeypatch):
    if how == "env":
        monkeypatch.setenv("CAFFEPY_ENGINE", "CAFFE")
        net = _net()
    elif how == "net":
        net = _net(engine="CAFFE")
    elif how == "layer":
        net = _net(layer_engine="CAFFE")       # conv1: the only layer that starts a region
    else:
        net = _net(SMALL.replace("num_output: 8", "num_output: 8 engine: CAFFE"))
    assert all(layout is None for layout in _layouts(net).values())
    assert type(net.layers[1]).__name__ == "Convolution"


def _copy_params(src, dst):
    for name, blobs in src.params.items():
        for a, b in zip(blobs, dst.params[name]):
            b.data[...] = a.data


def _compare(param, phase, feed, top_diff=True, backward=True, data_tol=1e-3, grad_tol=1e-3):
    """Build `param` twice (fast and engine CAFFE), same weights and inputs; compare every
    blob's data elementwise (to `data_tol` of its largest value) and, with `backward`, every
    blob's diff and parameter gradient in norm (|fast - plain| / |plain| <= `grad_tol`): a deep
    net's gradients pass through batch-statistics BatchNorms, whose backward subtracts nearly
    equal sums, so single elements carry the rounding of either path's summation order."""
    fast = Net(param, phase=phase)
    plain_param = caffe_pb2.NetParameter()
    plain_param.CopyFrom(param)
    plain_param.engine = "CAFFE"
    plain = Net(plain_param, phase=phase)
    assert any(b.layout == CHANNELS_LAST for b in fast.blobs.values())
    assert all(b.layout is None for b in plain.blobs.values())
    assert list(fast.blobs) == list(plain.blobs) and fast.outputs == plain.outputs
    _copy_params(plain, fast)
    gen = np.random.default_rng(3)
    for name, make in feed.items():
        values = make(gen, plain.blobs[name].shape)
        plain.blobs[name].data[...] = values
        fast.blobs[name].data[...] = values
    diff = None
    if top_diff:
        diff = gen.standard_normal(plain.blobs[plain.outputs[0]].shape).astype(np.float32)
    for net in (plain, fast):
        net.clear_param_diffs()
        net.forward_from_to()
        if diff is not None:
            net.blobs[net.outputs[0]].diff[...] = diff
        net.backward_from_to()

    def elementwise(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(b).all(), what
        scale = max(np.abs(b).max(), 1e-12)
        np.testing.assert_allclose(a / scale, b / scale, rtol=0, atol=data_tol, err_msg=what)

    def in_norm(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(b).all(), what
        if not b.any():                     # no gradient (labels, BatchNorm's statistics)
            assert not a.any(), what
            return
        error = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert error <= grad_tol, f"{what}: relative error {error:.2e}"
    for name in plain.blobs:
        elementwise(fast.blobs[name].data, plain.blobs[name].data, f"{name} data")
        if backward and name not in feed:
            in_norm(fast.blobs[name].diff, plain.blobs[name].diff, f"{name} diff")
    for name, blobs in plain.params.items():
        for i, b in enumerate(blobs):
            elementwise(fast.params[name][i].data, b.data, f"{name} param {i} data")  # BN statistics
            if backward and plain.layer_dict[name].param_propagate_down[i]:
                in_norm(fast.params[name][i].diff, b.diff, f"{name} param {i} diff")
    return fast


def _smooth(param):
    """`param` with TanH for ReLU and AVE for MAX pooling: a differentiable net. The fast and
    plain paths sum in other orders, so their blobs differ by float rounding; where that
    rounding moves a ReLU input across 0 or changes which of two nearly equal values is a MAX
    window's largest, a whole diff goes another way (a few percent of the gradients' norm in
    ResNet-50). Backward is compared on the smooth net; the real one, forward."""
    for layer in param.layer:
        if layer.type == "ReLU":
            layer.type = "TanH"
            layer.ClearField("relu_param")
        if layer.type == "Pooling":
            layer.pooling_param.pool = caffe_pb2.PoolingParameter.AVE
    return param


def _zoo(name, batch):
    param = upgrade.read_net(os.path.join(ZOO, name))
    param.force_backward = True
    param.layer[0].input_param.shape[0].dim[0] = batch
    for layer in param.layer:
        if layer.type == "BatchNorm":
            # batch statistics: the deploy files' global ones are unset (0), which divides by
            # sqrt(eps) layer after layer into infinities
            layer.batch_norm_param.use_global_stats = False
    return param


def _image(gen, shape):
    return gen.standard_normal(shape).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("smooth", [False, True], ids=["forward", "smooth-backward"])
def test_resnet50_fast_path_equals_the_plain_path(smooth):
    """Every blob and gradient of ResNet-50 (TRAIN: batch statistics)."""
    param = _zoo("resnet50_deploy.prototxt", 1)
    fast = _compare(_smooth(param) if smooth else param, TRAIN, {"data": _image}, backward=smooth)
    conversions = [c for convs in fast._conversions for c in convs]
    assert [c[0].type for c in conversions] == ["NHWCPack", "NHWCUnpack"]


def _googlenet():
    param = upgrade.read_net(os.path.join(ZOO, "googlenet_train.prototxt"))
    for layer in param.layer:
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                shape.dim[0] = 1
        if layer.type == "Dropout":
            layer.dropout_param.dropout_ratio = 0.0    # no random draws: both paths alike
    return param


def _label(gen, shape):
    return gen.integers(0, 1000, shape).astype(np.float32)


@pytest.mark.parametrize("smooth", [False, True], ids=["forward", "smooth-backward"])
def test_googlenet_train_fast_path_equals_the_plain_path(smooth):
    """GoogLeNet with its auxiliary heads and losses (LRN, Concat, pooling, 1x1 to 5x5
    convolutions)."""
    param = _smooth(_googlenet()) if smooth else _googlenet()
    fast = _compare(param, TRAIN, {"data": _image, "label": _label}, top_diff=False, backward=smooth)
    conversions = [c for convs in fast._conversions for c in convs]
    assert [c[0].type for c in conversions].count("NHWCPack") == 1


@pytest.mark.parametrize("smooth", [False, True], ids=["forward", "smooth-backward"])
def test_mobilenet_fast_path_equals_the_plain_path(smooth):
    """MobileNet v1: depthwise and pointwise convolutions, TEST phase (batch statistics)."""
    param = _zoo("mobilenet_v1_deploy.prototxt", 1)
    _compare(_smooth(param) if smooth else param, TEST, {"data": _image}, backward=smooth)


def test_algorithms_are_logged(capsys):
    log.set_quiet(False)
    _net()
    err = capsys.readouterr().err
    assert "Layout plan: 1 channels-last region(s), 2 conversion layer(s)" in err
    assert "Algorithm: direct (rule)" in err             # 3 input channels: the direct kernel


def test_time_shows_each_convolutions_algorithm(tmp_path, capsys):
    path = tmp_path / "small.prototxt"
    path.write_text(SMALL)
    log.set_quiet(False)
    result = actions.time(str(path), iterations=1)
    err = capsys.readouterr().err
    assert "conv1\tforward:" in err and "conv1\tbackward:" in err
    assert "Algorithm per layer:" in err
    assert "conv1\tdirect (rule)" in err             # 3 input channels: no Winograd
    assert result["algorithms"] == [("conv1", "direct"), ("ip", "gemm")]


def test_time_shows_which_product_an_inner_product_runs(tmp_path, capsys):
    """From 8 items on, a batch far smaller than the layer's inputs and outputs runs as
    skinny_gemm's columns."""
    path = tmp_path / "fc.prototxt"
    path.write_text(SMALL.replace("dim: 2 dim: 3", "dim: 8 dim: 3").replace("num_output: 4", "num_output: 40"))
    log.set_quiet(False)
    result = actions.time(str(path), iterations=1)
    assert "ip\tskinny (rule)" in capsys.readouterr().err
    assert ("ip", "skinny") in result["algorithms"]
