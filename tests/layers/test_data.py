"""Forward cases for the data layers (no gradients: differentiable = False), and WindowData on a
generated image set."""
import atexit
import os
import shutil
import tempfile

import cv2
import numpy as np
import pytest

from caffepy.data.windows import Window, window_crop
from caffepy.errors import DataError
from data_helpers import make_db
from layer_cases import TEST, Case, case_tests, setup_layer

_DIR = tempfile.mkdtemp(prefix="caffepy_data_cases_")
atexit.register(shutil.rmtree, _DIR, True)
_VALUES = [np.arange(12, dtype=np.uint8).reshape(1, 3, 4) + 20 * i for i in range(3)]
_DB = make_db(os.path.join(_DIR, "db"), 3, values=_VALUES)


def _batch(indices):
    return np.stack([_VALUES[i] for i in indices]).astype(np.float64)


CASES = [
    Case("Input", "input_param { shape { dim: 2 dim: 3 } }", [], n_top=1, grad=False,
         expected=lambda: [np.zeros((2, 3))]),
    Case("DummyData", 'dummy_data_param { shape { dim: 2 dim: 3 } data_filler { type: "constant" value: 7 } }',
         [], grad=False, expected=lambda: [np.full((2, 3), 7.0)]),
    Case("DummyData", "dummy_data_param { num: 1 channels: 2 height: 1 width: 1 }", [], n_top=2, grad=False,
         expected=lambda: [np.zeros((1, 2, 1, 1)), np.zeros((1, 2, 1, 1))], id="DummyData:legacy two tops"),
    Case("Data", f'data_param {{ source: "{_DB}" batch_size: 2 backend: LMDB }}', [], n_top=2, grad=False,
         phase=TEST, expected=lambda: [_batch([0, 1]), np.array([0.0, 1.0])], id="Data:raw"),
    Case("Data", f'data_param {{ source: "{_DB}" batch_size: 4 }} '
                 'transform_param { crop_size: 2 mean_value: 4 scale: 0.5 }',
         [], n_top=2, grad=False, phase=TEST, id="Data:center crop, mean, scale, wrap",
         expected=lambda: [(_batch([0, 1, 2, 0])[:, :, 0:2, 1:3] - 4) * 0.5, np.array([0.0, 1, 2, 0])]),
]

test_forward, test_gradient = case_tests(CASES)


# -- WindowData ---------------------------------------------------------------------------------
@pytest.fixture
def window_set(tmp_path):
    """Two generated 40 x 50 colour images and a window file: image 0 has a foreground
    window of class 1, one of class 2, a background one and one in between (unused);
    image 1 a background one and a class-3 one covering the whole image."""
    gen = np.random.default_rng(0)
    images = []
    for i in range(2):
        img = gen.integers(0, 255, (40, 50, 3), dtype=np.uint8)
        cv2.imwrite(str(tmp_path / f"img{i}.png"), img)
        images.append(img)
    (tmp_path / "windows.txt").write_text(
        "# 0\nimg0.png\n3 40 50\n4\n"
        "1 0.8 10 5 30 25\n0 0.1 0 0 20 20\n2 0.6 5 5 45 35\n1 0.4 1 1 9 9\n"
        "# 1\nimg1.png\n3 40 50\n2\n"
        "0 0.2 10 10 40 30\n3 0.9 0 0 49 39\n")
    return tmp_path, images


def window_layer(root, extra="", transform="crop_size: 16", batch=8, fg_fraction=0.5, phase=TEST):
    params = (f'window_data_param {{ source: "{root}/windows.txt" root_folder: "{root}/" batch_size: {batch} '
              f'fg_fraction: {fg_fraction} {extra} }} transform_param {{ {transform} }}')
    return setup_layer("WindowData", params, [], n_top=2, phase=phase)


def test_window_data_samples_background_then_foreground(window_set):
    root, _ = window_set
    layer, bottom, top = window_layer(root, fg_fraction=0.25)
    for _ in range(3):
        layer.forward(bottom, top)
        labels = top[1].data
        assert top[0].shape == (8, 3, 16, 16)
        assert (labels[:6] == 0).all() and set(labels[6:]) <= {1, 2, 3}
    layer.close()


def test_window_data_warps_the_window_minus_the_mean_times_scale(window_set):
    root, images = window_set
    # one foreground window (image 1, the whole image) fills the batch
    layer, bottom, top = window_layer(root, "fg_threshold: 0.85 scale: 0.5", "crop_size: 16 mean_value: 100",
                                      batch=2, fg_fraction=1.0)
    layer.forward(bottom, top)
    want = (cv2.resize(images[1], (16, 16), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1) - 100.0) * 0.5
    np.testing.assert_allclose(top[0].data[0], want)
    assert top[1].data.tolist() == [3, 3]
    layer.close()


def test_window_crop_context_padding_and_square():
    img = np.random.default_rng(1).integers(0, 255, (40, 50, 3), dtype=np.uint8)
    # 16 wide, 16 high; crop 20 with context 2 enlarges by 20 / 16 about the centre (18, 18):
    # columns and rows 8..28, all inside the image, warped to the whole crop
    patch, pad_h, pad_w = window_crop(img, Window(0, 1, 1.0, 10, 10, 25, 25), 20, context_pad=2)
    assert (pad_h, pad_w) == (0, 0)
    np.testing.assert_array_equal(patch, cv2.resize(img[8:29, 8:29], (20, 20), interpolation=cv2.INTER_LINEAR))
    # at the top-left corner the enlarged window reaches past the image: that part is zero padding
    patch, pad_h, pad_w = window_crop(img, Window(0, 1, 1.0, 0, 0, 15, 15), 20, context_pad=2)
    assert pad_h == pad_w == 2 and patch.shape == (18, 18, 3)
    mirrored, _, pad_w_m = window_crop(img, Window(0, 1, 1.0, 0, 0, 15, 15), 20, context_pad=2, mirror=True)
    assert pad_w_m == 0 and (mirrored == patch[:, ::-1]).all()     # the padding is mirrored too
    # square: a 10 wide, 20 high window, centre (25, 20), takes the half height 10 for both
    # sides: columns 15..35 and rows 10..30 (Caffe's centre +- half, ends included)
    patch, pad_h, pad_w = window_crop(img, Window(0, 1, 1.0, 20, 10, 29, 29), 20, square=True)
    np.testing.assert_array_equal(patch, cv2.resize(img[10:31, 15:36], (20, 20), interpolation=cv2.INTER_LINEAR))


def test_window_data_mirror_and_padding_in_the_batch(window_set):
    root, _ = window_set
    layer, bottom, top = window_layer(root, "context_pad: 4 fg_threshold: 0.85",
                                      "crop_size: 16 mirror: true", batch=8, fg_fraction=1.0)
    layer.forward(bottom, top)
    data = top[0].data
    # the whole-image window enlarged by 16 / 8: a zero border of 4 on every side
    assert not data[:, :, :4].any() and not data[:, :, :, -4:].any() and data[:, :, 4:12, 4:12].all()
    layer.close()


@pytest.mark.parametrize("text,match", [
    ("", r"window_data_param.source: the window file is empty"),
    ("# 0\nimg0.png\n3 40 50\n1\n1 0.3 0 0 5 5\n", r"no foreground windows \(fg_threshold 0.5, bg_threshold 0.5\)"),
    ("# 0\nimg0.png\n3 40 50\n1\n0 0.9 0 0 5 5\n", r"a foreground window \(overlap 0.9\) needs a class > 0, got 0"),
    ("# 0\nimg0.png\n3 40 50\n2\n1 0.9 0 0 5 5\n", r"image 0: the file ends inside its windows"),
    ("# 0\nimg0.png\n1 40 50\n2\n1 0.9 0 0 5 5\n0 0 0 0 5 5\n", r"must give 3 channels, got 1 \(first image\)"),
])
def test_window_file_mistakes_name_the_field(window_set, text, match):
    root, _ = window_set
    (root / "windows.txt").write_text(text)
    with pytest.raises(DataError, match=r"layer 'layer' \(WindowData\): .*" + match):
        window_layer(root)


def test_window_outside_its_image_is_a_data_error(window_set):
    root, _ = window_set
    (root / "windows.txt").write_text("# 0\nimg0.png\n3 40 50\n2\n1 0.9 0 0 60 10\n0 0 0 0 5 5\n")
    layer, bottom, top = window_layer(root, fg_fraction=1.0, batch=1)
    with pytest.raises(DataError, match=r"windows.txt: image '.*img0.png': window \(0, 0, 60, 10\) does not lie "
                                        r"in the 50x40 image"):
        layer.forward(bottom, top)
    layer.close()
