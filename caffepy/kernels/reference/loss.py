"""NumPy references of the loss kernels (cext/loss.pyx, caffepy.kernels.loss): SoftmaxWithLoss
over an (outer, classes, inner) view, with the kernels' signatures (int32 labels, -1 where
ignored; results written into the caller's arrays), and SigmoidCrossEntropyLoss over flat
arrays. The layers run them when the kernels are not built.
"""
import numpy as np

LOG_FLT_MIN = float(np.log(np.finfo(np.float32).tiny))


def softmax_into(x, prob):
    """prob = softmax of x over axis 1, written into `prob` without temporaries of x's
    size; returns (max, sum of exp(x - max)) per (outer, inner) for the log terms."""
    peak = x.max(axis=1, keepdims=True)
    np.subtract(x, peak, out=prob)
    np.exp(prob, out=prob)
    total = prob.sum(axis=1, keepdims=True)
    prob *= 1.0 / total
    return peak[:, 0, :], total[:, 0, :]


def softmax_loss_forward(x, labels, prob):
    """prob = softmax of x over axis 1; returns the sum over positions with a label (>= 0) of
    -log p[label], taken as max + log(sum) - x[label] (no log of an underflowed probability)
    and capped at -log(FLT_MIN) as Caffe's log(max(p, FLT_MIN)) is."""
    peak, total = softmax_into(x, prob)
    valid = labels >= 0
    picked = np.take_along_axis(x, np.where(valid, labels, 0)[:, None, :], axis=1)[:, 0, :]
    log_p = picked.astype(np.float64) - peak - np.log(total.astype(np.float64))
    return -float(np.sum(np.maximum(log_p, LOG_FLT_MIN)[valid]))


def softmax_loss_backward(prob, labels, scale, diff, ratio=1.0, hit=1.0, miss=0.0):
    """diff = (ratio * prob - target) * scale, target = hit at the label's class and miss at
    the others (the defaults: (prob - onehot(label)) * scale), 0 at ignored (-1) positions."""
    valid = labels >= 0
    np.multiply(prob, np.float32(ratio), out=diff)
    if miss:
        diff -= np.float32(miss)
    if valid.all():
        diff *= np.float32(scale)
    else:
        diff *= np.where(valid, np.float32(scale), np.float32(0))[:, None, :]
    rows, cols = np.nonzero(valid)
    diff[rows, labels[rows, cols], cols] -= (np.float32(hit) - np.float32(miss)) * np.float32(scale)


def _kept(t, ignore):
    """Positions whose target, cast to an integer as Caffe does, is not `ignore` (None: all)."""
    if ignore is None:
        return None
    with np.errstate(invalid="ignore"):
        inside = np.abs(t) < 9.2e18
        return ~(inside & (np.where(inside, t, 0).astype(np.int64) == ignore))


def sigmoid_ce_forward(x, t, ignore=None):
    """(sum, count) over the kept positions of max(x, 0) - x t + log(1 + exp(-|x|))."""
    per = np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))
    kept = _kept(t, ignore)
    if kept is None:
        return float(np.sum(per, dtype=np.float64)), x.size
    return float(np.sum(per[kept], dtype=np.float64)), int(kept.sum())


def sigmoid_ce_backward(x, t, scale, diff, ignore=None):
    """diff = (sigmoid(x) - t) * scale, 0 where the target is `ignore`."""
    # sigmoid as 0.5 tanh(x/2) + 0.5: no overflow for any x
    np.multiply(np.tanh(0.5 * x), 0.5, out=diff)
    diff += 0.5
    diff -= t
    diff *= scale
    kept = _kept(t, ignore)
    if kept is not None:
        diff *= kept
