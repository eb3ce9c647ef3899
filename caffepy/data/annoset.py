"""SSD's annotated records and the tools that make them: convert_annoset, create_label_map,
get_image_size (the fork's tools/*.cpp and util/io.cpp).

An AnnotatedDatum holds a Datum (the image; label -1 for detection) and its boxes grouped
by label: annotation_group { group_label, annotation { instance_id, bbox { xmin, ymin,
xmax, ymax, difficult } } }, the box normalized by the image's size. Groups come in the
order their label first appears in the annotation file, instance ids count 0, 1, ... within
a group.

A label map (LabelMap prototxt: item { name label display_name }) turns the names of
annotation files into labels; SSD's maps give the background label 0.

Annotation files (the list file's second column, under ROOTFOLDER):
    xml   PASCAL VOC: size/{width,height}; object/{name, difficult, bndbox/{xmin, ymin, xmax,
          ymax}} in pixels (the image's size when the file gives none)
    json  the fork's COCO form: {"image": {"height", "width"}, "annotation": [{"category_id":
          name, "iscrowd": 0|1, "bbox": [x, y, w, h]}]}; iscrowd is stored as difficult
    txt   one `label xmin ymin xmax ymax` line per box, in pixels, labels as numbers

Where caffepy departs from the fork, on purpose: a box outside the image or inverted
(xmin > xmax) is an error naming the file and the object (the fork warns and stores it),
pixel coordinates may be fractional (the fork reads them as integers, 0 when they are not),
min_dim / max_dim resize as weiliu89's SSD does (Intel Caffe's copy reads and ignores them),
and --encoded without --encode_type keeps the file's own bytes (the fork appends the dot of
the extension to the format's name and re-encodes).
"""
import json
import os
import xml.etree.ElementTree as ET

import cv2
import numpy as np
from google.protobuf import text_format

from .. import log
from ..errors import DataError, UsageError
from ..proto import caffe_pb2
from .sources import read_image
from .tools import image_datum, write_records

ANNO_TYPES = ("classification", "detection")
LABEL_TYPES = ("xml", "json", "txt")


# -- label maps ----------------------------------------------------------------------------------
def read_label_map(path):
    """A LabelMap from its prototxt."""
    label_map = caffe_pb2.LabelMap()
    try:
        with open(path) as f:
            text_format.Parse(f.read(), label_map)
    except OSError as e:
        raise DataError(f"{path}: cannot read the label map: {e.strerror}") from None
    except text_format.ParseError as e:
        raise DataError(f"{path}: not a LabelMap prototxt: {e}") from None
    return label_map


def name_to_label(label_map, strict=True, path="label map"):
    """{name: label}; `strict` (convert_annoset's --check_label) refuses a name given twice."""
    names = {}
    for item in label_map.item:
        if strict and item.name in names:
            raise DataError(f"{path}: the name '{item.name}' is given twice (labels {names[item.name]} "
                            f"and {item.label}; --check_label)")
        names[item.name] = item.label
    return names


def label_to_display_name(label_map):
    return {item.label: item.display_name or item.name for item in label_map.item}


def read_label_file(path, include_background=False, delimiter=" "):
    """create_label_map's input as a LabelMap: one label a line, `name [label [display_name]]`
    split at any character of `delimiter`, every line with as many fields; without a label the
    lines count up from 0 (from 1 after the background, none_of_the_above, with
    include_background)."""
    label_map = caffe_pb2.LabelMap()
    label = 0
    if include_background:
        label_map.item.add(name="none_of_the_above", label=0, display_name="background")
        label = 1
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DataError(f"{path}: cannot read the label file: {e.strerror}") from None
    width = None
    for n, line in enumerate(lines, 1):
        fields = [line]
        for d in delimiter:
            fields = [piece for field in fields for piece in field.split(d)]
        if width is None:
            width = len(fields)
        elif len(fields) != width:
            raise DataError(f"{path}:{n}: {len(fields)} fields where the first line has {width}, "
                            f"got '{line}'")
        if width > 3:
            raise DataError(f"{path}:{n}: expected 'name [label [display_name]]', got '{line}'")
        if width > 1:
            try:
                label = int(fields[1])
            except ValueError:
                raise DataError(f"{path}:{n}: the label must be an integer, got '{fields[1]}'") from None
        label_map.item.add(name=fields[0], label=label, display_name=fields[2] if width == 3 else fields[0])
        if width == 1:
            label += 1
    return label_map


def write_label_map(label_map, path):
    from ..prototxt import atomic_write
    atomic_write(path, text_format.MessageToString(label_map).encode())


def create_label_map(map_file, out_file, include_background=False, delimiter=" "):
    label_map = read_label_file(map_file, include_background, delimiter)
    write_label_map(label_map, out_file)
    return label_map


# -- annotation files ----------------------------------------------------------------------------
class _Groups:
    """Builds AnnotatedDatum.annotation_group: groups in first-appearance order of their label,
    instance ids counting within each."""

    def __init__(self, anno_datum, where):
        self.anno_datum, self.where, self.count = anno_datum, where, 0
        self.by_label = {}

    def add(self, label, box, height, width, difficult, what):
        xmin, ymin, xmax, ymax = box
        self.count += 1
        if xmin > xmax or ymin > ymax:
            raise DataError(f"{self.where}: {what}: the box is inverted (xmin, ymin, xmax, ymax = "
                            f"{_pixels(box)})")
        if xmin < 0 or ymin < 0 or xmax > width or ymax > height:
            raise DataError(f"{self.where}: {what}: the box (xmin, ymin, xmax, ymax = {_pixels(box)}) lies "
                            f"outside the {width}x{height} image")
        group = self.by_label.get(label)
        if group is None:
            group = self.by_label[label] = self.anno_datum.annotation_group.add(group_label=label)
        anno = group.annotation.add(instance_id=len(group.annotation))
        b = anno.bbox
        # float32 division, as the fork stores them
        b.xmin, b.ymin, b.xmax, b.ymax = (float(np.float32(v) / np.float32(s)) for v, s in
                                          ((xmin, width), (ymin, height), (xmax, width), (ymax, height)))
        b.difficult = bool(difficult)


def _pixels(box):
    return ", ".join(f"{v:g}" for v in box)


def _image_size(root, path, img_h, img_w, what):
    """(height, width) the annotation file gives, else the image's (with a warning)."""
    try:
        height, width = int(root.findtext(f"{what}/height")), int(root.findtext(f"{what}/width"))
    except (TypeError, ValueError):
        log.warning(f"{path}: no valid {what}/height and {what}/width; using the image's {img_w}x{img_h}")
        return img_h, img_w
    return height, width


def read_xml(path, img_h, img_w, names, anno_datum):
    """VOC's annotation file into anno_datum's groups."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise DataError(f"{path}: not a VOC annotation file: {e}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read the annotation: {e.strerror}") from None
    height, width = _image_size(root, path, img_h, img_w, "size")
    _check_size(path, height, width, img_h, img_w)
    groups = _Groups(anno_datum, path)
    for n, obj in enumerate(root.findall("object"), 1):
        name = (obj.findtext("name") or "").strip()
        what = f"object {n} ('{name}')"
        if name not in names:
            raise DataError(f"{path}: {what}: the name is not in the label map (known: "
                            f"{', '.join(sorted(names))})")
        bndbox = obj.find("bndbox")
        if bndbox is None:
            raise DataError(f"{path}: {what}: has no bndbox")
        try:
            box = [float(bndbox.findtext(k) or 0) for k in ("xmin", "ymin", "xmax", "ymax")]
        except ValueError:
            raise DataError(f"{path}: {what}: bndbox coordinates must be numbers, got "
                            f"{[bndbox.findtext(k) for k in ('xmin', 'ymin', 'xmax', 'ymax')]}") from None
        groups.add(names[name], box, height, width, (obj.findtext("difficult") or "").strip() == "1", what)


def read_json(path, img_h, img_w, names, anno_datum):
    """The fork's COCO-style json annotation into anno_datum's groups."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise DataError(f"{path}: cannot read the annotation: {e.strerror}") from None
    except ValueError as e:
        raise DataError(f"{path}: not a json annotation file: {e}") from None
    image = data.get("image", {}) if isinstance(data, dict) else {}
    try:
        height, width = int(image["height"]), int(image["width"])
    except (KeyError, TypeError, ValueError):
        log.warning(f"{path}: no valid image height and width; using the image's {img_w}x{img_h}")
        height, width = img_h, img_w
    _check_size(path, height, width, img_h, img_w)
    groups = _Groups(anno_datum, path)
    for n, obj in enumerate(data.get("annotation", []), 1):
        name = str(obj.get("category_id", ""))
        what = f"annotation {n} (category_id '{name}')"
        if name not in names:
            raise DataError(f"{path}: {what}: the category is not in the label map (known: "
                            f"{', '.join(sorted(names))})")
        try:
            x, y, w, h = (float(v) for v in obj["bbox"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{path}: {what}: bbox must be [x, y, width, height], got "
                            f"{obj.get('bbox')}") from None
        groups.add(names[name], (x, y, x + w, y + h), height, width, obj.get("iscrowd", 0), what)


def read_txt(path, img_h, img_w, names, anno_datum):
    """`label xmin ymin xmax ymax` lines (pixels) into anno_datum's groups; `names` unused."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DataError(f"{path}: cannot read the annotation: {e.strerror}") from None
    groups = _Groups(anno_datum, path)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            label, box = int(fields[0]), [float(v) for v in fields[1:]]
        except (ValueError, IndexError):
            box = None
        if box is None or len(box) != 4:
            raise DataError(f"{path}:{n}: expected 'label xmin ymin xmax ymax', got '{line}'")
        groups.add(label, box, img_h, img_w, False, f"line {n}")


def _check_size(path, height, width, img_h, img_w):
    if height <= 0 or width <= 0:
        raise DataError(f"{path}: the image size must be positive, got {width}x{height}")
    if (height, width) != (img_h, img_w):
        log.warning(f"{path}: gives the image size {width}x{height}, the image is {img_w}x{img_h}")


READERS = {"xml": read_xml, "json": read_json, "txt": read_txt}


def read_resized(path, resize_height, resize_width, min_dim, max_dim, is_color):
    """An image file as H x W x C uint8, resized as SSD's ReadImageToCVMat: with min_dim /
    max_dim by one factor (the shorter side up to min_dim, then the longer side down to
    max_dim if it ends larger), else to resize_height x resize_width when both are set;
    (image, original height, original width), or None if unreadable."""
    img = read_image(path, 0, 0, is_color)
    if img is None:
        return None
    h, w = img.shape[:2]
    if min_dim or max_dim:
        factor = np.float32(1)
        if min_dim and min(h, w) < min_dim:
            factor = np.float32(min_dim) / np.float32(min(h, w))
        if max_dim and int(factor * np.float32(max(h, w))) > max_dim:
            factor = np.float32(max_dim) / np.float32(max(h, w))
        if factor != 1:
            # OpenCV's own rounding of a size given by factors
            img = cv2.resize(img, (0, 0), fx=float(factor), fy=float(factor), interpolation=cv2.INTER_LINEAR)
    elif resize_height and resize_width and (h, w) != (resize_height, resize_width):
        img = cv2.resize(img, (resize_width, resize_height), interpolation=cv2.INTER_LINEAR)
    if img.ndim == 2:
        img = img[:, :, None]
    return img, h, w


def read_list(path, anno_type):
    """convert_annoset's list file: (image, label) for classification, (image, annotation file)
    for detection; whitespace-separated pairs, as the fork's stream reads them."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError as e:
        raise DataError(f"{path}: cannot read the list file: {e.strerror}") from None
    if len(words) % 2:
        raise DataError(f"{path}: expected pairs of image and {'label' if anno_type == 'classification' else 'annotation file'}, "
                        f"got an odd number of words ({len(words)}; the last: '{words[-1]}')")
    pairs = list(zip(words[0::2], words[1::2]))
    if anno_type == "classification":
        for image, label in pairs:
            try:
                int(label)
            except ValueError:
                raise DataError(f"{path}: '{image}': the label must be an integer, got '{label}'") from None
        return [(image, int(label)) for image, label in pairs]
    return pairs


def convert_annoset(root_folder, list_file, db_name, anno_type="classification", label_type="xml",
                    label_map_file="", check_label=False, min_dim=0, max_dim=0, resize_height=0,
                    resize_width=0, backend="lmdb", shuffle=False, check_size=False, encode_type="",
                    encoded=False, gray=False):
    """Write the images of `list_file` and their annotations into a new database of
    AnnotatedDatum under the keys `%08d_<image path>` (the line, then the path); return the
    number written. Unreadable images are skipped with a warning."""
    if anno_type not in ANNO_TYPES:
        raise UsageError(f"--anno_type: must be one of {', '.join(ANNO_TYPES)}, got '{anno_type}'")
    if label_type not in LABEL_TYPES:
        raise UsageError(f"--label_type: must be one of {', '.join(LABEL_TYPES)}, got '{label_type}'")
    if os.path.exists(db_name):
        raise DataError(f"{db_name}: database already exists; remove it or choose another name")
    names = {}
    if anno_type == "detection" and label_type != "txt":
        if not label_map_file:
            raise UsageError(f"--label_map_file: needed to read {label_type} annotations (their names "
                             f"become labels)")
        names = name_to_label(read_label_map(label_map_file), check_label, label_map_file)
    entries = read_list(list_file, anno_type)
    encode_type = encode_type.lower().lstrip(".")
    if encode_type and not encoded:
        log.info("encode_type specified, assuming encoded=true.")
        encoded = True
    is_color = not gray
    resized = bool(min_dim or max_dim or (resize_height and resize_width))

    def record(path, second):
        read = read_resized(path, resize_height, resize_width, min_dim, max_dim, is_color)
        if read is None:
            return None
        img, height, width = read
        anno_datum = caffe_pb2.AnnotatedDatum()
        label = second if anno_type == "classification" else -1
        anno_datum.datum.CopyFrom(image_datum(path, img, label, encoded, encode_type, is_color, resized))
        if anno_type != "classification":
            anno_datum.type = caffe_pb2.AnnotatedDatum.BBOX
            anno_path = root_folder + second
            if os.path.exists(anno_path):    # an image without its file: no boxes, as the fork
                READERS[label_type](anno_path, height, width, names, anno_datum)
        return img, anno_datum.SerializeToString()

    return write_records(db_name, backend, entries, root_folder, record, check_size, shuffle,
                         "convert_annoset")


def get_image_size(root_folder, list_file, out_file, name_id_file=""):
    """Write `<name> <height> <width>` for each image of `list_file` (its first column; the name
    is the file's stem, or its id from name_id_file's `<name> <id>` lines); return the lines."""
    entries = read_list(list_file, "detection")
    ids = {}
    if name_id_file:
        try:
            with open(name_id_file) as f:
                words = f.read().split()
        except OSError as e:
            raise DataError(f"{name_id_file}: cannot read the name id file: {e.strerror}") from None
        for name, image_id in zip(words[0::2], words[1::2]):
            if name in ids:
                raise DataError(f"{name_id_file}: the name '{name}' is given twice")
            ids[name] = image_id
    log.info(f"A total of {len(entries)} images.")
    lines = []
    for image, _ in entries:
        path = os.path.join(root_folder, image)
        img = read_image(path, 0, 0, True)
        if img is None:
            raise DataError(f"{path}: cannot read the image")
        stem = os.path.splitext(os.path.basename(image))[0]
        if ids and stem not in ids:
            raise DataError(f"{name_id_file}: has no id for the image '{stem}' ({path})")
        lines.append(f"{ids.get(stem, stem)} {img.shape[0]} {img.shape[1]}\n")
    from ..prototxt import atomic_write
    atomic_write(out_file, "".join(lines).encode())
    log.info(f"Processed {len(lines)} files.")
    return lines
