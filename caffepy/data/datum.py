"""Datum <-> NumPy array, as Caffe stores images in a database.

A Datum holds one image and its label in one of three ways:
  raw       `data` = uint8 pixels in C x H x W order (channels, height, width set)
  float     `float_data` = float pixels in C x H x W order
  encoded   `data` = the bytes of a JPEG/PNG file, `encoded` = true
Encoded images are decoded with OpenCV, which gives Caffe's BGR channel order.
"""
import cv2
import numpy as np
from google.protobuf.message import DecodeError

from ..errors import DataError, quote
from ..proto import caffe_pb2


def _where(source, key):
    if source is None:
        return ""
    return f"{source}: key '{_key_text(key)}': " if key is not None else f"{source}: "


def _key_text(key):
    return quote(key, 100)


def parse_datum(value, source=None, key=None):
    """A Datum from the bytes of a database record (DataError if they are not one)."""
    datum = caffe_pb2.Datum()
    try:
        datum.ParseFromString(bytes(value))
    except DecodeError as e:
        raise DataError(f"{_where(source, key)}corrupt or truncated Datum record ({len(value)} bytes): "
                        f"{e}") from None
    return datum


def decode_image(buf, force_color=False, force_gray=False, source=None, key=None):
    """Encoded image bytes -> H x W x C uint8 (BGR), as Caffe's DecodeDatumToCVMat.

    Without force_color / force_gray the image keeps its own channel count
    (1 for a grayscale PNG, 3 for a colour JPEG).
    """
    if force_color:
        flag = cv2.IMREAD_COLOR
    elif force_gray:
        flag = cv2.IMREAD_GRAYSCALE
    else:
        flag = cv2.IMREAD_ANYCOLOR
    try:
        img = cv2.imdecode(np.frombuffer(buf, np.uint8), flag)
    except cv2.error as e:
        raise DataError(f"{_where(source, key)}cannot decode the encoded image ({len(buf)} bytes): "
                        f"{str(e).strip().splitlines()[-1]}") from None
    if img is None:
        raise DataError(f"{_where(source, key)}cannot decode the encoded image ({len(buf)} bytes)")
    if img.ndim == 2:
        img = img[:, :, None]
    elif img.shape[2] == 4:
        img = img[:, :, :3]
    return img


def hwc_to_chw(img):
    return img.transpose(2, 0, 1)


def datum_to_array(datum, force_color=False, force_gray=False, source=None, key=None):
    """The pixels of a Datum as a C x H x W array: uint8 for raw and encoded
    images, float32 for float_data. Checks that the sizes agree.

    force_color / force_gray apply to encoded images only (as in Caffe).
    """
    if datum.encoded:
        return hwc_to_chw(decode_image(datum.data, force_color, force_gray, source, key))
    shape = (datum.channels, datum.height, datum.width)
    if min(shape) < 0:
        raise DataError(f"{_where(source, key)}Datum shape {shape[0]}x{shape[1]}x{shape[2]} has a "
                        f"negative size")
    count = shape[0] * shape[1] * shape[2]
    if len(datum.data):
        if len(datum.data) != count:
            raise DataError(f"{_where(source, key)}Datum data has {len(datum.data)} bytes, its shape "
                            f"{shape[0]}x{shape[1]}x{shape[2]} needs {count}")
        arr = np.frombuffer(datum.data, np.uint8).reshape(shape)
    else:
        if len(datum.float_data) != count:
            raise DataError(f"{_where(source, key)}Datum float_data has {len(datum.float_data)} values, "
                            f"its shape {shape[0]}x{shape[1]}x{shape[2]} needs {count}")
        arr = np.asarray(datum.float_data, np.float32).reshape(shape)
    return arr


def datum_header(channels, height, width):
    """The wire bytes of a Datum's channels, height and width fields (1, 2, 3), as protobuf
    writes them, for callers that append the rest of the message themselves."""
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = int(channels), int(height), int(width)
    return datum.SerializeToString()


def array_to_datum(arr, label=None):
    """A C x H x W array as a Datum: uint8 arrays to `data`, others to `float_data`."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise DataError(f"array_to_datum: needs a 3-axis C x H x W array, got shape {arr.shape}")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = (int(s) for s in arr.shape)
    if arr.dtype == np.uint8:
        datum.data = np.ascontiguousarray(arr).tobytes()
    else:
        datum.float_data.extend(np.ascontiguousarray(arr, np.float32).ravel().tolist())
    if label is not None:
        datum.label = int(label)
    return datum


def image_to_datum(img, label=0):
    """An H x W x C (or H x W) uint8 OpenCV image as a raw Datum (Caffe's CVMatToDatum,
    which writes `encoded: false` where pycaffe's array_to_datum leaves it unset)."""
    if img.ndim == 2:
        img = img[:, :, None]
    datum = array_to_datum(hwc_to_chw(img), label)
    datum.encoded = False
    return datum


def encoded_datum(buf, label=0):
    """A Datum holding encoded image bytes, as Caffe's ReadFileToDatum / EncodeCVMatToDatum."""
    datum = caffe_pb2.Datum()
    datum.data = bytes(buf)
    datum.encoded = True
    datum.label = int(label)
    return datum
