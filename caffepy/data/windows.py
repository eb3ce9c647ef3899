"""WindowData's source: R-CNN window files, and batches of warped windows.

A window file repeats, for each image (whitespace-separated tokens):

    # <image index>
    <image path>            (prefixed with root_folder)
    <channels> <height> <width>
    <number of windows>
    <class> <overlap> <x1> <y1> <x2> <y2>      one line per window, corners inclusive

A window overlapping a ground-truth object by at least fg_threshold is foreground (its
class must be > 0); one below bg_threshold is background (class and overlap set to 0);
others are not used. Each batch holds batch_size - int(batch_size * fg_fraction)
background windows, then the foreground ones, each drawn uniformly from its list.

A window is cut out and warped (bilinear) to crop_size x crop_size. With context_pad or
crop_mode "square" (the longer side for both) it is first enlarged about its centre so that
after warping context_pad pixels of context surround it; the part past the image is
not read, and left as zeros at the same place in the crop. Mirroring flips the warped
window (and its padding). Values are (pixel - mean) * scale, the mean being the mean_file
image centre-cropped to crop_size, or mean_value per channel.
"""
import collections

import cv2
import numpy as np

from ..errors import DataError
from .sources import read_image


class Window:
    __slots__ = ("image", "label", "overlap", "x1", "y1", "x2", "y2")

    def __init__(self, image, label, overlap, x1, y1, x2, y2):
        self.image, self.label, self.overlap = image, label, overlap
        self.x1, self.y1, self.x2, self.y2 = x1, y1, x2, y2


def read_window_file(path, root_folder="", fg_threshold=0.5, bg_threshold=0.5):
    """(images, foreground, background, channels): images is [(path, (C, H, W))], the two
    window lists hold Window objects (image = its position in `images`)."""
    try:
        with open(path) as f:
            tokens = f.read().split()
    except OSError as e:
        raise DataError(f"{path}: cannot read the window file: {e.strerror}") from None
    if not tokens:
        raise DataError(f"{path}: the window file is empty")
    images, fg, bg = [], [], []
    pos = 0

    def take(n, what):
        nonlocal pos
        if pos + n > len(tokens):
            raise DataError(f"{path}: image {len(images)}: the file ends inside its {what}")
        out = tokens[pos:pos + n]
        pos += n
        return out

    while pos < len(tokens):
        hashtag, index = take(2, "header ('# <index>')")
        if hashtag != "#":
            raise DataError(f"{path}: image {len(images)}: expected '# <image index>', got "
                            f"'{hashtag} {index}'")
        (image_path,) = take(1, "image path")
        try:
            shape = tuple(int(v) for v in take(3, "channels, height and width"))
            (count,) = (int(v) for v in take(1, "number of windows"))
            for _ in range(count):
                label, overlap, x1, y1, x2, y2 = take(6, "windows")
                w = Window(len(images), int(label), float(overlap), int(x1), int(y1), int(x2), int(y2))
                if w.overlap >= fg_threshold:
                    if w.label <= 0:
                        raise DataError(f"{path}: image '{image_path}': a foreground window (overlap "
                                        f"{w.overlap:g}) needs a class > 0, got {w.label}")
                    fg.append(w)
                elif w.overlap < bg_threshold:
                    w.label, w.overlap = 0, 0.0
                    bg.append(w)
        except ValueError as e:
            raise DataError(f"{path}: image '{image_path}': expected numbers: {e}") from None
        images.append((root_folder + image_path, shape))
    return images, fg, bg, images[0][1][0]


def _round(x):
    """C's round() of a float: halves away from zero."""
    return int(np.sign(x) * np.floor(np.abs(x) + np.float32(0.5)))


def window_crop(image, window, crop_size, context_pad=0, square=False, mirror=False):
    """The warped window of an H x W x C uint8 image: (patch, pad_h, pad_w), `patch` the
    warped (and mirrored) pixels to put at (pad_h, pad_w) of the crop_size square.
    Arithmetic in float32 with C rounding, as Caffe's WindowData."""
    f32 = np.float32
    x1, y1, x2, y2 = window.x1, window.y1, window.x2, window.y2
    rows, cols = image.shape[:2]
    out_h = out_w = crop_size
    pad_h = pad_w = 0
    if context_pad > 0 or square:
        context_scale = f32(crop_size) / f32(crop_size - 2 * context_pad)
        half_h, half_w = f32(y2 - y1 + 1) / f32(2), f32(x2 - x1 + 1) / f32(2)
        center_x, center_y = f32(x1) + half_w, f32(y1) + half_h
        if square:
            half_h = half_w = max(half_h, half_w)
        x1, x2 = _round(center_x - half_w * context_scale), _round(center_x + half_w * context_scale)
        y1, y2 = _round(center_y - half_h * context_scale), _round(center_y + half_h * context_scale)
        unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
        pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
        pad_x2, pad_y2 = max(0, x2 - cols + 1), max(0, y2 - rows + 1)
        x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
        scale_x, scale_y = f32(crop_size) / f32(unclipped_w), f32(crop_size) / f32(unclipped_h)
        out_w, out_h = _round(f32(x2 - x1 + 1) * scale_x), _round(f32(y2 - y1 + 1) * scale_y)
        pad_x1, pad_x2 = _round(f32(pad_x1) * scale_x), _round(f32(pad_x2) * scale_x)
        pad_h = _round(f32(pad_y1) * scale_y)
        pad_w = pad_x2 if mirror else pad_x1
        # rounding may push the warped window past the crop
        out_h, out_w = min(out_h, crop_size - pad_h), min(out_w, crop_size - pad_w)
    if x1 < 0 or y1 < 0 or x2 >= cols or y2 >= rows or x2 < x1 or y2 < y1:
        raise ValueError(f"window ({window.x1}, {window.y1}, {window.x2}, {window.y2}) does not lie in "
                         f"the {cols}x{rows} image")
    patch = cv2.resize(image[y1:y2 + 1, x1:x2 + 1], (out_w, out_h), interpolation=cv2.INTER_LINEAR)
    if patch.ndim == 2:
        patch = patch[:, :, None]
    if mirror:
        patch = patch[:, ::-1]
    return patch, pad_h, pad_w


class WindowFiller:
    """Fills {'data': (b, C, crop, crop), 'label': (b,)} batches of sampled windows (a
    filler for caffepy.data.prefetch.Prefetcher). `mean` is a C x H x W array, or C
    values, or None."""

    def __init__(self, images, fg, bg, batch_size, channels, crop_size, *, fg_fraction, context_pad,
                 square, mirror, scale, mean, generator, cache_images=False, where=""):
        self.images, self.fg, self.bg = images, fg, bg
        self.batch_size, self.channels, self.crop = batch_size, channels, crop_size
        self.num_fg = int(np.float32(batch_size) * np.float32(fg_fraction))
        self.context_pad, self.square, self.mirror = context_pad, square, mirror
        self.scale, self.gen, self.where = np.float32(scale), generator, where
        self.mean_values = self.mean = None
        if mean is not None and np.ndim(mean) == 3:
            off = (mean.shape[2] - crop_size) // 2      # Caffe centres the mean by its width
            self.mean = np.ascontiguousarray(mean[:, off:off + crop_size, off:off + crop_size], np.float32)
        elif mean is not None:
            self.mean_values = np.broadcast_to(np.asarray(mean, np.float32), (channels,))
        self.cache = {} if cache_images else None

    def allocate(self):
        return {"data": np.zeros((self.batch_size, self.channels, self.crop, self.crop), np.float32),
                "label": np.zeros(self.batch_size, np.float32)}

    def _image(self, index):
        if self.cache is not None and index in self.cache:
            return self.cache[index]
        path = self.images[index][0]
        img = read_image(path)
        if img is None:
            raise DataError(f"{self.where}cannot read the image file '{path}'")
        if self.cache is not None:
            self.cache[index] = img
        return img

    def fill(self, buf):
        data, labels = buf["data"], buf["label"]
        data[...] = 0
        item = 0
        for windows, count in ((self.bg, self.batch_size - self.num_fg), (self.fg, self.num_fg)):
            for _ in range(count):
                window = windows[int(self.gen.integers(len(windows)))]
                mirror = self.mirror and bool(self.gen.integers(2))
                image = self._image(window.image)
                try:
                    patch, pad_h, pad_w = window_crop(image, window, self.crop, self.context_pad,
                                                      self.square, mirror)
                except ValueError as e:
                    raise DataError(f"{self.where}image '{self.images[window.image][0]}': {e}") from None
                h, w = patch.shape[:2]
                values = patch.transpose(2, 0, 1).astype(np.float32)
                if self.mean is not None:
                    values -= self.mean[:, pad_h:pad_h + h, pad_w:pad_w + w]
                elif self.mean_values is not None:
                    values -= self.mean_values[:, None, None]
                data[item, :, pad_h:pad_h + h, pad_w:pad_w + w] = values * self.scale
                labels[item] = window.label
                item += 1
        return buf

    def close(self):
        pass


def label_histogram(fg, bg):
    """{class: number of windows}, class 0 the background (Caffe's log of the window file)."""
    hist = collections.Counter({0: len(bg)})
    hist.update(w.label for w in fg)
    return dict(sorted(hist.items()))
