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
import os

import numpy as np

from . import io
from .classifier import make_transformer
from .errors import CaffepyError
from .net import TEST, Net


def _round(x):
    # Python 2's round (half away from zero), which pycaffe's window arithmetic was written with
    return int(np.sign(x) * np.floor(abs(x) + 0.5))


class Detector(Net):
    def __init__(self, model_file, pretrained_file=None, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None):
        super().__init__(model_file, phase=TEST, weights=pretrained_file)
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
