"""SSD's detection layers, as Intel Caffe carries them (its models/intel_optimized_models/ssd
and benchmark/ssd): Permute, Normalize, PriorBox and DetectionOutput, the layers an SSD deploy
net runs after its convolutions. Training SSD needs AnnotatedData and MultiBoxLoss, which
caffepy does not have.

The boxes are SSD's normalized ones: (xmin, ymin, xmax, ymax) as fractions of the image, areas
without the +1 of pixel boxes. The arithmetic is NumPy: these layers run once per batch over a
few thousand boxes.
"""
import numpy as np

from .. import log
from ..layer import Layer, register
from ..proto import caffe_pb2
from .common import constant_filler, param_wanted

CodeType = caffe_pb2.PriorBoxParameter


@register
class Permute(Layer):
    """Reorder the axes: top axis i is bottom axis order[i]; the axes `order` leaves out follow
    in their own order. permute_param { order }."""
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        order = list(self.param.permute_param.order)
        axes = bottom[0].num_axes
        for i, a in enumerate(order):
            if a >= axes:
                raise self.error("permute_param.order", f"axis {a} is past the bottom's {axes} axes",
                                 order)
            if a in order[:i]:
                raise self.error("permute_param.order", f"names axis {a} twice", order)
        self.order = tuple(order + [a for a in range(axes) if a not in order])

    def reshape(self, bottom, top):
        if bottom[0].num_axes != len(self.order):
            raise self.error("bottom", f"needs the {len(self.order)} axes it was set up with",
                             bottom[0].shape)
        top[0].reshape(tuple(bottom[0].shape[a] for a in self.order))

    def forward(self, bottom, top):
        np.copyto(top[0].data, bottom[0].data.transpose(self.order))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.copyto(bottom[0].diff, top[0].diff.transpose(np.argsort(self.order)))


@register
class Normalize(Layer):
    """SSD's L2 normalization with a learned scale: y = s * x / n, with n = sqrt(eps + sum x^2)
    over each item (across_spatial) or over the channels of each pixel, and s one value
    (channel_shared) or one per channel. norm_param { across_spatial, scale_filler (default
    constant 1), channel_shared, eps }. blobs[0]: the scale, shape [] or [channels].

    The data gradient is the exact one, dx = g / n - x * sum(x g) / n^3 with g = s * dy. (Intel
    Caffe's backward scales by s after the sum, which is the same only when s is one value.)"""
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        if top[0] is bottom[0]:             # the backward reads x
            raise self.error("top", "cannot be computed in place", f"'{self.param.top[0]}'",
                             "Give the top its own name")
        p = self.param.norm_param
        if bottom[0].num_axes < 2:
            raise self.error("bottom", "needs at least 2 axes (channels on axis 1)", bottom[0].shape)
        self.across_spatial, self.shared, self.eps = p.across_spatial, p.channel_shared, p.eps
        filler = p.scale_filler if p.HasField("scale_filler") else constant_filler(1.0)
        self.init_param_blobs([((), filler) if self.shared else ((bottom[0].shape[1],), filler)])

    def reshape(self, bottom, top):
        if not self.shared and bottom[0].shape[1] != self.blobs[0].count:
            raise self.error("bottom", f"channels must match the {self.blobs[0].count} scales",
                             bottom[0].shape[1])
        top[0].reshape(bottom[0].shape)

    def _items(self, a):
        """[N, C, pixels]."""
        return a.reshape(a.shape[0], a.shape[1], -1)

    def _scale(self, channels):
        s = self.blobs[0].data.reshape(-1)
        return np.full((channels, 1), s[0], np.float32) if self.shared else s.reshape(-1, 1)

    def _sums(self, a, b):
        """sum of a * b over each item ([N, 1, 1]) or over the channels of each pixel ([N, 1, P]),
        summed in float64."""
        if self.across_spatial:
            return np.einsum("ncp,ncp->n", a, b, dtype=np.float64).reshape(-1, 1, 1)
        return np.einsum("ncp,ncp->np", a, b, dtype=np.float64)[:, None, :]

    def forward(self, bottom, top):
        x = self._items(bottom[0].data)
        self._n = np.sqrt(self._sums(x, x) + self.eps).astype(np.float32)
        np.multiply(x / self._n, self._scale(x.shape[1]), out=self._items(top[0].data))

    def backward(self, top, propagate_down, bottom):
        x, dy, n = self._items(bottom[0].data), self._items(top[0].diff), self._n
        if param_wanted(self, 0):
            ds = np.einsum("ncp,ncp->c", dy, x / n, dtype=np.float64)
            self.blobs[0].diff.reshape(-1)[...] += ds.sum() if self.shared else ds
        if propagate_down[0]:
            g = dy * self._scale(x.shape[1])
            along = (self._sums(x, g) / n.astype(np.float64) ** 3).astype(np.float32)
            np.subtract(g / n, x * along, out=self._items(bottom[0].diff))


@register
class PriorBox(Layer):
    """SSD's default boxes for one feature map: bottom[0] the map (its height and width), bottom[1]
    the image (its size, unless img_size / img_h, img_w say it). Top [1, 2, H * W * priors * 4]:
    channel 0 the boxes (xmin, ymin, xmax, ymax over the image's width and height), channel 1
    their variances. At each pixel, for each min_size: the min_size square, then the square of
    side sqrt(min_size * max_size) when max sizes are given, then one box per aspect ratio other
    than 1 (each ratio r also as 1/r with flip). prior_box_param { min_size, max_size,
    aspect_ratio, flip, clip, variance (1 or 4 values; default 0.1), img_size | img_h, img_w,
    step | step_h, step_w (default: image size / map size), offset }."""
    exact_bottoms = 2
    exact_tops = 1
    differentiable = False

    def setup(self, bottom, top):
        p = self.param.prior_box_param
        field = "prior_box_param"
        if not p.min_size:
            raise self.error(f"{field}.min_size", "needs at least one value", "none")
        if min(p.min_size) <= 0:
            raise self.error(f"{field}.min_size", "must be positive", list(p.min_size))
        if p.max_size and len(p.max_size) != len(p.min_size):
            raise self.error(f"{field}.max_size", f"needs one value per min_size ({len(p.min_size)})",
                             list(p.max_size))
        if any(mx <= mn for mn, mx in zip(p.min_size, p.max_size)):
            raise self.error(f"{field}.max_size", "must be greater than min_size", list(p.max_size))
        if len(p.variance) not in (0, 1, 4) or any(v <= 0 for v in p.variance):
            raise self.error(f"{field}.variance", "takes one or four positive values", list(p.variance))
        if p.HasField("img_size") and (p.HasField("img_h") or p.HasField("img_w")):
            raise self.error(f"{field}.img_size", "give either img_size or img_h and img_w", p.img_size)
        if p.HasField("step") and (p.HasField("step_h") or p.HasField("step_w")):
            raise self.error(f"{field}.step", "give either step or step_h and step_w", p.step)
        ratios = [1.0]
        for r in p.aspect_ratio:
            if all(abs(r - known) >= 1e-6 for known in ratios):
                ratios += [r, 1.0 / r] if p.flip else [r]
        # SSD reads the sizes as ints
        self.min_sizes, self.max_sizes = [int(s) for s in p.min_size], [int(s) for s in p.max_size]
        self.ratios = [np.float32(r) for r in ratios]
        self.priors = len(ratios) * len(self.min_sizes) + len(self.max_sizes)
        self.variance = list(p.variance) or [0.1]
        img = p.img_size if p.HasField("img_size") else 0
        self.img_h = p.img_h if p.HasField("img_h") else img
        self.img_w = p.img_w if p.HasField("img_w") else img
        step = p.step if p.HasField("step") else 0.0
        self.step_h = p.step_h if p.HasField("step_h") else step
        self.step_w = p.step_w if p.HasField("step_w") else step
        for name in ("img_h", "img_w", "step_h", "step_w"):
            if p.HasField(name) and getattr(p, name) <= 0:
                raise self.error(f"{field}.{name}", "must be positive", getattr(p, name))
        self.offset, self.clip = np.float32(p.offset), p.clip

    def reshape(self, bottom, top):
        h, w = bottom[0].shape[-2:]
        top[0].reshape((1, 2, h * w * self.priors * 4))

    def _sides(self):
        """(width, height) float32 of each prior at a pixel, in SSD's order."""
        sides = []
        for i, size in enumerate(self.min_sizes):
            sides.append((np.float32(size), np.float32(size)))
            if self.max_sizes:
                side = np.float32(np.sqrt(np.float64(size * self.max_sizes[i])))
                sides.append((side, side))
            for r in self.ratios:
                if abs(r - 1.0) >= 1e-6:
                    root = np.sqrt(r)
                    sides.append((np.float32(size * root), np.float32(size / root)))
        return np.array(sides, np.float32)

    def forward(self, bottom, top):
        h, w = bottom[0].shape[-2:]
        img_h, img_w = (self.img_h, self.img_w) if self.img_h and self.img_w else bottom[1].shape[-2:]
        if self.step_h and self.step_w:
            step_h, step_w = np.float32(self.step_h), np.float32(self.step_w)
        else:
            step_h, step_w = np.float32(img_h / h), np.float32(img_w / w)
        cy = ((np.arange(h, dtype=np.float32) + self.offset) * step_h).astype(np.float64)
        cx = ((np.arange(w, dtype=np.float32) + self.offset) * step_w).astype(np.float64)
        sides = self._sides().astype(np.float64)
        half_w, half_h = sides[:, 0] / 2, sides[:, 1] / 2
        boxes = np.empty((h, w, len(sides), 4))
        boxes[..., 0] = (cx[None, :, None] - half_w) / img_w
        boxes[..., 1] = (cy[:, None, None] - half_h) / img_h
        boxes[..., 2] = (cx[None, :, None] + half_w) / img_w
        boxes[..., 3] = (cy[:, None, None] + half_h) / img_h
        boxes = boxes.astype(np.float32).reshape(-1)
        if self.clip:
            np.clip(boxes, 0, 1, out=boxes)
        out = top[0].data.reshape(2, -1)
        out[0] = boxes
        out[1] = np.tile(np.asarray(self.variance, np.float32), boxes.size // len(self.variance))

    def backward(self, top, propagate_down, bottom):
        pass


def _area(b):
    """Areas of normalized boxes [..., 4] (0 for an inverted one)."""
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    return np.where((w < 0) | (h < 0), 0, w * h)


def _overlap(box, others):
    """Jaccard overlap of one normalized box with each of `others` [K, 4], float32 as SSD."""
    iw = np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0])
    ih = np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1])
    inter = np.where((iw > 0) & (ih > 0), iw * ih, 0).astype(np.float32)
    union = (_area(box) + _area(others) - inter).astype(np.float32)
    return np.where(inter > 0, inter / np.where(union > 0, union, 1), 0)


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
        if not kept or (_overlap(boxes[i], boxes[kept]) <= limit).all():
            kept.append(int(i))
            if eta < 1 and limit > 0.5:
                limit *= eta
    return kept


def decode(priors, variances, loc, code_type, encoded_in_target):
    """Boxes [P, 4] from the location predictions `loc` [P, 4] against the priors (SSD's
    DecodeBBox for CORNER, CENTER_SIZE and CORNER_SIZE)."""
    v = np.ones_like(variances) if encoded_in_target else variances
    pw, ph = priors[:, 2] - priors[:, 0], priors[:, 3] - priors[:, 1]
    if code_type == CodeType.CORNER:
        return priors + v * loc
    if code_type == CodeType.CORNER_SIZE:
        return priors + v * loc * np.stack([pw, ph, pw, ph], axis=1)
    cx = v[:, 0] * loc[:, 0] * pw + (priors[:, 0] + priors[:, 2]) / 2
    cy = v[:, 1] * loc[:, 1] * ph + (priors[:, 1] + priors[:, 3]) / 2
    w, h = np.exp(v[:, 2] * loc[:, 2]) * pw, np.exp(v[:, 3] * loc[:, 3]) * ph
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)


@register
class DetectionOutput(Layer):
    """SSD's detections: bottoms loc [N, priors * classes_of_location * 4], conf [N, priors *
    num_classes] (scores, after a Softmax), priors [1, 2, priors * 4] (PriorBox's, concatenated).
    Per image and class (the background label skipped): decode the boxes, keep those scoring
    above confidence_threshold, run NMS, then keep the keep_top_k best over the classes. Top
    [1, 1, detections, 7]: image, label, score, xmin, ymin, xmax, ymax, by image, then label,
    then score; with no detection at all, one row of -1 per image (its image index first).
    detection_output_param { num_classes, share_location, background_label_id, nms_param
    { nms_threshold, top_k, eta }, code_type, variance_encoded_in_target, keep_top_k,
    confidence_threshold }. save_output_param (the detections written to files) is ignored,
    with a warning. A fourth bottom (Intel Caffe: the images, for `visualize`, which draws the
    detections in a window) is read by nothing; `visualize` is ignored with a warning."""
    min_bottoms = 3
    max_bottoms = 4
    exact_tops = 1
    differentiable = False

    def setup(self, bottom, top):
        p = self.param.detection_output_param
        field = "detection_output_param"
        if not p.HasField("num_classes"):
            raise self.error(f"{field}.num_classes", "must be given", "none")
        if p.save_output_param.output_directory:
            log.warning(f"layer '{self.name}' (DetectionOutput): {field}.save_output_param: caffepy "
                        f"does not write detections to files; they are in the layer's top")
        if p.visualize:
            log.warning(f"layer '{self.name}' (DetectionOutput): {field}.visualize: caffepy does not "
                        f"draw detections; they are in the layer's top")
        nms = p.nms_param
        if nms.nms_threshold < 0:
            raise self.error(f"{field}.nms_param.nms_threshold", "must not be negative", nms.nms_threshold)
        if not 0 < nms.eta <= 1:
            raise self.error(f"{field}.nms_param.eta", "must lie in (0, 1]", nms.eta)
        self.classes, self.share = p.num_classes, p.share_location
        self.loc_classes = 1 if self.share else self.classes
        self.background, self.code_type = p.background_label_id, p.code_type
        self.in_target, self.keep_top_k = p.variance_encoded_in_target, p.keep_top_k
        self.threshold = p.confidence_threshold if p.HasField("confidence_threshold") else -np.inf
        self.nms_threshold, self.eta = nms.nms_threshold, nms.eta
        self.top_k = nms.top_k if nms.HasField("top_k") else -1

    def reshape(self, bottom, top):
        priors = bottom[2].shape[-1] // 4 if bottom[2].num_axes else 0
        self.priors = priors
        for i, per, what in ((0, self.loc_classes * 4, "loc"), (1, self.classes, "conf")):
            if bottom[i].count != bottom[i].shape[0] * priors * per:
                raise self.error(f"bottom[{i}]", f"{what} needs {priors * per} values per image "
                                 f"({priors} priors)", bottom[i].shape)
        top[0].reshape((1, 1, 1, 7))

    def forward(self, bottom, top):
        n, p = bottom[0].shape[0], self.priors
        loc = bottom[0].data.reshape(n, p, self.loc_classes, 4).astype(np.float32)
        conf = bottom[1].data.reshape(n, p, self.classes)
        prior = bottom[2].data.reshape(-1)
        boxes, variances = prior[:p * 4].reshape(p, 4), prior[p * 4:2 * p * 4].reshape(p, 4)
        rows = []
        for i in range(n):
            # the boxes of each location class, decoded once (one for all with share_location)
            decoded = [decode(boxes, variances, loc[i, :, lc], self.code_type, self.in_target)
                       .astype(np.float32) for lc in range(self.loc_classes)]
            found = []                # (score, label, index, box)
            for c in range(self.classes):
                if c == self.background:
                    continue
                lc = 0 if self.share else c
                scores = conf[i, :, c]
                for k in nms(decoded[lc], scores, self.threshold, self.nms_threshold, self.eta,
                             self.top_k):
                    found.append((scores[k], c, k, decoded[lc][k]))
            if self.keep_top_k > -1 and len(found) > self.keep_top_k:
                best = sorted(range(len(found)), key=lambda j: -found[j][0])[:self.keep_top_k]
                found = [found[j] for j in best]
            found.sort(key=lambda f: f[1])      # by label; within a label, in the order kept
            rows += [[i, c, s, *box] for s, c, _, box in found]
        if not rows:
            rows = [[i] + [-1] * 6 for i in range(n)]
        top[0].reshape((1, 1, len(rows), 7))
        top[0].data[...] = np.asarray(rows, np.float32).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        pass
