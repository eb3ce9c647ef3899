"""SSD's AnnotatedData layer (caffepy/layers/data.py, caffepy/data/annotated.py): the label
blob, boxes that follow their objects through expand, the batch samplers' crops, resize and
mirror, the samplers' constraints, the emit constraint, repeatable and rank-independent draws,
and one-line errors for bad records."""
import numpy as np
import pytest

from caffepy import bbox
from caffepy.context import RunContext
from caffepy.data import annotated
from caffepy.data.augment import Resize
from caffepy.errors import DataError, LayerError
from caffepy.proto import caffe_pb2
from data_helpers import annotated_datum, make_annotated_db
from google.protobuf import text_format
from layer_cases import setup_layer

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST
SSD_SAMPLERS = """
    batch_sampler { max_sample: 1 max_trials: 1 }
    batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 }
      sample_constraint { min_jaccard_overlap: 0.1 } max_sample: 1 max_trials: 50 }
    batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 }
      sample_constraint { min_jaccard_overlap: 0.5 } max_sample: 1 max_trials: 50 }
    batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 }
      sample_constraint { max_jaccard_overlap: 1.0 } max_sample: 1 max_trials: 50 }"""


def params(source, batch, transform="", extra="", samplers=""):
    return (f'data_param {{ source: "{source}" batch_size: {batch} }} '
            f'transform_param {{ {transform} }} annotated_data_param {{ {samplers} {extra} }}')


def layer(source, batch, phase=TRAIN, context=None, **kw):
    return setup_layer("AnnotatedData", params(source, batch, **kw), [], phase, n_top=2,
                       context=context or RunContext())


def forward(lay):
    _, _, top = lay
    lay[0].reshape([], top)
    lay[0].forward([], top)
    return top[0].data.copy(), top[1].data.copy()


def rect_records(n, seed=0, h=120, w=160):
    """Black images with 1-3 solid rectangles, each its own colour; (records, colours) where
    colours[i][(label, instance)] is the BGR colour of record i's object."""
    gen = np.random.default_rng(seed)
    records, colours = [], []
    for i in range(n):
        img = np.zeros((h, w, 3), np.uint8)
        objs, cols = [], {}
        k = int(gen.integers(1, 4))
        for j in range(k):
            x0, y0 = int(gen.integers(0, w // 2)), int(gen.integers(0, h // 2))
            x1, y1 = x0 + int(gen.integers(w // 6, w // 2)), y0 + int(gen.integers(h // 6, h // 2))
            label = int(gen.integers(1, 4))
            colour = (60 + 60 * j, 250 - 50 * label, 40 + 70 * j)
            img[y0:y1, x0:x1] = colour      # later ones hide earlier ones: none overlap below
            objs.append((label, (x0 / w, y0 / h, x1 / w, y1 / h), j == 2))
        # keep only rectangles that no later one overlaps, so each colour is one whole rectangle
        boxes = np.array([o[1] for o in objs], np.float32)
        keep = [a for a in range(k) if all(bbox.jaccard(boxes[a], boxes[b])[0, 0] == 0 for b in range(a + 1, k))]
        img[:] = 0
        objs = [objs[a] for a in keep]
        counts = {}
        for label, (x0, y0, x1, y1), difficult in objs:
            inst = counts.get(label, 0)
            counts[label] = inst + 1
            colour = (60 + 40 * len(cols), 250 - 50 * label, 40 + 30 * inst)
            img[round(y0 * h):round(y1 * h), round(x0 * w):round(x1 * w)] = colour
            cols[(label, inst)] = colour
        records.append(annotated_datum(img, objs))
        colours.append(cols)
    return records, colours


def test_test_phase_label_blob_is_the_records_boxes(tmp_path):
    objs = [[(2, (.1, .2, .5, .6), False), (1, (.5, .5, .9, .8), True), (2, (0, 0, 1, 1), False)],
            [],
            [(3, (.25, .25, .75, .75), False)]]
    db = make_annotated_db(tmp_path / "db", [annotated_datum(np.full((20, 30, 3), i, np.uint8), o)
                                             for i, o in enumerate(objs)])
    lay = layer(db, 3, TEST, transform="resize_param { height: 10 width: 12 }")
    data, label = forward(lay)
    assert data.shape == (3, 3, 10, 12) and data[1].max() == 1
    # rows by item, then group (first appearance of the label), then instance
    want = [[0, 2, 0, .1, .2, .5, .6, 0], [0, 2, 1, 0, 0, 1, 1, 0], [0, 1, 0, .5, .5, .9, .8, 1],
            [2, 3, 0, .25, .25, .75, .75, 0]]
    np.testing.assert_allclose(label.reshape(-1, 8), want, rtol=1e-6)
    assert label.shape == (1, 1, 4, 8)
    data, label = forward(lay)                      # the epoch wraps: records 0, 1, 2 again
    lay2 = layer(make_annotated_db(tmp_path / "empty", [annotated_datum(np.zeros((5, 5, 3), np.uint8), [])]), 2,
                 TEST)
    assert forward(lay2)[1].tolist() == [[[[-1] * 8]]]


def test_records_without_a_type_give_a_label_per_image(tmp_path):
    db = make_annotated_db(tmp_path / "db", [annotated_datum(np.zeros((4, 4, 3), np.uint8), [], typed=False,
                                                             label=7 + i) for i in range(3)])
    _, label = forward(layer(db, 3, TEST))
    assert label.tolist() == [7, 8, 9]
    # anno_type in the layer gives every record boxes (none here)
    _, label = forward(layer(db, 2, TEST, extra="anno_type: BBOX"))
    assert label.shape == (1, 1, 1, 8)


def boxes_follow_their_objects(data, label, colours, item_colours, size, tol):
    """Every box row bounds, within `tol` pixels, the pixels of its object's colour."""
    checked = 0
    for row in label.reshape(-1, 8):
        if row[0] < 0:
            continue
        j, lab, inst = (int(v) for v in row[:3])
        colour = item_colours[j][(lab, inst)]
        img = data[j].transpose(1, 2, 0)
        ys, xs = np.nonzero(np.all(np.abs(img - np.array(colour)) < 0.5, axis=2))
        assert len(xs), f"item {j}: no pixel of object ({lab}, {inst})"
        got = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], float)
        want = row[3:7] * size
        assert np.abs(got - want).max() <= tol, f"item {j} object ({lab}, {inst}): pixels {got}, box {want}"
        checked += 1
    return checked


def test_boxes_follow_their_objects_through_expand_samplers_resize_and_mirror(tmp_path):
    records, colours = rect_records(24, seed=1)
    db = make_annotated_db(tmp_path / "db", records)
    transform = ("mirror: true resize_param { resize_mode: WARP height: 80 width: 80 interp_mode: NEAREST } "
                 "emit_constraint { emit_type: CENTER } expand_param { prob: 0.6 max_expand_ratio: 2.5 }")
    lay = layer(db, 8, transform=transform, samplers=SSD_SAMPLERS)
    checked, dropped = 0, 0
    for batch in range(3):
        data, label = forward(lay)
        items = [colours[(8 * batch + j) % 24] for j in range(8)]
        checked += boxes_follow_their_objects(data, label, colours, items, 80, tol=1.0)
        dropped += sum(len(c) for c in items) - (label[0, 0, :, 0] >= 0).sum()
    assert checked > 20 and dropped > 0      # some crops cut objects out (their centres outside)


def test_mirror_flips_boxes_with_the_pixels(tmp_path):
    records, colours = rect_records(8, seed=2)
    db = make_annotated_db(tmp_path / "db", records)
    plain = forward(layer(db, 8, TEST))
    mirrored = forward(layer(db, 8, TRAIN, transform="mirror: true"))
    flipped = 0
    for j in range(8):
        rows_p = plain[1].reshape(-1, 8)[plain[1].reshape(-1, 8)[:, 0] == j]
        rows_m = mirrored[1].reshape(-1, 8)[mirrored[1].reshape(-1, 8)[:, 0] == j]
        if np.array_equal(mirrored[0][j], plain[0][j][:, :, ::-1]):
            flipped += 1
            np.testing.assert_allclose(rows_m[:, [3, 5]], 1 - rows_p[:, [5, 3]], atol=1e-6)
        else:
            np.testing.assert_array_equal(mirrored[0][j], plain[0][j])
            np.testing.assert_array_equal(rows_m, rows_p)
    assert 0 < flipped < 8
    assert boxes_follow_their_objects(*mirrored, colours, colours, np.array([160, 120, 160, 120]), 0.01)


def test_crop_size_with_emit_min_overlap(tmp_path):
    img = np.zeros((40, 40, 3), np.uint8)
    objs = [(1, (0, 0, .25, .25), False), (2, (.3, .3, .7, .7), False), (3, (.45, 0, .55, .45), False)]
    db = make_annotated_db(tmp_path / "db", [annotated_datum(img, objs)])
    # TEST: the centred 20 x 20 crop is (.25, .25) - (.75, .75)
    _, label = forward(layer(db, 1, TEST, transform="crop_size: 20 emit_constraint { emit_type: MIN_OVERLAP "
                                                     "emit_overlap: 0.3 }"))
    rows = label.reshape(-1, 8)
    # object 1 only touches the crop; object 3's box is covered .2 / .45 = .44 > .3
    assert rows[:, 1].tolist() == [2, 3]
    np.testing.assert_allclose(rows[0, 3:7], [.1, .1, .9, .9], atol=1e-6)
    np.testing.assert_allclose(rows[1, 3:7], [.4, 0, .6, .4], atol=1e-6)
    _, label = forward(layer(db, 1, TEST, transform="crop_size: 20 emit_constraint { emit_type: MIN_OVERLAP "
                                                     "emit_overlap: 0.5 }"))
    assert label.reshape(-1, 8)[:, 1].tolist() == [2]


def test_fit_large_size_and_pad_moves_boxes_into_the_padded_frame():
    r = caffe_pb2.ResizeParameter(resize_mode=caffe_pb2.ResizeParameter.FIT_LARGE_SIZE_AND_PAD, height=60, width=60)
    a = annotated.Annotations(np.array([[1, 0, .1, .2, .5, 1, 0]], np.float32))
    a.fit(Resize(r), 50, 100)        # 100 wide, 50 tall: bands of 15 rows above and below
    np.testing.assert_allclose(a.boxes, [[.1, .25 + .2 * .5, .5, .75]], rtol=1e-6)
    a = annotated.Annotations(np.array([[1, 0, 0, .2, 1, .4, 0]], np.float32))
    a.fit(Resize(r), 60, 30)         # 30 wide: bands of 15 columns left and right
    np.testing.assert_allclose(a.boxes, [[.25, .2, .75, .4]], rtol=1e-6)


def sampler(text):
    return text_format.Parse(text, caffe_pb2.BatchSampler())


def test_sampled_boxes_keep_scale_aspect_and_constraints():
    gen = np.random.default_rng(0)
    s = sampler("sampler { min_scale: 0.3 max_scale: 0.6 min_aspect_ratio: 0.5 max_aspect_ratio: 2 }")
    b = annotated.sample_boxes(s.sampler, 500, gen)
    w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    assert (0 <= b[:, :2]).all() and (b[:, 2:] <= 1 + 1e-6).all()
    assert (.3 - 1e-6 <= np.sqrt(w * h)).all() and (np.sqrt(w * h) <= .6 + 1e-6).all()
    assert (.5 - 1e-5 <= w / h).all() and (w / h <= 2 + 1e-5).all()
    assert w.min() < .4 and w.max() > .7            # the whole ranges are drawn
    objects = np.float32([[.1, .1, .4, .4], [.6, .6, .9, .9]])
    c = sampler("sampler { min_scale: 0.3 max_scale: 1 } sample_constraint { min_jaccard_overlap: 0.5 } "
                "max_trials: 200")
    found = annotated.batch_samples([c], objects, gen)
    assert found and all(bbox.jaccard(f, objects).max() >= .5 for f in found)
    c.max_sample = 3
    assert len(annotated.batch_samples([c], objects, gen)) == 3
    c.use_original_image = False
    assert annotated.batch_samples([c], objects, gen) == []
    # no object: a constrained sampler finds nothing, an unconstrained one anything
    assert annotated.batch_samples([sampler("sample_constraint { min_jaccard_overlap: 0.1 } max_trials: 5")],
                                   np.zeros((0, 4), np.float32), gen) == []
    assert len(annotated.batch_samples([sampler("max_trials: 5")], np.zeros((0, 4), np.float32), gen)) == 5


@pytest.mark.parametrize("constraint, want", [
    ("min_jaccard_overlap: 0.5", True),          # object 0: .5625
    ("min_jaccard_overlap: 0.6", False),
    ("max_jaccard_overlap: 0.1", True),          # object 1: 0
    ("min_object_coverage: 1.0", True),          # object 0 lies inside the sample
    ("min_sample_coverage: 0.9", False),         # object 0 covers .5625 of the sample
    # every bound must hold for one object: object 0 meets the first, only object 1 the second
    ("min_jaccard_overlap: 0.5 max_object_coverage: 0.5", False),
    ("min_jaccard_overlap: 0.5 max_sample_coverage: 0.6", True),
])
def test_sample_constraints_on_one_object(constraint, want):
    sample = np.float32([.1, .1, .5, .5])
    objects = np.float32([[.1, .1, .4, .4], [.6, .6, .9, .9]])
    c = text_format.Parse(constraint, caffe_pb2.SampleConstraint())
    assert annotated.meets(sample, objects, c).tolist() == [want]


def test_draws_repeat_resume_and_do_not_depend_on_the_ranks(tmp_path):
    records, _ = rect_records(12, seed=3)
    db = make_annotated_db(tmp_path / "db", records)
    kw = dict(transform="mirror: true resize_param { height: 48 width: 48 } emit_constraint { emit_type: CENTER } "
                        "expand_param { prob: 0.5 max_expand_ratio: 3 } distort_param { brightness_prob: 0.5 "
                        "brightness_delta: 32 }", samplers=SSD_SAMPLERS)
    one = layer(db, 4, **kw)
    batches = [forward(one) for _ in range(4)]
    again = layer(db, 4, **kw)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in
               zip(batches, [forward(again) for _ in range(4)]))
    # resume: a new layer given the state after two batches reads the third and fourth
    half = layer(db, 4, **kw)
    forward(half)
    forward(half)
    state = half[0].read_state()
    resumed = layer(db, 4, **kw)
    resumed[0].set_read_state(state)
    for want in batches[2:]:
        got = forward(resumed)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    # two ranks of batch 2: rank r's item i is the global batch's item 2 i + r
    ranks = [layer(db, 2, context=RunContext(rank=r, size=2), **kw) for r in range(2)]
    for want in batches:
        parts = [forward(r) for r in ranks]
        for r, (data, label) in enumerate(parts):
            for i in range(2):
                g = 2 * i + r
                np.testing.assert_array_equal(data[i], want[0][g])
                rows = label.reshape(-1, 8)
                wrows = want[1].reshape(-1, 8)
                np.testing.assert_array_equal(rows[rows[:, 0] == i][:, 1:], wrows[wrows[:, 0] == g][:, 1:])


@pytest.mark.parametrize("obj, problem", [
    ((1, (.2, .1, .1, .5), False), r"key '00000001': annotation_group label 1 instance 0: the box is inverted "
                                   r"\(xmin, ymin, xmax, ymax = 0.2, 0.1, 0.1, 0.5\)"),
    ((1, (.2, .1, 1.5, .5), False), r"key '00000001': annotation_group label 1 instance 0: the box \(xmin, ymin, "
                                    r"xmax, ymax = 0.2, 0.1, 1.5, 0.5\) lies outside the image"),
    ((9, (.2, .1, .3, .5), False), r"key '00000001': annotation_group label 9 is not in the label map \S+lm.prototxt "
                                   r"\(its labels: 0, 1, 2\)"),
])
def test_bad_records_are_one_line_errors_naming_the_key(tmp_path, obj, problem):
    (tmp_path / "lm.prototxt").write_text('item { name: "bg" label: 0 } item { name: "a" label: 1 } '
                                          'item { name: "b" label: 2 }')
    img = np.zeros((8, 8, 3), np.uint8)
    db = make_annotated_db(tmp_path / "db", [annotated_datum(img, [(1, (.1, .1, .5, .5), False)]),
                                             annotated_datum(img, [obj])])
    lay = layer(db, 2, TEST, extra=f'label_map_file: "{tmp_path / "lm.prototxt"}"')
    with pytest.raises(DataError, match=r"layer 'layer' \(AnnotatedData\): data_param.source: \S+db: " + problem):
        forward(lay)
    # the first record is read at setup
    db = make_annotated_db(tmp_path / "db2", [annotated_datum(img, [obj])])
    with pytest.raises(DataError, match=problem.replace("00000001", "00000000")):
        layer(db, 1, TEST, extra=f'label_map_file: "{tmp_path / "lm.prototxt"}"')


def test_setup_errors(tmp_path):
    db = make_annotated_db(tmp_path / "db", [annotated_datum(np.zeros((8, 8, 3), np.uint8), [])])
    with pytest.raises(LayerError, match=r"annotated_data_param.batch_sampler: crops the images to varying sizes. "
                                         r"Give transform_param a resize_param"):
        layer(db, 1, samplers=SSD_SAMPLERS)
    with pytest.raises(LayerError, match=r"batch_sampler\[0\].sampler.min_scale: needs 0 < min_scale <= max_scale "
                                         r"<= 1, got 0.5, 0.4"):
        layer(db, 1, samplers="batch_sampler { sampler { min_scale: 0.5 max_scale: 0.4 } }")
    with pytest.raises(DataError, match=r"annotated_data_param.label_map_file: \S+nolm.prototxt: cannot read"):
        layer(db, 1, extra=f'label_map_file: "{tmp_path / "nolm.prototxt"}"')
