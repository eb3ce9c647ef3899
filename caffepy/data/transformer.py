"""transform_param: crop, mirror, mean subtraction and scaling of one C x H x W image.

Caffe's order, per output pixel (c, h, w) of a crop at (h_off, w_off):
    top[c, h, w'] = (image[c, h_off + h, w_off + w] - mean[c, h_off + h, w_off + w]) * scale
where w' = crop_w - 1 - w when the image is mirrored, else w; `mean` is the
mean_file image (cropped at the same offsets as the image) or mean_value[c].
Crops are random in TRAIN (h_off uniform in [0, H - crop]) and centred in TEST
((H - crop) / 2); with `mirror` every image is flipped with probability 1/2 in
both phases, as Caffe does.

With Intel Caffe's `pad` the output gets a border of zeros `pad` wide on every side
(the first convolution's padding, moved into the data layer); with mean_value, values are
then rounded to the nearest integer, as Intel Caffe does (its int8 input path).

Proto fields: scale, mirror, crop_size, mean_file, mean_value, force_color,
force_gray (the last two apply to encoded images), pad. Intel Caffe's augmentations
(resize, noise, distortion, expansion, random resize / aspect ratio, crop_h / crop_w,
emit_constraint, flow) are refused: caffepy does not run them.
"""
import weakref

import numpy as np

from ..errors import DataError
from ..proto import caffe_pb2


# Intel Caffe's TransformationParameter fields caffepy does not run (bgr2rgb is ImageData's)
NOT_RUN = ("resize_param", "noise_param", "emit_constraint", "crop_h", "crop_w", "distort_param",
           "expand_param", "random_resize_param", "random_aspect_ratio_param", "flow")


class DataTransformer:
    """Applies one TransformationParameter. `layer` (optional) names the layer in errors.

    Random draws come from `generator` (a NumPy Generator; the data layers seed
    one from caffepy.rng so a run with a fixed random_seed is repeatable).
    """

    def __init__(self, param, phase, generator=None, layer=None):
        self.param = param
        self.phase = phase
        # weak: the prefetch thread holds the transformer, and a strong reference would keep
        # the layer alive, so its finalizer (which stops that thread) would never run
        self.layer = weakref.proxy(layer) if layer is not None else None
        self.gen = generator if generator is not None else np.random.default_rng()
        self.scale = float(param.scale)
        self.crop = int(param.crop_size)
        self.mirror = bool(param.mirror)
        self.pad = int(param.pad)
        for field in NOT_RUN:
            if param.HasField(field):
                raise self._error(f"transform_param.{field}", "is an Intel Caffe augmentation caffepy "
                                  "does not run", hint="Remove it (caffepy would train without it)")
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

    def _error(self, field, problem, value=None, hint=None):
        if self.layer is not None:
            return self.layer.error(field, problem, value, hint, cls=DataError)
        field = field if field.startswith("transform_param") else f"transform_param.{field}"
        msg = f"{field}: {problem}"
        return DataError(msg + (f", got {value}" if value is not None else "") + (f". {hint}" if hint else ""))

    # -- shapes ----------------------------------------------------------
    def check(self, shape, where=""):
        """Check an input C x H x W shape against crop and mean; return the output shape."""
        c, h, w = shape
        if self.crop and (self.crop > h or self.crop > w):
            raise DataError(f"{where}transform_param.crop_size: larger than the image ({h}x{w}), got "
                            f"{self.crop}")
        if self.mean is not None and self.mean.shape != (c, h, w):
            raise DataError(f"{where}transform_param.mean_file: the mean is "
                            f"{'x'.join(map(str, self.mean.shape))} but the image is {c}x{h}x{w} "
                            f"(mean file '{self.param.mean_file}')")
        if self.mean_values is not None and len(self.mean_values) not in (1, c):
            raise DataError(f"{where}transform_param.mean_value: give 1 value or one per channel ({c}), "
                            f"got {len(self.mean_values)}")
        h, w = (self.crop, self.crop) if self.crop else (h, w)
        return c, h + 2 * self.pad, w + 2 * self.pad

    # -- randomness ------------------------------------------------------
    def draw(self, n):
        """Random numbers for n images: columns (mirror coin, crop h, crop w).

        Drawn apart from the transform so one thread draws in record order
        while several threads transform: results do not depend on the threads.
        """
        if not (self.mirror or (self.crop and self.phase == caffe_pb2.TRAIN)):
            return np.zeros((n, 3), np.int64)
        return self.gen.integers(0, 1 << 62, size=(n, 3), dtype=np.int64)

    def offsets(self, shape, draw):
        """(h_off, w_off, mirrored) for an image of `shape` given its draw row."""
        _, h, w = shape
        do_mirror = self.mirror and bool(draw[0] & 1)
        if not self.crop:
            return 0, 0, do_mirror
        if self.phase == caffe_pb2.TRAIN:
            return int(draw[1] % (h - self.crop + 1)), int(draw[2] % (w - self.crop + 1)), do_mirror
        return (h - self.crop) // 2, (w - self.crop) // 2, do_mirror

    # -- the transform ---------------------------------------------------
    def transform(self, image, draw, out, where=""):
        """Write the transformed C x H x W `image` (uint8 or float) into `out` (float32).

        Only NumPy ufuncs on whole arrays, so the work runs without the GIL.
        """
        shape = self.check(image.shape, where)
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
