"""NetSpec (pycaffe's caffe.net_spec): nets written in Python give the same NetParameter as
the hand-written prototxt text."""
import numpy as np
import pytest
from google.protobuf import text_format

import caffepy as caffe
from caffepy import NetSpec, layers as L, params as P, to_proto
from caffepy.net_spec import assign_proto, param_name_dict
from caffepy.errors import LayerError
from caffepy.proto import caffe_pb2


def parse(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def assert_same(net, text):
    expected = parse(text)
    assert text_format.MessageToString(net) == text_format.MessageToString(expected)
    assert net == expected


def lenet(lmdb, batch_size):
    # the net of Caffe's "learning LeNet" notebook, as pycaffe users write it
    n = NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


LENET_TEXT = """
layer { name: "data" type: "Data" top: "data" top: "label"
  transform_param { scale: 0.00392156886 }
  data_param { source: "mnist_train_lmdb" batch_size: 64 backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 20 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 50 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool2" top: "fc1"
  inner_product_param { num_output: 500 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "score" type: "InnerProduct" bottom: "fc1" top: "score"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss" }
"""


def test_lenet_matches_hand_written_prototxt():
    assert_same(lenet("mnist_train_lmdb", 64), LENET_TEXT)


def test_layer_fields_param_specs_include_and_loss_weight():
    n = NetSpec()
    n.data = L.Input(shape=[dict(dim=[2, 3, 8, 8])])
    n.label = L.Input(shape=dict(dim=[2]), include=dict(phase=caffe.TRAIN))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3, pad=1, group=1,
                           param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)],
                           bias_filler=dict(type="constant", value=0.1))
    n.loss = L.SoftmaxWithLoss(n.conv, n.label, loss_weight=0.5, propagate_down=[True, False],
                               loss_param=dict(ignore_label=-1, normalization=P.Loss.VALID),
                               exclude=[dict(phase=caffe.TEST), dict(stage="deploy")])
    assert_same(n.to_proto(), """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "label" type: "Input" top: "label" include { phase: TRAIN }
  input_param { shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 4 pad: 1 kernel_size: 3 group: 1
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "conv" bottom: "label" top: "loss"
  loss_weight: 0.5 propagate_down: true propagate_down: false
  exclude { phase: TEST } exclude { stage: "deploy" }
  loss_param { ignore_label: -1 normalization: VALID } }
""")


def test_unnamed_tops_are_auto_named_by_type_and_in_place_keeps_names():
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 2]))
    ip = L.InnerProduct(n.data, num_output=3)
    n.out = L.ReLU(L.ReLU(ip, in_place=True), negative_slope=0.1)
    n.other = L.InnerProduct(L.InnerProduct(n.data, num_output=2), num_output=1)
    assert_same(n.to_proto(), """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }
layer { name: "InnerProduct1" type: "InnerProduct" bottom: "data" top: "InnerProduct1"
  inner_product_param { num_output: 3 } }
layer { name: "ReLU1" type: "ReLU" bottom: "InnerProduct1" top: "InnerProduct1" }
layer { name: "out" type: "ReLU" bottom: "InnerProduct1" top: "out" relu_param { negative_slope: 0.1 } }
layer { name: "InnerProduct2" type: "InnerProduct" bottom: "data" top: "InnerProduct2"
  inner_product_param { num_output: 2 } }
layer { name: "other" type: "InnerProduct" bottom: "InnerProduct2" top: "other"
  inner_product_param { num_output: 1 } }
""")


def test_module_to_proto_ntop_zero_enum_names_and_shared_param_messages():
    data, label = L.DummyData(shape=[dict(dim=[2, 3, 4, 4]), dict(dim=[2])],
                              data_filler=dict(type="gaussian"), ntop=2)
    pool = L.Pooling(data, pool="AVE", global_pooling=True)
    up = L.Deconvolution(pool, num_output=3, kernel_size=2, stride=2)
    silence = L.Silence(label, ntop=0)
    assert silence.ntop == 0 and silence.tops == ()
    net = to_proto(up, silence)
    assert_same(net, """
layer { name: "DummyData1" type: "DummyData" top: "DummyData1" top: "DummyData2"
  dummy_data_param { data_filler { type: "gaussian" } shape { dim: 2 dim: 3 dim: 4 dim: 4 }
                     shape { dim: 2 } } }
layer { name: "Pooling1" type: "Pooling" bottom: "DummyData1" top: "Pooling1"
  pooling_param { pool: AVE global_pooling: true } }
layer { name: "Deconvolution1" type: "Deconvolution" bottom: "Pooling1" top: "Deconvolution1"
  convolution_param { num_output: 3 kernel_size: 2 stride: 2 } }
layer { name: "Silence1" type: "Silence" bottom: "DummyData2" }
""")
    assert up.to_proto() == to_proto(up)


def test_python_layer_and_explicit_param_messages():
    n = NetSpec()
    n.data = L.Input(input_param=dict(shape=dict(dim=[1, 4])))
    n["double"] = L.Python(n.data, module="my_layers", layer="Double", param_str="{'k': 2}")
    assert n["double"] is n.double and n.keys() == ["data", "double"]
    assert_same(n.to_proto(), """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 4 } } }
layer { name: "double" type: "Python" bottom: "data" top: "double"
  python_param { module: "my_layers" layer: "Double" param_str: "{\\'k\\': 2}" } }
""")


def test_params_enums():
    assert P.Pooling.MAX == caffe_pb2.PoolingParameter.MAX
    assert P.Data.LMDB == caffe_pb2.DataParameter.LMDB
    assert P.Eltwise.SUM == caffe_pb2.EltwiseParameter.SUM
    with pytest.raises(AttributeError, match="no enum value 'MUX'"):
        P.Pooling.MUX
    with pytest.raises(AttributeError, match="NoSuchParameter"):
        P.NoSuch


@pytest.mark.parametrize("kwargs, message", [
    (dict(kernel_sze=3), "^NetSpec: layer 'bad' \\(Pooling\\): kernel_sze: no such field in pooling_param or "
                         "LayerParameter, got 3"),
    (dict(pool="MUX"), "pooling_param.pool: unknown enum value, got 'MUX'. Known values: MAX, AVE"),
    (dict(kernel_size="a"), "pooling_param.kernel_size: cannot take this value"),
    (dict(include=dict(phase=caffe.TEST, stag="x")), "include\\[0\\].stag: no such field in NetStateRule"),
    (dict(param=[3]), "param\\[0\\]: needs a dict of ParamSpec fields, got 3"),
])
def test_mistakes_name_the_layer_and_the_field(kwargs, message):
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 4, 4]))
    n.bad = L.Pooling(n.data, **kwargs)
    with pytest.raises(LayerError, match=message):
        n.to_proto()


def test_bottom_must_be_a_top():
    with pytest.raises(LayerError) as info:
        L.ReLU("data")
    assert str(info.value) == "ReLU input 0 is not a Top (type is <class 'str'>)"
    # a TypeError in pycaffe's exact words; the hint is a note under them
    with pytest.raises(TypeError) as info:
        L.Silence(L.DummyData(ntop=2), ntop=0)
    assert str(info.value) == "Silence input 0 is not a Top (type is <class 'tuple'>)"
    assert info.value.__notes__[0].endswith("a layer with ntop > 1 returns a tuple of tops: pick one with [i]")


@pytest.mark.parametrize("kwargs", [dict(kernel_size="a"), dict(param=[3]), dict(include=dict(phase=[1, 2]))])
def test_a_value_of_the_wrong_type_is_a_type_error(kwargs):
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 4, 4]))
    n.bad = L.Pooling(n.data, **kwargs)
    with pytest.raises(TypeError, match="^NetSpec: layer 'bad' \\(Pooling\\): "):
        n.to_proto()
    with pytest.raises(TypeError):
        assign_proto(caffe_pb2.LayerParameter(), "convolution_param", dict(num_output="many"))
    with pytest.raises(AttributeError, match="no top 'nothing'"):
        NetSpec().nothing


def test_layers_object_still_reaches_the_layers_subpackage():
    from caffepy.layers import common
    assert caffe.layers.common is common


def test_net_spec_output_builds_and_runs():
    n = NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[4, 1, 12, 12]), dict(dim=[4])],
                                  data_filler=[dict(type="gaussian", std=1), dict(type="constant")],
                                  ntop=2)
    n.conv = L.Convolution(n.data, num_output=3, kernel_size=3, weight_filler=dict(type="xavier"))
    n.relu = L.ReLU(n.conv, in_place=True)
    n.pool = L.Pooling(n.relu, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.score = L.InnerProduct(n.pool, num_output=5, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    net = caffe.Net(n.to_proto(), caffe.TRAIN)
    loss = net.forward_backward()
    assert list(net.blobs) == ["data", "label", "conv", "pool", "score", "loss"]
    assert net.blobs["pool"].data.shape == (4, 3, 5, 5)
    assert np.isfinite(loss) and loss > 0
    assert np.abs(net.params["conv"][0].diff).sum() > 0


def test_pycaffe_helpers_param_name_dict_and_assign_proto():
    names = param_name_dict()
    assert names["Convolution"] == "convolution" and names["InnerProduct"] == "inner_product"
    assert names["LRN"] == "lrn" and names["BatchNorm"] == "batch_norm" and names["Data"] == "data"
    layer = caffe_pb2.LayerParameter()
    assign_proto(layer, "convolution_param", dict(kernel_size=[3, 5], weight_filler=dict(type="msra")))
    assign_proto(layer, "top", "out")
    assert list(layer.convolution_param.kernel_size) == [3, 5] and list(layer.top) == ["out"]
    assert layer.convolution_param.weight_filler.type == "msra"


def test_name_keyword_renames_the_layer_but_not_its_top():
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3]))
    n["loss1/loss1"] = L.Softmax(n.data, name="loss1/loss", engine=P.Softmax.CAFFE)
    layer = n.to_proto().layer[1]
    assert (layer.name, list(layer.top)) == ("loss1/loss", ["loss1/loss1"])
    # `engine` exists in both messages: the type's own parameter message takes it, as in pycaffe
    assert layer.softmax_param.engine == caffe_pb2.SoftmaxParameter.CAFFE and not layer.HasField("engine")
