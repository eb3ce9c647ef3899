"""YOLO v2's RegionLoss and EvalDetection against loop references written from Intel Caffe's
layers (the swap to darknet's layout, cell by cell and anchor by anchor), and hand-worked
detections."""
import math

import numpy as np
import pytest

from caffepy.errors import LayerError, ShapeError
from gradient_checker import check_gradient
from layer_cases import Case, case_tests, randn, setup_layer

SIDE, NUM, CLASSES = 3, 2, 3
BIASES = [1.0, 1.5, 2.0, 1.0]


def region_param(**fields):
    """Intel's yolov2_train.prototxt scales unless given (caffe.proto's defaults differ)."""
    fields = {"object_scale": 5.0, "noobject_scale": 1.0, "class_scale": 1.0, "coord_scale": 1.0, "thresh": 0.6,
              **fields}
    text = " ".join(f"{k}: {v}" for k, v in fields.items())
    biases = " ".join(f"biases: {b}" for b in BIASES)
    return f"region_loss_param {{ side: {SIDE} num: {NUM} num_class: {CLASSES} {biases} {text} }}"


def label_rows(rows):
    """AnnotatedData's 1 x 1 x boxes x 8 blob from (item, label, xmin, ymin, xmax, ymax) rows."""
    out = np.array([[item, label, 0, x1, y1, x2, y2, 0] for item, label, x1, y1, x2, y2 in rows], np.float32)
    return out.reshape(1, 1, len(rows), 8)


def sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def iou_center(a, b):
    """Intel's region-loss Calc_iou, as written there."""
    w = min(a[0] + a[2] / 2, b[0] + b[2] / 2) - max(a[0] - a[2] / 2, b[0] - b[2] / 2)
    h = min(a[1] + a[3] / 2, b[1] + b[3] / 2) - max(a[1] - a[3] / 2, b[1] - b[3] / 2)
    if w < 0 or h < 0:
        return 0.0
    return w * h / (a[2] * a[3] + b[2] * b[3] - w * h)


def region_ref(x, labels, thresh=0.6, object_scale=5.0, noobject_scale=1.0, class_scale=1.0,
               coord_scale=1.0, bias_match=True):
    """Intel's RegionLoss forward loop by loop: the deltas (N C H W), the loss (sum of their
    squares) and the objective E whose gradient the deltas are (see the layer's docstring)."""
    n_img, c, side, _ = x.shape
    size = CLASSES + 5
    swap = np.zeros((n_img, side * side, NUM, size))
    for b in range(n_img):
        for h in range(side):
            for w in range(side):
                for ch in range(c):
                    swap[b, h * side + w, ch // size, ch % size] = x[b, ch, h, w]
    truths = [[] for _ in range(n_img)]
    for item, label, _, x1, y1, x2, y2, _ in labels.reshape(-1, 8):
        if item != -1:
            truths[int(item)].append((int(label) - 1, (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1))
    diff = np.zeros_like(swap)
    objective = 0.0

    def box(s, n, i, j):
        return [(i + sig(s[0])) / side, (j + sig(s[1])) / side, math.exp(s[2]) * BIASES[2 * n] / side,
                math.exp(s[3]) * BIASES[2 * n + 1] / side]

    for b in range(n_img):
        for j in range(side):
            for i in range(side):
                for n in range(NUM):
                    s = swap[b, j * side + i, n]
                    best = max([iou_center(box(s, n, i, j), t[1:]) for t in truths[b]], default=0.0)
                    o = sig(s[4])
                    if best <= thresh:
                        diff[b, j * side + i, n, 4] = noobject_scale * o * o * (1 - o)
        matched = {}
        for t in truths[b]:
            i, j = int(t[1] * side), int(t[2] * side)
            best, best_n = 0.0, 0
            for n in range(NUM):
                s = swap[b, j * side + i, n]
                shape = [0, 0, BIASES[2 * n] / side, BIASES[2 * n + 1] / side] if bias_match else \
                    [0, 0] + box(s, n, i, j)[2:]
                overlap = iou_center(shape, [0, 0, t[3], t[4]])
                if overlap > best:
                    best, best_n = overlap, n
            matched[(j * side + i, best_n)] = t
        for (cell, n), (label, tx, ty, tw, th) in matched.items():
            i, j = cell % side, cell // side
            s, d = swap[b, cell, n], diff[b, cell, n]
            target = [tx * side - i, ty * side - j, math.log(tw * side / BIASES[2 * n]),
                      math.log(th * side / BIASES[2 * n + 1])]
            for k in range(4):
                value = sig(s[k]) if k < 2 else s[k]
                g = value - target[k]
                d[k] = coord_scale * max(-1.0, min(1.0, g)) * (value * (1 - value) if k < 2 else 1.0)
                objective += coord_scale * (0.5 * g * g if abs(g) <= 1 else abs(g) - 0.5)
            o = sig(s[4])
            d[4] = -object_scale * 2 * (1 - o) ** 3 * o * (1 - o)
            objective += 0.5 * object_scale * (1 - o) ** 4
            p = np.exp(s[5:] - s[5:].max())
            p /= p.sum()
            d[5:] = class_scale * (p - np.eye(CLASSES)[label])
            objective -= class_scale * math.log(p[label])
        for cell in range(side * side):
            for n in range(NUM):
                if (cell, n) not in matched and diff[b, cell, n, 4] != 0:
                    objective += 0.5 * noobject_scale * sig(swap[b, cell, n, 4]) ** 2
    nchw = np.zeros_like(x, dtype=np.float64)
    for b in range(n_img):
        for h in range(side):
            for w in range(side):
                for ch in range(c):
                    nchw[b, ch, h, w] = diff[b, h * side + w, ch // size, ch % size]
    return nchw, float(np.sum(nchw ** 2)), objective / n_img


# image 0: two boxes (one large, fitting the wide anchor); image 1: one box; a row of item -1
LABELS = label_rows([(0, 1, 0.1, 0.2, 0.4, 0.5), (0, 3, 0.45, 0.3, 0.95, 0.6), (-1, 0, 0, 0, 0, 0),
                     (1, 2, 0.6, 0.55, 0.8, 0.9)])


def region_inputs(seed):
    """Scores at scale 0.5: every |t_w - log(w side / bias_w)| stays off the Huber seam at 1."""
    x = randn(2, NUM * (CLASSES + 5), SIDE, SIDE, seed=seed, scale=0.5)
    return x


X = region_inputs(50)
# an anchor predicting image 0's first box almost exactly: its IoU passes thresh (no objectness push)
X_HIT = X.copy()
X_HIT[0, 0:4, 1, 0] = [np.log(0.25 / 0.75), np.log(0.05 / 0.95), np.log(0.3 * 3 / 1.0), np.log(0.3 * 3 / 1.5)]


class ObjectiveCase(Case):
    """RegionLoss's gradient checked against the objective its deltas descend: the top (Intel's
    sum of squared deltas) is not that objective, so the checker differentiates the
    reference's E instead, through the layer's own backward."""

    def __init__(self, *args, objective, **kwargs):
        super().__init__(*args, **kwargs)
        self.objective = objective

    def check_gradient(self):
        layer, bottom, top = self.build()
        check_gradient(_Objective(layer, self.objective), bottom, top, [0], max_checks=self.max_checks)


class _Objective:
    def __init__(self, layer, objective):
        self.layer, self.objective = layer, objective
        self.type, self.name, self.blobs, self.param_propagate_down = layer.type, layer.name, [], []

    def reshape(self, bottom, top):
        self.layer.reshape(bottom, top)

    def forward(self, bottom, top):
        self.layer.forward(bottom, top)
        top[0].data[...] = self.objective(bottom[0].data.astype(np.float64), bottom[1].data)

    def backward(self, top, propagate_down, bottom):
        self.layer.backward(top, propagate_down, bottom)


CASES = [
    ObjectiveCase("RegionLoss", region_param(object_scale=5.0), [X, LABELS], check_bottom=[0],
                  expected=lambda x, l: [np.array(region_ref(x, l)[1])], objective=lambda x, l: region_ref(x, l)[2],
                  id="RegionLoss"),
    ObjectiveCase("RegionLoss", region_param(object_scale=2.0, noobject_scale=0.5, class_scale=3.0, coord_scale=2.0,
                                             thresh=0.2), [region_inputs(51), LABELS], check_bottom=[0],
                  expected=lambda x, l: [np.array(region_ref(x, l, 0.2, 2.0, 0.5, 3.0, 2.0)[1])],
                  objective=lambda x, l: region_ref(x, l, 0.2, 2.0, 0.5, 3.0, 2.0)[2], id="RegionLoss:scales"),
    Case("RegionLoss", region_param(object_scale=5.0), [X_HIT, LABELS], grad=False,
         expected=lambda x, l: [np.array(region_ref(x, l)[1])], id="RegionLoss:iou-above-thresh"),
    Case("RegionLoss", region_param(bias_match=0), [X, LABELS], grad=False,
         expected=lambda x, l: [np.array(region_ref(x, l, bias_match=False)[1])], id="RegionLoss:no-bias-match"),
]

test_forward, test_gradient = case_tests(CASES)


def test_region_loss_backward_is_the_deltas_over_the_batch():
    layer, bottom, top = setup_layer("RegionLoss", region_param(), [X_HIT, LABELS])
    layer.forward(bottom, top)
    top[0].diff[...] = 3.0
    layer.backward(top, [True, False], bottom)
    deltas = region_ref(X_HIT.astype(np.float64), LABELS)[0]
    np.testing.assert_allclose(bottom[0].diff, deltas * 3.0 / 2, rtol=1e-5, atol=1e-7)
    # the near-exact anchor: its box overlaps the truth past thresh; it is the matched anchor too
    assert deltas[0, 4, 1, 0] < 0


def test_region_loss_reads_class_map(tmp_path):
    # class k of the labels trains output position 2 - k
    (tmp_path / "map.txt").write_text("2\n1\n0\n")
    layer, bottom, top = setup_layer("RegionLoss", region_param(class_map=f'"{tmp_path / "map.txt"}"'), [X, LABELS])
    layer.forward(bottom, top)
    flipped = LABELS.copy()
    flipped.reshape(-1, 8)[:, 1] = np.where(flipped.reshape(-1, 8)[:, 0] >= 0, 4 - flipped.reshape(-1, 8)[:, 1], 0)
    assert float(top[0].data) == pytest.approx(region_ref(X.astype(np.float64), flipped)[1], rel=1e-5)


@pytest.mark.parametrize("params,bottoms,match", [
    (region_param(softmax_tree='"tree.txt"'), [X, LABELS],
     r"region_loss_param.softmax_tree: YOLO9000's hierarchical softmax is not supported"),
    (region_param().replace("biases: 1.0 ", "", 1), [X, LABELS],
     r"region_loss_param.biases: needs a width and a height for each of the 2 anchors \(4 values\), got 3"),
    (region_param(), [randn(2, 16, 4, 4), LABELS],
     r"bottom\[0\]: needs N x 16 x 3 x 3 \(region_loss_param num 2 x \(classes 3 \+ 5\) channels on a side x "
     r"side map\), got \(2, 16, 4, 4\)"),
    (region_param(), [X, label_rows([(0, 4, 0.1, 0.1, 0.2, 0.2)])],
     r"bottom\[1\]: a label row needs an item in \[0, 2\) and a label in \[1, 3\], got \[0, 4\]"),
    (region_param(class_map='"no/such/file"'), [X, LABELS],
     r"region_loss_param.class_map: cannot be read as one class position per line, got no/such/file"),
])
def test_region_loss_input_errors(params, bottoms, match):
    with pytest.raises(LayerError, match=match):
        layer, bottom, top = setup_layer("RegionLoss", params, bottoms)
        layer.forward(bottom, top)


# -- EvalDetection: a 2 x 2 map, two anchors of 1 x 1 cells, two classes -----------------------
def eval_param(nms=None, score="MULTIPLY", threshold=0.5):
    extra = "" if nms is None else f"nms: {nms}"
    return (f"eval_detection_param {{ side: 2 num_class: 2 num_object: 2 threshold: {threshold} "
            f"score_type: {score} {extra} biases: 1 biases: 1 biases: 0.8 biases: 0.8 }}")


def eval_map():
    """Anchor (cell row j, column i, anchor n) -> box, class scores, objectness score."""
    x = np.zeros((1, 2 * 7, 2, 2), np.float32)

    def anchor(j, i, n, t_obj, classes, txy=(0.0, 0.0)):
        x[0, n * 7:n * 7 + 2, j, i] = txy
        x[0, n * 7 + 4, j, i] = t_obj
        x[0, n * 7 + 5:n * 7 + 7, j, i] = classes
    # (0, 0, 0): box [0, .5] x [0, .5], class 0, score .953 x .993
    anchor(0, 0, 0, 3.0, (5, 0))
    # (0, 0, 1): box [.05, .45] x [.05, .45], class 0: IoU .64 with (0, 0, 0), .64 with the truth
    anchor(0, 0, 1, 2.5, (5, 0))
    # (0, 1, 0): class 1 at [.5, 1] x [0, .5], where the truth of class 1 is not
    anchor(0, 1, 0, 2.0, (0, 5))
    # (1, 0, 0): class 0 at [0, .5] x [.5, 1]: no truth of class 0 there
    anchor(1, 0, 0, 1.0, (5, 0))
    # the rest: objectness -10, under the 0.005 floor
    for j, i, n in [(0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 1, 1)]:
        anchor(j, i, n, -10.0, (0, 0))
    return x


EVAL_LABELS = label_rows([(0, 1, 0.0, 0.0, 0.5, 0.5), (0, 2, 0.5, 0.5, 1.0, 1.0), (0, 2, 0.6, 0.6, 0.9, 0.9)])


def score(t_obj, classes):
    p = np.exp(np.array(classes, np.float64) - max(classes))
    return sig(t_obj) * (p / p.sum()).max()


@pytest.mark.parametrize("nms", [None, 0.45])
def test_eval_detection_marks_hand_made_detections(nms):
    layer, bottom, top = setup_layer("EvalDetection", eval_param(nms), [eval_map(), EVAL_LABELS])
    layer.forward(bottom, top)
    out = top[0].data[0]
    assert out.shape == (2 + 2 * 2 * 2 * 4,)
    np.testing.assert_array_equal(out[:2], [1, 2])         # truths per class
    rows = out[2:].reshape(-1, 4)
    # by label, then score: class 0's (0, 0, 0) claims the truth; its overlapping twin (0, 0, 1)
    # is a second claim without NMS and suppressed with it; (1, 0, 0) hits nothing; class 1's
    # (0, 1, 0) misses both class-1 truths
    want = [(0, score(3.0, (5, 0)), 1, 0)]
    if nms is None:
        want.append((0, score(2.5, (5, 0)), 0, 1))
    want += [(0, score(1.0, (5, 0)), 0, 1), (1, score(2.0, (0, 5)), 0, 1)]
    np.testing.assert_allclose(rows[:len(want)], want, rtol=1e-5)
    assert not rows[len(want):].any()


def test_eval_detection_score_types_and_input_errors():
    for kind, expected in (("OBJ", sig(3.0)), ("PROB", score(100.0, (5, 0)))):
        layer, bottom, top = setup_layer("EvalDetection", eval_param(0.45, kind), [eval_map(), EVAL_LABELS])
        layer.forward(bottom, top)
        assert top[0].data[0, 3] == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ShapeError, match=r"bottom\[0\]: needs N x 14 x 2 x 2"):
        setup_layer("EvalDetection", eval_param(), [randn(1, 12, 2, 2), EVAL_LABELS])
    with pytest.raises(LayerError, match=r"eval_detection_param.biases: needs a width and a height for each of "
                                         r"the 2 anchors \(4 values\), got 2"):
        setup_layer("EvalDetection", eval_param().replace("biases: 0.8 biases: 0.8", ""), [eval_map(), EVAL_LABELS])
