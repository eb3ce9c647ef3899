"""SSD's annotated records and tools (caffepy/data/annoset.py): convert_annoset, create_label_map
and get_image_size, read back with plain lmdb + caffe_pb2, and through the CLI."""
import json

import cv2
import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import text_format

from caffepy.cli import main
from caffepy.data import annoset
from caffepy.data.shapes import write_shapes
from caffepy.errors import DataError, UsageError
from caffepy.proto import caffe_pb2
from data_helpers import db_records

VOC = """<annotation><size><width>{w}</width><height>{h}</height><depth>3</depth></size>
{objects}</annotation>"""
OBJ = ("<object><name>{name}</name><difficult>{d}</difficult><bndbox><xmin>{b[0]}</xmin>"
       "<ymin>{b[1]}</ymin><xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox></object>")
LABELMAP = ('item { name: "none_of_the_above" label: 0 display_name: "background" }\n'
            'item { name: "dog" label: 1 display_name: "dog" }\n'
            'item { name: "cat" label: 2 display_name: "cat" }\n')


def records(path):
    out = []
    for key, value in db_records(path):
        a = caffe_pb2.AnnotatedDatum()
        a.ParseFromString(value)
        out.append((key, a))
    return out


def boxes(a):
    """(group_label, instance_id, xmin, ymin, xmax, ymax, difficult) of each annotation, in order."""
    return [(g.group_label, an.instance_id, an.bbox.xmin, an.bbox.ymin, an.bbox.xmax, an.bbox.ymax,
             an.bbox.difficult) for g in a.annotation_group for an in g.annotation]


@pytest.fixture
def voc(tmp_path):
    """Two 40x30 JPEGs with VOC files: dog, cat, dog (difficult) on the first; none on the second."""
    for name in ("a", "b"):
        cv2.imwrite(str(tmp_path / f"{name}.jpg"), np.full((30, 40, 3), 90, np.uint8))
    objects = "".join(OBJ.format(name=n, d=d, b=b) for n, d, b in
                      (("dog", 0, (4, 3, 20, 15)), ("cat", 0, (1, 1, 40, 30)), ("dog", 1, (10, 12.5, 30, 27))))
    (tmp_path / "a.xml").write_text(VOC.format(w=40, h=30, objects=objects))
    (tmp_path / "b.xml").write_text(VOC.format(w=40, h=30, objects=""))
    (tmp_path / "list.txt").write_text("a.jpg a.xml\nb.jpg b.xml\n")
    (tmp_path / "labelmap.prototxt").write_text(LABELMAP)
    return tmp_path


def convert(tmp, db="db", **kwargs):
    kwargs.setdefault("anno_type", "detection")
    kwargs.setdefault("label_map_file", str(tmp / "labelmap.prototxt"))
    return annoset.convert_annoset(str(tmp) + "/", str(tmp / kwargs.pop("list", "list.txt")), str(tmp / db),
                                   **kwargs)


def test_detection_records_groups_instances_and_normalized_boxes(voc):
    assert convert(voc, encoded=True) == 2
    (k0, a), (k1, b) = records(voc / "db")
    assert (k0, k1) == ("00000000_a.jpg", "00000001_b.jpg")
    assert a.type == caffe_pb2.AnnotatedDatum.BBOX and a.datum.label == -1
    assert a.datum.encoded and a.datum.data == (voc / "a.jpg").read_bytes()
    f = np.float32
    # groups in the order their label first appears; instances count within a group
    want = [(1, 0, f(4) / f(40), f(3) / f(30), f(20) / f(40), f(15) / f(30), False),
            (1, 1, f(10) / f(40), f(12.5) / f(30), f(30) / f(40), f(27) / f(30), True),
            (2, 0, f(1) / f(40), f(1) / f(30), 1.0, 1.0, False)]
    assert boxes(a) == [tuple(float(np.float32(v)) if isinstance(v, (float, np.floating)) else v
                              for v in row) for row in want]
    assert boxes(b) == [] and b.type == caffe_pb2.AnnotatedDatum.BBOX


def test_classification_records_raw_and_resized(voc):
    (voc / "cls.txt").write_text("a.jpg 3\nb.jpg 5\n")
    convert(voc, list="cls.txt", anno_type="classification", resize_height=6, resize_width=8)
    (_, a), (_, b) = records(voc / "db")
    assert not a.HasField("type") and not a.annotation_group
    assert (a.datum.label, b.datum.label) == (3, 5)
    assert (a.datum.channels, a.datum.height, a.datum.width, a.datum.encoded) == (3, 6, 8, False)


def test_min_dim_and_max_dim_resize_by_one_factor(voc):
    convert(voc, min_dim=60)        # the shorter side 30 -> 60: x2
    (_, a), _ = records(voc / "db")
    assert (a.datum.height, a.datum.width) == (60, 80)
    convert(voc, db="db2", min_dim=60, max_dim=70)     # x2 would make the longer side 80 > 70: x1.75
    (_, a), _ = records(voc / "db2")
    assert (a.datum.height, a.datum.width) == (int(round(30 * 1.75)), 70)
    # the boxes are fractions of the image: resizing keeps them
    assert boxes(a)[0][2] == pytest.approx(0.1)


def test_json_and_txt_annotations(voc):
    (voc / "a.json").write_text(json.dumps({"image": {"height": 30, "width": 40}, "annotation": [
        {"category_id": "cat", "iscrowd": 1, "bbox": [2, 3, 10, 6]},
        {"category_id": "dog", "bbox": [0, 0, 40, 30]}]}))
    (voc / "j.txt").write_text("a.jpg a.json\n")
    convert(voc, list="j.txt", label_type="json")
    (_, a), = records(voc / "db")
    assert [r[:2] + (r[6],) for r in boxes(a)] == [(2, 0, True), (1, 0, False)]
    assert boxes(a)[0][2:6] == pytest.approx((2 / 40, 3 / 30, 12 / 40, 9 / 30))
    (voc / "a.txt").write_text("3 4 3 20 15\n3 0 0 8 8\n\n7 1 1 2 2\n")
    (voc / "t.txt").write_text("a.jpg a.txt\n")
    convert(voc, db="db2", list="t.txt", label_type="txt", label_map_file="")
    (_, a), = records(voc / "db2")
    assert [r[:2] for r in boxes(a)] == [(3, 0), (3, 1), (7, 0)]


@pytest.mark.parametrize("obj, problem", [
    (OBJ.format(name="horse", d=0, b=(1, 1, 5, 5)),
     r"a.xml: object 1 \('horse'\): the name is not in the label map \(known: cat, dog, "
     r"none_of_the_above\)"),
    (OBJ.format(name="dog", d=0, b=(20, 1, 5, 5)),
     r"a.xml: object 1 \('dog'\): the box is inverted \(xmin, ymin, xmax, ymax = 20, 1, 5, 5\)"),
    (OBJ.format(name="dog", d=0, b=(1, 1, 45, 5)),
     r"a.xml: object 1 \('dog'\): the box \(xmin, ymin, xmax, ymax = 1, 1, 45, 5\) lies outside the "
     r"40x30 image"),
])
def test_bad_annotations_are_one_line_errors_naming_the_file_and_object(voc, obj, problem):
    (voc / "a.xml").write_text(VOC.format(w=40, h=30, objects=obj))
    with pytest.raises(DataError, match=problem):
        convert(voc)


def test_label_map_errors(voc):
    (voc / "dup.prototxt").write_text(LABELMAP + 'item { name: "dog" label: 3 }\n')
    with pytest.raises(DataError, match=r"dup.prototxt: the name 'dog' is given twice \(labels 1 and 3; "
                                        r"--check_label\)"):
        convert(voc, label_map_file=str(voc / "dup.prototxt"), check_label=True)
    assert convert(voc, db="db2", label_map_file=str(voc / "dup.prototxt")) == 2     # the last wins
    assert {r[0] for r in boxes(records(voc / "db2")[0][1])} == {3, 2}
    (voc / "bad.prototxt").write_text("item { nam: 1 }")
    with pytest.raises(DataError, match=r"bad.prototxt: not a LabelMap prototxt"):
        convert(voc, db="db3", label_map_file=str(voc / "bad.prototxt"))
    with pytest.raises(UsageError, match=r"--label_map_file: needed to read xml annotations"):
        convert(voc, db="db4", label_map_file="")


def test_create_label_map_field_counts_background_and_delimiters(tmp_path):
    (tmp_path / "one.txt").write_text("dog\ncat\n")
    lm = annoset.create_label_map(str(tmp_path / "one.txt"), str(tmp_path / "one.prototxt"),
                                  include_background=True)
    assert [(i.name, i.label, i.display_name) for i in lm.item] == [
        ("none_of_the_above", 0, "background"), ("dog", 1, "dog"), ("cat", 2, "cat")]
    back = text_format.Parse((tmp_path / "one.prototxt").read_text(), caffe_pb2.LabelMap())
    assert back == lm
    (tmp_path / "three.txt").write_text("n01:7:Dog\nn02:9:Cat\n")
    lm = annoset.create_label_map(str(tmp_path / "three.txt"), str(tmp_path / "t.prototxt"), delimiter=":")
    assert [(i.name, i.label, i.display_name) for i in lm.item] == [("n01", 7, "Dog"), ("n02", 9, "Cat")]
    (tmp_path / "mixed.txt").write_text("dog 1\ncat\n")
    with pytest.raises(DataError, match=r"mixed.txt:2: 1 fields where the first line has 2, got 'cat'"):
        annoset.create_label_map(str(tmp_path / "mixed.txt"), str(tmp_path / "m.prototxt"))


def test_get_image_size_names_and_ids(voc):
    lines = annoset.get_image_size(str(voc), str(voc / "list.txt"), str(voc / "sizes.txt"))
    assert (voc / "sizes.txt").read_text() == "a 30 40\nb 30 40\n" == "".join(lines)
    (voc / "ids.txt").write_text("a 11\nb 12\n")
    annoset.get_image_size(str(voc), str(voc / "list.txt"), str(voc / "sizes2.txt"), str(voc / "ids.txt"))
    assert (voc / "sizes2.txt").read_text() == "11 30 40\n12 30 40\n"


def test_generated_set_round_trips_through_convert_annoset(tmp_path):
    """Every box of the shapes set's xml files comes back from the records, as a fraction of 96."""
    import xml.etree.ElementTree as ET
    write_shapes(tmp_path, 6, 0, size=96, seed=2)
    annoset.convert_annoset(str(tmp_path) + "/", str(tmp_path / "trainval.txt"), str(tmp_path / "db"),
                            anno_type="detection", label_map_file=str(tmp_path / "labelmap.prototxt"))
    for key, a in records(tmp_path / "db"):
        image_id = key.split("/")[-1][:-4]
        objs = ET.parse(tmp_path / "Annotations" / f"{image_id}.xml").getroot().findall("object")
        got = sorted((r[2] * 96, r[3] * 96, r[4] * 96, r[5] * 96) for r in boxes(a))
        want = sorted(tuple(float(o.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax"))
                      for o in objs)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert (a.datum.channels, a.datum.height, a.datum.width) == (3, 96, 96)


def test_cli_tools_and_one_line_errors(voc):
    runner = CliRunner()
    res = runner.invoke(main, ["convert_annoset", "-anno_type=detection",
                               f"-label_map_file={voc / 'labelmap.prototxt'}", "-encoded",
                               str(voc) + "/", str(voc / "list.txt"), str(voc / "db")])
    assert res.exit_code == 0, res.output
    assert len(records(voc / "db")) == 2
    (voc / "a.xml").write_text(VOC.format(w=40, h=30, objects=OBJ.format(name="horse", d=0, b=(1, 1, 5, 5))))
    res = runner.invoke(main, ["convert_annoset", "--anno_type", "detection", "--label_map_file",
                               str(voc / "labelmap.prototxt"), str(voc) + "/", str(voc / "list.txt"),
                               str(voc / "db2")])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert lines[-1].startswith("caffepy: error: ") and "a.xml: object 1 ('horse'): the name is not in " \
        "the label map" in lines[-1]
    assert not (voc / "db2").exists()
    (voc / "names.txt").write_text("dog\ncat\n")
    res = runner.invoke(main, ["create_label_map", "-include_background", str(voc / "names.txt"),
                               str(voc / "lm.prototxt")])
    assert res.exit_code == 0 and 'name: "none_of_the_above"' in (voc / "lm.prototxt").read_text()
    res = runner.invoke(main, ["get_image_size", str(voc) + "/", str(voc / "list.txt"), str(voc / "s.txt")])
    assert res.exit_code == 0 and (voc / "s.txt").read_text().startswith("a 30 40")
