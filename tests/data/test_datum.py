"""Datum codec: raw, float and encoded records, against hand-made arrays."""
import cv2
import numpy as np
import pytest

from caffepy.data.datum import array_to_datum, datum_to_array, encoded_datum, parse_datum
from caffepy.errors import DataError
from caffepy.proto import caffe_pb2


def test_raw_uint8_round_trip_is_chw_bytes():
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    datum = array_to_datum(arr, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (2, 3, 4, 7)
    assert datum.data == bytes(range(24))       # C x H x W order, byte for byte
    back = datum_to_array(parse_datum(datum.SerializeToString()))
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, arr)


def test_float_data_round_trip():
    arr = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 2, 2)
    datum = array_to_datum(arr)
    assert len(datum.data) == 0 and len(datum.float_data) == 12
    back = datum_to_array(datum)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, arr)


def test_encoded_png_decodes_in_bgr_order():
    img = np.zeros((4, 5, 3), np.uint8)
    img[..., 0], img[..., 1], img[..., 2] = 10, 20, 30     # OpenCV's B, G, R
    ok, buf = cv2.imencode(".png", img)
    back = datum_to_array(encoded_datum(buf.tobytes(), 3))
    assert back.shape == (3, 4, 5)
    assert (back[0] == 10).all() and (back[1] == 20).all() and (back[2] == 30).all()


def test_force_color_and_force_gray_on_encoded():
    gray = (np.arange(20, dtype=np.uint8) * 10).reshape(4, 5)
    ok, buf = cv2.imencode(".png", gray)
    datum = encoded_datum(buf.tobytes())
    assert datum_to_array(datum).shape == (1, 4, 5)           # native: stays gray
    colour = datum_to_array(datum, force_color=True)
    assert colour.shape == (3, 4, 5)
    np.testing.assert_array_equal(colour[2], gray)
    ok, buf = cv2.imencode(".png", np.dstack([gray, gray, gray]))
    assert datum_to_array(encoded_datum(buf.tobytes()), force_gray=True).shape == (1, 4, 5)


def test_corrupt_record_names_source_and_key():
    with pytest.raises(DataError, match=r"^db/x: key '00000003': corrupt or truncated Datum"):
        parse_datum(b"\xff\xff\xff\xff", "db/x", b"00000003")


def test_truncated_record():
    good = array_to_datum(np.zeros((3, 8, 8), np.uint8)).SerializeToString()
    with pytest.raises(DataError, match="key 'k': corrupt or truncated"):
        parse_datum(good[:-20], "db", b"k")


def test_size_mismatch_and_undecodable_image():
    datum = caffe_pb2.Datum(channels=1, height=2, width=2, data=b"abc")
    with pytest.raises(DataError, match=r"db: key 'k': Datum data has 3 bytes, its shape 1x2x2 needs 4"):
        datum_to_array(datum, source="db", key=b"k")
    with pytest.raises(DataError, match="cannot decode the encoded image"):
        datum_to_array(encoded_datum(b"not an image"), source="db", key=b"k")
