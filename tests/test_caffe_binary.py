"""caffepy beside a real BVLC Caffe build: the same nets and solvers through both, files
compared byte for byte (or field by field where caffepy adds its own), weights exchanged
both ways (binary and HDF5), learning rates bit for bit, log numbers.

Skipped unless CAFFE_BIN names Caffe's `caffe` binary (a CPU build with HDF5, e.g.
CAFFE_BIN=/path/to/caffe/build/tools/caffe).  Caffe's other tools (convert_imageset,
upgrade_net_proto_text) are used when they sit next to it, as in a Caffe build tree.
"""
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from caffepy.blobproto import array_to_blobproto
from caffepy.proto import caffe_pb2
from data_helpers import data_net_text, db_records, make_db

CAFFE_BIN = os.environ.get("CAFFE_BIN", "")
pytestmark = pytest.mark.skipif(not (CAFFE_BIN and os.access(CAFFE_BIN, os.X_OK)),
                                reason="set CAFFE_BIN to a BVLC caffe binary to compare with it")
h5py = pytest.importorskip("h5py")


def caffe_tool(name):
    path = os.path.join(os.path.dirname(CAFFE_BIN), name)
    if not os.access(path, os.X_OK):
        pytest.skip(f"no {name} next to CAFFE_BIN")
    return path


def run(argv, cwd):
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{argv[0]} {argv[1]}: {result.stderr[-3000:]}"
    return result.stderr


def caffe(*args, cwd):
    return run([CAFFE_BIN, *args], cwd)


def caffepy(*args, cwd):
    return run([shutil.which("caffepy") or "caffepy", *args], cwd)


def messages(log):
    """The message of each glog line (after `] `)."""
    return [line.split("] ", 1)[1] for line in log.splitlines() if re.match(r"^[IWEF]\d", line) and "] " in line]


# Constant fillers: both programs start from the same weights
NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 5 dim: 5 } shape { dim: 4 }
    data_filler { type: "constant" value: 0.5 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "constant" value: 0.1 }
    bias_filler { type: "constant" value: 0.2 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "constant" value: 0.01 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
"""

SOLVER = """net: "net.prototxt"
base_lr: 0.01 lr_policy: "step" gamma: 0.1 stepsize: 3 momentum: 0.9 weight_decay: 0.0005
display: 1 snapshot_prefix: "snap" max_iter: {max_iter} snapshot_format: {format}
"""


def workdir(root, name, max_iter, format_="BINARYPROTO"):
    d = root / name
    d.mkdir()
    (d / "net.prototxt").write_text(NET)
    (d / "solver.prototxt").write_text(SOLVER.format(max_iter=max_iter, format=format_))
    return d


def h5_weights(path):
    with h5py.File(path, "r") as f:
        return {f"{layer}/{i}": f["data"][layer][i][()] for layer in f["data"] for i in f["data"][layer]}


def test_snapshot_files_are_caffes(tmp_path):
    c, o = workdir(tmp_path, "c", 0), workdir(tmp_path, "o", 0)
    caffe("train", "--solver", "solver.prototxt", cwd=c)
    caffepy("train", "--solver", "solver.prototxt", cwd=o)
    # every layer (Split layers too) with its phase and the loss layer's loss_weight: same bytes
    assert (o / "snap_iter_0.caffemodel").read_bytes() == (c / "snap_iter_0.caffemodel").read_bytes()
    # the solver state: Caffe's fields, then Intel's plateau fields and our generator state
    assert (o / "snap_iter_0.solverstate").read_bytes().startswith((c / "snap_iter_0.solverstate").read_bytes())


def test_training_matches_and_hdf5_snapshots_cross_over(tmp_path):
    c, o = workdir(tmp_path, "c", 2, "HDF5"), workdir(tmp_path, "o", 2, "HDF5")
    caffe("train", "--solver", "solver.prototxt", cwd=c)
    caffepy("train", "--solver", "solver.prototxt", cwd=o)
    want, got = h5_weights(c / "snap_iter_2.caffemodel.h5"), h5_weights(o / "snap_iter_2.caffemodel.h5")
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-9, err_msg=key)
    # each resumes the other's .solverstate.h5 (and the .caffemodel.h5 it names) to iteration 4
    for d in (c, o):
        (d / "solver.prototxt").write_text(SOLVER.format(max_iter=4, format="HDF5"))
    caffe("train", "--solver", "solver.prototxt", "--snapshot", "snap_iter_2.solverstate.h5", cwd=o)
    caffepy("train", "--solver", "solver.prototxt", "--snapshot", "snap_iter_2.solverstate.h5", cwd=c)
    want, got = h5_weights(o / "snap_iter_4.caffemodel.h5"), h5_weights(c / "snap_iter_4.caffemodel.h5")
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-9, err_msg=key)


def test_weights_in_either_format_load_in_the_other_program(tmp_path):
    c, o = workdir(tmp_path, "c", 2, "HDF5"), workdir(tmp_path, "o", 2)
    caffe("train", "--solver", "solver.prototxt", cwd=c)
    caffepy("train", "--solver", "solver.prototxt", cwd=o)
    shutil.copy(c / "snap_iter_2.caffemodel.h5", o / "caffe.caffemodel.h5")
    shutil.copy(o / "snap_iter_2.caffemodel", c / "ours.caffemodel")
    caffepy("train", "--solver", "solver.prototxt", "--weights", "caffe.caffemodel.h5", cwd=o)
    ours = caffepy("test", "--model", "net.prototxt", "--weights", "caffe.caffemodel.h5", "--iterations", "1", cwd=o)
    theirs = caffe("test", "--model", "net.prototxt", "--weights", "ours.caffemodel", "--iterations", "1", cwd=c)
    assert messages(ours)[-2:] == messages(theirs)[-2:]      # acc = 1, loss = ... (* 1 = ... loss)


def caffe_rate(tmp_path, solver_text, it):
    """The rate Caffe used at iteration `it`: one SGD step on a bias whose gradient is 1."""
    d = tmp_path / f"rate_{abs(hash((solver_text, it)))}"
    d.mkdir()
    (d / "net.prototxt").write_text("""
name: "rate"
layer { name: "data" type: "DummyData" top: "data" top: "target"
  dummy_data_param { shape { dim: 1 dim: 1 } shape { dim: 1 dim: 1 }
    data_filler { type: "constant" value: 0 } data_filler { type: "constant" value: -1 } } }
layer { name: "bias" type: "Bias" bottom: "data" top: "out" }
layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "target" top: "loss" }
""")
    weights = caffe_pb2.NetParameter(name="rate")
    layer = weights.layer.add(name="bias", type="Bias")
    layer.blobs.append(array_to_blobproto(np.zeros(1, np.float32)))
    (d / "w.caffemodel").write_bytes(weights.SerializeToString())
    state = caffe_pb2.SolverState(iter=it, learned_net="w.caffemodel")
    state.history.append(array_to_blobproto(np.zeros(1, np.float32)))
    (d / "s.solverstate").write_bytes(state.SerializeToString())
    (d / "solver.prototxt").write_text(f'{solver_text}\nnet: "net.prototxt" max_iter: {it + 1} '
                                       f'snapshot_prefix: "out" display: 0')
    caffe("train", "--solver", "solver.prototxt", "--snapshot", "s.solverstate", cwd=d)
    out = caffe_pb2.NetParameter()
    out.ParseFromString((d / f"out_iter_{it + 1}.caffemodel").read_bytes())
    return -np.float32(next(lp for lp in out.layer if lp.name == "bias").blobs[0].data[0])


@pytest.mark.parametrize("text, it", [
    ('base_lr: 0.01 lr_policy: "step" gamma: 0.1 stepsize: 1', 7),
    ('base_lr: 0.01 lr_policy: "exp" gamma: 0.9999', 15),
    ('base_lr: 0.01 lr_policy: "inv" gamma: 0.0001 power: 0.75', 43),
    ('base_lr: 0.01 lr_policy: "poly" power: 0.5', 350),
    ('base_lr: 0.01 lr_policy: "sigmoid" gamma: 0.001 stepsize: 2000', 1),
    ('base_lr: 0.01 lr_policy: "sigmoid" gamma: 0.001 stepsize: 2000', 3333),
])
def test_learning_rates_are_caffes_bit_for_bit(tmp_path, text, it):
    from google.protobuf import text_format
    from caffepy.solvers import lr_policy
    param = text_format.Parse(text, caffe_pb2.SolverParameter())
    param.max_iter = it + 1
    assert np.float32(lr_policy.learning_rate(param, it, 0)[0]) == caffe_rate(tmp_path, text, it)


FLOAT_SUMS = """
name: "sums"
layer { name: "data" type: "DummyData" top: "score" top: "a" top: "b"
  dummy_data_param { shape { dim: 1 } data_filler { type: "constant" value: 0.9 }
    data_filler { type: "constant" value: 0 } data_filler { type: "constant" value: 0 } } }
layer { name: "p" type: "Power" bottom: "score" top: "out" }
layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" }
"""


def test_training_log_lines_are_caffes(tmp_path):
    logs = {}
    for name, program in (("c", caffe), ("o", caffepy)):
        d = tmp_path / name
        d.mkdir()
        (d / "net.prototxt").write_text(FLOAT_SUMS)
        (d / "solver.prototxt").write_text('net: "net.prototxt" test_iter: 100 test_interval: 2 base_lr: 0.01 '
                                           'lr_policy: "fixed" max_iter: 4 display: 2 snapshot_after_train: false')
        logs[name] = [m for m in messages(program("train", "--solver", "solver.prototxt", cwd=d))
                      if m.startswith(("Iteration", "    T", "Test", "Optimization"))]
    # the timings differ; their shape and every other number agree
    def mask(lines):
        return [re.sub(r"\(\S+ iter/s, \S+s/", "(N iter/s, Ns/", line) for line in lines]
    assert mask(logs["o"]) == mask(logs["c"])
    assert "    Test net output #1: out = 0.900001" in logs["c"]


def test_upgraded_text_is_caffes(tmp_path):
    """Every net under models/ that BVLC can read (Intel's fields it cannot), and a V1 net."""
    from test_prototxt import V1_NET
    tool = caffe_tool("upgrade_net_proto_text")
    (tmp_path / "v1.prototxt").write_text(V1_NET)
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
    paths = [str(tmp_path / "v1.prototxt")] + sorted(
        os.path.join(d, f) for d, _, files in os.walk(root) for f in files
        if f.endswith(".prototxt") and "solver" not in f)
    compared = 0
    for path in paths:
        theirs = subprocess.run([tool, path, str(tmp_path / "c.prototxt")], capture_output=True)
        if theirs.returncode != 0:
            continue
        caffepy("upgrade_net_proto_text", path, str(tmp_path / "o.prototxt"), cwd=tmp_path)
        assert (tmp_path / "o.prototxt").read_bytes() == (tmp_path / "c.prototxt").read_bytes(), path
        compared += 1
    assert compared >= 5


def test_convert_imageset_records_are_caffes(tmp_path):
    import cv2
    tool = caffe_tool("convert_imageset")
    (tmp_path / "img").mkdir()
    gen = np.random.default_rng(0)
    for i in range(4):
        cv2.imwrite(str(tmp_path / "img" / f"{i}.png"), gen.integers(0, 256, (5, 7, 3), dtype=np.uint8))
    (tmp_path / "list.txt").write_text("".join(f"{i}.png {i % 2}\n" for i in range(4)))
    for flags in ([], ["--gray", "--resize_height", "4", "--resize_width", "3"], ["--encoded", "--encode_type", "png"]):
        for name, program in (("c", lambda *a: run([tool, *a], tmp_path)), ("o", lambda *a: caffepy(
                "convert_imageset", *a, cwd=tmp_path))):
            shutil.rmtree(tmp_path / name, ignore_errors=True)
            program(*flags, "img/", "list.txt", name)
        assert db_records(tmp_path / "c") == db_records(tmp_path / "o"), flags


def test_convert_mnist_data_records_are_caffes(tmp_path):
    """Caffe's examples/mnist/convert_mnist_data (built beside tools/ as examples/mnist/)."""
    tool = os.path.join(os.path.dirname(os.path.dirname(CAFFE_BIN)), "examples", "mnist", "convert_mnist_data")
    if not os.access(tool, os.X_OK):
        pytest.skip("no examples/mnist/convert_mnist_data beside CAFFE_BIN's tools/")
    gen = np.random.default_rng(2)
    n = 1500                                     # past one 1000-item transaction
    (tmp_path / "img").write_bytes(np.array([2051, n, 28, 28], ">u4").tobytes()
                                   + gen.integers(0, 256, (n, 28, 28), dtype=np.uint8).tobytes())
    (tmp_path / "lab").write_bytes(np.array([2049, n], ">u4").tobytes()
                                   + gen.integers(0, 10, n, dtype=np.uint8).tobytes())
    run([tool, "img", "lab", "c"], tmp_path)
    caffepy("convert_mnist_data", "img", "lab", "o", cwd=tmp_path)
    theirs = db_records(tmp_path / "c")
    assert len(theirs) == n and theirs == db_records(tmp_path / "o")


def test_leveldbs_cross_over(tmp_path, monkeypatch):
    """Caffe's convert_mnist_data --backend=leveldb writes the records caffepy's writes; Caffe's
    extract_features, reading caffepy's LevelDB through a Data layer, gets what caffepy gets."""
    tool = os.path.join(os.path.dirname(os.path.dirname(CAFFE_BIN)), "examples", "mnist", "convert_mnist_data")
    if not os.access(tool, os.X_OK):
        pytest.skip("no examples/mnist/convert_mnist_data beside CAFFE_BIN's tools/")
    gen = np.random.default_rng(3)
    n = 1200                                     # past one 1000-item write batch
    (tmp_path / "img").write_bytes(np.array([2051, n, 6, 6], ">u4").tobytes()
                                   + gen.integers(0, 256, (n, 6, 6), dtype=np.uint8).tobytes())
    (tmp_path / "lab").write_bytes(np.array([2049, n], ">u4").tobytes()
                                   + gen.integers(0, 10, n, dtype=np.uint8).tobytes())
    run([tool, "img", "lab", "c", "--backend=leveldb"], tmp_path)
    caffepy("convert_mnist_data", "img", "lab", "o", "--backend", "leveldb", cwd=tmp_path)
    assert os.path.exists(tmp_path / "c" / "CURRENT") and os.path.exists(tmp_path / "o" / "CURRENT")
    theirs = db_records(tmp_path / "c")
    assert len(theirs) == n and theirs == db_records(tmp_path / "o")
    (tmp_path / "net.prototxt").write_text('name: "f"\n' + data_net_text("o", 50, backend="LEVELDB"))
    import caffepy as cp
    monkeypatch.chdir(tmp_path)
    net = cp.Net("net.prototxt", cp.TEST)
    net.save("w.caffemodel")
    net.layers[0].close()                   # LevelDB admits one process at a time
    args = ["w.caffemodel", "net.prototxt", "data,label"]
    run([caffe_tool("extract_features"), *args, "c_data,c_label", "3", "lmdb"], tmp_path)
    caffepy("extract_features", *args, "o_data,o_label", "3", "lmdb", cwd=tmp_path)
    for blob in ("data", "label"):
        ours = db_records(tmp_path / f"o_{blob}")
        assert len(ours) == 150 and db_records(tmp_path / f"c_{blob}") == ours, blob


def test_extract_features_records_are_caffes(tmp_path, monkeypatch):
    """The same keys, Datum headers and float_data; the bytes too where the arithmetic is the
    same (InnerProduct, the labels), to float rounding where the algorithm differs (a 3x3
    convolution)."""
    tool = caffe_tool("extract_features")
    gen = np.random.default_rng(0)
    make_db(tmp_path / "db", 7, shape=(3, 4, 5),
            values=[gen.integers(0, 256, (3, 4, 5), dtype=np.uint8) for _ in range(7)])
    (tmp_path / "net.prototxt").write_text(
        'name: "f"\n' + data_net_text("db", 3, transform="scale: 0.00390625")
        + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param {'
          ' num_output: 10 weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.5 } } }'
          'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param {'
          ' num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }'
          'layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }\n')
    import caffepy as cp
    monkeypatch.chdir(tmp_path)             # the Data layer's source is relative
    cp.Net("net.prototxt", cp.TEST).save("w.caffemodel")
    args = ["w.caffemodel", "net.prototxt", "ip,conv,label"]
    run([tool, *args, "c_ip,c_conv,c_label", "4", "lmdb"], tmp_path)
    caffepy("extract_features", *args, "o_ip,o_conv,o_label", "4", "lmdb", cwd=tmp_path)
    for blob in ("ip", "conv", "label"):
        theirs, ours = db_records(tmp_path / f"c_{blob}"), db_records(tmp_path / f"o_{blob}")
        assert [k for k, _ in theirs] == [k for k, _ in ours] == [f"{i:010d}" for i in range(12)]
        if blob != "conv":
            assert theirs == ours, blob
            continue
        for (_, a), (_, b) in zip(theirs, ours):
            a, b = caffe_pb2.Datum.FromString(a), caffe_pb2.Datum.FromString(b)
            assert (a.channels, a.height, a.width) == (b.channels, b.height, b.width) == (4, 4, 5)
            np.testing.assert_allclose(b.float_data, a.float_data, rtol=1e-5, atol=1e-6)


def test_hdf5_layers_read_and_write_as_caffes(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.arange(6.0).reshape(3, 2) / 7
        f["label"] = np.array([0, 1, 2], np.int32)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["data"] = (100 + np.arange(4.0)).reshape(2, 2)
        f["label"] = np.array([3, 4], np.int32)
    (tmp_path / "list.txt").write_text("a.h5\nb.h5\n")
    (tmp_path / "w.caffemodel").write_bytes(b"\x0a\x01h")
    net = """name: "h"
layer { name: "in" type: "HDF5Data" top: "data" top: "label" hdf5_data_param { source: "list.txt" batch_size: 4 } }
layer { name: "out" type: "HDF5Output" bottom: "data" bottom: "label" hdf5_output_param { file_name: "OUT.h5" } }
layer { name: "p" type: "Power" bottom: "data" top: "d" }
layer { name: "q" type: "Power" bottom: "label" top: "l" }
"""
    outputs = {}
    for name, program in (("c", caffe), ("o", caffepy)):
        (tmp_path / f"{name}.prototxt").write_text(net.replace("OUT", f"{name}_out"))
        log = program("test", "--model", f"{name}.prototxt", "--weights", "w.caffemodel", "--iterations", "1",
                      cwd=tmp_path)
        outputs[name] = [m for m in messages(log) if m.startswith("Batch 0")]
    assert outputs["o"] == outputs["c"]         # the rows, across both files, in Caffe's order
    with h5py.File(tmp_path / "c_out.h5", "r") as theirs, h5py.File(tmp_path / "o_out.h5", "r") as ours:
        for key in ("data", "label"):
            assert (ours[key].dtype, ours[key].shape, ours[key].chunks) == \
                (theirs[key].dtype, theirs[key].shape, theirs[key].chunks)
            np.testing.assert_array_equal(ours[key][()], theirs[key][()])
    # and each reads the other's output file
    for name, other in (("c", "o"), ("o", "c")):
        (tmp_path / f"{name}_list.txt").write_text(f"{other}_out.h5\n")
        (tmp_path / f"{name}2.prototxt").write_text(
            net.replace("list.txt", f"{name}_list.txt").replace("OUT", f"{name}_again"))
    again = [[m for m in messages(program("test", "--model", f"{name}2.prototxt", "--weights", "w.caffemodel",
                                          "--iterations", "1", cwd=tmp_path)) if m.startswith("Batch 0")]
             for name, program in (("c", caffe), ("o", caffepy))]
    assert again[0] == again[1] == outputs["c"]
