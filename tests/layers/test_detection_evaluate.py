"""DetectionEvaluate (caffepy/layers/detection.py) and the mAP of its rows (caffepy.bbox.MeanAP)
against an independent VOC-style evaluation written here: detections ranked per class over all
images, each matched to its image's best object of its class, AP as the VOC devkit computes it
(VOC2007's 11 points, VOC2010's area under the interpolated curve) and as the plain integral."""
import numpy as np
import pytest

from caffepy.bbox import MeanAP
from caffepy.errors import LayerError
from layer_cases import setup_layer

VERSIONS = ("11point", "MaxIntegral", "Integral")


def voc_iou(a, b, pixels=False):
    one = 1.0 if pixels else 0.0
    iw = min(a[2], b[2]) - max(a[0], b[0]) + one
    ih = min(a[3], b[3]) - max(a[1], b[1]) + one
    if iw <= 0 or ih <= 0:
        return 0.0
    area = lambda r: (r[2] - r[0] + one) * (r[3] - r[1] + one)
    return iw * ih / (area(a) + area(b) - iw * ih)


def voc_ap(rec, prec, version):
    """The VOC devkit's AP (voc_eval.py's voc_ap), and the plain integral. The 11 recall levels
    are j / 10 and recall is a float32, as in the fork (the devkit's np.arange(0, 1.1, 0.1)
    puts the levels .3 and .7 a hair above, so an exact recall of .3 misses its level there)."""
    if version == "11point":
        rec = rec.astype(np.float32).astype(np.float64)
        return sum((prec[rec >= j / 10].max() if (rec >= j / 10).any() else 0.0) for j in range(11)) / 11
    if version == "Integral":
        return float(np.sum(prec * np.diff(np.concatenate([[0.0], rec]))))
    mrec, mpre = np.concatenate([[0.0], rec, [1.0]]), np.concatenate([[0.0], prec, [0.0]])
    for i in range(len(mpre) - 2, -1, -1):
        mpre[i] = max(mpre[i], mpre[i + 1])
    i = np.flatnonzero(mrec[1:] != mrec[:-1])
    return float(np.sum((mrec[i + 1] - mrec[i]) * mpre[i + 1]))


def voc_map(dets, gts, classes, version, threshold=0.5, use_difficult=True, sizes=None):
    """dets: [(image, label, score, box)]; gts: [(image, label, box, difficult)]; classes: the
    labels scored. sizes: {image: (h, w)} for pixel boxes."""
    aps = []
    for c in classes:
        truth = {}
        for image, label, box, difficult in gts:
            if label == c:
                truth.setdefault(image, []).append([box, difficult, False])
        npos = sum(1 for rows in truth.values() for _, d, _ in rows if use_difficult or not d)
        mine = sorted([d for d in dets if d[1] == c], key=lambda d: -d[2])
        tp, fp = [], []
        for image, _, _, box in mine:
            rows = truth.get(image, [])
            scale = (lambda b: np.clip(b, 0, 1) * np.array(sizes[image][::-1] * 2)) if sizes else (lambda b: b)
            ovs = [voc_iou(scale(np.array(box)), scale(np.array(b)), sizes is not None) for b, _, _ in rows]
            j = int(np.argmax(ovs)) if ovs else -1
            if j >= 0 and ovs[j] >= threshold:
                if rows[j][1] and not use_difficult:
                    continue
                tp.append(0 if rows[j][2] else 1)
                fp.append(1 if rows[j][2] else 0)
                rows[j][2] = True
            else:
                tp.append(0)
                fp.append(1)
        if not mine or npos == 0:
            aps.append(0.0)
            continue
        tp, fp = np.cumsum(tp), np.cumsum(fp)
        aps.append(voc_ap(tp / npos, tp / np.maximum(tp + fp, 1e-12), version))
    return float(np.mean(aps))


def random_scene(seed, images=6, classes=4):
    g = np.random.default_rng(seed)
    gts, dets = [], []
    for image in range(images):
        for _ in range(int(g.integers(1, 4))):
            lo = g.uniform(0, .6, 2)
            box = [*lo, *(lo + g.uniform(.1, .4, 2))]
            label = int(g.integers(1, classes))
            gts.append((image, label, box, bool(g.random() < .2)))
            for _ in range(int(g.integers(0, 3))):       # detections near it, some off
                jitter = g.normal(0, .05, 4)
                dets.append((image, label if g.random() < .8 else int(g.integers(1, classes)),
                             float(g.random()), list(np.array(box) + jitter)))
        for _ in range(int(g.integers(0, 3))):           # stray detections
            lo = g.uniform(0, .7, 2)
            dets.append((image, int(g.integers(1, classes)), float(g.random()), [*lo, *(lo + .2)]))
    return dets, gts


def blobs(dets, gts):
    det = np.float32([[i, l, s, *b] for i, l, s, b in dets]).reshape(1, 1, -1, 7)
    gt = np.float32([[i, l, 0, *b, d] for i, l, b, d in gts]).reshape(1, 1, -1, 8)
    return [det, gt]


def evaluate(params, bottoms):
    layer, bottom, top = setup_layer("DetectionEvaluate", params, bottoms)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return layer, top[0].data.reshape(-1, 5).copy()


@pytest.mark.parametrize("difficult", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_map_matches_the_voc_reference_for_every_ap_version(seed, difficult):
    dets, gts = random_scene(seed)
    _, rows = evaluate(f"detection_evaluate_param {{ num_classes: 4 evaluate_difficult_gt: "
                       f"{str(difficult).lower()} }}", blobs(dets, gts))
    acc = MeanAP()
    acc.add(rows)
    for version in VERSIONS:
        got = acc.result(version)[0]
        want = voc_map(dets, gts, [1, 2, 3], version, use_difficult=difficult)
        assert got == pytest.approx(want, abs=2e-6), version


def test_map_over_batches_equals_map_of_the_whole():
    dets, gts = random_scene(7, images=8)
    whole = MeanAP()
    whole.add(evaluate("detection_evaluate_param { num_classes: 4 }", blobs(dets, gts))[1])
    parts = MeanAP()
    for lo in (0, 3, 5):
        hi = {0: 3, 3: 5, 5: 8}[lo]
        d = [(i - lo, l, s, b) for i, l, s, b in dets if lo <= i < hi]
        g = [(i - lo, l, b, x) for i, l, b, x in gts if lo <= i < hi]
        parts.add(evaluate("detection_evaluate_param { num_classes: 4 }", blobs(d, g))[1])
    for version in VERSIONS:
        assert parts.result(version)[0] == pytest.approx(whole.result(version)[0], abs=1e-7)


def test_rows_by_hand():
    gts = [(0, 1, [.1, .1, .5, .5], False), (0, 1, [.6, .6, .9, .9], True), (1, 2, [0, 0, .5, .5], False)]
    dets = [(0, 1, .3, [.1, .1, .5, .5]),       # the object, again: a duplicate
            (0, 1, .9, [.12, .1, .5, .5]),      # the object: true positive
            (0, 1, .6, [.6, .6, .9, .88]),      # the difficult one: neither
            (0, 2, .5, [0, 0, .5, .5]),         # no object of label 2 in image 0
            (1, 2, .4, [.4, .4, .9, .9])]       # misses
    _, rows = evaluate("detection_evaluate_param { num_classes: 3 evaluate_difficult_gt: false }", blobs(dets, gts))
    np.testing.assert_allclose(rows, [[-1, 1, 1, -1, -1], [-1, 2, 1, -1, -1],
                                      [0, 1, .9, 1, 0], [0, 1, .6, 0, 0], [0, 1, .3, 0, 1],
                                      [0, 2, .5, 0, 1], [1, 2, .4, 0, 1]], rtol=1e-6)
    _, rows = evaluate("detection_evaluate_param { num_classes: 3 }", blobs(dets, gts))
    assert rows[0].tolist() == [-1, 1, 2, -1, -1] and rows[3].tolist()[3:] == [1, 0]
    # DetectionOutput's row for an image without detections is no detection
    none = np.float32([[0, -1, -1, -1, -1, -1, -1]]).reshape(1, 1, 1, 7)
    _, rows = evaluate("detection_evaluate_param { num_classes: 3 }", [none, blobs(dets, gts)[1]])
    assert rows[:, 0].tolist() == [-1, -1]


def test_name_size_file_scores_pixel_boxes(tmp_path):
    # a box shifted by a quarter of its width: below .65 overlap normalized, above it in pixels
    (tmp_path / "sizes.txt").write_text("a 40 40\nb 20 20\n")
    gts = [(0, 1, [.1, .1, .2, .2], False), (1, 1, [.1, .1, .2, .2], False)]
    dets = [(0, 1, .9, [.125, .1, .225, .2]), (1, 1, .8, [.125, .1, .225, .2])]
    normal = MeanAP()
    normal.add(evaluate("detection_evaluate_param { num_classes: 2 overlap_threshold: 0.65 }", blobs(dets, gts))[1])
    layer, rows = evaluate(f'detection_evaluate_param {{ num_classes: 2 overlap_threshold: 0.65 name_size_file: '
                           f'"{tmp_path / "sizes.txt"}" }}', blobs(dets, gts))
    # normalized: .075 / .125 = .6; on 40 x 40: 4 x 5 shared of 5 x 5 + 5 x 5 (end pixels) = 20 / 30
    # = .667; on 20 x 20: 2.5 x 3 of 3 x 3 twice = 7.5 / 10.5 = .714
    assert [r[3] for r in rows[1:]] == [1, 1]
    assert normal.result("Integral")[0] == 0
    want = voc_map(dets, gts, [1], "Integral", 0.65, sizes={0: (40, 40), 1: (20, 20)})
    acc = MeanAP()
    acc.add(rows)
    assert acc.result("Integral")[0] == pytest.approx(want) == 1.0
    assert layer.count == 0                # two images read: the next batch starts at 'a' again


def test_setup_errors():
    dets, gts = random_scene(0)
    with pytest.raises(LayerError, match=r"detection_evaluate_param.num_classes: must be given"):
        setup_layer("DetectionEvaluate", "", blobs(dets, gts))
    with pytest.raises(LayerError, match=r"bottom\[1\]: must be \[1, 1, rows, 8\]"):
        setup_layer("DetectionEvaluate", "detection_evaluate_param { num_classes: 4 }",
                    [blobs(dets, gts)[0], np.zeros((1, 1, 2, 7), np.float32)])
    with pytest.raises(LayerError, match=r"name_size_file: cannot read it"):
        setup_layer("DetectionEvaluate", 'detection_evaluate_param { num_classes: 4 name_size_file: "/nonexistent" }',
                    blobs(dets, gts))
