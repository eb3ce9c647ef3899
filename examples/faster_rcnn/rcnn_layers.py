"""Faster R-CNN's Python layers, written for caffepy with py-faster-rcnn's interfaces (the same
bottoms, tops, blob layouts and param_str keys as its lib/rpn and lib/roi_data_layer), so a
train net can name either these or py-faster-rcnn's own:

    ShapesDataLayer      tops data (1 x 3 x H x W, mean subtracted), im_info (1 x 3: height,
                         width, scale), gt_boxes (G x 5: x1, y1, x2, y2 in pixels, class);
                         reads a VOC-layout set (caffepy.data.shapes writes one)
    AnchorTargetLayer    bottoms rpn_cls_score, gt_boxes, im_info, data; tops rpn_labels
                         (1 x 1 x A H x W: 1 object, 0 background, -1 ignored), rpn_bbox_targets,
                         rpn_bbox_inside_weights, rpn_bbox_outside_weights (1 x 4A x H x W)
    ProposalLayer        bottoms rpn_cls_prob_reshape (1 x 2A x H x W), rpn_bbox_pred, im_info;
                         top rois (R x 5: image 0, x1, y1, x2, y2), optional scores
    ProposalTargetLayer  bottoms rpn_rois, gt_boxes; tops rois, labels, bbox_targets,
                         bbox_inside_weights, bbox_outside_weights (R x C x 1 x 1 blobs, as
                         py-R-FCN shapes them: they feed Faster R-CNN and R-FCN's OHEM alike)

param_str is py-faster-rcnn's YAML mapping ("{'feat_stride': 8, 'scales': [1, 2, 3]}"); the settings
py-faster-rcnn keeps in fast_rcnn.config.cfg are SETTINGS here, looked up by str(self.phase).
Sampling draws from a generator seeded by 'seed' in param_str (default 0): runs repeat.
"""
import ast
import os
import re
import xml.etree.ElementTree as ET

import cv2
import numpy as np

import caffe

SETTINGS = {
    "TRAIN": dict(rpn_positive=0.7, rpn_negative=0.3, rpn_batch=128, rpn_fg_fraction=0.5,
                  pre_nms=1000, post_nms=200, nms=0.7, min_size=4,
                  rois=64, fg_fraction=0.25, fg_thresh=0.5, bg_hi=0.5, bg_lo=0.0),
    "TEST": dict(pre_nms=1000, post_nms=100, nms=0.7, min_size=4),
}
# py-faster-rcnn's BBOX_NORMALIZE_TARGETS_PRECOMPUTED: the head's targets are scaled by these
TARGET_STDS = np.array([0.1, 0.1, 0.2, 0.2], np.float32)
PIXEL_MEANS = np.array([102.9801, 115.9465, 122.7717], np.float32)     # BGR, py-faster-rcnn's


def parse_params(text):
    """py-faster-rcnn's param_str (a YAML mapping, braces optional, its entries separated by
    commas or line breaks, YAML's !!python/tuple tag on a list, as py-faster-rcnn's COCO nets
    write it) as a dict."""
    text = re.sub(r"!!python/tuple\s*", "", text).strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    entries = [line.strip().rstrip(",") for line in text.splitlines()]
    return ast.literal_eval("{" + ", ".join(e for e in entries if e) + "}")


# -- box arithmetic (Faster R-CNN's: pixel boxes, widths with the +1) ----------------------
def generate_anchors(base_size=16, ratios=(0.5, 1, 2), scales=(8, 16, 32)):
    """The A = len(ratios) len(scales) anchors around the base_size square at the origin: for
    each ratio (height / width) the square's area reshaped, rounded, then each scale of it."""
    ctr = (base_size - 1) / 2.0
    out = []
    for r in ratios:
        w = np.round(np.sqrt(base_size * base_size / r))
        h = np.round(w * r)
        for s in scales:
            out.append([ctr - 0.5 * (w * s - 1), ctr - 0.5 * (h * s - 1),
                        ctr + 0.5 * (w * s - 1), ctr + 0.5 * (h * s - 1)])
    return np.array(out)


def shifted_anchors(anchors, height, width, stride):
    """All anchors over a height x width map, rows ordered (h, w, anchor)."""
    sy, sx = np.meshgrid(np.arange(height) * stride, np.arange(width) * stride, indexing="ij")
    shifts = np.stack([sx.ravel(), sy.ravel(), sx.ravel(), sy.ravel()], axis=1)
    return (shifts[:, None, :] + anchors[None, :, :]).reshape(-1, 4)


def overlaps(boxes, gt):
    """IoU of each box with each ground-truth box (B x G)."""
    iw = np.minimum(boxes[:, None, 2], gt[None, :, 2]) - np.maximum(boxes[:, None, 0], gt[None, :, 0]) + 1
    ih = np.minimum(boxes[:, None, 3], gt[None, :, 3]) - np.maximum(boxes[:, None, 1], gt[None, :, 1]) + 1
    inter = np.clip(iw, 0, None) * np.clip(ih, 0, None)
    area = lambda b: (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)
    return inter / (area(boxes)[:, None] + area(gt)[None, :] - inter)


def encode(boxes, gt):
    """Regression targets (dx, dy, dw, dh) taking boxes to gt."""
    w, h = boxes[:, 2] - boxes[:, 0] + 1, boxes[:, 3] - boxes[:, 1] + 1
    gw, gh = gt[:, 2] - gt[:, 0] + 1, gt[:, 3] - gt[:, 1] + 1
    return np.stack([(gt[:, 0] + 0.5 * gw - boxes[:, 0] - 0.5 * w) / w,
                     (gt[:, 1] + 0.5 * gh - boxes[:, 1] - 0.5 * h) / h,
                     np.log(gw / w), np.log(gh / h)], axis=1)


def decode(boxes, deltas):
    """Boxes moved by deltas (N x 4k: one set per class), the inverse of encode."""
    w, h = boxes[:, 2:3] - boxes[:, 0:1] + 1, boxes[:, 3:4] - boxes[:, 1:2] + 1
    cx, cy = boxes[:, 0:1] + 0.5 * w, boxes[:, 1:2] + 0.5 * h
    px, py = deltas[:, 0::4] * w + cx, deltas[:, 1::4] * h + cy
    pw, ph = np.exp(np.minimum(deltas[:, 2::4], 10)) * w, np.exp(np.minimum(deltas[:, 3::4], 10)) * h
    out = np.empty(deltas.shape)
    out[:, 0::4], out[:, 1::4] = px - 0.5 * pw, py - 0.5 * ph
    out[:, 2::4], out[:, 3::4] = px + 0.5 * pw, py + 0.5 * ph
    return out


def clip(boxes, height, width):
    boxes[:, 0::2] = np.clip(boxes[:, 0::2], 0, width - 1)
    boxes[:, 1::2] = np.clip(boxes[:, 1::2], 0, height - 1)
    return boxes


def nms(boxes, scores, threshold, limit=None):
    """Greedy non-maximum suppression: indices kept (at most `limit`), best score first."""
    order = np.argsort(-scores, kind="stable")
    b = boxes[order].astype(np.float32)
    # which pairs overlap by more than threshold: inter > threshold * union, in float32 (speed)
    iw = np.minimum.outer(b[:, 2], b[:, 2]) - np.maximum.outer(b[:, 0], b[:, 0]) + 1
    ih = np.minimum.outer(b[:, 3], b[:, 3]) - np.maximum.outer(b[:, 1], b[:, 1]) + 1
    np.maximum(iw, 0, out=iw)
    np.maximum(ih, 0, out=ih)
    iw *= ih
    area = (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)
    union = np.add.outer(area, area)
    union -= iw
    union *= np.float32(threshold)
    iou = iw > union
    suppressed = np.zeros(len(order), bool)
    keep = []
    for k in range(len(order)):
        if suppressed[k]:
            continue
        keep.append(order[k])
        if limit is not None and len(keep) == limit:
            break
        suppressed |= iou[k]
    return np.array(keep, np.int64)


# -- the layers ------------------------------------------------------------------------------
def read_annotations(root, image_id, classes):
    """(BGR image, boxes G x 4 (0-based pixels), class indices 1.. (0 is the background),
    difficult flags) of one image of a VOC-layout set."""
    img = cv2.imread(os.path.join(root, "JPEGImages", image_id + ".jpg"))
    boxes, labels, difficult = [], [], []
    for obj in ET.parse(os.path.join(root, "Annotations", image_id + ".xml")).findall("object"):
        box = obj.find("bndbox")
        boxes.append([float(box.findtext(k)) - 1 for k in ("xmin", "ymin", "xmax", "ymax")])
        labels.append(list(classes).index(obj.findtext("name")) + 1)
        difficult.append(bool(int(obj.findtext("difficult", "0"))))
    return (img, np.array(boxes, np.float64).reshape(-1, 4), np.array(labels, np.int64),
            np.array(difficult, bool))


def read_voc(root, image_id, classes):
    """(image, gt boxes G x 5: x1, y1, x2, y2, class) without the difficult objects, as
    py-faster-rcnn trains."""
    img, boxes, labels, difficult = read_annotations(root, image_id, classes)
    keep = ~difficult
    return img, np.hstack([boxes[keep], labels[keep, None]]).astype(np.float32)


class ShapesDataLayer(caffe.Layer):
    """One image a forward, in a shuffled order (a new order each epoch), flipped at random
    in TRAIN. param_str: root, split ('trainval'), classes (the names in label order), scale
    (1.0: the image's size times it), seed."""

    def setup(self, bottom, top):
        p = parse_params(self.param_str_)
        self.root, self.classes = p["root"], list(p["classes"])
        self.scale = float(p.get("scale", 1.0))
        with open(os.path.join(self.root, "ImageSets", "Main", p.get("split", "trainval") + ".txt")) as f:
            self.ids = [line.strip() for line in f if line.strip()]
        self.rng = np.random.default_rng(p.get("seed", 0))
        self.order, self.cursor = [], 0
        top[0].reshape(1, 3, 1, 1)
        top[1].reshape(1, 3)
        top[2].reshape(1, 5)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        if self.cursor >= len(self.order):
            self.order, self.cursor = self.rng.permutation(len(self.ids)), 0
        image_id = self.ids[self.order[self.cursor]]
        self.cursor += 1
        img, gt = read_voc(self.root, image_id, self.classes)
        if str(self.phase) == "TRAIN" and self.rng.random() < 0.5:
            img = img[:, ::-1]
            gt[:, [0, 2]] = img.shape[1] - 1 - gt[:, [2, 0]]
        if self.scale != 1.0:
            img = cv2.resize(img, None, fx=self.scale, fy=self.scale, interpolation=cv2.INTER_LINEAR)
            gt[:, :4] *= self.scale
        data = (img.astype(np.float32) - PIXEL_MEANS).transpose(2, 0, 1)[None]
        for blob, value in zip(top, (data, [[img.shape[0], img.shape[1], self.scale]], gt)):
            value = np.asarray(value, np.float32)
            blob.reshape(*value.shape)
            blob.data[...] = value

    def backward(self, top, propagate_down, bottom):
        pass


class AnchorTargetLayer(caffe.Layer):
    """Faster R-CNN's RPN targets: anchors wholly inside the image are objects when their IoU
    with a truth reaches rpn_positive or they are some truth's best, background below
    rpn_negative; rpn_batch of them are kept (up to rpn_fg_fraction objects), the rest
    ignored. param_str: feat_stride, scales (8, 16, 32), ratios (0.5, 1, 2), seed."""

    def setup(self, bottom, top):
        p = parse_params(self.param_str_)
        self.stride = p["feat_stride"]
        self.anchors = generate_anchors(scales=p.get("scales", (8, 16, 32)), ratios=p.get("ratios", (0.5, 1, 2)))
        self.rng = np.random.default_rng(p.get("seed", 0))
        height, width = bottom[0].data.shape[-2:]
        a = len(self.anchors)
        top[0].reshape(1, 1, a * height, width)
        for t in top[1:]:
            t.reshape(1, 4 * a, height, width)

    def reshape(self, bottom, top):
        pass

    def _subsample(self, labels, value, keep):
        chosen = np.flatnonzero(labels == value)
        if len(chosen) > keep:
            labels[self.rng.choice(chosen, len(chosen) - keep, replace=False)] = -1

    def forward(self, bottom, top):
        s = SETTINGS[str(self.phase)]
        height, width = bottom[0].data.shape[-2:]
        gt = bottom[1].data[:, :4].astype(np.float64)
        im_h, im_w = bottom[2].data[0, :2]
        a = len(self.anchors)
        anchors = shifted_anchors(self.anchors, height, width, self.stride)
        inside = np.flatnonzero((anchors[:, 0] >= 0) & (anchors[:, 1] >= 0) &
                                (anchors[:, 2] < im_w) & (anchors[:, 3] < im_h))
        labels = np.full(len(inside), -1.0)
        targets = np.zeros((len(inside), 4))
        if len(gt):
            iou = overlaps(anchors[inside], gt)
            best = iou.max(axis=1)
            labels[best < s["rpn_negative"]] = 0
            peak = iou.max(axis=0, keepdims=True)
            labels[np.flatnonzero((iou == peak) & (peak > 0)) // len(gt)] = 1     # each truth's best
            labels[best >= s["rpn_positive"]] = 1
            targets = encode(anchors[inside], gt[iou.argmax(axis=1)])
        else:
            labels[:] = 0
        self._subsample(labels, 1, int(s["rpn_fg_fraction"] * s["rpn_batch"]))
        self._subsample(labels, 0, s["rpn_batch"] - int(np.sum(labels == 1)))
        inside_w = np.where(labels[:, None] == 1, 1.0, 0.0) * np.ones(4)
        outside_w = np.where(labels[:, None] >= 0, 1.0 / max(np.sum(labels >= 0), 1), 0.0) * np.ones(4)

        def full(values, fill):
            out = np.full((len(anchors),) + values.shape[1:], fill, np.float64)
            out[inside] = values
            return out
        rows = [full(labels, -1)] + [full(v, 0) for v in (targets, inside_w, outside_w)]
        # (h, w, anchor) rows -> Caffe's layouts: labels 1 x 1 x A H x W, the rest 1 x 4A x H x W
        out = [rows[0].reshape(1, height, width, a).transpose(0, 3, 1, 2).reshape(1, 1, a * height, width)]
        out += [r.reshape(1, height, width, 4 * a).transpose(0, 3, 1, 2) for r in rows[1:]]
        for blob, value in zip(top, out):
            blob.reshape(*value.shape)
            blob.data[...] = value

    def backward(self, top, propagate_down, bottom):
        pass


class ProposalLayer(caffe.Layer):
    """Faster R-CNN's proposals: every anchor moved by its predicted deltas, clipped to the
    image, those smaller than min_size dropped, the pre_nms best by object score through NMS,
    the post_nms first kept (SETTINGS by phase). param_str: feat_stride, scales, ratios."""

    def setup(self, bottom, top):
        p = parse_params(self.param_str_)
        self.stride = p["feat_stride"]
        self.anchors = generate_anchors(scales=p.get("scales", (8, 16, 32)), ratios=p.get("ratios", (0.5, 1, 2)))
        top[0].reshape(1, 5)
        if len(top) > 1:
            top[1].reshape(1, 1, 1, 1)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        s = SETTINGS[str(self.phase)]
        a = len(self.anchors)
        scores = bottom[0].data[:, a:].transpose(0, 2, 3, 1).reshape(-1)
        deltas = bottom[1].data.transpose(0, 2, 3, 1).reshape(-1, 4)
        height, width = bottom[0].data.shape[-2:]
        im_h, im_w, scale = bottom[2].data[0]
        boxes = clip(decode(shifted_anchors(self.anchors, height, width, self.stride), deltas), im_h, im_w)
        size = s["min_size"] * scale
        keep = np.flatnonzero((boxes[:, 2] - boxes[:, 0] + 1 >= size) & (boxes[:, 3] - boxes[:, 1] + 1 >= size))
        keep = keep[np.argsort(-scores[keep], kind="stable")][:s["pre_nms"]]
        keep = keep[nms(boxes[keep], scores[keep], s["nms"], s["post_nms"])]
        rois = np.hstack([np.zeros((len(keep), 1)), boxes[keep]]).astype(np.float32)
        top[0].reshape(*rois.shape)
        top[0].data[...] = rois
        if len(top) > 1:
            top[1].reshape(len(keep), 1)
            top[1].data[...] = scores[keep, None]

    def backward(self, top, propagate_down, bottom):
        pass


class ProposalTargetLayer(caffe.Layer):
    """Faster R-CNN's head targets: the proposals and the truths themselves, rois of them
    sampled (up to fg_fraction objects with IoU >= fg_thresh, the rest background with IoU in
    [bg_lo, bg_hi)), each labelled with its best truth's class (0 for background) and, for
    objects, regression targets toward it in that class's four columns (scaled by
    1 / TARGET_STDS), or in columns 4 to 7 of 8 with agnostic (py-R-FCN's TRAIN.AGONISTIC).
    param_str: num_classes (with the background), agnostic (False), seed."""

    def setup(self, bottom, top):
        p = parse_params(self.param_str_)
        self.classes = p["num_classes"]
        self.columns = 2 if p.get("agnostic") else self.classes
        self.rng = np.random.default_rng(p.get("seed", 0))
        for t, width in zip(top, (5, 1) + (4 * self.columns,) * 3):
            t.reshape(1, width, 1, 1)

    def reshape(self, bottom, top):
        pass

    def _pick(self, candidates, n):
        return self.rng.choice(candidates, n, replace=False) if len(candidates) > n else candidates

    def forward(self, bottom, top):
        s = SETTINGS[str(self.phase)]
        gt = bottom[1].data.astype(np.float64)
        rois = np.vstack([bottom[0].data.reshape(-1, 5)[:, 1:], gt[:, :4]])
        iou = overlaps(rois, gt[:, :4]) if len(gt) else np.zeros((len(rois), 1))
        best, which = iou.max(axis=1), iou.argmax(axis=1)
        fg = self._pick(np.flatnonzero(best >= s["fg_thresh"]), int(round(s["fg_fraction"] * s["rois"])))
        bg = self._pick(np.flatnonzero((best < s["bg_hi"]) & (best >= s["bg_lo"])), s["rois"] - len(fg))
        keep = np.concatenate([fg, bg]).astype(np.int64)
        labels = np.zeros(len(keep))
        targets = np.zeros((len(keep), 4 * self.columns))
        weights = np.zeros_like(targets)
        if len(fg):
            labels[:len(fg)] = gt[which[fg], 4]
            deltas = encode(rois[fg], gt[which[fg], :4]) / TARGET_STDS
            for r, (c, d) in enumerate(zip(labels[:len(fg)].astype(int), deltas)):
                c = 1 if self.columns == 2 else c
                targets[r, 4 * c:4 * c + 4] = d
                weights[r, 4 * c:4 * c + 4] = 1
        out = [np.hstack([np.zeros((len(keep), 1)), rois[keep]]), labels[:, None], targets, weights, weights]
        for blob, value in zip(top, out):
            blob.reshape(value.shape[0], value.shape[1], 1, 1)
            blob.data[...] = value.reshape(blob.data.shape)

    def backward(self, top, propagate_down, bottom):
        pass
