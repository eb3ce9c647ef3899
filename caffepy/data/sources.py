"""Record sources for the prefetcher: a database (LMDB or LevelDB) of Datum, or a list file of images.

A source has `len()`, get(index) -> (key, raw) (cheap, called in record order by
one thread), decode(key, raw) -> (C x H x W array, label) (the heavy part, called
from several threads) and where(key), the "<source>: key '<key>': " error prefix.
"""
import os

import cv2
import cv2.utils.logging

from .. import memory
from ..errors import DataError, quote
from .datum import datum_to_array, parse_datum
from .db import open_reader

# Unreadable images are reported by our own warning or error; OpenCV's own
# "[ WARN:0@...] imread_(...)" or "[ERROR:0@...] ... readHeader" line would
# repeat it in another shape.
cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)


class DBSource:
    """The records of a database; `backend`, the layer's `data_param.backend` when it sets one."""

    def __init__(self, path, force_color=False, force_gray=False, backend=None):
        self.reader = open_reader(path, backend, field="data_param.backend")
        self.path = self.reader.path
        self.force_color, self.force_gray = force_color, force_gray

    def __len__(self):
        return len(self.reader)

    def where(self, key):
        return f"{self.path}: key '{quote(key, 100)}': "

    def get(self, index):
        return self.reader.get(index)

    def decode(self, key, raw):
        datum = parse_datum(raw, self.path, key)
        try:
            image = datum_to_array(datum, self.force_color, self.force_gray, self.path, key)
        except cv2.error as e:
            raise DataError(f"{self.where(key)}cannot decode the image: {str(e).strip()}") from None
        return image, datum.label

    def close(self):
        self.reader.close()


def read_list_file(path):
    """[(image path, label)] from a file of `<path> <label>` lines (the label after the last space)."""
    entries = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DataError(f"{path}: cannot read the list file: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        name, _, label = line.rpartition(" ")
        try:
            entries.append((name.strip(), int(label)))
        except ValueError:
            raise DataError(f"{path}:{n}: expected '<image path> <integer label>', got '{line}'") from None
        if not name.strip():
            raise DataError(f"{path}:{n}: expected '<image path> <integer label>', got '{line}'")
    return entries


def read_image(path, height=0, width=0, is_color=True, where=""):
    """An image file as H x W x C uint8 (BGR or gray), resized with INTER_LINEAR when
    height and width are both set (Caffe's ReadImageToCVMat); None if unreadable."""
    if not os.path.isfile(path):
        return None
    img = cv2.imread(path, cv2.IMREAD_COLOR if is_color else cv2.IMREAD_GRAYSCALE)
    if img is None:
        return None
    if height > 0 and width > 0 and img.shape[:2] != (height, width):
        channels = img.shape[2] if img.ndim == 3 else 1
        why = memory.problem(height * width * channels, f"resizing '{path}' to {height} x {width}")
        if why:
            raise DataError(why)
        try:
            img = cv2.resize(img, (width, height), interpolation=cv2.INTER_LINEAR)
        except cv2.error as e:
            raise DataError(f"{path}: cannot resize the image to {height} x {width}: "
                            f"{str(e).strip().splitlines()[-1]}") from None
    if img.ndim == 2:
        img = img[:, :, None]
    return img


class ImageListSource:
    """ImageData's source: the lines of a list file, images read from root_folder; colour
    images in BGR order (OpenCV's, Caffe's), or RGB with `bgr2rgb` (Intel Caffe's
    transform_param.bgr2rgb)."""

    def __init__(self, list_file, root_folder="", height=0, width=0, is_color=True, bgr2rgb=False):
        self.path = list_file
        self.entries = read_list_file(list_file)
        self.root = root_folder
        self.height, self.width, self.is_color = height, width, is_color
        self.bgr2rgb = bgr2rgb

    def __len__(self):
        return len(self.entries)

    def where(self, key):
        return f"{self.path}: image '{key}': "

    def get(self, index):
        name, label = self.entries[index]
        return name, label

    def decode(self, key, label):
        img = read_image(self.root + key, self.height, self.width, self.is_color)
        if img is None:
            raise DataError(f"{self.where(key)}cannot read the image file '{self.root + key}'")
        if self.bgr2rgb and img.shape[2] == 3:
            img = img[:, :, ::-1]
        return img.transpose(2, 0, 1), label

    def close(self):
        pass
