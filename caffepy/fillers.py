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


# Intel Caffe's "gabor" filler: a fixed bank of Gabor filters for a first convolution over color
# images, defined for four nets' first layers. Kernel i's value at (y, x), both spaced evenly over
# [-1, 1], is
#     lam * exp(-(x^2 + y^2) / (2 sigma^2)) * cos(omega * (x cos(theta) - y sin(theta)) + phi)
# times (r, g, b) for the three input channels. The parameters of each kernel follow.
_GABOR_DEFAULT = dict(lam=1.0, sigma=0.6, omega=np.pi, phi=0.0, theta=0.0, rgb=(1.0, 1.0, 1.0))


def _gabor_cifar(i, k):
    pi, span = np.pi, np.pi * (k - 1) / 2
    q = dict(_GABOR_DEFAULT, lam=0.5)
    if i < 8:
        q.update(omega=span, theta=i * pi / 8)
    elif i < 14:
        q.update(omega=span / 2, theta=((i - 2) % 6) * pi / 6 + pi / 12)
    elif i < 16:
        q.update(sigma=0.75, omega=span / 8, phi=(i % 2) * pi, rgb=(1, -1, 1))
    else:
        q.update(omega=span / 4, theta=(i % 4) * pi / 2 + pi / 4 + pi / 8, phi=pi / 2)
    if i >= 30:
        q.update(theta=(i % 2) * pi / 2 + pi / 4 + pi / 8, rgb=(1, 1, 0))
    elif i >= 28:
        q.update(theta=(i % 2) * pi / 2 + pi / 4 - pi / 8, rgb=(-1, 1, -1))
    elif i >= 24:
        q.update(rgb=(-1, 1, 1))
    elif i >= 20:
        q.update(rgb=(1, 0, -1))
    return q


def _gabor_googlenet(i, k):
    pi, span = np.pi, np.pi * (k - 1) / 2
    q = dict(_GABOR_DEFAULT)
    if i < 32:
        frequency = i % 8
        q.update(lam=1 / (1 + frequency / 8), sigma=0.4 + 0.2 * frequency / 8,
                 omega=span / (1 + frequency / 2), phi=(i % 2) * pi + pi * 12 / 32, theta=(i // 8) * pi / 4)
    elif i < 40:
        q.update(sigma=0.45, lam=0.5, omega=span, theta=(i % 8) * pi / 8, phi=pi)
    elif i < 46:
        size = (i - 1) % 3
        q.update(lam=1 / (1 + size / 2), sigma=1 / (2.5 - size / 2), omega=pi / 4,
                 phi=((i - 1) // 3) * pi, rgb=(0.25, -1, 1))
    elif i < 48:
        q.update(lam=2 / 3, sigma=1, omega=span / 12, theta=(i % 8) * pi + pi / 8, phi=pi / 2,
                 rgb=(1, 0.1, -0.5))
    elif i < 56:
        q.update(lam=2 / 3, sigma=1, omega=span / 12, theta=(i % 8) * pi / 4 + pi / 32, phi=pi / 2,
                 rgb=(-0.5, 0.1, 1))
    elif i < 60:
        q.update(lam=1, sigma=1, omega=span / 12, theta=(i % 8) * pi / 2 + pi / 8, phi=pi / 2,
                 rgb=(0.25, -1, 1))
    else:
        q.update(lam=2 / 3, sigma=1, omega=span / 12, theta=(i % 8) * pi / 2 + pi / 8, phi=pi / 2,
                 rgb=(-1, -1, 1))
    return q


def _gabor_vgg(i, k):
    return dict(_gabor_googlenet(i, k), sigma=1.0)


def _gabor_alexnet(i, k):
    pi, span = np.pi, np.pi * (k - 1) / 2
    q = dict(_GABOR_DEFAULT)
    lam = 1 / 3
    if i < 48:
        frequency = i % 8
        q.update(lam=lam / (1 + frequency / 8), sigma=0.5 + 0.2 * frequency / 8,
                 omega=span / (1 + frequency / 2), phi=(i % 2) * pi + pi * 12 / 32, theta=(i // 8) * pi / 6)
    elif i < 56:
        size = i % 4
        q.update(lam=lam / (1 + size / 2), sigma=1 / (2.5 - size / 2), omega=pi / 4, phi=(i // 4) * pi,
                 rgb=(0.25, -1, 1))
    elif i < 60:
        q.update(lam=lam / 1.5, sigma=0.75, omega=span / 8, theta=(i % 4) * pi / 2 + pi / 8, phi=pi / 2,
                 rgb=(-1, 1, -0.5))
    elif i < 64:
        q.update(lam=lam / 3, sigma=2, omega=span / 8, theta=(i % 4) * pi / 2 + pi / 8, phi=pi / 2,
                 rgb=(1, -0.5, -0.75))
    elif i < 72:
        q.update(lam=lam / 1.5, sigma=0.75, omega=span / 4, theta=(i % 8) * pi / 4 + pi / 32, phi=pi / 2,
                 rgb=(1, 0.1, -0.75))
    elif i < 80:
        q.update(lam=lam / 1.5, sigma=1, omega=span / 12, theta=(i % 8) * pi / 4 + pi / 32, phi=pi / 2,
                 rgb=(-0.5, 0.1, 1))
    elif i < 88:
        q.update(lam=lam / 2.5, sigma=1, omega=span / 8, theta=(i % 8) * pi / 4 + pi / 32, phi=pi / 2,
                 rgb=(-1, -1, 1))
    elif i < 92:
        q.update(lam=lam, omega=span / 16, theta=(i % 4) * pi / 2 + pi / 16, phi=pi / 2)
    else:
        q.update(lam=lam / 4, sigma=0.75, omega=span / 4, theta=(i % 8) * pi / 4 + pi / 32, phi=pi / 2,
                 rgb=(-1, -1, 1))
    return q


# (kernels, size) -> the parameters of kernel i
GABOR_BANKS = {(32, 5): _gabor_cifar, (64, 7): _gabor_googlenet, (64, 3): _gabor_vgg,
               (96, 11): _gabor_alexnet}


def _gabor(p, shape, g):
    if len(shape) != 4 or shape[1] != 3 or shape[2] != shape[3]:
        raise CaffepyError(f"gabor filler: needs a kernels x 3 x k x k blob (a convolution over color "
                           f"images with a square kernel), got shape {tuple(shape)}")
    bank = GABOR_BANKS.get((shape[0], shape[3]))
    if bank is None:
        known = ", ".join(f"{n} of {k}x{k}" for n, k in GABOR_BANKS)
        raise CaffepyError(f"gabor filler: no Gabor bank for {shape[0]} kernels of {shape[3]}x{shape[3]}; "
                           f"Intel Caffe defines {known}")
    if p.sparse >= 0:
        raise CaffepyError(f"gabor filler: sparse is not supported, got {p.sparse}")
    k = shape[3]
    y, x = np.meshgrid(np.linspace(-1, 1, k), np.linspace(-1, 1, k), indexing="ij")
    out = np.empty(shape)
    for i in range(shape[0]):
        q = bank(i, k)
        along = x * np.cos(q["theta"]) - y * np.sin(q["theta"])
        value = q["lam"] * np.exp(-(x * x + y * y) / (2 * q["sigma"] ** 2)) * np.cos(along * q["omega"] + q["phi"])
        out[i] = np.multiply.outer(np.asarray(q["rgb"], np.float64), value)
    return out


FILLERS = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
    "gabor": _gabor,
}


_CHUNK = 1 << 16      # float64 draws at a time (512 KB: stays in L2)


def fill_into(filler_param, out):
    """Fill float32 array `out` as fill(filler_param, out.shape) would, with the same numbers.
    Gaussian (not sparse) and uniform draw into a small reused buffer and cast chunk by
    chunk: DummyData refills its tops every forward, and a whole float64 draw there (317 MB
    for an AlexNet batch of 256) cost more in page clearing than in drawing."""
    p = filler_param
    if not (p.type == "uniform" or (p.type == "gaussian" and p.sparse < 0)) or not out.flags.c_contiguous:
        out[...] = fill(p, out.shape)
        return
    flat = out.reshape(-1)
    g = rng.generator()
    buf = np.empty(min(_CHUNK, flat.size))
    for start in range(0, flat.size, _CHUNK):
        part = buf[:min(_CHUNK, flat.size - start)]
        # NumPy draws normal(m, s) as m + s * standard_normal and uniform(a, b) as
        # a + (b - a) * random, in the same order: the same doubles
        if p.type == "gaussian":
            g.standard_normal(out=part)
            part *= p.std
            part += p.mean
        else:
            g.random(out=part)
            part *= p.max - p.min
            part += p.min
        flat[start:start + part.size] = part


def fill(filler_param, shape):
    """A new float32 array of `shape` filled as `filler_param` (a FillerParameter) says."""
    kind = filler_param.type
    if kind not in FILLERS:
        raise CaffepyError(f"unknown filler type '{kind}', known: {', '.join(sorted(FILLERS))}")
    out = FILLERS[kind](filler_param, tuple(int(s) for s in shape), rng.generator())
    return np.ascontiguousarray(out, dtype=np.float32)
