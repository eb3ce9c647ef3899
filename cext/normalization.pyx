# cython: language_level=3
"""Kernels of the normalization layers (BatchNorm, MVN) over an (N, C, S) view, channel c
being x[:, c, :]: the normalizing forward, its backward, and a per-channel affine map.

MVN uses the same kernels on a (1, rows, D) view (one "channel" per row).
Reductions keep 16 float partial sums per row (so the loop vectorizes without
-ffast-math) and add rows up in double. The NumPy references are the fallbacks of the
same names in caffepy/layers/normalization.py; tests/layers/test_normalization.py runs
both and compares.
"""
from cython.parallel cimport prange
cimport openmp
from libc.math cimport sqrt

cdef enum:
    _SERIAL_BELOW = 65536     # values: smaller jobs are not worth waking the thread team


cdef inline int _threads(Py_ssize_t work) noexcept nogil:
    return 1 if work < _SERIAL_BELOW else openmp.omp_get_max_threads()


cdef inline tuple _s3(Py_ssize_t* shape):
    return (shape[0], shape[1], shape[2])


cdef extern from *:
    """
    /* Row reductions with 16 float partial sums, the pattern GCC vectorizes without
       -ffast-math (each lane is its own accumulator, so no reassociation is needed);
       the lanes and the tail are added in double. */
    static double caffepy_row_sum(const float* x, long n, float shift) {
        float acc[16] = {0};
        long i = 0, l;
        double total = 0.0;
        for (; i + 16 <= n; i += 16)
            for (l = 0; l < 16; l++) acc[l] += x[i + l] - shift;
        for (; i < n; i++) total += x[i] - shift;
        for (l = 0; l < 16; l++) total += acc[l];
        return total;
    }
    static double caffepy_row_sumsq(const float* x, long n, float shift) {
        float acc[16] = {0};
        long i = 0, l;
        double total = 0.0;
        for (; i + 16 <= n; i += 16)
            for (l = 0; l < 16; l++) {
                float d = x[i + l] - shift;
                acc[l] += d * d;
            }
        for (; i < n; i++) {
            float d = x[i] - shift;
            total += d * d;
        }
        for (l = 0; l < 16; l++) total += acc[l];
        return total;
    }
    /* *sa += sum a, *sab += sum a * b */
    static void caffepy_row_dots(const float* a, const float* b, long n, double* sa, double* sab) {
        float acc[16] = {0}, acc2[16] = {0};
        long i = 0, l;
        double t1 = 0.0, t2 = 0.0;
        for (; i + 16 <= n; i += 16)
            for (l = 0; l < 16; l++) {
                acc[l] += a[i + l];
                acc2[l] += a[i + l] * b[i + l];
            }
        for (; i < n; i++) {
            t1 += a[i];
            t2 += a[i] * b[i];
        }
        for (l = 0; l < 16; l++) {
            t1 += acc[l];
            t2 += acc2[l];
        }
        *sa += t1;
        *sab += t2;
    }
    """
    double _row_sum "caffepy_row_sum"(const float* x, long n, float shift) noexcept nogil
    double _row_sumsq "caffepy_row_sumsq"(const float* x, long n, float shift) noexcept nogil
    void _row_dots "caffepy_row_dots"(const float* a, const float* b, long n, double* sa,
                                      double* sab) noexcept nogil


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


# Fused per-channel passes: each channel's values are read again while they are still in
# cache (a ResNet channel at batch 32 is 0.4-1.6 MB), instead of streaming the whole blob
# from memory once per step.

cdef enum:                   # the same numbers as in caffepy/layers/normalization.py
    MODE_BATCH_NORM = 0      # inv = 1 / sqrt(var + eps)
    MODE_MVN = 1             # inv = 1 / (sqrt(var) + eps)
    MODE_MEAN_ONLY = 2       # inv = 1


def normalize_forward(const float[:, :, ::1] x, float[:, :, ::1] y, float[:, :, ::1] keep,
                      double[::1] mean, double[::1] var, float[::1] inv, int mode, double eps):
    """Per channel c of the (N, C, S) views: mean[c], biased var[c] (two passes), inv[c] by
    `mode`, then y = (x - mean) * inv and, when `keep` is given, keep = y. y may be x."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], n, c, i
    cdef int nt = _threads(x.shape[0] * x.shape[1] * x.shape[2])
    cdef double m = <double>N * S, s
    cdef float mu, a
    cdef bint has_keep = keep is not None
    cdef const float* src
    cdef float* dst
    cdef float* kp
    if _s3(y.shape) != _s3(x.shape) or (has_keep and _s3(keep.shape) != _s3(x.shape)):
        raise ValueError(f"y/keep need the shape of x {_s3(x.shape)}")
    if mean.shape[0] != C or var.shape[0] != C or inv.shape[0] != C:
        raise ValueError(f"mean/var/inv need {C} values")
    if mode not in (MODE_BATCH_NORM, MODE_MVN, MODE_MEAN_ONLY):
        raise ValueError(f"unknown mode {mode}")
    if m == 0:
        mean[:] = 0.0
        var[:] = 0.0
        inv[:] = 1.0
        return
    with nogil:
        for c in prange(C, schedule="static", num_threads=nt):
            s = 0.0
            for n in range(N):
                s = s + _row_sum(&x[n, c, 0], S, 0.0)
            mean[c] = s / m
            mu = <float>mean[c]
            s = 0.0
            for n in range(N):
                s = s + _row_sumsq(&x[n, c, 0], S, mu)
            var[c] = s / m
            if mode == MODE_BATCH_NORM:
                inv[c] = <float>(1.0 / sqrt(var[c] + eps))
            elif mode == MODE_MVN:
                inv[c] = <float>(1.0 / (sqrt(var[c]) + eps))
            else:
                inv[c] = 1.0
            a = inv[c]
            for n in range(N):
                src = &x[n, c, 0]
                dst = &y[n, c, 0]
                for i in range(S):
                    dst[i] = (src[i] - mu) * a
                if has_keep:
                    kp = &keep[n, c, 0]
                    for i in range(S):
                        kp[i] = dst[i]


def normalize_backward(const float[:, :, ::1] dy, const float[:, :, ::1] y, const float[::1] inv,
                       const float[::1] inv_y, float[:, :, ::1] dx):
    """Per channel, with m = N * S values and y the normalized forward output:
        dx = inv (dy - mean(dy)) - inv_y mean(dy y) y
    (inv_y = inv for BatchNorm; for MVN 1/std, the exact gradient). dx may be dy."""
    cdef Py_ssize_t N = dy.shape[0], C = dy.shape[1], S = dy.shape[2], n, c, i
    cdef int nt = _threads(dy.shape[0] * dy.shape[1] * dy.shape[2])
    cdef double m = <double>N * S, sa, sab
    cdef float p, q, r
    cdef const float* g
    cdef const float* yy
    cdef float* out
    if _s3(y.shape) != _s3(dy.shape) or _s3(dx.shape) != _s3(dy.shape):
        raise ValueError(f"y/dx need the shape of dy {_s3(dy.shape)}")
    if inv.shape[0] != C or inv_y.shape[0] != C:
        raise ValueError(f"inv/inv_y need {C} values")
    if m == 0:
        return
    with nogil:
        for c in prange(C, schedule="static", num_threads=nt):
            sa = 0.0
            sab = 0.0
            for n in range(N):
                _row_dots(&dy[n, c, 0], &y[n, c, 0], S, &sa, &sab)
            p = inv[c]
            q = <float>(-inv_y[c] * sab / m)
            r = <float>(-inv[c] * sa / m)
            for n in range(N):
                g = &dy[n, c, 0]
                yy = &y[n, c, 0]
                out = &dx[n, c, 0]
                for i in range(S):
                    out[i] = p * g[i] + q * yy[i] + r
