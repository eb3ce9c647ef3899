# cython: language_level=3
"""Fused parameter updates for caffepy/solvers: one pass over data, diff and history
instead of NumPy's six (the update of a 61M-parameter net is memory bound).

NumPy references: caffepy/solvers/updates.py (tests/test_solvers.py checks both agree).
"""
from cython.parallel cimport prange


def regularize(float[::1] w, float[::1] g, float norm, float decay, bint l1):
    """g = norm * g + decay * (sign(w) if l1 else w)."""
    cdef Py_ssize_t i, n = g.shape[0]
    cdef float x
    with nogil:
        if l1:
            for i in prange(n, schedule="static"):
                x = w[i]
                g[i] = norm * g[i] + decay * ((x > 0) - (x < 0))
        else:
            for i in prange(n, schedule="static"):
                g[i] = norm * g[i] + decay * w[i]


def sgd_step(float[::1] w, float[::1] g, float[::1] h, float norm, float decay, bint l1,
             float lr, float momentum):
    """Caffe's SGD update for one parameter, fused:
    g = norm * g + decay * (sign(w) | w);  h = momentum * h + lr * g;  g = h;  w -= h."""
    cdef Py_ssize_t i, n = g.shape[0]
    cdef float x, gi, hi
    with nogil:
        for i in prange(n, schedule="static"):
            x = w[i]
            if l1:
                gi = norm * g[i] + decay * ((x > 0) - (x < 0))
            else:
                gi = norm * g[i] + decay * x
            hi = momentum * h[i] + lr * gi
            h[i] = hi
            g[i] = hi
            w[i] = x - hi
