"""Caffe's image tools: convert_imageset and compute_image_mean.

convert_imageset: each line `<path> <label>` of the list file (label after the
last space) becomes one Datum under the key `%08d_<path>` (the line number,
counted over every line, then the path), in a new LMDB. Images are read in
colour (BGR) or gray, resized with INTER_LINEAR when both resize sizes are set,
and stored raw (C x H x W) or, with `encoded`, as the file's own bytes when
nothing changed them (else re-encoded as `encode_type`). Unreadable images are
skipped with a warning and counted at the end.

compute_image_mean: the mean of every Datum of a database, written as a
1 x C x H x W .binaryproto, plus the per-channel means.
"""
import os
import sys

import click
import cv2
import numpy as np

from .. import log, memory, rng
from ..errors import DataError, UsageError, quote
from .datum import datum_to_array, encoded_datum, image_to_datum, parse_datum
from .db import Reader, Writer
from .sources import read_image, read_list_file

_COMMIT = 1000


def _progress(items, label):
    """click's progress bar on a terminal, a plain iterator elsewhere (logs, pipes)."""
    if sys.stderr.isatty():
        return click.progressbar(items, label=label, file=sys.stderr)
    return _Plain(items)


class _Plain:
    def __init__(self, items):
        self.items = items

    def __enter__(self):
        return self.items

    def __exit__(self, *exc):
        return False


def _same_format(path, encoding):
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return ext == encoding or (encoding == "jpg" and ext == "jpeg")


def convert_imageset(root_folder, list_file, db_name, gray=False, shuffle=False, backend="lmdb",
                     resize_width=0, resize_height=0, check_size=False, encoded=False, encode_type=""):
    """Write the images of `list_file` into a new LMDB `db_name`; return the number written."""
    if backend != "lmdb":
        raise DataError(f"{db_name}: backend '{backend}' is not supported; use lmdb")
    is_color = not gray
    if os.path.exists(db_name):
        raise DataError(f"{db_name}: database already exists; remove it or choose another name")
    if resize_height and resize_width:
        why = memory.problem(resize_height * resize_width * (3 if is_color else 1),
                             f"one {resize_height} x {resize_width} image")
        if why:
            raise UsageError(f"--resize_height, --resize_width: {why}, got {resize_height} x {resize_width}")
    entries = read_list_file(list_file)
    if shuffle:
        log.info("Shuffling data")
        order = rng.generator().permutation(len(entries))
        entries = [entries[i] for i in order]
    log.info(f"A total of {len(entries)} images.")
    encode_type = encode_type.lower().lstrip(".")
    if encode_type and not encoded:
        log.warning("encode_type given without --encoded; storing raw pixels")
    size = None
    written, skipped = 0, 0
    with Writer(db_name, commit_every=_COMMIT) as db, \
            _progress(list(enumerate(entries)), "convert_imageset") as items:
        for line_id, (name, label) in items:
            path = root_folder + name
            img = read_image(path, resize_height, resize_width, is_color)
            if img is None:
                log.warning(f"Could not open or find file {path}")
                skipped += 1
                continue
            key = f"{line_id:08d}_{name}"
            if encoded:
                enc = encode_type or os.path.splitext(name)[1].lower().lstrip(".")
                unchanged = (img.shape[2] == 3) == is_color and not (resize_height or resize_width)
                if unchanged and _same_format(name, enc):
                    with open(path, "rb") as f:
                        datum = encoded_datum(f.read(), label)
                else:
                    try:
                        ok, buf = cv2.imencode("." + enc, img)
                    except cv2.error:
                        ok = False
                    if not ok:
                        raise DataError(f"{path}: cannot encode the image as '{enc}'")
                    datum = encoded_datum(buf.tobytes(), label)
            else:
                datum = image_to_datum(img, label)
            if check_size:
                this = datum_to_array(datum).shape if encoded else (datum.channels, datum.height,
                                                                     datum.width)
                if size is None:
                    size = this
                elif this != size:
                    raise DataError(f"{db_name}: key '{key}': image size {'x'.join(map(str, this))} "
                                    f"differs from the first image's {'x'.join(map(str, size))} "
                                    f"(--check_size)")
            db.put(key, datum.SerializeToString())
            written += 1
            if written % _COMMIT == 0:
                log.info(f"Processed {written} files.")
    if written % _COMMIT:
        log.info(f"Processed {written} files.")
    if skipped:
        log.warning(f"Skipped {skipped} of {len(entries)} images that could not be read")
    return written


def compute_image_mean(input_db, output_file=None):
    """The mean image of an LMDB of Datum (C x H x W float32); written as a
    1 x C x H x W .binaryproto when `output_file` is given."""
    reader = Reader(input_db)
    try:
        if len(reader) == 0:
            raise DataError(f"{reader.path}: the database is empty; no mean to compute")
        total, first, count = None, None, 0
        with _progress(reader, "compute_image_mean") as records:
            for key, value in records:
                image = datum_to_array(parse_datum(value, reader.path, key), source=reader.path, key=key)
                if total is None:
                    total, first = np.zeros(image.shape, np.float64), image.shape
                elif image.shape != first:
                    raise DataError(f"{reader.path}: key '{quote(key)}': Datum shape "
                                    f"{'x'.join(map(str, image.shape))} differs from the first one's "
                                    f"{'x'.join(map(str, first))}")
                total += image
                count += 1
                if count % 10000 == 0:
                    log.info(f"Processed {count} files.")
    finally:
        reader.close()
    if count % 10000:
        log.info(f"Processed {count} files.")
    mean = (total / count).astype(np.float32)
    if output_file:
        write_mean(mean, output_file)
        log.info(f"Write to {output_file}")
    log.info(f"Number of channels: {mean.shape[0]}")
    for c, value in enumerate(mean.reshape(mean.shape[0], -1).mean(axis=1, dtype=np.float64)):
        log.info(f"mean_value channel [{c}]: {value:g}")
    return mean


def write_mean(mean, path):
    """A C x H x W mean as a .binaryproto with Caffe's legacy num/channels/height/width."""
    from ..blobproto import array_to_blobproto
    from ..prototxt import atomic_write
    bp = array_to_blobproto(mean.reshape(-1))
    bp.ClearField("shape")
    bp.num, (bp.channels, bp.height, bp.width) = 1, mean.shape
    atomic_write(path, bp.SerializeToString())
