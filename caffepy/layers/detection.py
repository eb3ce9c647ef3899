"""SSD's detection layers, as Intel Caffe carries them (its models/intel_optimized_models/ssd
and benchmark/ssd): Permute, Normalize, PriorBox and DetectionOutput, the layers an SSD deploy
net runs after its convolutions; MultiBoxLoss, which trains them; DetectionEvaluate, which
scores DetectionOutput's boxes against the ground truth. (SSD's data layer, AnnotatedData, is
with the other data layers in data.py; the box arithmetic they share is caffepy/bbox.py.)

The boxes are SSD's normalized ones: (xmin, ymin, xmax, ymax) as fractions of the image, areas
without the +1 of pixel boxes. The arithmetic is NumPy: these layers run once per batch over a
few thousand boxes.
"""
import numpy as np

from .. import bbox, log
from ..bbox import decode, nms
from ..errors import ShapeError
from ..layer import Layer, register
from ..proto import caffe_pb2
from .common import constant_filler, param_wanted
from .loss import normalization_mode, normalizer

LossParameter = caffe_pb2.LossParameter

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


MBL = caffe_pb2.MultiBoxLossParameter
FLT_MIN_LOG = float(-np.log(np.finfo(np.float32).tiny))      # -log(FLT_MIN): Caffe's clamp of -log(prob)


def _softmax_rows(x):
    """(log-probabilities, probabilities) of rows x [R, C], in float64."""
    x = x.astype(np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return shifted - log_sum, np.exp(shifted - log_sum)


def _logistic_rows(x, t):
    """Summed sigmoid cross-entropy of rows x [R, C] against targets t, per row, in float64."""
    x = x.astype(np.float64)
    return (np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))).sum(axis=1)


@register
class MultiBoxLoss(Layer):
    """SSD's training loss. Bottoms: loc predictions [N, priors * loc_classes * 4], conf
    predictions [N, priors * num_classes] (scores before any softmax), priors [1, 2, priors * 4]
    (PriorBox's, concatenated), ground truth [1, 1, boxes, 8] (AnnotatedData's label top:
    item_id, label, instance, xmin, ymin, xmax, ymax, difficult). Top: the loss.

    Per image: the priors (with use_prior_for_matching; else the decoded predictions) are
    matched to the ground truth, bipartite then per prediction by overlap_threshold
    (caffepy.bbox.match). The matched priors are positives. Mining picks the negatives:
    MAX_NEGATIVE takes, among the unmatched priors overlapping every object by less than
    neg_overlap, the neg_pos_ratio * positives with the largest confidence loss (of the
    background); HARD_EXAMPLE takes the sample_size priors of largest confidence + location
    loss, and positives it leaves out stop being positives; with nms_param the candidates
    first go through NMS on their loss. NONE: every prior counts, unmatched ones as background.
        loss = (loc_weight * sum_positives loc_loss(pred - encode(gt, prior))
                + sum_selected conf_loss(scores, label)) / normalizer
    loc_loss: SMOOTH_L1 (0.5 d^2 below |d| = 1, |d| - 0.5 above) or L2 (0.5 d^2), over the 4
    coordinates; conf_loss: SOFTMAX (cross-entropy; -log p clamped at -log FLT_MIN) or
    LOGISTIC (summed sigmoid cross-entropy against one-hot targets). normalizer (loss_param):
    VALID the positives, FULL N * priors, BATCH_SIZE N, NONE 1, at least 1. code_type and
    encode_variance_in_target as PriorBox / DetectionOutput decode them; bp_inside holds the
    gradient of coordinates whose prior (or decoded box) lies outside the image at 0;
    map_object_to_agnostic trains one object class. The loss of loc (conf) is left out when the
    layer's propagate_down says false for bottom 0 (1).

    multibox_loss_param: num_classes, share_location, background_label_id, loc_loss_type,
    conf_loss_type, loc_weight, match_type, overlap_threshold, use_prior_for_matching,
    use_difficult_gt, mining_type (do_neg_mining, deprecated, must agree), neg_pos_ratio,
    neg_overlap, code_type, encode_variance_in_target, map_object_to_agnostic,
    ignore_cross_boundary_bbox, bp_inside, nms_param, sample_size, use_prior_for_nms.

    Under a multi-rank TRAIN run the normalizer is the whole global batch's, divided by the
    number of ranks (whose gradients are averaged), so N ranks give what one rank with their
    batches together gives. Where the fork departs from its own formulas caffepy does not:
    with encode_variance_in_target the gradient carries the variance's 1/v (the fork leaves it
    out), an unset nms_param.top_k means no limit in mining (the fork's 0 keeps nothing), the
    LOGISTIC targets are 0 but for the label (the fork starts them at background_label_id),
    and ties in mining keep the lower prior first (the fork's unstable sort leaves them open).
    """
    is_loss = True
    exact_bottoms = 4
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index < 2

    def setup(self, bottom, top):
        p = self.param.multibox_loss_param
        f = "multibox_loss_param"
        if not p.HasField("num_classes"):
            raise self.error(f"{f}.num_classes", "must be given", "none")
        if p.num_classes < 1:
            raise self.error(f"{f}.num_classes", "must be at least 1", p.num_classes)
        self.p, self.classes, self.share = p, p.num_classes, p.share_location
        self.loc_classes = 1 if self.share else self.classes
        self.background = p.background_label_id
        self.mining = p.mining_type
        if p.HasField("do_neg_mining"):
            log.warning(f"layer '{self.name}' (MultiBoxLoss): {f}.do_neg_mining is deprecated; use mining_type")
            if p.do_neg_mining != (self.mining != MBL.NONE):
                raise self.error(f"{f}.do_neg_mining", f"disagrees with mining_type {MBL.MiningType.Name(self.mining)}",
                                 str(p.do_neg_mining).lower())
        if self.mining != MBL.NONE and not self.share:
            raise self.error(f"{f}.mining_type", "mining needs share_location: true",
                             MBL.MiningType.Name(self.mining))
        if self.mining == MBL.HARD_EXAMPLE and p.sample_size < 1:
            raise self.error(f"{f}.sample_size", "must be positive for HARD_EXAMPLE mining", p.sample_size)
        if p.conf_loss_type == MBL.SOFTMAX and not 0 <= self.background < self.classes:
            raise self.error(f"{f}.background_label_id", f"must be a class in [0, {self.classes}) for SOFTMAX",
                             self.background)
        if p.map_object_to_agnostic and self.classes != (2 if self.background >= 0 else 1):
            raise self.error(f"{f}.num_classes", "must be 2 (1 without a background) with "
                             "map_object_to_agnostic", self.classes)
        if p.overlap_threshold < 0 or p.neg_overlap < 0:
            raise self.error(f"{f}.overlap_threshold", "thresholds must not be negative",
                             f"{p.overlap_threshold:g}, neg_overlap {p.neg_overlap:g}")
        down = list(self.param.propagate_down)
        self.use_loc, self.use_conf = (bool(down[0]), bool(down[1])) if down else (True, True)
        self.mode = normalization_mode(self)
        nms = p.nms_param
        self.mining_nms = p.HasField("nms_param") and nms.nms_threshold > 0
        self.mining_top_k = nms.top_k if nms.HasField("top_k") else -1

    def reshape(self, bottom, top):
        n = bottom[0].shape[0] if bottom[0].num_axes else 0
        priors = bottom[2].count // 8
        if bottom[2].count != 8 * priors or not priors:
            raise self.error("bottom[2]", "the priors must be [1, 2, priors * 4] (boxes, then variances)",
                             bottom[2].shape, cls=ShapeError)
        for i, per, what in ((0, self.loc_classes * 4, "loc"), (1, self.classes, "conf")):
            if not bottom[i].num_axes or bottom[i].shape[0] != n or bottom[i].count != n * priors * per:
                raise self.error(f"bottom[{i}]", f"{what} needs {priors * per} values per image ({priors} "
                                 f"priors) for {n} images", bottom[i].shape, cls=ShapeError)
        if bottom[3].count % 8:
            raise self.error("bottom[3]", "the ground truth rows must have 8 values", bottom[3].shape,
                             cls=ShapeError)
        self.n, self.priors = n, priors
        top[0].reshape(())

    # -- the pieces -----------------------------------------------------------------------------
    def _ground_truth(self, blob):
        """Per image: (labels [G] int, boxes [G, 4] float32) of its ground truth, difficult ones
        left out unless use_difficult_gt; None for an image without any."""
        rows = blob.data.reshape(-1, 8)
        rows = rows[rows[:, 0] != -1]
        if not self.p.use_difficult_gt:
            rows = rows[rows[:, 7] == 0]
        items = rows[:, 0].astype(np.int64)
        labels = rows[:, 1].astype(np.int64)
        if len(items) and (items.min() < 0 or items.max() >= self.n):
            raise self.error("bottom[3]", f"item_id out of the batch's range [0, {self.n})",
                             int(items[(items < 0) | (items >= self.n)][0]))
        if (labels == self.background).any():
            raise self.error("bottom[3]", "a ground truth box has the background label", self.background,
                             hint="The dataset's labels must leave background_label_id to the background")
        gts = [None] * self.n
        for i in np.unique(items):
            mine = items == i
            gts[i] = (labels[mine], rows[mine, 3:7].astype(np.float32))
        return gts

    def _match(self, gt, loc_i, priors, variances):
        """{loc label: (indices [P], overlaps [P])} of one image, the fork's FindMatches
        (label -1: shared locations)."""
        p = self.p
        if gt is None:
            return {}
        labels, boxes = gt
        if p.use_prior_for_matching:
            idx, ov = bbox.match(boxes, priors, p.match_type, p.overlap_threshold, p.ignore_cross_boundary_bbox)
            if self.share:
                return {-1: (idx, ov)}
            out = {}
            for c in range(self.loc_classes):
                if c != self.background:
                    mine = (idx > -1) & (labels[np.maximum(idx, 0)] == c)
                    out[c] = (np.where(mine, idx, -1), ov)
            return out
        out = {}
        for c in range(self.loc_classes):
            label = -1 if self.share else c
            if label == self.background and not self.share:
                continue
            decoded = decode(priors, variances, loc_i[:, c], p.code_type, p.encode_variance_in_target)
            which = np.arange(len(labels)) if label == -1 else np.flatnonzero(labels == label)
            idx, ov = bbox.match(boxes[which], decoded, p.match_type, p.overlap_threshold,
                                 p.ignore_cross_boundary_bbox)
            out[label] = (np.where(idx > -1, which[np.maximum(idx, 0)], idx), ov)
        return out

    def _targets(self, gt, idx):
        """The class each prior of one image is trained toward: its object's (or the agnostic
        object class), else the background."""
        if self.p.map_object_to_agnostic:
            return np.where(idx > -1, self.background + 1, self.background)
        return np.where(idx > -1, gt[0][np.maximum(idx, 0)], self.background) if gt is not None \
            else np.full(len(idx), self.background)

    def _conf_losses(self, scores, targets):
        """Confidence loss of rows [R, C] toward their targets [R] (float64)."""
        if self.p.conf_loss_type == MBL.SOFTMAX:
            logp, _ = _softmax_rows(scores)
            return np.minimum(-logp[np.arange(len(targets)), targets], FLT_MIN_LOG)
        return _logistic_rows(scores, self._onehot(targets, scores.shape[1]))

    def _onehot(self, targets, classes):
        t = np.zeros((len(targets), classes))
        ok = (targets >= 0) & (targets < classes)
        t[np.flatnonzero(ok), targets[ok]] = 1
        return t

    def _loc_pairs(self, label, idx, gt, loc_i, priors, variances):
        """(positions j, predictions [M, 4], targets [M, 4], frozen [M, 4], divide [M, 4]) of one
        image's positives of loc label `label`: what the location loss compares."""
        p = self.p
        j = np.flatnonzero(idx > -1)
        slot = 0 if self.share else label
        pred = loc_i[j, slot].astype(np.float32)
        target = bbox.encode(priors[j], variances[j], gt[1][idx[j]], p.code_type, p.encode_variance_in_target)
        frozen = np.zeros(pred.shape, bool)
        if p.bp_inside:
            match_box = priors[j] if p.use_prior_for_matching else \
                decode(priors[j], variances[j], pred, p.code_type, p.encode_variance_in_target)
            frozen = (match_box < 0) | (match_box > 1)
        divide = variances[j] if p.encode_variance_in_target else np.ones_like(pred)
        return j, pred, target, frozen, divide

    def _loc_loss(self, d):
        """Per element location loss and its derivative, d = prediction - target."""
        if self.p.loc_loss_type == MBL.SMOOTH_L1:
            small = np.abs(d) < 1
            return np.where(small, 0.5 * d * d, np.abs(d) - 0.5), np.where(small, d, np.sign(d))
        return 0.5 * d * d, d

    def _mine(self, matches, gt, conf_i, loc_i, priors, variances):
        """The fork's MineHardExamples for one image: updates `matches` (HARD_EXAMPLE drops the
        positives it does not pick) and returns the negatives' prior indices, ascending."""
        p = self.p
        if self.mining == MBL.NONE or not matches:
            return np.zeros(0, np.int64)
        negatives = []
        for label in sorted(matches):
            idx, ov = matches[label]
            loss = self._conf_losses(conf_i, self._targets(gt, idx))
            if self.mining == MBL.HARD_EXAMPLE:
                j, pred, target, frozen, divide = self._loc_pairs(label, idx, gt, loc_i, priors, variances)
                d = np.where(frozen, 0, (pred - target) / divide)
                loss = loss.copy()
                loss[j] += self._loc_loss(d.astype(np.float64))[0].sum(axis=1)
                eligible = np.arange(len(idx))
                num_sel = min(p.sample_size, len(eligible))
            else:
                eligible = np.flatnonzero((idx == -1) & (ov < np.float32(p.neg_overlap)))
                num_pos = int((idx > -1).sum())
                num_sel = min(int(np.float32(num_pos) * np.float32(p.neg_pos_ratio)), len(eligible))
            if self.mining_nms:
                boxes = priors[eligible] if p.use_prior_for_nms else decode(
                    priors, variances, loc_i[:, 0], p.code_type, p.encode_variance_in_target)[eligible]
                kept = bbox.nms_by_loss(boxes, loss[eligible], p.nms_param.nms_threshold, self.mining_top_k)
                chosen = eligible[np.asarray(kept[:num_sel], np.int64)]
            else:
                chosen = eligible[np.argsort(-loss[eligible], kind="stable")[:num_sel]]
            selected = np.zeros(len(idx), bool)
            selected[chosen] = True
            if self.mining == MBL.HARD_EXAMPLE:      # positives left out stop being positives
                matches[label] = (np.where((idx > -1) & ~selected, -1, idx), ov)
            negatives.append(np.flatnonzero(selected & (idx == -1)))
        return np.concatenate(negatives) if negatives else np.zeros(0, np.int64)

    # -- forward / backward ---------------------------------------------------------------------
    def forward(self, bottom, top):
        n, P, C, L = self.n, self.priors, self.classes, self.loc_classes
        loc = bottom[0].data.reshape(n, P, L, 4)
        conf = bottom[1].data.reshape(n, P, C)
        prior = bottom[2].data.reshape(-1)
        priors, variances = prior[:P * 4].reshape(P, 4), prior[P * 4:].reshape(P, 4)
        gts = self._ground_truth(bottom[3])
        self.matches, self.negatives = [], []
        for i in range(n):
            matches = self._match(gts[i], loc[i], priors, variances)
            self.negatives.append(self._mine(matches, gts[i], conf[i], loc[i], priors, variances))
            self.matches.append(matches)
        num_matches = sum(int((idx > -1).sum()) for m in self.matches for idx, _ in m.values())
        self.norm = self._normalizer(n, P, num_matches)
        # location: every positive of every loc label
        self.loc_terms = []
        loc_loss = 0.0
        for i in range(n):
            for label in sorted(self.matches[i]):
                idx, _ = self.matches[i][label]
                j, pred, target, frozen, divide = self._loc_pairs(label, idx, gts[i], loc[i], priors, variances)
                d = np.where(frozen, 0, (pred.astype(np.float64) - target) / divide)
                value, slope = self._loc_loss(d)
                loc_loss += value.sum()
                self.loc_terms.append((i, 0 if self.share else label, j, np.where(frozen, 0, slope / divide)))
        # confidence: positives then negatives (mining), or every prior
        if self.mining != MBL.NONE:
            rows, targets = [], []
            for i in range(n):
                if gts[i] is None:
                    continue
                for label in sorted(self.matches[i]):
                    idx, _ = self.matches[i][label]
                    j = np.flatnonzero(idx > -1)
                    rows.append(i * P + j)
                    targets.append(self._targets(gts[i], idx)[j])
                rows.append(i * P + self.negatives[i])
                targets.append(np.full(len(self.negatives[i]), self.background))
            self.conf_rows = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
            self.conf_targets = np.concatenate(targets).astype(np.int64) if targets else np.zeros(0, np.int64)
        else:
            self.conf_rows = np.arange(n * P)
            t = np.full((n, P), self.background, np.int64)
            for i in range(n):
                for label in sorted(self.matches[i]):
                    idx, _ = self.matches[i][label]
                    t[i, idx > -1] = self._targets(gts[i], idx)[idx > -1]
            self.conf_targets = t.reshape(-1)
        scores = conf.reshape(n * P, C)[self.conf_rows]
        conf_loss = self._conf_losses(scores, self.conf_targets).sum() if len(self.conf_rows) else 0.0
        total = (self.p.loc_weight * loc_loss if self.use_loc else 0.0) + (conf_loss if self.use_conf else 0.0)
        top[0].data[...] = np.float32(total / self.norm)

    def _normalizer(self, n, priors, num_matches):
        count = {LossParameter.VALID: num_matches, LossParameter.FULL: n * priors,
                 LossParameter.BATCH_SIZE: n}.get(self.mode)
        ctx = self.context
        if not (ctx.distributed and self.phase == caffe_pb2.TRAIN):
            return normalizer(self, self.mode, n, priors, num_matches)
        # the global batch's normalizer, shared out: the ranks' gradients are averaged
        if count is None:
            return normalizer(self, self.mode, n, priors, num_matches) / ctx.size
        return max(1.0, float(ctx.total(count))) / ctx.size

    def backward(self, top, propagate_down, bottom):
        scale = float(top[0].diff.reshape(-1)[0]) / self.norm
        n, P, C = self.n, self.priors, self.classes
        if propagate_down[0]:
            diff = bottom[0].diff.reshape(n, P, self.loc_classes, 4)
            diff[...] = 0
            for i, slot, j, slope in self.loc_terms:
                diff[i, j, slot] = slope * (self.p.loc_weight * scale)
        if propagate_down[1]:
            diff = bottom[1].diff.reshape(n * P, C)
            diff[...] = 0
            if len(self.conf_rows):
                scores = bottom[1].data.reshape(n * P, C)[self.conf_rows]
                if self.p.conf_loss_type == MBL.SOFTMAX:
                    _, prob = _softmax_rows(scores)
                    prob[np.arange(len(self.conf_targets)), self.conf_targets] -= 1
                    grad = prob
                else:
                    grad = 1 / (1 + np.exp(-scores.astype(np.float64))) - self._onehot(self.conf_targets, C)
                diff[self.conf_rows] = grad * scale
        for i in (2, 3):
            if propagate_down[i]:
                raise self.error(f"propagate_down[{i}]", "MultiBoxLoss has no gradient for the priors or the "
                                 "ground truth", "true")


@register
class DetectionEvaluate(Layer):
    """SSD's test-time scorer: bottoms detections [1, 1, D, 7] (DetectionOutput's: image,
    label, score, xmin, ymin, xmax, ymax) and ground truth [1, 1, G, 8] (AnnotatedData's label).
    Top [1, 1, classes + detections, 5]: first, per label but the background, a row (-1, label,
    number of objects, -1, -1); then per image, per label, the detections by score (highest
    first), each (image, label, score, tp, fp): a true positive when its best overlap with an
    object of its label reaches overlap_threshold and that object was not found before, else a
    false positive; a detection of a difficult object when evaluate_difficult_gt is false is
    neither (0, 0) and such objects are not counted. caffepy test -detection and a solver's
    eval_type: "detection" turn the rows into mAP (caffepy.bbox.MeanAP).

    detection_evaluate_param: num_classes, background_label_id, overlap_threshold,
    evaluate_difficult_gt, name_size_file (`name height width` lines, one per test image in
    order: overlaps are then taken over pixel boxes of each image's size, counting both end
    pixels, after resize_param maps the boxes back), resize_param. Without name_size_file the
    overlaps are of the normalized boxes. (The fork moves to the next image's size once per
    image that has detections; caffepy once per image of the batch, counted from the largest
    image index of its detections and objects.)"""
    exact_bottoms = 2
    exact_tops = 1
    differentiable = False

    def setup(self, bottom, top):
        p = self.param.detection_evaluate_param
        f = "detection_evaluate_param"
        if not p.HasField("num_classes"):
            raise self.error(f"{f}.num_classes", "must be given", "none")
        if p.overlap_threshold <= 0:
            raise self.error(f"{f}.overlap_threshold", "must be positive", p.overlap_threshold)
        self.classes, self.background = p.num_classes, p.background_label_id
        self.threshold, self.difficult = np.float32(p.overlap_threshold), p.evaluate_difficult_gt
        self.sizes = []
        if p.name_size_file:
            try:
                with open(p.name_size_file) as fh:
                    words = fh.read().split()
            except OSError as e:
                raise self.error(f"{f}.name_size_file", f"cannot read it: {e.strerror}", p.name_size_file) from None
            try:
                self.sizes = [(int(h), int(w)) for h, w in zip(words[1::3], words[2::3])]
            except ValueError:
                raise self.error(f"{f}.name_size_file", "expected 'name height width' lines",
                                 p.name_size_file) from None
        self.resize = p.resize_param if p.HasField("resize_param") else None
        self.count = 0

    def reshape(self, bottom, top):
        for i, width in ((0, 7), (1, 8)):
            if bottom[i].num_axes != 4 or bottom[i].shape[:2] != (1, 1) or bottom[i].shape[3] != width:
                raise self.error(f"bottom[{i}]", f"must be [1, 1, rows, {width}]", bottom[i].shape, cls=ShapeError)
        det = bottom[0].data.reshape(-1, 7)
        positive_classes = self.classes - (0 if self.background == -1 else 1)
        top[0].reshape((1, 1, positive_classes + int((det[:, 1] != -1).sum()), 5))

    def _pixels(self, boxes, size):
        """Normalized boxes as pixel boxes of an image of `size` (the fork's OutputBBox)."""
        h, w = size
        b = np.array(boxes, np.float32)
        r = self.resize
        if r is not None and r.resize_mode == caffe_pb2.ResizeParameter.FIT_LARGE_SIZE_AND_PAD:
            aspect, resized = np.float32(w) / np.float32(h), np.float32(r.width) / np.float32(r.height)
            if aspect > resized:
                pad = (np.float32(r.height) - np.float32(r.width) / aspect) / 2 / np.float32(r.height)
                src = np.array([0, pad, 1, 1 - pad], np.float32)
            else:
                pad = (np.float32(r.width) - np.float32(r.height) * aspect) / 2 / np.float32(r.width)
                src = np.array([pad, 0, 1 - pad, 1], np.float32)
            b, _ = bbox.project(b, src)
        if r is not None and r.resize_mode == caffe_pb2.ResizeParameter.FIT_SMALL_SIZE \
                and r.height_scale and r.width_scale:
            b = b * np.array([r.width_scale, r.height_scale] * 2, np.float32)
            return np.clip(b, 0, np.array([w, h, w, h], np.float32))
        return bbox.clip(b) * np.array([w, h, w, h], np.float32)

    def forward(self, bottom, top):
        det = bottom[0].data.reshape(-1, 7)
        gt = bottom[1].data.reshape(-1, 8)
        end = np.flatnonzero(gt[:, 0] == -1)
        gt = gt[:end[0]] if len(end) else gt          # the fork stops at the first -1 row
        det = det[(det[:, 0] != -1) & (det[:, 1] != -1)]     # DetectionOutput's rows for no detection
        for what, labels in (("detections", det[:, 1]), ("ground truth", gt[:, 1])):
            if (labels.astype(np.int64) == self.background).any():
                raise self.error(f"bottom[{0 if what == 'detections' else 1}]",
                                 f"the {what} hold the background label", self.background)
        rows = []
        for c in range(self.classes):
            if c == self.background:
                continue
            mine = gt[:, 1].astype(np.int64) == c
            n = int(mine.sum()) if self.difficult else int((mine & (gt[:, 7] == 0)).sum())
            rows.append([-1, c, n, -1, -1])
        images = sorted(set(det[:, 0].astype(np.int64).tolist()))
        for image in images:
            mine = det[det[:, 0].astype(np.int64) == image]
            objects = gt[gt[:, 0].astype(np.int64) == image]
            size = self.sizes[(self.count + image) % len(self.sizes)] if self.sizes else None
            for label in sorted(set(mine[:, 1].astype(np.int64).tolist())):
                found = mine[mine[:, 1].astype(np.int64) == label]
                truth = objects[objects[:, 1].astype(np.int64) == label]
                if not len(truth):
                    rows += [[image, label, s, 0, 1] for s in found[:, 2]]
                    continue
                found = found[np.argsort(-found[:, 2], kind="stable")]
                boxes, truth_boxes = found[:, 3:7], truth[:, 3:7]
                if size is not None:
                    boxes, truth_boxes = self._pixels(boxes, size), self._pixels(truth_boxes, size)
                overlaps = bbox.jaccard(boxes, truth_boxes, normalized=size is None)
                visited = np.zeros(len(truth), bool)
                for k, score in enumerate(found[:, 2]):
                    j = int(np.argmax(overlaps[k]))
                    if overlaps[k, j] < self.threshold:
                        rows.append([image, label, score, 0, 1])
                    elif not self.difficult and truth[j, 7]:
                        rows.append([image, label, score, 0, 0])
                    elif visited[j]:
                        rows.append([image, label, score, 0, 1])
                    else:
                        visited[j] = True
                        rows.append([image, label, score, 1, 0])
        if self.sizes:
            seen = max(images + gt[:, 0].astype(np.int64).tolist(), default=-1) + 1
            self.count = (self.count + seen) % len(self.sizes)
        top[0].reshape((1, 1, len(rows), 5))
        top[0].data[...] = np.asarray(rows, np.float32).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        pass
