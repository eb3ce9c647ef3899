"""The generated detection set (caffepy.data.shapes, examples/shapes/make_shapes.py): VOC's
layout, boxes that bound the drawn shapes, and the same files from the same seed."""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import cv2
import numpy as np
from google.protobuf import text_format

from caffepy.data.shapes import CLASSES, make_image, write_shapes
from caffepy.proto import caffe_pb2
from data_helpers import db_records
from paths import REPO


def _files(root, *args, **kwargs):
    """Write the set under root; return {relative path: bytes} of every file."""
    write_shapes(root, *args, **kwargs)
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            path = os.path.join(dirpath, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_same_seed_same_files_and_image_i_independent_of_count(tmp_path):
    a = _files(tmp_path / "a", 6, 2, seed=3)
    b = _files(tmp_path / "b", 6, 2, seed=3)
    assert a == b
    c = _files(tmp_path / "c", 6, 2, seed=4)
    assert c["JPEGImages/000000.jpg"] != a["JPEGImages/000000.jpg"]
    bigger = _files(tmp_path / "d", 20, 5, seed=3)
    for i in range(8):
        name = f"{i:06d}"
        assert bigger[f"JPEGImages/{name}.jpg"] == a[f"JPEGImages/{name}.jpg"]
        assert bigger[f"Annotations/{name}.xml"] == a[f"Annotations/{name}.xml"]


def test_voc_layout_lists_and_labelmap(tmp_path):
    splits = write_shapes(tmp_path, 5, 3, size=64, seed=1)
    assert splits == {"trainval": [f"{i:06d}" for i in range(5)],
                      "test": [f"{i:06d}" for i in range(5, 8)]}
    for split, ids in splits.items():
        assert (tmp_path / "ImageSets/Main" / f"{split}.txt").read_text().split() == ids
        lines = (tmp_path / f"{split}.txt").read_text().splitlines()
        assert lines == [f"JPEGImages/{i}.jpg Annotations/{i}.xml" for i in ids]
    assert (tmp_path / "test_name_size.txt").read_text().splitlines() == [
        f"{i} 64 64" for i in splits["test"]]
    label_map = text_format.Parse((tmp_path / "labelmap.prototxt").read_text(), caffe_pb2.LabelMap())
    assert [(i.name, i.label, i.display_name) for i in label_map.item] == (
        [("none_of_the_above", 0, "background")] + [(c, k + 1, c) for k, c in enumerate(CLASSES)])
    for image_id in splits["trainval"] + splits["test"]:
        img = cv2.imread(str(tmp_path / "JPEGImages" / f"{image_id}.jpg"))
        assert img.shape == (64, 64, 3)
        root = ET.parse(tmp_path / "Annotations" / f"{image_id}.xml").getroot()
        assert root.findtext("filename") == f"{image_id}.jpg"
        assert (root.findtext("size/width"), root.findtext("size/height"),
                root.findtext("size/depth")) == ("64", "64", "3")
        objects = root.findall("object")
        assert objects
        for o in objects:
            assert o.findtext("name") in CLASSES
            assert o.findtext("difficult") in ("0", "1") and o.findtext("truncated") == "0"
            x1, y1, x2, y2 = (int(o.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax"))
            assert 1 <= x1 < x2 <= 64 and 1 <= y1 < y2 <= 64


def test_boxes_bound_the_drawn_shapes():
    """The last shape drawn is never hidden: the region of its colour around its box's centre
    (inside every shape) spans exactly the box, in VOC's 1-based inclusive pixels."""
    seen = set()
    for i in range(30):
        img, objects = make_image(7, i, size=96)
        o = objects[-1]
        seen.add(o.name)
        cx, cy = (o.xmin + o.xmax) // 2 - 1, (o.ymin + o.ymax) // 2 - 1
        same = np.all(img == img[cy, cx], axis=2).astype(np.uint8)
        _, comp = cv2.connectedComponents(same, connectivity=8)
        ys, xs = np.nonzero(comp == comp[cy, cx])
        assert (xs.min() + 1, ys.min() + 1, xs.max() + 1, ys.max() + 1) == (
            o.xmin, o.ymin, o.xmax, o.ymax), (i, o)
    assert seen == set(CLASSES)


def test_difficult_marks_objects_mostly_hidden_by_later_ones():
    hidden = 0
    for i in range(60):
        _, objects = make_image(0, i, size=96)
        for k, o in enumerate(objects):
            if o.difficult:
                hidden += 1
                later = objects[k + 1:]
                assert any(min(o.xmax, p.xmax) >= max(o.xmin, p.xmin) and
                           min(o.ymax, p.ymax) >= max(o.ymin, p.ymin) for p in later)
        assert not objects[-1].difficult
    assert hidden > 0


def test_example_script(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "shapes", "make_shapes.py"),
                          "--root", str(tmp_path / "s"), "--trainval", "3", "--test", "1",
                          "--size", "32", "--classes", "circle,square", "--lmdb"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "3 trainval + 1 test images of 32x32, 2 classes" in out.stdout
    names = {o.findtext("name") for f in (tmp_path / "s" / "Annotations").iterdir()
             for o in ET.parse(f).getroot().findall("object")}
    assert names <= {"circle", "square"}
    assert "trainval_lmdb: 3 AnnotatedDatum records" in out.stdout
    assert len(db_records(tmp_path / "s" / "test_lmdb")) == 1
    bad = subprocess.run([sys.executable, os.path.join(REPO, "examples", "shapes", "make_shapes.py"),
                          "--root", str(tmp_path / "t"), "--classes", "hexagon"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--classes: unknown shape hexagon" in bad.stderr
