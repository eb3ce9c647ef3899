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
import numpy as np

from . import io
from .errors import CaffepyError
from .net import TEST, Net


class Classifier(Net):
    def __init__(self, model_file, pretrained_file=None, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None):
        super().__init__(model_file, phase=TEST, weights=pretrained_file)
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
