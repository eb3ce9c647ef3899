# cython: language_level=3
# distutils: extra_compile_args = -fno-trapping-math
"""Kernels of the elementwise neuron layers where NumPy would need several passes.

Every kernel takes flat float32 C-contiguous arrays, writes into buffers the caller allocated
(an output may be the same buffer as an input: the layers run in place) and runs without the GIL.
The work is split over OpenMP threads in contiguous chunks; each chunk runs a plain pointer loop
in a small inline function, the shape GCC vectorizes. The NumPy references are in
tests/layers/test_neuron.py.
"""

from cython.parallel cimport prange
cimport openmp
from libc.math cimport expm1f


# Below this many elements one thread is faster than waking the team.
DEF SERIAL_BELOW = 65536
DEF CHUNK = 16384


cdef inline int _threads(Py_ssize_t n) noexcept nogil:
    return 1 if n < SERIAL_BELOW else openmp.omp_get_max_threads()


# -- chunk loops ---------------------------------------------------------------------------------
# -fno-trapping-math (top of file) lets GCC turn `a if c else b` into a vector blend: nothing here
# reads the floating-point exception flags, and a data-dependent branch mispredicts half the time.
# Constants are typed float so no step is promoted to double.
cdef float ONE = 1


cdef inline void _relu_f(const float* x, float* y, Py_ssize_t n, float slope) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = x[i] if x[i] > 0 else x[i] * slope


cdef inline void _relu_b(const float* x, const float* g, float* d, Py_ssize_t n,
                         float slope) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = g[i] if x[i] > 0 else g[i] * slope


cdef inline void _elu_f(const float* x, float* y, Py_ssize_t n, float alpha) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = x[i] if x[i] > 0 else alpha * expm1f(x[i])


cdef inline void _elu_b(const float* x, const float* y, const float* g, float* d, Py_ssize_t n,
                        float alpha) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = g[i] if x[i] > 0 else g[i] * (y[i] + alpha)


cdef inline void _sigmoid_b(const float* y, const float* g, float* d, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = g[i] * y[i] * (ONE - y[i])


cdef inline void _tanh_b(const float* y, const float* g, float* d, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = g[i] * (ONE - y[i] * y[i])


cdef inline void _swish_b(const float* y, const float* s, const float* g, float* d, Py_ssize_t n,
                          float beta) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = g[i] * (beta * y[i] + s[i] * (ONE - beta * y[i]))


cdef inline void _dropout_f(const float* x, float* m, float* y, Py_ssize_t n, float ratio,
                            float scale) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        m[i] = scale if m[i] >= ratio else 0
        y[i] = x[i] * m[i]


# -- entry points --------------------------------------------------------------------------------
def relu_forward(const float[::1] x, float[::1] y, float negative_slope):
    """y = x if x > 0 else negative_slope * x."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _relu_f(&x[lo], &y[lo], min(CHUNK, n - lo), negative_slope)


def relu_backward(const float[::1] x, const float[::1] dy, float[::1] dx, float negative_slope):
    """dx = dy * (1 if x > 0 else negative_slope); `x` may be the top (same sign for slope >= 0)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _relu_b(&x[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo), negative_slope)


def elu_forward(const float[::1] x, float[::1] y, float alpha):
    """y = x if x > 0 else alpha * (exp(x) - 1); expm1 keeps small negative x exact."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _elu_f(&x[lo], &y[lo], min(CHUNK, n - lo), alpha)


def elu_backward(const float[::1] x, const float[::1] y, const float[::1] dy, float[::1] dx,
                 float alpha):
    """dx = dy if x > 0 else dy * (y + alpha); `x` may be the top (same sign for alpha > 0)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _elu_b(&x[lo], &y[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo), alpha)


def sigmoid_backward(const float[::1] y, const float[::1] dy, float[::1] dx):
    """dx = dy * y * (1 - y)."""
    cdef Py_ssize_t n = y.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _sigmoid_b(&y[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo))


def tanh_backward(const float[::1] y, const float[::1] dy, float[::1] dx):
    """dx = dy * (1 - y^2)."""
    cdef Py_ssize_t n = y.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _tanh_b(&y[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo))


def swish_backward(const float[::1] y, const float[::1] s, const float[::1] dy, float[::1] dx,
                   float beta):
    """dx = dy * (beta * y + s * (1 - beta * y)) with s = sigmoid(beta * x) saved by forward."""
    cdef Py_ssize_t n = y.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _swish_b(&y[lo], &s[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo), beta)


def dropout_forward(const float[::1] x, float[::1] mask, float[::1] y, float ratio, float scale):
    """`mask` holds uniform [0, 1) draws on entry and scale * (u >= ratio) on exit; y = x * mask.

    Keeping u >= ratio keeps each unit with probability 1 - ratio (Caffe's Bernoulli mask).
    """
    cdef Py_ssize_t n = x.shape[0], c, lo
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=_threads(n)):
        lo = c * CHUNK
        _dropout_f(&x[lo], &mask[lo], &y[lo], min(CHUNK, n - lo), ratio, scale)


# -- PReLU: a slope per channel over (num, channels, inner) views ---------------------------------
cdef inline void _prelu_f(const float* x, float* y, Py_ssize_t n, float a) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = x[i] if x[i] > 0 else x[i] * a


cdef inline double _prelu_b(const float* x, const float* g, float* d, Py_ssize_t n, float a,
                            bint want_dx) noexcept nogil:
    """dx over one plane (when wanted); returns the plane's sum of x * dy over x <= 0."""
    cdef Py_ssize_t i
    cdef float acc = 0
    for i in range(n):
        acc = acc + (x[i] * g[i] if x[i] <= 0 else 0)
    if want_dx:
        for i in range(n):
            d[i] = g[i] if x[i] > 0 else g[i] * a
    return acc


def prelu_forward(const float[:, :, ::1] x, float[:, :, ::1] y, const float[::1] slope):
    """y[n, c, :] = x if x > 0 else slope[c] * x."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], inner = x.shape[2], c, n
    if N == 0 or C == 0 or inner == 0:
        return
    for c in prange(C, nogil=True, schedule="static", num_threads=_threads(N * C * inner)):
        for n in range(N):
            _prelu_f(&x[n, c, 0], &y[n, c, 0], inner, slope[c])


def prelu_backward(const float[:, :, ::1] x, const float[:, :, ::1] dy, float[:, :, ::1] dx,
                   const float[::1] slope, double[::1] slope_diff):
    """dx = dy if x > 0 else slope[c] * dy (skipped when dx is None); slope_diff[c] (float64)
    gets the sum of x * dy over x <= 0 added (skipped when None). dx may be dy."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], inner = x.shape[2], c, n
    cdef bint want_dx = dx is not None, want_slope = slope_diff is not None
    cdef double acc
    cdef float* d
    if N == 0 or C == 0 or inner == 0:
        return
    for c in prange(C, nogil=True, schedule="static", num_threads=_threads(N * C * inner)):
        acc = 0
        for n in range(N):
            d = &dx[n, c, 0] if want_dx else NULL
            acc = acc + _prelu_b(&x[n, c, 0], &dy[n, c, 0], d, inner, slope[c], want_dx)
        if want_slope:
            slope_diff[c] += acc
