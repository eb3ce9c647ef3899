"""Intel Caffe's `engine` rule (caffepy/engine.py): which strings name an engine, which of the
places that name one wins, and one-line errors for the rest."""
import pytest
from google.protobuf import text_format

from caffepy import engine
from caffepy.blob import CHANNELS_LAST
from caffepy.errors import CaffepyError, LayerError, PrototxtError
from caffepy.net import TRAIN, Net
from caffepy.proto import caffe_pb2
from caffepy.solvers.nets import solver_test_net_params, solver_train_net_param

NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv1" top: "ip" inner_product_param { num_output: 4 } }
"""


def _param(text=NET, net=None, layer=None):
    param = text_format.Parse(text, caffe_pb2.NetParameter())
    if net is not None:
        param.engine = net
    if layer is not None:
        param.layer[1].engine = layer
    return param


@pytest.mark.parametrize("text, name", [
    ("", ""), ("DEFAULT", ""), ("CAFFE", "CAFFE"), ("caffe", "CAFFE"), (" MKL2017 ", "MKL2017"),
    ("MKLDNN", "MKLDNN"), ("MKLDNN:CPU", "MKLDNN"), ("MKLDNN:CPU,FPGA;DLA", "MKLDNN"),
    ("mkldnn : cpu", "MKLDNN")])
def test_engine_strings_intel_accepts(text, name):
    assert engine.problem(text) is None and engine.name(text) == name


@pytest.mark.parametrize("text, problem", [
    ("BOGUS_ENGINE", "unknown engine"), ("CUDNN", "GPU engine"), ("CAFFE:DLA", "CAFFE takes no subengines"),
    ("MKL2017:CPU", "MKL2017 takes no subengines"), ("MKLDNN:", "no subengine"),
    ("MKLDNN:GPU", "unknown MKLDNN subengine 'GPU'"), (":CPU", "no engine before ':'")])
def test_engine_strings_refused(text, problem):
    assert problem in engine.problem(text)


def test_intel_precedence_param_enum_then_layer_string_then_net():
    lp = caffe_pb2.LayerParameter(name="c", type="Convolution", engine="MKLDNN")
    net = caffe_pb2.NetParameter(engine="CAFFE")
    assert engine.layer_engine(lp, net) == "MKLDNN"                 # the layer's string over the net's
    lp.convolution_param.engine = caffe_pb2.ConvolutionParameter.CAFFE
    assert engine.layer_engine(lp, net) == "CAFFE"                  # the *_param enum over the string
    lp.engine = "CAFFE"
    lp.convolution_param.engine = caffe_pb2.ConvolutionParameter.MKLDNN
    assert engine.layer_engine(lp, caffe_pb2.NetParameter()) == "MKLDNN"
    plain = caffe_pb2.LayerParameter(name="r", type="ReLU")
    assert engine.layer_engine(plain, net) == "CAFFE"               # no engine of its own: the net's
    assert engine.layer_engine(plain, caffe_pb2.NetParameter()) == ""
    # Net::Init: a layer's MKL2017 takes a net's MKLDNN (and the reverse); CAFFE stays
    swap = caffe_pb2.LayerParameter(name="s", type="ReLU", engine="MKL2017")
    assert engine.layer_engine(swap, caffe_pb2.NetParameter(engine="MKLDNN")) == "MKLDNN"
    swap.engine = "CAFFE"
    assert engine.layer_engine(swap, caffe_pb2.NetParameter(engine="MKLDNN")) == "CAFFE"


def test_the_environment_forces_caffe_over_everything(monkeypatch):
    lp = caffe_pb2.LayerParameter(name="c", type="Convolution", engine="MKLDNN")
    lp.convolution_param.engine = caffe_pb2.ConvolutionParameter.MKLDNN
    monkeypatch.setenv("CAFFEPY_ENGINE", "CAFFE")
    assert engine.caffe_engine(lp, caffe_pb2.NetParameter(engine="MKLDNN"))
    monkeypatch.setenv("CAFFEPY_ENGINE", "fast")
    with pytest.raises(CaffepyError, match="CAFFEPY_ENGINE: must be CAFFE or DEFAULT, got 'FAST'"):
        engine.caffe_engine(lp)


def test_a_layers_fast_engine_wins_over_a_caffe_net():
    net = Net(_param(net="CAFFE", layer="MKLDNN:CPU"), phase=TRAIN)
    assert type(net.layers[1]).__name__ == "NHWCConvolution"
    assert net.blobs["conv1"].layout == CHANNELS_LAST
    plain = Net(_param(net="CAFFE"), phase=TRAIN)
    assert type(plain.layers[1]).__name__ == "Convolution" and plain.blobs["conv1"].layout is None


def test_a_solvers_engine_overwrites_its_nets():
    solver = text_format.Parse('engine: "CAFFE" test_iter: 1 test_interval: 1', caffe_pb2.SolverParameter())
    solver.net_param.CopyFrom(_param(net="MKLDNN"))
    assert solver_train_net_param(solver).param.engine == "CAFFE"    # Intel's Solver::InitTrainNet
    assert solver_test_net_params(solver)[0].param.engine == "CAFFE"
    solver.engine = "DEFAULT"                                          # names none: the net's stays
    assert solver_train_net_param(solver).param.engine == "MKLDNN"


def test_unknown_engines_are_one_line_errors_naming_the_place():
    with pytest.raises(LayerError) as e:
        Net(_param(layer="BOGUS_ENGINE"), phase=TRAIN, source="n.prototxt")
    assert str(e.value).startswith("n.prototxt: layer 'conv1' (Convolution): engine: unknown engine, "
                                   "got 'BOGUS_ENGINE'. Accepted: CAFFE")
    with pytest.raises(PrototxtError, match=r"^n.prototxt: engine: unknown engine, got 'MKL'\. Accepted"):
        Net(_param(net="MKL"), phase=TRAIN, source="n.prototxt")
    relu = NET + 'layer { name: "r" type: "ReLU" bottom: "ip" top: "ip" relu_param { engine: CUDNN } }'
    with pytest.raises(LayerError, match=r"layer 'r' \(ReLU\): relu_param.engine: CUDNN is a GPU engine"):
        Net(_param(relu), phase=TRAIN, source="n.prototxt")
    solver = text_format.Parse('engine: "MKLDNN:GPU"', caffe_pb2.SolverParameter())
    solver.net_param.CopyFrom(_param())
    with pytest.raises(PrototxtError, match=r"^s.prototxt: engine: unknown MKLDNN subengine 'GPU'"):
        solver_train_net_param(solver, "s.prototxt")


BLOCKED = """
name: "blocked"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 16 dim: 8 dim: 8 } } }
layer { name: "pack" type: "IntelPack" bottom: "data" top: "packed" }
layer { name: "conv" type: "Convolution" bottom: "packed" top: "conv"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "unpack" type: "IntelUnpack" bottom: "conv" top: "out" }
"""


@pytest.mark.parametrize("net_engine, layer_engine, winograd", [
    ("", "", True), ("CAFFE", "", False), ("", "CAFFE", False), ("CAFFE", "MKLDNN", True)])
def test_blocked_convolution_follows_the_engine_rule(net_engine, layer_engine, winograd):
    """The explicit blocked region's convolution picks its algorithms by the same rule as every
    layer: the net's engine reaches it, and a layer's own engine string wins over the net's."""
    param = text_format.Parse(BLOCKED, caffe_pb2.NetParameter())
    param.engine = net_engine
    param.layer[2].engine = layer_engine
    conv = Net(param, phase=TRAIN).layer_dict["conv"]
    assert conv.winograd is winograd
