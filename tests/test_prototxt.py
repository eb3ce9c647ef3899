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
