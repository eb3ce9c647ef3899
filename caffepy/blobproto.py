"""NumPy arrays <-> BlobProto, fast enough for 60M-parameter layers.

Filling a repeated float field from NumPy element by element costs ~20 s per
60M floats under protobuf's upb runtime.  Writing instead builds the packed
wire bytes of the field (tag, varint length, raw little-endian floats) and
merges them into the message, which is two memcpys; reading goes through the
container's `__array__`, also a copy.  benchmarks/bench_blobproto.py measures
both directions.
"""
import os

import numpy as np

from . import memory
from .errors import BlobValuesError, quote
from .proto import caffe_pb2

# Wire tags (field_number << 3 | wire type 2 = length-delimited) of the
# packed BlobProto fields.
_TAG = {"data": 5 << 3 | 2, "diff": 6 << 3 | 2, "double_data": 8 << 3 | 2, "double_diff": 9 << 3 | 2}


def _varint(value):
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _packed_field(name, values):
    """The wire bytes of one packed field holding `values` (1-D, right dtype)."""
    raw = values.view(np.uint8)
    head = bytes([_TAG[name]]) + _varint(raw.nbytes)
    buf = bytearray(len(head) + raw.nbytes)
    buf[: len(head)] = head
    np.frombuffer(buf, dtype=np.uint8, offset=len(head))[:] = raw
    return buf


def fill_blobproto(bp, arr, diff=None, double=False, legacy_shape=False):
    """Set `bp`'s shape and data (and diff) from arrays, replacing what it held.

    Values go to `data`/`diff` as float32, or to `double_data`/`double_diff`
    as float64 when `double` is true.  `legacy_shape` writes the shape as
    num/channels/height/width (at most 4 axes, padded with leading 1s, as
    Caffe's own compute_image_mean does) instead of `shape`.
    """
    arr = np.asarray(arr)
    dtype = np.dtype("<f8" if double else "<f4")
    names = ("double_data", "double_diff") if double else ("data", "diff")
    bp.Clear()
    if legacy_shape:
        if arr.ndim > 4:
            raise ValueError(f"a legacy blob shape has at most 4 axes, got {arr.shape}")
        bp.num, bp.channels, bp.height, bp.width = (1,) * (4 - arr.ndim) + arr.shape
    else:
        bp.shape.dim.extend(int(d) for d in arr.shape)
        # Proto2 drops an empty sub-message; mark a 0-axis shape explicitly.
        bp.shape.SetInParent()
    wire = _packed_field(names[0], np.ascontiguousarray(arr, dtype=dtype).reshape(-1))
    if diff is not None:
        diff = np.asarray(diff)
        if diff.size != arr.size:
            raise ValueError(f"diff has {diff.size} values, data has {arr.size}")
        wire += _packed_field(names[1], np.ascontiguousarray(diff, dtype=dtype).reshape(-1))
    bp.MergeFromString(memoryview(wire))
    return bp


def array_to_blobproto(arr, diff=None, double=False, legacy_shape=False):
    """A new BlobProto with `shape`, `data` (and `diff`) from NumPy arrays."""
    return fill_blobproto(caffe_pb2.BlobProto(), arr, diff, double, legacy_shape)


def blob_shape(bp):
    """The shape a BlobProto declares: legacy num/channels/height/width if any
    of them is set (as Caffe's Blob::FromProto decides), else `shape.dim`. A
    blob that declares neither has no axes, one value (Caffe and pycaffe both
    read it as a scalar)."""
    if bp.HasField("num") or bp.HasField("channels") or bp.HasField("height") or bp.HasField("width"):
        return (bp.num, bp.channels, bp.height, bp.width)
    return tuple(bp.shape.dim)


def blobproto_to_array(bp, return_diff=False, source=None, where="blob"):
    """The values of a BlobProto as an array of its declared shape.

    Reads `data` (float32) or, when only doubles are stored, `double_data`
    (float64); `return_diff` reads the diff fields instead. Errors name
    `source` (the file) and `where` (e.g. "layer 'fc' (InnerProduct): blobs[0]").
    """
    single, double = ("diff", "double_diff") if return_diff else ("data", "double_data")
    values = getattr(bp, single)
    dtype = np.float32
    if len(values) == 0 and len(getattr(bp, double)) > 0:
        values, dtype = getattr(bp, double), np.float64
    shape = blob_shape(bp)
    prefix = f"{source}: {where}" if source else where
    if any(d < 0 for d in shape):
        raise BlobValuesError(f"{prefix}: shape: negative dimension, got {quote(list(shape))}")
    count = memory.count(shape)     # exact: a product of int64 dims may overflow 64 bits
    if len(values) != count:
        hint = "" if shape else " (no num/channels/height/width and no shape: a scalar, as in Caffe)"
        raise BlobValuesError(f"{prefix}: {single}: has {len(values)} values, its shape "
                              f"{quote(list(shape))} needs {count}{hint}")
    return np.array(values, dtype=dtype).reshape(shape)


def read_blobproto(path):
    """A .binaryproto file (e.g. a mean image) as an array of its shape."""
    from .prototxt import read_binary

    bp = read_binary(caffe_pb2.BlobProto(), path)
    return blobproto_to_array(bp, source=os.fspath(path))


def write_blobproto(arr, path, legacy_shape=False):
    """Write an array as a .binaryproto file, atomically."""
    from .prototxt import write_binary

    write_binary(array_to_blobproto(arr, legacy_shape=legacy_shape), path)
