"""transform_param: Intel Caffe's augmentations, then crop, mirror, mean subtraction and
scaling of one C x H x W image.

Caffe's order, per output pixel (c, h, w) of a crop at (h_off, w_off):
    top[c, h, w'] = (image[c, h_off + h, w_off + w] - mean[c, h_off + h, w_off + w]) * scale
where w' = crop_w - 1 - w when the image is mirrored, else w; `mean` is the
mean_file image (cropped at the same offsets as the image) or mean_value[c].
Crops are random in TRAIN (h_off uniform in [0, H - crop]) and centred in TEST
((H - crop) / 2); with `mirror` every image is flipped with probability 1/2 in
both phases, as Caffe does. crop_size crops a square; Intel's crop_h and crop_w (set
together, without crop_size) a crop_h x crop_w rectangle (Intel Caffe declares them but
never reads them).

Before the crop, Intel Caffe's augmentations (caffepy/data/augment.py, which gives their
order and where caffepy departs from Intel's code): distort_param, expand_param,
random_resize_param or random_aspect_ratio_param, resize_param, noise_param. They run in
TEST as in TRAIN: what the TEST phase changes is the crop, centred; a TEST transform is
deterministic when it asks for nothing random (Intel's recipes: random_resize_param with
min_size = max_size, no mirror). The random ones need a crop, which gives every image one
size; the top's shape is the crop's, or resize_param's height x width without a crop (for
FIT_SMALL_SIZE, what the first record resizes to).

With Intel Caffe's `pad` the output gets a border of zeros `pad` wide on every side
(the first convolution's padding, moved into the data layer); with mean_value, values are
then rounded to the nearest integer, as Intel Caffe does (its int8 input path). With
Intel's `flow` (optical-flow images, x flow in channel 2) a mirrored image's channel 2
becomes 255 - value, before the mean.

Proto fields: scale, mirror, crop_size, crop_h, crop_w, mean_file, mean_value, force_color,
force_gray (the last two apply to encoded images), pad, flow and the augmentations above.
emit_constraint (which boxes survive a crop) is read by AnnotatedData alone
(caffepy/data/annotated.py); the other layers, which have no boxes, refuse it.
"""
import weakref

import numpy as np

from ..errors import DataError
from ..proto import caffe_pb2
from .augment import FIELDS as AUGMENTATIONS
from .augment import Augmentations


class DataTransformer:
    """Applies one TransformationParameter. `layer` (optional) names the layer in errors.

    Random draws come from `generator` (a NumPy Generator; the data layers seed
    one from caffepy.rng so a run with a fixed random_seed is repeatable).
    """

    def __init__(self, param, phase, generator=None, layer=None, boxes=False):
        self.param = param
        self.phase = phase
        # weak: the prefetch thread holds the transformer, and a strong reference would keep
        # the layer alive, so its finalizer (which stops that thread) would never run
        self.layer = weakref.proxy(layer) if layer is not None else None
        self.gen = generator if generator is not None else np.random.default_rng()
        self.scale = float(param.scale)
        self.mirror = bool(param.mirror)
        self.pad = int(param.pad)
        self.flow = bool(param.flow)
        if param.HasField("emit_constraint") and not boxes:
            raise self._error("transform_param.emit_constraint", "filters the boxes of a crop, and only "
                              "AnnotatedData has boxes", hint="Remove it")
        self.crop_h = self.crop_w = int(param.crop_size)
        self.crop_field, self.crop_text = "crop_size", str(self.crop_h)
        if param.crop_h or param.crop_w:
            if param.crop_size:
                raise self._error("transform_param.crop_h", "give crop_size or crop_h and crop_w, not both",
                                  f"crop_size {param.crop_size}, crop_h {param.crop_h}, crop_w {param.crop_w}")
            if not (param.crop_h and param.crop_w):
                raise self._error("transform_param.crop_h", "set crop_h and crop_w together",
                                  f"{param.crop_h}x{param.crop_w}")
            self.crop_h, self.crop_w = int(param.crop_h), int(param.crop_w)
            self.crop_field, self.crop_text = "crop_h", f"{self.crop_h}x{self.crop_w}"
        if self.pad and param.mean_file:
            raise self._error("transform_param.pad", "cannot be combined with mean_file (Intel Caffe "
                              "misaligns the mean then)", self.pad, hint="Give mean_value instead")
        self.mean = None            # C x H x W float32 (mean_file)
        self.mean_values = None     # C values (mean_value)
        if param.mean_file and len(param.mean_value):
            raise self._error("transform_param.mean_file", "give mean_file or mean_value, not both",
                              f"mean_file '{param.mean_file}' and {len(param.mean_value)} mean_value(s)")
        if param.mean_file:
            from ..blobproto import read_blobproto
            from ..errors import CaffepyError
            try:
                mean = read_blobproto(param.mean_file)
            except CaffepyError as e:
                raise self._error("transform_param.mean_file", f"cannot read the mean: {e}") from None
            except OSError as e:
                raise self._error("transform_param.mean_file", f"cannot read the mean: {e.strerror}",
                                  param.mean_file) from None
            if mean.ndim == 4 and mean.shape[0] == 1:
                mean = mean[0]
            if mean.ndim != 3:
                raise self._error("transform_param.mean_file", f"the mean in '{param.mean_file}' must be "
                                  f"1 x C x H x W or C x H x W",
                                  " x ".join(map(str, mean.shape)) or "a scalar")
            self.mean = np.ascontiguousarray(mean, np.float32)
        elif len(param.mean_value):
            self.mean_values = np.asarray(param.mean_value, np.float32)
        self.augment = None
        if any(param.HasField(field) for field in AUGMENTATIONS):
            self.augment = Augmentations(param, (self.crop_h, self.crop_w), self.crop_field, self.crop_text,
                                         self.mean_values, self._param_error)
            if self.mean is not None and (self.augment.varies or self.augment.expand):
                raise self._error("transform_param.mean_file", "cannot follow images whose size varies "
                                  "(expand_param, random_resize_param, random_aspect_ratio_param)",
                                  param.mean_file, hint="Give mean_value instead (expand_param's canvas "
                                  "takes its colour)")

    def _error(self, field, problem, value=None, hint=None):
        if self.layer is not None:
            return self.layer.error(field, problem, value, hint, cls=DataError)
        field = field if field.startswith("transform_param") else f"transform_param.{field}"
        msg = f"{field}: {problem}"
        return DataError(msg + (f", got {value}" if value is not None else "") + (f". {hint}" if hint else ""))

    def _param_error(self, field, problem, value=None, hint=None):
        """_error for `field` of transform_param, named without the prefix."""
        return self._error(f"transform_param.{field}", problem, value, hint)

    # -- shapes ----------------------------------------------------------
    def check(self, shape, where=""):
        """Check an input C x H x W shape against the augmentations, crop and mean; return
        the output shape."""
        if self.augment is not None:
            shape = self.augment.check(shape, where)
        return self._output_shape(shape, where)

    def _output_shape(self, shape, where):
        """The output shape for the C x H x W that reaches the crop (H, W None: it varies)."""
        c, h, w = shape
        if h is not None and self.crop_h and (self.crop_h > h or self.crop_w > w):
            raise DataError(f"{where}transform_param.{self.crop_field}: larger than the image ({h}x{w}"
                            f"{' after the augmentations' if self.augment is not None else ''}), got "
                            f"{self.crop_text}")
        if self.mean is not None and self.mean.shape != (c, h, w):
            raise DataError(f"{where}transform_param.mean_file: the mean is "
                            f"{'x'.join(map(str, self.mean.shape))} but the image is {c}x{h}x{w}"
                            f"{' after the augmentations' if self.augment is not None else ''} "
                            f"(mean file '{self.param.mean_file}')")
        if self.mean_values is not None and len(self.mean_values) not in (1, c):
            raise DataError(f"{where}transform_param.mean_value: give 1 value or one per channel ({c}), "
                            f"got {len(self.mean_values)}")
        if self.flow and c < 3:
            raise DataError(f"{where}transform_param.flow: needs the x flow in channel 2, got {c} "
                            f"channel(s)")
        h, w = (self.crop_h, self.crop_w) if self.crop_h else (h, w)
        return c, h + 2 * self.pad, w + 2 * self.pad

    # -- randomness ------------------------------------------------------
    def draw(self, n):
        """Random numbers for n images: columns (mirror coin, crop h, crop w), and the seed
        of the image's own generator when an augmentation is random.

        Drawn apart from the transform so one thread draws in record order
        while several threads transform: results do not depend on the threads.
        """
        if self.augment is not None and self.augment.random:
            return self.gen.integers(0, 1 << 62, size=(n, 4), dtype=np.int64)
        if not (self.mirror or (self.crop_h and self.phase == caffe_pb2.TRAIN)):
            return np.zeros((n, 3), np.int64)
        return self.gen.integers(0, 1 << 62, size=(n, 3), dtype=np.int64)

    def offsets(self, shape, draw):
        """(h_off, w_off, mirrored) for an image of `shape` (as it reaches the crop) given
        its draw row."""
        _, h, w = shape
        do_mirror = self.mirror and bool(draw[0] & 1)
        if not self.crop_h:
            return 0, 0, do_mirror
        if self.phase == caffe_pb2.TRAIN:
            return int(draw[1] % (h - self.crop_h + 1)), int(draw[2] % (w - self.crop_w + 1)), do_mirror
        return (h - self.crop_h) // 2, (w - self.crop_w) // 2, do_mirror

    def augmented(self, image, draw, where=""):
        """The C x H x W image after Intel's augmentations (the image itself without any)."""
        if self.augment is None:
            return image
        gen = np.random.Generator(np.random.PCG64(int(draw[3]))) if self.augment.random else None
        return self.augment.apply(image, gen, where).transpose(2, 0, 1)

    # -- the transform ---------------------------------------------------
    def transform(self, image, draw, out, where=""):
        """Write the transformed C x H x W `image` (uint8 or float) into `out` (float32).

        NumPy ufuncs on whole arrays and OpenCV, so the work runs without the GIL.
        """
        if self.augment is not None:
            image = self.augmented(image, draw, where)
        return self.finish(image, draw, out, where)

    def finish(self, image, draw, out, where=""):
        """The crop (at offsets(image.shape, draw)), pad, mirror, mean and scale of a C x H x W
        image the augmentations are done with, written into `out`."""
        shape = self._output_shape(image.shape, where)
        if out.shape != shape:
            raise DataError(f"{where}image of shape {'x'.join(map(str, image.shape))} does not give the "
                            f"{'x'.join(map(str, out.shape))} of the first record (records must share one "
                            f"size unless a crop makes them equal)")
        h_off, w_off, mirrored = self.offsets(image.shape, draw)
        full = out
        if self.pad:
            out[...] = 0
            p = self.pad
            out = out[:, p:out.shape[1] - p, p:out.shape[2] - p]
        ch, cw = out.shape[1], out.shape[2]
        src = image[:, h_off:h_off + ch, w_off:w_off + cw]
        if self.mean is not None:
            mean = self.mean[:, h_off:h_off + ch, w_off:w_off + cw]
        elif self.mean_values is not None:
            mean = self.mean_values[:, None, None] if len(self.mean_values) > 1 else self.mean_values[0]
        else:
            mean = None
        if mirrored and self.flow:      # the x flow changes sign with the image
            src = np.concatenate([src[:2], 255 - src[2:3], src[3:]])
        if mirrored:
            src = src[:, :, ::-1]
            if self.mean is not None:
                mean = mean[:, :, ::-1]
        if mean is None:
            if self.scale != 1:
                np.multiply(src, np.float32(self.scale), out=out, casting="unsafe")
            else:
                np.copyto(out, src, casting="unsafe")
        else:
            np.subtract(src, mean, out=out, casting="unsafe")
            if self.scale != 1:
                np.multiply(out, np.float32(self.scale), out=out)
            if self.pad and self.mean_values is not None:
                np.rint(out, out=out)
        return full

    def __call__(self, image, draw=None):
        """Transform one image into a new array (drawing its random numbers if not given)."""
        draw = self.draw(1)[0] if draw is None else draw
        out = np.empty(self.check(image.shape), np.float32)
        return self.transform(image, draw, out)
