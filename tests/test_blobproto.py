"""blobproto: arrays <-> BlobProto in both shape forms, files, the 2 GiB guard."""
import os
import time

import numpy as np
import pytest

from caffepy.blobproto import (array_to_blobproto, blob_shape, blobproto_to_array, read_blobproto,
                               write_blobproto)
from caffepy.errors import CaffepyError, PrototxtError
from caffepy.proto import caffe_pb2
from caffepy import prototxt as P
from caffepy.solvers.snapshot import write_solver_state
from caffepy.upgrade import read_binary_net


def test_round_trip_with_shape_and_diff():
    rng = np.random.default_rng(0)
    data = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    diff = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    bp = array_to_blobproto(data, diff)
    assert list(bp.shape.dim) == [2, 3, 4, 5] and not bp.HasField("num")
    assert len(bp.data) == data.size and len(bp.diff) == diff.size
    # The packed bytes we build are what protobuf itself stores for the field.
    assert list(bp.data)[:3] == [float(x) for x in data.reshape(-1)[:3]]
    back = blobproto_to_array(bp)
    assert back.dtype == np.float32 and back.flags.writeable
    np.testing.assert_array_equal(back, data)
    np.testing.assert_array_equal(blobproto_to_array(bp, return_diff=True), diff)


def test_bytes_equal_protobufs_own_encoding():
    data = np.linspace(-1, 1, 7, dtype=np.float32).reshape(7, 1)
    ours = array_to_blobproto(data)
    theirs = caffe_pb2.BlobProto()
    theirs.shape.dim.extend([7, 1])
    theirs.data.extend(data.reshape(-1).tolist())
    assert ours.SerializeToString() == theirs.SerializeToString()


def test_legacy_four_axis_form():
    bp = caffe_pb2.BlobProto(num=2, channels=1, height=2, width=3)
    bp.data.extend(range(12))
    arr = blobproto_to_array(bp)
    assert arr.shape == (2, 1, 2, 3) and arr[1, 0, 1, 2] == 11
    # Legacy fields win over `shape`, as in Caffe's Blob::FromProto.
    bp.shape.dim.extend([12])
    assert blob_shape(bp) == (2, 1, 2, 3)


def test_a_blob_with_no_shape_at_all_is_a_scalar():
    # no num/channels/height/width and no shape: zero axes, one value (Caffe's Blob::FromProto
    # and pycaffe's blobproto_to_array agree); any other count is pycaffe's ValueError
    bp = caffe_pb2.BlobProto()
    bp.data.append(123)
    assert blob_shape(bp) == ()
    arr = blobproto_to_array(bp)
    assert arr.shape == () and arr.dtype == np.float32 and arr == 123
    bp.data.extend([1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"^blob: data: has 5 values, its shape \[\] needs 1 \(no num/channels"):
        blobproto_to_array(bp)
    with pytest.raises(PrototxtError):
        blobproto_to_array(caffe_pb2.BlobProto())
    # one legacy dimension set makes it 4-D (the unset ones are 0, as Caffe reads them)
    bp.channels = 5
    with pytest.raises(PrototxtError, match=r"has 5 values, its shape \[0, 5, 0, 0\] needs 0$"):
        blobproto_to_array(bp)
    bp.num, bp.height, bp.width = 1, 1, 1
    assert blobproto_to_array(bp).shape == (1, 5, 1, 1)
    bp.diff.extend([-1, -2, -3, -4, -5])
    np.testing.assert_array_equal(blobproto_to_array(bp, return_diff=True).ravel(), [-1, -2, -3, -4, -5])


def test_legacy_shape_writer_pads_leading_axes():
    bp = array_to_blobproto(np.zeros((3, 4, 5), np.float32), legacy_shape=True)
    assert (bp.num, bp.channels, bp.height, bp.width) == (1, 3, 4, 5)
    assert not bp.HasField("shape")
    assert blobproto_to_array(bp).shape == (1, 3, 4, 5)


def test_double_fields():
    data = np.arange(6, dtype=np.float64).reshape(2, 3) / 3
    bp = array_to_blobproto(data, diff=-data, double=True)
    assert len(bp.data) == 0 and len(bp.double_data) == 6
    back = blobproto_to_array(bp)
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, data)
    np.testing.assert_array_equal(blobproto_to_array(bp, return_diff=True), -data)


def test_scalar_and_empty_blobs():
    bp = array_to_blobproto(np.float32(2.5))
    assert bp.HasField("shape") and list(bp.shape.dim) == []
    assert blobproto_to_array(bp).shape == () and float(blobproto_to_array(bp)) == 2.5
    empty = array_to_blobproto(np.zeros((0, 3), np.float32))
    assert blobproto_to_array(empty).shape == (0, 3)


def test_count_mismatch_names_the_file():
    bp = caffe_pb2.BlobProto()
    bp.shape.dim.extend([2, 2])
    bp.data.extend([1, 2, 3])
    with pytest.raises(PrototxtError, match=r"^w\.caffemodel: blob: data: has 3 values, its shape \[2, 2\] needs 4$"):
        blobproto_to_array(bp, source="w.caffemodel")


def test_mean_file_round_trip(tmp_path):
    mean = np.random.default_rng(1).random((1, 3, 8, 8)).astype(np.float32) * 255
    path = tmp_path / "mean.binaryproto"
    write_blobproto(mean, path)
    np.testing.assert_array_equal(read_blobproto(path), mean)
    write_blobproto(mean[0], path, legacy_shape=True)
    np.testing.assert_array_equal(read_blobproto(path), mean)


def test_large_blob_is_fast():
    # 8M floats; the full 60M case is benchmarks/bench_blobproto.py.
    arr = np.random.default_rng(2).random(8_000_000, dtype=np.float32)
    start = time.perf_counter()
    back = blobproto_to_array(array_to_blobproto(arr))
    assert time.perf_counter() - start < 2.0
    np.testing.assert_array_equal(back, arr)


def test_two_gib_guard_refuses_before_writing(tmp_path):
    net = caffe_pb2.NetParameter(name="big")
    layer = net.layer.add(name="fc", type="InnerProduct")
    layer.blobs.append(array_to_blobproto(np.zeros(1000, np.float32)))
    layer.blobs.append(array_to_blobproto(np.zeros(10, np.float64), double=True))
    assert P.payload_bytes(net) == 1000 * 4 + 10 * 8 + len("big") + len("fc") + len("InnerProduct")
    path = tmp_path / "big.caffemodel"
    with pytest.raises(CaffepyError, match=r"big\.caffemodel: NetParameter needs .* GiB, over protobuf's .* "
                                           r"message limit; nothing was written"):
        P.write_binary(net, path, limit=4000)
    assert not os.listdir(tmp_path)
    # Under the limit by payload, over it once tags and lengths are counted.
    with pytest.raises(CaffepyError, match="nothing was written"):
        P.write_binary(net, path, limit=P.payload_bytes(net))
    assert not os.listdir(tmp_path)
    P.write_binary(net, path, limit=5000)
    assert read_binary_net(path) == net


def test_solver_state_guard(tmp_path):
    state = caffe_pb2.SolverState(iter=1)
    state.history.append(array_to_blobproto(np.ones(100, np.float32)))
    with pytest.raises(CaffepyError, match="SolverState needs"):
        write_solver_state(state, tmp_path / "s.solverstate", limit=100)
    assert not os.listdir(tmp_path)
