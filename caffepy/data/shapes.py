"""A generated detection data set in PASCAL VOC's layout: shapes of a few classes on textured
backgrounds, several per image, with their boxes, so detectors can be shown to learn without
downloading VOC or COCO.

    write_shapes(root, trainval=48, test=16, size=96, seed=0)

writes, under `root`:

    JPEGImages/<id>.jpg             the images (`size` x `size`, BGR JPEGs)
    Annotations/<id>.xml            VOC's annotation: size, and per object name, pose, truncated,
                                    difficult and a 1-based pixel bndbox (xmin, ymin, xmax, ymax)
    ImageSets/Main/trainval.txt     the ids of each split, one a line
    ImageSets/Main/test.txt
    trainval.txt, test.txt          the list files of `caffepy convert_annoset`: one line
                                    `JPEGImages/<id>.jpg Annotations/<id>.xml` per image
    test_name_size.txt              `<id> <height> <width>` per test image (get_image_size's)
    labelmap.prototxt               SSD's LabelMap: background 0, then the classes 1..n

and `write_lmdbs(root)` converts the two splits to <root>/trainval_lmdb and test_lmdb with
convert_annoset, encoded, as Intel Caffe's data/VOC0712/create_data.sh does for VOC.

Image i of a seed is the same whatever the number of images asked for (each image draws from
its own generator, seeded by (seed, i)), so a bigger set extends a smaller one. An object more
than half hidden by the ones drawn over it is marked difficult, as VOC marks the objects it
does not score.
"""
import os
from dataclasses import dataclass

import cv2
import numpy as np

CLASSES = ("circle", "square", "triangle", "cross")


@dataclass
class ShapeObject:
    name: str
    label: int          # 1-based, as in labelmap.prototxt (0 is the background)
    xmin: int           # VOC's 1-based pixel box, inclusive
    ymin: int
    xmax: int
    ymax: int
    difficult: bool = False


def _background(gen, size):
    """Low-frequency colour noise, stripes of a random angle, and pixel noise on top: texture
    enough that a detector cannot find objects by their edges alone."""
    small = gen.uniform(40, 215, (max(2, size // 12), max(2, size // 12), 3)).astype(np.float32)
    img = cv2.resize(small, (size, size), interpolation=cv2.INTER_CUBIC)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    angle = gen.uniform(0, np.pi)
    period = gen.uniform(size / 12, size / 4)
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period)
    img += (gen.uniform(10, 35) * stripes)[..., None]
    img += gen.normal(0, 12, img.shape).astype(np.float32)
    return img


def _draw(canvas, mask, shape, x0, y0, side, colour):
    """Draw one filled shape in the square [x0, x0 + side) x [y0, y0 + side) on canvas and on
    mask (the object's own pixels), and return its tight pixel box (x1, y1, x2, y2), inclusive."""
    x1, y1, x2, y2 = x0, y0, x0 + side - 1, y0 + side - 1
    for target, value in ((canvas, colour), (mask, 1)):
        if shape == "circle":
            r = (side - 1) / 2
            cv2.ellipse(target, (int(round((x1 + x2) * 8)), int(round((y1 + y2) * 8))),
                        (int(round(r * 16)), int(round(r * 16))), 0, 0, 360, value, -1,
                        cv2.LINE_8, 4)
        elif shape == "square":
            cv2.rectangle(target, (x1, y1), (x2, y2), value, -1)
        elif shape == "triangle":
            pts = np.array([[(x1 + x2) // 2, y1], [x1, y2], [x2, y2]], np.int32)
            cv2.fillPoly(target, [pts], value)
        else:  # cross: two bars a third of the side thick
            t = max(1, side // 3)
            cv2.rectangle(target, (x1 + (side - t) // 2, y1), (x1 + (side - t) // 2 + t - 1, y2),
                          value, -1)
            cv2.rectangle(target, (x1, y1 + (side - t) // 2), (x2, y1 + (side - t) // 2 + t - 1),
                          value, -1)
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())


def _iou(a, b):
    iw = min(a[2], b[2]) - max(a[0], b[0]) + 1
    ih = min(a[3], b[3]) - max(a[1], b[1]) + 1
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    area = lambda r: (r[2] - r[0] + 1) * (r[3] - r[1] + 1)
    return inter / (area(a) + area(b) - inter)


def make_image(seed, index, size=96, classes=CLASSES, max_objects=4,
               min_scale=0.15, max_scale=0.55):
    """Image `index` of `seed`: (BGR uint8 image of size x size, [ShapeObject]).

    1 to max_objects shapes, each a square footprint of side min_scale..max_scale of the
    image, placed so that no two boxes overlap by more than 0.5 IoU, each in a colour far from
    the background under it."""
    gen = np.random.default_rng([seed, index])
    img = _background(gen, size)
    n = int(gen.integers(1, max_objects + 1))
    placed, masks = [], []
    for _ in range(n):
        for _try in range(20):
            side = int(round(size * gen.uniform(min_scale, max_scale)))
            side = max(6, min(side, size))
            x0, y0 = (int(v) for v in gen.integers(0, size - side + 1, 2))
            square = (x0, y0, x0 + side - 1, y0 + side - 1)
            if all(_iou(square, p[1]) <= 0.5 for p in placed):
                break
        else:
            continue
        label = int(gen.integers(len(classes)))
        under = img[y0:y0 + side, x0:x0 + side].reshape(-1, 3).mean(axis=0)
        # a colour at least 80 away (per channel, on average) from what lies beneath
        colour = np.where(under > 127, gen.uniform(0, max(0.0, under.mean() - 80), 3),
                          gen.uniform(min(255.0, under.mean() + 80), 255, 3))
        mask = np.zeros((size, size), np.uint8)
        box = _draw(img, mask, classes[label], x0, y0, side, [float(c) for c in colour])
        for m in masks:
            m[mask > 0] = 0  # later shapes hide the earlier ones where they overlap
        placed.append((label, square, box, int(mask.sum())))
        masks.append(mask)
    objects = []
    for (label, _square, box, area), mask in zip(placed, masks):
        x1, y1, x2, y2 = box
        objects.append(ShapeObject(classes[label], label + 1, x1 + 1, y1 + 1, x2 + 1, y2 + 1,
                                   difficult=bool(mask.sum() < 0.5 * area)))
    return np.clip(img, 0, 255).astype(np.uint8), objects


def voc_xml(image_id, size, objects, depth=3):
    """VOC's annotation file for one image, as text."""
    lines = ["<annotation>", "\t<folder>shapes</folder>", f"\t<filename>{image_id}.jpg</filename>",
             "\t<source>", "\t\t<database>caffepy generated shapes</database>", "\t</source>",
             "\t<size>", f"\t\t<width>{size}</width>", f"\t\t<height>{size}</height>",
             f"\t\t<depth>{depth}</depth>", "\t</size>", "\t<segmented>0</segmented>"]
    for o in objects:
        lines += ["\t<object>", f"\t\t<name>{o.name}</name>", "\t\t<pose>Unspecified</pose>",
                  "\t\t<truncated>0</truncated>", f"\t\t<difficult>{int(o.difficult)}</difficult>",
                  "\t\t<bndbox>", f"\t\t\t<xmin>{o.xmin}</xmin>", f"\t\t\t<ymin>{o.ymin}</ymin>",
                  f"\t\t\t<xmax>{o.xmax}</xmax>", f"\t\t\t<ymax>{o.ymax}</ymax>", "\t\t</bndbox>",
                  "\t</object>"]
    lines.append("</annotation>")
    return "\n".join(lines) + "\n"


def labelmap_text(classes=CLASSES):
    """SSD's LabelMap prototxt: the background as label 0, then each class."""
    items = [("none_of_the_above", 0, "background")]
    items += [(name, i + 1, name) for i, name in enumerate(classes)]
    return "".join(f'item {{\n  name: "{n}"\n  label: {l}\n  display_name: "{d}"\n}}\n'
                   for n, l, d in items)


def write_shapes(root, trainval=48, test=16, size=96, seed=0, classes=CLASSES, max_objects=4,
                 quality=95):
    """Write the data set under `root` (see the module's docstring); return
    {"trainval": [ids], "test": [ids]}. Image ids are 6-digit numbers: trainval first."""
    root = os.fspath(root)
    for sub in ("JPEGImages", "Annotations", os.path.join("ImageSets", "Main")):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    splits = {"trainval": [f"{i:06d}" for i in range(trainval)],
              "test": [f"{i:06d}" for i in range(trainval, trainval + test)]}
    name_size = []
    for split, ids in splits.items():
        for image_id in ids:
            img, objects = make_image(seed, int(image_id), size, classes, max_objects)
            cv2.imwrite(os.path.join(root, "JPEGImages", image_id + ".jpg"), img,
                        [cv2.IMWRITE_JPEG_QUALITY, quality])
            with open(os.path.join(root, "Annotations", image_id + ".xml"), "w") as f:
                f.write(voc_xml(image_id, size, objects))
            if split == "test":
                name_size.append(f"{image_id} {size} {size}\n")
        with open(os.path.join(root, "ImageSets", "Main", split + ".txt"), "w") as f:
            f.writelines(i + "\n" for i in ids)
        with open(os.path.join(root, split + ".txt"), "w") as f:
            f.writelines(f"JPEGImages/{i}.jpg Annotations/{i}.xml\n" for i in ids)
    with open(os.path.join(root, "test_name_size.txt"), "w") as f:
        f.writelines(name_size)
    with open(os.path.join(root, "labelmap.prototxt"), "w") as f:
        f.write(labelmap_text(classes))
    return splits


def write_lmdbs(root, splits=("trainval", "test"), backend="lmdb"):
    """convert_annoset (detection, VOC xml, JPEG bytes kept) of each split's list file into
    <root>/<split>_<backend>; return {split: path}."""
    from .annoset import convert_annoset
    root = os.fspath(root)
    out = {}
    for split in splits:
        out[split] = os.path.join(root, f"{split}_{backend}")
        convert_annoset(root + os.sep, os.path.join(root, split + ".txt"), out[split], anno_type="detection",
                        label_map_file=os.path.join(root, "labelmap.prototxt"), check_label=True,
                        backend=backend, encoded=True, encode_type="jpg")
    return out
