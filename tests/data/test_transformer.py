"""transform_param against hand-computed expectations: order (x - mean) * scale, crop
offsets (random in TRAIN, centred in TEST), mirror, mean file cropped with the image."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffepy.blobproto import write_blobproto
from caffepy.data.transformer import DataTransformer
from caffepy.errors import DataError
from caffepy.proto import caffe_pb2

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def make(text, phase=TRAIN, seed=0):
    p = caffe_pb2.TransformationParameter()
    text_format.Parse(text, p)
    return DataTransformer(p, phase, np.random.default_rng(seed))


def image(c=2, h=5, w=6):
    return np.arange(c * h * w, dtype=np.uint8).reshape(c, h, w)


def test_mean_value_then_scale():
    t = make("mean_value: 2 scale: 0.5")
    img = image(1, 4, 5)
    out = t(img)
    np.testing.assert_allclose(out, (img.astype(np.float32) - 2) * 0.5)
    assert out.dtype == np.float32


def test_mean_value_per_channel():
    t = make("mean_value: 1 mean_value: 10")
    out = t(image(2, 2, 2))
    assert out[0, 0, 0] == 0 - 1 and out[1, 0, 0] == 4 - 10


def test_center_crop_in_test():
    t = make("crop_size: 3", TEST)
    img = image(2, 5, 6)
    out = t(img)
    # h_off = (5 - 3) // 2 = 1, w_off = (6 - 3) // 2 = 1
    np.testing.assert_array_equal(out, img[:, 1:4, 1:4])


def test_random_crop_offsets_from_draw_in_train():
    t = make("crop_size: 3")
    img = image(2, 5, 6)
    out = np.empty((2, 3, 3), np.float32)
    t.transform(img, np.array([0, 7, 9]), out)
    # h_off = 7 mod (5 - 3 + 1) = 1, w_off = 9 mod (6 - 3 + 1) = 1
    np.testing.assert_array_equal(out, img[:, 1:4, 1:4])
    t.transform(img, np.array([0, 2, 3]), out)
    np.testing.assert_array_equal(out, img[:, 2:5, 3:6])


def test_random_crops_cover_every_offset():
    t = make("crop_size: 3")
    seen = {t.offsets((1, 5, 6), d)[:2] for d in t.draw(400)}
    assert seen == {(h, w) for h in range(3) for w in range(4)}


def test_mirror_with_mean_file_cropped_at_same_offsets(tmp_path):
    mean = np.random.default_rng(1).uniform(0, 50, (2, 5, 6)).astype(np.float32)
    write_blobproto(mean[None], tmp_path / "mean.binaryproto")
    t = make(f'crop_size: 3 mirror: true scale: 0.25 mean_file: "{tmp_path / "mean.binaryproto"}"')
    img = image(2, 5, 6)
    out = np.empty((2, 3, 3), np.float32)
    t.transform(img, np.array([1, 1, 2]), out)        # mirror coin odd: flipped; h_off 1, w_off 2
    for c in range(2):
        for h in range(3):
            for w in range(3):
                src_h, src_w = 1 + h, 2 + (3 - 1 - w)
                want = (float(img[c, src_h, src_w]) - float(mean[c, src_h, src_w])) * 0.25
                assert out[c, h, w] == pytest.approx(want, rel=1e-6)
    t.transform(img, np.array([2, 1, 2]), out)        # even coin: not flipped
    np.testing.assert_allclose(out, (img[:, 1:4, 2:5] - mean[:, 1:4, 2:5]) * 0.25, rtol=1e-6)


def test_mirror_happens_about_half_the_time():
    t = make("mirror: true")
    flips = sum(t.offsets((1, 2, 2), d)[2] for d in t.draw(1000))
    assert 400 < flips < 600


def test_float_input_and_no_mean():
    t = make("scale: 2")
    img = np.array([[[0.5, -1.0]]], np.float32)
    np.testing.assert_array_equal(t(img), [[[1.0, -2.0]]])


def test_errors():
    with pytest.raises(DataError, match="give mean_file or mean_value, not both"):
        make('mean_file: "m.binaryproto" mean_value: 1')
    with pytest.raises(DataError, match=r"crop_size: larger than the image \(5x6\), got 7"):
        make("crop_size: 7").check((1, 5, 6))
    with pytest.raises(DataError, match=r"mean_value: give 1 value or one per channel \(3\), got 2"):
        make("mean_value: 1 mean_value: 2").check((3, 4, 4))
    with pytest.raises(DataError, match="cannot read the mean"):
        make('mean_file: "/nonexistent/mean.binaryproto"')


def test_mean_file_shape_must_match_image(tmp_path):
    write_blobproto(np.zeros((1, 3, 4, 4), np.float32), tmp_path / "m.binaryproto")
    t = make(f'mean_file: "{tmp_path / "m.binaryproto"}"')
    with pytest.raises(DataError, match="the mean is 3x4x4 but the image is 3x5x5"):
        t.check((3, 5, 5))


# -- Intel Caffe's transform fields ----------------------------------------------------------------
def test_intel_pad_puts_a_zero_border_around_the_crop():
    t = make("crop_size: 3 pad: 2 scale: 0.5", TEST)
    img = image(1, 5, 5)
    out = t(img)
    assert out.shape == (1, 7, 7)
    assert not out[:, :2].any() and not out[:, -2:].any() and not out[:, :, :2].any() and not out[:, :, -2:].any()
    np.testing.assert_allclose(out[:, 2:5, 2:5], img[:, 1:4, 1:4] * 0.5)
    assert t.check((1, 5, 5)) == (1, 7, 7)


def test_intel_pad_with_mean_value_rounds_as_intel_caffe():
    t = make("pad: 1 mean_value: 0.25 scale: 0.5", TEST)
    out = t(np.array([[[0, 1], [2, 5]]], np.uint8))
    # (x - 0.25) * 0.5 = -0.125, 0.375, 0.875, 2.375, rounded to the nearest integer
    np.testing.assert_array_equal(out[0, 1:3, 1:3], [[0, 0], [1, 2]])
    assert out[0, 0].tolist() == [0, 0, 0, 0]


def test_emit_constraint_is_refused_not_ignored_without_boxes():
    """It filters SSD's annotated boxes (AnnotatedData: tests/data/test_annotated.py); the
    augmentations themselves: tests/data/test_augment.py."""
    with pytest.raises(DataError, match=r"^transform_param.emit_constraint: filters the boxes of a crop, and "
                                        r"only AnnotatedData has boxes. Remove it"):
        make("emit_constraint { emit_type: CENTER }")


def test_intel_pad_with_a_mean_file_is_refused(tmp_path):
    write_blobproto(np.zeros((1, 1, 5, 5), np.float32), tmp_path / "m.binaryproto")
    with pytest.raises(DataError, match=r"transform_param.pad: cannot be combined with mean_file"):
        make(f'pad: 1 mean_file: "{tmp_path / "m.binaryproto"}"')
