"""SSD's box arithmetic (the fork's util/bbox_util), shared by its data layer, its loss, its
output and its evaluation.

A box is (xmin, ymin, xmax, ymax); arrays of boxes are [..., 4]. Normalized boxes are
fractions of the image and their area is w * h; pixel boxes (normalized=False) count both
end pixels, (w + 1) * (h + 1), as VOC does. An inverted box (xmax < xmin or ymax < ymin)
has area 0. Arithmetic is float32, as the fork's, so that thresholds (0.5 overlap and the
like) fall on the same side.

    area, jaccard, coverage        sizes and overlaps (jaccard: every pair of two lists)
    clip, project, locate, mirror  boxes moved between frames: an image and a crop of it
    encode, decode                 a box against a prior, for each CodeType
    match                          SSD's bipartite then per-prediction matching
    nms, nms_by_loss               non-maximum suppression (DetectionOutput's; mining's)
    average_precision              ComputeAP for ap_version 11point, MaxIntegral, Integral
"""
import numpy as np

from .proto import caffe_pb2

F = np.float32
CodeType = caffe_pb2.PriorBoxParameter
MatchType = caffe_pb2.MultiBoxLossParameter
AP_VERSIONS = ("11point", "MaxIntegral", "Integral")


def area(b, normalized=True):
    """Areas of boxes [..., 4]; 0 for an inverted box."""
    b = np.asarray(b, F)
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    if not normalized:
        w, h = w + F(1), h + F(1)
    return np.where((b[..., 2] < b[..., 0]) | (b[..., 3] < b[..., 1]), F(0), w * h).astype(F)


def _intersection(a, b, normalized):
    """Intersection areas of a [A, 4] with b [B, 4]: [A, B]; 0 where they do not overlap."""
    one = F(0) if normalized else F(1)
    iw = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]) + one
    ih = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]) + one
    return np.where((iw > 0) & (ih > 0), iw * ih, F(0)).astype(F)


def jaccard(a, b, normalized=True):
    """Intersection over union of every box of a [A, 4] with every box of b [B, 4]: [A, B]."""
    a, b = np.asarray(a, F).reshape(-1, 4), np.asarray(b, F).reshape(-1, 4)
    inter = _intersection(a, b, normalized)
    union = area(a, normalized)[:, None] + area(b, normalized)[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(inter > 0, inter / union, F(0)).astype(F)


def coverage(a, b):
    """The share of each box of a [A, 4] that each box of b [B, 4] covers: [A, B] (the fork's
    BBoxCoverage(a, b) = intersection / area(a))."""
    a, b = np.asarray(a, F).reshape(-1, 4), np.asarray(b, F).reshape(-1, 4)
    inter = _intersection(a, b, True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(inter > 0, inter / area(a)[:, None], F(0)).astype(F)


def clip(b):
    """Boxes with every coordinate clipped to [0, 1]."""
    return np.clip(np.asarray(b, F), F(0), F(1))


def locate(src, b):
    """Boxes b given in the frame of box `src` (0..1 spans src) in src's own frame."""
    src, b = np.asarray(src, F), np.asarray(b, F)
    w, h = src[2] - src[0], src[3] - src[1]
    return np.stack([src[0] + b[..., 0] * w, src[1] + b[..., 1] * h,
                     src[0] + b[..., 2] * w, src[1] + b[..., 3] * h], axis=-1).astype(F)


def project(b, src):
    """Boxes b [N, 4] seen in the frame of box `src` (a crop or a canvas): (boxes clipped to
    [0, 1], kept) where `kept` marks those that overlap src and keep an area after clipping."""
    b, src = np.asarray(b, F).reshape(-1, 4), np.asarray(src, F)
    overlaps = (b[:, 0] < src[2]) & (b[:, 2] > src[0]) & (b[:, 1] < src[3]) & (b[:, 3] > src[1])
    w, h = src[2] - src[0], src[3] - src[1]
    out = clip(np.stack([(b[:, 0] - src[0]) / w, (b[:, 1] - src[1]) / h,
                         (b[:, 2] - src[0]) / w, (b[:, 3] - src[1]) / h], axis=1))
    return out, overlaps & (area(out) > 0)


def mirror(b):
    """Boxes of a horizontally flipped image."""
    b = np.array(b, F)
    b[..., [0, 2]] = F(1) - b[..., [2, 0]]
    return b


def encode(priors, variances, gt, code_type, variance_in_target):
    """The regression targets of boxes gt [N, 4] against their priors [N, 4] (variances [N, 4];
    with variance_in_target they are left out here and divided in later by the caller)."""
    p, g = np.asarray(priors, F), np.asarray(gt, F)
    v = np.ones_like(p) if variance_in_target else np.asarray(variances, F)
    if code_type == CodeType.CORNER:
        return ((g - p) / v).astype(F)
    pw, ph = p[:, 2] - p[:, 0], p[:, 3] - p[:, 1]
    if code_type == CodeType.CORNER_SIZE:
        return ((g - p) / np.stack([pw, ph, pw, ph], axis=1) / v).astype(F)
    gw, gh = g[:, 2] - g[:, 0], g[:, 3] - g[:, 1]
    pcx, pcy = (p[:, 0] + p[:, 2]) / F(2), (p[:, 1] + p[:, 3]) / F(2)
    gcx, gcy = (g[:, 0] + g[:, 2]) / F(2), (g[:, 1] + g[:, 3]) / F(2)
    return np.stack([(gcx - pcx) / pw / v[:, 0], (gcy - pcy) / ph / v[:, 1],
                     np.log(gw / pw) / v[:, 2], np.log(gh / ph) / v[:, 3]], axis=1).astype(F)


def decode(priors, variances, loc, code_type, variance_in_target):
    """Boxes [P, 4] from the location predictions loc [P, 4] against the priors (SSD's DecodeBBox)."""
    v = np.ones_like(variances) if variance_in_target else variances
    pw, ph = priors[:, 2] - priors[:, 0], priors[:, 3] - priors[:, 1]
    if code_type == CodeType.CORNER:
        return priors + v * loc
    if code_type == CodeType.CORNER_SIZE:
        return priors + v * loc * np.stack([pw, ph, pw, ph], axis=1)
    cx = v[:, 0] * loc[:, 0] * pw + (priors[:, 0] + priors[:, 2]) / 2
    cy = v[:, 1] * loc[:, 1] * ph + (priors[:, 1] + priors[:, 3]) / 2
    w, h = np.exp(v[:, 2] * loc[:, 2]) * pw, np.exp(v[:, 3] * loc[:, 3]) * ph
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)


def crosses_boundary(b):
    b = np.asarray(b, F)
    return ((b < 0) | (b > 1)).any(axis=-1)


def match(gt, preds, match_type, overlap_threshold, ignore_cross_boundary=False):
    """SSD's MatchBBox of predictions (priors) preds [P, 4] to ground truth gt [G, 4]:
    (indices [P] int: the gt matched or -1, -2 for a prediction crossing the image boundary
    when those are ignored; overlaps [P] float32: the overlap with the gt matched, else the
    largest overlap with any gt).

    Bipartite first: again and again, the largest overlap left between a prediction and a gt
    both still free pairs them (ties: the lowest prediction, then the lowest gt), until every
    gt is paired or nothing overlaps. With PER_PREDICTION, each prediction left free then
    takes its best gt overlapping it by at least overlap_threshold. Overlaps of 1e-6 or less
    count as none."""
    P = len(preds)
    indices = np.full(P, -1, np.int64)
    overlaps = np.zeros(P, F)
    if len(gt) == 0 or P == 0:
        return indices, overlaps
    o = jaccard(preds, gt)
    o = np.where(o > F(1e-6), o, F(-1))
    if ignore_cross_boundary:
        ignored = crosses_boundary(preds)
        indices[ignored] = -2
        o[ignored] = -1
    overlaps[:] = np.maximum(o.max(axis=1), 0)
    free = o.copy()
    for _ in range(len(gt)):
        flat = int(np.argmax(free))             # row-major: lowest prediction, then lowest gt
        i, j = divmod(flat, free.shape[1])
        if free[i, j] < 0:
            break
        indices[i], overlaps[i] = j, free[i, j]
        free[i, :] = -1
        free[:, j] = -1
    if match_type == MatchType.PER_PREDICTION:
        rest = np.flatnonzero(indices == -1)
        eligible = np.where(o[rest] >= F(overlap_threshold), o[rest], F(-1))
        best = np.argmax(eligible, axis=1)
        found = eligible[np.arange(len(rest)), best] >= 0
        indices[rest[found]] = best[found]
        overlaps[rest[found]] = eligible[np.arange(len(rest)), best][found]
    return indices, overlaps


def nms(boxes, scores, threshold, nms_threshold, eta, top_k):
    """SSD's ApplyNMSFast: the indices kept, best score first. Candidates score above
    `threshold` (the top_k best of them, ties in index order); each is kept unless it overlaps a
    kept one by more than the (adaptive, with eta < 1) nms threshold."""
    candidates = np.flatnonzero(scores > threshold)
    candidates = candidates[np.argsort(-scores[candidates], kind="stable")]
    if top_k > -1:
        candidates = candidates[:top_k]
    kept, limit = [], nms_threshold
    for i in candidates:
        if not kept or (jaccard(boxes[i], boxes[kept])[0] <= limit).all():
            kept.append(int(i))
            if eta < 1 and limit > 0.5:
                limit *= eta
    return kept


def nms_by_loss(boxes, scores, nms_threshold, top_k):
    """SSD's ApplyNMS, as hard example mining runs it: positions into boxes / scores, highest
    score first (ties in order), skipping boxes of area under 1e-5, each suppressing the later
    ones it overlaps by more than nms_threshold, at most top_k (-1: all) kept."""
    order = list(np.argsort(-np.asarray(scores), kind="stable"))
    if top_k > -1:
        order = order[:top_k]
    sizes = area(boxes)
    kept = []
    while order:
        best = order.pop(0)
        if sizes[best] < 1e-5:
            continue
        kept.append(int(best))
        if top_k > -1 and len(kept) >= top_k:
            break
        if order:
            rest = np.asarray(order)
            o = jaccard(boxes[best], boxes[rest])[0]
            order = [int(r) for r, ov in zip(rest, o) if sizes[r] >= 1e-5 and ov <= nms_threshold]
    return kept


def average_precision(scores, true_pos, num_pos, version):
    """ComputeAP: the average precision of detections with `scores`, `true_pos` (1 true, 0
    false positive; detections of difficult objects left out), against num_pos objects.

    Detections are ranked by score (a stable sort: equal scores keep their order). With
    precision p_i and recall r_i after the i-th:
        11point      VOC2007: the mean over t in 0, 0.1, ..., 1 of max p_i over r_i >= t
        MaxIntegral  VOC2010 on: the area under the precision made non-increasing in recall
        Integral     sum p_i (r_i - r_{i-1}), the natural integral
    Recall steps of 1e-6 or less count as none (the fork's eps). 0 without detections or
    objects."""
    if version not in AP_VERSIONS:
        raise ValueError(f"unknown ap_version '{version}'")
    scores = np.asarray(scores, F)
    if scores.size == 0 or num_pos == 0:
        return 0.0
    order = np.argsort(-scores, kind="stable")
    tp = np.cumsum(np.asarray(true_pos, np.int64)[order])
    fp = np.cumsum(1 - np.asarray(true_pos, np.int64)[order])
    prec = tp.astype(F) / (tp + fp).astype(F)
    rec = tp.astype(F) / F(num_pos)
    eps = 1e-6
    if version == "11point":
        ap = F(0)
        for t in range(10, -1, -1):    # the recall levels compared in double, as the fork's
            reached = rec.astype(np.float64) >= t / 10.
            ap += (prec[reached].max() if reached.any() else F(0)) / F(11)
        return float(ap)
    if version == "MaxIntegral":
        ap, cur_rec, cur_prec = F(0), rec[-1], prec[-1]
        for i in range(len(rec) - 2, -1, -1):
            cur_prec = max(prec[i], cur_prec)
            if abs(cur_rec - rec[i]) > eps:
                ap += cur_prec * abs(cur_rec - rec[i])
            cur_rec = rec[i]
        return float(ap + cur_rec * cur_prec)
    ap, prev = F(0), F(0)
    for p, r in zip(prec, rec):
        if abs(r - prev) > eps:
            ap += p * abs(r - prev)
        prev = r
    return float(ap)


class MeanAP:
    """The fork's TestDetection over DetectionEvaluate's rows: `add` each batch's rows
    [K, 5] (image, label, score, tp, fp; image -1: the label's number of objects in score's
    place), then `result(version)`. Rows with tp = fp = 0 (detections of difficult objects
    not evaluated) are left out. mAP is the mean over every label that has a count row, of
    its AP (0 without detections or objects: as the fork, such a label counts in the mean)."""

    def __init__(self):
        self.num_pos, self.detections = {}, {}

    def add(self, rows):
        for image, label, score, tp, fp in np.asarray(rows, np.float32).reshape(-1, 5):
            label = int(label)
            if int(image) == -1:
                self.num_pos[label] = self.num_pos.get(label, 0) + int(score)
            elif int(tp) or int(fp):
                self.detections.setdefault(label, []).append((float(score), int(tp)))

    def merge(self, other):
        for label, n in other.num_pos.items():
            self.num_pos[label] = self.num_pos.get(label, 0) + n
        for label, found in other.detections.items():
            self.detections.setdefault(label, []).extend(found)

    def result(self, version):
        """(mAP, {label: AP}, [labels with objects counted but no detection])."""
        aps, missing = {}, []
        for label in sorted(self.num_pos):
            found = self.detections.get(label)
            if not found:
                missing.append(label)
                continue
            scores, tp = zip(*found)
            aps[label] = average_precision(scores, tp, self.num_pos[label], version)
        total = F(0)
        for ap in aps.values():
            total += F(ap)
        return (float(total / F(len(self.num_pos))) if self.num_pos else 0.0), aps, missing
