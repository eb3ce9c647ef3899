# cython: language_level=3
"""Fused parameter updates for caffepy/solvers: one pass over data, diff and history
instead of NumPy's six (the update of a 61M-parameter net is memory bound).

Arrays under PARALLEL_MIN elements run on one thread: an OpenMP region costs more
than it saves on them, and far more when ranks oversubscribe the cores.

NumPy references: caffepy/solvers/updates.py (tests/test_solvers.py checks both agree).
"""
from cython.parallel cimport prange

DEF PARALLEL_MIN = 1 << 20


cdef inline float _sign(float x) noexcept nogil:
    return (x > 0) - (x < 0)


def regularize(float[::1] w, float[::1] g, float norm, float decay, bint l1):
    """g = norm * g + decay * (sign(w) if l1 else w)."""
    cdef Py_ssize_t i, n = g.shape[0]
    with nogil:
        if n < PARALLEL_MIN:
            for i in range(n):
                g[i] = norm * g[i] + decay * (_sign(w[i]) if l1 else w[i])
        else:
            for i in prange(n, schedule="static"):
                g[i] = norm * g[i] + decay * (_sign(w[i]) if l1 else w[i])


cdef inline void _sgd(float* w, float* g, float* h, Py_ssize_t i, float norm, float decay, bint l1,
                      float lr, float momentum) noexcept nogil:
    cdef float x = w[i]
    cdef float gi = norm * g[i] + decay * (_sign(x) if l1 else x)
    cdef float hi = momentum * h[i] + lr * gi
    h[i] = hi
    g[i] = hi
    w[i] = x - hi


def sgd_step(float[::1] w, float[::1] g, float[::1] h, float norm, float decay, bint l1,
             float lr, float momentum):
    """Caffe's SGD update for one parameter, fused:
    g = norm * g + decay * (sign(w) | w);  h = momentum * h + lr * g;  g = h;  w -= h."""
    cdef Py_ssize_t i, n = g.shape[0]
    if n == 0:
        return
    with nogil:
        if n < PARALLEL_MIN:
            for i in range(n):
                _sgd(&w[0], &g[0], &h[0], i, norm, decay, l1, lr, momentum)
        else:
            for i in prange(n, schedule="static"):
                _sgd(&w[0], &g[0], &h[0], i, norm, decay, l1, lr, momentum)
