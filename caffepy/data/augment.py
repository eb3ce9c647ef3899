"""Intel Caffe's image augmentations of transform_param, on one H x W x C image (OpenCV).

Intel Caffe's order, per image, in TRAIN and TEST alike (only the crop knows the phase):

    distort_param        photometric distortions, each with its own probability
    expand_param         the image placed at random on a larger canvas of the mean colour
    random_resize_param  the shorter side resized to a size uniform in [min_size, max_size]
      or random_aspect_ratio_param   a random region resized to the crop
    resize_param         a resize to height x width (WARP, FIT_SMALL_SIZE, FIT_LARGE_SIZE_AND_PAD)
    noise_param          fixed filters (blur, equalisation, JPEG, ...) and salt-and-pepper pixels

then DataTransformer's crop (random in TRAIN, centred in TEST), pad, mirror, mean and scale.

Every random choice of one image comes from that image's own generator (seeded by a
number DataTransformer.draw takes from the layer's generator in record order), so an
image's result does not depend on which thread transforms it, however many draws the
rejection loops and probabilities take.

Where Intel Caffe's code departs from what its fields say, caffepy follows the fields:
distort_param and expand_param run in Data and ImageData (Intel only in AnnotatedData,
and re-encodes the result as JPEG there), resize_param and noise_param apply to raw Datum
too (Intel: encoded only) and the crop is taken from the resized, noised image (Intel
crops the image from before them), the JPEG noise keeps a grey image grey, decolorize
leaves a grey image as it is, and convert_to_lab gives float Lab values (Intel reads them
as bytes). The `prob` of resize_param and noise_param is never read by Intel Caffe: every
image is resized and noised, here too (a warning says so). Saturation skips factors
within 1e-3 of 1, as contrast does (Intel converts to HSV and back even then).
"""
import math

import cv2
import numpy as np

from .. import log
from ..errors import DataError
from ..proto import caffe_pb2

RP = caffe_pb2.ResizeParameter
INTERP = {RP.LINEAR: cv2.INTER_LINEAR, RP.AREA: cv2.INTER_AREA, RP.NEAREST: cv2.INTER_NEAREST,
          RP.CUBIC: cv2.INTER_CUBIC, RP.LANCZOS4: cv2.INTER_LANCZOS4}
BORDER = {RP.CONSTANT: cv2.BORDER_CONSTANT, RP.MIRRORED: cv2.BORDER_REFLECT_101,
          RP.REPEAT_NEAREST: cv2.BORDER_REPLICATE}
F = np.float32      # Intel Caffe computes sizes and ratios in single precision: so do we

# the TransformationParameter fields this module runs
FIELDS = ("distort_param", "expand_param", "random_resize_param", "random_aspect_ratio_param",
          "resize_param", "noise_param")


def _hwc(img):
    return img[:, :, None] if img.ndim == 2 else img


def _lut(img, alpha, beta):
    """saturate(round(x * alpha + beta)) for every uint8 x (OpenCV's convertTo), as a lookup."""
    table = np.clip(np.rint(np.arange(256, dtype=F) * F(alpha) + F(beta)), 0, 255).astype(np.uint8)
    return _hwc(cv2.LUT(img, table))


def _need_uint8(img, field, where):
    if img.dtype != np.uint8:
        raise DataError(f"{where}transform_param.{field}: needs 8-bit images, got {img.dtype} pixels "
                        f"(a Datum of float_data)")


# -- resizing -------------------------------------------------------------------------------------
class Resize:
    """One ResizeParameter. height_scale / width_scale only map boxes (detection): not read."""

    def __init__(self, rp):
        self.mode, self.height, self.width = rp.resize_mode, int(rp.height), int(rp.width)
        self.interps = [INTERP[m] for m in rp.interp_mode] or [cv2.INTER_LINEAR]
        self.border = BORDER[rp.pad_mode]
        self.pad_value = [float(v) for v in rp.pad_value]
        self.random = len(self.interps) > 1

    def size(self, h, w, height=None, width=None):
        """(rows, cols) of an h x w image resized to height x width in this mode."""
        height, width = height or self.height, width or self.width
        if self.mode != RP.FIT_SMALL_SIZE:
            return height, width
        aspect = F(w) / F(h)
        if aspect < F(width) / F(height):
            return max(1, int(F(width) / aspect)), width
        return height, max(1, int(aspect * F(height)))

    def __call__(self, img, gen, height=None, width=None):
        """The image resized to height x width (this parameter's own unless given); the
        interpolation drawn uniformly from interp_mode (LINEAR when none is listed)."""
        height, width = height or self.height, width or self.width
        interp = self.interps[int(gen.integers(len(self.interps)))] if self.random else self.interps[0]
        h, w = img.shape[:2]
        if self.mode != RP.FIT_LARGE_SIZE_AND_PAD:
            rows, cols = self.size(h, w, height, width)
            return _hwc(cv2.resize(img, (cols, rows), interpolation=interp))
        aspect = F(w) / F(h)
        channels = img.shape[2]
        pad = self.pad_value * channels if len(self.pad_value) == 1 else self.pad_value or [0.0] * channels
        if aspect > F(width) / F(height):            # as wide as asked, bands above and below
            rows = max(1, int(F(width) / aspect))
            out = _hwc(cv2.resize(img, (width, rows), interpolation=interp))
            top = (height - rows) // 2
            out = cv2.copyMakeBorder(out, top, height - rows - top, 0, 0, self.border, value=pad)
        else:
            cols = max(1, int(aspect * F(height)))
            out = _hwc(cv2.resize(img, (cols, height), interpolation=interp))
            left = (width - cols) // 2
            out = cv2.copyMakeBorder(out, 0, 0, left, width - cols - left, self.border, value=pad)
        return _hwc(out)


def shorter_side(h, w, side):
    """(rows, cols) of an h x w image whose shorter side is resized to `side`, the longer in
    proportion (rounded down, in single precision, as Intel Caffe)."""
    if h < w:
        return side, int(F(w) / F(h) * F(side))
    return int(F(h) / F(w) * F(side)), side


def grid_ratio(gen, lo, hi):
    """Intel Caffe's random ratio: uniform over the multiples of 1/1000 from lo up to hi."""
    steps = int((F(hi) - F(lo)) * F(1000) + F(1))
    return (F(gen.integers(steps)) + F(lo) * F(1000)) / F(1000)


def random_resize(img, min_size, max_size, resize, gen, where=""):
    """The shorter side resized to a size uniform in [min_size, max_size] (0: the image's
    shorter / longer side)."""
    h, w = img.shape[:2]
    lo, hi = min_size or min(h, w), max_size or max(h, w)
    if lo > hi:
        raise DataError(f"{where}transform_param.random_resize_param.min_size: larger than max_size "
                        f"({hi}{' (0: the longer side of the image)' if not max_size else ''}), got {lo}"
                        f"{' (0: the shorter side of the image)' if not min_size else ''}")
    side = lo if lo == hi else int(gen.integers(lo, hi + 1))
    return resize(img, gen, *shorter_side(h, w, side))


def aspect_region(h, w, p, gen):
    """Intel Caffe's choice of region for random_aspect_ratio_param: (y, x, rows, cols), or
    None when no attempt of max_attempt fits. Each attempt draws an area fraction in
    [min_area_ratio, max_area_ratio] and a side ratio r in [change, 1 / change] (on Intel's
    1/1000 grid): rows = sqrt(area) * r, cols = sqrt(area) / r, swapped with probability
    about 1/2; a region that fits goes at a uniform position."""
    area = F(h * w)
    change = F(p.aspect_ratio_change)
    for _ in range(p.max_attempt):
        area_ratio = grid_ratio(gen, p.min_area_ratio, p.max_area_ratio)
        ratio = grid_ratio(gen, change, F(1) / change)
        side = np.sqrt(area_ratio * area)
        rows, cols = int(side * ratio), int(side / ratio)
        if grid_ratio(gen, 0, 1) < F(0.5):
            rows, cols = cols, rows
        if 0 < rows <= h and 0 < cols <= w:
            return int(gen.integers(h - rows + 1)), int(gen.integers(w - cols + 1)), rows, cols
    return None


def random_aspect_ratio(img, p, resize, crop_h, crop_w, gen):
    """A random region (aspect_region) resized to the crop; after max_attempt misses, the
    whole image with its shorter side resized to the crop's longer side. (image, region as
    (y, x, rows, cols) or None)."""
    h, w = img.shape[:2]
    region = aspect_region(h, w, p, gen)
    if region is None:
        return resize(img, gen, *shorter_side(h, w, max(crop_h, crop_w))), None
    y, x, rows, cols = region
    return resize(img[y:y + rows, x:x + cols], gen, crop_h, crop_w), region


# -- expansion --------------------------------------------------------------------------------------
def expand(img, p, fill, gen):
    """With probability `prob`, the image at a random place on a canvas `ratio` times as
    tall and as wide (ratio uniform in [1, max_expand_ratio]) filled with `fill` per channel.
    (image, its (top, left) on the canvas, or None when not expanded)."""
    if gen.random() > p.prob or abs(p.max_expand_ratio - 1) < 1e-2:
        return img, None
    ratio = F(gen.uniform(1, p.max_expand_ratio))
    h, w, c = img.shape
    rows, cols = int(F(h) * ratio), int(F(w) * ratio)
    top, left = math.floor(gen.uniform(0, rows - h)), math.floor(gen.uniform(0, cols - w))
    out = np.empty((rows, cols, c), img.dtype)
    out[...] = fill
    out[top:top + h, left:left + w] = img
    return out, (top, left)


def crop_box(img, box):
    """The part of an image a normalized box (clipped to [0, 1]) covers, in whole pixels as the
    fork's CropImage takes it (offsets and sizes truncated, at least one pixel): (the part, the
    normalized box of the pixels taken)."""
    h, w = img.shape[:2]
    x0, y0, x1, y1 = (F(v) for v in np.clip(np.asarray(box, F), 0, 1))
    left, top = int(x0 * F(w)), int(y0 * F(h))
    cols, rows = max(1, int(x1 * F(w) - x0 * F(w))), max(1, int(y1 * F(h) - y0 * F(h)))
    taken = np.array([left / F(w), top / F(h), (left + cols) / F(w), (top + rows) / F(h)], F)
    return img[top:top + rows, left:left + cols], taken


def per_channel(values, channels, field, where=""):
    """`values` (one, or one per channel) as one float per channel."""
    if len(values) not in (1, channels):
        raise DataError(f"{where}transform_param.{field}: give 1 value or one per channel ({channels}), "
                        f"got {len(values)}")
    return np.broadcast_to(np.asarray(values, np.float64), (channels,))


def expand_fill(mean_values, channels, dtype, where=""):
    """The canvas colour of expand_param: mean_value (rounded and clipped for 8-bit images), or 0."""
    if mean_values is None:
        return np.zeros(channels, dtype)
    values = per_channel(mean_values, channels, "mean_value", where)
    if dtype == np.uint8:
        return np.clip(np.rint(values), 0, 255).astype(np.uint8)
    return values.astype(dtype)


# -- distortion -------------------------------------------------------------------------------------
def _hsv_channel(img, channel, alpha, beta):
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    hsv[:, :, channel] = _lut(np.ascontiguousarray(hsv[:, :, channel]), alpha, beta)[:, :, 0]
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)


def distort(img, p, gen):
    """Intel Caffe's photometric distortion of a BGR uint8 image: a fair coin picks the order
    brightness, contrast, saturation, hue or brightness, saturation, hue, contrast, then a
    channel shuffle; each step runs with its probability, with a factor or offset uniform in
    its range: brightness adds [-delta, delta], contrast multiplies by [lower, upper],
    saturation multiplies HSV's S by [lower, upper], hue adds [-delta, delta] to HSV's H."""
    def brightness(x):
        if gen.random() < p.brightness_prob:
            delta = gen.uniform(-p.brightness_delta, p.brightness_delta)
            if delta != 0:
                return _lut(x, 1, delta)
        return x

    def contrast(x):
        if gen.random() < p.contrast_prob:
            factor = gen.uniform(p.contrast_lower, p.contrast_upper)
            if abs(factor - 1) > 1e-3:
                return _lut(x, factor, 0)
        return x

    def saturation(x):
        if gen.random() < p.saturation_prob:
            factor = gen.uniform(p.saturation_lower, p.saturation_upper)
            if abs(factor - 1) > 1e-3:
                return _hsv_channel(x, 1, factor, 0)
        return x

    def hue(x):
        if gen.random() < p.hue_prob:
            delta = gen.uniform(-p.hue_delta, p.hue_delta)
            if delta != 0:
                return _hsv_channel(x, 0, 1, delta)
        return x

    steps = (brightness, contrast, saturation, hue) if gen.random() > 0.5 else \
        (brightness, saturation, hue, contrast)
    for step in steps:
        img = step(img)
    if gen.random() < p.random_order_prob:
        img = np.ascontiguousarray(img[:, :, gen.permutation(3)])
    return img


# -- noise ------------------------------------------------------------------------------------------
def _luma(img, fn):
    """fn applied to the luma of a colour image (through YCrCb), or to a grey image."""
    if img.shape[2] == 1:
        return _hwc(fn(img))
    ycrcb = cv2.cvtColor(img, cv2.COLOR_BGR2YCrCb)
    ycrcb[:, :, 0] = fn(np.ascontiguousarray(ycrcb[:, :, 0]))
    return cv2.cvtColor(ycrcb, cv2.COLOR_YCrCb2BGR)


def noise(img, p, salt, gen):
    """Intel Caffe's noise_param, its filters in its order; `salt` the salt-and-pepper
    value per channel."""
    if p.decolorize and img.shape[2] == 3:
        img = cv2.cvtColor(cv2.cvtColor(img, cv2.COLOR_BGR2GRAY), cv2.COLOR_GRAY2BGR)
    if p.gauss_blur:
        img = _hwc(cv2.GaussianBlur(img, (7, 7), 1.5))
    if p.hist_eq:
        img = _luma(img, cv2.equalizeHist)
    if p.clahe:
        img = _luma(img, cv2.createCLAHE(clipLimit=4).apply)
    if p.jpeg > 0:
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, int(p.jpeg)])
        img = _hwc(cv2.imdecode(buf, cv2.IMREAD_COLOR if img.shape[2] == 3 else cv2.IMREAD_GRAYSCALE))
    if p.erode:
        img = _hwc(cv2.erode(img, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (3, 3), (1, 1))))
    if p.posterize:     # 4 levels per channel, each the middle of its quarter
        img = _hwc(cv2.LUT(img, (np.arange(256) // 64 * 64 + 32).astype(np.uint8)))
    if p.inverse:
        img = _hwc(cv2.bitwise_not(img))
    if p.saltpepper:
        h, w = img.shape[:2]
        count = math.floor(p.saltpepper_param.fraction * w * h)
        if count:
            img = img.copy()
            img[gen.integers(h, size=count), gen.integers(w, size=count)] = salt
    if p.convert_to_hsv:
        img = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    if p.convert_to_lab:
        img = cv2.cvtColor(img.astype(F) * F(1 / 255), cv2.COLOR_BGR2Lab)
    return img


# -- the whole chain --------------------------------------------------------------------------------
class Augmentations:
    """The augmentations a TransformationParameter asks for, checked once.

    `crop` is the (rows, cols) of the transformer's crop, (0, 0) without one, `crop_field`
    and `crop_text` the field that sets it and its value for messages; `mean_values`
    the mean_value list (expand_param's canvas colour); `error(field, problem, value, hint)`
    makes the caller's exception for a bad field.
    """

    def __init__(self, param, crop, crop_field, crop_text, mean_values, error):
        self.crop, self.crop_field, self.crop_text, self.mean_values = crop, crop_field, crop_text, mean_values
        self.distort = param.distort_param if param.HasField("distort_param") else None
        self.expand = param.expand_param if param.HasField("expand_param") else None
        self.resize = Resize(param.resize_param) if param.HasField("resize_param") else None
        self.noise = param.noise_param if param.HasField("noise_param") else None
        self.random_resize = self.random_aspect = self.inner = None
        if param.HasField("random_resize_param"):
            self.random_resize = param.random_resize_param
            self.inner = Resize(self.random_resize.resize_param)
        if param.HasField("random_aspect_ratio_param"):
            self.random_aspect = param.random_aspect_ratio_param
            self.inner = Resize(self.random_aspect.resize_param)
        self._validate(param, error)
        # does the image need its own generator?
        self.random = bool(self.distort or self.expand or self.random_aspect
                           or (self.resize and self.resize.random) or (self.inner and self.inner.random)
                           or (self.random_resize and (self.random_resize.min_size != self.random_resize.max_size
                                                       or not self.random_resize.min_size))
                           or (self.noise and self.noise.saltpepper and self.noise.saltpepper_param.fraction > 0))
        # the size reaching the crop varies from image to image of one size
        self.varies = bool(self.expand or self.random_resize or self.random_aspect) and not (
            self.resize and self.resize.mode != RP.FIT_SMALL_SIZE)

    def _validate(self, param, error):
        def probability(field, value):
            if not 0 <= value <= 1:
                raise error(field, "must be a probability in [0, 1]", f"{value:g}")

        def at_least(field, value, low):
            if value < low:
                raise error(field, f"must be at least {low:g}", f"{value:g}")

        if self.random_resize and self.random_aspect:
            raise error("random_aspect_ratio_param", "give random_resize_param or random_aspect_ratio_param, "
                        "not both (Intel Caffe runs only random_resize_param then)")
        for name in ("random_resize_param", "random_aspect_ratio_param"):
            if param.HasField(name) and not self.crop[0]:
                raise error(name, "needs crop_size (or crop_h and crop_w): the crop gives the images "
                            "their one size", hint="Set crop_size")
        if self.expand and not self.crop[0] and not (self.resize and self.resize.mode != RP.FIT_SMALL_SIZE):
            raise error("expand_param", "makes images of varying size: set crop_size, or a resize_param "
                        "of WARP or FIT_LARGE_SIZE_AND_PAD mode")
        if self.resize:
            for field in ("height", "width"):
                if getattr(self.resize, field) < 1:
                    raise error(f"resize_param.{field}", "must be positive (the size to resize to)",
                                getattr(self.resize, field))
            probability("resize_param.prob", param.resize_param.prob)
            if param.resize_param.prob != 1:
                log.warning(f"transform_param.resize_param.prob: {param.resize_param.prob:g} is not read "
                            f"(as in Intel Caffe): every image is resized")
        if self.random_resize:
            p = self.random_resize
            if p.min_size and p.max_size and p.min_size > p.max_size:
                raise error("random_resize_param.min_size", f"larger than max_size ({p.max_size})", p.min_size)
            for field in ("min_size", "max_size"):
                size = getattr(p, field)
                if size and size < max(self.crop) and not self.resize:
                    raise error(f"random_resize_param.{field}", f"smaller than the crop ({max(self.crop)}): "
                                f"the resized image must cover it", size)
        if self.random_aspect:
            p = self.random_aspect
            for field in ("min_area_ratio", "max_area_ratio", "aspect_ratio_change"):
                value = getattr(p, field)
                if not 0 < value <= 1:
                    raise error(f"random_aspect_ratio_param.{field}", "must be in (0, 1]", f"{value:g}")
            if p.min_area_ratio > p.max_area_ratio:
                raise error("random_aspect_ratio_param.min_area_ratio",
                            f"larger than max_area_ratio ({p.max_area_ratio:g})", f"{p.min_area_ratio:g}")
        if self.noise:
            p = self.noise
            probability("noise_param.prob", p.prob)
            if p.HasField("prob"):
                log.warning(f"transform_param.noise_param.prob: {p.prob:g} is not read (as in Intel Caffe): "
                            f"every image gets the noise")
            if p.jpeg > 100:
                raise error("noise_param.jpeg", "must be a JPEG quality up to 100 (or -1: none)", f"{p.jpeg:g}")
            if p.saltpepper:
                probability("noise_param.saltpepper_param.fraction", p.saltpepper_param.fraction)
                if not len(p.saltpepper_param.value):
                    raise error("noise_param.saltpepper_param.value", "give the salt-and-pepper value "
                                "(one, or one per channel)")
                for v in p.saltpepper_param.value:
                    if not 0 <= v <= 255:
                        raise error("noise_param.saltpepper_param.value", "must be a pixel value in [0, 255]",
                                    f"{v:g}")
        if self.distort:
            p = self.distort
            for field in ("brightness_prob", "contrast_prob", "saturation_prob", "hue_prob", "random_order_prob"):
                probability(f"distort_param.{field}", getattr(p, field))
            at_least("distort_param.brightness_delta", p.brightness_delta, 0)
            at_least("distort_param.hue_delta", p.hue_delta, 0)
            for kind in ("contrast", "saturation"):
                lower, upper = getattr(p, f"{kind}_lower"), getattr(p, f"{kind}_upper")
                at_least(f"distort_param.{kind}_lower", lower, 0)
                if upper < lower:
                    raise error(f"distort_param.{kind}_upper", f"smaller than {kind}_lower ({lower:g})",
                                f"{upper:g}")
        if self.expand:
            probability("expand_param.prob", self.expand.prob)
            if not self.expand.max_expand_ratio > 1:
                raise error("expand_param.max_expand_ratio", "must be greater than 1",
                            f"{self.expand.max_expand_ratio:g}")

    def check(self, shape, where=""):
        """The (C, H, W) that reaches the crop from a C x H x W input, H and W None where it
        varies from image to image; DataError for what this input cannot go through."""
        c, h, w = shape

        def bad(field, problem, value):
            return DataError(f"{where}transform_param.{field}: {problem}, got {value}")

        for field, resize in (("resize_param", self.resize),
                              ("random_resize_param.resize_param" if self.random_resize
                               else "random_aspect_ratio_param.resize_param", self.inner)):
            if resize and len(resize.pad_value) not in (0, 1, c):
                raise bad(f"{field}.pad_value", f"give 1 value or one per channel ({c})", len(resize.pad_value))
        if self.noise:
            p = self.noise
            if p.saltpepper and len(p.saltpepper_param.value) not in (1, c):
                raise bad("noise_param.saltpepper_param.value", f"give 1 value or one per channel ({c})",
                          len(p.saltpepper_param.value))
            for field in ("convert_to_hsv", "convert_to_lab"):
                if getattr(p, field) and c != 3:
                    raise bad(f"noise_param.{field}", "needs colour (3-channel) images", f"{c} channel(s)")
        if self.distort and c != 3:
            for field in ("saturation_prob", "hue_prob", "random_order_prob"):
                if getattr(self.distort, field) > 0:
                    raise bad(f"distort_param.{field}", "needs colour (3-channel) images", f"{c} channel(s)")
        if self.random_resize and not self.random_resize.min_size and min(h, w) < max(self.crop) \
                and not self.resize:
            raise bad(self.crop_field, f"larger than the shorter side of the image ({h}x{w}), which "
                      f"random_resize_param.min_size 0 keeps at least", self.crop_text)
        if self.expand and not (self.random_resize or self.random_aspect or self.resize) \
                and (self.crop[0] > h or self.crop[1] > w):
            raise bad(self.crop_field, f"larger than the image ({h}x{w})", self.crop_text)
        if self.resize:
            if self.crop[0] and (self.crop[0] > self.resize.height or self.crop[1] > self.resize.width):
                raise bad(self.crop_field, f"larger than what resize_param gives "
                          f"({self.resize.height}x{self.resize.width})", self.crop_text)
            if self.resize.mode != RP.FIT_SMALL_SIZE:
                return c, self.resize.height, self.resize.width
            if not self.varies:
                return (c,) + self.resize.size(h, w)
        return (c, None, None) if self.varies else (c, h, w)

    def apply(self, image, gen, where="", boxes=None, sample=None):
        """The augmented H x W x C image (uint8, or float32 from float data or convert_to_lab)
        of a C x H x W `image`.

        For AnnotatedData: `boxes` (caffepy.data.annotated.Annotations) follow the image
        through every step that moves its pixels; `sample(boxes, gen)` (the batch samplers)
        runs after the expansion and gives the normalized box to crop to, or None."""
        img = image.transpose(1, 2, 0)
        if not img.flags.c_contiguous:      # a raw Datum: OpenCV interleaves 20x faster than NumPy
            img = _hwc(cv2.merge([np.ascontiguousarray(channel) for channel in image]))
        if self.distort:
            _need_uint8(img, "distort_param", where)
            img = distort(img, self.distort, gen)
        if self.expand:
            h, w = img.shape[:2]
            img, placed = expand(img, self.expand, expand_fill(self.mean_values, img.shape[2], img.dtype, where),
                                 gen)
            if boxes is not None and placed is not None:
                (top, left), (rows, cols) = placed, img.shape[:2]
                boxes.reframe(np.array([-left / F(w), -top / F(h), (cols - left) / F(w), (rows - top) / F(h)], F))
        if sample is not None:
            box = sample(boxes, gen)
            if box is not None:
                img, taken = crop_box(img, box)
                boxes.reframe(taken)
        if self.random_resize:
            p = self.random_resize
            img = random_resize(img, p.min_size, p.max_size, self.inner, gen, where)
        elif self.random_aspect:
            h, w = img.shape[:2]
            img, region = random_aspect_ratio(img, self.random_aspect, self.inner, *self.crop, gen)
            if boxes is not None and region is not None:
                y, x, rows, cols = region
                boxes.reframe(np.array([x / F(w), y / F(h), (x + cols) / F(w), (y + rows) / F(h)], F))
        if self.resize:
            if boxes is not None:
                boxes.fit(self.resize, *img.shape[:2])
            img = self.resize(img, gen)
        if self.noise:
            _need_uint8(img, "noise_param", where)
            salt = per_channel(self.noise.saltpepper_param.value, img.shape[2], "noise_param.saltpepper_param.value",
                               where).astype(np.uint8) if self.noise.saltpepper else None
            img = noise(img, self.noise, salt, gen)
        return img
