"""caffepy.io, pycaffe's caffe.io."""
import cv2
import numpy as np
import pytest

from caffepy import io
from caffepy.errors import CaffepyError


def test_datum_and_blobproto_round_trips():
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    d = io.array_to_datum(arr, 3)
    assert d.label == 3
    np.testing.assert_array_equal(io.datum_to_array(d), arr)
    f = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(io.blobproto_to_array(io.array_to_blobproto(f)), f)
    s = io.arraylist_to_blobprotovector_str([f, f * 2])
    back = io.blobprotovector_str_to_arraylist(s)
    np.testing.assert_array_equal(back[1], f * 2)


def test_load_image_rgb_float(tmp_path):
    img = np.zeros((3, 4, 3), np.uint8)
    img[..., 2] = 255                                    # red in OpenCV's BGR
    cv2.imwrite(str(tmp_path / "r.png"), img)
    rgb = io.load_image(str(tmp_path / "r.png"))
    assert rgb.shape == (3, 4, 3) and rgb.dtype == np.float32
    np.testing.assert_allclose(rgb[0, 0], [1, 0, 0])
    assert io.load_image(str(tmp_path / "r.png"), color=False).shape == (3, 4, 1)
    cv2.imwrite(str(tmp_path / "g.png"), np.full((2, 2), 51, np.uint8))
    g = io.load_image(str(tmp_path / "g.png"))
    assert g.shape == (2, 2, 3)
    np.testing.assert_allclose(g, 0.2)


def test_resize_image_and_oversample():
    im = np.random.default_rng(0).uniform(size=(8, 10, 3)).astype(np.float32)
    assert io.resize_image(im, (4, 5)).shape == (4, 5, 3)
    np.testing.assert_allclose(io.resize_image(np.ones((3, 3, 7)), (6, 2)), np.ones((6, 2, 7)))
    crops = io.oversample([im, im + 1], (4, 6))
    assert crops.shape == (20, 4, 6, 3)
    np.testing.assert_array_equal(crops[0], im[:4, :6])                 # top-left
    np.testing.assert_array_equal(crops[3], im[4:, 4:])                 # bottom-right
    np.testing.assert_array_equal(crops[4], im[2:6, 2:8])               # centre
    np.testing.assert_array_equal(crops[5], im[:4, :6][:, ::-1])         # its mirror
    np.testing.assert_array_equal(crops[10], im[:4, :6] + 1)


def test_transformer_preprocess_and_deprocess():
    t = io.Transformer({"data": (1, 3, 4, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([10, 20, 30]))
    t.set_input_scale("data", 0.5)
    img = np.random.default_rng(1).uniform(size=(4, 5, 3)).astype(np.float32)
    x = t.preprocess("data", img)
    assert x.shape == (3, 4, 5)
    # channel 0 of the input is the image's last channel (RGB -> BGR)
    np.testing.assert_allclose(x[0], (img[:, :, 2] * 255 - 10) * 0.5, rtol=1e-5)
    np.testing.assert_allclose(t.deprocess("data", x), img, rtol=1e-5, atol=1e-6)
    assert t.preprocess("data", np.zeros((8, 10, 3))).shape == (3, 4, 5)      # resized first


def test_transformer_errors():
    t = io.Transformer({"data": (1, 3, 4, 5)})
    with pytest.raises(CaffepyError, match="'nope' is not one of the net inputs: data"):
        t.set_raw_scale("nope", 1)
    with pytest.raises(CaffepyError, match=r"mean needs one value per channel \(3\), got 2"):
        t.set_mean("data", [1, 2])
    with pytest.raises(CaffepyError, match="mean shape"):
        t.set_mean("data", np.zeros((3, 5, 5)))
