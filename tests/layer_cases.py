"""Declarative layer tests: a case gives the layer, its inputs and the expected forward;
the gradient check comes free.

    Case("ReLU", "relu_param { negative_slope: 0.1 }", [randn(2, 3, 4, 5)],
         expected=lambda x: [np.where(x > 0, x, 0.1 * x)], kink=0.0)

A case exercises one implementation (variant, caffepy/layer.py) of its type: the plain one by
default; `layout="blocked"` packs the bottoms (NCHW arrays) into the SIMD-blocked layout and
lets the factory choose (the case says which `variant` it expects, "blocked" unless given);
`layout="nhwc"` puts them in the channels-last layout (variant "nhwc" unless given);
`variant=` alone asks the factory for that variant by name, under `context` (a RunContext, or
a function returning one). Forward references stay NCHW: blocked tops are unpacked first.
Each tests/layers/test_<family>.py defines CASES and calls `case_tests(CASES)`;
tests/test_registry.py checks every variant of every differentiable type has a gradient case.
"""
import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng
from caffepy.blob import CHANNELS_LAST, Blob, Blocked
from caffepy.context import SINGLE
from caffepy.kernels.reference.intel import pack as ref_pack, unpack as ref_unpack  # noqa: F401
from caffepy.layer import BLOCKED, NHWC, PLAIN, create_layer
from caffepy.proto import caffe_pb2
from gradient_checker import check_gradient

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def randn(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def distinct(*shape, seed=0):
    # a permutation: no ties, so MAX pooling's argmax is stable under the checker's steps
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n).reshape(shape) * 0.05).astype(np.float32)


def pool_expected(kind, k, s, p, global_pooling=False, floor=False, include_pad=True):
    """A loop over Caffe's pooling windows (for the plain and blocked Pooling cases); AVE divides
    by the window clipped to the padded image, or to the image without include_pad."""
    def expected(x):
        n, c, h, w = x.shape
        kh, kw = (h, w) if global_pooling else k
        def extent(size, kk, ss, pp):
            span = size + 2 * pp - kk
            out = (span // ss if floor else -(-span // ss)) + 1
            if pp and (out - 1) * ss >= size + pp:
                out -= 1
            return out
        oh, ow = extent(h, kh, s[0], p[0]), extent(w, kw, s[1], p[1])
        out = np.zeros((n, c, oh, ow))
        for y in range(oh):
            for xx in range(ow):
                y0, x0 = y * s[0] - p[0], xx * s[1] - p[1]
                y1, x1 = min(y0 + kh, h + p[0]), min(x0 + kw, w + p[1])
                win = x[:, :, max(y0, 0):min(y1, h), max(x0, 0):min(x1, w)]
                size = (y1 - y0) * (x1 - x0) if include_pad else win.shape[2] * win.shape[3]
                out[:, :, y, xx] = win.max(axis=(2, 3)) if kind == "MAX" else win.sum(axis=(2, 3)) / size
        return [out]
    return expected


def blocked_blob(x, width, name="b"):
    b = Blob(name=name)
    b.set_data(ref_pack(np.asarray(x, np.float32), width))
    b.layout = Blocked(width, x.shape[1])
    return b


def nhwc_blob(x, name="b"):
    """A channels-last blob holding the NCHW array x (its data view shows x)."""
    b = Blob(x.shape, name=name)
    b.layout = CHANNELS_LAST
    b.data[...] = x
    return b


def layer_param(type_, params="", name="layer", n_bottom=1, n_top=1):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(params, lp)
    lp.name, lp.type = name, type_
    lp.bottom.extend(f"b{i}" for i in range(n_bottom))
    lp.top.extend(f"t{i}" for i in range(n_top))
    return lp


def make_layer(type_, params="", phase=TRAIN, name="layer", n_bottom=1, n_top=1, bottoms=(),
               context=SINGLE, variant=None):
    lp = layer_param(type_, params, name, n_bottom, n_top)
    return create_layer(lp, phase, bottoms=bottoms, context=context, variant=variant)


def setup_layer(type_, params, bottoms, phase=TRAIN, n_top=1, seed=1701, layout=None,
                context=SINGLE, variant=None):
    """Create a layer over copies of `bottoms` (arrays; packed with layout="blocked") through
    the factory; return (layer, bottom, top)."""
    rng.seed(seed)
    bottom = []
    for i, a in enumerate(bottoms):
        if layout == BLOCKED:
            from caffepy.layers.intel import block_width
            bottom.append(blocked_blob(a, block_width(), f"b{i}"))
        elif layout == NHWC:
            bottom.append(nhwc_blob(np.asarray(a, np.float32), f"b{i}"))
        else:
            b = Blob(name=f"b{i}")
            b.set_data(a)
            bottom.append(b)
    layer = make_layer(type_, params, phase, n_bottom=len(bottoms), n_top=n_top, bottoms=bottom,
                       context=context, variant=variant)
    top = [Blob(name=f"t{i}") for i in range(n_top)]
    layer.layer_setup(bottom, top)
    return layer, bottom, top


def _nchw(blob):
    return ref_unpack(blob.data, blob.layout.channels) if isinstance(blob.layout, Blocked) else blob.data


class Case:
    def __init__(self, type_, params="", bottoms=(), expected=None, phase=TRAIN, n_top=1,
                 check_bottom=None, check_params=True, grad=True, eps=1e-2, threshold=1e-3,
                 kink=None, kink_range=-1.0, init=None, atol=1e-5, rtol=1e-4, id=None, max_checks=150,
                 layout=None, variant=None, context=None, top_weights=None):
        self.type, self.params, self.bottoms = type_, params, [np.asarray(b) for b in bottoms]
        self.expected, self.phase, self.n_top = expected, phase, n_top
        self.check_bottom, self.check_params, self.grad = check_bottom, check_params, grad
        self.eps, self.threshold, self.kink, self.kink_range = eps, threshold, kink, kink_range
        self.init, self.atol, self.rtol, self.max_checks = init, atol, rtol, max_checks
        self.layout, self.context = layout, context
        self.top_weights = top_weights      # top -> the checker's top weights (default: random)
        self.variant = variant or (layout if layout in (BLOCKED, NHWC) else PLAIN)
        tag = "" if self.variant == PLAIN else f"[{self.variant}]"
        self.id = id or f"{type_}{tag}:{params.strip()[:40]}"

    def build(self):
        context = self.context() if callable(self.context) else (self.context or SINGLE)
        # a variant the layout does not decide is asked for by name
        forced = self.variant if self.layout is None and self.variant != PLAIN else None
        layer, bottom, top = setup_layer(self.type, self.params, self.bottoms, self.phase, self.n_top,
                                         layout=self.layout, context=context, variant=forced)
        assert layer.variant == self.variant, \
            f"{self.id}: the factory chose the {layer.variant} variant, the case is for {self.variant}"
        if self.init:
            self.init(layer)
        return layer, bottom, top

    def check_forward(self):
        if self.expected is None:
            pytest.skip("no forward reference for this case")
        layer, bottom, top = self.build()
        rng.seed(1701)
        layer.reshape(bottom, top)     # as the Net does before every forward
        layer.forward(bottom, top)
        want = self.expected(*[b.astype(np.float64) for b in self.bottoms], layer=layer) \
            if _takes_layer(self.expected) else self.expected(*[b.astype(np.float64) for b in self.bottoms])
        assert len(want) == len(top), f"{self.id}: expected {len(want)} tops, layer made {len(top)}"
        for i, (t, w) in enumerate(zip(top, want)):
            w = np.asarray(w)
            got = _nchw(t) if self.layout == BLOCKED else t.data
            assert got.shape == w.shape, f"{self.id}: top[{i}] shape {got.shape} != expected {w.shape}"
            np.testing.assert_allclose(got, w, rtol=self.rtol, atol=self.atol,
                                       err_msg=f"{self.id}: top[{i}]")

    def check_gradient(self):
        if not self.grad:
            pytest.skip("no gradient for this case")
        layer, bottom, top = self.build()
        check_gradient(layer, bottom, top, self.check_bottom, self.check_params, self.eps,
                       self.threshold, self.kink, self.kink_range, max_checks=self.max_checks,
                       top_weights=self.top_weights(top) if self.top_weights else _lane_weights(top))

    def __repr__(self):
        return self.id


def _lane_weights(top):
    """For blocked tops: the checker's random top weights, zero in the padding lanes (no layer
    writes them, and the kernels' backward may route their diffs as if they were real)."""
    if not any(isinstance(t.layout, Blocked) for t in top):
        return None
    gen = np.random.default_rng(1701)
    weights = []
    for t in top:
        w = gen.standard_normal(t.shape)
        if isinstance(t.layout, Blocked):
            w *= ref_pack(np.ones((1, t.layout.channels, 1, 1)), t.layout.width)
        weights.append(w)
    return weights


def _takes_layer(fn):
    import inspect
    try:
        return "layer" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def case_tests(cases):
    """Two parametrized tests (forward, gradient) for a module's CASES."""
    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test_forward(case):
        case.check_forward()

    @pytest.mark.parametrize("case", [c for c in cases if c.grad], ids=[c.id for c in cases if c.grad])
    def test_gradient(case):
        case.check_gradient()

    return test_forward, test_gradient
