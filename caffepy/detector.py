"""pycaffe's caffe.Detector: classify windows of images, as R-CNN does.

    det = caffe.Detector("deploy.prototxt", "weights.caffemodel", mean=mean_bgr, raw_scale=255,
                         channel_swap=(2, 1, 0), context_pad=16)
    dets = det.detect_windows([("cat.jpg", np.array([[10, 20, 110, 140]]))])
    # [{"window": ..., "prediction": class scores, "filename": "cat.jpg"}, ...]

A window is (ymin, xmin, ymax, xmax) in pixels. Each is cropped (`crop`), warped to the net
input's H x W by the Transformer (set up as caffe.Classifier's) and classified; the net runs
in batches of its batch size. With `context_pad` p, the crop is widened so that a p-pixel
border of the warped input is context around the window; where that border falls outside the
image it is filled with the mean (in image space, before preprocessing).
"""
import csv
import os
import time

import numpy as np

from . import io, log
from .classifier import (IMAGENET_MEAN, REFERENCE_DEPLOY, REFERENCE_WEIGHTS, load_mean, make_transformer,
                         parse_ints)
from .errors import CaffepyError
from .net import TEST, Net


def _round(x):
    # Python 2's round (half away from zero), which pycaffe's window arithmetic was written with
    return int(np.sign(x) * np.floor(abs(x) + 0.5))


class Detector(Net):
    def __init__(self, model_file, pretrained_file=None, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None, keep_blobs=True):
        # keep_blobs=False: detect_windows reads the output alone (Net, caffepy/net_memory.py)
        super().__init__(model_file, phase=TEST, weights=pretrained_file, keep_blobs=keep_blobs)
        self.transformer = make_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """Classify windows: `images_windows` is [(image file, [window, ...]), ...]; returns one
        {"window", "prediction", "filename"} dict per window, in order."""
        images_windows = [(name, [np.asarray(w) for w in windows]) for name, windows in images_windows]
        crops = []
        for filename, windows in images_windows:
            image = io.load_image(filename).astype(np.float32)
            crops.extend(self.crop(image, window) for window in windows)
        if not crops:
            return []
        in_ = self.inputs[0]
        batch = np.zeros((len(crops), crops[0].shape[2]) + self.blobs[in_].data.shape[2:], np.float32)
        for i, crop in enumerate(crops):
            batch[i] = self.transformer.preprocess(in_, crop)
        predictions = self.forward_all(**{in_: batch})[self.outputs[0]]
        detections = []
        for filename, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[len(detections)],
                                   "filename": filename})
        return detections

    def detect_selective_search(self, image_fnames):
        """Detect over Selective Search proposals (needs the selective_search_ijcv_with_python
        package and MATLAB, as pycaffe's)."""
        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError:
            raise CaffepyError("detect_selective_search: needs the selective_search_ijcv_with_python "
                               "package (and MATLAB), which is not installed; compute the windows with "
                               "any proposal method and call detect_windows([(image, windows), ...])") from None
        image_fnames = [os.path.abspath(f) for f in image_fnames]
        windows_list = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows_list))

    def crop(self, im, window):
        """The H x W x K region of `im` for `window` (ymin, xmin, ymax, xmax), with context
        padding when configured (then already of the net input's size)."""
        window = np.asarray(window)
        if not self.context_pad:
            return im[int(window[0]):int(window[2]), int(window[1]):int(window[3])]
        crop_size = self.blobs[self.inputs[0]].width      # square inputs, as pycaffe assumes
        scale = crop_size / (1.0 * crop_size - self.context_pad * 2)
        half_h = (window[2] - window[0] + 1) / 2.0
        half_w = (window[3] - window[1] + 1) / 2.0
        center = (window[0] + half_h, window[1] + half_w)
        box = np.round(np.tile(center, 2) + scale * np.array((-half_h, -half_w, half_h, half_w)))
        full_h, full_w = box[2] - box[0] + 1, box[3] - box[1] + 1
        scale_h, scale_w = crop_size / full_h, crop_size / full_w
        pad_y = _round(max(0, -box[0]) * scale_h)         # the part outside the image
        pad_x = _round(max(0, -box[1]) * scale_w)
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0.0, [im_h, im_w, im_h, im_w])
        clip_h, clip_w = box[2] - box[0] + 1, box[3] - box[1] + 1
        if clip_h <= 0 or clip_w <= 0:
            raise CaffepyError(f"Detector.crop: window {window.tolist()} lies outside the {im_h}x{im_w} image")
        crop_h = min(_round(clip_h * scale_h), crop_size - pad_y)
        crop_w = min(_round(clip_w * scale_w), crop_size - pad_x)
        box = box.astype(int)
        context = io.resize_image(im[box[0]:box[2], box[1]:box[3]], (crop_h, crop_w))
        crop = np.ones(self.crop_dims, np.float32) * self.crop_mean
        crop[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context
        return crop

    def configure_crop(self, context_pad):
        """Set the crop dimensions (the input's H x W x K) and, for context padding, the mean
        in image space (undoing the transpose, channel swap and raw scale)."""
        in_ = self.inputs[0]
        transpose = self.transformer.transpose[in_]
        inverse = [transpose[t] for t in transpose]
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inverse]
        self.context_pad = context_pad
        if not context_pad:
            return
        crop_size = self.blobs[in_].width
        if 2 * context_pad >= crop_size:
            raise CaffepyError(f"Detector: context_pad: a border of {context_pad} pixels on each side leaves no "
                               f"room for the window in the {crop_size}-pixel input, got {context_pad}")
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, np.float32)
            return
        crop_mean = mean.copy().transpose(inverse)
        channel_swap = self.transformer.channel_swap.get(in_)
        if channel_swap is not None:
            crop_mean = crop_mean[:, :, [list(channel_swap).index(i) for i in range(crop_mean.shape[2])]]
        raw_scale = self.transformer.raw_scale.get(in_)
        if raw_scale is not None:
            crop_mean = crop_mean / raw_scale
        self.crop_mean = crop_mean


# -- `caffepy detect`: BVLC's python/detect.py ----------------------------------------------------
CROP_MODES = ("list", "selective_search")
COORD_COLS = ("ymin", "xmin", "ymax", "xmax")


def read_windows(input_file):
    """detect.py's .csv input (a header naming filename, xmin, ymin, xmax, ymax, in any order)
    as [(filename, N x 4 windows as ymin, xmin, ymax, xmax)], one entry per image in order of
    first appearance, as pandas' unique() groups them."""
    try:
        with open(input_file, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise CaffepyError(f"{input_file}: cannot read the windows: {e.strerror}") from None
    header = [name.strip() for name in rows[0]] if rows else []
    missing = [name for name in ("filename",) + COORD_COLS if name not in header]
    if missing:
        raise CaffepyError(f"{input_file}: line 1: the header needs the columns filename, xmin, ymin, "
                           f"xmax, ymax; missing {', '.join(missing)}, got '{','.join(header)}'")
    columns = [header.index(name) for name in COORD_COLS]
    windows = {}
    for number, row in enumerate(rows[1:], 2):
        if not any(cell.strip() for cell in row):
            continue
        try:
            window = [float(row[c]) for c in columns]
        except (ValueError, IndexError):
            raise CaffepyError(f"{input_file}: line {number}: needs numbers in columns "
                               f"{', '.join(COORD_COLS)}, got '{','.join(row)}'") from None
        windows.setdefault(row[header.index("filename")].strip(), []).append(window)
    return [(name, np.array(w)) for name, w in windows.items()]


def _output_format(output_file):
    ext = os.path.splitext(output_file)[1].lower()
    if ext not in (".csv", ".h5", ".hdf5", ".npy"):
        raise CaffepyError(f"detect: output_file: the extension chooses the format (.csv, .h5 or .npy), "
                           f"got '{output_file}'")
    return ext


def save_detections(detections, output_file):
    """detect.py's outputs by extension: .csv (filename, ymin, xmin, ymax, xmax, class0..
    classN-1), .h5 (datasets filename, window, prediction through h5py), .npy (a structured
    array of those three fields)."""
    from .prototxt import atomic_path
    names = [d["filename"] for d in detections]
    windows = np.array([d["window"] for d in detections], np.float64).reshape(-1, 4)
    scores = np.array([np.asarray(d["prediction"]).ravel() for d in detections], np.float32)
    classes = scores.shape[1] if scores.ndim == 2 else 0
    ext = _output_format(output_file)
    with atomic_path(output_file) as tmp:
        if ext == ".csv":
            with open(tmp, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["filename", *COORD_COLS] + [f"class{c}" for c in range(classes)])
                for name, window, score in zip(names, windows, scores):
                    writer.writerow([name] + [repr(float(v)) for v in window] + [repr(float(v)) for v in score])
        elif ext == ".npy":
            table = np.zeros(len(names), dtype=[("filename", f"U{max(map(len, names), default=1)}"),
                                                ("window", np.float64, 4), ("prediction", np.float32, classes)])
            table["filename"], table["window"], table["prediction"] = names, windows, scores.reshape(-1, classes)
            with open(tmp, "wb") as f:
                np.save(f, table)
        else:
            from .net_hdf5 import require_h5py
            h5py = require_h5py("detect: a .h5 output")
            with h5py.File(tmp, "w") as f:
                f.create_dataset("filename", data=np.array(names, dtype=object), dtype=h5py.string_dtype())
                f.create_dataset("window", data=windows)
                f.create_dataset("prediction", data=scores.reshape(-1, classes))
                f["window"].attrs["columns"] = ",".join(COORD_COLS)


def detect(input_file, output_file, model_def=REFERENCE_DEPLOY, pretrained_model=REFERENCE_WEIGHTS,
           crop_mode="selective_search", mean_file=IMAGENET_MEAN, input_scale=None, raw_scale=255.0,
           channel_swap="2,1,0", context_pad=16):
    """Classify windows of images: with --crop_mode list, those of a .csv; with
    selective_search, Selective Search's proposals for the images a .txt lists. Saves one
    row per window (see save_detections); returns the detections."""
    _output_format(output_file)
    channel_swap = parse_ints(channel_swap, "--channel_swap")
    start = time.time()
    log.info("Loading input...")
    kind = input_file.lower()
    if crop_mode == "list":
        if not kind.endswith("csv"):
            raise CaffepyError(f"detect: --crop_mode list reads windows from a .csv (filename, xmin, ymin, "
                               f"xmax, ymax), got '{input_file}'")
        windows = read_windows(input_file)
    elif kind.endswith("txt"):
        try:
            with open(input_file) as f:
                images = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise CaffepyError(f"{input_file}: cannot read the image list: {e.strerror}") from None
    else:
        raise CaffepyError(f"detect: the input is a .txt of image files (--crop_mode selective_search) or "
                           f"a .csv of windows (--crop_mode list), got '{input_file}'")
    mean = load_mean(mean_file)
    if mean is not None and mean.ndim == 3 and mean.shape[1:] != (1, 1):
        mean = mean.mean(1).mean(1)      # detect.py's per-channel mean
    detector = Detector(model_def, pretrained_model, mean=mean, input_scale=input_scale, raw_scale=raw_scale,
                        channel_swap=channel_swap, context_pad=context_pad)
    if crop_mode == "list":
        detections = detector.detect_windows(windows)
    else:
        detections = detector.detect_selective_search(images)
    log.info(f"Processed {len(detections)} windows in {time.time() - start:.3f} s.")
    start = time.time()
    save_detections(detections, output_file)
    log.info(f"Saved to {output_file} in {time.time() - start:.3f} s.")
    return detections
