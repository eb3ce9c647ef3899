"""NumPy references of the loss kernels (cext/loss.pyx, caffepy.kernels.loss): SoftmaxWithLoss
over an (outer, classes, inner) view, with the kernels' signatures (int32 labels, -1 where
ignored; results written into the caller's arrays). SoftmaxWithLoss runs them when the kernels
are not built.
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


def softmax_loss_backward(prob, labels, scale, diff):
    """diff = (prob - onehot(label)) * scale, 0 at ignored (-1) positions."""
    valid = labels >= 0
    if valid.all():
        np.multiply(prob, np.float32(scale), out=diff)
    else:
        weight = np.where(valid, np.float32(scale), np.float32(0))
        np.multiply(prob, weight[:, None, :], out=diff)
    rows, cols = np.nonzero(valid)
    diff[rows, labels[rows, cols], cols] -= np.float32(scale)
