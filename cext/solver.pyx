# cython: language_level=3
"""Fused parameter updates for caffepy/solvers: one pass over data, diff and history
(normalize by iter_size, weight decay, the rule, data -= step) instead of NumPy's
six to twelve; a 61M-parameter update is memory bound.  Each rule's formula is
the one in caffepy/solvers/updates.py (the NumPy reference; tests/test_solvers.py
checks both agree).  Afterwards diff holds the step, as in Caffe.

Arrays under PARALLEL_MIN elements run on one thread: an OpenMP region costs more
than it saves on them, and far more when ranks oversubscribe the cores.
"""
from cython.parallel cimport prange
from libc.math cimport sqrtf

DEF PARALLEL_MIN = 1 << 20


cdef inline float _sign(float x) noexcept nogil:
    return (x > 0) - (x < 0)


cdef inline float _reg(float w, float g, float norm, float decay, bint l1) noexcept nogil:
    """The normalized, regularized gradient."""
    return norm * g + decay * (_sign(w) if l1 else w)


def regularize(float[::1] w, float[::1] g, float norm, float decay, bint l1):
    """g = norm * g + decay * (sign(w) if l1 else w)."""
    cdef Py_ssize_t i, n = g.shape[0]
    with nogil:
        if n < PARALLEL_MIN:
            for i in range(n):
                g[i] = _reg(w[i], g[i], norm, decay, l1)
        else:
            for i in prange(n, schedule="static"):
                g[i] = _reg(w[i], g[i], norm, decay, l1)


cdef struct Args:
    float norm, decay, lr, momentum, beta2, delta
    bint l1


cdef inline void _sgd(float* w, float* g, float* h, Py_ssize_t i, Args* a) noexcept nogil:
    cdef float gi = _reg(w[i], g[i], a.norm, a.decay, a.l1)
    cdef float hi = a.momentum * h[i] + a.lr * gi
    h[i] = hi
    g[i] = hi
    w[i] = w[i] - hi


cdef inline void _nesterov(float* w, float* g, float* h, Py_ssize_t i, Args* a) noexcept nogil:
    cdef float gi = _reg(w[i], g[i], a.norm, a.decay, a.l1)
    cdef float prev = h[i]
    cdef float hi = a.momentum * prev + a.lr * gi
    cdef float step = (1 + a.momentum) * hi - a.momentum * prev
    h[i] = hi
    g[i] = step
    w[i] = w[i] - step


cdef inline void _adagrad(float* w, float* g, float* h, Py_ssize_t i, Args* a) noexcept nogil:
    cdef float gi = _reg(w[i], g[i], a.norm, a.decay, a.l1)
    cdef float hi = h[i] + gi * gi
    cdef float step = gi / (sqrtf(hi) + a.delta) * a.lr
    h[i] = hi
    g[i] = step
    w[i] = w[i] - step


cdef inline void _rmsprop(float* w, float* g, float* h, Py_ssize_t i, Args* a) noexcept nogil:
    # a.momentum carries rms_decay
    cdef float gi = _reg(w[i], g[i], a.norm, a.decay, a.l1)
    cdef float hi = a.momentum * h[i] + (1 - a.momentum) * (gi * gi)
    cdef float step = gi / (sqrtf(hi) + a.delta) * a.lr
    h[i] = hi
    g[i] = step
    w[i] = w[i] - step


cdef inline void _adadelta(float* w, float* g, float* h, float* h2, Py_ssize_t i, Args* a) noexcept nogil:
    cdef float gi = _reg(w[i], g[i], a.norm, a.decay, a.l1)
    cdef float hi = a.momentum * h[i] + (1 - a.momentum) * (gi * gi)
    cdef float u = gi * sqrtf((h2[i] + a.delta) / (hi + a.delta))
    cdef float step = u * a.lr
    h[i] = hi
    h2[i] = a.momentum * h2[i] + (1 - a.momentum) * (u * u)
    g[i] = step
    w[i] = w[i] - step


cdef inline void _adam(float* w, float* g, float* m, float* v, Py_ssize_t i, Args* a) noexcept nogil:
    # a.momentum = beta1, a.lr = local rate * bias correction
    cdef float gi = _reg(w[i], g[i], a.norm, a.decay, a.l1)
    cdef float mi = a.momentum * m[i] + (1 - a.momentum) * gi
    cdef float vi = a.beta2 * v[i] + (1 - a.beta2) * (gi * gi)
    cdef float step = mi / (sqrtf(vi) + a.delta) * a.lr
    m[i] = mi
    v[i] = vi
    g[i] = step
    w[i] = w[i] - step


cdef enum Rule:
    SGD, NESTEROV, ADAGRAD, RMSPROP, ADADELTA, ADAM

_RULES = {"SGD": SGD, "Nesterov": NESTEROV, "AdaGrad": ADAGRAD, "RMSProp": RMSPROP,
          "AdaDelta": ADADELTA, "Adam": ADAM}


cdef inline void _one(Rule rule, float* w, float* g, float* h, float* h2, Py_ssize_t i,
                      Args* a) noexcept nogil:
    if rule == SGD:
        _sgd(w, g, h, i, a)
    elif rule == NESTEROV:
        _nesterov(w, g, h, i, a)
    elif rule == ADAGRAD:
        _adagrad(w, g, h, i, a)
    elif rule == RMSPROP:
        _rmsprop(w, g, h, i, a)
    elif rule == ADADELTA:
        _adadelta(w, g, h, h2, i, a)
    else:
        _adam(w, g, h, h2, i, a)


def step(str rule_name, float[::1] w, float[::1] g, float[::1] h, float[::1] h2, float norm,
         float decay, bint l1, float lr, float momentum, float beta2=0, float delta=0):
    """One fused update of one parameter with the named rule.  `h2` is the second history
    (AdaDelta, Adam; pass `h` otherwise); RMSProp takes rms_decay as `momentum`, Adam
    takes beta1 as `momentum` and lr already multiplied by its bias correction."""
    cdef Rule rule = _RULES[rule_name]
    cdef Py_ssize_t i, n = g.shape[0]
    cdef Args a
    if n == 0:
        return
    if not (w.shape[0] == n and h.shape[0] == n and h2.shape[0] == n):
        raise ValueError("step: arrays of different sizes")
    a.norm, a.decay, a.l1, a.lr, a.momentum, a.beta2, a.delta = norm, decay, l1, lr, momentum, beta2, delta
    with nogil:
        if n < PARALLEL_MIN:
            for i in range(n):
                _one(rule, &w[0], &g[0], &h[0], &h2[0], i, &a)
        else:
            for i in prange(n, schedule="static"):
                _one(rule, &w[0], &g[0], &h[0], &h2[0], i, &a)
