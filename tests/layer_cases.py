"""Declarative layer tests: a case gives the layer, its inputs and the expected forward;
the gradient check comes free.

    Case("ReLU", "relu_param { negative_slope: 0.1 }", [randn(2, 3, 4, 5)],
         expected=lambda x: [np.where(x > 0, x, 0.1 * x)], kink=0.0)

Each tests/layers/test_<family>.py defines CASES and calls `case_tests(CASES)`;
tests/test_registry.py checks every differentiable layer type has a gradient case.
"""
import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng
from caffepy.blob import Blob
from caffepy.layer import create_layer
from caffepy.proto import caffe_pb2
from gradient_checker import check_gradient

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def randn(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def make_layer(type_, params="", phase=TRAIN, name="layer", n_bottom=1, n_top=1):
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(params, lp)
    lp.name, lp.type = name, type_
    lp.bottom.extend(f"b{i}" for i in range(n_bottom))
    lp.top.extend(f"t{i}" for i in range(n_top))
    return create_layer(lp, phase)


def setup_layer(type_, params, bottoms, phase=TRAIN, n_top=1, seed=1701):
    """Create a layer over copies of `bottoms` (arrays); return (layer, bottom, top)."""
    rng.seed(seed)
    layer = make_layer(type_, params, phase, n_bottom=len(bottoms), n_top=n_top)
    bottom = []
    for i, a in enumerate(bottoms):
        b = Blob(name=f"b{i}")
        b.set_data(a)
        bottom.append(b)
    top = [Blob(name=f"t{i}") for i in range(n_top)]
    layer.layer_setup(bottom, top)
    return layer, bottom, top


class Case:
    def __init__(self, type_, params="", bottoms=(), expected=None, phase=TRAIN, n_top=1,
                 check_bottom=None, check_params=True, grad=True, eps=1e-2, threshold=1e-3,
                 kink=None, kink_range=-1.0, init=None, atol=1e-5, rtol=1e-4, id=None, max_checks=150):
        self.type, self.params, self.bottoms = type_, params, [np.asarray(b) for b in bottoms]
        self.expected, self.phase, self.n_top = expected, phase, n_top
        self.check_bottom, self.check_params, self.grad = check_bottom, check_params, grad
        self.eps, self.threshold, self.kink, self.kink_range = eps, threshold, kink, kink_range
        self.init, self.atol, self.rtol, self.max_checks = init, atol, rtol, max_checks
        self.id = id or f"{type_}:{params.strip()[:40]}"

    def build(self):
        layer, bottom, top = setup_layer(self.type, self.params, self.bottoms, self.phase, self.n_top)
        if self.init:
            self.init(layer)
        return layer, bottom, top

    def check_forward(self):
        if self.expected is None:
            pytest.skip("no forward reference for this case")
        layer, bottom, top = self.build()
        rng.seed(1701)
        layer.forward(bottom, top)
        want = self.expected(*[b.astype(np.float64) for b in self.bottoms], layer=layer) \
            if _takes_layer(self.expected) else self.expected(*[b.astype(np.float64) for b in self.bottoms])
        assert len(want) == len(top), f"{self.id}: expected {len(want)} tops, layer made {len(top)}"
        for i, (t, w) in enumerate(zip(top, want)):
            w = np.asarray(w)
            assert t.shape == w.shape, f"{self.id}: top[{i}] shape {t.shape} != expected {w.shape}"
            np.testing.assert_allclose(t.data, w, rtol=self.rtol, atol=self.atol,
                                       err_msg=f"{self.id}: top[{i}]")

    def check_gradient(self):
        if not self.grad:
            pytest.skip("no gradient for this case")
        layer, bottom, top = self.build()
        check_gradient(layer, bottom, top, self.check_bottom, self.check_params, self.eps,
                       self.threshold, self.kink, self.kink_range, max_checks=self.max_checks)

    def __repr__(self):
        return self.id


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
