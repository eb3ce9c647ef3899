"""Caffe's data tools: convert_imageset, compute_image_mean and the dataset converters.

convert_imageset: each line `<path> <label>` of the list file (label after the
last space) becomes one Datum under the key `%08d_<path>` (the line number,
counted over every line, then the path), in a new LMDB or LevelDB. Images are read
in colour (BGR) or gray, resized with INTER_LINEAR when both resize sizes are set,
and stored raw (C x H x W) or, with `encoded`, as the file's own bytes when
nothing changed them (else re-encoded as `encode_type`). Unreadable images are
skipped with a warning and counted at the end.

compute_image_mean: the mean of every Datum of a database, written as a
1 x C x H x W .binaryproto, plus the per-channel means.

convert_mnist_data, convert_mnist_siamese_data and convert_cifar_data (Caffe's
examples/mnist, examples/siamese and examples/cifar10 converters): the datasets' own binary
files into LMDBs or LevelDBs of raw Datum, the keys and records Caffe's converters write.

resize_and_crop_images (Caffe's tools/extra script, its mapreduce replaced by threads): each
image scaled so its short side is the output side, then its centre square.
"""
import os

import cv2
import numpy as np

from .. import log, memory, rng
from ..errors import DataError, UsageError, quote
from .datum import datum_to_array, encoded_datum, image_to_datum, parse_datum
from .db import open_reader, open_writer
from .sources import read_image, read_list_file

_COMMIT = 1000


def _same_format(path, encoding):
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return ext == encoding or (encoding == "jpg" and ext == "jpeg")


def image_datum(path, img, label, encoded, encode_type, is_color, resized):
    """The Datum of image file `path`, read as `img` (H x W x C): raw pixels, or with `encoded`
    the file's own bytes when nothing changed them (no resize, its own channel count, the
    format asked for: `encode_type`, else the file's extension), else `img` encoded anew."""
    if not encoded:
        return image_to_datum(img, label)
    enc = encode_type or os.path.splitext(path)[1].lower().lstrip(".")
    if (img.shape[2] == 3) == is_color and not resized and _same_format(path, enc):
        with open(path, "rb") as f:
            return encoded_datum(f.read(), label)
    try:
        ok, buf = cv2.imencode("." + enc, img)
    except cv2.error:
        ok = False
    if not ok:
        raise DataError(f"{path}: cannot encode the image as '{enc}'")
    return encoded_datum(buf.tobytes(), label)


def same_size(size, img, db_name, key):
    """--check_size: the C x H x W of the first image, checked against `img`'s."""
    this = (img.shape[2],) + img.shape[:2]
    if size is not None and this != size:
        raise DataError(f"{db_name}: key '{key}': image size {'x'.join(map(str, this))} "
                        f"differs from the first image's {'x'.join(map(str, size))} (--check_size)")
    return this


def convert_imageset(root_folder, list_file, db_name, gray=False, shuffle=False, backend="lmdb",
                     resize_width=0, resize_height=0, check_size=False, encoded=False, encode_type=""):
    """Write the images of `list_file` into a new database `db_name` (`backend` lmdb or leveldb);
    return the number written."""
    is_color = not gray
    if os.path.exists(db_name):
        raise DataError(f"{db_name}: database already exists; remove it or choose another name")
    if resize_height and resize_width:
        why = memory.problem(resize_height * resize_width * (3 if is_color else 1),
                             f"one {resize_height} x {resize_width} image")
        if why:
            raise UsageError(f"--resize_height, --resize_width: {why}, got {resize_height} x {resize_width}")
    entries = read_list_file(list_file)
    encode_type = encode_type.lower().lstrip(".")
    if encode_type and not encoded:
        log.warning("encode_type given without --encoded; storing raw pixels")
    resized = bool(resize_height or resize_width)

    def record(path, label):
        img = read_image(path, resize_height, resize_width, is_color)
        if img is None:
            return None
        return img, image_datum(path, img, label, encoded, encode_type, is_color, resized).SerializeToString()

    return write_records(db_name, backend, entries, root_folder, record, check_size, shuffle,
                         "convert_imageset")


def write_records(db_name, backend, entries, root_folder, record, check_size, shuffle, tool):
    """The loop convert_imageset and convert_annoset share: each (name, second) entry of a list
    file becomes the record `record(root_folder + name, second)` gives ((image, bytes), or None
    when the image cannot be read: skipped with a warning) under the key `%08d_<name>`, with
    Caffe's progress lines; return the number written."""
    if shuffle:
        log.info("Shuffling data")
        order = rng.generator().permutation(len(entries))
        entries = [entries[i] for i in order]
    log.info(f"A total of {len(entries)} images.")
    size, written, skipped = None, 0, 0
    with open_writer(db_name, backend, commit_every=_COMMIT) as db, \
            log.progress(list(enumerate(entries)), tool) as items:
        for line_id, (name, second) in items:
            path = root_folder + name
            made = record(path, second)
            if made is None:
                log.warning(f"Could not open or find file {path}; skipped")
                skipped += 1
                continue
            img, value = made
            key = f"{line_id:08d}_{name}"
            if check_size:
                size = same_size(size, img, db_name, key)
            db.put(key, value)
            written += 1
            if written % _COMMIT == 0:
                log.info(f"Processed {written} files.")
    if written % _COMMIT:
        log.info(f"Processed {written} files.")
    if skipped:
        log.warning(f"Skipped {skipped} of {len(entries)} images that could not be read")
    return written


def compute_image_mean(input_db, output_file=None, backend=None):
    """The mean image of a database (LMDB or LevelDB) of Datum (C x H x W float32); written as a
    1 x C x H x W .binaryproto when `output_file` is given."""
    reader = open_reader(input_db, backend, field="--backend")
    try:
        if len(reader) == 0:
            raise DataError(f"{reader.path}: the database is empty; no mean to compute")
        total, first, count = None, None, 0
        with log.progress(reader, "compute_image_mean") as records:
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


# -- the MNIST and CIFAR-10 converters (Caffe's examples/mnist, siamese, cifar10) --------------
_MNIST_IMAGES, _MNIST_LABELS = 2051, 2049        # the idx files' magic numbers


def _read_binary(path):
    """The bytes of `path`, gunzipped when they are gzip's (the datasets ship as .gz)."""
    import gzip
    try:
        with open(path, "rb") as f:
            data = f.read()
        return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it: {e}") from None


def _idx(path, magic, what):
    """(header numbers after the magic, payload) of an MNIST idx file of `magic`."""
    data = _read_binary(path)
    dims = 3 if magic == _MNIST_IMAGES else 1
    if len(data) < 4 * (1 + dims):
        raise DataError(f"{path}: {len(data)} bytes: too short for an MNIST {what} file")
    head = np.frombuffer(data, ">u4", 1 + dims)
    if head[0] != magic:
        raise DataError(f"{path}: not an MNIST {what} file (magic number {head[0]}, expected {magic})")
    return [int(v) for v in head[1:]], data[4 * (1 + dims):]


def _mnist(image_file, label_file):
    """(count, rows, cols, pixels, labels) of MNIST's idx image and label files, checked."""
    (count, rows, cols), pixels = _idx(image_file, _MNIST_IMAGES, "image")
    (labels_count,), labels = _idx(label_file, _MNIST_LABELS, "label")
    if count != labels_count:
        raise DataError(f"{image_file} holds {count} images but {label_file} {labels_count} labels")
    if len(pixels) < count * rows * cols or len(labels) < count:
        raise DataError(f"{image_file if len(pixels) < count * rows * cols else label_file}: ends "
                        f"before its {count} items")
    log.info(f"A total of {count} items.")
    log.info(f"Rows: {rows} Cols: {cols}")
    return count, rows, cols, pixels, labels


def convert_mnist_data(image_file, label_file, db_path, backend="lmdb"):
    """MNIST's idx image and label files into a new LMDB or LevelDB (`backend`): key `%08d` of the
    item, a Datum of 1 x rows x cols raw pixels and the label. Returns the number of items."""
    count, rows, cols, pixels, labels = _mnist(image_file, label_file)
    from ..proto import caffe_pb2
    size = rows * cols
    datum = caffe_pb2.Datum(channels=1, height=rows, width=cols)
    with open_writer(db_path, backend, commit_every=_COMMIT) as db:
        for i in range(count):
            datum.data = pixels[i * size:(i + 1) * size]
            datum.label = _signed_char(labels[i])
            db.put(f"{i:08d}", datum.SerializeToString())
    log.info(f"Processed {count} files.")
    return count


def convert_mnist_siamese_data(image_file, label_file, db_path, backend="leveldb"):
    """Caffe's examples/siamese converter: as many pairs as items, each of two items drawn at
    random (with replacement) into a Datum of 2 x rows x cols pixels (the first item's channel,
    then the second's), label 1 when their labels agree and 0 when not; key `%08d` of the pair.
    A LevelDB by default, as Caffe's tool writes. Returns the number of pairs."""
    count, rows, cols, pixels, labels = _mnist(image_file, label_file)
    if count == 0:
        raise DataError(f"{image_file}: holds no items to pair")
    from ..proto import caffe_pb2
    size = rows * cols
    images = np.frombuffer(pixels, np.uint8, count * size).reshape(count, size)
    labels = np.frombuffer(labels, np.uint8, count)
    pairs = rng.generator().integers(0, count, (count, 2))
    datum = caffe_pb2.Datum(channels=2, height=rows, width=cols)
    with open_writer(db_path, backend, commit_every=_COMMIT) as db:
        for n, (i, j) in enumerate(pairs):
            datum.data = images[[i, j]].tobytes()
            datum.label = int(labels[i] == labels[j])
            db.put(f"{n:08d}", datum.SerializeToString())
    log.info(f"Processed {count} pairs.")
    return count


def _signed_char(byte):
    """A label byte as Caffe's converters read it: a (signed) char."""
    return byte - 256 if byte > 127 else byte


_CIFAR_RECORD = 1 + 3 * 32 * 32                  # a label byte, then 3 x 32 x 32 pixels


def convert_cifar_data(input_folder, output_folder, db_type="lmdb"):
    """CIFAR-10's binary batches into new databases (`db_type` lmdb or leveldb) `cifar10_train_<db_type>` (data_batch_1..5.bin,
    keys `%05d` counted across them) and `cifar10_test_<db_type>` (test_batch.bin) in
    `output_folder`: each record a Datum of 3 x 32 x 32 raw pixels and its label. Every
    whole record of a file is read (CIFAR-10's hold 10000). Returns (train, test) counts."""
    files = {"train": [os.path.join(input_folder, f"data_batch_{i}.bin") for i in range(1, 6)],
             "test": [os.path.join(input_folder, "test_batch.bin")]}
    batches = {part: [_read_binary(path) for path in paths] for part, paths in files.items()}
    for part, paths in files.items():
        for path, data in zip(paths, batches[part]):
            if not data or len(data) % _CIFAR_RECORD:
                raise DataError(f"{path}: {len(data)} bytes is not a whole number of CIFAR-10 records "
                                f"({_CIFAR_RECORD} bytes each)")
    outputs = {part: os.path.join(output_folder, f"cifar10_{part}_{db_type}") for part in files}
    for path in outputs.values():         # refuse before writing either
        if os.path.exists(path):
            raise DataError(f"{path}: database already exists; remove it or choose another folder")
    from ..proto import caffe_pb2
    datum = caffe_pb2.Datum(channels=3, height=32, width=32)
    counts = []
    for part, title in (("train", "Training"), ("test", "Testing")):
        log.info(f"Writing {title} data")
        n = 0
        with open_writer(outputs[part], db_type, commit_every=_COMMIT) as db:
            for b, data in enumerate(batches[part]):
                if part == "train":
                    log.info(f"Training Batch {b + 1}")
                for r in range(len(data) // _CIFAR_RECORD):
                    record = data[r * _CIFAR_RECORD:(r + 1) * _CIFAR_RECORD]
                    datum.label = _signed_char(record[0])
                    datum.data = record[1:]
                    db.put(f"{n:05d}", datum.SerializeToString())
                    n += 1
        counts.append(n)
    return tuple(counts)


# -- Caffe's tools/extra/resize_and_crop_images.py, without its mapreduce --------------------------
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")


def _listed_images(input_folder, input_list):
    """The images to do, relative to input_folder: the list file's lines (a path, with or without
    a trailing integer label, input_folder's prefix dropped as Caffe's mapper drops it), or every
    image file under input_folder."""
    if input_list is None:
        names = []
        for root, dirs, files in os.walk(input_folder):
            dirs.sort()
            names.extend(os.path.relpath(os.path.join(root, f), input_folder) for f in sorted(files)
                         if f.lower().endswith(IMAGE_EXTENSIONS))
        return names
    try:
        with open(input_list) as f:
            lines = [line.strip() for line in f]
    except OSError as e:
        raise DataError(f"{input_list}: cannot read the image list: {e.strerror}") from None
    names = []
    for line in filter(None, lines):
        if input_folder and line.startswith(input_folder):
            line = line[len(input_folder):].lstrip("/")
        path, _, label = line.rpartition(" ")
        names.append(path.strip() if path.strip() and label.lstrip("-").isdigit() else line)
    return names


def resize_and_crop_image(image, side):
    """Scale the short side to `side` (the long one in proportion, rounded down) with
    INTER_LINEAR, then take the centre `side` x `side` square (Caffe's OpenCV path)."""
    height, width = image.shape[:2]
    new_height = side * height // width if height > width else side
    new_width = side if height > width else side * width // height
    resized = cv2.resize(image, (new_width, new_height))
    top, left = (new_height - side) // 2, (new_width - side) // 2
    return resized[top:top + side, left:left + side]


def resize_and_crop_images(input_folder, output_folder, output_side_length=256, input_list=None,
                           num_clients=None):
    """Write every image (input_list's, or all under input_folder) as a centre square of
    output_side_length pixels under output_folder, at the same relative path and in the same
    format; `num_clients` threads (default: one per core). Unreadable images are skipped with a
    warning, as Caffe's mapper skips them. Returns the number written."""
    from concurrent.futures import ThreadPoolExecutor

    from ..prototxt import atomic_write
    if output_side_length < 1:
        raise UsageError(f"--output_side_length: must be positive, got {output_side_length}")
    if input_list is None and not os.path.isdir(input_folder):
        raise DataError(f"{input_folder}: no such folder (--input_folder), and no --input list")
    names = _listed_images(input_folder, input_list)
    log.info(f"A total of {len(names)} images.")

    def one(name):
        source = os.path.join(input_folder, name)
        image = cv2.imread(source)
        if image is None:
            return f"Could not open or find file {source}"
        ok, encoded = cv2.imencode(os.path.splitext(name)[1] or ".jpg",
                                   resize_and_crop_image(image, output_side_length))
        if not ok:
            return f"{source}: cannot encode the image as '{os.path.splitext(name)[1]}'"
        target = os.path.join(output_folder, name)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        atomic_write(target, encoded.tobytes())
        return None

    written = skipped = 0
    with ThreadPoolExecutor(num_clients or os.cpu_count()) as pool, \
            log.progress(pool.map(one, names), "resize_and_crop_images", len(names)) as results:
        for problem in results:
            if problem:
                log.warning(problem)
                skipped += 1
            else:
                written += 1
                if written % _COMMIT == 0:
                    log.info(f"Processed {written} files.")
    log.info(f"Processed {written} files.")
    if skipped:
        log.warning(f"Skipped {skipped} of {len(names)} images that could not be read")
    return written
