# cython: language_level=3
"""Fused parameter updates for caffepy/solvers: one pass over data, diff and history
(normalize by iter_size, weight decay, the rule, data -= step) instead of NumPy's
six to twelve; a 61M-parameter update is memory bound.  Each rule's formula is
the one in caffepy/solvers/updates.py (the NumPy path of the solver).  The NumPy
references of these kernels are in caffepy/kernels/reference/solver.py
(tests/test_kernels_solver.py); tests/test_solvers.py checks that training with
and without them agrees.  Afterwards diff holds the step, as in Caffe.

Every rule is its own loop over plain scalars, so GCC vectorizes it (sqrt and
division included).  Small arrays run on one thread (the thread rule of rules.pxd):
an OpenMP region costs more than it saves on them, and far more when ranks
oversubscribe the cores.
"""
from cython.parallel cimport prange
from libc.math cimport sqrtf

from rules cimport dims, need, need_shape, threads_for


cdef extern from *:
    """
    #include <stdint.h>
    #ifdef __AVX__
    #include <immintrin.h>
    #endif
    /* dst[0 .. n) = src[0 .. n) with streaming stores where aligned: the copy is not read
       again soon, so it passes the caches by and costs no read of dst's lines */
    static void caffepy_stream_copy(float *dst, const float *src, Py_ssize_t n)
    {
        Py_ssize_t i = 0;
    #ifdef __AVX__
        for (; i < n && ((uintptr_t)(dst + i) & 31); i++)
            dst[i] = src[i];
        for (; i + 8 <= n; i += 8)
            _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    #endif
        for (; i < n; i++)
            dst[i] = src[i];
    }
    static void caffepy_store_fence(void)
    {
    #ifdef __AVX__
        _mm_sfence();
    #endif
    }
    """
    void caffepy_stream_copy(float* dst, const float* src, Py_ssize_t n) noexcept nogil
    void caffepy_store_fence() noexcept nogil


cdef inline float _reg(float w, float g, float norm, float decay, bint l1) noexcept nogil:
    """The normalized, regularized gradient."""
    if l1:
        return norm * g + decay * <float>((w > 0) - (w < 0))
    return norm * g + decay * w


def regularize(float[::1] w, float[::1] g, float norm, float decay, bint l1):
    """g = norm * g + decay * (sign(w) if l1 else w)."""
    cdef Py_ssize_t i, n = g.shape[0]
    cdef int nt = threads_for(n)
    need_shape("regularize", "w", dims(w.shape, 1), (n,))
    if n == 0:
        return
    with nogil:
        if nt == 1:
            for i in range(n):
                g[i] = _reg(w[i], g[i], norm, decay, l1)
        else:
            for i in prange(n, schedule="static", num_threads=nt):
                g[i] = _reg(w[i], g[i], norm, decay, l1)


cdef void _sgd(float* w, float* g, float* h, Py_ssize_t lo, Py_ssize_t hi_, float norm, float decay,
               bint l1, float lr, float mom) noexcept nogil:
    cdef Py_ssize_t i
    cdef float gi, hi
    for i in range(lo, hi_):
        gi = _reg(w[i], g[i], norm, decay, l1)
        hi = mom * h[i] + lr * gi
        h[i] = hi
        g[i] = hi
        w[i] = w[i] - hi


cdef void _nesterov(float* w, float* g, float* h, Py_ssize_t lo, Py_ssize_t hi_, float norm, float decay,
                    bint l1, float lr, float mom) noexcept nogil:
    cdef Py_ssize_t i
    cdef float gi, prev, hi, s
    for i in range(lo, hi_):
        gi = _reg(w[i], g[i], norm, decay, l1)
        prev = h[i]
        hi = mom * prev + lr * gi
        s = (1 + mom) * hi - mom * prev
        h[i] = hi
        g[i] = s
        w[i] = w[i] - s


cdef void _adagrad(float* w, float* g, float* h, Py_ssize_t lo, Py_ssize_t hi_, float norm, float decay,
                   bint l1, float lr, float delta) noexcept nogil:
    cdef Py_ssize_t i
    cdef float gi, hi, s
    for i in range(lo, hi_):
        gi = _reg(w[i], g[i], norm, decay, l1)
        hi = h[i] + gi * gi
        s = gi / (sqrtf(hi) + delta) * lr
        h[i] = hi
        g[i] = s
        w[i] = w[i] - s


cdef void _rmsprop(float* w, float* g, float* h, Py_ssize_t lo, Py_ssize_t hi_, float norm, float decay,
                   bint l1, float lr, float rms, float delta) noexcept nogil:
    cdef Py_ssize_t i
    cdef float gi, hi, s
    for i in range(lo, hi_):
        gi = _reg(w[i], g[i], norm, decay, l1)
        hi = rms * h[i] + (1 - rms) * (gi * gi)
        s = gi / (sqrtf(hi) + delta) * lr
        h[i] = hi
        g[i] = s
        w[i] = w[i] - s


cdef void _adadelta(float* w, float* g, float* h, float* h2, Py_ssize_t lo, Py_ssize_t hi_, float norm,
                    float decay, bint l1, float lr, float mom, float delta) noexcept nogil:
    cdef Py_ssize_t i
    cdef float gi, hi, u, s
    for i in range(lo, hi_):
        gi = _reg(w[i], g[i], norm, decay, l1)
        hi = mom * h[i] + (1 - mom) * (gi * gi)
        u = gi * sqrtf((h2[i] + delta) / (hi + delta))
        s = u * lr
        h[i] = hi
        h2[i] = mom * h2[i] + (1 - mom) * (u * u)
        g[i] = s
        w[i] = w[i] - s


cdef void _adam(float* w, float* g, float* m, float* v, Py_ssize_t lo, Py_ssize_t hi_, float norm,
                float decay, bint l1, float lr, float beta1, float beta2, float delta) noexcept nogil:
    cdef Py_ssize_t i
    cdef float gi, mi, vi, s
    for i in range(lo, hi_):
        gi = _reg(w[i], g[i], norm, decay, l1)
        mi = beta1 * m[i] + (1 - beta1) * gi
        vi = beta2 * v[i] + (1 - beta2) * (gi * gi)
        s = mi / (sqrtf(vi) + delta) * lr
        m[i] = mi
        v[i] = vi
        g[i] = s
        w[i] = w[i] - s


cdef enum:
    SGD, NESTEROV, ADAGRAD, RMSPROP, ADADELTA, ADAM

_RULES = {"SGD": SGD, "Nesterov": NESTEROV, "AdaGrad": ADAGRAD, "RMSProp": RMSPROP,
          "AdaDelta": ADADELTA, "Adam": ADAM}

DEF CHUNK = 1 << 16


cdef void _range(int rule, float* w, float* g, float* h, float* h2, Py_ssize_t lo, Py_ssize_t hi_,
                 float norm, float decay, bint l1, float lr, float mom, float beta2,
                 float delta) noexcept nogil:
    if rule == SGD:
        _sgd(w, g, h, lo, hi_, norm, decay, l1, lr, mom)
    elif rule == NESTEROV:
        _nesterov(w, g, h, lo, hi_, norm, decay, l1, lr, mom)
    elif rule == ADAGRAD:
        _adagrad(w, g, h, lo, hi_, norm, decay, l1, lr, delta)
    elif rule == RMSPROP:
        _rmsprop(w, g, h, lo, hi_, norm, decay, l1, lr, mom, delta)
    elif rule == ADADELTA:
        _adadelta(w, g, h, h2, lo, hi_, norm, decay, l1, lr, mom, delta)
    else:
        _adam(w, g, h, h2, lo, hi_, norm, decay, l1, lr, mom, beta2, delta)


cdef void _chunk(int rule, float* w, float* g, float* h, float* h2, float* kw, float* kh,
                 float* kh2, Py_ssize_t lo, Py_ssize_t hi_, float norm, float decay, bint l1,
                 float lr, float mom, float beta2, float delta) noexcept nogil:
    """_range, first keeping w, h (and h2) of [lo, hi_) in kw, kh (kh2) when kw is not NULL:
    the update then reads the chunk from cache, so the copy costs its stores alone."""
    if kw != NULL:
        caffepy_stream_copy(kw + lo, w + lo, hi_ - lo)
        caffepy_stream_copy(kh + lo, h + lo, hi_ - lo)
        if kh2 != NULL:
            caffepy_stream_copy(kh2 + lo, h2 + lo, hi_ - lo)
        caffepy_store_fence()       # streaming stores are weakly ordered: visible before the update
    _range(rule, w, g, h, h2, lo, hi_, norm, decay, l1, lr, mom, beta2, delta)


def step(str rule_name, float[::1] w, float[::1] g, float[::1] h, float[::1] h2, float norm,
         float decay, bint l1, float lr, float momentum, float beta2=0, float delta=0,
         float[::1] keep_w=None, float[::1] keep_h=None, float[::1] keep_h2=None):
    """One fused update of one parameter with the named rule.  `h2` is the second history
    (AdaDelta, Adam; pass `h` otherwise); RMSProp takes rms_decay as `momentum`, Adam
    takes beta1 as `momentum` and lr already multiplied by its bias correction.
    With `keep_w` and `keep_h` (and `keep_h2` for a second history) the values of w, h (h2)
    before the update are written there in the same pass (the emergency snapshot's copy of
    a parameter updated before every gradient arrived: parallel/failsafe.py)."""
    cdef int rule = _RULES[rule_name]
    cdef Py_ssize_t c, n = g.shape[0], chunks
    cdef int nt = threads_for(n)
    need_shape("step", "w", dims(w.shape, 1), (n,))
    need_shape("step", "h", dims(h.shape, 1), (n,))
    need_shape("step", "h2", dims(h2.shape, 1), (n,))
    cdef bint keeping = keep_w is not None
    if keeping:
        need(keep_h is not None, "step", "keep_h", "must be given with keep_w", None)
        need_shape("step", "keep_w", dims(keep_w.shape, 1), (n,))
        need_shape("step", "keep_h", dims(keep_h.shape, 1), (n,))
        if keep_h2 is not None:
            need_shape("step", "keep_h2", dims(keep_h2.shape, 1), (n,))
    if n == 0:
        return
    cdef float* pw = &w[0]
    cdef float* pg = &g[0]
    cdef float* ph = &h[0]
    cdef float* ph2 = &h2[0]
    cdef float* kw = &keep_w[0] if keeping else NULL
    cdef float* kh = &keep_h[0] if keeping else NULL
    cdef float* kh2 = &keep_h2[0] if keeping and keep_h2 is not None else NULL
    with nogil:
        if nt == 1 and not keeping:
            _range(rule, pw, pg, ph, ph2, 0, n, norm, decay, l1, lr, momentum, beta2, delta)
        else:
            # chunks, each a plain vectorizable loop (and a cache-sized copy when keeping)
            chunks = (n + CHUNK - 1) // CHUNK
            if nt == 1:
                for c in range(chunks):
                    _chunk(rule, pw, pg, ph, ph2, kw, kh, kh2, c * CHUNK, min((c + 1) * CHUNK, n),
                           norm, decay, l1, lr, momentum, beta2, delta)
            else:
                for c in prange(chunks, schedule="static", num_threads=nt):
                    _chunk(rule, pw, pg, ph, ph2, kw, kh, kh2, c * CHUNK, min((c + 1) * CHUNK, n),
                           norm, decay, l1, lr, momentum, beta2, delta)
