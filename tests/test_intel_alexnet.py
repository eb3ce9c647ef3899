"""The Intel path through whole nets: a small AlexNet-like net with and without IntelPack /
IntelUnpack gives the same outputs and gradients; layers that cannot take a blocked blob are
errors; models/intel_alexnet builds and runs through `caffepy time`."""
import os
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng
from caffepy.errors import LayerError
from caffepy.net import TEST, TRAIN, Net
from caffepy.proto import caffe_pb2

from paths import REPO
MODELS = os.path.join(REPO, "models", "intel_alexnet")

# AlexNet in miniature: conv1 (3 channels, stride), LRN, max pooling over the edge, a grouped conv
# with padding, Concat and Eltwise, AVE pooling, then Unpack into InnerProduct and a loss.
SMALL = """
name: "small_alexnet"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 35 dim: 35 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 } } }
{pack}
layer { name: "conv1" type: "Convolution" bottom: "{data}" top: "conv1"
  convolution_param { num_output: 12 kernel_size: 7 stride: 2
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
  lrn_param { local_size: 5 alpha: 0.01 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 20 kernel_size: 3 pad: 1 group: 2
    weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1
    weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "cat" type: "Concat" bottom: "conv3" bottom: "conv2" top: "cat" }
layer { name: "conv4" type: "Convolution" bottom: "cat" top: "conv4"
  convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "sum" type: "Eltwise" bottom: "conv4" bottom: "conv3" top: "sum" }
layer { name: "norm2" type: "LRN" bottom: "sum" top: "norm2"
  lrn_param { local_size: 3 alpha: 0.02 beta: 0.75 k: 2 } }
layer { name: "pool2" type: "Pooling" bottom: "norm2" top: "pool2"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
{unpack}
layer { name: "fc" type: "InnerProduct" bottom: "{pool}" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def small_net(blocked):
    text = SMALL
    if blocked:
        text = text.replace("{pack}", 'layer { name: "pack" type: "IntelPack" bottom: "data" top: "packed" }')
        text = text.replace("{data}", "packed")
        text = text.replace("{unpack}", 'layer { name: "unpack" type: "IntelUnpack" bottom: "pool2" top: "flat" }')
        text = text.replace("{pool}", "flat")
    else:
        text = text.replace("{pack}", "").replace("{data}", "data").replace("{unpack}", "")
        text = text.replace("{pool}", "pool2")
    param = caffe_pb2.NetParameter()
    text_format.Parse(text, param)
    rng.seed(5)
    return Net(param, TRAIN)


@pytest.mark.parametrize("width", ["8", "16"])
def test_blocked_net_matches_plain_net(width, monkeypatch):
    monkeypatch.setenv("CAFFEPY_BLOCK_WIDTH", width)
    plain, blocked = small_net(False), small_net(True)
    assert blocked.blobs["conv2"].shape[-1] == int(width)
    for name in plain.params:          # same weights (same seed, but make sure)
        for p, b in zip(plain.params[name], blocked.params[name]):
            b.data[...] = p.data
    x = np.random.default_rng(0).standard_normal((2, 3, 35, 35)).astype(np.float32)
    label = np.array([1, 3], np.float32)
    outs = []
    for net in (plain, blocked):
        net.blobs["data"].data[...] = x
        net.blobs["label"].data[...] = label
        net.clear_param_diffs()
        loss = net.forward_backward()
        outs.append(loss)
    assert outs[0] == pytest.approx(outs[1], rel=1e-5)
    np.testing.assert_allclose(blocked.blobs["flat"].data, plain.blobs["pool2"].data, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(blocked.blobs["fc"].data, plain.blobs["fc"].data, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(blocked.blobs["data"].diff, plain.blobs["data"].diff, rtol=1e-3, atol=1e-6)
    for name in plain.params:
        for i, (p, b) in enumerate(zip(plain.params[name], blocked.params[name])):
            np.testing.assert_allclose(b.diff, p.diff, rtol=1e-3, atol=1e-6, err_msg=f"{name}[{i}]")
    kinds = {layer.name: type(layer).__name__ for layer in blocked.layers}
    assert kinds["conv1"] == "BlockedConvolution" and kinds["norm1"] == "BlockedLRN"
    assert kinds["pool1"] == "BlockedPooling" and kinds["cat"] == "BlockedConcat"


BN_NET = """
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 3 dim: 5 dim: 6 dim: 6 } } }
{pack}
layer { name: "conv" type: "Convolution" bottom: "{data}" top: "conv"
  convolution_param { num_output: 11 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv"
  scale_param { bias_term: true filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } } }
layer { name: "sig" type: "Sigmoid" bottom: "conv" top: "conv" }
layer { name: "norm" type: "LRN" bottom: "conv" top: "norm" lrn_param { local_size: 5 alpha: 0.5 } }
{unpack}
layer { name: "loss" type: "EuclideanLoss" bottom: "{out}" bottom: "target" top: "loss" }
layer { name: "target" type: "Input" top: "target" input_param { shape { dim: 3 dim: 11 dim: 4 dim: 4 } } }
"""


@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_batchnorm_scale_and_sigmoid_on_blocked_blobs(phase):
    # BatchNorm and Scale run through NCHW; Sigmoid leaves 0.5 in the padding lanes, which the
    # LRN after it must not read
    def build(blocked):
        text = BN_NET.replace("{pack}", 'layer { name: "pack" type: "IntelPack" bottom: "data" top: "packed" }'
                              if blocked else "").replace("{data}", "packed" if blocked else "data")
        text = text.replace("{unpack}", 'layer { name: "unpack" type: "IntelUnpack" bottom: "norm" top: "out" }'
                            if blocked else "").replace("{out}", "out" if blocked else "norm")
        # the target Input must come first: move it up
        lines = text.strip().splitlines()
        target = [ln for ln in lines if 'name: "target"' in ln]
        lines = [ln for ln in lines if 'name: "target"' not in ln]
        param = caffe_pb2.NetParameter()
        text_format.Parse("\n".join(lines[:1] + target + lines[1:]), param)
        rng.seed(3)
        return Net(param, phase)
    plain, blocked = build(False), build(True)
    gen = np.random.default_rng(1)
    x = gen.standard_normal((3, 5, 6, 6)).astype(np.float32)
    target = gen.standard_normal((3, 11, 4, 4)).astype(np.float32)
    for name, blobs in blocked.params.items():
        for b, p in zip(blobs, plain.params[name]):
            b.data[...] = p.data
    for net in (plain, blocked):
        if phase == TEST:
            net.params["bn"][0].data[...] = np.arange(11)
            net.params["bn"][1].data[...] = np.arange(1, 12)
            net.params["bn"][2].data[...] = 2
        net.blobs["data"].data[...] = x
        net.blobs["target"].data[...] = target
        net.clear_param_diffs()
        net.forward_backward()
    np.testing.assert_allclose(blocked.blobs["out"].data, plain.blobs["norm"].data, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(blocked.blobs["data"].diff, plain.blobs["data"].diff, rtol=1e-3, atol=1e-5)
    for name in ("conv", "scale"):
        for p, b in zip(plain.params[name], blocked.params[name]):
            np.testing.assert_allclose(b.diff, p.diff, rtol=1e-3, atol=1e-5, err_msg=name)
    if phase == TRAIN:   # running statistics updated alike
        for p, b in zip(plain.params["bn"], blocked.params["bn"]):
            np.testing.assert_allclose(b.data, p.data, rtol=1e-5, atol=1e-6)


def _net(text):
    param = caffe_pb2.NetParameter()
    text_format.Parse(text, param)
    return Net(param, TRAIN, source="net.prototxt")


PACKED = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } } }
layer { name: "pack" type: "IntelPack" bottom: "data" top: "packed" }
"""


def test_layer_without_blocked_version_is_an_error():
    text = PACKED + """
    layer { name: "fc6" type: "InnerProduct" bottom: "packed" top: "fc6" inner_product_param { num_output: 3 } }"""
    with pytest.raises(LayerError) as e:
        _net(text)
    msg = str(e.value)
    assert msg.startswith("net.prototxt: layer 'fc6' (InnerProduct): bottom: blob 'packed' is in the "
                          "SIMD-blocked layout")
    assert "Put an IntelUnpack before this layer" in msg and "\n" not in msg


def test_mixed_layouts_are_an_error():
    text = PACKED + """
    layer { name: "sum" type: "Eltwise" bottom: "packed" bottom: "data" top: "sum" }"""
    with pytest.raises(LayerError, match=r"layer 'sum' \(Eltwise\): bottom: mixes blocked and plain"):
        _net(text)


def test_pack_twice_is_an_error():
    text = PACKED + """
    layer { name: "pack2" type: "IntelPack" bottom: "packed" top: "twice" }"""
    with pytest.raises(LayerError, match=r"layer 'pack2' \(IntelPack\): bottom: blob 'packed' is already blocked"):
        _net(text)


def test_unsupported_pooling_is_an_error():
    text = PACKED + """
    layer { name: "pool" type: "Pooling" bottom: "packed" top: "pool"
      pooling_param { pool: STOCHASTIC kernel_size: 2 } }"""
    with pytest.raises(LayerError, match=r"layer 'pool' \(Pooling\): pooling_param.pool: only MAX and AVE"):
        _net(text)


def test_intel_alexnet_models_match_bvlc_alexnet():
    # same layers and parameters as BVLC AlexNet, plus the pack / unpack pair
    deploy = Net(os.path.join(MODELS, "deploy.prototxt"), TEST)
    types = [layer.type for layer in deploy.layers]
    assert types[1] == "IntelPack" and types[types.index("InnerProduct") - 1] == "IntelUnpack"
    shapes = {name: [b.shape for b in blobs] for name, blobs in deploy.params.items()}
    assert shapes["conv2"] == [(256, 48, 5, 5), (256,)]
    assert shapes["fc6"] == [(4096, 9216), (4096,)]
    assert deploy.blobs["prob"].shape == (10, 1000)
    from caffepy import upgrade
    solver = upgrade.read_solver(os.path.join(MODELS, "solver.prototxt"))
    val = upgrade.read_net(os.path.join(MODELS, "train_val.prototxt"))
    val_batch = [lp.data_param.batch_size for lp in val.layer
                 if lp.type == "Data" and lp.include[0].phase == caffe_pb2.TEST]
    assert solver.test_iter == [200] and val_batch == [256]


def _alexnet_train(blocked, batch=2):
    """models/intel_alexnet's TRAIN net on random DummyData; without Pack / Unpack if not blocked."""
    from caffepy import upgrade
    from caffepy.net import filter_net, net_state
    param = filter_net(upgrade.read_net(os.path.join(MODELS, "train_val.prototxt")), net_state(TRAIN, 0, []))
    data = param.layer[0]
    assert data.type == "Data"
    data.Clear()
    text_format.Parse(f"""name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param {{ shape {{ dim: {batch} dim: 3 dim: 227 dim: 227 }} shape {{ dim: {batch} }}
        data_filler {{ type: "gaussian" std: 50 }} data_filler {{ type: "constant" value: 7 }} }}""", data)
    if not blocked:
        renamed = {}
        for lp in list(param.layer):
            if lp.type in ("IntelPack", "IntelUnpack"):
                renamed[lp.top[0]] = lp.bottom[0]
                param.layer.remove(lp)
        for lp in param.layer:
            lp.bottom[:] = [renamed.get(b, b) for b in lp.bottom]
    rng.seed(11)
    return Net(param, TRAIN)


def test_intel_alexnet_equals_plain_alexnet():
    # the whole model: blocked kernels (Winograd conv2-conv5, blocked LRN and pooling) against
    # Caffe's NCHW algorithms, forward and every gradient
    plain, blocked = _alexnet_train(False), _alexnet_train(True)
    winograd = [layer.name for layer in blocked.layers if getattr(layer, "winograd", False)]
    assert winograd == ["conv2", "conv3", "conv4", "conv5"]
    for name in plain.params:
        for p, b in zip(plain.params[name], blocked.params[name]):
            b.data[...] = p.data
    for net in (plain, blocked):
        rng.seed(3)                         # the same data and dropout masks in both nets
        net.clear_param_diffs()
        net.forward_backward()
    np.testing.assert_array_equal(blocked.blobs["data"].data, plain.blobs["data"].data)
    for mine, theirs in (("pool5_nchw", "pool5"), ("fc8", "fc8")):
        want = plain.blobs[theirs].data
        np.testing.assert_allclose(blocked.blobs[mine].data, want, rtol=1e-3,
                                   atol=1e-3 * np.abs(want).max(), err_msg=mine)
    assert float(blocked.blobs["loss"].data) == pytest.approx(float(plain.blobs["loss"].data), rel=1e-4)
    # Gradients: Winograd's float32 rounding (~1e-6 here) moves a few max-pooling argmaxes and
    # ReLU signs at near-ties, which reroutes single gradient entries; the fc layers (before any
    # such switch) stay within 1e-5, the convolutions within 1e-2 in norm (measured ~3e-3 at most).
    for name in plain.params:
        for i, (p, b) in enumerate(zip(plain.params[name], blocked.params[name])):
            norm = np.linalg.norm(p.diff)
            assert norm > 0, f"{name}[{i}] got no gradient"
            err = np.linalg.norm(b.diff - p.diff) / norm
            assert err < (1e-5 if name.startswith("fc") else 1e-2), f"{name}[{i}]: {err:.2e}"


def _caffepy(*args, cwd=REPO):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "caffepy.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_caffepy_time_on_intel_alexnet_deploy():
    r = _caffepy("time", "--model", "models/intel_alexnet/deploy.prototxt", "--iterations", "1",
                 "--phase", "TEST")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Average Forward pass" in r.stderr and "pack\tforward" in r.stderr.replace("  ", "")


@pytest.mark.slow
def test_caffepy_time_on_intel_alexnet_train_val(tmp_path):
    # the TRAIN net with its Data layer swapped for small DummyData (no ImageNet LMDB in tests)
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from bench_alexnet import caffepy_net_param
    param = caffepy_net_param(2, blocked=True)
    path = tmp_path / "train_val_dummy.prototxt"
    path.write_text(text_format.MessageToString(param))
    r = _caffepy("time", "--model", str(path), "--iterations", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Average Forward-Backward" in r.stderr
    assert "conv2\tbackward" in r.stderr.replace(" ", "")
