"""Layer base class and the registry keyed by the prototxt `type` string.

A layer has the pycaffe Python-layer shape:
    setup(bottom, top)                      read parameters, create `self.blobs`
    reshape(bottom, top)                    shape the tops (called before every forward)
    forward(bottom, top)                    fill top data
    backward(top, propagate_down, bottom)   fill bottom diffs (overwrite) and
                                            param diffs (accumulate, as Caffe)
Blob counts are declared as class data and checked once by `layer_setup`.

Which implementation runs is the factory's decision, as in Caffe's layer_factory.cpp. A type
may have several implementations, its variants, each registered with `@register(variant=...)`
after the plain one (`@register`):
    plain            the NCHW implementation, in caffepy/layers/<family>.py
    blocked          on the SIMD-blocked layout between IntelPack and IntelUnpack (layers/intel.py)
    blocked_via_nchw the plain layer run between an unpack and a pack (layers/intel.py)
    nhwc             on the channels-last layout the fast path plans (layers/nhwc.py)
    model_parallel   InnerProduct split across ranks (caffepy/parallel/model_parallel.py)
`create_layer` picks one from what a Request holds (the layer's parameters, its bottoms, the
run context, the net's parameters): first the bottoms' layout (each implementation declares
the one it takes in `Layer.layout`; bottoms in another layout than NCHW need a variant of that
layout or a layout-agnostic plain layer), then the first other variant whose `wanted(request)`
says yes, else the plain one. Which layout a layer's bottoms are in is the layout plan's
decision (caffepy/layout_plan.py, asked by the Net); `takes_layout` tells it what a type can
run on. A new implementation is a class with a `wanted` and a `@register(variant=...)`. The Net
only asks; the layer keeps the run context it was built for in `layer.context`.
"""
import difflib
import enum
import math
import typing

import numpy as np

from . import engine, fillers
from .blob import CHANNELS_LAST, Blob, Blocked
from .context import SINGLE
from .errors import CaffepyError, LayerError, ShapeError, layer_error, quote

# The bottom layouts an implementation takes (Layer.layout)
NCHW = "nchw"        # plain blobs only
BLOCKED = "blocked"  # SIMD-blocked blobs only; the layer sets its tops' layout
NHWC = "nhwc"        # channels-last blobs only; the layer sets its tops' layout
ANY = "any"          # any, all bottoms alike; the tops take the first bottom's layout
OWN = "own"          # any; the layer checks and sets layouts itself (the packs and unpacks)
LAYOUTS = (NCHW, BLOCKED, NHWC)

# Variant names (the registry's second key); the blocked and nhwc variants are named after
# their layouts
PLAIN = "plain"
VIA_NCHW = "blocked_via_nchw"
MODEL_PARALLEL = "model_parallel"


def layout_of(blob):
    """The layout name (NCHW, BLOCKED, NHWC) of a blob."""
    if blob.layout is None:
        return NCHW
    return BLOCKED if isinstance(blob.layout, Blocked) else NHWC

class Phase(enum.IntEnum):
    """caffe_pb2's phases as pycaffe shows them (caffepy.TRAIN, caffepy.TEST): TRAIN prints as
    TRAIN (py-faster-rcnn's layers look their settings up by str(self.phase)) and equals
    caffe_pb2.TRAIN (0)."""
    TRAIN = 0
    TEST = 1

    def __str__(self):
        return self.name


LAYERS = {}          # prototxt type -> {variant name: class}, the plain implementation first

# The types that read quantization_param (caffepy/quantization.py: Intel's int8 layers); on
# another type the field is refused when the net is built, never ignored.
QUANTIZED_TYPES = ("Convolution", "InnerProduct")


def register(cls=None, *, variant=PLAIN):
    """Class decorator: `@register` adds a type's plain implementation under its class name
    (or its `type` attribute), `@register(variant=name)` another implementation of a type
    registered before."""
    def add(cls):
        name = cls.__dict__.get("type") or cls.__name__
        variants = LAYERS.get(name)
        if variant == PLAIN and variants:
            raise RuntimeError(f"layer type '{name}' registered twice")
        if variant != PLAIN and not variants:
            raise RuntimeError(f"layer type '{name}': variant '{variant}' registered before the "
                               f"plain implementation")
        if variant in (variants or {}):
            raise RuntimeError(f"layer type '{name}': variant '{variant}' registered twice")
        cls.type, cls.variant = name, variant
        LAYERS.setdefault(name, {})[variant] = cls
        return cls
    return add if cls is None else add(cls)


class Request(typing.NamedTuple):
    """What the factory knows when it picks an implementation."""
    param: object            # the LayerParameter
    phase: int
    source: str
    bottoms: tuple           # the bottom Blobs (their `layout` decides blocked or not)
    context: object          # the RunContext
    net: object              # the NetParameter the layer belongs to (None outside a Net)


def create_layer(param, phase, source=None, *, bottoms=(), context=SINGLE, net=None, variant=None):
    """The implementation of `param.type` for these bottoms and this run, constructed, with
    `layer.context` set. `variant` names one instead of choosing (tests, benchmarks)."""
    cls = choose(Request(param, phase, source, tuple(bottoms), context, net), variant)
    layer = cls(param, phase, source)
    layer.context = context
    layer.caffe_algorithms = engine.caffe_engine(param, net, source)
    layer.net_param = net
    return layer


def choose(request, variant=None):
    """The class `create_layer` builds for `request` (see the module docstring)."""
    param, source = request.param, request.source
    if param.HasField("quantization_param") and param.type not in QUANTIZED_TYPES:
        raise layer_error(param, "quantization_param", "Intel Caffe's int8 inference quantizes "
                          "Convolution and InnerProduct only", param.type, source=source,
                          hint="Remove quantization_param from this layer")
    variants = LAYERS.get(param.type)
    if variants is None:
        known = ", ".join(sorted(LAYERS))
        lower = {t.lower(): t for t in LAYERS}
        close = difflib.get_close_matches(param.type.lower(), lower, n=1)
        guess = f"did you mean '{lower[close[0]]}'? " if close else ""
        raise layer_error(param, "type", f"unknown layer type '{quote(param.type)}'",
                          hint=f"{guess}Known types: {known}", source=source)
    engine.layer_engine(param, request.net, source)     # checked whether or not a variant asks
    if variant is not None:
        if variant not in variants:
            raise layer_error(param, "type", f"{param.type} has no '{variant}' implementation",
                              hint=f"Its variants: {', '.join(variants)}", source=source)
        return variants[variant]
    pool = _pool(request, variants)
    for cls in pool:
        if cls.variant != PLAIN and cls.wanted(request):
            return cls
    plain = variants[PLAIN]
    if plain in pool:
        return plain
    raise _no_variant(request, layout_of(request.bottoms[0]))


def _pool(request, variants):
    """The implementations that take the layout of `request`'s bottoms."""
    param, source, bottoms = request.param, request.source, request.bottoms
    plain = variants[PLAIN]
    kinds = {layout_of(b) for b in bottoms}
    if plain.layout == OWN or kinds <= {NCHW}:
        return [cls for cls in variants.values() if cls.layout not in (BLOCKED, NHWC)]
    if len(kinds) > 1:
        names = [name for kind, name in ((BLOCKED, "blocked"), (NHWC, "channels-last (NHWC)"),
                                         (NCHW, "plain (NCHW)")) if kind in kinds]
        raise layer_error(param, "bottom", f"mixes {' and '.join(names)} blobs",
                          ", ".join(f"'{b.name}'" for b in bottoms), source=source,
                          hint="Put an IntelPack or IntelUnpack so all bottoms share one layout")
    kind = kinds.pop()
    pool = [cls for cls in variants.values() if cls.layout == kind]
    if not pool and plain.layout == ANY:
        if len({b.layout for b in bottoms}) > 1:
            raise layer_error(param, "bottom", "blocked bottoms differ in channels or width",
                              ", ".join(f"'{b.name}' {b.layout}" for b in bottoms), source=source)
        return [plain]
    if not pool:
        raise _no_variant(request, kind)
    return pool


def takes_layout(request, kind):
    """Whether `request`'s type has an implementation for bottoms in layout `kind` that wants
    this request (the layout plan asks before it converts a layer's bottoms)."""
    variants = LAYERS.get(request.param.type)
    if variants is None:
        return False
    plain = variants[PLAIN]
    if kind == NCHW or plain.layout == ANY:
        return True
    return any(cls.layout == kind and cls.wanted(request) for cls in variants.values())


def _no_variant(request, kind):
    param, bottoms = request.param, request.bottoms
    named = ", ".join(f"'{b.name}'" for b in bottoms)
    if kind != BLOCKED:
        return layer_error(param, "bottom", f"blob {named} is in the {kind} layout and {param.type} "
                           f"has no {kind} implementation for it", bottoms[0].layout,
                           source=request.source)
    known = ", ".join(sorted(name for name, variants in LAYERS.items()
                             if variants[PLAIN].layout == ANY
                             or any(cls.layout == BLOCKED for cls in variants.values())))
    return layer_error(param, "bottom", f"blob {named} is in the SIMD-blocked layout (between "
                       f"IntelPack and IntelUnpack) and {param.type} has no blocked implementation",
                       bottoms[0].layout, hint=f"Put an IntelUnpack before this layer; blocked types: {known}",
                       source=request.source)


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
    # which implementation of its type this is, and the bottom layout it takes (see above)
    variant = PLAIN
    layout = NCHW
    # reshape reads nothing but the shapes of the bottoms, the tops and the layer's own blobs
    # and the layer's settings: the Net skips it while those shapes stay as its last reshape
    # left them (net._reshape)
    reshape_from_shapes = False
    # reshape reads the bottoms' shapes, layouts and buffers (a Split's tops share its bottom's):
    # the Net skips it while no blob has changed any of them (Blob.arrangement)
    reshape_from_blobs = False
    _reshaped_at = _reshaped_arrangement = None
    # the net-compilation rules (caffepy/net_rules.py, by name) this implementation takes part
    # in; it then has the methods that rule calls
    fuses = frozenset()

    @classmethod
    def wanted(cls, request):
        """Whether the factory picks this variant for `request` (a Request) over the plain
        implementation; asked only of variants that take the bottoms' layout."""
        return True

    def __init__(self, param, phase=0, source=None):
        self.param = param
        self.phase = phase
        self.source = source
        self.name = param.name
        self.context = SINGLE       # the run's RunContext; create_layer sets it
        # Caffe's own algorithms asked for (caffepy.engine); create_layer adds the net's engine
        self.caffe_algorithms = engine.caffe_engine(param, None, source)
        # the NetParameter of the net it belongs to (None alone; create_layer sets it), for the
        # net-wide fields a layer honours (Intel's bn_stats_batch_size)
        self.net_param = None
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
        # which bottoms will likely want a gradient, known before setup (the Net sets it; a
        # layer built alone assumes all): what an algorithm trial's backward computes
        self.bottom_need_backward = None

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

    def read_state(self):
        """A layer that reads a source: where it stands in it after the batches its forward
        has handed out, as JSON-able data the solver keeps in its snapshots; None for the rest."""
        return None

    def set_read_state(self, state, ranks=None):
        """Continue from what `read_state` gave (and a snapshot kept): the next forward hands
        out the batch that followed. `ranks`: the number of ranks of the run that saved it
        (None: as many as now). Raises a CaffepyError `<field>: <problem>, got <value>` for a
        state it cannot use."""
        raise NotImplementedError

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
        """What the Net calls once: count check, setup, first reshape; the tops of a
        layout-agnostic layer take its bottoms' layout."""
        self.check_blob_counts(bottom, top)
        self.setup(bottom, top)
        self.reshape(bottom, top)
        if self.layout == ANY and bottom and bottom[0].layout is not None:
            for t in top:
                t.layout = bottom[0].layout

    def __repr__(self):
        return f"<{self.type} layer '{self.name}'>"


def count_from(shape, start, end=None):
    # Python ints (no overflow) and no NumPy call: this runs in every reshape
    return math.prod(int(d) for d in shape[start:end])


def canonical_axis(layer, axis, num_axes, field="axis"):
    """Caffe's CanonicalAxisIndex: negative axes count from the end."""
    if not -num_axes <= axis < num_axes:
        raise layer.error(field, f"out of range for a {num_axes}-axis blob", axis, cls=ShapeError)
    return axis % num_axes
