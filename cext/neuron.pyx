# cython: language_level=3
# distutils: extra_compile_args = -fno-trapping-math
"""Kernels of the elementwise neuron layers where NumPy would need several passes.

Every kernel takes flat float32 C-contiguous arrays, writes into buffers the caller allocated
(an output may be the same buffer as an input: the layers run in place) and runs without the GIL.
The work is split over OpenMP threads in contiguous chunks; each chunk runs a plain pointer loop
in a small inline function, the shape GCC vectorizes. The NumPy references are in
caffepy/kernels/reference/neuron.py.
"""

from cython.parallel cimport prange
from libc.math cimport floorf
from libc.string cimport memcpy
from libc.stdint cimport int32_t

from rules cimport dims, need, need_shape, threads_for

DEF CHUNK = 16384


cdef inline int _same_size(str kernel, str name, Py_ssize_t got, Py_ssize_t n) except -1:
    """Every flat array of a kernel holds its first array's n values."""
    if got != n:
        need_shape(kernel, name, (got,), (n,))
    return 0


# -- chunk loops ---------------------------------------------------------------------------------
# -fno-trapping-math (top of file) lets GCC turn `a if c else b` into a vector blend: nothing here
# reads the floating-point exception flags, and a data-dependent branch mispredicts half the time.
# Constants are typed float so no step is promoted to double.
cdef float ONE = 1


# -- exp without a libm call, so loops over it vectorize --------------------------------------------
# Cody-Waite reduction x = k ln2 + r (ln2 split in a part exact in float and a correction), a
# degree-6 polynomial for e^r on |r| <= ln2/2 (Cephes' expf coefficients), and 2^k built in the
# exponent bits. Within 2 ulp of expf over the clamped range [-87.3, 88.3], which keeps 2^k a
# normal float: below it the result is ~1e-38 instead of a denormal or 0, above it ~2e38
# instead of inf.
cdef union _Bits:
    float f
    int32_t i

cdef float EXP_LO = -87.3
cdef float EXP_HI = 88.3
cdef float LOG2E = 1.44269504088896341
cdef float LN2_HI = 0.693359375
cdef float LN2_LO = -2.12194440e-4
cdef float HALF = 0.5
cdef float P0 = 1.9875691500e-4
cdef float P1 = 1.3981999507e-3
cdef float P2 = 8.3334519073e-3
cdef float P3 = 4.1665795894e-2
cdef float P4 = 1.6666665459e-1
cdef float P5 = 5.0000001201e-1


cdef inline float _exp(float x) noexcept nogil:
    cdef float k, r, p
    cdef _Bits two_k
    x = EXP_LO if x < EXP_LO else x
    x = EXP_HI if x > EXP_HI else x
    k = floorf(x * LOG2E + HALF)
    r = x - k * LN2_HI - k * LN2_LO
    p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    p = p * r * r + r + ONE
    two_k.i = (<int32_t>k + 127) << 23
    return p * two_k.f


# tanh: the odd polynomial of Cephes' tanhf below |x| = 0.625, where 1 - 2 / (e^2|x| + 1) would
# cancel, and that form above it.
cdef float TANH_SMALL = 0.625
cdef float TWO = 2
cdef float T0 = -5.70498872745e-3
cdef float T1 = 2.06390887954e-2
cdef float T2 = -5.37397155531e-2
cdef float T3 = 1.33314422036e-1
cdef float T4 = -3.33332819422e-1


cdef inline float _tanh(float x) noexcept nogil:
    cdef float ax = x if x >= 0 else -x
    cdef float z = x * x
    cdef float small = x + x * z * ((((T0 * z + T1) * z + T2) * z + T3) * z + T4)
    cdef float big = ONE - TWO / (_exp(TWO * ax) + ONE)
    big = big if x >= 0 else -big
    return small if ax < TANH_SMALL else big


cdef inline void _tanh_f(const float* x, float* y, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = _tanh(x[i])


cdef inline void _exp_f(const float* x, float* y, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = _exp(x[i])


cdef inline void _relu_f(const float* x, float* y, Py_ssize_t n, float slope) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = x[i] if x[i] > 0 else x[i] * slope


cdef inline void _relu_b(const float* x, const float* g, float* d, Py_ssize_t n,
                         float slope) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = g[i] if x[i] > 0 else g[i] * slope


cdef inline void _sum_relu_f(const float* a, const float* b, float* y, Py_ssize_t n,
                             float slope) noexcept nogil:
    cdef Py_ssize_t i
    cdef float v
    for i in range(n):
        v = a[i] + b[i]
        y[i] = v if v > 0 else v * slope


cdef inline void _sum_relu_b(const float* y, const float* g0, const float* g1, float* d,
                             Py_ssize_t n, float slope) noexcept nogil:
    cdef Py_ssize_t i
    cdef float v
    for i in range(n):
        v = g0[i] + g1[i]
        d[i] = v if y[i] > 0 else v * slope


cdef inline void _elu_f(const float* x, float* y, Py_ssize_t n, float alpha) noexcept nogil:
    cdef Py_ssize_t i
    cdef float neg
    for i in range(n):
        neg = alpha * (_exp(x[i]) - ONE)
        y[i] = x[i] if x[i] > 0 else neg


cdef inline void _elu_b(const float* x, const float* y, const float* g, float* d, Py_ssize_t n,
                        float alpha) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = g[i] if x[i] > 0 else g[i] * (y[i] + alpha)


cdef inline void _sigmoid_f(const float* x, float* y, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        y[i] = ONE / (ONE + _exp(-x[i]))


cdef inline void _swish_f(const float* x, float* s, float* y, Py_ssize_t n, float beta) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        s[i] = ONE / (ONE + _exp(-beta * x[i]))
        y[i] = x[i] * s[i]


cdef inline void _absval_b(const float* x, const float* g, float* d, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef float zero = 0
    cdef float neg
    for i in range(n):
        neg = -g[i] if x[i] < 0 else zero
        d[i] = g[i] if x[i] > 0 else neg


cdef inline void _clip_b(const float* x, const float* g, float* d, Py_ssize_t n, float lo,
                         float hi) noexcept nogil:
    cdef Py_ssize_t i
    cdef float zero = 0
    for i in range(n):
        d[i] = g[i] if (x[i] >= lo) & (x[i] <= hi) else zero


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
    _same_size("relu_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _relu_f(&x[lo], &y[lo], min(CHUNK, n - lo), negative_slope)


def relu_backward(const float[::1] x, const float[::1] dy, float[::1] dx, float negative_slope):
    """dx = dy * (1 if x > 0 else negative_slope); `x` may be the top (same sign for slope >= 0)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("relu_backward", "dy", dy.shape[0], n)
    _same_size("relu_backward", "dx", dx.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _relu_b(&x[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo), negative_slope)


def sum_relu_forward(const float[::1] a, const float[::1] b, float[::1] y, float negative_slope):
    """y = ReLU(a + b) with the given negative slope (y may be a or b): an Eltwise SUM and the
    ReLU in place after it, one pass."""
    cdef Py_ssize_t n = a.shape[0], c, lo
    _same_size("sum_relu_forward", "b", b.shape[0], n)
    _same_size("sum_relu_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _sum_relu_f(&a[lo], &b[lo], &y[lo], min(CHUNK, n - lo), negative_slope)


def sum_relu_backward(const float[::1] y, const float[::1] g0, g1, float[::1] d, outs,
                      float negative_slope):
    """The backward of sum_relu_forward, and of a Split after it: d = (g0 + g1) * (1 if y > 0
    else negative_slope) (g1 None: g0 alone; d may be g0), then each array of `outs` = d, copied
    a chunk at a time while the chunk is in cache. y is the forward's output (its sign is the
    sum's for a slope >= 0)."""
    cdef Py_ssize_t n = y.shape[0], c, lo, count
    cdef int k, n_out = len(outs)
    cdef const float[::1] second
    cdef float[::1] out
    cdef const float* gp1 = NULL
    cdef float* targets[2]
    _same_size("sum_relu_backward", "g0", g0.shape[0], n)
    _same_size("sum_relu_backward", "d", d.shape[0], n)
    need(n_out <= 2, "sum_relu_backward", "outs", "takes at most 2 arrays", n_out)
    if n == 0:
        return
    for k in range(n_out):
        out = outs[k]
        _same_size("sum_relu_backward", f"outs[{k}]", out.shape[0], n)
        targets[k] = &out[0]
    if g1 is not None:
        second = g1
        _same_size("sum_relu_backward", "g1", second.shape[0], n)
        gp1 = &second[0]
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        count = min(CHUNK, n - lo)
        if gp1 == NULL:
            _relu_b(&y[lo], &g0[lo], &d[lo], count, negative_slope)
        else:
            _sum_relu_b(&y[lo], &g0[lo], gp1 + lo, &d[lo], count, negative_slope)
        for k in range(n_out):
            memcpy(targets[k] + lo, &d[lo], count * sizeof(float))


def elu_forward(const float[::1] x, float[::1] y, float alpha):
    """y = x if x > 0 else alpha * (exp(x) - 1)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("elu_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _elu_f(&x[lo], &y[lo], min(CHUNK, n - lo), alpha)


def elu_backward(const float[::1] x, const float[::1] y, const float[::1] dy, float[::1] dx,
                 float alpha):
    """dx = dy if x > 0 else dy * (y + alpha); `x` may be the top (same sign for alpha > 0)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("elu_backward", "y", y.shape[0], n)
    _same_size("elu_backward", "dy", dy.shape[0], n)
    _same_size("elu_backward", "dx", dx.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _elu_b(&x[lo], &y[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo), alpha)


def exp_forward(const float[::1] x, float[::1] y):
    """y = exp(x) (see _exp for the range)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("exp_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _exp_f(&x[lo], &y[lo], min(CHUNK, n - lo))


def sigmoid_forward(const float[::1] x, float[::1] y):
    """y = 1 / (1 + exp(-x))."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("sigmoid_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _sigmoid_f(&x[lo], &y[lo], min(CHUNK, n - lo))


def swish_forward(const float[::1] x, float[::1] s, float[::1] y, float beta):
    """s = sigmoid(beta * x) (kept for backward), y = x * s; y may be x."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("swish_forward", "s", s.shape[0], n)
    _same_size("swish_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _swish_f(&x[lo], &s[lo], &y[lo], min(CHUNK, n - lo), beta)


def absval_backward(const float[::1] x, const float[::1] dy, float[::1] dx):
    """dx = sign(x) * dy (0 at x = 0, as Caffe's sign)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("absval_backward", "dy", dy.shape[0], n)
    _same_size("absval_backward", "dx", dx.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _absval_b(&x[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo))


def clip_backward(const float[::1] x, const float[::1] dy, float[::1] dx, float lo_, float hi_):
    """dx = dy where lo <= x <= hi, else 0."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("clip_backward", "dy", dy.shape[0], n)
    _same_size("clip_backward", "dx", dx.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _clip_b(&x[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo), lo_, hi_)


def sigmoid_backward(const float[::1] y, const float[::1] dy, float[::1] dx):
    """dx = dy * y * (1 - y)."""
    cdef Py_ssize_t n = y.shape[0], c, lo
    _same_size("sigmoid_backward", "dy", dy.shape[0], n)
    _same_size("sigmoid_backward", "dx", dx.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _sigmoid_b(&y[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo))


def tanh_forward(const float[::1] x, float[::1] y):
    """y = tanh(x)."""
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("tanh_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _tanh_f(&x[lo], &y[lo], min(CHUNK, n - lo))


def tanh_backward(const float[::1] y, const float[::1] dy, float[::1] dx):
    """dx = dy * (1 - y^2)."""
    cdef Py_ssize_t n = y.shape[0], c, lo
    _same_size("tanh_backward", "dy", dy.shape[0], n)
    _same_size("tanh_backward", "dx", dx.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _tanh_b(&y[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo))


def swish_backward(const float[::1] y, const float[::1] s, const float[::1] dy, float[::1] dx,
                   float beta):
    """dx = dy * (beta * y + s * (1 - beta * y)) with s = sigmoid(beta * x) saved by forward."""
    cdef Py_ssize_t n = y.shape[0], c, lo
    _same_size("swish_backward", "s", s.shape[0], n)
    _same_size("swish_backward", "dy", dy.shape[0], n)
    _same_size("swish_backward", "dx", dx.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
        lo = c * CHUNK
        _swish_b(&y[lo], &s[lo], &dy[lo], &dx[lo], min(CHUNK, n - lo), beta)


def dropout_forward(const float[::1] x, float[::1] mask, float[::1] y, float ratio, float scale):
    """`mask` holds uniform [0, 1) draws on entry and scale * (u >= ratio) on exit; y = x * mask.

    Keeping u >= ratio keeps each unit with probability 1 - ratio (Caffe's Bernoulli mask).
    """
    cdef Py_ssize_t n = x.shape[0], c, lo
    _same_size("dropout_forward", "mask", mask.shape[0], n)
    _same_size("dropout_forward", "y", y.shape[0], n)
    if n == 0:
        return
    for c in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static", num_threads=threads_for(n)):
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
    need_shape("prelu_forward", "y", dims(y.shape, 3), dims(x.shape, 3))
    need_shape("prelu_forward", "slope", dims(slope.shape, 1), (C,))
    if N == 0 or C == 0 or inner == 0:
        return
    for c in prange(C, nogil=True, schedule="static", num_threads=threads_for(N * C * inner)):
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
    need_shape("prelu_backward", "dy", dims(dy.shape, 3), dims(x.shape, 3))
    if want_dx:
        need_shape("prelu_backward", "dx", dims(dx.shape, 3), dims(x.shape, 3))
    need_shape("prelu_backward", "slope", dims(slope.shape, 1), (C,))
    if want_slope:
        need_shape("prelu_backward", "slope_diff", dims(slope_diff.shape, 1), (C,))
    if N == 0 or C == 0 or inner == 0:
        return
    for c in prange(C, nogil=True, schedule="static", num_threads=threads_for(N * C * inner)):
        acc = 0
        for n in range(N):
            d = &dx[n, c, 0] if want_dx else NULL
            acc = acc + _prelu_b(&x[n, c, 0], &dy[n, c, 0], d, inner, slope[c], want_dx)
        if want_slope:
            slope_diff[c] += acc
