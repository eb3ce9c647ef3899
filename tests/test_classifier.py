"""caffe.Classifier and caffe.Detector against a NumPy reference of pycaffe's documented steps:
resize, ten crops (corners, centre, mirrored) or the centre crop, transpose, channel swap,
raw scale, mean, input scale, a softmax classifier, averaging over the crops."""
import cv2
import numpy as np
import pytest

import caffepy as caffe
from caffepy.errors import CaffepyError

DEPLOY = """
name: "tiny_classifier"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {batch} dim: 3 dim: {h} dim: {w} }} }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param {{ num_output: 5 weight_filler {{ type: "gaussian" std: 0.05 }}
                         bias_filler {{ type: "gaussian" std: 0.5 }} }} }}
layer {{ name: "prob" type: "Softmax" bottom: "fc" top: "prob" }}
"""

MEAN = np.array([0.1, 0.2, 0.3], np.float32) * 255     # BGR, in the net's 0-255 space


@pytest.fixture
def model(tmp_path):
    """A deploy prototxt (batch 4, 3 x 4 x 5 crops) and trained-looking weights."""
    def make(batch=4, h=4, w=5):
        deploy = tmp_path / f"deploy_{batch}_{h}_{w}.prototxt"
        deploy.write_text(DEPLOY.format(batch=batch, h=h, w=w))
        caffe.set_random_seed(7)
        net = caffe.Net(str(deploy), caffe.TEST)
        weights = tmp_path / f"w_{batch}_{h}_{w}.caffemodel"
        net.save(str(weights))
        return str(deploy), str(weights), [p.data.copy() for p in net.params["fc"]]
    return make


def reference_scores(crops, w, b, input_scale=0.5):
    """Softmax of fc over crops (H x W x 3 RGB in [0, 1]) preprocessed as the Classifier does."""
    x = np.stack([c.transpose(2, 0, 1)[[2, 1, 0]] * 255 for c in crops])    # K x H x W, BGR, 0-255
    x = (x - MEAN[:, None, None]) * input_scale
    z = x.reshape(len(x), -1) @ w.T + b
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def ten_crops(image, ch, cw):
    h, w = image.shape[:2]
    corners = [(0, 0), (0, w - cw), (h - ch, 0), (h - ch, w - cw), (int(h / 2 - ch / 2), int(w / 2 - cw / 2))]
    crops = [image[y:y + ch, x:x + cw] for y, x in corners]
    return crops + [c[:, ::-1] for c in crops]


def images(n, h=9, w=11, seed=0):
    return [np.random.default_rng(seed + i).random((h, w, 3)).astype(np.float32) for i in range(n)]


@pytest.mark.parametrize("batch", [4, 30, 7])     # batches padded or not
def test_predict_oversampled_averages_ten_crops(model, batch):
    deploy, weights, (w, b) = model(batch=batch)
    clf = caffe.Classifier(deploy, weights, image_dims=(9, 11), mean=MEAN, input_scale=0.5, raw_scale=255,
                           channel_swap=(2, 1, 0))
    inputs = images(3)
    predictions = clf.predict(inputs)
    assert predictions.shape == (3, 5)
    expected = np.stack([reference_scores(ten_crops(im, 4, 5), w, b).mean(0) for im in inputs])
    np.testing.assert_allclose(predictions, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(predictions.sum(1), 1, rtol=1e-5)


def test_predict_centre_crop_and_resizing(model):
    deploy, weights, (w, b) = model()
    clf = caffe.Classifier(deploy, weights, image_dims=(8, 9), mean=MEAN, input_scale=0.5, raw_scale=255,
                           channel_swap=(2, 1, 0))
    assert clf.crop_dims.tolist() == [4, 5]
    inputs = images(2, h=16, w=13)
    predictions = clf.predict(inputs, oversample=False)
    # resized to 8 x 9 (bilinear), then rows 2..5 and columns 2..6 (centre (4, 4.5) -/+ (2, 2.5))
    resized = [cv2.resize(im, (9, 8), interpolation=cv2.INTER_LINEAR) for im in inputs]
    expected = reference_scores([r[2:6, 2:7] for r in resized], w, b)
    np.testing.assert_allclose(predictions, expected, rtol=1e-4, atol=1e-6)


def test_classifier_defaults_to_the_input_size(model):
    deploy, weights, (w, b) = model()
    clf = caffe.Classifier(deploy, weights)
    assert list(clf.image_dims) == [4, 5]
    assert clf.transformer.transpose["data"] == (2, 0, 1)
    assert "data" not in clf.transformer.mean and "data" not in clf.transformer.channel_swap
    im = images(1, h=4, w=5)[0]
    x = im.transpose(2, 0, 1).reshape(1, -1)
    z = x @ w.T + b
    expected = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(clf.predict([im], oversample=False), expected, rtol=1e-4, atol=1e-6)
    assert isinstance(clf, caffe.Net) and clf.phase == caffe.TEST


def test_classifier_needs_an_input_layer(tmp_path):
    deploy = tmp_path / "d.prototxt"
    deploy.write_text('layer { name: "d" type: "DummyData" top: "data" dummy_data_param { shape { dim: 1 dim: 3 } } }')
    with pytest.raises(CaffepyError, match="Classifier needs a deploy net whose first layer is an Input layer"):
        caffe.Classifier(str(deploy), None)


# -- Detector ----------------------------------------------------------------------

def write_image(path, rgb):
    cv2.imwrite(str(path), np.round(rgb[:, :, ::-1] * 255).astype(np.uint8))
    return np.round(rgb * 255) / 255


def test_detect_windows_classifies_each_window(model, tmp_path):
    deploy, weights, (w, b) = model(batch=2, h=4, w=5)
    det = caffe.Detector(deploy, weights, mean=MEAN, input_scale=0.5, raw_scale=255, channel_swap=(2, 1, 0))
    rng = np.random.default_rng(3)
    one = write_image(tmp_path / "one.png", rng.random((12, 14, 3)))
    two = write_image(tmp_path / "two.png", rng.random((10, 10, 3)))
    windows_one = np.array([[0, 0, 4, 5], [2, 3, 10, 13], [1, 1, 9, 6]])
    windows_two = np.array([[5, 5, 10, 10]])
    dets = det.detect_windows([(str(tmp_path / "one.png"), windows_one), (str(tmp_path / "two.png"), windows_two)])
    assert [d["filename"] for d in dets] == [str(tmp_path / "one.png")] * 3 + [str(tmp_path / "two.png")]
    assert [d["window"].tolist() for d in dets] == windows_one.tolist() + windows_two.tolist()
    crops = [one[y0:y1, x0:x1] for y0, x0, y1, x1 in windows_one] + [two[5:10, 5:10]]
    warped = [cv2.resize(c.astype(np.float32), (5, 4), interpolation=cv2.INTER_LINEAR) for c in crops]
    expected = reference_scores(warped, w, b)
    np.testing.assert_allclose(np.stack([d["prediction"] for d in dets]), expected, rtol=1e-4, atol=1e-5)


def test_context_padding_fills_outside_the_image_with_the_mean(model):
    deploy, weights, _ = model(batch=1, h=8, w=8)
    det = caffe.Detector(deploy, weights, mean=MEAN, raw_scale=255, channel_swap=(2, 1, 0), context_pad=2)
    assert det.crop_dims.tolist() == [8, 8, 3]
    np.testing.assert_allclose(det.crop_mean.reshape(3), [0.3, 0.2, 0.1], rtol=1e-6)   # RGB, 0-1 space
    im = np.random.default_rng(0).random((20, 20, 3)).astype(np.float32)
    crop = det.crop(im, np.array([0, 0, 9, 9]))
    # input 8 with a 2-pixel context border: the window is scaled by 8 / 4 = 2 around its centre
    # (5, 5) to the box (-5, -5, 15, 15), 21 pixels for 8 (8/21 per pixel); 5 pixels off the
    # image make round(5 * 8/21) = 2 rows and columns of mean; the 16 clipped pixels take the other 6
    assert crop.shape == (8, 8, 3)
    np.testing.assert_allclose(crop[:2], np.broadcast_to([0.3, 0.2, 0.1], (2, 8, 3)), rtol=1e-6)
    np.testing.assert_allclose(crop[:, :2], np.broadcast_to([0.3, 0.2, 0.1], (8, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(crop[2:, 2:], cv2.resize(im[0:15, 0:15], (6, 6), interpolation=cv2.INTER_LINEAR),
                               rtol=1e-6)
    # a window well inside the image has no mean border
    inner = det.crop(im, np.array([6, 6, 13, 13]))
    np.testing.assert_allclose(inner, cv2.resize(im[2:18, 2:18], (8, 8), interpolation=cv2.INTER_LINEAR), rtol=1e-6)
    # without context padding the crop is the window itself
    plain = caffe.Detector(deploy, weights)
    np.testing.assert_array_equal(plain.crop(im, np.array([1, 2, 5, 9])), im[1:5, 2:9])


def test_selective_search_needs_its_package(model):
    deploy, weights, _ = model()
    with pytest.raises(CaffepyError, match="needs the selective_search_ijcv_with_python package"):
        caffe.Detector(deploy, weights).detect_selective_search(["a.jpg"])


# -- caffepy classify / detect: BVLC's python/classify.py and detect.py ------------------------------

def run(*args):
    from click.testing import CliRunner
    from caffepy.cli import main
    return CliRunner().invoke(main, [str(a) for a in args])


def test_classify_command_on_a_folder_matches_the_ten_crop_reference(model, tmp_path):
    deploy, weights, (w, b) = model()
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(5)
    # classify.py globs *.jpg by default; --ext picks another; the images go in name order
    pixels = [write_image(folder / f"{name}.png", rng.random((12, 15, 3))) for name in ("b", "a", "c")]
    write_image(folder / "ignored.bmp", rng.random((12, 15, 3)))
    np.save(tmp_path / "mean.npy", MEAN)
    out = tmp_path / "predictions.npy"
    result = run("classify", folder, out, "--model_def", deploy, "--pretrained_model", weights,
                 "--images_dim", "9,11", "--mean_file", tmp_path / "mean.npy", "--input_scale", 0.5, "--ext", "png")
    assert result.exit_code == 0, result.output
    resized = [cv2.resize(p.astype(np.float32), (11, 9), interpolation=cv2.INTER_LINEAR) for p in pixels]
    expected = np.stack([reference_scores(ten_crops(r, 4, 5), w, b).mean(0) for r in (resized[1], resized[0], resized[2])])
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-4, atol=1e-6)
    # one image, the centre crop, no mean, gflags' spelling of the switch
    result = run("classify", folder / "a.png", tmp_path / "one", "--model_def", deploy, "--pretrained_model",
                 weights, "--images_dim", "4,5", "--mean_file", "", "-center_only", "--raw_scale", 255)
    assert result.exit_code == 0, result.output
    scaled = cv2.resize(pixels[1].astype(np.float32), (5, 4), interpolation=cv2.INTER_LINEAR)
    z = (scaled.transpose(2, 0, 1)[[2, 1, 0]] * 255).reshape(1, -1) @ w.T + b
    np.testing.assert_allclose(np.load(tmp_path / "one.npy"), np.exp(z) / np.exp(z).sum(), rtol=1e-4, atol=1e-6)


def test_classify_takes_a_mean_image_of_another_size_per_channel(model, tmp_path):
    # pycaffe's ImageNet mean is 256 x 256 for 227 x 227 crops: classify uses its channel means
    deploy, weights, (w, b) = model()
    image = write_image(tmp_path / "x.png", np.random.default_rng(1).random((4, 5, 3)))
    mean = np.broadcast_to(MEAN[:, None, None], (3, 7, 7)).copy()
    mean[:, 0, 0] += 70       # moves each channel's mean by 70 / 49
    np.save(tmp_path / "big_mean.npy", mean)
    got = caffe.classifier.classify(str(tmp_path / "x.png"), str(tmp_path / "o.npy"), deploy, weights,
                                    center_only=True, images_dim="4,5", mean_file=str(tmp_path / "big_mean.npy"))
    x = image.transpose(2, 0, 1)[[2, 1, 0]] * 255 - (MEAN + 70 / 49)[:, None, None]
    z = x.reshape(1, -1) @ w.T + b
    np.testing.assert_allclose(got, np.exp(z - z.max()) / np.exp(z - z.max()).sum(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--images_dim", "256"], "--images_dim: needs 'height,width', got '256'"),
    (["--channel_swap", "2,1,x"], "--channel_swap: needs comma-separated integers, got '2,1,x'"),
    ([], "--mean_file: cannot read the mean: No such file or directory, got "
         "'python/caffe/imagenet/ilsvrc_2012_mean.npy'. python/caffe/imagenet/ilsvrc_2012_mean.npy is "
         "pycaffe's ImageNet mean"),
])
def test_classify_mistakes_are_one_line(model, tmp_path, args, message):
    deploy, weights, _ = model()
    result = run("classify", tmp_path, tmp_path / "o.npy", "--model_def", deploy, "--pretrained_model", weights, *args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


@pytest.fixture
def windows_csv(model, tmp_path):
    deploy, weights, params = model(batch=2, h=4, w=5)
    rng = np.random.default_rng(3)
    one = write_image(tmp_path / "one.png", rng.random((12, 14, 3)))
    two = write_image(tmp_path / "two.png", rng.random((10, 10, 3)))
    # detect.py's header order (xmin before ymin); rows of one image need not be adjacent
    (tmp_path / "windows.csv").write_text(
        "filename,xmin,ymin,xmax,ymax\n"
        f"{tmp_path}/one.png,0,0,5,4\n{tmp_path}/two.png,5,5,10,10\n{tmp_path}/one.png,3,2,13,10\n")
    crops = [one[0:4, 0:5], one[2:10, 3:13], two[5:10, 5:10]]
    warped = [cv2.resize(c.astype(np.float32), (5, 4), interpolation=cv2.INTER_LINEAR) for c in crops]
    return deploy, weights, reference_scores(warped, *params, input_scale=1)


@pytest.mark.parametrize("ext", ["csv", "npy", "h5"])
def test_detect_command_writes_each_window_and_its_scores(windows_csv, tmp_path, ext):
    deploy, weights, expected = windows_csv
    if ext == "h5":
        h5py = pytest.importorskip("h5py")
    np.save(tmp_path / "mean.npy", np.broadcast_to(MEAN[:, None, None], (3, 6, 6)))   # detect.py averages it
    out = tmp_path / f"dets.{ext}"
    result = run("detect", tmp_path / "windows.csv", out, "--model_def", deploy, "--pretrained_model", weights,
                 "--crop_mode", "list", "--context_pad", 0, "--mean_file", tmp_path / "mean.npy")
    assert result.exit_code == 0, result.output
    names = [f"{tmp_path}/one.png"] * 2 + [f"{tmp_path}/two.png"]     # grouped by image, first seen first
    windows = [[0, 0, 4, 5], [2, 3, 10, 13], [5, 5, 10, 10]]           # ymin, xmin, ymax, xmax
    if ext == "csv":
        lines = out.read_text().splitlines()
        assert lines[0] == "filename,ymin,xmin,ymax,xmax,class0,class1,class2,class3,class4"
        rows = [line.split(",") for line in lines[1:]]
        assert [r[0] for r in rows] == names and [[float(v) for v in r[1:5]] for r in rows] == windows
        scores = np.array([[float(v) for v in r[5:]] for r in rows])
    elif ext == "npy":
        table = np.load(out)
        assert table["filename"].tolist() == names and table["window"].tolist() == windows
        scores = table["prediction"]
    else:
        with h5py.File(out) as f:
            assert [n.decode() for n in f["filename"][:]] == names and f["window"][:].tolist() == windows
            assert f["window"].attrs["columns"] == "ymin,xmin,ymax,xmax"
            scores = f["prediction"][:]
    np.testing.assert_allclose(scores, expected[[0, 1, 2]], rtol=1e-4, atol=1e-5)


def test_detect_mistakes_are_one_line(windows_csv, tmp_path):
    deploy, weights, _ = windows_csv
    common = ["--model_def", deploy, "--pretrained_model", weights, "--mean_file", ""]
    result = run("detect", tmp_path / "windows.csv", tmp_path / "o.csv", *common)
    assert result.exit_code == 1 and "needs the selective_search_ijcv_with_python package" not in result.output
    assert "a .txt of image files (--crop_mode selective_search)" in result.output
    (tmp_path / "bad.csv").write_text("filename,x0,ymin,xmax,ymax\na.png,1,2,3,4\n")
    result = run("detect", tmp_path / "bad.csv", tmp_path / "o.csv", "--crop_mode", "list", *common)
    assert result.exit_code == 1 and "bad.csv: line 1: the header needs the columns filename, xmin, ymin, " \
                                     "xmax, ymax; missing xmin" in result.output
    result = run("detect", tmp_path / "windows.csv", tmp_path / "o.txt", "--crop_mode", "list", *common)
    assert result.exit_code == 1 and "the extension chooses the format (.csv, .h5 or .npy)" in result.output
    # detect.py's default context_pad, 16, is for 227-pixel inputs
    result = run("detect", tmp_path / "windows.csv", tmp_path / "o.csv", "--crop_mode", "list", *common)
    assert result.exit_code == 1 and "Detector: context_pad: a border of 16 pixels on each side leaves no room " \
                                     "for the window in the 5-pixel input, got 16" in result.output
