"""prototxt: text and binary I/O, parse errors, atomic writes; reference nets and solvers read back."""
import glob
import os
import stat

import pytest

from caffepy import prototxt as P
from caffepy import upgrade as U
from caffepy.errors import CaffepyError, PrototxtError
from caffepy.proto import caffe_pb2

from paths import REPO
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


# Every prototxt under the reference directories (bvlc, intel) and under the directories of
# CAFFEPY_REFERENCE_MODELS (os.pathsep-separated; e.g. checkouts of BVLC and Intel Caffe, whose
# models/ and examples/ hold 54 and 302 prototxts) must read, and every net must build in
# TRAIN and TEST or be refused in one line naming its file and the layer (a missing LMDB, an
# Intel layer or field caffepy does not run).
CORPUS_DIRS = [os.path.join(REFERENCE, "bvlc"), os.path.join(REFERENCE, "intel")] + \
    [d for d in os.environ.get("CAFFEPY_REFERENCE_MODELS", "").split(os.pathsep) if d]
CORPUS = sorted({os.path.abspath(f) for d in CORPUS_DIRS
                 for f in glob.glob(os.path.join(d, "**", "*.prototxt"), recursive=True)})


def corpus_kind(path):
    name = os.path.basename(path)
    return "solver" if "solver" in name else "labelmap" if "labelmap" in name else "net"


def corpus_id(path):
    for d in CORPUS_DIRS:
        if path.startswith(os.path.abspath(d) + os.sep):
            return os.path.relpath(path, os.path.dirname(os.path.abspath(d)))
    return path


@pytest.mark.skipif(not CORPUS, reason="no reference models")
@pytest.mark.parametrize("path", CORPUS, ids=corpus_id)
def test_reference_prototxt_reads(path):
    kind = corpus_kind(path)
    if kind == "solver":
        assert U.read_solver(path).ListFields()
    elif kind == "labelmap":
        assert P.read_text(caffe_pb2.LabelMap(), path).item
    else:
        assert U.read_net(path).layer


@pytest.mark.skipif(not CORPUS, reason="no reference models")
@pytest.mark.parametrize("phase", [caffe_pb2.TRAIN, caffe_pb2.TEST], ids=["TRAIN", "TEST"])
@pytest.mark.parametrize("path", [p for p in CORPUS if corpus_kind(p) == "net"], ids=corpus_id)
def test_reference_net_builds_or_is_refused_in_one_line(path, phase, monkeypatch):
    import numpy as np
    from caffepy import fillers
    from caffepy.net import Net
    # the weights' values do not matter here: zeros are faster to make than random numbers
    monkeypatch.setattr(fillers, "fill", lambda param, shape: np.zeros(shape, np.float32))
    try:
        Net(path, phase=phase)
    except CaffepyError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(path), message
        assert "layer '" in message, message


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


def test_intel_fields_of_the_38_reference_files_that_did_not_parse():
    """One of each field that kept Intel Caffe's reference prototxts from parsing."""
    net = U.parse_net_text('''
        layer { name: "data" type: "Data" top: "data" transform_param { pad: 3 bgr2rgb: true }
                data_param { source: "x" batch_size: 1 side: 13 } }
        layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
                quantization_param { bw_layer_in: 8 is_negative_input: true force_u8_input: true }
                convolution_param { num_output: 1 kernel_size: 1 fusion_type: SUM_FUSION coeff: 1 } }
        layer { name: "reorg" type: "Reorg" bottom: "conv" top: "reorg" reorg_param { stride: 2 } }
        layer { name: "cat" type: "Concat" bottom: "reorg" top: "cat" concat_param { per_fla_fuse: true } }
        layer { name: "loss" type: "RegionLoss" bottom: "cat" top: "loss" region_loss_param { biases: 1 } }
        layer { name: "eval" type: "EvalDetection" bottom: "cat" top: "eval"
                eval_detection_param { score_type: PROB } }
        layer { name: "pool" type: "Pooling" bottom: "cat" top: "pool" pooling_param { kernel_size_3d: 2 } }
        layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { relu: true } }
        layer { name: "up" type: "Reshape" bottom: "ip" top: "up" reshape_param { pixelshuffler: 2 } }
        compile_net_state { negative_conv_names: "conv" negative_conv_indexes: 1 }''', "intel.prototxt")
    assert net.layer[1].quantization_param.is_negative_input and net.layer[2].reorg_param.stride == 2
    solver = U.parse_solver_text('net: "n" lr_policy: "multifixed" stagelr: 0.1 stageiter: 10 test_offset: 5',
                                 "solver.prototxt")
    assert solver.test_offset == 5 and list(solver.stageiter) == [10]


def _dead_pid():
    import subprocess
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_temporaries_of_killed_writers_are_removed_and_nothing_else(tmp_path):
    import socket
    host, dead = socket.gethostname(), _dead_pid()
    stale = [f".out.prototxt.{dead}@{host}.abcd_123.tmp", f".out.prototxt.{dead}@{host}.zzzzzzzz.tmp"]
    kept = [f".out.prototxt.{os.getpid()}@{host}.abcdefgh.tmp",      # a live writer's
            f".out.prototxt.{dead}@otherhost.example.abcdefgh.tmp",  # another host's
            f".other.prototxt.{dead}@{host}.abcdefgh.tmp",           # another file's
            ".out.prototxt.abcdefgh.tmp",                            # no pid: not ours to judge
            "out.prototxt.tmp", "notes.txt"]
    for name in stale + kept:
        (tmp_path / name).write_text("x")
    (tmp_path / stale[1]).unlink()
    (tmp_path / stale[1]).mkdir()                                    # a directory (an LMDB being built)
    (tmp_path / stale[1] / "data.mdb").write_bytes(bytes(100))
    removed = P.remove_stale_temporaries(str(tmp_path), r"out\.prototxt")
    assert sorted((os.path.basename(p), n) for p, n in removed) == sorted([(stale[0], 1), (stale[1], 100)])
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    P.write_text(caffe_pb2.NetParameter(name="n"), tmp_path / "other.prototxt")   # cleans its own name
    assert sorted(os.listdir(tmp_path)) == sorted(set(kept) - {kept[2]} | {"other.prototxt"})


def test_temporary_names_carry_the_writer(tmp_path, monkeypatch):
    import socket
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        real(src, dst)
    monkeypatch.setattr(os, "replace", spy)
    P.write_text(caffe_pb2.NetParameter(name="n"), tmp_path / "net.prototxt")
    (name,) = seen
    assert name.startswith(f".net.prototxt.{os.getpid()}@{socket.gethostname()}.") and name.endswith(".tmp")


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
