"""Loss layers: SoftmaxWithLoss, SigmoidCrossEntropyLoss, EuclideanLoss, HingeLoss,
ContrastiveLoss, InfogainLoss, MultinomialLogisticLoss, SmoothL1Loss (Fast R-CNN); R-FCN's
online hard example mining (SoftmaxWithLossOHEM, SmoothL1LossOHEM and BoxAnnotatorOHEM, which
is no loss but picks what the losses train on); and Accuracy (not a loss).

Every loss writes a scalar top (shape (), Caffe's 0-axis blob) that the Net weighs
by `loss_weight` (1 by default for the first top). Backward scales by the top diff,
which the Net sets to that weight. Labels are float blobs read as integers the way
Caffe does (truncation toward zero); a label outside [0, classes) that is not the
ignore_label is an error naming the layer and the value.
"""
import numpy as np

from ..errors import ShapeError
from ..kernels.reference import loss as reference
from ..layer import Layer, canonical_axis, count_from, register
from ..proto import caffe_pb2

try:
    from ..kernels import loss as _kernels
except ImportError:     # not built: the NumPy references are correct, only slower
    _kernels = None

LossParameter = caffe_pb2.LossParameter
LOG_THRESHOLD = 1e-20          # Caffe's kLOG_THRESHOLD


class LossLayer(Layer):
    """Caffe's LossLayer: two bottoms (prediction, label/target), a scalar top,
    no gradient to the label (even under force_backward)."""
    is_loss = True
    exact_bottoms = 2
    exact_tops = 1
    smooths_labels = False          # reads loss_param.label_smoothing (Intel: SoftmaxWithLoss)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1

    def layer_setup(self, bottom, top):
        smoothing = self.param.loss_param.label_smoothing
        if smoothing and not self.smooths_labels:
            raise self.error("loss_param.label_smoothing", "applies to SoftmaxWithLoss only (Intel "
                             "Caffe reads it there alone)", smoothing, hint="Remove it")
        super().layer_setup(bottom, top)

    def reshape(self, bottom, top):
        a, b = bottom[0], bottom[1]
        if not a.num_axes or not b.num_axes or a.shape[0] != b.shape[0]:
            raise self.error("bottom", "the data and label should have the same first dimension",
                             f"{a.shape} and {b.shape}", cls=ShapeError)
        top[0].reshape(())

    def top_diff(self, top):
        return float(top[0].diff.reshape(-1)[0])


# -- shared helpers -------------------------------------------------------
def normalization_mode(layer, default=LossParameter.VALID):
    """The `normalization` field, else the legacy `normalize` bool, else `default`."""
    lp = layer.param.loss_param
    if lp.HasField("normalization"):
        return lp.normalization
    if lp.HasField("normalize"):
        return LossParameter.VALID if lp.normalize else LossParameter.BATCH_SIZE
    return default


def normalizer(layer, mode, outer, inner, valid_count):
    """Caffe's get_normalizer, floored at 1 so an all-ignored batch gives 0, not NaN."""
    if mode == LossParameter.FULL:
        n = outer * inner
    elif mode == LossParameter.VALID:
        n = outer * inner if valid_count < 0 else valid_count
    elif mode == LossParameter.BATCH_SIZE:
        n = outer
    elif mode == LossParameter.NONE:
        n = 1
    elif mode == LossParameter.PRE_FIXED:
        n = layer.param.loss_param.pre_fixed_normalizer
    else:
        raise layer.error("loss_param.normalization", "unknown normalization mode", mode)
    return max(1.0, float(n))


def split_at_axis(layer, shape, axis, field="axis"):
    """(outer, classes, inner) around the class axis."""
    axis = canonical_axis(layer, axis, len(shape), field)
    return count_from(shape, 0, axis), shape[axis], count_from(shape, axis + 1), axis


def read_labels(layer, blob, num_classes, ignore_label=None, shape=None, field="bottom[1]"):
    """Integer labels (truncated as Caffe's static_cast<int>) and the mask of those
    not ignored; a kept label outside [0, num_classes) raises."""
    values = blob.data if shape is None else blob.data.reshape(shape)
    labels = values.astype(np.int64)
    if ignore_label is None:
        valid = np.ones(labels.shape, bool)
        # two reductions instead of four masks: this runs in every forward of every loss
        if not labels.size or (labels.min() >= 0 and labels.max() < num_classes):
            return labels, valid
    else:
        valid = labels != ignore_label
    bad = valid & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        flat = int(np.flatnonzero(bad)[0])
        value = values.reshape(-1)[flat]
        value = int(value) if float(value).is_integer() else float(value)
        raise layer.error(field, f"label at index {flat} is out of range [0, {num_classes})", value,
                          hint="Check the dataset labels against the number of classes "
                               "(num_output of the layer before)")
    return labels, valid


def gather_classes(array, labels):
    """array[i, labels[i, j], j] for an (outer, classes, inner) array."""
    return np.take_along_axis(array, labels[:, None, :], axis=1)[:, 0, :]


def log_softmax(x):
    """Stable log-softmax over axis 1 of an (outer, classes, inner) array; also
    returns the probabilities (the backward needs them)."""
    shifted = x - x.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    s = e.sum(axis=1, keepdims=True)
    prob = e / s
    return shifted - np.log(s), prob


# -- layers -----------------------------------------------------------------
@register
class SoftmaxWithLoss(LossLayer):
    """Softmax over `softmax_param.axis` then the multinomial logistic loss:
        loss = -sum_{valid (i,j)} log softmax(x)[i, label_ij, j] / normalizer
    d loss / dx = (prob - onehot(label)) * top_diff / normalizer, 0 where ignored.
    Intel Caffe's label smoothing s (loss_param.label_smoothing, in [0, 1)) changes the
    backward only, as Intel's does: with D = classes * inner (Intel's `dim`; the classes when
    the class axis is the last), each valid position's gradient is that of the cross-entropy
    against the target a = 1 - s at the label and b = s / D at every other class,
        d loss / dx = ((a + (D - 1) b) prob - target) * top_diff / normalizer,
    while the loss top stays the hard-label loss above (what Intel's log shows, and what
    the plateau lr policy reads). Ignored positions and the normalizer are as without it.
    Reads softmax_param.axis, loss_param.ignore_label, loss_param.normalization
    (VALID default; legacy `normalize`), loss_param.label_smoothing. Optional top[1]: the
    probabilities.
    The log comes from log-softmax (no log of an underflowed probability), clamped
    at log(FLT_MIN) as Caffe's log(max(prob, FLT_MIN)) is. Computed by
    caffepy.kernels.loss (cext/loss.pyx) when built, else by its NumPy reference
    (caffepy/kernels/reference/loss.py)."""
    reshape_from_shapes = True
    exact_tops = None
    min_tops, max_tops = 1, 2
    smooths_labels = True

    def setup(self, bottom, top):
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        self.mode = normalization_mode(self)
        self.smoothing = lp.label_smoothing
        if not 0 <= self.smoothing < 1:
            raise self.error("loss_param.label_smoothing", "must be in [0, 1)", self.smoothing)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.outer, self.classes, self.inner, self.axis = split_at_axis(
            self, bottom[0].shape, self.param.softmax_param.axis, "softmax_param.axis")
        # the backward's (ratio, hit, miss) in float32, as Intel computes them
        self.targets = (1.0, 1.0, 0.0)
        if self.smoothing:
            s, dim = np.float32(self.smoothing), self.classes * self.inner
            hit, miss = np.float32(1) - s, s / np.float32(dim)
            self.targets = (hit + np.float32(dim - 1) * miss, hit, miss)
        if self.outer * self.inner != bottom[1].count:
            raise self.error("bottom[1]", f"number of labels must match number of predictions "
                             f"({self.outer * self.inner} for prediction shape {bottom[0].shape} and "
                             f"softmax axis {self.axis})", bottom[1].count, cls=ShapeError)
        if len(top) > 1:
            top[1].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        labels, valid = read_labels(self, bottom[1], self.classes, self.ignore_label,
                                    (self.outer, self.inner))
        if getattr(self, "prob", None) is None or self.prob.shape != x.shape:
            self.prob = np.empty(x.shape, np.float32)
        if self.ignore_label is None:
            self.count = labels.size
            self.labels = labels.astype(np.int32)
        else:
            self.count = int(valid.sum())
            self.labels = np.where(valid, labels, -1).astype(np.int32)
        loss = (_kernels or reference).softmax_loss_forward(x, self.labels, self.prob)
        top[0].data[...] = loss / normalizer(self, self.mode, self.outer, self.inner, self.count)
        if len(top) > 1:
            top[1].data[...] = self.prob.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        scale = self.top_diff(top) / normalizer(self, self.mode, self.outer, self.inner, self.count)
        diff = bottom[0].diff.reshape(self.outer, self.classes, self.inner)
        (_kernels or reference).softmax_loss_backward(self.prob, self.labels, scale, diff, *self.targets)


@register
class SigmoidCrossEntropyLoss(LossLayer):
    """Cross-entropy of sigmoid(x) against targets t in [0, 1], elementwise:
        loss = sum_{valid} max(x, 0) - x t + log(1 + exp(-|x|)) / normalizer
    d loss / dx = (sigmoid(x) - t) * top_diff / normalizer, 0 where ignored.
    Reads loss_param.ignore_label (a target equal to it, as an integer, is skipped),
    loss_param.normalization (BATCH_SIZE by default here, as in Caffe; legacy
    `normalize` true = VALID)."""

    def setup(self, bottom, top):
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        self.mode = normalization_mode(self, LossParameter.BATCH_SIZE)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            raise self.error("bottom", "inputs must have the same count",
                             f"{bottom[0].count} and {bottom[1].count}", cls=ShapeError)
        self.outer, self.inner = bottom[0].shape[0], count_from(bottom[0].shape, 1)

    def forward(self, bottom, top):
        loss, count = (_kernels or reference).sigmoid_ce_forward(
            bottom[0].data.reshape(-1), bottom[1].data.reshape(-1), self.ignore_label)
        self.norm = normalizer(self, self.mode, self.outer, self.inner, count)
        top[0].data[...] = loss / self.norm

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        (_kernels or reference).sigmoid_ce_backward(
            bottom[0].data.reshape(-1), bottom[1].data.reshape(-1),
            np.float32(self.top_diff(top) / self.norm), bottom[0].diff.reshape(-1), self.ignore_label)


@register
class EuclideanLoss(LossLayer):
    """loss = sum ||a - b||^2 / (2 N), N = bottom[0].shape[0].
    Gradient to both bottoms: +-(a - b) * top_diff / N."""

    def allow_force_backward(self, bottom_index):
        return True

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        a, b = bottom
        if count_from(a.shape, 1) != count_from(b.shape, 1):
            raise self.error("bottom", "inputs must have the same dimension",
                             f"{a.shape} and {b.shape}", cls=ShapeError)

    def forward(self, bottom, top):
        self.delta = bottom[0].data - bottom[1].data.reshape(bottom[0].shape)
        flat = self.delta.reshape(-1)
        flat = flat.astype(np.float64)
        top[0].data[...] = float(np.dot(flat, flat)) / bottom[0].shape[0] / 2.0

    def backward(self, top, propagate_down, bottom):
        alpha = self.top_diff(top) / bottom[0].shape[0]
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                np.multiply(self.delta.reshape(bottom[i].shape), sign * alpha, out=bottom[i].diff)


@register
class HingeLoss(LossLayer):
    """One-vs-all hinge loss over the count(1) scores of each item:
        m[i, k] = max(0, 1 - s x[i, k]), s = +1 for k == label_i, -1 otherwise
        L1: loss = sum m / N          L2: loss = sum m^2 / N
    Reads hinge_loss_param.norm (L1 default)."""

    def setup(self, bottom, top):
        self.norm = self.param.hinge_loss_param.norm
        if self.norm not in (caffe_pb2.HingeLossParameter.L1, caffe_pb2.HingeLossParameter.L2):
            raise self.error("hinge_loss_param.norm", "unknown norm", self.norm)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.num = bottom[0].shape[0]
        self.dim = bottom[0].count // self.num if self.num else 0
        if bottom[1].count != self.num:
            raise self.error("bottom[1]", f"needs one label per item ({self.num})", bottom[1].count,
                             cls=ShapeError)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.num, self.dim)
        labels, _ = read_labels(self, bottom[1], self.dim, shape=(self.num,))
        signed = x.copy()
        rows = np.arange(self.num)
        signed[rows, labels] *= -1
        self.margin = np.maximum(0.0, 1.0 + signed)
        self.labels = labels
        m = self.margin.reshape(-1).astype(np.float64)
        loss = np.sum(np.abs(m)) if self.norm == caffe_pb2.HingeLossParameter.L1 else np.dot(m, m)
        top[0].data[...] = float(loss) / self.num

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        diff = bottom[0].diff.reshape(self.num, self.dim)
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            np.sign(self.margin, out=diff)
            scale = self.top_diff(top) / self.num
        else:
            np.copyto(diff, self.margin)
            scale = 2.0 * self.top_diff(top) / self.num
        diff[np.arange(self.num), self.labels] *= -1
        diff *= scale


@register
class ContrastiveLoss(LossLayer):
    """Siamese loss over feature pairs a, b (N x C x 1 x 1) and similarity y (N):
        d = ||a - b||,  loss = sum_i [y_i d^2 + (1 - y_i) max(margin - d, 0)^2] / (2N)
    legacy_version: the dissimilar term is max(margin - d^2, 0) instead.
    y is read as an integer (non-zero = similar). Gradient to a and b, not y; as in
    Caffe, the non-legacy gradient divides by d + 1e-4 to stay finite at d = 0.
    Reads contrastive_loss_param.margin, legacy_version."""
    exact_bottoms = 3

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def setup(self, bottom, top):
        p = self.param.contrastive_loss_param
        self.margin, self.legacy = float(p.margin), p.legacy_version

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        a, b, y = bottom
        if a.num_axes < 2 or b.shape != a.shape or count_from(a.shape, 2) != 1:
            raise self.error("bottom", "the feature pair needs equal N x C (x 1 x 1) shapes",
                             f"{a.shape} and {b.shape}", cls=ShapeError)
        if y.count != a.shape[0]:
            raise self.error("bottom[2]", f"needs one similarity label per pair ({a.shape[0]})",
                             y.shape, cls=ShapeError)

    def forward(self, bottom, top):
        a, b, y = bottom
        n = a.shape[0]
        self.delta = (a.data - b.data).reshape(n, -1)
        d64 = self.delta.astype(np.float64)
        self.dist_sq = np.einsum("ij,ij->i", d64, d64)
        self.similar = y.data.reshape(-1).astype(np.int64) != 0
        if self.legacy:
            dissimilar = np.maximum(self.margin - self.dist_sq, 0.0)
        else:
            dissimilar = np.maximum(self.margin - np.sqrt(self.dist_sq), 0.0) ** 2
        per = np.where(self.similar, self.dist_sq, dissimilar)
        top[0].data[...] = float(per.sum()) / n / 2.0

    def backward(self, top, propagate_down, bottom):
        n = bottom[0].shape[0]
        if self.legacy:
            mdist = self.margin - self.dist_sq
            beta = -np.ones_like(mdist)
        else:
            dist = np.sqrt(self.dist_sq)
            mdist = self.margin - dist
            beta = -mdist / (dist + 1e-4)
        coeff = np.where(self.similar, 1.0, np.where(mdist > 0.0, beta, 0.0))
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                alpha = sign * self.top_diff(top) / n
                out = bottom[i].diff.reshape(n, -1)
                np.multiply(self.delta, (alpha * coeff)[:, None].astype(np.float32), out=out)


@register
class InfogainLoss(LossLayer):
    """Softmax over `infogain_loss_param.axis`, then the infogain-weighted log loss
        loss = -sum_{valid (i,j)} sum_l H[label_ij, l] log p[i, l, j] / normalizer
    (H the identity gives SoftmaxWithLoss). d loss / dx = p rowsum(H)[label] - H[label].
    H (classes x classes) is bottom[2] or the .binaryproto `infogain_loss_param.source`.
    Reads loss_param.ignore_label, normalization (the legacy `normalize` is refused,
    as in Caffe); optional top[1] = the probabilities. log p is clamped at
    log(kLOG_THRESHOLD) as Caffe's log(max(p, 1e-20))."""
    exact_bottoms = None
    min_bottoms, max_bottoms = 2, 3
    exact_tops = None
    min_tops, max_tops = 1, 2

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def setup(self, bottom, top):
        lp = self.param.loss_param
        self.ignore_label = lp.ignore_label if lp.HasField("ignore_label") else None
        if lp.HasField("normalize"):
            raise self.error("loss_param.normalize", "is deprecated for InfogainLoss", lp.normalize,
                             hint="Use loss_param { normalization: VALID } (or FULL, BATCH_SIZE, NONE)")
        self.mode = lp.normalization
        self.infogain = None
        if len(bottom) < 3:
            source = self.param.infogain_loss_param.source
            if not source:
                raise self.error("infogain_loss_param.source", "the infogain matrix must be given "
                                 "as a .binaryproto file or as a third bottom", "''")
            from ..blobproto import read_blobproto
            self.infogain = np.asarray(read_blobproto(source), np.float32)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.outer, self.classes, self.inner, self.axis = split_at_axis(
            self, bottom[0].shape, self.param.infogain_loss_param.axis, "infogain_loss_param.axis")
        if self.outer * self.inner != bottom[1].count:
            raise self.error("bottom[1]", f"number of labels must match number of predictions "
                             f"({self.outer * self.inner} for prediction shape {bottom[0].shape} and "
                             f"axis {self.axis})", bottom[1].count, cls=ShapeError)
        h_count = bottom[2].count if len(bottom) > 2 else self.infogain.size
        if h_count != self.classes * self.classes:
            field = "bottom[2]" if len(bottom) > 2 else "infogain_loss_param.source"
            raise self.error(field, f"the infogain matrix needs {self.classes}x{self.classes} values",
                             h_count, cls=ShapeError)
        if len(top) > 1:
            top[1].reshape(bottom[0].shape)

    def _matrix(self, bottom):
        h = bottom[2].data if len(bottom) > 2 else self.infogain
        return h.reshape(self.classes, self.classes)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        labels, valid = read_labels(self, bottom[1], self.classes, self.ignore_label,
                                    (self.outer, self.inner))
        logp, self.prob = log_softmax(x)
        logp = np.maximum(logp, np.float32(np.log(LOG_THRESHOLD)))
        safe = np.where(valid, labels, 0)
        h_rows = self._matrix(bottom)[safe]                    # (outer, inner, classes)
        per = np.einsum("ijl,ilj->ij", h_rows.astype(np.float64), logp.astype(np.float64))
        self.labels, self.valid = safe, valid
        self.count = int(valid.sum())
        top[0].data[...] = -float(per[valid].sum()) / normalizer(
            self, self.mode, self.outer, self.inner, self.count)
        if len(top) > 1:
            top[1].data[...] = self.prob.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        h = self._matrix(bottom)
        rowsum = h.sum(axis=1, dtype=np.float64).astype(np.float32)
        diff = bottom[0].diff.reshape(self.outer, self.classes, self.inner)
        np.multiply(self.prob, rowsum[self.labels][:, None, :], out=diff)
        diff -= h[self.labels].transpose(0, 2, 1)
        diff *= self.valid[:, None, :]
        diff *= self.top_diff(top) / normalizer(self, self.mode, self.outer, self.inner, self.count)


@register
class MultinomialLogisticLoss(LossLayer):
    """Log loss of given probabilities p (N x classes, e.g. a Softmax top):
        loss = -sum_i log(max(p[i, label_i], 1e-20)) / N
    d loss / dp[i, label_i] = -top_diff / (N max(p, 1e-20)), 0 elsewhere."""

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if count_from(bottom[1].shape, 1) != 1:
            raise self.error("bottom[1]", "needs one label per item (N x 1 x 1 x 1)",
                             bottom[1].shape, cls=ShapeError)
        self.num = bottom[0].shape[0]
        self.dim = bottom[0].count // self.num if self.num else 0

    def forward(self, bottom, top):
        p = bottom[0].data.reshape(self.num, self.dim)
        self.labels, _ = read_labels(self, bottom[1], self.dim, shape=(self.num,))
        picked = np.maximum(p[np.arange(self.num), self.labels].astype(np.float64), LOG_THRESHOLD)
        top[0].data[...] = -float(np.log(picked).sum()) / self.num

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        p = bottom[0].data.reshape(self.num, self.dim)
        diff = bottom[0].diff.reshape(self.num, self.dim)
        diff[...] = 0
        rows = np.arange(self.num)
        picked = np.maximum(p[rows, self.labels], np.float32(LOG_THRESHOLD))
        diff[rows, self.labels] = -(self.top_diff(top) / self.num) / picked


# -- Fast R-CNN and R-FCN --------------------------------------------------------------
def smooth_l1(d, sigma2=1.0):
    """Fast R-CNN's smooth L1 of d (float64) and its derivative: 0.5 sigma^2 d^2 within
    |d| < 1 / sigma^2, |d| - 0.5 / sigma^2 outside (the two meet with equal slope)."""
    inside = np.abs(d) < 1.0 / sigma2
    value = np.where(inside, 0.5 * sigma2 * d * d, np.abs(d) - 0.5 / sigma2)
    slope = np.where(inside, sigma2 * d, np.sign(d))
    return value, slope


def _legacy_nchw(shape):
    """(num, channels, spatial) of a blob as Caffe's 4-D accessors see it."""
    return shape[0], shape[1] if len(shape) > 1 else 1, count_from(shape, 2)


class _RegressionLoss(LossLayer):
    """What SmoothL1Loss and SmoothL1LossOHEM share: bottoms x, t and weights, each with the
    values of x per item; gradients to x and t (force_backward allowed, as Intel's layers
    do), none to the weights."""
    exact_bottoms = None

    def allow_force_backward(self, bottom_index):
        return bottom_index < 2

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        n, per = bottom[0].shape[0], count_from(bottom[0].shape, 1)
        for i, b in enumerate(bottom[1:], 1):
            if not b.num_axes or b.shape[0] != n or count_from(b.shape, 1) != per:
                raise self.error(f"bottom[{i}]", f"needs the {n} x {per} values of bottom[0] "
                                 f"{bottom[0].shape}", b.shape, cls=ShapeError)

    def _deltas(self, bottom, weight=None):
        d = bottom[0].data.astype(np.float64) - bottom[1].data.reshape(bottom[0].shape)
        return d if weight is None else d * weight.data.reshape(bottom[0].shape)

    def _backward_into(self, bottom, propagate_down, grad):
        for i, sign in ((0, 1.0), (1, -1.0)):
            if propagate_down[i]:
                bottom[i].diff[...] = (sign * grad).reshape(bottom[i].shape)


@register
class SmoothL1Loss(_RegressionLoss):
    """Fast R-CNN's box regression loss (Intel Caffe's layer; py-faster-rcnn's RPN and head):
        d = w_in (x - t),  loss = sum w_out smooth_l1(d; sigma) / N
    with smooth_l1 as above and N = bottom[0].shape[0] (1 with loss_param.normalization NONE;
    Intel's layer reads no other mode, nor do we). Bottoms: x, t, and optionally the inside
    and outside weights w_in, w_out (both or neither), each with x's values per item.
    d loss / dx = w_in w_out smooth_l1'(d) top_diff / N, the opposite to t.
    smooth_l1_loss_param { sigma (1) }."""
    min_bottoms, max_bottoms = 2, 4

    def setup(self, bottom, top):
        if len(bottom) == 3:
            raise self.error("bottom", "takes the inside and outside weights together (4 bottoms) or "
                             "neither (2)", len(bottom))
        self.sigma2 = float(self.param.smooth_l1_loss_param.sigma) ** 2
        if self.sigma2 == 0:
            raise self.error("smooth_l1_loss_param.sigma", "must not be 0", 0.0)

    def _normalizer(self, bottom):
        none = self.param.loss_param.normalization == LossParameter.NONE
        return 1.0 if none else max(1.0, float(bottom[0].shape[0]))

    def forward(self, bottom, top):
        weighted = len(bottom) == 4
        value, self.slope = smooth_l1(self._deltas(bottom, bottom[2] if weighted else None), self.sigma2)
        if weighted:
            w_in = bottom[2].data.reshape(bottom[0].shape)
            w_out = bottom[3].data.reshape(bottom[0].shape)
            value = value * w_out
            self.slope = self.slope * w_in * w_out
        top[0].data[...] = value.sum() / self._normalizer(bottom)

    def backward(self, top, propagate_down, bottom):
        self._backward_into(bottom, propagate_down, self.slope * (self.top_diff(top) / self._normalizer(bottom)))


@register
class SmoothL1LossOHEM(_RegressionLoss):
    """R-FCN's smooth L1 (sigma 1) with a per-item loss for hard example mining (Intel Caffe's
    layer): d = w (x - t), loss = sum smooth_l1(d) / normalizer. Bottoms: x, t, optional
    weights w, each with x's values per item. top[1] (optional): each position's loss summed
    over the channels, N x 1 x spatial (Caffe's N x 1 x H x W), unnormalized; no gradient
    flows from it. normalization (loss_param): FULL and VALID divide by N x spatial,
    BATCH_SIZE by N, PRE_FIXED by pre_fixed_normalizer, NONE by 1 (legacy `normalize`
    true = VALID); floored at 1.
    d loss / dx = w smooth_l1'(d) top_diff / normalizer: the exact gradient. (Intel's backward
    leaves out the factor w, which is the same for the 0 / 1 weights R-FCN's prototxts give.)"""
    min_bottoms, max_bottoms = 2, 3
    exact_tops = None
    min_tops, max_tops = 1, 2

    def setup(self, bottom, top):
        self.mode = normalization_mode(self)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.num, self.channels, self.spatial = _legacy_nchw(bottom[0].shape)
        if len(top) > 1:
            top[1].reshape((self.num, 1) + tuple(bottom[0].shape[2:]) if bottom[0].num_axes > 2
                           else (self.num, 1, 1, 1))

    def forward(self, bottom, top):
        weight = bottom[2] if len(bottom) == 3 else None
        value, self.slope = smooth_l1(self._deltas(bottom, weight))
        if weight is not None:
            self.slope = self.slope * weight.data.reshape(bottom[0].shape)
        # VALID counts every position: no label marks one ignored here
        self.norm = normalizer(self, self.mode, self.num, self.spatial, -1)
        top[0].data[...] = value.sum() / self.norm
        if len(top) > 1:
            top[1].data[...] = value.reshape(self.num, self.channels, self.spatial).sum(axis=1) \
                .reshape(top[1].shape)

    def backward(self, top, propagate_down, bottom):
        self._backward_into(bottom, propagate_down, self.slope * (self.top_diff(top) / self.norm))


@register
class SoftmaxWithLossOHEM(SoftmaxWithLoss):
    """SoftmaxWithLoss (same loss, gradient and loss_param fields) with R-FCN's per-item loss
    for hard example mining (Intel Caffe's layer). top[1] (optional): the probabilities;
    top[2] (optional): each label's -log(max(p[label], FLT_MIN)), 0 where ignored, shaped
    as the labels; no gradient flows from them. (Intel's CPU layer fills top[1] only when
    there are two tops; here it always holds the probabilities.)"""
    max_tops = 3

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if len(top) > 2:
            top[2].reshape(bottom[1].shape)

    def forward(self, bottom, top):
        super().forward(bottom, top)
        if len(top) > 2:
            valid = self.labels >= 0
            picked = gather_classes(self.prob, np.where(valid, self.labels, 0))
            per = -np.log(np.maximum(picked, np.finfo(np.float32).tiny))
            top[2].data[...] = np.where(valid, per, 0).reshape(top[2].shape)


@register
class BoxAnnotatorOHEM(Layer):
    """R-FCN's online hard example mining (Intel Caffe's layer): keep, in each image, the
    roi_per_img regions of interest with the highest loss; the others get ignore_label and
    zero box-regression weights, so the losses downstream train on the hard ones only.

    Bottoms: rois R x 5 (batch index, x1, y1, x2, y2; Caffe's R x 5 x H x W in general, the
    index read per position), the per-ROI loss (R x 1 x H x W: typically the sum of
    SoftmaxWithLossOHEM's and SmoothL1LossOHEM's per-item tops), the labels, and the box
    regression weights (R x B x H x W). Tops: the labels with ignore_label except on the
    kept ROIs, and the weights zeroed except on them. ROIs go by loss, highest first (ties
    in index order: Intel's sort leaves their order unspecified). No gradient.
    box_annotator_ohem_param { roi_per_img (required, > 0) ignore_label (-1) }."""
    exact_bottoms = 4
    exact_tops = 2
    differentiable = False

    def allow_force_backward(self, bottom_index):
        return False

    def setup(self, bottom, top):
        p = self.param.box_annotator_ohem_param
        if not p.HasField("roi_per_img") or p.roi_per_img <= 0:
            raise self.error("box_annotator_ohem_param.roi_per_img", "is required and must be positive",
                             p.roi_per_img)
        self.roi_per_img, self.ignore_label = int(p.roi_per_img), p.ignore_label

    def reshape(self, bottom, top):
        rois = bottom[0]
        if rois.num_axes < 2 or rois.shape[1] != 5:
            raise self.error("bottom[0]", "rois must be R x 5 (batch index, x1, y1, x2, y2)", rois.shape,
                             cls=ShapeError)
        self.num, _, self.spatial = _legacy_nchw(rois.shape)
        for i, what in ((1, "per-ROI loss"), (2, "labels")):
            if bottom[i].count != self.num * self.spatial or bottom[i].shape[0] != self.num:
                raise self.error(f"bottom[{i}]", f"the {what} need one value per ROI ({self.num} x 1 x "
                                 f"{self.spatial})", bottom[i].shape, cls=ShapeError)
        weights = bottom[3]
        if weights.num_axes < 2 or weights.shape[0] != self.num or count_from(weights.shape, 2) != self.spatial:
            raise self.error("bottom[3]", f"the box regression weights need {self.num} x B x {self.spatial} "
                             f"values", weights.shape, cls=ShapeError)
        top[0].reshape(bottom[1].shape)
        top[1].reshape(weights.shape)

    def forward(self, bottom, top):
        n, s = self.num, self.spatial
        images = bottom[0].data.reshape(n, 5, s)[:, 0, :].reshape(-1).astype(np.int64)
        loss = bottom[1].data.reshape(-1)
        order = np.argsort(-loss, kind="stable")
        kept = np.zeros(n * s, bool)
        left = {}
        for index in order:
            image = images[index]
            if left.setdefault(image, self.roi_per_img) > 0:
                left[image] -= 1
                kept[index] = True
        labels = bottom[2].data.reshape(-1)
        top[0].data.reshape(-1)[...] = np.where(kept, labels, np.float32(self.ignore_label))
        weights = bottom[3].data.reshape(n, -1, s)
        top[1].data.reshape(n, -1, s)[...] = weights * kept.reshape(n, 1, s)

    def backward(self, top, propagate_down, bottom):
        pass


@register
class Accuracy(Layer):
    """Fraction of (item, position) pairs whose label is among the top_k scores
    along `accuracy_param.axis`; a score tied with the true class counts as better
    (Caffe's rule). Ignored labels (accuracy_param.ignore_label) are not counted.
    top[0]: accuracy (0 when nothing is counted); optional top[1]: per-class
    accuracy (0 for classes absent from the batch). No gradient."""
    exact_bottoms = 2
    min_tops, max_tops = 1, 2
    differentiable = False

    def allow_force_backward(self, bottom_index):
        return False

    def setup(self, bottom, top):
        p = self.param.accuracy_param
        self.top_k = int(p.top_k)
        self.ignore_label = p.ignore_label if p.HasField("ignore_label") else None

    def reshape(self, bottom, top):
        if bottom[1].count == 0 or self.top_k > bottom[0].count // bottom[1].count:
            raise self.error("accuracy_param.top_k", "must be at most the number of classes "
                             f"({bottom[0].count // max(bottom[1].count, 1)})", self.top_k)
        self.outer, self.classes, self.inner, self.axis = split_at_axis(
            self, bottom[0].shape, self.param.accuracy_param.axis, "accuracy_param.axis")
        if self.outer * self.inner != bottom[1].count:
            raise self.error("bottom[1]", f"number of labels must match number of predictions "
                             f"({self.outer * self.inner} for prediction shape {bottom[0].shape} and "
                             f"axis {self.axis})", bottom[1].count, cls=ShapeError)
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((self.classes,))

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        labels, valid = read_labels(self, bottom[1], self.classes, self.ignore_label,
                                    (self.outer, self.inner))
        safe = np.where(valid, labels, 0)
        true_score = gather_classes(x, safe)
        # the true class itself is among the ">=" ones, hence the - 1
        better = (x >= true_score[:, None, :]).sum(axis=1) - 1
        correct = valid & (better < self.top_k)
        count = int(valid.sum())
        top[0].data[...] = 0.0 if count == 0 else int(correct.sum()) / count
        if len(top) > 1:
            seen = np.bincount(labels[valid], minlength=self.classes)
            hits = np.bincount(labels[correct], minlength=self.classes)
            top[1].data[...] = np.where(seen > 0, hits / np.maximum(seen, 1), 0.0)

    def backward(self, top, propagate_down, bottom):
        pass
