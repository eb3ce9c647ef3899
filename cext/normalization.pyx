# cython: language_level=3
"""Kernels of the normalization layers (BatchNorm, MVN): per-channel statistics and
per-channel affine maps over an (N, C, S) view, channel c being x[:, c, :].

MVN uses the same kernels on a (1, rows, D) view (one "channel" per row).
Reductions keep 16 float partial sums per row (so the loop vectorizes without
-ffast-math) and add rows up in double. NumPy references live in
tests/layers/test_normalization.py.
"""
from cython.parallel cimport prange
cimport openmp

cdef enum:
    _LANES = 16
    _SERIAL_BELOW = 65536     # values: smaller jobs are not worth waking the thread team


cdef inline int _threads(Py_ssize_t work) noexcept nogil:
    return 1 if work < _SERIAL_BELOW else openmp.omp_get_max_threads()


cdef inline tuple _s3(Py_ssize_t* shape):
    return (shape[0], shape[1], shape[2])


cdef inline double _row_sum(const float* x, Py_ssize_t n, float shift) noexcept nogil:
    cdef float acc[_LANES]
    cdef Py_ssize_t i, l, blk, n16 = n - n % _LANES
    cdef double total = 0.0
    for l in range(_LANES):
        acc[l] = 0.0
    for blk in range(n16 // _LANES):
        i = blk * _LANES
        for l in range(_LANES):
            acc[l] = acc[l] + (x[i + l] - shift)
    for i in range(n16, n):
        total += x[i] - shift
    for l in range(_LANES):
        total += acc[l]
    return total


cdef inline double _row_sumsq(const float* x, Py_ssize_t n, float shift) noexcept nogil:
    cdef float acc[_LANES]
    cdef float d
    cdef Py_ssize_t i, l, blk, n16 = n - n % _LANES
    cdef double total = 0.0
    for l in range(_LANES):
        acc[l] = 0.0
    for blk in range(n16 // _LANES):
        i = blk * _LANES
        for l in range(_LANES):
            d = x[i + l] - shift
            acc[l] = acc[l] + d * d
    for i in range(n16, n):
        d = x[i] - shift
        total += d * d
    for l in range(_LANES):
        total += acc[l]
    return total


cdef inline void _row_dots(const float* a, const float* b, Py_ssize_t n, double* sa,
                           double* sab) noexcept nogil:
    cdef float acc[_LANES]
    cdef float acc2[_LANES]
    cdef Py_ssize_t i, l, blk, n16 = n - n % _LANES
    cdef double t1 = 0.0, t2 = 0.0
    for l in range(_LANES):
        acc[l] = 0.0
        acc2[l] = 0.0
    for blk in range(n16 // _LANES):
        i = blk * _LANES
        for l in range(_LANES):
            acc[l] = acc[l] + a[i + l]
            acc2[l] = acc2[l] + a[i + l] * b[i + l]
    for i in range(n16, n):
        t1 += a[i]
        t2 += a[i] * b[i]
    for l in range(_LANES):
        t1 += acc[l]
        t2 += acc2[l]
    sa[0] += t1
    sab[0] += t2


def channel_mean_var(const float[:, :, ::1] x, double[::1] mean, double[::1] var):
    """mean[c], var[c] (biased) of x[:, c, :], two passes (the second over x - mean)."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], n, c
    cdef int nt = _threads(x.shape[0] * x.shape[1] * x.shape[2])
    cdef double m = <double>N * S, s
    if mean.shape[0] != C or var.shape[0] != C:
        raise ValueError(f"mean/var need {C} values, got {mean.shape[0]}/{var.shape[0]}")
    if m == 0:
        mean[:] = 0.0
        var[:] = 0.0
        return
    with nogil:
        for c in prange(C, schedule="static", num_threads=nt):
            s = 0.0
            for n in range(N):
                s = s + _row_sum(&x[n, c, 0], S, 0.0)
            mean[c] = s / m
            s = 0.0
            for n in range(N):
                s = s + _row_sumsq(&x[n, c, 0], S, <float>mean[c])
            var[c] = s / m


def channel_sums(const float[:, :, ::1] a, const float[:, :, ::1] b, double[::1] sum_a,
                 double[::1] sum_ab):
    """sum_a[c] = sum of a[:, c, :]; sum_ab[c] = sum of a[:, c, :] * b[:, c, :]."""
    cdef Py_ssize_t N = a.shape[0], C = a.shape[1], S = a.shape[2], n, c
    cdef int nt = _threads(a.shape[0] * a.shape[1] * a.shape[2])
    if _s3(b.shape) != _s3(a.shape):
        raise ValueError(f"shapes differ: {_s3(a.shape)} and {_s3(b.shape)}")
    if sum_a.shape[0] != C or sum_ab.shape[0] != C:
        raise ValueError(f"sums need {C} values")
    with nogil:
        for c in prange(C, schedule="static", num_threads=nt):
            sum_a[c] = 0.0
            sum_ab[c] = 0.0
            for n in range(N):
                _row_dots(&a[n, c, 0], &b[n, c, 0], S, &sum_a[c], &sum_ab[c])


def channel_affine(const float[:, :, ::1] x, const float[::1] sub, const float[::1] mul,
                   float[:, :, ::1] out):
    """out[:, c, :] = (x[:, c, :] - sub[c]) * mul[c]; out may be x. Subtracting first keeps
    the precision of x - mean when the mean is large against the spread."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], r, i
    cdef int nt = _threads(x.shape[0] * x.shape[1] * x.shape[2])
    cdef float a, b
    cdef const float* src
    cdef float* dst
    if _s3(out.shape) != _s3(x.shape):
        raise ValueError(f"out shape {_s3(out.shape)} != {_s3(x.shape)}")
    if sub.shape[0] != C or mul.shape[0] != C:
        raise ValueError(f"sub/mul need {C} values")
    if N * C * S == 0:
        return
    with nogil:
        for r in prange(N * C, schedule="static", num_threads=nt):
            b = sub[r % C]
            a = mul[r % C]
            src = &x[0, 0, 0] + r * S
            dst = &out[0, 0, 0] + r * S
            for i in range(S):
                dst[i] = (src[i] - b) * a


def channel_combine(const float[:, :, ::1] a, const float[:, :, ::1] b, const float[::1] alpha,
                    const float[::1] beta, const float[::1] gamma, float[:, :, ::1] out):
    """out[:, c, :] = alpha[c] a + beta[c] b + gamma[c]; out may be a or b."""
    cdef Py_ssize_t N = a.shape[0], C = a.shape[1], S = a.shape[2], r, i
    cdef int nt = _threads(a.shape[0] * a.shape[1] * a.shape[2])
    cdef float p, q, g
    cdef const float* sa
    cdef const float* sb
    cdef float* dst
    if _s3(b.shape) != _s3(a.shape) or _s3(out.shape) != _s3(a.shape):
        raise ValueError("a, b and out need one shape")
    if alpha.shape[0] != C or beta.shape[0] != C or gamma.shape[0] != C:
        raise ValueError(f"coefficients need {C} values")
    if N * C * S == 0:
        return
    with nogil:
        for r in prange(N * C, schedule="static", num_threads=nt):
            p = alpha[r % C]
            q = beta[r % C]
            g = gamma[r % C]
            sa = &a[0, 0, 0] + r * S
            sb = &b[0, 0, 0] + r * S
            dst = &out[0, 0, 0] + r * S
            for i in range(S):
                dst[i] = p * sa[i] + q * sb[i] + g
