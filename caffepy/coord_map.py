"""pycaffe's caffe.coord_map: how the spatial coordinates of two NetSpec tops relate, and the
Crop layer that aligns one to the other (the FCN skip-connection helper).

A layer maps an input coordinate x to the output coordinate a * x + b along the spatial axes
from `axis` on; a map is the triple (axis, a, b), with `a` and `b` one value per spatial axis
(or a scalar when the layer treats them alike). For a layer with kernel k (dilated:
(k - 1) * dilation + 1), stride s and pad p:

    Convolution, Pooling, Im2col   a = 1 / s,  b = (p - (k - 1) / 2) / s
    Deconvolution                  a = s,      b = (k - 1) / 2 - p
    Crop (axis, offset)            a = 1,      b = -offset      (axis - 1: the last fixed axis)
    pointwise layers (ReLU, ...)   (None, 1, 0): the identity, on any axis

    n = caffe.NetSpec(); ...; n.upscore = L.Deconvolution(n.score, ...)
    n.score = crop(n.upscore, n.data)    # L.Crop(upscore, data, crop_param=dict(axis=2, offset=[19]))
"""
import numpy as np

from .errors import CaffepyError
from .net_spec import PARAM_FIELDS, layers as L

PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log", "LRN",
                       "Exp", "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split", "TanH",
                       "Threshold"]


class UndefinedMapException(CaffepyError):
    """A layer type with no coordinate mapping (InnerProduct, Reshape, ...)."""


class AxisMismatchException(CaffepyError):
    """Two maps on different axes cannot be composed."""


class UnconnectedTopsError(CaffepyError, RuntimeError):
    """The two tops share no ancestor through spatial layers (a RuntimeError, as in pycaffe)."""


class CropError(CaffepyError, AssertionError):
    """The map between the tops is no crop (an AssertionError, as pycaffe's checks raise)."""


def _params(fn):
    """The layer's parameter keywords: its `<type>_param` dict if given so, else the keywords."""
    field = PARAM_FIELDS.get(fn.type_name)
    nested = fn.params.get(field) if field else None
    return nested if isinstance(nested, dict) else fn.params


def _values(params, name, default):
    return np.array(params.get(name, default), dtype=float, ndmin=1)


def conv_params(fn):
    """(axis, stride, dilated kernel extent, pad) of a Convolution, Deconvolution, Im2col or
    Pooling call; kernel_h/_w, stride_h/_w and pad_h/_w give one value per axis."""
    p = _params(fn)

    def pick(name, default):
        if f"{name}_h" in p or f"{name}_w" in p:
            return np.array([p.get(f"{name}_h", default), p.get(f"{name}_w", default)], dtype=float)
        return _values(p, name if name != "kernel" else "kernel_size", default)

    if "kernel_h" in p and "kernel_w" in p:
        kernel = pick("kernel", None)
    elif "kernel_size" in p:
        kernel = _values(p, "kernel_size", None)
    else:
        what = "global_pooling" if p.get("global_pooling") else "kernel_size (or kernel_h and kernel_w)"
        raise UndefinedMapException(f"coord_map: layer of type '{fn.type_name}': {what}: no coordinate "
                                    f"mapping without a kernel size")
    dilation = _values(p, "dilation", 1)
    return p.get("axis", 1), pick("stride", 1), (kernel - 1) * dilation + 1, pick("pad", 0)


def crop_params(fn):
    """(axis, offset) of a Crop call, with Caffe's defaults (axis 2, offset 0)."""
    p = _params(fn)
    return p.get("axis", 2), np.array(p.get("offset", 0), dtype=float, ndmin=1)


def coord_map(fn):
    """The (axis, a, b) map of one layer call."""
    if fn.type_name in ("Convolution", "Pooling", "Im2col"):
        axis, stride, kernel, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (kernel - 1) / 2) / stride
    if fn.type_name == "Deconvolution":
        axis, stride, kernel, pad = conv_params(fn)
        return axis, stride, (kernel - 1) / 2 - pad
    if fn.type_name in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if fn.type_name == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset
    raise UndefinedMapException(f"coord_map: layer type '{fn.type_name}' has no coordinate mapping")


def compose(base_map, next_map):
    """The map of applying `next_map`, then `base_map`: scales multiply, and next_map's
    shift is scaled by base_map's scale."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is None:
        ax = ax2
    elif ax2 is None or ax1 == ax2:
        ax = ax1
    else:
        raise AxisMismatchException(f"coord_map: cannot compose maps on axis {ax1} and axis {ax2}")
    return ax, a1 * a2, a1 * b2 + b1


def inverse(coord_map):
    """The backward map: x = (y - b) / a."""
    ax, a, b = coord_map
    return ax, 1 / a, -b / a


def _mapped_bottoms(top):
    # Crop's second bottom only gives the reference shape: its coordinates are not mapped
    inputs = top.fn.inputs
    return inputs[:1] if top.fn.type_name == "Crop" else inputs


def _walk(start):
    """Yield (top, map from `top` to `start`) back through the graph, breadth first."""
    maps = {start: (None, 1, 0)}
    frontier = [start]
    while frontier:
        top = frontier.pop(0)
        yield top, maps[top]
        try:
            step = coord_map(top.fn)
        except UndefinedMapException:
            continue
        for bottom in _mapped_bottoms(top):
            if bottom not in maps:
                maps[bottom] = compose(maps[top], step)
                frontier.append(bottom)


def coord_map_from_to(top_from, top_to):
    """(axis, a, b) such that a coordinate x in `top_from` is a * x + b in `top_to`, found
    through their nearest common ancestor."""
    from_maps = dict(_walk(top_from))
    for top, to_map in _walk(top_to):
        if top in from_maps:
            return compose(to_map, inverse(from_maps[top]))
    raise UnconnectedTopsError("coord_map: could not compute the map between the tops; are they "
                               "connected by spatial layers (Convolution, Pooling, Deconvolution, Crop, "
                               "pointwise layers)?")


def crop(top_from, top_to):
    """A Crop layer call that crops `top_from` to the coordinates of `top_to`."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    a, b = np.atleast_1d(a), np.atleast_1d(b)
    if not (a == 1).all():
        raise CropError(f"crop: scale mismatch on crop (a = {a}); the tops are not at the same resolution")
    if not (b <= 0).all():
        raise CropError(f"crop: cannot crop a negative offset (b = {b}); the top to crop is smaller "
                        f"than the reference")
    if not (np.round(b) == b).all():
        raise CropError(f"crop: cannot crop a non-integer offset (b = {b})")
    axis = 2 if ax is None else ax + 1     # +1: the first cropped axis
    return L.Crop(top_from, top_to, crop_param=dict(axis=int(axis), offset=[int(o) for o in -np.round(b)]))
