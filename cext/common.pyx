# cython: language_level=3
# distutils: extra_compile_args = -fno-trapping-math
"""Kernels of the common layers (caffepy/layers/common.py): the matrix products of InnerProduct
(caffepy.blas.gemm_into; skinny_gemm at small batch), the Scale layer's fused passes over
(outer, dim, inner) views, and threaded whole-blob copies and sums (Eltwise, Split).

Float32 C-contiguous arrays in, buffers the caller allocated out, no GIL. Work is split over
OpenMP threads by plane (forward) or by channel (backward, so every thread owns its channels'
sums and nothing races). The NumPy references are in caffepy/kernels/reference/common.py.
"""

import numpy as np

from cython.parallel cimport prange
from libc.string cimport memcpy

from blas cimport (caffepy_packed_floats, caffepy_panel_gemm, caffepy_panel_pack,
                   caffepy_panels_wanted, gemm_ld_by)
from blas cimport gemm_packed as packed_product
from rules cimport caffepy_team_limit, dims, need, need_shape, threads_for, threads_for_macs

cdef extern from "common_skinny.h" nogil:
    int SK_W, SK_MR
    void skinny_rows(int trans_a, int m0, int m1, int N, int K, const float* a, long lda,
                     const float* b, float* c, int accumulate)

include "blas_threads.pxi"


def team_limit():
    """The threads a parallel region of this module may have now: OMP_NUM_THREADS (else the
    cores) less the cores other processes keep busy (rules.h). For tests and benchmarks."""
    return caffepy_team_limit()


def gemm(a, b, float[:, ::1] c, float beta=0.0, bint panels=True):
    """c = a @ b + beta * c for float32 matrices a [M, K], b [K, N] (each C- or Fortran-ordered,
    so a transposed view costs nothing) and c [M, N]; beta 0 overwrites c. Threaded as every
    product of the kernels (blas.pxd); panels False runs the BLAS even where the kernels would
    not (tests and benchmarks)."""
    cdef bint ta = not a.flags.c_contiguous, tb = not b.flags.c_contiguous
    cdef const float[:, ::1] sa = a.T if ta else a        # as stored: [M, K] or [K, M]
    cdef const float[:, ::1] sb = b.T if tb else b
    cdef int M = a.shape[0], K = a.shape[1], N = b.shape[1]
    need_shape("gemm", "b", tuple(b.shape), (K, N))
    need_shape("gemm", "c", dims(c.shape, 2), (M, N))
    if M == 0 or N == 0:
        return
    with nogil:
        gemm_ld_by(panels, ta, tb, M, N, K, 1.0, &sa[0, 0], sa.shape[1], &sb[0, 0], sb.shape[1],
                   beta, &c[0, 0], N)


def panel_gemm(a, b, float[:, ::1] c, float alpha=1.0, float beta=0.0):
    """c = alpha * a @ b + beta * c by cext/gemm_panels.h on one thread, whatever the shape (the
    products that blas.pxd routes there take this path inside gemm): a [M, K] C-ordered, b
    [K, N] either order. For its tests."""
    cdef bint tb = not b.flags.c_contiguous
    cdef const float[:, ::1] sa = a
    cdef const float[:, ::1] sb = b.T if tb else b
    cdef int M = a.shape[0], K = a.shape[1], N = b.shape[1], done
    need_shape("panel_gemm", "b", tuple(b.shape), (K, N))
    need_shape("panel_gemm", "c", dims(c.shape, 2), (M, N))
    need(M > 0 and N > 0 and K > 0, "panel_gemm", "a, b", "need no empty side", (M, N, K))
    with nogil:
        done = caffepy_panel_gemm(tb, M, N, K, alpha, &sa[0, 0], sa.shape[1], &sb[0, 0],
                                  sb.shape[1], beta, &c[0, 0], c.shape[1])
    if not done:
        raise MemoryError("panel_gemm: no memory for the packed operand")


def pack_panels(b, float alpha=1.0):
    """alpha * b (b [K, N], either order) packed into gemm_packed's panels: a 1-D float32 array
    of this module's panel layout (cext/gemm_panels.h)."""
    cdef bint tb = not b.flags.c_contiguous
    cdef const float[:, ::1] sb = b.T if tb else b
    cdef int K = b.shape[0], N = b.shape[1]
    need(K > 0 and N > 0, "pack_panels", "b", "needs no empty side", (K, N))
    out = np.empty(caffepy_packed_floats(N, K), np.float32)
    cdef float[::1] bp = out
    with nogil:
        caffepy_panel_pack(tb, N, K, alpha, &sb[0, 0], sb.shape[1], &bp[0])
    return out


def gemm_packed(const float[:, ::1] a, const float[::1] packed, float[:, ::1] c,
                float beta=0.0):
    """c = a @ B + beta * c, B the alpha * b that pack_panels packed into `packed` (its N: c's
    columns); beta 0 overwrites c. Threaded (blas.pxd packed_split): its tests and benchmarks."""
    cdef int M = a.shape[0], K = a.shape[1], N = c.shape[1]
    need_shape("gemm_packed", "c", dims(c.shape, 2), (M, N))
    need(N > 0 and K > 0 and packed.shape[0] == caffepy_packed_floats(N, K), "gemm_packed",
         "packed", f"needs {caffepy_packed_floats(N, K)} floats (b of {K} x {N})",
         packed.shape[0])
    if M == 0:
        return
    with nogil:
        packed_product(M, N, K, &a[0, 0], K, &packed[0], beta, &c[0, 0], N)


def panels_wanted(int M, int N, int K):
    """Whether gemm runs C [M, N] = A [M, K] op(B) by panel_gemm's kernel (else by the BLAS)."""
    return bool(caffepy_panels_wanted(M, N, K))


SKINNY_WIDTH = SK_W


def skinny_gemm(a, const float[:, ::1] b, float[:, ::1] c):
    """c = a @ b for a product whose columns are few (InnerProduct's batch): a [M, K] (C- or
    Fortran-ordered), b [K, N] and c [M, N] packed, N a multiple of SKINNY_WIDTH (pad the
    batch; a padding column of b only reaches the same column of c). common_skinny.h says why
    it beats the BLAS there. Threads split c's rows."""
    cdef bint ta = not a.flags.c_contiguous
    cdef const float[:, ::1] sa = a.T if ta else a        # as stored: [M, K] or [K, M]
    cdef int M = a.shape[0], K = a.shape[1], N = b.shape[1], nt, t, step
    need_shape("skinny_gemm", "b", dims(b.shape, 2), (K, N))
    need_shape("skinny_gemm", "c", dims(c.shape, 2), (M, N))
    need(N % SK_W == 0, "skinny_gemm", "b", f"needs a multiple of {SK_W} columns", N)
    if M == 0 or N == 0:
        return
    if K == 0:
        c[:, :] = 0
        return
    nt = threads_for_macs(<Py_ssize_t>M * N * K)
    step = ((M + nt - 1) // nt + SK_MR - 1) // SK_MR * SK_MR
    with nogil:
        for t in prange(nt, num_threads=nt, schedule="static"):
            if t * step < M:
                skinny_rows(ta, t * step, min(M, (t + 1) * step), N, K, &sa[0, 0], sa.shape[1],
                            &b[0, 0], &c[0, 0], 0)


cdef inline void _affine(const float* x, float* y, float* saved, Py_ssize_t n, float s, float b,
                         bint keep) noexcept nogil:
    cdef Py_ssize_t i
    if keep:
        for i in range(n):
            saved[i] = x[i]
    for i in range(n):
        y[i] = x[i] * s + b


cdef inline void _plane_backward(const float* x, const float* g, float* d, Py_ssize_t n, float s,
                                 bint want_dx, double* sum_gx, double* sum_g) noexcept nogil:
    """One plane: sum(g * x), sum(g), and d = g * s, in a single pass (d may be g).

    Eight running sums per quantity break the add-latency chain and let GCC vectorize the
    reduction without reassociating float math on its own.
    """
    cdef float sx[8]
    cdef float sg[8]
    cdef Py_ssize_t i, k, blocks = n - n % 8
    cdef float gi
    for k in range(8):
        sx[k] = 0
        sg[k] = 0
    i = 0
    while i < blocks:
        for k in range(8):
            gi = g[i + k]
            sx[k] = sx[k] + gi * x[i + k]
            sg[k] = sg[k] + gi
            if want_dx:
                d[i + k] = gi * s
        i = i + 8
    for i in range(blocks, n):
        gi = g[i]
        sx[0] = sx[0] + gi * x[i]
        sg[0] = sg[0] + gi
        if want_dx:
            d[i] = gi * s
    for k in range(8):
        sum_gx[0] += sx[k]
        sum_g[0] += sg[k]


def scale_forward(const float[:, :, ::1] x, const float[::1] scale, const float[::1] bias,
                  float[:, :, ::1] y, float[:, :, ::1] saved):
    """y[o, d, :] = x[o, d, :] * scale[d] (+ bias[d] unless None); copies x into `saved` first
    unless None (an in-place layer needs x for backward). y may be x."""
    cdef Py_ssize_t O = x.shape[0], D = x.shape[1], inner = x.shape[2], p, o, d
    cdef bint has_bias = bias is not None, keep = saved is not None
    cdef float b
    need_shape("scale_forward", "scale", dims(scale.shape, 1), (D,))
    if has_bias:
        need_shape("scale_forward", "bias", dims(bias.shape, 1), (D,))
    need_shape("scale_forward", "y", dims(y.shape, 3), dims(x.shape, 3))
    if keep:
        need_shape("scale_forward", "saved", dims(saved.shape, 3), dims(x.shape, 3))
    if O == 0 or D == 0 or inner == 0:
        return
    for p in prange(O * D, nogil=True, schedule="static", num_threads=threads_for(O * D * inner)):
        o = p // D
        d = p % D
        b = bias[d] if has_bias else 0
        _affine(&x[o, d, 0], &y[o, d, 0], &saved[o, d, 0] if keep else NULL, inner, scale[d], b,
                keep)


def scale_backward(const float[:, :, ::1] x, const float[:, :, ::1] dy, const float[::1] scale,
                   float[:, :, ::1] dx, double[::1] scale_diff, double[::1] bias_diff):
    """Per channel d: scale_diff[d] += sum(dy * x), bias_diff[d] += sum(dy) (each skipped when
    None, float64 sums of per-plane float sums), then dx = dy * scale[d] unless dx is None.
    dx may be dy (the sums of a plane are taken before it is overwritten)."""
    cdef Py_ssize_t O = x.shape[0], D = x.shape[1], inner = x.shape[2], o, d
    cdef bint want_s = scale_diff is not None, want_b = bias_diff is not None
    cdef bint want_dx = dx is not None
    cdef double acc_s, acc_b
    need_shape("scale_backward", "dy", dims(dy.shape, 3), dims(x.shape, 3))
    need_shape("scale_backward", "scale", dims(scale.shape, 1), (D,))
    if want_dx:
        need_shape("scale_backward", "dx", dims(dx.shape, 3), dims(x.shape, 3))
    if want_s:
        need_shape("scale_backward", "scale_diff", dims(scale_diff.shape, 1), (D,))
    if want_b:
        need_shape("scale_backward", "bias_diff", dims(bias_diff.shape, 1), (D,))
    if O == 0 or D == 0 or inner == 0:
        return
    for d in prange(D, nogil=True, schedule="static", num_threads=threads_for(O * D * inner)):
        acc_s = 0
        acc_b = 0
        for o in range(O):
            _plane_backward(&x[o, d, 0], &dy[o, d, 0], &dx[o, d, 0] if want_dx else NULL, inner,
                            scale[d], want_dx, &acc_s, &acc_b)
        if want_s:
            scale_diff[d] += acc_s
        if want_b:
            bias_diff[d] += acc_b


# ---------------------------------------------------------------------------------------------
# Threaded copies and sums: Eltwise and Split move whole blobs, which NumPy does on one thread
# (a ResNet-50 Eltwise sum at 16 x 256 x 56 x 56: 4.3 ms in NumPy, 3.7 here; a copy 3.2 and 1.5).

DEF CHUNK = 16384           # floats a task: 64 KB


def add(const float[::1] a, const float[::1] b, float[::1] out):
    """out = a + b (out may be a or b)."""
    cdef Py_ssize_t n = a.shape[0], task, i, lo, hi
    need_shape("add", "b", (b.shape[0],), (n,))
    need_shape("add", "out", (out.shape[0],), (n,))
    if n == 0:
        return
    for task in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static",
                       num_threads=threads_for(n)):
        lo = task * CHUNK
        hi = min(lo + CHUNK, n)
        for i in range(lo, hi):
            out[i] = a[i] + b[i]


def copy(const float[::1] src, float[::1] dst):
    """dst = src."""
    cdef Py_ssize_t n = src.shape[0], task, lo
    need_shape("copy", "dst", (dst.shape[0],), (n,))
    if n == 0:
        return
    for task in prange((n + CHUNK - 1) // CHUNK, nogil=True, schedule="static",
                       num_threads=threads_for(n)):
        lo = task * CHUNK
        memcpy(&dst[lo], &src[lo], min(CHUNK, n - lo) * sizeof(float))
