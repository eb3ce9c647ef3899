"""caffepy.kernels.solver against the NumPy references in caffepy.kernels.reference.solver, one
parameter at a time, on one thread and above the size that threads the update."""
import numpy as np
import pytest

from caffepy.kernels.reference import solver as ref

solver = pytest.importorskip("caffepy.kernels.solver")

SIZES = [1000, 3 * 65536 + 7]
# (rule, momentum, beta2, delta, lr): RMSProp's rms_decay and Adam's beta1 come as momentum
RULES = [("SGD", 0.9, 0.0, 0.0, 0.01), ("Nesterov", 0.9, 0.0, 0.0, 0.01),
         ("AdaGrad", 0.0, 0.0, 1e-8, 0.01), ("RMSProp", 0.98, 0.0, 1e-8, 0.01),
         ("AdaDelta", 0.95, 0.0, 1e-6, 1.0), ("Adam", 0.9, 0.999, 1e-8, 0.001)]


def arrays(n, seed):
    gen = np.random.default_rng(seed)
    w, g = gen.standard_normal(n, np.float32), gen.standard_normal(n, np.float32) * 0.1
    h, h2 = (np.abs(gen.standard_normal(n, np.float32)) * 0.01 for _ in range(2))
    return w, g, h, h2


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("l1", [False, True])
def test_regularize(n, l1):
    w, g, _, _ = arrays(n, 1)
    want = ref.regularize(w, g, 0.5, 0.01, l1)
    solver.regularize(w, g, 0.5, 0.01, l1)
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rule,momentum,beta2,delta,lr", RULES, ids=[r[0] for r in RULES])
def test_step(n, rule, momentum, beta2, delta, lr):
    w, g, h, h2 = arrays(n, 2)
    want = ref.step(rule, w, g, h, h2, 0.5, 0.0005, False, lr, momentum, beta2, delta)
    solver.step(rule, w, g, h, h2, 0.5, 0.0005, False, lr, momentum, beta2, delta)
    for got, expected in zip((w, g, h, h2), want):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", SIZES + [37])
@pytest.mark.parametrize("rule,momentum,beta2,delta,lr", RULES, ids=[r[0] for r in RULES])
def test_step_keeps_the_values_from_before(n, rule, momentum, beta2, delta, lr):
    """keep_w, keep_h (and keep_h2) receive w, h (h2) as they were before the update, and the
    update itself is the one without them, bit for bit; a keep buffer that starts off a
    vector boundary (the streaming stores' aligned part shifts) gets the same."""
    w, g, h, h2 = arrays(n, 3)
    before = [a.copy() for a in (w, h, h2)]
    plain = [a.copy() for a in (w, g, h, h2)]
    solver.step(rule, *plain, 0.5, 0.0005, False, lr, momentum, beta2, delta)
    two = rule in ("AdaDelta", "Adam")
    backing = np.full(3 * (n + 1), np.nan, np.float32)
    kw, kh, kh2 = (backing[1 + k * (n + 1):1 + k * (n + 1) + n] for k in range(3))
    solver.step(rule, w, g, h, h2 if two else h, 0.5, 0.0005, False, lr, momentum, beta2, delta,
                keep_w=kw, keep_h=kh, keep_h2=kh2 if two else None)
    got = (w, g, h, h2) if two else (w, g, h)
    for a, b in zip(got, plain):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kw, before[0])
    np.testing.assert_array_equal(kh, before[1])
    if two:
        np.testing.assert_array_equal(kh2, before[2])
    else:
        assert np.isnan(kh2).all()


def test_step_keep_needs_both_and_matching_shapes():
    w, g, h, _ = arrays(100, 4)
    with pytest.raises(ValueError, match="keep_h"):
        solver.step("SGD", w, g, h, h, 1.0, 0.0, False, 0.1, 0.9, keep_w=np.empty(100, np.float32))
    with pytest.raises(ValueError, match="keep_w"):
        solver.step("SGD", w, g, h, h, 1.0, 0.0, False, 0.1, 0.9, keep_w=np.empty(99, np.float32),
                    keep_h=np.empty(100, np.float32))
