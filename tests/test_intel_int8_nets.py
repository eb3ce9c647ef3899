"""Intel Caffe's int8 nets (models/intel_optimized_models/int8 of the tree CAFFEPY_INTEL_CAFFE
names, e.g. an export: `git archive HEAD models | tar -x -C /work/intel-caffe`) build in TEST and
run a forward on random weights (ssd_vgg16_int8's Concats with per_fla_fuse, Intel's fused
Permute + Flatten, too): every layer with quantization_param runs as the first layer of an int8 unit (net_rules.Int8Unit), and every blob is finite. Data layers become inputs of one
image (Data: the crop size; AnnotatedData: its resize), DummyData batches shrink to one."""
import glob
import os

import numpy as np
import pytest

import caffepy
from caffepy import upgrade
from caffepy.net import Net

TREE = os.environ.get("CAFFEPY_INTEL_CAFFE", "")
INT8 = os.path.join(TREE, "models", "intel_optimized_models", "int8")
NETS = sorted(glob.glob(os.path.join(INT8, "*.prototxt"))) if TREE else []
# the ones the default run builds (a ResNet-50, both MobileNets, Inception-v3); the rest are slow
CORE = ("resnet50_int8_full_perf.prototxt", "mobilenet_v1_int8_perf.prototxt",
        "mobilenet_v2_int8_perf.prototxt", "inceptionv3_int8.prototxt")


def _synthetic(param):
    for lp in param.layer:
        if lp.type in ("Data", "AnnotatedData"):
            tops, name, include = list(lp.top), lp.name, list(lp.include)
            t = lp.transform_param
            side = t.crop_size or t.resize_param.height or 300
            lp.Clear()
            lp.name, lp.type = name, "DummyData"
            lp.top.extend(tops)
            lp.include.extend(include)
            lp.dummy_data_param.shape.add().dim.extend([1, 3, side, side])
            lp.dummy_data_param.data_filler.add(type="gaussian", std=1)
            if len(tops) > 1:
                lp.dummy_data_param.data_filler.add(type="constant", value=0)   # labels
            if len(tops) > 1:
                lp.dummy_data_param.shape.add().dim.extend([1, 1, 2, 8] if name != "data" or
                                                           "Annotated" in tops[1] else [1])
        elif lp.type == "DummyData":
            for shape in lp.dummy_data_param.shape:
                shape.dim[0] = 1
            for filler in lp.dummy_data_param.data_filler:   # constants would give zero tops
                filler.type, filler.std = "gaussian", 1.0
    for i in range(len(param.input_shape)):
        param.input_shape[i].dim[0] = 1
    if len(param.input_dim):
        param.input_dim[0] = 1
    return param


def _params():
    if not TREE:
        return [pytest.param(None, marks=pytest.mark.skip(
            reason="CAFFEPY_INTEL_CAFFE names no Intel Caffe tree"))]
    return [pytest.param(p, id=os.path.basename(p),
                         marks=() if os.path.basename(p) in CORE else (pytest.mark.slow,))
            for p in NETS]


@pytest.mark.parametrize("path", _params())
def test_intel_int8_net_builds_and_runs(path):
    with open(path) as f:
        param = _synthetic(upgrade.parse_net_text(f.read(), path))
    for lp in param.layer:
        if lp.type in ("Accuracy", "DetectionEvaluate", "EvalDetection"):
            del lp.include[:]                      # scored against labels the synthetic data lacks
            lp.include.add().stage.append("never")
    net = Net(param, caffepy.TEST)
    quantized = [lp.name for lp in param.layer if lp.HasField("quantization_param")]
    units = {net.layers[i].name for i, j in net.fusions.items()
             if net._units[i].rule.name == "Int8 convolution"}
    assert units == set(quantized)
    rng = np.random.default_rng(0)
    for layer in net.layers:        # Intel's perf nets give no fillers: weights would be 0
        if layer.type == "BatchNorm":
            for blob, value in zip(layer.blobs, (0, 1, 1)):
                blob.data[...] = value
        elif layer.type in ("Convolution", "InnerProduct"):
            w = layer.blobs[0].data
            if layer.param.HasField("quantization_param"):
                # weights over the int8 range the layer's scales were calibrated for
                sp = np.broadcast_to(np.float32(layer.param.quantization_param.scale_params), w.shape[:1])
                bound = np.where(sp > 0, 127 / np.where(sp > 0, sp, 1), 0)
                w[...] = rng.uniform(-1, 1, w.shape) * bound.reshape((-1,) + (1,) * (w.ndim - 1))
            else:
                w[...] = rng.normal(0, (w.size // w.shape[0]) ** -0.5, w.shape)
    for name in net.inputs:
        net.blobs[name].data[...] = rng.normal(0, 1, net.blobs[name].shape)
    net.forward()
    # (resnext50_int8_perf's conv1 has one scale_params of 1.2e11: its 8-bit outputs are 0)
    assert any(np.abs(net.blobs[lp.top[0]].data).max() > 0 for lp in param.layer
               if lp.name in quantized) or "resnext50_int8_perf" in path
    for name, blob in net.blobs.items():
        assert np.isfinite(blob.data).all(), name


@pytest.mark.parametrize("path", [p for p in _params() if p.values[0] is None
                                  or os.path.basename(p.values[0]) in CORE])
def test_a_float32_fallback_runs_the_float32_nets_layers(path):
    """Every channels-last quantized convolution forced to its float32 fallback computes what
    the net without quantization_param computes (caffepy/quantization.py: Intel's float32
    layers), up to the first layer that stays int8 (an InnerProduct, a grouped convolution)."""
    from caffepy import quantization
    with open(path) as f:
        text = f.read()
    nets = []
    for quantized in (False, True):
        param = _synthetic(upgrade.parse_net_text(text, path))
        for lp in param.layer:
            if not quantized:
                lp.ClearField("quantization_param")
            if lp.type == "Accuracy":
                del lp.include[:]
                lp.include.add().stage.append("never")
        nets.append(Net(param, caffepy.TEST))
    f32, int8 = nets
    for a, b in zip(f32.layers, int8.layers):
        for x, y in zip(a.blobs, b.blobs):
            y.data[...] = x.data
        if b.type == "BatchNorm":
            for blob, value in zip(b.blobs, (0, 1, 1)):
                blob.data[...] = value
            for blob, value in zip(a.blobs, (0, 1, 1)):
                blob.data[...] = value
    stays = [li for li, la in enumerate(int8.layers) if getattr(la, "int8", None) is not None
             and not la.int8.channels_last]
    for layer in int8.layers:
        if getattr(layer, "int8", None) is not None and layer.int8.channels_last:
            layer.int8.force_path(quantization.FLOAT32)
    f32.forward()
    start = max(li for li, bottoms in enumerate(int8.bottom_vecs) if not bottoms) + 1
    for name in int8.inputs + [t for li in range(start) for t in int8.layers[li].param.top]:
        int8.blobs[name].data[...] = f32.blobs[name].data        # the same random input
    end = min(stays, default=len(int8.layers))
    int8.forward_from_to(start, end - 1)
    checked = 0
    for li in range(start, end):
        for blob, name in zip(int8.top_vecs[li], int8.layers[li].param.top):
            want = f32.blobs[name].data
            np.testing.assert_allclose(blob.data, want, rtol=0, atol=1e-5 * max(np.abs(want).max(), 1e-30),
                                       err_msg=name)
            checked += 1
    assert checked > 10
