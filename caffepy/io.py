"""pycaffe's caffe.io: array <-> BlobProto / Datum conversions, image helpers and the
input Transformer.

Images from load_image are H x W x K float32 in [0, 1], RGB (as pycaffe, which reads
with scikit-image); nets trained from Caffe databases expect BGR, hence the usual
    t = Transformer({"data": net.blobs["data"].data.shape})
    t.set_transpose("data", (2, 0, 1)); t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255); t.set_mean("data", mean_bgr)
    net.blobs["data"].data[...] = t.preprocess("data", load_image(path))
"""
import cv2
import numpy as np

from .blobproto import array_to_blobproto, blobproto_to_array  # noqa: F401
from .data.datum import array_to_datum  # noqa: F401
from .data.datum import datum_to_array as _datum_to_array
from .errors import CaffepyError, DataError
from .proto import caffe_pb2


# -- protos ---------------------------------------------------------------------
def arraylist_to_blobprotovector_str(arraylist):
    """A list of arrays as the serialized bytes of a BlobProtoVector."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(a) for a in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(text):
    """The arrays of a serialized BlobProtoVector."""
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(text)
    return [blobproto_to_array(b) for b in vec.blobs]


def datum_to_array(datum):
    """A Datum's pixels as a C x H x W array (uint8 for raw and encoded images, which
    are decoded in BGR order; float32 for float_data)."""
    return _datum_to_array(datum)


# -- images ---------------------------------------------------------------------
def load_image(filename, color=True):
    """An image file as H x W x 3 (color) or H x W x 1 float32 in [0, 1], RGB order."""
    img = cv2.imread(filename, cv2.IMREAD_UNCHANGED)
    if img is None:
        raise DataError(f"{filename}: cannot read the image")
    if img.dtype == np.uint16:
        img = img.astype(np.float32) / 65535.0
    else:
        img = img.astype(np.float32) / 255.0
    if img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, :3]
    if color:
        if img.ndim == 2:
            img = np.repeat(img[:, :, None], 3, axis=2)
        else:
            img = np.ascontiguousarray(img[:, :, ::-1])
    else:
        if img.ndim == 3:
            img = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
        img = img[:, :, None]
    return img


_INTERP = {0: cv2.INTER_NEAREST, 1: cv2.INTER_LINEAR, 2: cv2.INTER_CUBIC, 3: cv2.INTER_CUBIC}


def resize_image(im, new_dims, interp_order=1):
    """Resize an H x W x K image to new_dims (height, width); interp_order 0 nearest,
    1 bilinear (default), 2-3 bicubic. Any K; values keep their range."""
    im = np.asarray(im, np.float32)
    h, w = int(new_dims[0]), int(new_dims[1])
    if im.shape[:2] == (h, w):
        return im.copy()
    flag = _INTERP.get(interp_order, cv2.INTER_CUBIC)
    channels = im.shape[2] if im.ndim == 3 else None
    # cv2.resize takes at most 512 channels; resize in slices beyond that
    if channels and channels > 512:
        return np.concatenate([resize_image(im[:, :, k:k + 512], new_dims, interp_order)
                               for k in range(0, channels, 512)], axis=2)
    out = cv2.resize(im, (w, h), interpolation=flag)
    if channels is not None and out.ndim == 2:
        out = out[:, :, None]
    return out


def oversample(images, crop_dims):
    """Ten crops of each H x W x K image: the four corners and the centre, then the
    same five mirrored left-right. Returns (10 * N) x crop_h x crop_w x K float32."""
    images = [np.asarray(im) for im in images]
    ch, cw = int(crop_dims[0]), int(crop_dims[1])
    h, w, k = images[0].shape
    if ch > h or cw > w:
        raise DataError(f"oversample: crop {ch}x{cw} is larger than the image {h}x{w}")
    corners = [(0, 0), (0, w - cw), (h - ch, 0), (h - ch, w - cw),
               (int(h / 2.0 - ch / 2.0), int(w / 2.0 - cw / 2.0))]
    out = np.empty((10 * len(images), ch, cw, k), np.float32)
    for n, im in enumerate(images):
        for i, (y, x) in enumerate(corners):
            crop = im[y:y + ch, x:x + cw, :]
            out[10 * n + i] = crop
            out[10 * n + 5 + i] = crop[:, ::-1, :]
    return out


# -- the input Transformer ------------------------------------------------------
class Transformer:
    """Turns H x W x K images into net inputs and back (pycaffe's caffe.io.Transformer).

    preprocess: resize to the input's H x W, transpose, channel swap, raw scale,
    subtract mean, input scale; deprocess undoes the steps in reverse order.
    """

    def __init__(self, inputs):
        self.inputs = {name: tuple(shape) for name, shape in inputs.items()}
        self.transpose, self.channel_swap = {}, {}
        self.raw_scale, self.mean, self.input_scale = {}, {}, {}

    def _check(self, in_):
        if in_ not in self.inputs:
            raise CaffepyError(f"Transformer: '{in_}' is not one of the net inputs: "
                               f"{', '.join(self.inputs)}")

    def set_transpose(self, in_, order):
        """Axis order to go from the image (H x W x K) to the input (K x H x W): (2, 0, 1)."""
        self._check(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise CaffepyError(f"Transformer: '{in_}': transpose order must have "
                               f"{len(self.inputs[in_]) - 1} axes, got {tuple(order)}")
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_, order):
        """Channel order after transposing, e.g. (2, 1, 0) for RGB -> BGR."""
        self._check(in_)
        if len(order) != self.inputs[in_][1]:
            raise CaffepyError(f"Transformer: '{in_}': channel swap needs {self.inputs[in_][1]} "
                               f"channels, got {tuple(order)}")
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_, scale):
        """Multiply by this after the swap (255 for [0, 1] images and nets trained on 0-255)."""
        self._check(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """Subtract a per-channel mean (K values) or a K x H x W mean image."""
        self._check(in_)
        mean = np.asarray(mean, np.float32)
        shape = self.inputs[in_]
        if mean.ndim == 1:
            if mean.shape[0] != shape[1]:
                raise CaffepyError(f"Transformer: '{in_}': mean needs one value per channel "
                                   f"({shape[1]}), got {mean.shape[0]}")
            mean = mean[:, None, None]
        elif mean.shape != tuple(shape[1:]):
            raise CaffepyError(f"Transformer: '{in_}': mean shape {mean.shape} is incompatible with "
                               f"the input shape {tuple(shape)}")
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Multiply by this last, after mean subtraction."""
        self._check(in_)
        self.input_scale[in_] = scale

    def preprocess(self, in_, data):
        """H x W x K image -> K x H x W float32 input for blob `in_`."""
        self._check(in_)
        x = np.asarray(data, np.float32)
        in_dims = self.inputs[in_][2:]
        if x.shape[:2] != tuple(in_dims):
            x = resize_image(x, in_dims)
        if in_ in self.transpose:
            x = x.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            x = x[list(self.channel_swap[in_]), :, :]
        if in_ in self.raw_scale:
            x = x * self.raw_scale[in_]
        if in_ in self.mean:
            x = x - self.mean[in_]
        if in_ in self.input_scale:
            x = x * self.input_scale[in_]
        return np.ascontiguousarray(x, np.float32)

    def deprocess(self, in_, data):
        """Undo preprocess: K x H x W input -> H x W x K image."""
        self._check(in_)
        x = np.array(data, np.float32).squeeze()
        if in_ in self.input_scale:
            x = x / self.input_scale[in_]
        if in_ in self.mean:
            x = x + self.mean[in_]
        if in_ in self.raw_scale:
            x = x / self.raw_scale[in_]
        if in_ in self.channel_swap:
            x = x[list(np.argsort(self.channel_swap[in_])), :, :]
        if in_ in self.transpose:
            x = x.transpose(np.argsort(self.transpose[in_]))
        return x
