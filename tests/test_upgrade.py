"""upgrade: V0 / V1 nets, data transforms, net inputs, BatchNorm specs, solver_type, the upgrade tools."""
import glob
import os

import pytest

from caffepy import prototxt as P
from caffepy import upgrade as U
from caffepy.errors import PrototxtError
from caffepy.proto import caffe_pb2
from caffepy.solvers.updates import RULES

from paths import REPO
REFERENCE = os.path.join(REPO, "..", "shared", "reference-models")
needs_reference = pytest.mark.skipif(not glob.glob(os.path.join(REFERENCE, "*", "*.prototxt")),
                                     reason="no reference models next to the repository")


@needs_reference
def test_reference_deploy_input_becomes_input_layer():
    net = U.read_net(os.path.join(REFERENCE, "bvlc", "bvlc_alexnet__deploy.prototxt"))
    first = net.layer[0]
    assert first.type == "Input" and list(first.top) == ["data"]
    assert list(first.input_param.shape[0].dim) == [10, 3, 227, 227]


# -- upgrades ----------------------------------------------------------------

V1_NET = """
name: "v1"
layers {
  name: "mnist" type: DATA top: "data" top: "label"
  data_param { source: "db" batch_size: 64 scale: 0.00390625 mean_file: "m.binaryproto" crop_size: 24 }
  include { phase: TRAIN }
}
layers {
  name: "conv1" type: CONVOLUTION bottom: "data" top: "conv1"
  blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  param: "shared_w" param: "shared_b"
  convolution_param { num_output: 20 kernel_size: 5 }
}
layers { name: "relu1" type: RELU bottom: "conv1" top: "conv1" }
layers { name: "loss" type: SOFTMAX_LOSS bottom: "conv1" bottom: "label" top: "loss" loss_weight: 2 }
"""


def test_v1_net_upgrade():
    raw = P.parse_text(caffe_pb2.NetParameter(), V1_NET, "v1.prototxt")
    net, changed = U.upgrade_net(raw, "v1.prototxt")
    assert changed and len(raw.layers) == 4, "the input is left alone"
    assert not len(net.layers)
    assert [l.type for l in net.layer] == ["Data", "Convolution", "ReLU", "SoftmaxWithLoss"]
    conv = net.layer[1]
    assert [(p.name, p.lr_mult, p.decay_mult) for p in conv.param] == [("shared_w", 1, 1), ("shared_b", 2, 0)]
    assert conv.convolution_param.num_output == 20 and list(conv.convolution_param.kernel_size) == [5]
    data = net.layer[0]
    assert data.include[0].phase == caffe_pb2.TRAIN
    assert data.transform_param.scale == pytest.approx(0.00390625)
    assert data.transform_param.mean_file == "m.binaryproto" and data.transform_param.crop_size == 24
    assert not data.data_param.HasField("scale") and not data.data_param.HasField("mean_file")
    assert list(net.layer[3].loss_weight) == [2]
    assert U.upgrade_net(net)[1] is False


def test_v1_upgrade_keeps_blobs():
    raw = P.parse_text(caffe_pb2.NetParameter(), V1_NET, "v1")
    raw.layers[1].blobs.add().data.extend([1.0, 2.0, 3.0])
    net = U.upgrade_net(raw)[0]
    assert list(net.layer[1].blobs[0].data) == [1.0, 2.0, 3.0]


def test_net_with_layer_and_layers_is_refused():
    text = V1_NET + 'layer { name: "x" type: "ReLU" bottom: "conv1" top: "conv1" }'
    with pytest.raises(PrototxtError, match=r"^v1\.prototxt: net has both 'layer' and 'layers'"):
        U.parse_net_text(text, "v1.prototxt")


V0_NET = """
name: "v0"
input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2 blobs_lr: 1 blobs_lr: 2 }
         bottom: "pad1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 2 stride: 2 } bottom: "conv1" top: "pool1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 10 } bottom: "pool1" top: "fc" }
layers { layer { name: "prob" type: "softmax" } bottom: "fc" top: "prob" }
"""


def test_v0_net_upgrade():
    net = U.parse_net_text(V0_NET, "v0.prototxt")
    assert [l.type for l in net.layer] == ["Input", "Convolution", "Pooling", "InnerProduct", "Softmax"]
    conv = net.layer[1]
    assert list(conv.bottom) == ["data"], "the padding layer is folded into the conv"
    cp = conv.convolution_param
    assert (list(cp.pad), list(cp.kernel_size), list(cp.stride), cp.num_output) == ([2], [3], [2], 4)
    assert [p.lr_mult for p in conv.param] == [1, 2]
    assert net.layer[2].pooling_param.pool == caffe_pb2.PoolingParameter.AVE
    assert list(net.layer[0].input_param.shape[0].dim) == [1, 3, 8, 8]


def test_unknown_v0_type_is_an_error():
    with pytest.raises(PrototxtError, match="unknown V0 layer type, got 'convolution'"):
        U.parse_net_text('layers { layer { name: "c" type: "convolution" } }', "v0.prototxt")


def test_input_fields_become_an_input_layer():
    net = U.parse_net_text('input: "a" input_shape { dim: 2 dim: 3 } input: "b" input_shape { dim: 5 }\n'
                           'layer { name: "r" type: "ReLU" bottom: "a" top: "r" }', "in.prototxt")
    assert [l.name for l in net.layer] == ["input", "r"]
    assert list(net.layer[0].top) == ["a", "b"]
    assert [list(s.dim) for s in net.layer[0].input_param.shape] == [[2, 3], [5]]
    assert not len(net.input) and not len(net.input_shape)


def test_input_dim_count_is_checked():
    with pytest.raises(PrototxtError, match=r"^in\.prototxt: input_dim: four are needed per input"):
        U.parse_net_text('input: "a" input_dim: 1 input_dim: 2', "in.prototxt")


def test_input_without_shape_is_dropped():
    net = U.parse_net_text('input: "data" layer { name: "r" type: "ReLU" }', "old.caffemodel")
    assert [l.name for l in net.layer] == ["r"] and not len(net.input)


def test_old_batch_norm_param_specs_get_zero_rates():
    net = U.parse_net_text('layer { name: "bn" type: "BatchNorm" param { lr_mult: 1 name: "m" } '
                           'param { lr_mult: 1 } param { lr_mult: 1 } }', "bn.prototxt")
    assert [(p.name, p.lr_mult, p.decay_mult) for p in net.layer[0].param] == [("m", 0, 0), ("", 0, 0), ("", 0, 0)]


def test_solver_type_upgrade():
    solver = U.parse_solver_text('net: "n.prototxt" solver_type: NESTEROV', "s.prototxt")
    assert solver.type == "Nesterov" and not solver.HasField("solver_type")
    with pytest.raises(PrototxtError, match="solver_type, type: both given"):
        U.parse_solver_text('solver_type: ADAM type: "Adam"', "s.prototxt")


def test_upgrade_files(tmp_path):
    src = tmp_path / "v1.prototxt"
    src.write_text(V1_NET)
    assert U.upgrade_net_file(src, tmp_path / "new.prototxt") is True
    upgraded = P.read_text(caffe_pb2.NetParameter(), tmp_path / "new.prototxt")
    assert len(upgraded.layer) == 4 and not len(upgraded.layers)

    raw = P.parse_text(caffe_pb2.NetParameter(), V1_NET, "v1")
    P.write_binary(raw, tmp_path / "v1.caffemodel")
    U.upgrade_net_file(tmp_path / "v1.caffemodel", tmp_path / "new.caffemodel", binary=True)
    assert P.read_binary(caffe_pb2.NetParameter(), tmp_path / "new.caffemodel") == upgraded

    src = tmp_path / "s.prototxt"
    src.write_text('net: "n" solver_type: ADAGRAD')
    U.upgrade_solver_file(src, tmp_path / "s2.prototxt")
    assert P.read_text(caffe_pb2.SolverParameter(), tmp_path / "s2.prototxt").type == "AdaGrad"


def test_every_solver_type_enum_value_names_a_rule():
    enum = caffe_pb2.SolverParameter.SolverType
    for value in enum.values():
        solver = U.parse_solver_text(f"solver_type: {enum.Name(value)}", "s")
        assert RULES[solver.type].enum == value
    assert sorted(cls.enum for cls in RULES.values()) == sorted(enum.values())
