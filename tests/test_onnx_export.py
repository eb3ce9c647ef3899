"""ONNX export: every mapped layer type against onnxruntime on small shapes (odd pooling
geometries included), the refusals, the CLI, and real nets (AlexNet, GoogLeNet, ResNet-50)."""
import os
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import caffepy  # noqa: E402
from caffepy import fillers, onnx_export  # noqa: E402
from caffepy.blob import Blocked  # noqa: E402
from caffepy.errors import CaffepyError  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402

from paths import REPO


def make_net(text, phase=caffepy.TEST):
    return caffepy.Net(text_format.Parse(text, caffe_pb2.NetParameter()), phase=phase)


def randomize(net, seed=0, filler=None):
    """Random weights: N(0, 0.5), or caffepy's `filler` ("msra", "xavier") for weights and
    N(0, 0.1) biases (activations that stay in range through a deep net); BatchNorm statistics
    that are plausible (var > 0, a moving-average factor that is not 1)."""
    caffepy.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    for layer in net.layers:
        for i, blob in enumerate(layer.blobs):
            if layer.type == "BatchNorm":
                blob.data[...] = [rng.normal(0, 0.5, blob.shape), rng.uniform(0.5, 2, blob.shape), [0.7]][i]
            elif filler and blob.num_axes > 1:
                blob.data[...] = fillers.fill(caffe_pb2.FillerParameter(type=filler), blob.shape)
            else:
                blob.data[...] = rng.normal(0, 0.1 if filler else 0.5, blob.shape)


def onnx_outputs(model, feed, names=()):
    """Run `model` in onnxruntime; also fetch the tensors in `names` that it holds."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    known = {o for n in model.graph.node for o in n.output}
    have = {o.name for o in model.graph.output}
    for name in names:
        if name in known and name not in have:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fetch = [o.name for o in session.get_outputs()]
    return dict(zip(fetch, session.run(fetch, feed)))


def check(net, inputs, rtol=1e-4, every_blob=True):
    """Export `net`, run both on `inputs`, compare the outputs (and every blob ONNX holds)."""
    model = onnx_export.export(net)
    feed = {v.name: inputs[v.name] for v in model.graph.input}
    out = net.forward(**feed)
    got = onnx_outputs(model, feed, net.blobs if every_blob else ())
    blob_of = {o.name: o.doc_string.split(" ", 1)[1] for o in model.graph.output}
    assert set(blob_of) <= set(got)
    unwritten = set(net.unwritten_blobs())      # a TEST net's fused units compute past them
    for name, value in got.items():
        if blob_of.get(name, name) in unwritten:
            continue
        want = nchw(net.blobs[blob_of.get(name, name)])
        scale = max(float(np.abs(want).max()), 1e-30)
        err = float(np.abs(value - want).max()) / scale
        assert value.shape == want.shape, name
        assert err <= rtol, f"{name}: max error {err:.3g} of max |value| {scale:.3g}"
    return model, out


def nchw(blob):
    """A blob's values in NCHW (blobs on the Intel path hold the SIMD-blocked layout)."""
    if not isinstance(blob.layout, Blocked):
        return blob.data                 # plain, or channels-last (whose data is an NCHW view)
    n, blocks, h, w, width = blob.shape
    return blob.data.transpose(0, 1, 4, 2, 3).reshape(n, blocks * width, h, w)[:, :blob.layout.channels]


def ops(model):
    return [n.op_type for n in model.graph.node]


def input_layer(shape, name="data"):
    dims = " ".join(f"dim: {d}" for d in shape)
    return f'layer {{ name: "{name}" type: "Input" top: "{name}" input_param {{ shape {{ {dims} }} }} }}\n'


def one_layer(body, shape=(2, 6, 9, 8), positive=False, seed=1, extra_inputs=()):
    """A net of an Input and the layers in `body` (bottom "data"); random weights and input."""
    text = input_layer(shape) + "".join(input_layer(s, n) for n, s in extra_inputs) + body
    net = make_net(text)
    randomize(net, seed)
    rng = np.random.default_rng(seed + 100)
    inputs = {"data": rng.normal(0, 1, shape).astype(np.float32)}
    for n, s in extra_inputs:
        inputs[n] = rng.normal(0, 1, s).astype(np.float32)
    if positive:
        inputs["data"] = np.abs(inputs["data"]) + 0.1
    return net, inputs


def layer(type_, params="", bottom="data", top="out", name="l", extra=""):
    bottoms = "".join(f'bottom: "{b}" ' for b in ([bottom] if isinstance(bottom, str) else bottom))
    tops = "".join(f'top: "{t}" ' for t in ([top] if isinstance(top, str) else top))
    return f'layer {{ name: "{name}" type: "{type_}" {bottoms}{tops}{params} {extra}}}\n'


# -- one case per mapped layer type -----------------------------------------------------------
CASES = {
    "conv_groups_dilation": layer("Convolution", "convolution_param { num_output: 4 kernel_h: 3 "
                                  "kernel_w: 2 pad_h: 1 pad_w: 2 stride_h: 2 stride_w: 1 dilation: 2 "
                                  "group: 2 }"),
    "conv_no_bias": layer("Convolution", "convolution_param { num_output: 3 kernel_size: 3 "
                          "bias_term: false }"),
    "conv_two_bottoms": layer("ReLU", top="a", name="r") + layer(
        "Convolution", "convolution_param { num_output: 3 kernel_size: 2 stride: 2 }", bottom=["data", "a"],
        top=["out", "out2"]),
    "deconv": layer("Deconvolution", "convolution_param { num_output: 4 kernel_size: 4 stride: 2 "
                    "pad: 1 group: 2 }"),
    "deconv_dilation": layer("Deconvolution", "convolution_param { num_output: 2 kernel_size: 3 "
                             "stride: 3 dilation: 2 }"),
    "inner_product": layer("InnerProduct", "inner_product_param { num_output: 5 }"),
    "inner_product_2d_batchnorm": layer("Flatten", top="f", name="f") + layer(
        "InnerProduct", "inner_product_param { num_output: 5 }", bottom="f", top="ip", name="ip")
    + layer("BatchNorm", bottom="ip", top="ip", name="bn"),
    "inner_product_axis2_transpose": layer("InnerProduct", "inner_product_param { num_output: 5 "
                                           "axis: 2 transpose: true bias_term: false }"),
    "relu": layer("ReLU", bottom="data", top="data"),
    "leaky_relu": layer("ReLU", "relu_param { negative_slope: 0.1 }"),
    "sigmoid": layer("Sigmoid"),
    "tanh": layer("TanH"),
    "absval": layer("AbsVal"),
    "bnll": layer("BNLL"),
    "elu": layer("ELU", "elu_param { alpha: 0.5 }"),
    "exp": layer("Exp"),
    "exp_base_shift": layer("Exp", "exp_param { base: 2 scale: 0.5 shift: 1 }"),
    "power": layer("Power", "power_param { power: 2 scale: 0.5 shift: 1 }"),
    "power_constant": layer("Power", "power_param { power: 2 scale: 0 shift: 3 }"),
    "threshold": layer("Threshold", "threshold_param { threshold: 0.2 }"),
    "clip": layer("Clip", "clip_param { min: -0.5 max: 0.7 }"),
    "swish": layer("Swish", "swish_param { beta: 1.5 }"),
    "prelu": layer("PReLU"),
    "prelu_shared": layer("PReLU", "prelu_param { channel_shared: true }"),
    "dropout": layer("Dropout", "dropout_param { dropout_ratio: 0.3 }", top="data"),
    "lrn_across": layer("LRN", "lrn_param { local_size: 5 alpha: 0.5 beta: 0.75 k: 2 }"),
    "lrn_within": layer("LRN", "lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 "
                        "norm_region: WITHIN_CHANNEL }"),
    "softmax": layer("Softmax"),
    "softmax_axis2": layer("Softmax", "softmax_param { axis: -2 }"),
    "batchnorm_scale": layer("BatchNorm", top="data", name="bn")
    + layer("Scale", "scale_param { bias_term: true }", bottom="data", top="data", name="scale"),
    "batchnorm_relu": layer("BatchNorm", "batch_norm_param { relu: true }", top="data", name="bn"),
    "scale_axis2": layer("Scale", "scale_param { axis: 2 num_axes: 2 }"),
    "bias": layer("Bias"),
    "flatten": layer("Flatten", "flatten_param { axis: 1 end_axis: 2 }"),
    "reshape": layer("Reshape", "reshape_param { shape { dim: 0 dim: -1 dim: 4 } }"),
    "split_and_concat": layer("ReLU", top="a", name="r") + layer("Sigmoid", top="b", name="s")
    + layer("Concat", bottom=["a", "b", "data"], top="out", name="c"),
    "concat_axis3": layer("TanH", top="a", name="t") + layer("Concat", "concat_param { axis: 3 }",
                                                             bottom=["a", "data"], top="out", name="c"),
    "eltwise_sum_coeff": layer("ReLU", top="a", name="r") + layer("Sigmoid", top="b", name="s")
    + layer("Eltwise", "eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 }",
            bottom=["a", "b", "data"], name="e"),
    "eltwise_sum": layer("ReLU", top="a", name="r") + layer("Eltwise", bottom=["a", "data"], name="e"),
    "eltwise_prod": layer("TanH", top="a", name="t") + layer("Sigmoid", top="b", name="s")
    + layer("Eltwise", "eltwise_param { operation: PROD }", bottom=["a", "b", "data"], name="e"),
    "eltwise_max": layer("TanH", top="a", name="t") + layer("Eltwise", "eltwise_param { operation: MAX }",
                                                            bottom=["a", "data"], name="e"),
    "slice_points": layer("Slice", "slice_param { axis: 1 slice_point: 1 slice_point: 4 }",
                          top=["s0", "s1", "s2"]),
    "slice_equal": layer("Slice", "slice_param { axis: 3 }", top=["s0", "s1"]),
    "tile": layer("Tile", "tile_param { axis: 2 tiles: 3 }"),
    "reduction_sum": layer("Reduction", "reduction_param { axis: 2 coeff: 0.5 }"),
    "reduction_asum": layer("Reduction", "reduction_param { operation: ASUM axis: 1 }"),
    "reduction_sumsq": layer("Reduction", "reduction_param { operation: SUMSQ axis: -1 }"),
    "reduction_mean": layer("Reduction", "reduction_param { operation: MEAN axis: 1 coeff: 3 }"),
    "argmax_topk_values": layer("ArgMax", "argmax_param { top_k: 3 out_max_val: true }"),
    "argmax_axis": layer("ArgMax", "argmax_param { top_k: 2 axis: 1 }"),
    "argmax_axis_values": layer("ArgMax", "argmax_param { axis: 3 out_max_val: true }"),
}
POSITIVE = {"log": layer("Log", "log_param { base: 10 scale: 2 shift: 0.5 }"),
            "log_natural": layer("Log"),
            "power_sqrt": layer("Power", "power_param { power: 0.5 scale: 2 }")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_onnxruntime(case):
    net, inputs = one_layer(CASES[case])
    check(net, inputs)


@pytest.mark.parametrize("case", sorted(POSITIVE))
def test_layer_on_positive_input_matches_onnxruntime(case):
    net, inputs = one_layer(POSITIVE[case], positive=True)
    check(net, inputs)


def test_scale_and_bias_from_a_second_bottom():
    body = (layer("Scale", bottom=["data", "s"], top="scaled", name="scale")
            + layer("Bias", "bias_param { axis: 2 }", bottom=["scaled", "b"], top="out", name="bias"))
    net, inputs = one_layer(body, extra_inputs=[("s", (6, 9)), ("b", (9, 8))])
    check(net, inputs)


def test_crop_to_a_reference_blob():
    body = layer("Crop", "crop_param { axis: 2 offset: 1 offset: 2 }", bottom=["data", "ref"])
    net, inputs = one_layer(body, extra_inputs=[("ref", (1, 1, 5, 4))])
    model, _ = check(net, inputs)
    assert "Slice" in ops(model)


def test_argmax_ties_rank_the_later_index_first_as_caffe():
    net, inputs = one_layer(layer("ArgMax", "argmax_param { top_k: 4 out_max_val: true }"), shape=(3, 2, 2, 3))
    inputs["data"] = np.round(inputs["data"])      # many equal values
    check(net, inputs)


# Pooling: (H, W, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, extra fields). The
# comments say where Caffe's rounding bites.
POOL_GEOMETRIES = {
    "ceil_past_end_no_pad": (6, 6, 3, 3, 2, 2, 0, 0, ""),     # last window runs past the image
    "ceil_past_pad": (6, 6, 3, 3, 2, 2, 1, 1, ""),            # ... and past Caffe's pad
    "ceil_inside_pad": (5, 5, 3, 3, 2, 2, 1, 1, ""),          # every window inside the padding
    "clip_last_window": (4, 4, 3, 3, 2, 2, 2, 2, ""),         # ceil gives 4, Caffe drops one: 3
    "clip_stride3": (7, 7, 2, 2, 3, 3, 1, 1, ""),
    "asymmetric": (8, 5, 3, 2, 2, 2, 1, 0, ""),               # H past its pad, W past the image
    "floor_rounding": (6, 7, 3, 3, 2, 2, 1, 1, "round_mode: FLOOR"),
    "stride1": (5, 6, 3, 3, 1, 1, 1, 1, ""),
    "global": (5, 7, 0, 0, 1, 1, 0, 0, "global_pooling: true"),
}


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("geometry", sorted(POOL_GEOMETRIES))
def test_pooling_geometry_matches_onnxruntime(method, geometry):
    H, W, kh, kw, sh, sw, ph, pw, extra = POOL_GEOMETRIES[geometry]
    fields = f"pool: {method} {extra} "
    if geometry != "global":
        fields += f"kernel_h: {kh} kernel_w: {kw} stride_h: {sh} stride_w: {sw} pad_h: {ph} pad_w: {pw}"
    net, inputs = one_layer(layer("Pooling", f"pooling_param {{ {fields} }}"), shape=(2, 3, H, W))
    # positive inputs: a max over the padding (zeros in ONNX's view) would show
    inputs["data"] = np.abs(inputs["data"]) + 1 if method == "MAX" else inputs["data"]
    model, _ = check(net, inputs)
    if method == "AVE" and geometry in ("ceil_past_pad", "asymmetric"):
        assert ops(model) == ["Pad", "AveragePool"]    # windows past Caffe's pad: explicit zeros
    assert "ceil_mode" not in str(model.graph.node)


@pytest.mark.parametrize("geometry", ["ceil_past_pad", "clip_last_window", "asymmetric", "ceil_inside_pad"])
def test_ave_pooling_without_pad_in_the_divisor_matches_onnxruntime(geometry):
    # Intel Caffe's avg_include_pad: false divides by the window clipped to the image
    H, W, kh, kw, sh, sw, ph, pw, _ = POOL_GEOMETRIES[geometry]
    fields = (f"pool: AVE avg_include_pad: false kernel_h: {kh} kernel_w: {kw} stride_h: {sh} "
              f"stride_w: {sw} pad_h: {ph} pad_w: {pw}")
    net, inputs = one_layer(layer("Pooling", f"pooling_param {{ {fields} }}"), shape=(2, 3, H, W))
    check(net, inputs)


def test_train_val_net_exports_data_as_input_and_drops_loss_layers():
    text = ('layer { name: "data" type: "DummyData" top: "data" top: "label" dummy_data_param { '
            'shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } data_filler { type: "constant" } } }\n'
            + layer("Convolution", "convolution_param { num_output: 4 kernel_size: 3 }", top="conv",
                    name="conv")
            + layer("InnerProduct", "inner_product_param { num_output: 3 }", bottom="conv", top="ip",
                    name="ip")
            + layer("SoftmaxWithLoss", bottom=["ip", "label"], top="loss", name="loss")
            + layer("Accuracy", bottom=["ip", "label"], top="accuracy", name="accuracy"))
    net = make_net(text)
    randomize(net)
    model = onnx_export.export(net)
    assert [v.name for v in model.graph.input] == ["data"]
    assert [v.name for v in model.graph.output] == ["ip"]
    check(net, {"data": np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)})


def test_in_place_blobs_are_named_for_their_last_value():
    body = (layer("Convolution", "convolution_param { num_output: 4 kernel_size: 3 }", top="conv", name="conv")
            + layer("ReLU", bottom="conv", top="conv", name="relu")
            + layer("Pooling", "pooling_param { pool: MAX kernel_size: 2 stride: 2 }", bottom="conv",
                    top="pool", name="pool"))
    net, inputs = one_layer(body)
    model, _ = check(net, inputs)
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    assert list(relu.output) == ["conv"] and list(relu.input) == ["conv_conv"]
    assert [v.name for v in model.graph.output] == ["pool"]
    assert model.opset_import[0].version == onnx_export.OPSET


def test_layer_without_exact_mapping_is_one_line_error():
    net, _ = one_layer(layer("MVN", name="norm"))
    with pytest.raises(CaffepyError) as e:
        onnx_export.export(net)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("<net>: layer 'norm' (MVN): type: has no exact ONNX mapping. Mapped types: ")


def test_a_layer_reading_a_left_out_layer_is_refused():
    text = (input_layer((2, 3)) + input_layer((2,), "label")
            + layer("SoftmaxWithLoss", bottom=["data", "label"], top="loss", name="loss")
            + layer("Power", bottom="loss", top="out", name="twice"))
    with pytest.raises(CaffepyError, match=r"layer 'twice' \(Power\): bottom: blob 'loss' comes from a layer left out"):
        onnx_export.export(make_net(text))


def test_mask_top_train_phase_and_fused_relu_are_refused():
    net, _ = one_layer(layer("Pooling", "pooling_param { pool: MAX kernel_size: 2 }", top=["out", "mask"]))
    with pytest.raises(CaffepyError, match=r"layer 'l' \(Pooling\): top: the MAX pooling mask top"):
        onnx_export.export(net)
    net = make_net(input_layer((2, 3)) + layer("Dropout"), phase=caffepy.TRAIN)
    with pytest.raises(CaffepyError, match=r"\(Dropout\): phase: TRAIN-phase dropout is random"):
        onnx_export.export(net)
    net = make_net(input_layer((2, 3)) + layer("BatchNorm"), phase=caffepy.TRAIN)
    with pytest.raises(CaffepyError, match=r"\(BatchNorm\): batch_norm_param.use_global_stats: batch "):
        onnx_export.export(net)
    # Intel's fused ReLU: computed by caffepy, not exported
    net, _ = one_layer(layer("Convolution", "convolution_param { num_output: 2 kernel_size: 1 relu: true }"))
    with pytest.raises(CaffepyError, match=r"convolution_param.relu: Intel's fused ReLU / Eltwise SUM is not "
                                           r"exported\. Export the net with a ReLU"):
        onnx_export.export(net)


def test_missing_onnx_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)
    net, _ = one_layer(layer("ReLU"))
    with pytest.raises(CaffepyError, match=r"^export_onnx needs the onnx package: pip install 'caffepy\[onnx\]'"):
        onnx_export.export(net)


def test_intel_path_exports_as_plain_nchw():
    body = (layer("IntelPack", top="packed", name="pack")
            + layer("Convolution", "convolution_param { num_output: 8 kernel_size: 3 pad: 1 }",
                    bottom="packed", top="conv", name="conv")
            + layer("ReLU", bottom="conv", top="conv", name="relu")
            + layer("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 }", bottom="conv",
                    top="pool", name="pool")
            + layer("IntelUnpack", bottom="pool", top="out", name="unpack"))
    net, inputs = one_layer(body)
    model, _ = check(net, inputs)
    assert "IntelPack" not in str(model.graph.node)


def test_cli_export_onnx(tmp_path):
    net, inputs = one_layer(layer("Convolution", "convolution_param { num_output: 4 kernel_size: 3 }",
                                  top="conv", name="conv")
                            + layer("Softmax", bottom="conv", top="prob", name="prob"))
    prototxt = tmp_path / "deploy.prototxt"
    prototxt.write_text(text_format.MessageToString(net.param))
    net.save(str(tmp_path / "w.caffemodel"))
    out = tmp_path / "net.onnx"
    proc = subprocess.run([sys.executable, "-m", "caffepy.cli", "export_onnx", str(prototxt),
                           str(tmp_path / "w.caffemodel"), str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Outputs: prob (2x4x7x6)" in proc.stderr
    got = onnx_outputs(onnx.load(str(out)), inputs)["prob"]
    np.testing.assert_allclose(got, net.forward(**inputs)["prob"], rtol=1e-4, atol=1e-6)

    prototxt.write_text(text_format.MessageToString(net.param) + layer("MVN", bottom="prob", top="n",
                                                                           name="mvn"))
    proc = subprocess.run([sys.executable, "-m", "caffepy.cli", "export_onnx", str(prototxt),
                           str(tmp_path / "w.caffemodel"), str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"caffepy: error: {prototxt}: layer 'mvn' (MVN): type: has no exact ONNX mapping. "
                      + errors[0].split(". ", 1)[1]]


# -- real nets, weights filled randomly by caffepy, batch 1 ----------------------------------
def real_net(path, filler):
    from caffepy import upgrade
    param = upgrade.read_net(os.path.join(REPO, path))
    for lp in param.layer:
        if lp.type == "Input":
            lp.input_param.shape[0].dim[0] = 1
    net = caffepy.Net(param, phase=caffepy.TEST, source=path)
    randomize(net, filler=filler)
    return net


# GoogLeNet (Concat, LRN, ceil-rounded pooling) runs by default; AlexNet on the Intel path (240 MB
# of weights) and ResNet-50 (BatchNorm, Scale, Eltwise; caffepy's forward alone takes seconds)
# are slow
# Fillers as each net's own prototxt or generator would choose: xavier keeps AlexNet's logits in
# the tens (MSRA gives hundreds, where softmax turns 1e-6 of rounding into 1e-4)
@pytest.mark.parametrize("path,filler", [
    pytest.param("models/intel_alexnet/deploy.prototxt", "xavier", marks=pytest.mark.slow),
    ("models/zoo/googlenet_deploy.prototxt", "xavier"),
    pytest.param("models/zoo/resnet50_deploy.prototxt", "msra", marks=pytest.mark.slow)])
def test_real_net_matches_onnxruntime(path, filler):
    # mean-subtracted pixels have a standard deviation of about 50
    net = real_net(path, filler)
    shape = net.blobs["data"].shape
    inputs = {"data": np.random.default_rng(0).normal(0, 50, shape).astype(np.float32)}
    check(net, inputs)
