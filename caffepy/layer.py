"""Layer base class and the registry keyed by the prototxt `type` string.

A layer has the pycaffe Python-layer shape:
    setup(bottom, top)                      read parameters, create `self.blobs`
    reshape(bottom, top)                    shape the tops (called before every forward)
    forward(bottom, top)                    fill top data
    backward(top, propagate_down, bottom)   fill bottom diffs (overwrite) and
                                            param diffs (accumulate, as Caffe)
Blob counts are declared as class data and checked once by `layer_setup`.
"""
import difflib

import numpy as np

from . import fillers
from .blob import Blob
from .errors import CaffepyError, LayerError, ShapeError, layer_error, quote

LAYERS = {}


def register(cls):
    """Class decorator: register `cls` under its class name (the prototxt type)."""
    name = cls.__dict__.get("type") or cls.__name__
    if name in LAYERS:
        raise RuntimeError(f"layer type '{name}' registered twice")
    cls.type = name
    LAYERS[name] = cls
    return cls


def create_layer(param, phase, source=None):
    cls = LAYERS.get(param.type)
    if cls is None:
        known = ", ".join(sorted(LAYERS))
        lower = {t.lower(): t for t in LAYERS}
        close = difflib.get_close_matches(param.type.lower(), lower, n=1)
        guess = f"did you mean '{lower[close[0]]}'? " if close else ""
        raise layer_error(_Named(param, source), "type", f"unknown layer type '{quote(param.type)}'",
                          hint=f"{guess}Known types: {known}")
    return cls(param, phase, source)


class _Named:
    def __init__(self, param, source):
        self.param, self.source = param, source


class Layer:
    type = None
    # blob-count contract (None = unconstrained)
    exact_bottoms = min_bottoms = max_bottoms = None
    exact_tops = min_tops = max_tops = None
    equal_bottom_top = False
    # loss layers weigh their first top by 1 unless loss_weight says otherwise
    is_loss = False
    # False for layers with no gradient (data, Accuracy, ArgMax): no gradient test owed
    differentiable = True
    # may sit between IntelPack and IntelUnpack (takes the SIMD-blocked layout)
    accepts_blocked = False

    def __init__(self, param, phase=0, source=None):
        self.param = param
        self.phase = phase
        self.source = source
        self.name = param.name
        self.blobs = []
        if len(param.blobs):
            from .blobproto import blobproto_to_array
            for i, bp in enumerate(param.blobs):
                b = Blob(name=f"{self.name}.{len(self.blobs)}")
                b.set_data(blobproto_to_array(bp, source=source,
                                              where=f"layer '{param.name}' ({param.type}): blobs[{i}]"))
                self.blobs.append(b)
        # which param blobs want a gradient (lr_mult != 0); set by the Net
        self.param_propagate_down = []

    # -- overridables ----------------------------------------------------
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        raise NotImplementedError

    def forward(self, bottom, top):
        raise NotImplementedError

    def backward(self, top, propagate_down, bottom):
        pass

    def allow_force_backward(self, bottom_index):
        return True

    # -- helpers for subclasses ------------------------------------------
    def error(self, field, problem, value=None, hint=None, cls=LayerError):
        return layer_error(self, field, problem, value, hint, cls)

    def init_param_blobs(self, specs):
        """Create `self.blobs` from [(shape, FillerParameter), ...] unless loaded already.

        Blobs that came with the layer (weights inside the prototxt) must match the
        expected shapes.
        """
        if self.blobs:
            if len(self.blobs) != len(specs):
                raise self.error("blobs", f"expected {len(specs)} parameter blobs", len(self.blobs))
            for i, (blob, (shape, _)) in enumerate(zip(self.blobs, specs)):
                if blob.shape != tuple(shape):
                    raise self.error(f"blobs[{i}]", f"shape should be {tuple(shape)}", blob.shape,
                                     cls=ShapeError)
            return
        for i, (shape, filler) in enumerate(specs):
            b = Blob(shape, name=f"{self.name}.{i}")
            try:
                b.data[...] = fillers.fill(filler, shape)
            except CaffepyError as e:
                raise self.error(f"blobs[{i}] filler", str(e)) from None
            self.blobs.append(b)

    def check_blob_counts(self, bottom, top):
        def check(kind, n, exact, lo, hi):
            if exact is not None and n != exact:
                raise self.error(kind, f"takes exactly {exact} blob(s)", n)
            if lo is not None and n < lo:
                raise self.error(kind, f"takes at least {lo} blob(s)", n)
            if hi is not None and n > hi:
                raise self.error(kind, f"takes at most {hi} blob(s)", n)
        check("bottom", len(bottom), self.exact_bottoms, self.min_bottoms, self.max_bottoms)
        check("top", len(top), self.exact_tops, self.min_tops, self.max_tops)
        if self.equal_bottom_top and len(bottom) != len(top):
            raise self.error("top", f"needs as many tops as bottoms ({len(bottom)})", len(top))

    def loss_weights(self, num_tops):
        """Per-top loss weights: from the prototxt, else Caffe's defaults."""
        given = list(self.param.loss_weight)
        if given:
            if len(given) != num_tops:
                raise self.error("loss_weight", f"needs one value per top ({num_tops})", len(given))
            return [float(w) for w in given]
        return [1.0 if (self.is_loss and i == 0) else 0.0 for i in range(num_tops)]

    def layer_setup(self, bottom, top):
        """What the Net calls once: count check, setup, first reshape."""
        self.check_blob_counts(bottom, top)
        self.setup(bottom, top)
        self.reshape(bottom, top)

    def __repr__(self):
        return f"<{self.type} layer '{self.name}'>"


def count_from(shape, start, end=None):
    return int(np.prod(shape[start:end], dtype=np.int64))


def canonical_axis(layer, axis, num_axes, field="axis"):
    """Caffe's CanonicalAxisIndex: negative axes count from the end."""
    if not -num_axes <= axis < num_axes:
        raise layer.error(field, f"out of range for a {num_axes}-axis blob", axis, cls=ShapeError)
    return axis % num_axes
