"""YOLO v2's training loss and evaluation: RegionLoss and EvalDetection (Intel Caffe's layers,
a port of darknet's region layer; Reorg, the third YOLO v2 layer, is in vision.py).

Both read the bottom as darknet lays it out: at each cell (row j, column i) of the side x side
map sit `num` anchors of 4 + 1 + classes values (channel n (classes + 5) + k of the bottom is
value k of anchor n): t_x, t_y, t_w, t_h, the objectness t_o, the class scores. A box is
(x, y, w, h), its centre and size as fractions of the image:
    x = (i + sigmoid(t_x)) / side     w = exp(t_w) bias_w[n] / side
    y = (j + sigmoid(t_y)) / side     h = exp(t_h) bias_h[n] / side
its objectness sigmoid(t_o), its class probabilities the softmax of the class scores, with the
anchors' sizes in cells from `biases` (bias_w, bias_h pairs).

The ground truth is SSD's AnnotatedData label blob, 1 x 1 x boxes x 8 rows: item (image in the
batch; -1 marks no box), group label (1 is the first class: 0 is SSD's background), instance,
xmin, ymin, xmax, ymax (fractions of the image), difficult.

The arithmetic is NumPy in float64: both layers run once per batch over side^2 num boxes.
"""
import numpy as np

from ..errors import ShapeError
from ..layer import Layer, register
from ..proto import caffe_pb2
from .loss import LossLayer

ScoreType = caffe_pb2.EvalDetectionParameter


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))       # no overflow warning for large |x|


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _cells(blob, num, classes, side):
    """The bottom as N x side (j) x side (i) x num x (classes + 5), float64."""
    n = blob.shape[0]
    return blob.data.reshape(n, num, classes + 5, side, side).transpose(0, 3, 4, 1, 2).astype(np.float64)


def _check_map(layer, blob, num, classes, side, field):
    need = num * (classes + 5)
    if blob.num_axes != 4 or blob.shape[1:] != (need, side, side):
        raise layer.error("bottom[0]", f"needs N x {need} x {side} x {side} ({field} num {num} x (classes "
                          f"{classes} + 5) channels on a side x side map)", blob.shape, cls=ShapeError)


def _biases(layer, field, values, num):
    if len(values) != 2 * num:
        raise layer.error(f"{field}.biases", f"needs a width and a height for each of the {num} anchors "
                          f"({2 * num} values)", len(values))
    return np.asarray(values, np.float64).reshape(num, 2)


def _boxes(cells, biases, side):
    """Each anchor's box (x, y, w, h) from N x side x side x num x (classes + 5) cells."""
    j, i = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    x = (i[None, :, :, None] + _sigmoid(cells[..., 0])) / side
    y = (j[None, :, :, None] + _sigmoid(cells[..., 1])) / side
    w = np.exp(cells[..., 2]) * biases[:, 0] / side
    h = np.exp(cells[..., 3]) * biases[:, 1] / side
    return np.stack([x, y, w, h], axis=-1)


def _truths(layer, blob, images, classes, past_the_batch=False):
    """Per image, the ground-truth boxes as rows (class, x, y, w, h) in the label blob's order;
    rows of items past the batch are skipped with `past_the_batch` (EvalDetection: Intel's
    dummy-data nets give item 1 in a batch of 1), else refused."""
    if blob.count % 8:
        raise layer.error("bottom[1]", "needs AnnotatedData's label rows of 8 values (item, label, "
                          "instance, xmin, ymin, xmax, ymax, difficult)", blob.shape, cls=ShapeError)
    rows = blob.data.reshape(-1, 8).astype(np.float64)
    out = [[] for _ in range(images)]
    for row in rows:
        item = int(row[0])
        if item == -1 or (past_the_batch and item >= images):
            continue
        label = int(row[1]) - 1
        if not 0 <= item < images or not 0 <= label < classes:
            raise layer.error("bottom[1]", f"a label row needs an item in [0, {images}) and a label in "
                              f"[1, {classes}]", [item, int(row[1])])
        xmin, ymin, xmax, ymax = row[3:7]
        out[item].append((label, (xmin + xmax) / 2, (ymin + ymax) / 2, xmax - xmin, ymax - ymin))
    return [np.asarray(t, np.float64).reshape(-1, 5) for t in out]


def center_iou(a, b):
    """RegionLoss's IoU of (x, y, w, h) boxes, broadcast: the boxes as given (no clipping)."""
    def overlap(ca, sa, cb, sb):
        return np.minimum(ca + sa / 2, cb + sb / 2) - np.maximum(ca - sa / 2, cb - sb / 2)
    w = overlap(a[..., 0], a[..., 2], b[..., 0], b[..., 2])
    h = overlap(a[..., 1], a[..., 3], b[..., 1], b[..., 3])
    inter = w * h
    union = a[..., 2] * a[..., 3] + b[..., 2] * b[..., 3] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((w < 0) | (h < 0), 0.0, inter / union)


def clipped_iou(a, b):
    """EvalDetection's IoU of (x, y, w, h) boxes, broadcast: each box clipped to the image
    first (SSD's normalized Jaccard overlap of the corners)."""
    def corners(box):
        return (np.clip(box[..., 0] - box[..., 2] / 2, 0, None), np.clip(box[..., 1] - box[..., 3] / 2, 0, None),
                np.clip(box[..., 0] + box[..., 2] / 2, None, 1), np.clip(box[..., 1] + box[..., 3] / 2, None, 1))

    def size(x1, y1, x2, y2):
        return np.where((x2 < x1) | (y2 < y1), 0.0, (x2 - x1) * (y2 - y1))
    ax1, ay1, ax2, ay2 = corners(a)
    bx1, by1, bx2, by2 = corners(b)
    iw = np.minimum(ax2, bx2) - np.maximum(ax1, bx1)
    ih = np.minimum(ay2, by2) - np.maximum(ay1, by1)
    inter = iw * ih
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = inter / (size(ax1, ay1, ax2, ay2) + size(bx1, by1, bx2, by2) - inter)
    return np.where((iw > 0) & (ih > 0), iou, 0.0)


@register
class RegionLoss(LossLayer):
    """YOLO v2's loss (Intel Caffe's layer). Bottoms: the N x num (classes + 5) x side x side
    map and AnnotatedData's labels (module docstring). Per image it sets a delta for each value
    of the map, darknet's: every anchor's objectness is pushed to 0 (noobject_scale) unless its
    box overlaps a ground truth by more than `thresh`; each ground truth picks, in the cell its
    centre falls in, the anchor whose size fits it best (the biases with bias_match, else the
    predicted sizes) and that anchor gets (a later truth overwriting an earlier one)
        coordinates  coord_scale * clip(g, -1, 1) * d/dt g,  g = sigmoid(t_x) - (x side - i),
                     likewise y, and g = t_w - log(w side / bias_w), likewise h
        objectness   -object_scale * 2 (1 - o)^3 o (1 - o)
        classes      class_scale * (p - onehot(label))   (label through class_map if given)
    The top is Intel's loss, the sum of the squared deltas; the backward is the deltas times
    top_diff / N, the gradient of the objective darknet's deltas descend,
        E = sum over matched anchors of coord_scale * huber(g) + 0.5 object_scale (1 - o)^4
            + class_scale * -log p[label], and over unmatched ones 0.5 noobject_scale o^2
    (huber(g) = 0.5 g^2 for |g| <= 1, |g| - 0.5 beyond), divided by N.
    region_loss_param { side num_class coords (4) num bias_match biases object_scale
    noobject_scale class_scale coord_scale thresh class_map (a file: line k holds the
    position of class k) }; softmax (always), jitter, rescore, absolute and random are read by
    neither Intel's layer nor this one; softmax_tree (YOLO9000) is not supported."""

    def setup(self, bottom, top):
        p = self.param.region_loss_param
        field = "region_loss_param"
        if p.softmax_tree:
            raise self.error(f"{field}.softmax_tree", "YOLO9000's hierarchical softmax is not supported",
                             p.softmax_tree, hint="Remove it to train with a flat softmax over num_class")
        if p.coords != 4:
            raise self.error(f"{field}.coords", "only 4 (x, y, w, h) is supported", p.coords)
        if p.side < 1 or p.num < 1 or p.num_class < 1:
            raise self.error(field, "side, num and num_class must be positive", [p.side, p.num, p.num_class])
        self.side, self.num, self.classes = int(p.side), int(p.num), int(p.num_class)
        self.biases = _biases(self, field, p.biases, self.num)
        self.bias_match, self.thresh = bool(p.bias_match), float(p.thresh)
        self.object_scale, self.noobject_scale = float(p.object_scale), float(p.noobject_scale)
        self.class_scale, self.coord_scale = float(p.class_scale), float(p.coord_scale)
        self.class_map = None
        if p.class_map:
            try:
                with open(p.class_map) as f:
                    self.class_map = [int(line.split()[0]) for line in f if line.strip()]
            except (OSError, ValueError) as e:
                raise self.error(f"{field}.class_map", "cannot be read as one class position per line",
                                 p.class_map, hint=str(e)) from None

    def reshape(self, bottom, top):
        # no LossLayer check: the labels' first axis is not the batch
        _check_map(self, bottom[0], self.num, self.classes, self.side, "region_loss_param")
        top[0].reshape(())

    def _deltas(self, bottom):
        """The deltas in the N x side x side x num x (classes + 5) layout."""
        cells = _cells(bottom[0], self.num, self.classes, self.side)
        boxes = _boxes(cells, self.biases, self.side)
        obj = _sigmoid(cells[..., 4])
        prob = _softmax(cells[..., 5:])
        delta = np.zeros_like(cells)
        side = self.side
        for b, truths in enumerate(_truths(self, bottom[1], len(cells), self.classes)):
            best = center_iou(boxes[b][..., None, :], truths[:, 1:]).max(axis=-1, initial=0.0)
            delta[b, ..., 4] = np.where(best > self.thresh, 0.0,
                                        self.noobject_scale * obj[b] * obj[b] * (1 - obj[b]))
            for label, x, y, w, h in truths:
                i, j = min(max(int(x * side), 0), side - 1), min(max(int(y * side), 0), side - 1)
                sizes = self.biases / side if self.bias_match else boxes[b, j, i, :, 2:]
                fits = center_iou(np.concatenate([np.zeros_like(sizes), sizes], axis=1), np.array([0, 0, w, h]))
                n = int(np.argmax(fits)) if fits.max() > 0 else 0
                t = cells[b, j, i, n]
                with np.errstate(divide="ignore"):
                    target = np.array([x * side - i, y * side - j, np.log(w * side / self.biases[n, 0]),
                                       np.log(h * side / self.biases[n, 1])])
                s = _sigmoid(t[:2])
                d = delta[b, j, i, n]
                d[:2] = self.coord_scale * np.clip(s - target[:2], -1, 1) * s * (1 - s)
                d[2:4] = self.coord_scale * np.clip(t[2:4] - target[2:], -1, 1)
                o = obj[b, j, i, n]
                d[4] = -self.object_scale * 2 * (1 - o) ** 3 * o * (1 - o)
                k = int(label) if self.class_map is None else self._mapped(int(label))
                d[5:] = self.class_scale * (prob[b, j, i, n] - np.eye(self.classes)[k])
        return delta

    def _mapped(self, label):
        if label >= len(self.class_map) or not 0 <= self.class_map[label] < self.classes:
            raise self.error("region_loss_param.class_map", f"needs a position in [0, {self.classes}) for "
                             f"class {label}", self.param.region_loss_param.class_map)
        return self.class_map[label]

    def forward(self, bottom, top):
        delta = self._deltas(bottom)
        self.diff = delta.transpose(0, 3, 4, 1, 2).reshape(bottom[0].shape).astype(np.float32)
        top[0].data[...] = np.sum(delta * delta)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.multiply(self.diff, np.float32(self.top_diff(top) / bottom[0].shape[0]), out=bottom[0].diff)


@register
class EvalDetection(Layer):
    """YOLO v2's detections scored against the ground truth (Intel Caffe's layer), for mAP.
    Bottoms: the map, AnnotatedData's labels (module docstring; rows of items past the batch
    are skipped, as Intel's layer does), optionally the image (unused).
    Top N x (num_class + side^2 num_object 4): per image, the number of ground-truth boxes of
    each class, then one row (label, score, tp, fp) per detection, the rest 0.

    Each anchor's box is a detection, labelled with its most probable class (the first of
    ties) and scored by score_type: OBJ the objectness, PROB that class's probability, MULTIPLY
    their product. With nms >= 0 they are sorted by score (ties in anchor order) and
    suppressed greedily across classes when their IoU with a kept box is >= nms; those scoring
    at least 0.005 (darknet's floor) are listed by label, then score. A detection is a true
    positive when its best IoU with a same-class truth not yet claimed reaches `threshold`
    (the truth's first best; IoUs of the boxes clipped to the image), else a false positive.
    Two differences from Intel's layer, on purpose: with nms < 0 (the default) the boxes are
    listed unsuppressed (Intel lists none), and a detection whose best IoU is below threshold
    counts as a false positive (Intel marks it neither, so it would not count against mAP).
    eval_detection_param { side num_class num_object threshold nms score_type biases }; sqrt
    and constriant (YOLO v1's) are read by neither layer."""
    min_bottoms, max_bottoms = 2, 3
    exact_tops = 1
    differentiable = False
    FLOOR = 0.005

    def allow_force_backward(self, bottom_index):
        return False

    def setup(self, bottom, top):
        p = self.param.eval_detection_param
        field = "eval_detection_param"
        if p.side < 1 or p.num_object < 1 or p.num_class < 1:
            raise self.error(field, "side, num_object and num_class must be positive",
                             [p.side, p.num_object, p.num_class])
        self.side, self.num, self.classes = int(p.side), int(p.num_object), int(p.num_class)
        self.biases = _biases(self, field, p.biases, self.num)
        self.threshold, self.nms, self.score_type = float(p.threshold), float(p.nms), p.score_type

    def reshape(self, bottom, top):
        _check_map(self, bottom[0], self.num, self.classes, self.side, "eval_detection_param")
        top[0].reshape(bottom[0].shape[0], self.classes + self.side * self.side * self.num * 4)

    def _detections(self, cells):
        """(labels, scores, boxes) of one image's kept detections, in the output's order."""
        boxes = _boxes(cells[None], self.biases, self.side)[0].reshape(-1, 4)
        prob = _softmax(cells[..., 5:]).reshape(-1, self.classes)
        labels = prob.argmax(axis=1)
        best = prob.max(axis=1)
        obj = _sigmoid(cells[..., 4]).reshape(-1)
        scores = {ScoreType.OBJ: obj, ScoreType.PROB: best}.get(self.score_type, obj * best)
        order = np.argsort(-scores, kind="stable")
        if self.nms >= 0:
            kept = []
            for index in order:
                if not kept or clipped_iou(boxes[index], boxes[kept]).max() < self.nms:
                    kept.append(index)
            order = np.asarray(kept, np.int64)
        order = order[scores[order] >= self.FLOOR]
        order = order[np.argsort(labels[order], kind="stable")]
        return labels[order], scores[order], boxes[order]

    def forward(self, bottom, top):
        cells = _cells(bottom[0], self.num, self.classes, self.side)
        out = top[0].data
        out[...] = 0
        for b, truths in enumerate(_truths(self, bottom[1], len(cells), self.classes, past_the_batch=True)):
            truth_labels = truths[:, 0].astype(np.int64)
            out[b, :self.classes] = np.bincount(truth_labels, minlength=self.classes)
            claimed = np.zeros(len(truths), bool)
            rows = out[b, self.classes:].reshape(-1, 4)
            for r, (label, score, box) in enumerate(zip(*self._detections(cells[b]))):
                same = np.flatnonzero(truth_labels == label)
                tp = False
                if len(same):
                    ious = clipped_iou(box, truths[same, 1:])
                    g = same[int(np.argmax(ious))]
                    if ious.max() >= self.threshold and not claimed[g]:
                        claimed[g] = tp = True
                rows[r] = (label, score, tp, not tp)

    def backward(self, top, propagate_down, bottom):
        pass
