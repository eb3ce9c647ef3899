"""Intel Caffe's augmentations in transform_param (caffepy/data/augment.py through DataTransformer).

Per augmentation: its draws over many images against the documented distribution, its output
against a NumPy / OpenCV reference for a fixed draw, what TEST does; then the whole chain
through the Data and ImageData layers: independent of the thread count, raw = encoded = image
files, the checks made up front, and (mpiexec) 2 ranks against 1. The exact resume across a
snapshot is in tests/solvers/test_resume.py.
"""
import os
import subprocess
import sys
import textwrap

import cv2
import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng
from caffepy.data import augment
from caffepy.data.transformer import DataTransformer
from caffepy.errors import DataError
from caffepy.net import Net
from caffepy.proto import caffe_pb2
from data_helpers import data_net_text, make_db
from paths import REPO

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST
MEAN = np.array([104, 117, 123], np.float32)
# the ResNet-50 multinode recipes' transforms, at a small size (crop 224 -> 24, 256 -> 28)
RECIPE_TRAIN = ("crop_size: 24 mirror: true mean_value: 104 mean_value: 117 mean_value: 123 "
                "random_aspect_ratio_param { min_area_ratio: 0.08 max_area_ratio: 1 aspect_ratio_change: 0.75 "
                "resize_param { interp_mode: CUBIC } }")
RECIPE_TEST = ("crop_size: 24 mean_value: 104 mean_value: 117 mean_value: 123 "
               "random_resize_param { min_size: 28 max_size: 28 resize_param { interp_mode: CUBIC } }")
# every random augmentation at once
EVERYTHING = ("crop_size: 16 mirror: true mean_value: 100 scale: 0.5 "
              "distort_param { brightness_prob: 0.5 brightness_delta: 32 contrast_prob: 0.5 contrast_lower: 0.5 "
              "contrast_upper: 1.5 saturation_prob: 0.5 saturation_lower: 0.5 saturation_upper: 1.5 "
              "hue_prob: 0.5 hue_delta: 18 random_order_prob: 0.2 } "
              "expand_param { prob: 0.5 max_expand_ratio: 2 } "
              "random_aspect_ratio_param { min_area_ratio: 0.2 aspect_ratio_change: 0.75 "
              "resize_param { interp_mode: LINEAR interp_mode: CUBIC interp_mode: AREA } } "
              "noise_param { saltpepper: true saltpepper_param { fraction: 0.05 value: 255 } }")


def make(text, phase=TRAIN, seed=0):
    p = caffe_pb2.TransformationParameter()
    text_format.Parse(text, p)
    return DataTransformer(p, phase, np.random.default_rng(seed))


def param(cls, text):
    return text_format.Parse(text, getattr(caffe_pb2, cls)())


def photo(h, w, seed=0, c=3):
    """A smooth colour image with texture (H x W x C uint8), so every resize differs."""
    g = np.random.default_rng(seed)
    low = g.uniform(0, 255, (4, 5, c)).astype(np.float32)
    img = cv2.resize(low, (w, h), interpolation=cv2.INTER_CUBIC).reshape(h, w, c)
    return np.clip(img + g.normal(0, 20, img.shape), 0, 255).astype(np.uint8)


def chw(img):
    return np.ascontiguousarray(img.transpose(2, 0, 1))


def finish(hwc, mirrored, mean=MEAN, scale=1.0):
    """Caffe's last steps on a crop, as a reference: CHW float, mirror, (x - mean) * scale."""
    x = hwc.transpose(2, 0, 1).astype(np.float32)
    if mirrored:
        x = x[:, :, ::-1]
    return (x - mean[:, None, None]) * np.float32(scale)


def image_gen(draw):
    return np.random.Generator(np.random.PCG64(int(draw[3])))


def chi_square(counts):
    counts = np.asarray(counts, np.float64)
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


def close_layers(net):
    for layer in net.layers:
        if hasattr(layer, "close"):
            layer.close()


# -- random_aspect_ratio_param ----------------------------------------------------------------------
def test_aspect_regions_follow_the_documented_distribution():
    """Area fraction uniform in [min, max], side ratio r uniform in [change, 1 / change]
    (rows / cols = r^2, swapped half the time), position uniform."""
    p = param("RandomAspectRatioParameter", "min_area_ratio: 0.1 max_area_ratio: 0.3 aspect_ratio_change: 0.9")
    g = np.random.default_rng(1)
    h = w = 1000                          # every attempt fits: the first one is taken
    regions = np.array([augment.aspect_region(h, w, p, g) for _ in range(4000)], np.float64)
    y, x, rows, cols = regions.T
    area = rows * cols / (h * w)
    assert area.min() >= 0.1 * 0.99 and area.max() <= 0.3            # sides rounded down
    assert abs(area.mean() - 0.2) < 0.004 and abs(area.std() - 0.2 / np.sqrt(12)) < 0.003
    ratio = rows / cols
    assert ratio.min() >= 0.81 * 0.99 and ratio.max() <= 1 / 0.81 * 1.01
    assert abs((rows > cols).mean() - 0.5) < 0.03
    assert abs(np.log(ratio).mean()) < 0.005
    r = np.random.default_rng(0).uniform(0.9, 1 / 0.9, 10 ** 6)   # |log(rows / cols)| = 2 |log r|
    assert abs(np.abs(np.log(ratio)).mean() - 2 * np.abs(np.log(r)).mean()) < 0.003
    for pos, size, side in ((y, rows, h), (x, cols, w)):
        u = pos / (side - size)
        assert abs(u.mean() - 0.5) < 0.02 and chi_square(np.histogram(u, 4, (0, 1))[0]) < 16.3


def test_aspect_ratio_recipe_misses_as_often_as_the_documented_process():
    """The recipe's ranges on a square image: an attempt fits with the probability a direct
    simulation of the documented formula gives; with max_attempt 1 the misses fall back."""
    p = param("RandomAspectRatioParameter", "min_area_ratio: 0.08 max_area_ratio: 1 aspect_ratio_change: 0.75 "
              "max_attempt: 1")
    g = np.random.default_rng(2)
    found = [augment.aspect_region(256, 256, p, g) for _ in range(4000)]
    hits = np.array([f for f in found if f is not None], np.float64)
    s = np.random.default_rng(3)
    a, r = s.uniform(0.08, 1, 10 ** 6), s.uniform(0.75, 1 / 0.75, 10 ** 6)
    side = np.sqrt(a * 256 * 256)
    fits = (np.floor(side * r) <= 256) & (np.floor(side / r) <= 256)
    assert abs(len(hits) / len(found) - fits.mean()) < 0.025
    area = hits[:, 2] * hits[:, 3] / 256 ** 2
    assert area.min() >= 0.08 * 0.98 and area.max() <= 1
    assert abs(area.mean() - a[fits].mean()) < 0.015
    ratio = hits[:, 2] / hits[:, 3]
    assert ratio.min() >= 0.75 ** 2 * 0.97 and ratio.max() <= 0.75 ** -2 * 1.03


def test_aspect_ratio_output_against_reference():
    """The region the image's generator picks, resized to the crop by OpenCV (cubic),
    mirrored by the mirror coin, minus the mean; and the fallback (no attempt left): the
    shorter side resized to the crop, then a random crop."""
    t = make(RECIPE_TRAIN)
    img = photo(40, 50)
    p = t.param.random_aspect_ratio_param
    checked = set()
    for draw in t.draw(40):
        region = augment.aspect_region(40, 50, p, image_gen(draw))
        y, x, rows, cols = region
        want = finish(cv2.resize(img[y:y + rows, x:x + cols], (24, 24), interpolation=cv2.INTER_CUBIC),
                      draw[0] & 1)
        np.testing.assert_array_equal(t(chw(img), draw), want)
        checked.add(int(draw[0] & 1))
    assert checked == {0, 1}
    t = make(RECIPE_TRAIN.replace("aspect_ratio_change: 0.75", "aspect_ratio_change: 0.75 max_attempt: 0"))
    short = cv2.resize(img, (30, 24), interpolation=cv2.INTER_CUBIC)       # 40x50 -> 24 x int(50 / 40 * 24)
    offsets = set()
    for draw in t.draw(30):
        w_off = int(draw[2] % (30 - 24 + 1))
        offsets.add(w_off)
        np.testing.assert_array_equal(t(chw(img), draw), finish(short[:, w_off:w_off + 24], draw[0] & 1))
    assert offsets == set(range(7))


# -- random_resize_param ----------------------------------------------------------------------------
def test_random_resize_shorter_side_is_uniform():
    g = np.random.default_rng(4)
    resize = augment.Resize(caffe_pb2.ResizeParameter())
    img = photo(30, 40)
    sides = []
    for _ in range(1800):
        out = augment.random_resize(img, 12, 20, resize, g)
        assert out.shape[1] == int(np.float32(40) / np.float32(30) * np.float32(out.shape[0]))
        sides.append(out.shape[0])
    counts = np.bincount(sides, minlength=21)[12:]
    assert counts.sum() == 1800 and chi_square(counts) < 26.1        # 8 degrees of freedom, p = 0.001
    # 0 means the image's own sides: the shorter side between 30 and 40 (portrait: it is the width)
    sides = {augment.random_resize(img.transpose(1, 0, 2), 0, 0, resize, g).shape[1] for _ in range(400)}
    assert sides == set(range(30, 41))


def test_random_resize_test_phase_is_deterministic_and_matches_reference():
    """The recipe's TEST transform: shorter side to 28 (cubic), centre crop 24, mean; no draws."""
    img = photo(40, 50, seed=5)
    resized = cv2.resize(img, (35, 28), interpolation=cv2.INTER_CUBIC)     # 28 x int(50 / 40 * 28)
    want = finish(resized[2:26, 5:29], False)
    outs = [make(RECIPE_TEST, TEST, seed)(chw(img)) for seed in (0, 1)]
    np.testing.assert_array_equal(outs[0], want)
    np.testing.assert_array_equal(outs[1], want)
    t = make(RECIPE_TEST, TEST)
    state = t.gen.bit_generator.state
    assert not t.draw(8).any() and t.gen.bit_generator.state == state
    # random in TRAIN, as in Intel Caffe: the range is drawn from, the crop is random
    t = make(RECIPE_TEST.replace("max_size: 28", "max_size: 36"), TRAIN)
    outs = {t(chw(img)).tobytes() for _ in range(10)}
    assert len(outs) == 10


# -- resize_param -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, size, want", [
    ("WARP", (20, 30), lambda img: cv2.resize(img, (30, 20), interpolation=cv2.INTER_LINEAR)),
    ("FIT_SMALL_SIZE", (20, 20), lambda img: cv2.resize(img, (30, 20), interpolation=cv2.INTER_LINEAR)),
    ("FIT_LARGE_SIZE_AND_PAD", (30, 30), lambda img: cv2.copyMakeBorder(
        cv2.resize(img, (30, 20), interpolation=cv2.INTER_LINEAR), 5, 5, 0, 0, cv2.BORDER_CONSTANT,
        value=(7, 8, 9))),
])
def test_resize_modes_against_opencv_and_intels_top_shape(mode, size, want):
    """Without a crop the top takes resize_param's size (FIT_SMALL_SIZE: what the first record
    resizes to), as Intel Caffe's InferBlobShape."""
    img = photo(40, 60)
    t = make(f"resize_param {{ resize_mode: {mode} height: {size[0]} width: {size[1]} "
             f"pad_value: 7 pad_value: 8 pad_value: 9 }}", TEST)
    ref = want(img)
    assert t.check((3, 40, 60)) == (3,) + ref.shape[:2]
    np.testing.assert_array_equal(t(chw(img)), finish(ref, False, mean=np.zeros(3, np.float32)))


@pytest.mark.parametrize("pad_mode, border", [("MIRRORED", cv2.BORDER_REFLECT_101),
                                              ("REPEAT_NEAREST", cv2.BORDER_REPLICATE)])
def test_fit_large_size_pads_tall_images_at_the_sides(pad_mode, border):
    img = photo(60, 30)
    out = augment.Resize(param("ResizeParameter", f"resize_mode: FIT_LARGE_SIZE_AND_PAD height: 24 width: 24 "
                                                  f"pad_mode: {pad_mode} interp_mode: AREA"))(img, None)
    ref = cv2.copyMakeBorder(cv2.resize(img, (12, 24), interpolation=cv2.INTER_AREA), 0, 0, 6, 6, border)
    np.testing.assert_array_equal(out, ref)


def test_interpolation_is_drawn_uniformly_from_the_list():
    modes = {"LINEAR": cv2.INTER_LINEAR, "NEAREST": cv2.INTER_NEAREST, "CUBIC": cv2.INTER_CUBIC,
             "AREA": cv2.INTER_AREA}
    img = photo(31, 43)
    refs = {name: cv2.resize(img, (17, 13), interpolation=flag).tobytes() for name, flag in modes.items()}
    assert len(set(refs.values())) == 4
    resize = augment.Resize(param("ResizeParameter", "height: 13 width: 17 " +
                                  " ".join(f"interp_mode: {m}" for m in modes)))
    g = np.random.default_rng(6)
    by_output = {r: name for name, r in refs.items()}
    seen = [by_output[resize(img, g).tobytes()] for _ in range(800)]
    counts = [seen.count(name) for name in modes]
    assert chi_square(counts) < 16.3, counts                           # 3 degrees of freedom, p = 0.001


# -- distort_param ----------------------------------------------------------------------------------
def distort_many(text, img, n=3000, seed=7):
    p = param("DistortionParameter", text)
    g = np.random.default_rng(seed)
    return np.array([augment.distort(img, p, g) for _ in range(n)])


def test_brightness_adds_a_uniform_delta_with_its_probability():
    outs = distort_many("brightness_prob: 0.4 brightness_delta: 32", np.full((2, 2, 3), 128, np.uint8))
    delta = outs[:, 0, 0, 0].astype(np.float64) - 128
    assert (outs == outs[:, :1, :1, :1]).all()                          # one delta for every pixel
    changed = delta != 0
    assert abs(changed.mean() - 0.4) < 0.03
    d = delta[changed]
    assert d.min() >= -32 and d.max() <= 32
    assert abs(d.mean()) < 1.5 and abs(d.std() - 64 / np.sqrt(12)) < 1
    assert chi_square(np.histogram(d, 4, (-32.5, 32.5))[0]) < 16.3


def test_contrast_multiplies_by_a_uniform_factor():
    outs = distort_many("contrast_prob: 1 contrast_lower: 0.5 contrast_upper: 1.2", np.full((1, 1, 3), 200, np.uint8))
    factor = outs[:, 0, 0, 0] / 200
    assert factor.min() >= 0.5 - 0.003 and factor.max() <= 1.2 + 0.003
    assert abs(factor.mean() - 0.85) < 0.01 and abs(factor.std() - 0.7 / np.sqrt(12)) < 0.01


def hsv_pixel(h, s, v):
    return cv2.cvtColor(np.array([[[h, s, v]]], np.uint8), cv2.COLOR_HSV2BGR)


def test_saturation_and_hue_move_hsv_within_their_ranges():
    img = hsv_pixel(60, 100, 200)
    base = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)[0, 0].astype(int)
    sat = distort_many("saturation_prob: 1 saturation_lower: 0.5 saturation_upper: 1.5", img, 2000)
    s = np.array([cv2.cvtColor(o, cv2.COLOR_BGR2HSV)[0, 0, 1] for o in sat]) / base[1]
    assert s.min() > 0.45 and s.max() < 1.55 and abs(s.mean() - 1) < 0.03
    hue = distort_many("hue_prob: 0.5 hue_delta: 18", img, 2000)
    shift = np.array([cv2.cvtColor(o, cv2.COLOR_BGR2HSV)[0, 0, 0] for o in hue]).astype(int) - base[0]
    assert abs((shift != 0).mean() - 0.5) < 0.04
    assert shift.min() >= -19 and shift.max() <= 19 and abs(shift[shift != 0].mean()) < 1.5


def test_channel_order_shuffles_with_its_probability():
    img = np.array([[[10, 20, 30]]], np.uint8)
    outs = distort_many("random_order_prob: 0.6", img)
    perms = [tuple(o[0, 0]) for o in outs]
    counts = {p: perms.count(p) for p in set(perms)}
    assert len(counts) == 6
    assert abs(counts[(10, 20, 30)] / len(perms) - (0.4 + 0.6 / 6)) < 0.03
    others = [c for p, c in counts.items() if p != (10, 20, 30)]
    assert chi_square(others) < 18.5                                  # 4 degrees of freedom, p = 0.001


def test_the_order_coin_puts_contrast_before_or_after_saturation():
    """Intel's two orders: contrast second (then saturation) or last (after saturation), half
    the time each; references from OpenCV's HSV conversion."""
    img = photo(6, 6, seed=8)

    def contrast(x):
        return np.clip(np.rint(x.astype(np.float32) * np.float32(1.5)), 0, 255).astype(np.uint8)

    def saturation(x):
        hsv = cv2.cvtColor(x, cv2.COLOR_BGR2HSV)
        hsv[:, :, 1] = np.clip(np.rint(hsv[:, :, 1].astype(np.float32) * np.float32(0.5)), 0, 255)
        return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)

    first, last = saturation(contrast(img)).tobytes(), contrast(saturation(img)).tobytes()
    assert first != last
    outs = [o.tobytes() for o in distort_many("contrast_prob: 1 contrast_lower: 1.5 contrast_upper: 1.5 "
                                              "saturation_prob: 1 saturation_lower: 0.5 saturation_upper: 0.5",
                                              img, 1000)]
    assert set(outs) == {first, last} and abs(outs.count(first) / 1000 - 0.5) < 0.05


# -- expand_param -----------------------------------------------------------------------------------
def test_expand_ratio_is_uniform_and_the_canvas_is_the_mean():
    p = param("ExpansionParameter", "prob: 0.6 max_expand_ratio: 3")
    img = photo(20, 30, seed=9)
    fill = augment.expand_fill([104.4, 117, 250.6], 3, np.uint8)
    assert fill.tolist() == [104, 117, 251]
    g = np.random.default_rng(10)
    ratios, tops = [], []
    for _ in range(2000):
        out = augment.expand(img, p, fill, g)[0]
        if out is img:
            continue
        rows, cols = out.shape[:2]
        assert rows >= 20 and cols >= 30 and abs(rows / 20 - cols / 30) < 0.1
        top, left = np.argwhere((out != fill).any(axis=2))[0]          # the image's first pixel differs
        if not np.array_equal(out[top:top + 20, left:left + 30], img):
            top, left = next((t, l) for t in range(rows - 19) for l in range(cols - 29)
                             if np.array_equal(out[t:t + 20, l:l + 30], img))
        canvas = out.copy()
        canvas[top:top + 20, left:left + 30] = fill
        assert (canvas == fill).all()
        ratios.append(cols / 30)
        if rows > 20:
            tops.append((top + 0.5) / (rows - 20))         # top: uniform in [0, rows - 20), rounded down
    assert abs(len(ratios) / 2000 - 0.6) < 0.03
    r = np.array(ratios)
    assert r.min() >= 1 and r.max() <= 3 and abs(r.mean() - 2) < 0.04 and abs(r.std() - 2 / np.sqrt(12)) < 0.03
    assert abs(np.mean(tops) - 0.5) < 0.03


def test_expand_through_the_transformer_crops_from_the_canvas():
    """expand + crop in TEST: the centre of the canvas, against the reference canvas built
    from the image's own draws; float images are expanded with the exact mean."""
    t = make("crop_size: 20 mean_value: 50 expand_param { prob: 1 max_expand_ratio: 2 }", TEST)
    img = photo(20, 24, seed=11)
    for draw in t.draw(5) + np.arange(5)[:, None]:
        canvas = augment.expand(img, t.param.expand_param, np.full(3, 50, np.uint8), image_gen(draw))[0]
        h, w = canvas.shape[:2]
        top, left = (h - 20) // 2, (w - 20) // 2
        np.testing.assert_array_equal(t(chw(img), draw), finish(canvas[top:top + 20, left:left + 20], False,
                                                                 mean=np.full(3, 50, np.float32)))
    assert augment.expand_fill([0.25], 2, np.float32).tolist() == [0.25, 0.25]


# -- noise_param ------------------------------------------------------------------------------------
def _luma(img, fn):
    ycrcb = cv2.cvtColor(img, cv2.COLOR_BGR2YCrCb)
    ycrcb[:, :, 0] = fn(ycrcb[:, :, 0].copy())
    return cv2.cvtColor(ycrcb, cv2.COLOR_YCrCb2BGR)


NOISE = {
    "decolorize: true": lambda x: cv2.cvtColor(cv2.cvtColor(x, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR),
    "gauss_blur: true": lambda x: cv2.GaussianBlur(x, (7, 7), 1.5),
    "hist_eq: true": lambda x: _luma(x, cv2.equalizeHist),
    "clahe: true": lambda x: _luma(x, cv2.createCLAHE(clipLimit=4).apply),
    "jpeg: 30": lambda x: cv2.imdecode(cv2.imencode(".jpg", x, [cv2.IMWRITE_JPEG_QUALITY, 30])[1], cv2.IMREAD_COLOR),
    "erode: true": lambda x: cv2.erode(x, np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], np.uint8)),
    "posterize: true": lambda x: (x // 64 * 64 + 32).astype(np.uint8),
    "inverse: true": lambda x: 255 - x,
    "convert_to_hsv: true": lambda x: cv2.cvtColor(x, cv2.COLOR_BGR2HSV),
    "convert_to_lab: true": lambda x: cv2.cvtColor(x.astype(np.float32) / 255, cv2.COLOR_BGR2Lab),
    "hist_eq: true inverse: true": lambda x: 255 - _luma(x, cv2.equalizeHist),
    "decolorize: true gauss_blur: true posterize: true":
        lambda x: cv2.GaussianBlur(cv2.cvtColor(cv2.cvtColor(x, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR),
                                   (7, 7), 1.5) // 64 * 64 + 32,
}


@pytest.mark.parametrize("text", NOISE)
def test_noise_filters_against_opencv(text):
    """Each filter, and chains of them in Intel's order, on the resized image before the crop."""
    img = photo(32, 40, seed=12)
    t = make(f"crop_size: 24 resize_param {{ height: 30 width: 36 }} noise_param {{ {text} }}", TEST)
    ref = NOISE[text](cv2.resize(img, (36, 30), interpolation=cv2.INTER_LINEAR))
    np.testing.assert_allclose(t(chw(img)), finish(ref[3:27, 6:30], False, mean=np.zeros(3, np.float32)),
                               rtol=1e-6, atol=1e-4)


def test_salt_and_pepper_hits_the_fraction_of_pixels_uniformly():
    p = param("NoiseParameter", "saltpepper: true saltpepper_param { fraction: 0.1 value: 1 value: 2 value: 3 }")
    img = np.full((40, 50, 3), 128, np.uint8)
    g = np.random.default_rng(13)
    hits = np.zeros((40, 50))
    for _ in range(200):
        out = augment.noise(img, p, np.array([1, 2, 3], np.uint8), g)
        salted = (out != 128).any(axis=2)
        assert (out[salted] == [1, 2, 3]).all() and (out[~salted] == 128).all()
        hits += salted
    # 200 pixels drawn with replacement per image: 1 - (1 - 1/2000)^200 of them salted
    assert abs(hits.sum() / (200 * 2000) - (1 - (1 - 1 / 2000) ** 200)) < 0.004
    assert chi_square(hits.sum(axis=1)) < 73.4 and chi_square(hits.sum(axis=0)) < 85.4   # p = 0.001
    assert img.max() == 128                                                              # the input untouched


# -- crop_h / crop_w and flow -----------------------------------------------------------------------
def test_crop_h_crop_w_crop_a_rectangle():
    img = np.arange(2 * 6 * 8, dtype=np.uint8).reshape(2, 6, 8)
    t = make("crop_h: 3 crop_w: 5")
    assert t.check(img.shape) == (2, 3, 5)
    seen = {t.offsets(img.shape, d)[:2] for d in t.draw(500)}
    assert seen == {(h, w) for h in range(4) for w in range(4)}
    np.testing.assert_array_equal(make("crop_h: 3 crop_w: 5", TEST)(img), img[:, 1:4, 1:6])


def test_flow_inverts_the_x_flow_of_mirrored_images():
    img = np.arange(3 * 2 * 3, dtype=np.uint8).reshape(3, 2, 3)
    t = make("flow: true mirror: true mean_value: 1")
    out = np.empty((3, 2, 3), np.float32)
    t.transform(img, np.array([1, 0, 0]), out)
    want = img[:, :, ::-1].astype(np.float32) - 1
    want[2] = 255 - img[2, :, ::-1].astype(np.float32) - 1
    np.testing.assert_array_equal(out, want)
    t.transform(img, np.array([2, 0, 0]), out)
    np.testing.assert_array_equal(out, img.astype(np.float32) - 1)


# -- what every augmentation shares -----------------------------------------------------------------
def test_nets_without_the_new_fields_keep_their_random_stream():
    """Mirror and crop draw the same three columns as before the augmentations existed."""
    t = make("crop_size: 3 mirror: true", seed=5)
    np.testing.assert_array_equal(t.draw(4), np.random.default_rng(5).integers(0, 1 << 62, (4, 3), dtype=np.int64))


def test_an_image_depends_only_on_its_own_draw():
    """Transformed in another order (as other threads would), every image comes out the same."""
    t = make(EVERYTHING)
    imgs = [chw(photo(30, 36, seed=s)) for s in range(6)]
    draws = t.draw(6)
    forward = [t(img, d) for img, d in zip(imgs, draws)]
    backward = [t(img, d) for img, d in reversed(list(zip(imgs, draws)))][::-1]
    for a, b in zip(forward, backward):
        np.testing.assert_array_equal(a, b)
    assert len({f.tobytes() for f in forward}) == 6


def test_float_images_resize_but_refuse_8_bit_filters():
    img = np.random.default_rng(14).uniform(0, 1, (3, 20, 20)).astype(np.float32)
    assert make("crop_size: 8 random_resize_param { min_size: 10 max_size: 14 }")(img).shape == (3, 8, 8)
    with pytest.raises(DataError, match=r"^transform_param.noise_param: needs 8-bit images, got float32"):
        make("noise_param { inverse: true }")(img)


@pytest.mark.parametrize("text, message", [
    ("random_resize_param { min_size: 256 }", r"random_resize_param: needs crop_size"),
    ("crop_size: 8 random_resize_param { min_size: 20 max_size: 10 }",
     r"random_resize_param.min_size: larger than max_size \(10\), got 20"),
    ("crop_size: 8 random_resize_param { min_size: 6 max_size: 10 }",
     r"random_resize_param.min_size: smaller than the crop \(8\): the resized image must cover it, got 6"),
    ("crop_size: 8 random_resize_param { max_size: 7 }",
     r"random_resize_param.max_size: smaller than the crop \(8\): the resized image must cover it, got 7"),
    ("crop_size: 8 random_aspect_ratio_param { min_area_ratio: -0.1 }",
     r"random_aspect_ratio_param.min_area_ratio: must be in \(0, 1\], got -0.1"),
    ("crop_size: 8 random_aspect_ratio_param { min_area_ratio: 0 }",
     r"random_aspect_ratio_param.min_area_ratio: must be in \(0, 1\], got 0"),
    ("crop_size: 8 random_aspect_ratio_param { min_area_ratio: 0.6 max_area_ratio: 0.4 }",
     r"random_aspect_ratio_param.min_area_ratio: larger than max_area_ratio \(0.4\), got 0.6"),
    ("crop_size: 8 random_aspect_ratio_param { aspect_ratio_change: 1.5 }",
     r"random_aspect_ratio_param.aspect_ratio_change: must be in \(0, 1\], got 1.5"),
    ("crop_size: 8 random_aspect_ratio_param { } random_resize_param { }",
     r"random_aspect_ratio_param: give random_resize_param or random_aspect_ratio_param, not both"),
    ("distort_param { hue_prob: 1.5 }", r"distort_param.hue_prob: must be a probability in \[0, 1\], got 1.5"),
    ("distort_param { brightness_delta: -3 }", r"distort_param.brightness_delta: must be at least 0, got -3"),
    ("distort_param { contrast_lower: 1.5 contrast_upper: 0.5 }",
     r"distort_param.contrast_upper: smaller than contrast_lower \(1.5\), got 0.5"),
    ("crop_size: 8 expand_param { max_expand_ratio: 1 }", r"expand_param.max_expand_ratio: must be greater than 1"),
    ("crop_size: 8 expand_param { prob: -0.5 max_expand_ratio: 2 }", r"expand_param.prob: must be a probability"),
    ("expand_param { max_expand_ratio: 2 }", r"expand_param: makes images of varying size"),
    ("resize_param { height: 10 }", r"resize_param.width: must be positive"),
    ("resize_param { height: 10 width: 10 prob: 2 }", r"resize_param.prob: must be a probability"),
    ("noise_param { jpeg: 101 }", r"noise_param.jpeg: must be a JPEG quality up to 100"),
    ("noise_param { saltpepper: true saltpepper_param { fraction: 0.1 } }",
     r"noise_param.saltpepper_param.value: give the salt-and-pepper value"),
    ("crop_size: 8 crop_h: 4 crop_w: 4", r"crop_h: give crop_size or crop_h and crop_w, not both"),
    ("crop_h: 4", r"crop_h: set crop_h and crop_w together, got 4x0"),
])
def test_bad_parameters_are_one_line_naming_the_field(text, message):
    with pytest.raises(DataError, match="^transform_param." + message):
        make(text)


@pytest.mark.parametrize("text, shape, message", [
    ("crop_size: 24 resize_param { height: 20 width: 30 }", (3, 40, 40),
     r"crop_size: larger than what resize_param gives \(20x30\), got 24"),
    ("crop_size: 24 expand_param { max_expand_ratio: 2 }", (3, 20, 30), r"crop_size: larger than the image \(20x30\)"),
    ("crop_size: 24 random_resize_param { max_size: 40 }", (3, 20, 30),
     r"crop_size: larger than the shorter side of the image \(20x30\)"),
    ("crop_h: 24 crop_w: 8", (3, 20, 30), r"crop_h: larger than the image \(20x30\), got 24x8"),
    ("distort_param { hue_prob: 0.5 }", (1, 8, 8), r"distort_param.hue_prob: needs colour \(3-channel\) images"),
    ("noise_param { convert_to_hsv: true }", (1, 8, 8), r"noise_param.convert_to_hsv: needs colour"),
    ("resize_param { height: 8 width: 8 pad_value: 1 pad_value: 2 }", (3, 8, 8),
     r"resize_param.pad_value: give 1 value or one per channel \(3\), got 2"),
    ("flow: true", (2, 8, 8), r"flow: needs the x flow in channel 2, got 2 channel\(s\)"),
])
def test_what_an_input_cannot_go_through_is_found_up_front(text, shape, message):
    with pytest.raises(DataError, match="^transform_param." + message):
        make(text).check(shape)


def test_a_mean_file_cannot_follow_a_varying_size(tmp_path):
    from caffepy.blobproto import write_blobproto
    write_blobproto(np.zeros((1, 3, 8, 8), np.float32), tmp_path / "m.binaryproto")
    with pytest.raises(DataError, match=r"^transform_param.mean_file: cannot follow images whose size varies"):
        make(f'crop_size: 8 mean_file: "{tmp_path / "m.binaryproto"}" random_resize_param {{ min_size: 8 }}')
    with pytest.raises(DataError, match=r"^transform_param.mean_file: .*expand_param's canvas takes its colour"):
        make(f'mean_file: "{tmp_path / "m.binaryproto"}" resize_param {{ height: 8 width: 8 }} '
             f'expand_param {{ max_expand_ratio: 2 }}')
    # a fixed resize: the mean must be the resized size
    t = make(f'mean_file: "{tmp_path / "m.binaryproto"}" resize_param {{ height: 8 width: 8 }}')
    assert t.check((3, 20, 30)) == (3, 8, 8)


# -- through the data layers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 12 photos as a raw LMDB, a PNG-encoded LMDB and PNG files for ImageData."""
    root = tmp_path_factory.mktemp("augment")
    imgs = [photo(30 + 2 * (i % 3), 36, seed=100 + i) for i in range(12)]
    values = [chw(img) for img in imgs]
    out = {"raw": make_db(root / "raw", 12, values=values),
           "png": make_db(root / "png", 12, encoded=True, values=values)}
    lines = []
    for i, img in enumerate(imgs):
        cv2.imwrite(str(root / f"im{i}.png"), img)
        lines.append(f"im{i}.png {i}")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    out["images"] = root
    return out


def layer_text(sources, kind, batch, transform):
    if kind == "images":
        root = sources["images"]
        return (f'layer {{ name: "data" type: "ImageData" top: "data" top: "label"\n'
                f'  image_data_param {{ source: "{root / "list.txt"}" root_folder: "{root}/" batch_size: {batch} }}\n'
                f'  transform_param {{ {transform} }} }}\n')
    return data_net_text(sources[kind], batch, transform=transform)


def batches(sources, kind, transform, phase=TRAIN, n=3, batch=4, seed=5):
    rng.seed(seed)
    net = Net(text_format.Parse(layer_text(sources, kind, batch, transform), caffe_pb2.NetParameter()), phase=phase)
    try:
        out = []
        for _ in range(n):
            net.forward()
            out.append((net.blobs["data"].data.copy(), net.blobs["label"].data.copy()))
        return out
    finally:
        close_layers(net)
        rng.seed(-1)


@pytest.mark.parametrize("kind", ["png", "images"])
def test_batches_do_not_depend_on_the_thread_count(sources, kind, monkeypatch):
    monkeypatch.setenv("CAFFEPY_DATA_THREADS", "1")
    one = batches(sources, kind, EVERYTHING)
    monkeypatch.setenv("CAFFEPY_DATA_THREADS", "3")
    three = batches(sources, kind, EVERYTHING)
    for (a, la), (b, lb) in zip(one, three):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    assert not np.array_equal(one[0][0], batches(sources, kind, EVERYTHING, seed=6)[0][0])


def test_raw_encoded_and_image_files_give_the_same_batches(sources):
    """The recipe's TEST transform is deterministic: any seed, any source kind, the same data."""
    got = [batches(sources, kind, RECIPE_TEST, TEST, n=2, seed=seed)
           for kind, seed in (("raw", 1), ("png", 2), ("images", 3))]
    for other in got[1:]:
        for (a, la), (b, lb) in zip(got[0], other):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(la, lb)
    assert got[0][0][0].shape == (4, 3, 24, 24)


def test_the_recipes_train_transform_runs_on_every_source(sources):
    for kind in ("raw", "png", "images"):
        (data, _), = batches(sources, kind, RECIPE_TRAIN, n=1)
        assert data.shape == (4, 3, 24, 24) and np.isfinite(data).all()


# -- ranks -----------------------------------------------------------------------------------------
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
READER = textwrap.dedent("""
    import sys
    from google.protobuf import text_format
    from caffepy.parallel import mpi, world
    mpi.init_world()
    from caffepy import log, rng
    log.set_quiet(True)
    from caffepy.net import Net
    from caffepy.proto import caffe_pb2
    text, phase, steps = open(sys.argv[1]).read(), int(sys.argv[2]), int(sys.argv[3])
    rng.seed(7 + world.rank)
    net = Net(text_format.Parse(text, caffe_pb2.NetParameter()), phase=phase, context=world)
    seen = []
    for _ in range(steps):
        net.forward()
        seen.append({int(l): net.blobs["data"].data[i].tolist() for i, l in enumerate(net.blobs["label"].data)})
    everything = world.comm.gather(seen, root=0) if world.comm is not None else [seen]
    if world.rank == 0:
        print(repr(everything))
    mpi.finish()
""")


def read_ranks(tmp_path, ranks, sources, batch, transform, phase, steps=2):
    (tmp_path / "reader.py").write_text(READER)
    net = tmp_path / f"net_{ranks}_{phase}.prototxt"
    net.write_text(data_net_text(sources["png"], batch, transform=transform))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = ([MPIEXEC, "-n", str(ranks)] if ranks > 1 else []) + [sys.executable, str(tmp_path / "reader.py"),
                                                                 str(net), str(phase), str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")
def test_two_ranks_read_what_one_rank_reads(tmp_path, sources):
    """A shared DB: in TEST (deterministic) the union of the 2 ranks' images is exactly one
    rank's batch of twice the size; in TRAIN each rank augments its images with its own
    generator (as it crops and mirrors them): the same records, repeatable with the seed."""
    single = read_ranks(tmp_path, 1, sources, 4, RECIPE_TEST, TEST)[0]
    ranks = read_ranks(tmp_path, 2, sources, 2, RECIPE_TEST, TEST)
    for k in range(2):
        assert {**ranks[0][k], **ranks[1][k]} == single[k]
    single = read_ranks(tmp_path, 1, sources, 4, RECIPE_TRAIN, TRAIN)[0]
    ranks = read_ranks(tmp_path, 2, sources, 2, RECIPE_TRAIN, TRAIN)
    again = read_ranks(tmp_path, 2, sources, 2, RECIPE_TRAIN, TRAIN)
    assert ranks == again                                      # repeatable with the seed
    for k in range(2):
        assert {**ranks[0][k], **ranks[1][k]}.keys() == single[k].keys()
