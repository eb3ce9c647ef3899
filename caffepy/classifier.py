"""pycaffe's caffe.Classifier: a TEST-phase Net that classifies H x W x K images.

    net = caffe.Classifier("deploy.prototxt", "weights.caffemodel", image_dims=(256, 256),
                           mean=mean_bgr, raw_scale=255, channel_swap=(2, 1, 0))
    probs = net.predict([caffe.io.load_image("cat.jpg")])       # N x classes

predict resizes every image to `image_dims`, then takes the net input's crop (H x W of the
first input blob): with `oversample` (the default) the four corners and the centre, and the
same five mirrored, averaging the ten predictions; without it, the centre crop only. Each crop
goes through a caffe.io.Transformer (transpose to K x H x W, then channel_swap, raw_scale,
mean, input_scale) and the net runs in batches of its batch size (forward_all).
"""
import glob
import io as _io
import os
import time

import numpy as np

from . import io, log
from .errors import CaffepyError
from .net import TEST, Net


class Classifier(Net):
    def __init__(self, model_file, pretrained_file=None, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None, keep_blobs=True):
        # keep_blobs=False: predict reads the output alone (Net, caffepy/net_memory.py)
        super().__init__(model_file, phase=TEST, weights=pretrained_file, keep_blobs=keep_blobs)
        self.transformer = make_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].data.shape[2:])
        self.image_dims = self.crop_dims if image_dims is None or not len(image_dims) else image_dims

    def predict(self, inputs, oversample=True):
        """(N x classes) predictions of the net's first output for N H x W x K images."""
        image_dims = [int(d) for d in self.image_dims]
        images = np.zeros((len(inputs), image_dims[0], image_dims[1], np.asarray(inputs[0]).shape[2]),
                          np.float32)
        for i, image in enumerate(inputs):
            images[i] = io.resize_image(image, image_dims)
        if oversample:
            crops = io.oversample(images, self.crop_dims)
        else:
            center = np.array(image_dims) / 2.0
            y0, x0 = (center - self.crop_dims / 2.0).astype(int)
            y1, x1 = (center + self.crop_dims / 2.0).astype(int)
            crops = images[:, y0:y1, x0:x1, :]
        in_ = self.inputs[0]
        batch = np.zeros((len(crops), crops.shape[3]) + tuple(crops.shape[1:3]), np.float32)
        for i, crop in enumerate(crops):
            batch[i] = self.transformer.preprocess(in_, crop)
        predictions = self.forward_all(**{in_: batch})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions


def make_transformer(net, mean, input_scale, raw_scale, channel_swap):
    """The Transformer pycaffe's Classifier and Detector configure for the net's first input."""
    if not net.inputs:
        raise CaffepyError(f"{net.source}: {type(net).__name__} needs a deploy net whose first layer is "
                           f"an Input layer (the images go there); this net has no inputs")
    in_ = net.inputs[0]
    t = io.Transformer({in_: net.blobs[in_].data.shape})
    t.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        t.set_mean(in_, mean)
    if input_scale is not None:
        t.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        t.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        t.set_channel_swap(in_, channel_swap)
    return t


# -- `caffepy classify`: BVLC's python/classify.py ------------------------------------------------
# Its defaults name files of a Caffe tree, found from its root as BVLC's script finds them.
REFERENCE_DEPLOY = "models/bvlc_reference_caffenet/deploy.prototxt"
REFERENCE_WEIGHTS = "models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel"
IMAGENET_MEAN = "python/caffe/imagenet/ilsvrc_2012_mean.npy"


def load_mean(path, flag="--mean_file"):
    """A mean as classify.py and detect.py take it: a .npy of K x H x W (or K values), or a
    Caffe .binaryproto (1 x K x H x W, as compute_image_mean writes); None for ''."""
    if not path:
        return None
    if path.endswith(".binaryproto"):
        from .blobproto import read_blobproto
        mean = read_blobproto(path)
        return mean[0] if mean.ndim == 4 else mean
    try:
        return np.load(path)
    except OSError as e:
        hint = (f". {IMAGENET_MEAN} is pycaffe's ImageNet mean, found from a Caffe tree's root; give "
                f"{flag} FILE, or {flag} '' for no mean subtraction") if path == IMAGENET_MEAN else ""
        raise CaffepyError(f"{flag}: cannot read the mean: {e.strerror or e}, got '{path}'{hint}") from None
    except ValueError as e:
        raise CaffepyError(f"{flag}: not a NumPy .npy file ({e}), got '{path}'") from None


def parse_ints(text, flag):
    """'2,1,0' -> [2, 1, 0] (classify.py's --channel_swap and --images_dim); '' -> None."""
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise CaffepyError(f"{flag}: needs comma-separated integers, got '{text}'") from None


def _input_images(input_file, ext):
    """classify.py's inputs: a .npy of images, every *.ext of a folder (sorted), or one image."""
    input_file = os.path.expanduser(input_file)
    if input_file.endswith("npy"):
        log.info(f"Loading file: {input_file}")
        return np.load(input_file)
    if os.path.isdir(input_file):
        log.info(f"Loading folder: {input_file}")
        files = sorted(glob.glob(os.path.join(glob.escape(input_file), "*." + ext)))
        if not files:
            raise CaffepyError(f"{input_file}: no *.{ext} images in the folder (--ext chooses the extension)")
        return [io.load_image(f) for f in files]
    log.info(f"Loading file: {input_file}")
    return [io.load_image(input_file)]


def classify(input_file, output_file, model_def=REFERENCE_DEPLOY, pretrained_model=REFERENCE_WEIGHTS,
             center_only=False, images_dim="256,256", mean_file=IMAGENET_MEAN, input_scale=None,
             raw_scale=255.0, channel_swap="2,1,0", ext="jpg"):
    """Classify an image, a folder of them or a .npy of them; save the N x classes predictions
    (ten-crop averages, or the centre crop) as a .npy. Returns the predictions."""
    image_dims = parse_ints(images_dim, "--images_dim")
    if image_dims is None or len(image_dims) != 2 or min(image_dims) < 1:
        raise CaffepyError(f"--images_dim: needs 'height,width', got '{images_dim}'")
    channel_swap = parse_ints(channel_swap, "--channel_swap")
    mean = load_mean(mean_file)
    classifier = Classifier(model_def, pretrained_model, image_dims=image_dims, input_scale=input_scale,
                            raw_scale=raw_scale, channel_swap=channel_swap)
    if mean is not None:
        crop = tuple(classifier.crop_dims)
        if mean.ndim == 3 and mean.shape[1:] != crop:
            # pycaffe refuses a mean image of another size than the crop (its own ImageNet mean is
            # 256 x 256 for 227 x 227 crops); its per-channel average is what users then pass
            log.info(f"Mean image {mean.shape[1]}x{mean.shape[2]} differs from the {crop[0]}x{crop[1]} "
                     f"input: subtracting its per-channel mean")
            mean = mean.mean(1).mean(1)
        classifier.transformer.set_mean(classifier.inputs[0], mean)
    inputs = _input_images(input_file, ext)
    log.info(f"Classifying {len(inputs)} inputs.")
    start = time.time()
    predictions = classifier.predict(inputs, not center_only)
    log.info(f"Done in {time.time() - start:.2f} s.")
    log.info(f"Saving results into {output_file}")
    from .prototxt import atomic_write
    buffer = _io.BytesIO()
    np.save(buffer, predictions)
    atomic_write(output_file if output_file.endswith(".npy") else output_file + ".npy", buffer.getvalue())
    return predictions
