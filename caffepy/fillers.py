"""Weight fillers, keyed by FillerParameter.type as in Caffe.

fan_in = count / shape[0], fan_out = count / shape[1] (Caffe's convention for
conv and inner-product weights); xavier and msra scale by fan_in, fan_out or
their average per `variance_norm`.
"""
import numpy as np

from . import rng
from .errors import CaffepyError


def _fan(shape, variance_norm):
    count = int(np.prod(shape))
    fan_in = count / shape[0] if shape and shape[0] else count
    fan_out = count / shape[1] if len(shape) > 1 and shape[1] else count
    # variance_norm: FAN_IN = 0, FAN_OUT = 1, AVERAGE = 2
    if variance_norm == 1:
        return fan_out
    if variance_norm == 2:
        return (fan_in + fan_out) / 2.0
    return fan_in


def _constant(p, shape, g):
    return np.full(shape, p.value, np.float32)


def _uniform(p, shape, g):
    return g.uniform(p.min, p.max, shape)


def _gaussian(p, shape, g):
    out = g.normal(p.mean, p.std, shape)
    if p.sparse >= 0:
        # keep each weight with probability sparse / num_outputs, so every output
        # unit sees `sparse` non-zero inputs on average
        if len(shape) < 2:
            raise CaffepyError("gaussian filler: sparse needs a blob with at least 2 axes")
        num_outputs = shape[0]
        keep = g.random(shape) < (p.sparse / num_outputs)
        out = out * keep
    return out


def _positive_unitball(p, shape, g):
    out = g.uniform(0, 1, shape).reshape(shape[0] if shape else 1, -1)
    out /= out.sum(axis=1, keepdims=True)
    return out.reshape(shape)


def _xavier(p, shape, g):
    scale = np.sqrt(3.0 / _fan(shape, p.variance_norm))
    return g.uniform(-scale, scale, shape)


def _msra(p, shape, g):
    # Intel Caffe's `scale` multiplies the standard deviation (1 in BVLC Caffe)
    return g.normal(0.0, p.scale * np.sqrt(2.0 / _fan(shape, p.variance_norm)), shape)


def _bilinear(p, shape, g):
    # upsampling kernel for Deconvolution: weights of a bilinear interpolation
    if len(shape) != 4 or shape[2] != shape[3]:
        raise CaffepyError(f"bilinear filler: needs a square 4-axis kernel, got shape {tuple(shape)}")
    k = shape[3]
    f = np.ceil(k / 2.0)
    c = (2 * f - 1 - f % 2) / (2.0 * f)
    x = np.arange(k)
    w1 = 1 - np.abs(x / f - c)
    return np.broadcast_to(np.outer(w1, w1), shape)


FILLERS = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
}


def fill(filler_param, shape):
    """A new float32 array of `shape` filled as `filler_param` (a FillerParameter) says."""
    kind = filler_param.type
    if kind not in FILLERS:
        raise CaffepyError(f"unknown filler type '{kind}', known: {', '.join(sorted(FILLERS))}")
    out = FILLERS[kind](filler_param, tuple(int(s) for s in shape), rng.generator())
    return np.ascontiguousarray(out, dtype=np.float32)
