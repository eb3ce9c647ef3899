"""`caffepy calibrate` (caffepy/calibrate.py): the scales Intel's calibrator writes, measured on
the net's own batches, and the int8 net it writes runs and keeps the float net's top-1."""
import numpy as np
import pytest
from google.protobuf import text_format

import caffepy
from caffepy import calibrate
from caffepy.errors import CaffepyError
from caffepy.net import Net
from caffepy.proto import caffe_pb2
from caffepy.upgrade import read_net

NET = """name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 }
                     data_filler { type: "constant" value: 0.5 } data_filler { type: "constant" value: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 6 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool" top: "conv3"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "fc" type: "InnerProduct" bottom: "conv3" top: "fc"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "fc" bottom: "label" top: "accuracy" }
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "small.prototxt"
    path.write_text(NET)
    caffepy.set_random_seed(1)     # the fillers: some draws leave conv1's ReLU all zero on this input
    net = Net(str(path), caffepy.TEST)
    bn = net.layer_dict["bn2"]
    bn.blobs[0].data[...] = np.linspace(-0.2, 0.3, 5)
    bn.blobs[1].data[...] = np.linspace(0.5, 2.0, 5)
    bn.blobs[2].data[...] = 1
    weights = tmp_path / "small.caffemodel"
    net.save(str(weights))
    return path, weights, net


def test_scales_are_intels(model, tmp_path):
    path, weights, net = model
    out = tmp_path / "int8.prototxt"
    base, acc, agree, names = calibrate.calibrate(str(path), str(weights), str(out), 2, 2,
                                                  weights_channel="multiple")
    assert names == ["conv2", "conv3"]            # the first convolution stays float32
    net.forward()                                 # the float32 score is the net's own
    assert base[0] == pytest.approx(float(net.blobs["accuracy"].data)) and 0 <= agree <= 1
    q = {lp.name: lp.quantization_param for lp in read_net(str(out)).layer
         if lp.HasField("quantization_param")}
    net.forward()
    conv1, conv2 = net.blobs["conv1"].data, net.blobs["conv2"].data    # after their ReLUs
    w, _ = calibrate.fold_batchnorm(net.layer_dict["conv2"].blobs[0].data,
                                    net.layer_dict["conv2"].blobs[1].data, net.layer_dict["bn2"], None)
    c2 = q["conv2"]
    assert (c2.bw_layer_in, c2.bw_layer_out, c2.bw_params) == (8, 8, 8)
    assert not c2.is_negative_input                                     # a ReLU's output
    np.testing.assert_allclose(c2.scale_in, [255 / np.abs(conv1).max()], rtol=1e-6)
    np.testing.assert_allclose(c2.scale_out, [255 / np.abs(conv2).max()], rtol=1e-6)
    np.testing.assert_allclose(c2.scale_params, 127 / np.abs(w.reshape(5, -1)).max(axis=1), rtol=1e-6)
    c3 = q["conv3"]                  # read by the float32 InnerProduct: a float32 top
    assert c3.bw_layer_out == 32 and list(c3.scale_out) == [1.0]
    assert len(c3.scale_params) == 4
    int8 = Net(str(out), caffepy.TEST, weights=str(weights))
    assert {int8.layers[i].name for i in int8.fusions} >= {"conv2", "conv3"}


def test_single_weight_scale_and_fc(model, tmp_path):
    path, weights, net = model
    out = tmp_path / "int8.prototxt"
    *_, names = calibrate.calibrate(str(path), str(weights), str(out), 1, 1, first_conv=True,
                                    fc_int8=True)
    assert names == ["conv1", "conv2", "conv3", "fc"]
    q = {lp.name: lp.quantization_param for lp in read_net(str(out)).layer
         if lp.HasField("quantization_param")}
    assert all(len(p.scale_params) == 1 for p in q.values())
    assert q["conv3"].bw_layer_out == 8             # the InnerProduct reads it in int8 now


def test_a_quantized_model_is_refused(model, tmp_path):
    path, weights, _ = model
    out = tmp_path / "int8.prototxt"
    calibrate.calibrate(str(path), str(weights), str(out), 1, 1)
    with pytest.raises(CaffepyError, match=r"^calibrate: --model: .*int8.prototxt is quantized "
                                           r"already \(quantization_param\); give the float32 net$"):
        calibrate.calibrate(str(out), str(weights), str(tmp_path / "again.prototxt"), 1, 1)


BLOCK = """name: "block"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 }
                     data_filler { type: "constant" value: 0.5 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
                      bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "b" type: "Convolution" bottom: "conv1" top: "b"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 stride: 2 weight_filler { type: "msra" } } }
layer { name: "b_bn" type: "BatchNorm" bottom: "b" top: "b" }
layer { name: "proj" type: "Convolution" bottom: "conv1" top: "proj"
  convolution_param { num_output: 6 kernel_size: 1 stride: 2 weight_filler { type: "msra" } } }
layer { name: "sum" type: "Eltwise" bottom: "b" bottom: "proj" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "conv3" type: "Convolution" bottom: "sum" top: "conv3"
  convolution_param { num_output: 3 kernel_size: 4 weight_filler { type: "msra" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "conv3" bottom: "label" top: "accuracy" }
"""


def test_the_summand_of_a_fused_sum_keeps_an_8_bit_top(tmp_path):
    """ResNet's shortcut written after the branch (b, then proj, then the sum): the sum folds
    into proj's unit and reads b's top as its summand, so b's top stays 8-bit and proj runs
    int8 with the sum (with a float32 summand both would run apart in float32)."""
    path, weights, out = tmp_path / "block.prototxt", tmp_path / "block.caffemodel", tmp_path / "int8.prototxt"
    path.write_text(BLOCK)
    caffepy.set_random_seed(2)
    net = Net(str(path), caffepy.TEST)
    bn = net.layer_dict["b_bn"]
    bn.blobs[0].data[...], bn.blobs[1].data[...], bn.blobs[2].data[...] = 0.1, 2.0, 1
    net.save(str(weights))
    *_, names = calibrate.calibrate(str(path), str(weights), str(out), 1, 1, accuracy_loss=1)
    assert names == ["b", "proj", "conv3"]
    q = {lp.name: lp.quantization_param for lp in read_net(str(out)).layer
         if lp.HasField("quantization_param")}
    assert q["b"].bw_layer_out == 8 and q["proj"].bw_layer_out == 8
    net.forward()
    b = net.blobs["b"].data                       # after its BatchNorm: signed
    np.testing.assert_allclose(q["b"].scale_out, [127 / np.abs(b).max()], rtol=1e-6)
    int8 = Net(str(out), caffepy.TEST, weights=str(weights))
    units = {int8.layers[first].name: int8.layers[last].name for first, last in int8.fusions.items()}
    assert units["b"] == "b_bn" and units["proj"] == "relu2"


@pytest.mark.parametrize("accuracies, kept", [
    ((0.50, 0.60, 0.505), ["conv3"]),           # a gain beyond the bound: conv2 goes float32
    ((0.50, 0.40, 0.45), ["conv3"]),            # a loss: conv2 goes; the last layer stays
    ((0.50, 0.495), ["conv2", "conv3"]),        # within the bound
])
def test_layers_fall_back_while_the_accuracy_differs_either_way(model, tmp_path, monkeypatch,
                                                                 accuracies, kept):
    path, weights, _ = model
    scores = iter(accuracies)
    monkeypatch.setattr(calibrate, "score", lambda net, iterations, skip:
                        (np.array([next(scores)]), np.zeros(4, np.int64)))
    *_, names = calibrate.calibrate(str(path), str(weights), str(tmp_path / "int8.prototxt"), 1, 1,
                                    accuracy_loss=0.01)
    assert names == kept and next(scores, None) is None


def test_a_chain_of_tops_is_measured_as_the_int8_unit_runs_it(model, tmp_path):
    """conv2's BatchNorm and ReLU each writing a blob of its own (Intel's Inception-v3): the
    unit's output is the ReLU's, as with them in place."""
    path, weights, _ = model
    chained = tmp_path / "chained.prototxt"
    chained.write_text(NET.replace('"bn2" type: "BatchNorm" bottom: "conv2" top: "conv2"',
                                   '"bn2" type: "BatchNorm" bottom: "conv2" top: "conv2_bn"')
                       .replace('"relu2" type: "ReLU" bottom: "conv2" top: "conv2"',
                                '"relu2" type: "ReLU" bottom: "conv2_bn" top: "conv2_relu"')
                       .replace('"pool" type: "Pooling" bottom: "conv2"',
                                '"pool" type: "Pooling" bottom: "conv2_relu"'))
    params = []
    for prototxt in (path, chained):
        out = tmp_path / f"int8_{prototxt.stem}.prototxt"
        calibrate.calibrate(str(prototxt), str(weights), str(out), 2, 2)
        params.append({lp.name: lp.quantization_param for lp in read_net(str(out)).layer
                       if lp.HasField("quantization_param")})
    # (the in-place net's float32 run folds bn2 into conv2: its maxima differ by rounding)
    assert params[0].keys() == params[1].keys() and params[0]["conv2"].bw_layer_out == 8
    for name, q in params[0].items():
        other = params[1][name]
        assert (q.bw_layer_out, q.is_negative_input) == (other.bw_layer_out, other.is_negative_input)
        for field in ("scale_in", "scale_out", "scale_params"):
            np.testing.assert_allclose(getattr(q, field), getattr(other, field), rtol=1e-5)


INCEPTION = """name: "inception"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "a" type: "Convolution" bottom: "conv1" top: "a"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu_a" type: "ReLU" bottom: "a" top: "a" }
layer { name: "b" type: "Convolution" bottom: "conv1" top: "b"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 1.0 } } }
layer { name: "relu_b" type: "ReLU" bottom: "b" top: "b" }
layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" top: "cat" }
layer { name: "c" type: "Convolution" bottom: "cat" top: "c"
  convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu_c" type: "ReLU" bottom: "c" top: "c" }
layer { name: "d" type: "Convolution" bottom: "c" top: "d"
  convolution_param { num_output: 3 kernel_size: 8 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "d" bottom: "label" top: "accuracy" }
"""


@pytest.mark.parametrize("unify", [False, True])
def test_unify_concat_scales_gives_a_concats_inputs_one_scale(tmp_path, unify):
    path, weights, out = tmp_path / "net.prototxt", tmp_path / "net.caffemodel", tmp_path / "int8.prototxt"
    path.write_text(INCEPTION)
    caffepy.set_random_seed(4)
    Net(str(path), caffepy.TEST).save(str(weights))
    calibrate.calibrate(str(path), str(weights), str(out), 1, 1, accuracy_loss=1,
                        unify_concat_scales=unify)
    q = {lp.name: lp.quantization_param for lp in read_net(str(out)).layer
         if lp.HasField("quantization_param")}
    a, b, c = q["a"].scale_out[0], q["b"].scale_out[0], q["c"].scale_in[0]
    if not unify:
        assert a != b and min(a, b) == c          # measured apart: b's values are larger
        return
    assert a == b == c          # the concat's readers measure its largest value: the same scale
    int8 = Net(str(out), caffepy.TEST, weights=str(weights))
    if int8.layer_dict["a"].int8.isa in ("vnni", "amx"):
        assert int8.layer_dict["cat"].byte_concat
