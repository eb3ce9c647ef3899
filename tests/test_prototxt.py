"""prototxt: text and binary I/O, parse errors, atomic writes; reference nets and solvers read back."""
import glob
import os
import stat

import pytest

from caffepy import prototxt as P
from caffepy import upgrade as U
from caffepy.errors import CaffepyError, PrototxtError
from caffepy.proto import caffe_pb2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(REPO, "..", "shared", "reference-models")
NETS = sorted(p for p in glob.glob(os.path.join(REFERENCE, "*", "*.prototxt")) if "solver" not in p)
SOLVERS = sorted(p for p in glob.glob(os.path.join(REFERENCE, "*", "*.prototxt")) if "solver" in p)
needs_reference = pytest.mark.skipif(not NETS, reason="no reference models next to the repository")


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- reference models --------------------------------------------------------

@needs_reference
@pytest.mark.parametrize("path", NETS, ids=os.path.basename)
def test_reference_net_round_trips(path, tmp_path):
    net = U.read_net(path)
    assert len(net.layer) > 0 and not len(net.layers) and not len(net.input)
    assert U.upgrade_net(net, path) == (net, False)
    P.write_binary(net, tmp_path / "net.binaryproto")
    back = U.read_binary_net(tmp_path / "net.binaryproto")
    P.write_text(back, tmp_path / "net.prototxt")
    assert U.read_net(tmp_path / "net.prototxt") == net


@needs_reference
@pytest.mark.parametrize("path", SOLVERS, ids=os.path.basename)
def test_reference_solver_round_trips(path, tmp_path):
    solver = U.read_solver(path)
    assert solver.HasField("net") and not solver.HasField("solver_type")
    P.write_text(solver, tmp_path / "solver.prototxt")
    assert U.read_solver(tmp_path / "solver.prototxt") == solver


@needs_reference
def test_reference_intel_fields():
    solver = U.read_solver(os.path.join(REFERENCE, "intel", "multinode__alexnet_bn_64nodes__solver.prototxt"))
    assert solver.warmup_iter == 400 and solver.local_lr_auto and solver.base_lr == 32
    net = U.read_net(os.path.join(REFERENCE, "intel", "multinode__alexnet_4nodes__train_val.prototxt"))
    assert net.layer[0].data_param.shuffle


# -- errors ------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ('name: "n"\nlayer {\n  name: "c"\n  convolution_parm { num_output: 3 }\n}',
     "net.prototxt:4:3: unknown field 'convolution_parm' in LayerParameter; did you mean 'convolution_param'?"),
    ('layer {\n  pooling_param { pool: MAXX }\n}',
     "net.prototxt:2:25: unknown value 'MAXX' for pool (PoolingParameter.PoolMethod); "
     "known values: MAX, AVE, STOCHASTIC"),
    ('layer {\n  name: "a"\n', "net.prototxt:2:9: unexpected end of file: a '{' is not closed"),
    ('layer { name: "a" } }', "net.prototxt:1:21: expected a field name, got '}'"),
    ('layer { convolution_param { num_output: many } }', "net.prototxt:1:41: num_output: not an integer, got many"),
    ('layer { pooling_param { kernel_size: 3 kernel_size: 3 } }',
     "net.prototxt:1:53: field 'kernel_size' given more than once in PoolingParameter, which takes one value"),
    ('layer { clip_param { min: 0 } }', "net.prototxt: required field missing: layer[0].clip_param.max"),
])
def test_parse_errors_are_one_line_with_position(tmp_path, text, expected):
    path = write(tmp_path, "net.prototxt", text)
    with pytest.raises(PrototxtError) as info:
        U.read_net(path)
    message = str(info.value)
    assert "\n" not in message
    assert message == f"{tmp_path}/{expected}"


def test_missing_file_names_the_path():
    with pytest.raises(PrototxtError, match=r"^/no/such/lenet\.prototxt: cannot open: No such file"):
        U.read_net("/no/such/lenet.prototxt")


def test_binary_parse_failure_names_the_file(tmp_path):
    path = write(tmp_path, "lenet.caffemodel", 'name: "LeNet"\nlayer { name: "x" }\n')
    with pytest.raises(PrototxtError, match=r"lenet\.caffemodel: not a binary NetParameter .*text prototxt"):
        U.read_binary_net(path)


def test_not_utf8(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_bytes(b'name: "a"\nname2: "\xff"\n')
    with pytest.raises(PrototxtError, match=r"bad\.prototxt:2: not UTF-8"):
        U.read_net(path)


# -- writing -----------------------------------------------------------------

def test_writes_are_atomic_and_leave_no_temporaries(tmp_path):
    net = caffe_pb2.NetParameter(name="n")
    target = tmp_path / "out.prototxt"
    target.write_text("old")
    P.write_text(net, target)
    assert target.read_text() == 'name: "n"\n'
    assert os.listdir(tmp_path) == ["out.prototxt"]
    mode = stat.S_IMODE(os.stat(target).st_mode)
    assert mode & 0o044, "readable like any file the user creates, not mkstemp's 0600"


def test_write_into_missing_directory_is_a_clean_error(tmp_path):
    with pytest.raises(CaffepyError, match="cannot write"):
        P.write_binary(caffe_pb2.NetParameter(), tmp_path / "no" / "net.caffemodel")


# -- text as Caffe writes it -------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (1.0, "1"), (0.0, "0"), (2.0, "2"), (-0.5, "-0.5"), (0.01, "0.01"), (1e-05, "1e-05"),
    (1e8, "1e+08"), (0.123456789, "0.123456791"), (3.4028235e38, "3.40282347e+38"),
    (float("inf"), "inf"), (float("-inf"), "-inf"), (float("nan"), "nan")])
def test_floats_print_as_cpp_protobuf_prints_them(value, text):
    # C++ SimpleFtoa: %.6g, or %.9g when that does not read back as the same float
    assert P.format_float(value) == text


def test_doubles_print_with_15_or_17_digits():
    assert P.format_float(0.1, double=True) == "0.1"
    assert P.format_float(0.1 + 0.2, double=True) == "0.30000000000000004"


# What BVLC's upgrade_net_proto_text wrote for V1 (run on the real binary; byte for byte)
V1_NET = r'''name: "a\"b\\c\td é"
layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv" blobs_lr: 1 blobs_lr: 2
  weight_decay: 1 weight_decay: 0
  convolution_param { num_output: 2 kernel_size: 3 bias_filler { type: "constant" value: 0.123456789 } } }
layers { name: "s" type: POWER bottom: "conv" top: "s" power_param { power: 2 scale: 100000000 shift: -0.5 } }
input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
'''
CAFFE_UPGRADED = r'''name: "a\"b\\c\td \303\251"
layer {
  name: "input"
  type: "Input"
  top: "data"
  input_param {
    shape {
      dim: 1
      dim: 3
      dim: 8
      dim: 8
    }
  }
}
layer {
  name: "conv"
  type: "Convolution"
  bottom: "data"
  top: "conv"
  param {
    lr_mult: 1
    decay_mult: 1
  }
  param {
    lr_mult: 2
    decay_mult: 0
  }
  convolution_param {
    num_output: 2
    kernel_size: 3
    bias_filler {
      type: "constant"
      value: 0.123456791
    }
  }
}
layer {
  name: "s"
  type: "Power"
  bottom: "conv"
  top: "s"
  power_param {
    power: 2
    scale: 1e+08
    shift: -0.5
  }
}
'''


def test_upgraded_text_is_byte_for_byte_caffes(tmp_path):
    src = write(tmp_path, "v1.prototxt", V1_NET)
    U.upgrade_net_file(src, tmp_path / "out.prototxt")
    assert (tmp_path / "out.prototxt").read_bytes() == CAFFE_UPGRADED.encode()
