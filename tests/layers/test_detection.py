"""SSD's detection layers (caffepy/layers/detection.py): Permute and Normalize against NumPy
and the gradient checker; PriorBox and DetectionOutput against boxes worked out by hand."""
import numpy as np
import pytest

from caffepy.errors import LayerError
from layer_cases import Case, case_tests, randn, setup_layer


def permute_ref(order):
    def ref(x):
        full = list(order) + [a for a in range(x.ndim) if a not in order]
        return [x.transpose(full)]
    return ref


def normalize_ref(across_spatial):
    def ref(x, layer):
        s = layer.blobs[0].data.astype(np.float64).reshape(-1)
        s = s.reshape(1, -1, 1, 1) if s.size > 1 else s
        axes = (1, 2, 3) if across_spatial else 1
        return [s * x / np.sqrt((x * x).sum(axis=axes, keepdims=True) + 1e-10)]
    return ref


def random_scale(layer):
    layer.blobs[0].data[...] = np.random.default_rng(3).uniform(0.5, 2.0, layer.blobs[0].shape)


CASES = [
    Case("Permute", "permute_param { order: 0 order: 2 order: 3 order: 1 }", [randn(2, 3, 4, 5)],
         expected=permute_ref((0, 2, 3, 1)), atol=0, rtol=0),
    Case("Permute", "permute_param { order: 1 }", [randn(2, 3, 4)], expected=permute_ref((1,)),
         atol=0, rtol=0),
]
for across in (True, False):
    for shared in (True, False):
        CASES.append(Case("Normalize", f"norm_param {{ across_spatial: {str(across).lower()} "
                                       f"channel_shared: {str(shared).lower()} }}",
                          [randn(2, 4, 3, 3, seed=5)], expected=normalize_ref(across), init=random_scale,
                          eps=1e-3, threshold=2e-3))

test_forward, test_gradient = case_tests(CASES)


def test_permute_and_normalize_refuse_what_caffe_refuses():
    with pytest.raises(LayerError, match=r"permute_param.order: names axis 2 twice"):
        setup_layer("Permute", "permute_param { order: 2 order: 2 }", [randn(1, 2, 3)])
    with pytest.raises(LayerError, match=r"permute_param.order: axis 3 is past the bottom's 3 axes"):
        setup_layer("Permute", "permute_param { order: 3 }", [randn(1, 2, 3)])


def prior_boxes(layer_hw, image_hw, min_size, max_size, ratios, step=None, offset=0.5):
    """SSD's default boxes at each pixel, written out the long way."""
    (h, w), (ih, iw) = layer_hw, image_hw
    sh, sw = (step, step) if step else (ih / h, iw / w)
    out = []
    for y in range(h):
        for x in range(w):
            cx, cy = (x + offset) * sw, (y + offset) * sh
            sides = [(min_size, min_size)]
            if max_size:
                sides.append((np.sqrt(min_size * max_size),) * 2)
            sides += [(min_size * np.sqrt(r), min_size / np.sqrt(r)) for r in ratios]
            for bw, bh in sides:
                out += [(cx - bw / 2) / iw, (cy - bh / 2) / ih, (cx + bw / 2) / iw, (cy + bh / 2) / ih]
    return np.array(out)


def test_prior_box_gives_ssds_boxes_in_its_order():
    params = ("prior_box_param { min_size: 2 max_size: 4 aspect_ratio: 2 aspect_ratio: 2 flip: true "
              "variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 }")
    layer, bottom, top = setup_layer("PriorBox", params, [randn(1, 5, 2, 3), randn(1, 3, 8, 12)])
    layer.forward(bottom, top)
    want = prior_boxes((2, 3), (8, 12), 2, 4, [2, 0.5])     # the repeated ratio counts once
    assert top[0].shape == (1, 2, 2 * 3 * 4 * 4)
    np.testing.assert_allclose(top[0].data[0, 0], want, rtol=1e-6)
    np.testing.assert_array_equal(top[0].data[0, 1].reshape(-1, 4), np.tile([0.1, 0.1, 0.2, 0.2], (24, 1)).astype(np.float32))
    # a fixed image size and step, no flip, clipped to the image, one variance for all
    params = ("prior_box_param { min_size: 6 aspect_ratio: 3 flip: false clip: true img_size: 10 step: 4 "
              "offset: 0 }")
    layer, bottom, top = setup_layer("PriorBox", params, [randn(1, 5, 2, 2), randn(1, 3, 99, 99)])
    layer.forward(bottom, top)
    want = np.clip(prior_boxes((2, 2), (10, 10), 6, None, [3], step=4, offset=0), 0, 1)
    np.testing.assert_allclose(top[0].data[0, 0], want, rtol=1e-6)
    assert (top[0].data[0, 1] == np.float32(0.1)).all()


def test_prior_box_refuses_bad_sizes():
    for params, words in [("", "min_size: needs at least one value"),
                          ("min_size: 4 max_size: 3", "max_size: must be greater than min_size"),
                          ("min_size: 4 variance: 0.1 variance: 0.2", "variance: takes one or four"),
                          ("min_size: 4 img_size: 9 img_h: 3", "give either img_size or img_h and img_w")]:
        with pytest.raises(LayerError, match=words):
            setup_layer("PriorBox", f"prior_box_param {{ {params} }}", [randn(1, 1, 2, 2), randn(1, 1, 4, 4)])


# three priors (corner boxes) with variances, three classes (0: background)
PRIORS = np.array([[0.1, 0.1, 0.3, 0.3], [0.12, 0.1, 0.32, 0.3], [0.6, 0.6, 0.9, 0.8]], np.float32)
VARIANCES = np.array([0.1, 0.1, 0.2, 0.2], np.float32)


def detect(loc, conf, params, n=1):
    prior = np.concatenate([PRIORS.reshape(-1), np.tile(VARIANCES, 3)]).reshape(1, 2, 12)
    layer, bottom, top = setup_layer("DetectionOutput", f"detection_output_param {{ num_classes: 3 {params} }}",
                                     [np.asarray(loc, np.float32).reshape(n, -1),
                                      np.asarray(conf, np.float32).reshape(n, -1), prior])
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return top[0].data.reshape(-1, 7)


def test_detection_output_decodes_suppresses_and_orders_by_label_then_score():
    # CENTER_SIZE with the variances: a prediction (dx, dy, dw, dh) moves the centre by
    # 0.1 * dx * width and scales the width by exp(0.2 * dw)
    loc = np.zeros((3, 4))
    loc[2] = [1.0, -1.0, 0.5, 0.0]
    conf = [[0.1, 0.7, 0.2], [0.1, 0.6, 0.3], [0.2, 0.3, 0.8]]
    out = detect(loc, conf, "code_type: CENTER_SIZE nms_param { nms_threshold: 0.45 }")
    w = 0.3 * np.exp(0.2 * 0.5)
    cx, cy = 0.75 + 0.1 * 0.3, 0.7 - 0.1 * 0.2
    third = [cx - w / 2, cy - 0.1, cx + w / 2, cy + 0.1]
    # class 1: prior 1 (0.6) overlaps prior 0 (0.7) by 0.82 and goes; prior 2 stays (0.3)
    # class 2: prior 2 (0.8), then priors 1 (0.3) and 0 (0.2) overlap each other: 0 goes
    want = [[0, 1, 0.7, *PRIORS[0]], [0, 1, 0.3, *third], [0, 2, 0.8, *third], [0, 2, 0.3, *PRIORS[1]]]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    # keep_top_k 2 keeps the two best over the classes (0.8 of class 2, 0.7 of class 1), by label
    out = detect(loc, conf, "code_type: CENTER_SIZE keep_top_k: 2 nms_param { nms_threshold: 0.45 }")
    np.testing.assert_allclose(out, [want[0], want[2]], rtol=1e-5, atol=1e-6)
    # a confidence threshold drops the low scores; nms top_k keeps each class's best candidates
    out = detect(loc, conf, "code_type: CENTER_SIZE confidence_threshold: 0.4 nms_param { nms_threshold: 0.45 }")
    np.testing.assert_allclose(out[:, 2], [0.7, 0.8])
    out = detect(loc, conf, "code_type: CENTER_SIZE nms_param { nms_threshold: 0.9 top_k: 1 }")
    np.testing.assert_allclose(out[:, :3], [[0, 1, 0.7], [0, 2, 0.8]])


def test_detection_output_code_types_and_the_empty_answer():
    loc = np.full((3, 4), 0.5)
    conf = [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    corner = detect(loc, conf, "code_type: CORNER")
    np.testing.assert_allclose(corner[0, 3:], PRIORS[0] + VARIANCES * 0.5, rtol=1e-6)
    size = detect(loc, conf, "code_type: CORNER_SIZE variance_encoded_in_target: true")
    np.testing.assert_allclose(size[0, 3:], PRIORS[0] + 0.5 * 0.2, rtol=1e-6)
    none = detect(np.zeros((2, 3, 4)), np.zeros((2, 3, 3)), "confidence_threshold: 0.5", n=2)
    np.testing.assert_array_equal(none, [[0, -1, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1, -1]])


def test_detection_output_with_a_location_per_class():
    loc = np.zeros((3, 3, 4))
    loc[0, 2] = [0.1, 0.1, 0.1, 0.1]            # prior 0's box for class 2 only
    conf = [[0.0, 0.9, 0.8], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    out = detect(loc, conf, "share_location: false code_type: CORNER confidence_threshold: 0.1")
    np.testing.assert_allclose(out[:, 3:], [PRIORS[0], PRIORS[0] + VARIANCES * 0.1], rtol=1e-6)


def test_detection_output_takes_intels_image_bottom_and_ignores_visualize(capsys):
    """Intel Caffe's webcam SSD gives DetectionOutput the images as a fourth bottom, to draw the
    detections (visualize); caffepy draws nothing, and the detections are the same."""
    from caffepy import log
    loc = np.zeros((3, 4))
    conf = [[0.1, 0.7, 0.2], [0.1, 0.6, 0.3], [0.2, 0.3, 0.8]]
    prior = np.concatenate([PRIORS.reshape(-1), np.tile(VARIANCES, 3)]).reshape(1, 2, 12)
    three = detect(loc, conf, "")
    log.set_quiet(False)
    try:
        layer, bottom, top = setup_layer(
            "DetectionOutput", "detection_output_param { num_classes: 3 visualize: true visualize_threshold: 0.6 }",
            [np.asarray(loc, np.float32).reshape(1, -1), np.asarray(conf, np.float32).reshape(1, -1), prior,
             np.zeros((1, 3, 8, 8), np.float32)])
    finally:
        log.set_quiet(True)
    assert "detection_output_param.visualize: caffepy does not draw detections" in capsys.readouterr().err
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data.reshape(-1, 7), three)


SSD = """name: "ssd_small"
input: "data" input_shape { dim: 2 dim: 3 dim: 32 dim: 32 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 8
  kernel_size: 3 stride: 4 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "norm" type: "Normalize" bottom: "conv" top: "norm" norm_param { across_spatial: false
  channel_shared: false scale_filler { type: "constant" value: 20 } } }
layer { name: "loc" type: "Convolution" bottom: "norm" top: "loc" convolution_param { num_output: 12
  kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "loc_perm" type: "Permute" bottom: "loc" top: "loc_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "loc_flat" type: "Flatten" bottom: "loc_perm" top: "loc_flat" }
layer { name: "conf" type: "Convolution" bottom: "norm" top: "conf" convolution_param { num_output: 12
  kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "conf_perm" type: "Permute" bottom: "conf" top: "conf_perm" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_perm" top: "conf_flat" }
layer { name: "priors" type: "PriorBox" bottom: "norm" bottom: "data" top: "priors" prior_box_param {
  min_size: 8 max_size: 16 aspect_ratio: 2 flip: false clip: true variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
layer { name: "conf_reshape" type: "Reshape" bottom: "conf_flat" top: "conf_reshape" reshape_param { shape { dim: 0 dim: -1 dim: 4 } } }
layer { name: "conf_softmax" type: "Softmax" bottom: "conf_reshape" top: "conf_softmax" softmax_param { axis: 2 } }
layer { name: "conf_out" type: "Flatten" bottom: "conf_softmax" top: "conf_out" }
layer { name: "detection" type: "DetectionOutput" bottom: "loc_flat" bottom: "conf_out" bottom: "priors"
  top: "detection" detection_output_param { num_classes: 4 share_location: true background_label_id: 0
  nms_param { nms_threshold: 0.45 top_k: 50 } code_type: CENTER_SIZE keep_top_k: 20 confidence_threshold: 0.2 } }
"""


def test_a_small_ssd_deploy_net_detects_and_times(tmp_path):
    """An SSD head in small (the layers as Intel's benchmark/ssd deploy net wires them): the
    detections are rows of seven with labels 1..3 and scores above the threshold, by image,
    label, then score; `caffepy time` runs every layer forward and backward."""
    import subprocess
    import sys

    import caffepy
    (tmp_path / "ssd.prototxt").write_text(SSD)
    net = caffepy.Net(str(tmp_path / "ssd.prototxt"), caffepy.TEST)
    net.blobs["data"].data[...] = np.random.default_rng(0).uniform(0, 1, net.blobs["data"].shape)
    out = net.forward()["detection"].reshape(-1, 7)
    assert net.blobs["priors"].shape == (1, 2, 8 * 8 * 3 * 4) and len(out) == 40     # 20 per image
    assert set(out[:, 0]) == {0, 1} and set(out[:, 1]) <= {1, 2, 3} and (out[:, 2] > 0.2).all()
    for i in (0, 1):
        rows = out[out[:, 0] == i]
        assert (np.diff(rows[:, 1]) >= 0).all()
        for label in set(rows[:, 1]):
            assert (np.diff(rows[rows[:, 1] == label, 2]) <= 0).all()
    result = subprocess.run([sys.executable, "-m", "caffepy.cli", "time", "-model", str(tmp_path / "ssd.prototxt"),
                             "-iterations", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "norm\tbackward" in result.stderr and "Average Forward-Backward" in result.stderr
