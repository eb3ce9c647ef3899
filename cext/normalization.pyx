# cython: language_level=3
"""Kernels of the normalization layers (caffepy/layers/normalization.py):

- BatchNorm and MVN over an (N, C, S) view, channel c being x[:, c, :]: the normalizing
  forward, its backward, and a per-channel affine map. MVN uses the same kernels on a
  (1, rows, D) view (one "channel" per row). Reductions keep 16 float partial sums per row (so
  the loop vectorizes without -ffast-math) and add rows up in double.
- LRN on N x C x H x W, across channels and within a channel (at the end of this file; the
  blocked-layout LRN of the Intel path is in intel.pyx).

Float32 C-contiguous arrays in, buffers the caller allocated out, no GIL. The NumPy references
are in caffepy/kernels/reference/normalization.py (the layers run them when the kernels are
not built).
"""
from cython.parallel cimport prange
from libc.math cimport powf, sqrt, sqrtf

from rules cimport dims, need, need_shape, threads_for


cdef extern from "normalization_rows.h":
    double _row_sum "caffepy_row_sum"(const float* x, long n, float shift) noexcept nogil
    double _row_sumsq "caffepy_row_sumsq"(const float* x, long n, float shift) noexcept nogil
    void _row_dots "caffepy_row_dots"(const float* a, const float* b, long n, double* sa,
                                      double* sab) noexcept nogil


def channel_affine(const float[:, :, ::1] x, const float[::1] sub, const float[::1] mul,
                   float[:, :, ::1] out):
    """out[:, c, :] = (x[:, c, :] - sub[c]) * mul[c]; out may be x. Subtracting first keeps
    the precision of x - mean when the mean is large against the spread."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], r, i
    cdef int nt = threads_for(x.shape[0] * x.shape[1] * x.shape[2])
    cdef float a, b
    cdef const float* src
    cdef float* dst
    need_shape("channel_affine", "out", dims(out.shape, 3), dims(x.shape, 3))
    need_shape("channel_affine", "sub", dims(sub.shape, 1), (C,))
    need_shape("channel_affine", "mul", dims(mul.shape, 1), (C,))
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

cdef enum:                   # the MODE_* of caffepy/kernels/reference/normalization.py
    MODE_BATCH_NORM = 0      # inv = 1 / sqrt(var + eps)
    MODE_MVN = 1             # inv = 1 / (sqrt(var) + eps)
    MODE_MEAN_ONLY = 2       # inv = 1


def normalize_forward(const float[:, :, ::1] x, float[:, :, ::1] y, float[:, :, ::1] keep,
                      double[::1] mean, double[::1] var, float[::1] inv, int mode, double eps):
    """Per channel c of the (N, C, S) views: mean[c], biased var[c] (two passes), inv[c] by
    `mode`, then y = (x - mean) * inv and, when `keep` is given, keep = y. y may be x."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], n, c, i
    cdef int nt = threads_for(x.shape[0] * x.shape[1] * x.shape[2])
    cdef double m = <double>N * S, s
    cdef float mu, a
    cdef bint has_keep = keep is not None
    cdef const float* src
    cdef float* dst
    cdef float* kp
    need_shape("normalize_forward", "y", dims(y.shape, 3), dims(x.shape, 3))
    if has_keep:
        need_shape("normalize_forward", "keep", dims(keep.shape, 3), dims(x.shape, 3))
    need_shape("normalize_forward", "mean", dims(mean.shape, 1), (C,))
    need_shape("normalize_forward", "var", dims(var.shape, 1), (C,))
    need_shape("normalize_forward", "inv", dims(inv.shape, 1), (C,))
    need(mode in (MODE_BATCH_NORM, MODE_MVN, MODE_MEAN_ONLY), "normalize_forward", "mode",
         "unknown mode", mode)
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
    cdef int nt = threads_for(dy.shape[0] * dy.shape[1] * dy.shape[2])
    cdef double m = <double>N * S, sa, sab
    cdef float p, q, r
    cdef const float* g
    cdef const float* yy
    cdef float* out
    need_shape("normalize_backward", "y", dims(y.shape, 3), dims(dy.shape, 3))
    need_shape("normalize_backward", "dx", dims(dx.shape, 3), dims(dy.shape, 3))
    need_shape("normalize_backward", "inv", dims(inv.shape, 1), (C,))
    need_shape("normalize_backward", "inv_y", dims(inv_y.shape, 1), (C,))
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


# ---------------------------------------------------------------------------------------------
# LRN on N x C x H x W. y = x * scale^-beta; the power is the hot spot, so the common betas
# avoid powf.

cdef enum:
    _BLOCK = 1024         # spatial positions per task: vectors over positions, L1-sized rows
    _RING = 8192          # floats of the per-task ring of recent channels (backward)
    _MAX_WITHIN_PRE = 255

include "lrn_pow.pxi"


cdef inline float _npow(float s, float beta, int kind) noexcept nogil:
    """s ** -beta; callers' loops get unswitched on kind, so each kind vectorizes."""
    cdef float r
    if kind == _POW_075:
        # s^-3/4 = 1 / (s^1/2 * s^1/4): two square roots instead of exp(log)
        r = sqrtf(s)
        return <float>1.0 / (r * sqrtf(r))
    if kind == _POW_050:
        return <float>1.0 / sqrtf(s)
    if kind == _POW_100:
        return <float>1.0 / s
    return powf(s, -beta)


cdef inline void _neg_pow(const float* s, float* out, int n, float beta, int kind) noexcept nogil:
    """out[i] = s[i] ** -beta; separate loops so each kind vectorizes."""
    cdef int i
    cdef float r, one = 1.0
    if kind == _POW_075:
        # s^-3/4 = 1 / (s^1/2 * s^1/4): two square roots instead of exp(log)
        for i in range(n):
            r = sqrtf(s[i])
            out[i] = one / (r * sqrtf(r))
    elif kind == _POW_050:
        for i in range(n):
            out[i] = one / sqrtf(s[i])
    elif kind == _POW_100:
        for i in range(n):
            out[i] = one / s[i]
    else:
        for i in range(n):
            out[i] = powf(s[i], -beta)


cdef _check_lrn(str kernel, int size, int max_size, tuple shape, list others):
    need(size >= 1 and size % 2 == 1, kernel, "local_size", "must be odd and positive", size)
    need(size <= max_size, kernel, "local_size",
         f"is larger than this kernel supports ({max_size})", size)
    for name, other in others:
        need_shape(kernel, name, tuple(other.shape[:4]), shape)


def lrn_across_forward(const float[:, :, :, ::1] bottom, float[:, :, :, ::1] top,
                       float[:, :, :, ::1] scale, int size, float alpha, float beta, float k):
    """ACROSS_CHANNELS: scale = k + alpha/size * sum of x^2 over `size` channels centred on c
    (zero past the ends); top = bottom * scale^-beta. top and scale are overwritten."""
    _check_lrn("lrn_across_forward", size, size, dims(bottom.shape, 4),
               [("top", top), ("scale", scale)])
    cdef int N = bottom.shape[0], C = bottom.shape[1]
    cdef Py_ssize_t HW = <Py_ssize_t>bottom.shape[2] * bottom.shape[3]
    cdef Py_ssize_t nblocks = (HW + _BLOCK - 1) // _BLOCK, item
    if N == 0 or C == 0 or HW == 0:
        return
    with nogil:
        for item in prange(N * nblocks, schedule="static",
                          num_threads=threads_for(N * C * HW * 4)):
            _lrn_across_fwd_block(&bottom[0, 0, 0, 0], &top[0, 0, 0, 0], &scale[0, 0, 0, 0],
                                  item // nblocks, (item % nblocks) * _BLOCK, C, HW, size,
                                  alpha, beta, k)


cdef void _lrn_across_fwd_block(const float* bottom, float* top, float* scale, Py_ssize_t n,
                                Py_ssize_t s0, int C, Py_ssize_t HW, int size, float alpha,
                                float beta, float k) noexcept nogil:
    # running sum of x^2 over channels [c - pre, c + pre] for L positions at once; one fused
    # pass per channel (a zero row stands in for channels past the ends)
    cdef float acc[_BLOCK]
    cdef float zero[_BLOCK]
    cdef int L = <int>min(<Py_ssize_t>_BLOCK, HW - s0)
    cdef int pre = (size - 1) // 2, c, i, kind = _pow_kind(beta)
    cdef float a = alpha / size, v
    cdef Py_ssize_t base = n * C * HW + s0
    cdef const float* zp = zero
    cdef const float* x
    cdef const float* xh
    cdef const float* xt
    cdef float* sc
    cdef float* y
    for i in range(L):
        acc[i] = 0.0
        zero[i] = 0.0
    for c in range(min(pre, C)):
        x = bottom + base + c * HW
        for i in range(L):
            acc[i] = acc[i] + x[i] * x[i]
    for c in range(C):
        xh = bottom + base + (c + pre) * HW if c + pre < C else zp
        xt = bottom + base + (c - pre - 1) * HW if c - pre - 1 >= 0 else zp
        x = bottom + base + c * HW
        sc = scale + base + c * HW
        y = top + base + c * HW
        for i in range(L):
            acc[i] = acc[i] + xh[i] * xh[i] - xt[i] * xt[i]
            v = k + a * acc[i]
            sc[i] = v
            y[i] = x[i] * _npow(v, beta, kind)


def lrn_across_backward(const float[:, :, :, ::1] bottom, const float[:, :, :, ::1] scale,
                        const float[:, :, :, ::1] top_diff, float[:, :, :, ::1] bottom_diff,
                        int size, float alpha, float beta):
    """bottom_diff = top_diff * scale^-beta
                     - 2*alpha*beta/size * bottom * sum over the channel window of
                       top_diff * top / scale                              (overwritten).

    top / scale is formed as bottom * scale^(-beta-1), so top itself is not read.
    """
    # the ring holds size + 1 channels of L positions, L a multiple of 8
    _check_lrn("lrn_across_backward", size, _RING // 8 - 1, dims(bottom.shape, 4),
               [("scale", scale), ("top_diff", top_diff), ("bottom_diff", bottom_diff)])
    cdef int N = bottom.shape[0], C = bottom.shape[1]
    cdef Py_ssize_t HW = <Py_ssize_t>bottom.shape[2] * bottom.shape[3]
    cdef int L = min(_BLOCK, (_RING // (size + 1)) // 8 * 8)
    cdef Py_ssize_t nblocks = (HW + L - 1) // L, item
    if N == 0 or C == 0 or HW == 0:
        return
    with nogil:
        for item in prange(N * nblocks, schedule="static",
                          num_threads=threads_for(N * C * HW * 4)):
            _lrn_across_bwd_block(&bottom[0, 0, 0, 0], &scale[0, 0, 0, 0], &top_diff[0, 0, 0, 0],
                                  &bottom_diff[0, 0, 0, 0], item // nblocks,
                                  (item % nblocks) * L, L, C, HW, size, alpha, beta)


cdef void _lrn_across_bwd_block(const float* bottom, const float* scale, const float* top_diff,
                                float* bottom_diff, Py_ssize_t n, Py_ssize_t s0, int Lmax, int C,
                                Py_ssize_t HW, int size, float alpha, float beta) noexcept nogil:
    # Ring slot ch % R (R = size + 1) keeps, for channel ch, ratio = dy * x * scale^(-beta-1)
    # (= dy * top / scale) and scale^-beta, from when ch entered the window as its head until
    # it leaves as the tail. Rows of zeros (and ones for the scale) stand in past the last
    # channel, so each channel is one fused pass.
    cdef float ratio[_RING]
    cdef float pw[_RING]
    cdef float acc[_BLOCK]
    cdef float zero[_BLOCK]
    cdef float one[_BLOCK]
    cdef int R = size + 1
    cdef int L = <int>min(<Py_ssize_t>Lmax, HW - s0)
    cdef int pre = (size - 1) // 2, c, h, i, kind = _pow_kind(beta)
    cdef float cache = 2.0 * alpha * beta / size, p, r
    cdef Py_ssize_t base = n * C * HW + s0
    cdef const float* zp = zero
    cdef const float* op = one
    cdef const float* x
    cdef const float* dy
    cdef const float* xh
    cdef const float* sh
    cdef const float* dyh
    cdef const float* rt
    cdef const float* pc
    cdef float* rh
    cdef float* ph
    cdef float* dx
    for i in range(L):
        acc[i] = 0.0
        zero[i] = 0.0
        one[i] = 1.0
    for h in range(min(pre, C)):
        x = bottom + base + h * HW
        sh = scale + base + h * HW
        dy = top_diff + base + h * HW
        rh = ratio + (h % R) * Lmax
        ph = pw + (h % R) * Lmax
        for i in range(L):
            p = _npow(sh[i], beta, kind)
            ph[i] = p
            rh[i] = dy[i] * x[i] * p / sh[i]
            acc[i] = acc[i] + rh[i]
    for c in range(C):
        h = c + pre
        xh = bottom + base + h * HW if h < C else zp
        sh = scale + base + h * HW if h < C else op
        dyh = top_diff + base + h * HW if h < C else zp
        rh = ratio + (h % R) * Lmax
        ph = pw + (h % R) * Lmax
        rt = <const float*>&ratio[((c - pre - 1) % R) * Lmax] if c - pre - 1 >= 0 else zp
        pc = pw + (c % R) * Lmax
        x = bottom + base + c * HW
        dy = top_diff + base + c * HW
        dx = bottom_diff + base + c * HW
        # two loops, not one: with every ring row in one loop GCC cannot rule out overlaps
        # and leaves it scalar (3x slower measured)
        for i in range(L):
            p = _npow(sh[i], beta, kind)
            ph[i] = p
            r = dyh[i] * xh[i] * p / sh[i]
            rh[i] = r
            acc[i] = acc[i] + r - rt[i]
        for i in range(L):
            dx[i] = dy[i] * pc[i] - cache * x[i] * acc[i]


# WITHIN_CHANNEL (Caffe builds it from layers: AVE pooling of x^2 with pad (size-1)/2, then a
# power layer with shift 1, scale alpha, power -beta): scale = 1 + alpha/size^2 * box sum of x^2
# over size x size (zero outside the image; the AVE divisor is always size^2 for odd size).

cdef void _box_sum_inplace(float* v, int n, Py_ssize_t stride, int pre, float* ring) noexcept nogil:
    """v[i] = sum of v[i-pre .. i+pre] (zero outside), in place; ring holds pre + 1 floats."""
    cdef int i, R = pre + 1
    cdef float s = 0.0
    for i in range(min(pre, n)):
        s = s + v[i * stride]
    for i in range(n):
        if i + pre < n:
            s = s + v[(i + pre) * stride]
        ring[i % R] = v[i * stride]
        v[i * stride] = s
        if i - pre >= 0:
            s = s - ring[(i - pre) % R]


cdef inline void _box_sum_plane(float* plane, int H, int W, int pre, float* ring) noexcept nogil:
    cdef int y, xx
    for y in range(H):
        _box_sum_inplace(plane + <Py_ssize_t>y * W, W, 1, pre, ring)
    for xx in range(W):
        _box_sum_inplace(plane + xx, H, W, pre, ring)


def lrn_within_forward(const float[:, :, :, ::1] bottom, float[:, :, :, ::1] top,
                       float[:, :, :, ::1] scale, int size, float alpha, float beta):
    """WITHIN_CHANNEL: scale = 1 + alpha/size^2 * sum of x^2 over the size x size window
    centred on (h, w); top = bottom * scale^-beta. top and scale are overwritten."""
    _check_lrn("lrn_within_forward", size, 2 * _MAX_WITHIN_PRE + 1, dims(bottom.shape, 4),
               [("top", top), ("scale", scale)])
    cdef int H = bottom.shape[2], W = bottom.shape[3]
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, pl
    cdef Py_ssize_t planes = <Py_ssize_t>bottom.shape[0] * bottom.shape[1]
    if planes == 0 or HW == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                          num_threads=threads_for(planes * HW * 8)):
            _lrn_within_fwd_plane(&bottom[0, 0, 0, 0] + pl * HW, &top[0, 0, 0, 0] + pl * HW,
                                  &scale[0, 0, 0, 0] + pl * HW, H, W, size, alpha, beta)


cdef void _lrn_within_fwd_plane(const float* x, float* y, float* sc, int H, int W, int size,
                                float alpha, float beta) noexcept nogil:
    cdef float ring[_MAX_WITHIN_PRE + 1]
    cdef Py_ssize_t i, HW = <Py_ssize_t>H * W
    cdef float a = alpha / (size * size), one = 1.0
    for i in range(HW):
        sc[i] = x[i] * x[i]
    _box_sum_plane(sc, H, W, (size - 1) // 2, ring)
    for i in range(HW):
        sc[i] = one + a * sc[i]
    _neg_pow(sc, y, <int>HW, beta, _pow_kind(beta))
    for i in range(HW):
        y[i] = x[i] * y[i]


def lrn_within_backward(const float[:, :, :, ::1] bottom, const float[:, :, :, ::1] scale,
                        const float[:, :, :, ::1] top_diff, float[:, :, :, ::1] bottom_diff,
                        int size, float alpha, float beta):
    """bottom_diff = top_diff * scale^-beta
                     - 2*alpha*beta/size^2 * bottom * box sum of top_diff * top / scale
                                                                        (overwritten)."""
    _check_lrn("lrn_within_backward", size, 2 * _MAX_WITHIN_PRE + 1, dims(bottom.shape, 4),
               [("scale", scale), ("top_diff", top_diff), ("bottom_diff", bottom_diff)])
    cdef int H = bottom.shape[2], W = bottom.shape[3]
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, pl
    cdef Py_ssize_t planes = <Py_ssize_t>bottom.shape[0] * bottom.shape[1]
    if planes == 0 or HW == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                          num_threads=threads_for(planes * HW * 8)):
            _lrn_within_bwd_plane(&bottom[0, 0, 0, 0] + pl * HW, &scale[0, 0, 0, 0] + pl * HW,
                                  &top_diff[0, 0, 0, 0] + pl * HW,
                                  &bottom_diff[0, 0, 0, 0] + pl * HW, H, W, size, alpha, beta)


cdef void _lrn_within_bwd_plane(const float* x, const float* sc, const float* dy, float* dx,
                                int H, int W, int size, float alpha, float beta) noexcept nogil:
    cdef float ring[_MAX_WITHIN_PRE + 1]
    cdef float pw[_BLOCK]
    cdef Py_ssize_t i, j, s0, HW = <Py_ssize_t>H * W
    cdef int L, kind = _pow_kind(beta)
    cdef float cache = 2.0 * alpha * beta / (size * size)
    # dx holds dy * x * scale^(-beta-1), then its box sum, then the result
    s0 = 0
    while s0 < HW:
        L = <int>min(<Py_ssize_t>_BLOCK, HW - s0)
        _neg_pow(sc + s0, pw, L, beta, kind)
        for j in range(L):
            i = s0 + j
            dx[i] = dy[i] * x[i] * pw[j] / sc[i]
        s0 += L
    _box_sum_plane(dx, H, W, (size - 1) // 2, ring)
    s0 = 0
    while s0 < HW:
        L = <int>min(<Py_ssize_t>_BLOCK, HW - s0)
        _neg_pow(sc + s0, pw, L, beta, kind)
        for j in range(L):
            i = s0 + j
            dx[i] = dy[i] * pw[j] - cache * x[i] * dx[i]
        s0 += L
