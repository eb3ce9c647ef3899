# cython: language_level=3
"""Kernels of the Intel family (caffepy/layers/intel.py): the SIMD-blocked layout that
IntelPack / IntelUnpack bracket, and the blocked Convolution (im2col + sgemm), Pooling and LRN.
The blocked Convolution's other algorithm, Winograd, is winograd.pyx (shared with the
channels-last layout).

A blocked tensor is float32 [N, Cb, H, W, V], C-contiguous: channel c sits in block c // V,
lane c % V, where V is the vector width (8 floats for AVX2, 16 for AVX-512); lanes past the real
channel count C are padding: every kernel here writes zeros there and never reads them as data
(so an elementwise layer that maps 0 to something else, Sigmoid say, cannot leak into real
lanes). The innermost loops run over the V lanes of one pixel, which are contiguous, so they
vectorize; the outer loops are OpenMP-parallel over images, blocks or pixels.

Conventions (Caffe's): top and bottom diffs are OVERWRITTEN, weight and bias diffs ACCUMULATE.
Every kernel writes into buffers the caller allocated (scratch included) and runs without the GIL.
The NumPy references are in caffepy/kernels/reference/intel.py (pack, unpack) and, for the
computations, the NCHW references of reference/vision.py and reference/normalization.py on the
unpacked arrays; tests/layers/test_intel.py compares them.
"""

from cython.parallel cimport prange, threadid
cimport openmp
from libc.float cimport FLT_MAX
from libc.math cimport powf, sqrtf
from libc.stdint cimport int32_t
from libc.string cimport memcpy, memset

from blas cimport gemm_ld
from rules cimport dims, need, need_shape, threads_for


# ---------------------------------------------------------------------------------------------
# Pack / unpack

def pack(const float[:, :, :, ::1] x, float[:, :, :, :, ::1] y):
    """y[n, c // V, h, w, c % V] = x[n, c, h, w]; lanes past C are zeroed."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int Cb = y.shape[1], V = y.shape[4]
    need(V > 0, "pack", "y", "needs a block width V > 0", V)
    need_shape("pack", "y", dims(y.shape, 5), (N, (C + V - 1) // V, H, W, V))
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, item
    if N * Cb == 0 or HW == 0:
        return
    with nogil:
        for item in prange(<Py_ssize_t>N * Cb, schedule="static",
                           num_threads=threads_for(<Py_ssize_t>N * Cb * HW * V)):
            _pack_plane(&x[0, 0, 0, 0] + (item // Cb) * C * HW, &y[0, 0, 0, 0, 0] + item * HW * V,
                        <int>(item % Cb), C, HW, V)


cdef void _pack_plane(const float* im, float* dst, int cb, int C, Py_ssize_t HW, int V) noexcept nogil:
    # pixel-major so the blocked plane is written once, front to back
    cdef int v, nv = min(V, C - cb * V)
    cdef Py_ssize_t p
    cdef const float* src = im + cb * V * HW
    for p in range(HW):
        for v in range(nv):
            dst[v] = src[v * HW + p]
        for v in range(nv, V):
            dst[v] = 0.0
        dst += V


def unpack(const float[:, :, :, :, ::1] y, float[:, :, :, ::1] x):
    """x[n, c, h, w] = y[n, c // V, h, w, c % V] for the C channels of x (overwritten)."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int Cb = y.shape[1], V = y.shape[4]
    need(V > 0, "unpack", "y", "needs a block width V > 0", V)
    need_shape("unpack", "y", dims(y.shape, 5), (N, (C + V - 1) // V, H, W, V))
    cdef Py_ssize_t HW = <Py_ssize_t>H * W, item, p
    cdef int c
    cdef const float* src
    cdef float* dst
    if N * C == 0 or HW == 0:
        return
    with nogil:
        for item in prange(<Py_ssize_t>N * C, schedule="static",
                           num_threads=threads_for(<Py_ssize_t>N * C * HW * V)):
            c = <int>(item % C)
            src = &y[0, 0, 0, 0, 0] + ((item // C) * Cb + c // V) * HW * V + c % V
            dst = &x[0, 0, 0, 0] + item * HW
            for p in range(HW):
                dst[p] = src[p * V]


cdef void _plane_sums(const float* plane, Py_ssize_t HW, int V, double* out) noexcept nogil:
    """out[v] += sum of plane[:, v] over the HW pixels of a blocked plane (V <= 64). The lanes
    of 16 pixels at a time add up in a local (thread-private, unaliased) float array."""
    cdef float acc[64]
    cdef Py_ssize_t p
    cdef int v
    for v in range(V):
        acc[v] = 0.0
    for p in range(HW):
        for v in range(V):
            acc[v] = acc[v] + plane[p * V + v]
    for v in range(V):
        out[v] += acc[v]


def channel_sums(const float[:, :, :, :, ::1] x, double[::1] out):
    """out[cb * V + v] = sum of x[:, cb, :, :, v] (overwritten): a blocked blob's per-channel
    sums (a bias gradient), padding lanes included. Threads take blocks of channels; a plane
    sums in float, the planes in float64."""
    cdef int N = x.shape[0], Cb = x.shape[1], V = x.shape[4], cb, n, v
    cdef Py_ssize_t HW = <Py_ssize_t>x.shape[2] * x.shape[3]
    need_shape("channel_sums", "out", dims(out.shape, 1), (Cb * V,))
    need(V <= 64, "channel_sums", "x", "needs a block width of at most 64", V)
    out[:] = 0
    if N * Cb * V * HW == 0:
        return
    with nogil:
        for cb in prange(Cb, schedule="static",
                         num_threads=threads_for(<Py_ssize_t>N * Cb * HW * V)):
            for n in range(N):
                _plane_sums(&x[n, cb, 0, 0, 0], HW, V, &out[cb * V])


# ---------------------------------------------------------------------------------------------
# Convolution: blocked im2col + one sgemm per group, per image.
#
# For image n, col[P, Ktot] holds one row per output pixel; Y[P, O] = col_g @ Wt_g per group,
# then Y is written into the blocked top with the bias. Column order within a group:
#   vec   (channels per group a multiple of V): ((cb * kh + i) * kw + j) * V + v, so a row is
#         built from runs of kw * V contiguous floats of the blocked image;
#   plain (otherwise, e.g. conv1's 3 channels): Caffe's (c * kh + i) * kw + j, so padding lanes
#         cost no FLOPs.
# The weight is given as Wt[group, Kg, Og] in the same order (the layer builds it from Caffe's
# [O, C/g, kh, kw]). Threads take whole images, each with its own col / Y / weight-diff buffers
# and a single-threaded BLAS; with one image, one thread or a small problem (the thread rule of
# rules.pxd), the BLAS threads each GEMM instead.

include "blas_threads.pxi"


def max_threads():
    """Threads the kernels use (OMP_NUM_THREADS, else all cores): size of per-thread scratch."""
    return openmp.omp_get_max_threads()


cdef struct BGeom:
    int C, Cb, H, W, O, Ob, oh, ow, V
    int kh, kw, ph, pw, sh, sw, dh, dw, group
    int Cg, Og, Kg, Ktot, P
    bint vec


cdef BGeom _bgeom(int C, int Cb, int H, int W, int V, int O, int kh, int kw, int ph, int pw,
                  int sh, int sw, int dh, int dw, int group, str kernel) except *:
    cdef BGeom g
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and dh >= 1 and dw >= 1 and ph >= 0
         and pw >= 0, kernel, "geometry", "kernel, stride and dilation must be >= 1 and pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} dilation {dh}x{dw} pad {ph}x{pw}")
    need(group >= 1 and C % group == 0 and O % group == 0, kernel, "group",
         f"must divide {C} input and {O} output channels", group)
    need(V >= 1 and Cb == (C + V - 1) // V, kernel, "x", f"needs the blocks of width {V} that "
         f"hold {C} channels", f"{Cb} blocks")
    g.C, g.Cb, g.H, g.W, g.V, g.O = C, Cb, H, W, V, O
    g.Ob = (O + V - 1) // V
    g.kh, g.kw, g.ph, g.pw, g.sh, g.sw, g.dh, g.dw, g.group = kh, kw, ph, pw, sh, sw, dh, dw, group
    g.oh = (H + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    g.ow = (W + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    need(g.oh >= 1 and g.ow >= 1, kernel, "geometry", f"kernel {kh}x{kw} (dilation {dh}x{dw}, "
         f"pad {ph}x{pw}) does not fit the image", f"{H}x{W}")
    g.Cg = C // group
    g.Og = O // group
    g.Kg = g.Cg * kh * kw
    g.Ktot = C * kh * kw
    g.P = g.oh * g.ow
    g.vec = g.Cg % V == 0
    return g


def conv_uses_vec_order(int C, int group, int V):
    """True when the column / weight order is the vector one (channels per group % V == 0)."""
    return (C // group) % V == 0


cdef inline void _jrange(int ix0, int kw, int W, int* lo, int* hi) noexcept nogil:
    """Taps j in [lo, hi) keep 0 <= ix0 + j < W (dilation 1)."""
    cdef int a = -ix0 if ix0 < 0 else 0
    cdef int b = W - ix0
    if b > kw:
        b = kw
    if a > kw:
        a = kw
    if b < a:
        b = a
    lo[0] = a
    hi[0] = b


cdef void _im2col_b(const float* x, const BGeom* g, float* col) noexcept nogil:
    cdef int oy, ox, i, j, cb, c, v, iy, ix, ix0, lo = 0, hi = 0, V = g.V
    cdef Py_ssize_t plane = <Py_ssize_t>g.H * g.W * V
    cdef float* row
    cdef float* dst
    cdef const float* src
    for oy in range(g.oh):
        for ox in range(g.ow):
            row = col + (<Py_ssize_t>oy * g.ow + ox) * g.Ktot
            ix0 = ox * g.sw - g.pw
            if g.vec:
                for cb in range(g.Cb):
                    for i in range(g.kh):
                        iy = oy * g.sh - g.ph + i * g.dh
                        dst = row + <Py_ssize_t>(cb * g.kh + i) * g.kw * V
                        if iy < 0 or iy >= g.H:
                            memset(dst, 0, g.kw * V * sizeof(float))
                            continue
                        src = x + cb * plane + <Py_ssize_t>iy * g.W * V
                        if g.dw == 1:
                            _jrange(ix0, g.kw, g.W, &lo, &hi)
                            memset(dst, 0, lo * V * sizeof(float))
                            memcpy(dst + lo * V, src + (ix0 + lo) * V, (hi - lo) * V * sizeof(float))
                            memset(dst + hi * V, 0, (g.kw - hi) * V * sizeof(float))
                        else:
                            for j in range(g.kw):
                                ix = ix0 + j * g.dw
                                if ix < 0 or ix >= g.W:
                                    memset(dst + j * V, 0, V * sizeof(float))
                                else:
                                    memcpy(dst + j * V, src + ix * V, V * sizeof(float))
            else:
                if g.dw == 1:
                    _jrange(ix0, g.kw, g.W, &lo, &hi)
                for c in range(g.C):
                    for i in range(g.kh):
                        iy = oy * g.sh - g.ph + i * g.dh
                        dst = row + (c * g.kh + i) * g.kw
                        if iy < 0 or iy >= g.H:
                            memset(dst, 0, g.kw * sizeof(float))
                            continue
                        src = x + (c // V) * plane + (<Py_ssize_t>iy * g.W + ix0) * V + c % V
                        if g.dw == 1:
                            # taps inside the row copy without a test each (a strided gather)
                            for j in range(lo):
                                dst[j] = 0.0
                            for j in range(lo, hi):
                                dst[j] = src[j * V]
                            for j in range(hi, g.kw):
                                dst[j] = 0.0
                        else:
                            for j in range(g.kw):
                                ix = ix0 + j * g.dw
                                dst[j] = src[j * g.dw * V] if ix >= 0 and ix < g.W else 0.0


cdef void _col2im_b(const float* col, const BGeom* g, float* x) noexcept nogil:
    """x (zeroed by the caller) += the columns scattered back onto the blocked image."""
    cdef int oy, ox, i, j, cb, c, t, iy, ix, ix0, lo, hi, V = g.V
    cdef Py_ssize_t plane = <Py_ssize_t>g.H * g.W * V
    cdef const float* row
    cdef const float* src
    cdef float* dst
    for oy in range(g.oh):
        for ox in range(g.ow):
            row = col + (<Py_ssize_t>oy * g.ow + ox) * g.Ktot
            ix0 = ox * g.sw - g.pw
            if g.vec:
                for cb in range(g.Cb):
                    for i in range(g.kh):
                        iy = oy * g.sh - g.ph + i * g.dh
                        if iy < 0 or iy >= g.H:
                            continue
                        src = row + <Py_ssize_t>(cb * g.kh + i) * g.kw * V
                        dst = x + cb * plane + <Py_ssize_t>iy * g.W * V
                        if g.dw == 1:
                            _jrange(ix0, g.kw, g.W, &lo, &hi)
                            dst = dst + (ix0 + lo) * V
                            src = src + lo * V
                            for t in range((hi - lo) * V):
                                dst[t] += src[t]
                        else:
                            for j in range(g.kw):
                                ix = ix0 + j * g.dw
                                if ix >= 0 and ix < g.W:
                                    for t in range(V):
                                        dst[ix * V + t] += src[j * V + t]
            else:
                for c in range(g.C):
                    for i in range(g.kh):
                        iy = oy * g.sh - g.ph + i * g.dh
                        if iy < 0 or iy >= g.H:
                            continue
                        src = row + (c * g.kh + i) * g.kw
                        dst = x + (c // V) * plane + <Py_ssize_t>iy * g.W * V + c % V
                        for j in range(g.kw):
                            ix = ix0 + j * g.dw
                            if ix >= 0 and ix < g.W:
                                dst[ix * V] += src[j]


cdef void _conv_fwd_image(const BGeom* g, const float* x, const float* wt, const float* bias,
                          float* y, float* col, float* ybuf) noexcept nogil:
    cdef int gr, ob, v, nv, V = g.V
    cdef float b
    cdef Py_ssize_t p
    cdef float* dst
    cdef const float* src
    _im2col_b(x, g, col)
    # Y^T[O, P] = Wt^T @ col^T per group: BLAS sees the long pixel side as its M (measured
    # faster with OpenBLAS than Y[P, O] = col @ Wt on AlexNet's conv2-conv5 shapes)
    for gr in range(g.group):
        gemm_ld(True, True, g.Og, g.P, g.Kg, 1.0, wt + <Py_ssize_t>gr * g.Kg * g.Og, g.Og,
                col + gr * g.Kg, g.Ktot, 0.0, ybuf + <Py_ssize_t>gr * g.Og * g.P, g.P)
    for ob in range(g.Ob):
        nv = g.O - ob * V
        if nv > V:
            nv = V
        dst = y + ob * <Py_ssize_t>g.P * V
        for v in range(nv):
            src = ybuf + <Py_ssize_t>(ob * V + v) * g.P
            b = bias[ob * V + v] if bias != NULL else 0.0
            for p in range(g.P):
                dst[p * V + v] = src[p] + b
        for v in range(nv, V):
            for p in range(g.P):
                dst[p * V + v] = 0.0


cdef _check_scratch(str kernel, const float[:, :, ::1] col, const float[:, :, ::1] ybuf,
                    const BGeom* g):
    """col[T, P, Ktot] and ybuf[>= T, P, O] for T >= 1 threads."""
    need(col.shape[0] >= 1 and col.shape[1] == g.P and col.shape[2] == g.Ktot, kernel, "col",
         f"needs shape (threads, {g.P}, {g.Ktot})", dims(col.shape, 3))
    need(ybuf.shape[0] >= col.shape[0] and ybuf.shape[1] == g.P and ybuf.shape[2] == g.O, kernel,
         "ybuf", f"needs shape (>= {col.shape[0]}, {g.P}, {g.O})", dims(ybuf.shape, 3))


def conv_forward(const float[:, :, :, :, ::1] x, const float[:, :, ::1] wt, const float[::1] bias,
                 float[:, :, :, :, ::1] y, float[:, :, ::1] col, float[:, :, ::1] ybuf,
                 int C, int O, int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw,
                 int group):
    """y (blocked, O channels) = conv(x (blocked, C channels), Wt) + bias (empty: no bias).

    Scratch: col[T, P, Ktot], ybuf[T, P, O] for T threads (T = 1 lets BLAS thread each GEMM).
    """
    cdef BGeom g = _bgeom(C, x.shape[1], x.shape[2], x.shape[3], x.shape[4], O, kh, kw, ph, pw,
                          sh, sw, dh, dw, group, "conv_forward")
    cdef int N = x.shape[0], T = col.shape[0], nt, n, tid, saved = 0
    need_shape("conv_forward", "wt", dims(wt.shape, 3), (group, g.Kg, g.Og))
    need_shape("conv_forward", "y", dims(y.shape, 5), (N, g.Ob, g.oh, g.ow, g.V))
    _check_scratch("conv_forward", col, ybuf, &g)
    need(bias.shape[0] in (0, O), "conv_forward", "bias", f"needs {O} values or none",
         bias.shape[0])
    cdef const float* b = &bias[0] if bias.shape[0] else NULL
    cdef Py_ssize_t xs = <Py_ssize_t>g.Cb * g.H * g.W * g.V, ys = <Py_ssize_t>g.Ob * g.P * g.V
    cdef Py_ssize_t cs = <Py_ssize_t>g.P * g.Ktot, bs = <Py_ssize_t>g.P * O
    if N == 0:
        return
    nt = _task_threads(T, N, <Py_ssize_t>N * g.P * g.O * g.Kg)
    with nogil:
        if nt == 1:
            for n in range(N):
                _conv_fwd_image(&g, &x[0, 0, 0, 0, 0] + n * xs, &wt[0, 0, 0], b,
                                &y[0, 0, 0, 0, 0] + n * ys, &col[0, 0, 0], &ybuf[0, 0, 0])
        else:
            saved = _blas_get_threads()
            _blas_set_threads(1)
            for n in prange(N, num_threads=nt, schedule="static"):
                tid = threadid()
                _conv_fwd_image(&g, &x[0, 0, 0, 0, 0] + n * xs, &wt[0, 0, 0], b,
                                &y[0, 0, 0, 0, 0] + n * ys, &col[0, 0, 0] + tid * cs,
                                &ybuf[0, 0, 0] + tid * bs)
            _blas_set_threads(saved)


cdef void _conv_bwd_image(const BGeom* g, const float* x, const float* wt, const float* dy,
                          float* dx, float* dwt, float* db, float* col, float* ybuf) noexcept nogil:
    cdef int gr, ob, v, nv, o, V = g.V
    cdef Py_ssize_t p
    cdef const float* src
    # dY[P, O] from the blocked top diff
    for ob in range(g.Ob):
        nv = g.O - ob * V
        if nv > V:
            nv = V
        src = dy + ob * <Py_ssize_t>g.P * V
        for p in range(g.P):
            for v in range(nv):
                ybuf[p * g.O + ob * V + v] = src[p * V + v]
    if db != NULL:
        for p in range(g.P):
            for o in range(g.O):
                db[o] += ybuf[p * g.O + o]
    if dwt != NULL:
        _im2col_b(x, g, col)
        for gr in range(g.group):
            gemm_ld(True, False, g.Kg, g.Og, g.P, 1.0, col + gr * g.Kg, g.Ktot,
                    ybuf + gr * g.Og, g.O, 1.0, dwt + <Py_ssize_t>gr * g.Kg * g.Og, g.Og)
    if dx != NULL:
        for gr in range(g.group):
            gemm_ld(False, True, g.P, g.Kg, g.Og, 1.0, ybuf + gr * g.Og, g.O,
                    wt + <Py_ssize_t>gr * g.Kg * g.Og, g.Og, 0.0, col + gr * g.Kg, g.Ktot)
        memset(dx, 0, <Py_ssize_t>g.Cb * g.H * g.W * V * sizeof(float))
        _col2im_b(col, g, dx)


def conv_backward(const float[:, :, :, :, ::1] x, const float[:, :, ::1] wt,
                  const float[:, :, :, :, ::1] dy, float[:, :, :, :, ::1] dx,
                  float[:, :, :, ::1] dwt, float[:, ::1] db, float[:, :, ::1] col,
                  float[:, :, ::1] ybuf, int C, int O, int kh, int kw, int ph, int pw, int sh,
                  int sw, int dh, int dw, int group, bint need_x, bint need_w, bint need_b):
    """Gradients of conv_forward.

    dx (blocked, overwritten) if need_x; dwt[0] = sum over images of the Wt gradient and
    db[0] = the bias gradient if need_w / need_b (dwt[T, group, Kg, Og] and db[T, O] are
    per-thread scratch: the caller adds row 0 into its diffs). col / ybuf as for conv_forward.
    """
    cdef BGeom g = _bgeom(C, x.shape[1], x.shape[2], x.shape[3], x.shape[4], O, kh, kw, ph, pw,
                          sh, sw, dh, dw, group, "conv_backward")
    cdef int N = x.shape[0], T = col.shape[0], nt, n, tid, t, saved = 0
    need_shape("conv_backward", "wt", dims(wt.shape, 3), (group, g.Kg, g.Og))
    need_shape("conv_backward", "dy", dims(dy.shape, 5), (N, g.Ob, g.oh, g.ow, g.V))
    if need_x:
        need_shape("conv_backward", "dx", dims(dx.shape, 5), dims(x.shape, 5))
    if need_w:
        need(dwt.shape[0] >= T and dims(dwt.shape + 1, 3) == (group, g.Kg, g.Og),
             "conv_backward", "dwt", f"needs shape (>= {T}, {group}, {g.Kg}, {g.Og})",
             dims(dwt.shape, 4))
    if need_b:
        need(db.shape[0] >= T and db.shape[1] == O, "conv_backward", "db",
             f"needs shape (>= {T}, {O})", dims(db.shape, 2))
    _check_scratch("conv_backward", col, ybuf, &g)
    cdef Py_ssize_t xs = <Py_ssize_t>g.Cb * g.H * g.W * g.V, ys = <Py_ssize_t>g.Ob * g.P * g.V
    cdef Py_ssize_t cs = <Py_ssize_t>g.P * g.Ktot, bs = <Py_ssize_t>g.P * O
    cdef Py_ssize_t ws = <Py_ssize_t>group * g.Kg * g.Og, i
    cdef float* dxp = &dx[0, 0, 0, 0, 0] if need_x else NULL
    cdef float* dwp = &dwt[0, 0, 0, 0] if need_w else NULL
    cdef float* dbp = &db[0, 0] if need_b else NULL
    if N == 0:
        return
    nt = _task_threads(T, N, <Py_ssize_t>N * g.P * g.O * g.Kg)
    with nogil:
        for t in range(nt):
            if need_w:
                memset(dwp + t * ws, 0, ws * sizeof(float))
            if need_b:
                memset(dbp + t * O, 0, O * sizeof(float))
        if nt == 1:
            for n in range(N):
                _conv_bwd_image(&g, &x[0, 0, 0, 0, 0] + n * xs, &wt[0, 0, 0],
                                &dy[0, 0, 0, 0, 0] + n * ys, dxp + n * xs if need_x else NULL,
                                dwp, dbp, &col[0, 0, 0], &ybuf[0, 0, 0])
        else:
            saved = _blas_get_threads()
            _blas_set_threads(1)
            for n in prange(N, num_threads=nt, schedule="static"):
                tid = threadid()
                _conv_bwd_image(&g, &x[0, 0, 0, 0, 0] + n * xs, &wt[0, 0, 0],
                                &dy[0, 0, 0, 0, 0] + n * ys, dxp + n * xs if need_x else NULL,
                                dwp + tid * ws if need_w else NULL,
                                dbp + tid * O if need_b else NULL,
                                &col[0, 0, 0] + tid * cs, &ybuf[0, 0, 0] + tid * bs)
            _blas_set_threads(saved)
            for t in range(1, nt):
                if need_w:
                    for i in prange(ws, schedule="static", num_threads=threads_for(ws)):
                        dwp[i] += dwp[t * ws + i]
                if need_b:
                    for i in range(O):
                        dbp[i] += dbp[t * O + i]


# ---------------------------------------------------------------------------------------------
# Pooling on blocked planes [H, W, V]: windows as Caffe's (see cext/vision.pyx).

cdef _check_pool(str kernel, str xname, x, str yname, y, int kh, int kw, int sh, int sw, int ph,
                 int pw):
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and ph >= 0 and pw >= 0, kernel,
         "geometry", "kernel and stride must be >= 1, pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} pad {ph}x{pw}")
    need(x.shape[4] <= 64, kernel, xname, "needs a block width of at most 64", x.shape[4])
    need(x.shape[0] == y.shape[0] and x.shape[1] == y.shape[1] and x.shape[4] == y.shape[4],
         kernel, yname, f"does not fit {xname} {tuple(x.shape[:5])}", tuple(y.shape[:5]))


def pool_max_forward(const float[:, :, :, :, ::1] x, float[:, :, :, :, ::1] y,
                     int32_t[:, :, :, :, ::1] mask, int kh, int kw, int sh, int sw, int ph, int pw):
    """y = max over each window (padding ignored); mask = h * W + w of the first maximum."""
    _check_pool("pool_max_forward", "x", x, "y", y, kh, kw, sh, sw, ph, pw)
    need_shape("pool_max_forward", "mask", dims(mask.shape, 5), dims(y.shape, 5))
    cdef int H = x.shape[2], W = x.shape[3], oh = y.shape[2], ow = y.shape[3], V = x.shape[4]
    cdef Py_ssize_t planes = <Py_ssize_t>x.shape[0] * x.shape[1], pl
    if planes == 0 or oh * ow == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                         num_threads=threads_for(planes * oh * ow * V * kh * kw)):
            if _MAXPOOL4 and V % 4 == 0:
                _max_plane4(&x[0, 0, 0, 0, 0] + pl * H * W * V,
                            &y[0, 0, 0, 0, 0] + pl * oh * ow * V,
                            &mask[0, 0, 0, 0, 0] + pl * oh * ow * V, H, W, oh, ow, V,
                            kh, kw, sh, sw, ph, pw)
            else:
                _max_plane(&x[0, 0, 0, 0, 0] + pl * H * W * V, &y[0, 0, 0, 0, 0] + pl * oh * ow * V,
                           &mask[0, 0, 0, 0, 0] + pl * oh * ow * V, H, W, oh, ow, V,
                           kh, kw, sh, sw, ph, pw)


cdef extern from "intel_maxpool.h":
    bint _MAXPOOL4 "CAFFEPY_MAXPOOL4"
    void _max_plane4 "caffepy_max_plane4"(const float* x, float* y, int32_t* mask, int H, int W,
                                          int oh, int ow, int V, int kh, int kw, int sh, int sw,
                                          int ph, int pw) noexcept nogil


cdef void _max_plane(const float* x, float* y, int32_t* mask, int H, int W, int oh, int ow, int V,
                     int kh, int kw, int sh, int sw, int ph, int pw) noexcept nogil:
    cdef float m[64]
    cdef int32_t idx[64]
    cdef int py, px, h, w, hs, he, ws, we, v
    cdef int32_t at
    cdef const float* src
    cdef float* out = y
    cdef int32_t* mk = mask
    for py in range(oh):
        hs = py * sh - ph
        he = min(hs + kh, H)
        hs = max(hs, 0)
        for px in range(ow):
            ws = px * sw - pw
            we = min(ws + kw, W)
            ws = max(ws, 0)
            for v in range(V):
                m[v] = -FLT_MAX
                idx[v] = -1
            for h in range(hs, he):
                for w in range(ws, we):
                    src = x + (h * W + w) * V
                    at = h * W + w
                    # strict '>' keeps the first maximum (Caffe's rule)
                    for v in range(V):
                        idx[v] = at if src[v] > m[v] else idx[v]
                        m[v] = src[v] if src[v] > m[v] else m[v]
            for v in range(V):
                out[v] = m[v]
                mk[v] = idx[v]
            out += V
            mk += V


def pool_max_backward(const float[:, :, :, :, ::1] dy, const int32_t[:, :, :, :, ::1] mask,
                      float[:, :, :, :, ::1] dx):
    """dx = top diffs routed to their argmax (zeroed first: overwritten)."""
    need_shape("pool_max_backward", "mask", dims(mask.shape, 5), dims(dy.shape, 5))
    need(dims(dx.shape, 2) == dims(dy.shape, 2) and dx.shape[4] == dy.shape[4],
         "pool_max_backward", "dx", f"does not fit dy {dims(dy.shape, 5)}", dims(dx.shape, 5))
    cdef int H = dx.shape[2], W = dx.shape[3], oh = dy.shape[2], ow = dy.shape[3], V = dx.shape[4]
    cdef Py_ssize_t planes = <Py_ssize_t>dx.shape[0] * dx.shape[1], pl, p
    cdef int v
    cdef float* d
    cdef const float* g
    cdef const int32_t* mk
    if planes == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                         num_threads=threads_for(planes * (<Py_ssize_t>H * W + oh * ow) * V)):
            d = &dx[0, 0, 0, 0, 0] + pl * H * W * V
            g = &dy[0, 0, 0, 0, 0] + pl * oh * ow * V
            mk = &mask[0, 0, 0, 0, 0] + pl * oh * ow * V
            memset(d, 0, <Py_ssize_t>H * W * V * sizeof(float))
            for p in range(<Py_ssize_t>oh * ow):
                for v in range(V):
                    if mk[p * V + v] >= 0:
                        d[mk[p * V + v] * V + v] += g[p * V + v]


def pool_ave_forward(const float[:, :, :, :, ::1] x, float[:, :, :, :, ::1] y,
                     int kh, int kw, int sh, int sw, int ph, int pw):
    """y = window sum / window size clipped to the padded extent (Caffe's AVE)."""
    _check_pool("pool_ave_forward", "x", x, "y", y, kh, kw, sh, sw, ph, pw)
    cdef int H = x.shape[2], W = x.shape[3], oh = y.shape[2], ow = y.shape[3], V = x.shape[4]
    cdef Py_ssize_t planes = <Py_ssize_t>x.shape[0] * x.shape[1], pl
    if planes == 0 or oh * ow == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                         num_threads=threads_for(planes * oh * ow * V * kh * kw)):
            _ave_plane(<float*>&x[0, 0, 0, 0, 0] + pl * H * W * V, &y[0, 0, 0, 0, 0] + pl * oh * ow * V,
                       H, W, oh, ow, V, kh, kw, sh, sw, ph, pw, False)


def pool_ave_backward(const float[:, :, :, :, ::1] dy, float[:, :, :, :, ::1] dx,
                      int kh, int kw, int sh, int sw, int ph, int pw):
    """dx = each top diff spread evenly over its window (zeroed first: overwritten)."""
    _check_pool("pool_ave_backward", "dx", dx, "dy", dy, kh, kw, sh, sw, ph, pw)
    cdef int H = dx.shape[2], W = dx.shape[3], oh = dy.shape[2], ow = dy.shape[3], V = dx.shape[4]
    cdef Py_ssize_t planes = <Py_ssize_t>dx.shape[0] * dx.shape[1], pl
    if planes == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                         num_threads=threads_for(planes * oh * ow * V * kh * kw)):
            memset(&dx[0, 0, 0, 0, 0] + pl * H * W * V, 0, <Py_ssize_t>H * W * V * sizeof(float))
            _ave_plane(&dx[0, 0, 0, 0, 0] + pl * H * W * V, <float*>&dy[0, 0, 0, 0, 0] + pl * oh * ow * V,
                       H, W, oh, ow, V, kh, kw, sh, sw, ph, pw, True)


cdef void _ave_plane(float* x, float* y, int H, int W, int oh, int ow, int V, int kh, int kw,
                     int sh, int sw, int ph, int pw, bint backward) noexcept nogil:
    # forward: y = mean of x over the window; backward: x += y / window size
    cdef float acc[64]
    cdef int py, px, h, w, hs, he, ws, we, v
    cdef float inv
    cdef float* cell
    cdef float* out
    for py in range(oh):
        hs = py * sh - ph
        he = min(hs + kh, H + ph)
        for px in range(ow):
            ws = px * sw - pw
            we = min(ws + kw, W + pw)
            inv = 1.0 / ((he - hs) * (we - ws))
            out = y + (py * ow + px) * V
            if backward:
                for v in range(V):
                    acc[v] = out[v] * inv
                for h in range(max(hs, 0), min(he, H)):
                    for w in range(max(ws, 0), min(we, W)):
                        cell = x + (h * W + w) * V
                        for v in range(V):
                            cell[v] += acc[v]
            else:
                for v in range(V):
                    acc[v] = 0.0
                for h in range(max(hs, 0), min(he, H)):
                    for w in range(max(ws, 0), min(we, W)):
                        cell = x + (h * W + w) * V
                        for v in range(V):
                            acc[v] += cell[v]
                for v in range(V):
                    out[v] = acc[v] * inv


# ---------------------------------------------------------------------------------------------
# LRN across channels. scale = k + alpha/size * sum of x^2 over the `size` channels centred on c
# (zero past the ends and past C), y = x * scale^-beta.
#
# A task takes a tile of L pixels of one image and walks its blocks in order; a block's pixels
# are a contiguous run of L * V floats, streamed in and out by the loop that computes on them.
# The window of a lane reaches into the blocks on both sides.
#   fast path (FMA build, V = 8 or 16, local_size <= 9, beta 0.75: AlexNet's and GoogLeNet's
#     LRN): per pixel, the quarters (4 lanes) of the block with the last quarter of the block
#     before and the first of the block after; each window sum is a few in-register shifts
#     across neighbouring quarters (alignr), and the power and the output follow in the same
#     iteration, so the memory traffic overlaps the square roots and the division that bound
#     the kernel. 128-bit vectors: a 256-bit shift across halves costs a lane permute, and this
#     EPYC runs 256-bit ops as two halves anyway (measured slower).
#   generic path (any width, size, beta): per block, each pixel's window row of pre + V + pre
#     floats is filled (the `pre` neighbouring channels one float each), the window sums of the
#     tile are formed, then the power in one contiguous loop.
# The backward recomputes the scale from x (cheaper than storing and re-reading a scale blob:
# no extra blob and less memory traffic) in two passes: the first writes dy * scale^-beta into
# dx and keeps dy * x * scale^(-beta-1) per block, the second subtracts cache * x * the channel
# window of what was kept, which needs the blocks on both sides, so it runs one block behind
# (fast path: three kept blocks; generic path: the whole tile).

cdef extern from "intel_lrn.h":
    bint _LRN4 "CAFFEPY_LRN4"
    void _lrn4_fwd "caffepy_lrn4_fwd"(const float* xp, const float* xc, const float* xn, float* y,
                                      long L, int nv, int nn, int V, int pre, float k,
                                      float a) noexcept nogil
    void _lrn4_bwd1 "caffepy_lrn4_bwd1"(const float* xp, const float* xc, const float* xn,
                                        const float* dy, float* dx, float* keep, long L, int nv,
                                        int nn, int V, int pre, float k,
                                        float a) noexcept nogil
    void _lrn4_bwd2 "caffepy_lrn4_bwd2"(const float* kp, const float* kc, const float* kn,
                                        const float* xc, float* dx, long L, int nv, int nn, int V,
                                        int pre, float cache) noexcept nogil


DEF _MAXC = 2048          # channels (padded to blocks) an LRN kernel takes
DEF _MAXPAD = 128         # (local_size - 1) / 2 at most
DEF _ROWS = 4096          # generic path: floats of the window rows of a tile (L * W)
DEF _KEEP = 24576         # backward: floats kept per tile (generic: L * Cb * V, fast: 3 * L * V)
DEF _PIXELS = 1024        # fast path: pixels per tile

include "lrn_pow.pxi"


def lrn_max_channels():
    return _MAXC, 2 * _MAXPAD + 1


cdef struct LrnGeom:
    int C, Cb, V, pre, W, kind
    bint fast
    Py_ssize_t HW
    float k, a, beta, cache


cdef _check_lrn(str kernel, x, others, int size, int C):
    need(0 <= C <= x.shape[1] * x.shape[4] and C > (x.shape[1] - 1) * x.shape[4], kernel, "C",
         f"must fill the {x.shape[1]} blocks of {x.shape[4]} of x", C)
    need(size >= 1 and size % 2 == 1, kernel, "local_size", "must be odd and positive", size)
    need((size - 1) // 2 <= _MAXPAD, kernel, "local_size",
         f"is larger than this kernel supports ({2 * _MAXPAD + 1})", size)
    need(x.shape[1] * x.shape[4] <= _MAXC, kernel, "x",
         f"has more channels than this kernel supports ({_MAXC})", x.shape[1] * x.shape[4])
    for name, o in others:
        need_shape(kernel, name, tuple(o.shape[:5]), tuple(x.shape[:5]))


cdef LrnGeom _lrn_geom(x, int C, int size, float alpha, float beta, float k):
    cdef LrnGeom g
    g.C, g.Cb, g.V = C, x.shape[1], x.shape[4]
    g.HW = <Py_ssize_t>x.shape[2] * x.shape[3]
    g.pre = (size - 1) // 2
    g.W = g.V + 2 * g.pre
    g.kind = _pow_kind(beta)
    g.k, g.a, g.beta = k, alpha / size, beta
    g.cache = 2.0 * alpha * beta / size
    g.fast = _LRN4 and (g.V == 8 or g.V == 16) and g.pre <= 4 and g.kind == _POW_075
    return g


def lrn_forward(const float[:, :, :, :, ::1] x, float[:, :, :, :, ::1] y, int C, int size,
                float alpha, float beta, float k):
    """y = x * (k + alpha/size * window sum of x^2 across channels)^-beta (overwritten)."""
    _check_lrn("lrn_forward", x, [("y", y)], size, C)
    cdef LrnGeom g = _lrn_geom(x, C, size, alpha, beta, k)
    cdef int N = x.shape[0], L = _PIXELS if g.fast else _ROWS // g.W
    cdef Py_ssize_t tiles = (g.HW + L - 1) // L, item, image = g.Cb * g.HW * g.V
    if N * g.Cb == 0 or g.HW == 0:
        return
    with nogil:
        for item in prange(N * tiles, schedule="static", num_threads=threads_for(N * image * 4)):
            _lrn_fwd_tile(&x[0, 0, 0, 0, 0] + (item // tiles) * image,
                          &y[0, 0, 0, 0, 0] + (item // tiles) * image, (item % tiles) * L, L, &g)


def lrn_backward(const float[:, :, :, :, ::1] x, const float[:, :, :, :, ::1] dy,
                 float[:, :, :, :, ::1] dx, int C, int size, float alpha, float beta, float k):
    """dx = dy * scale^-beta - 2*alpha*beta/size * x * window sum of dy * y / scale (overwritten)."""
    _check_lrn("lrn_backward", x, [("dy", dy), ("dx", dx)], size, C)
    cdef LrnGeom g = _lrn_geom(x, C, size, alpha, beta, k)
    cdef int N = x.shape[0]
    cdef int L = min(_PIXELS, _KEEP // (3 * g.V)) if g.fast else min(_ROWS // g.W, _KEEP // (g.Cb * g.V))
    cdef Py_ssize_t tiles = (g.HW + L - 1) // L, item, image = g.Cb * g.HW * g.V
    if N * g.Cb == 0 or g.HW == 0:
        return
    with nogil:
        for item in prange(N * tiles, schedule="static", num_threads=threads_for(N * image * 4)):
            _lrn_bwd_tile(&x[0, 0, 0, 0, 0] + (item // tiles) * image,
                          &dy[0, 0, 0, 0, 0] + (item // tiles) * image,
                          &dx[0, 0, 0, 0, 0] + (item // tiles) * image, (item % tiles) * L, L, &g)


cdef void _lrn_fwd_tile(const float* x, float* y, Py_ssize_t p0, int L, const LrnGeom* g) noexcept nogil:
    cdef int cb, V = g.V
    cdef Py_ssize_t run = g.HW * V
    cdef const float* xc
    L = <int>min(<Py_ssize_t>L, g.HW - p0)
    if not g.fast:
        _lrn_fwd_generic(x, y, p0, L, g)
        return
    for cb in range(g.Cb):
        xc = x + cb * run + p0 * V
        _lrn4_fwd(xc - run if cb > 0 else NULL, xc, xc + run if cb + 1 < g.Cb else NULL,
                  y + cb * run + p0 * V, L, min(V, g.C - cb * V), min(V, g.C - cb * V - V), V,
                  g.pre, g.k, g.a)


cdef void _lrn_bwd_tile(const float* x, const float* dy, float* dx, Py_ssize_t p0, int L,
                        const LrnGeom* g) noexcept nogil:
    # pass 2 of block j needs what pass 1 kept for blocks j - 1, j, j + 1: it runs one block
    # behind pass 1, and three kept blocks are enough
    cdef float keep[_KEEP]
    cdef int cb, j, V = g.V
    cdef Py_ssize_t run = g.HW * V, off, kr
    cdef const float* xc
    L = <int>min(<Py_ssize_t>L, g.HW - p0)
    if not g.fast:
        _lrn_bwd_generic(x, dy, dx, p0, L, g, keep)
        return
    kr = <Py_ssize_t>L * V
    for cb in range(g.Cb + 1):
        if cb < g.Cb:
            off = cb * run + p0 * V
            xc = x + off
            _lrn4_bwd1(xc - run if cb > 0 else NULL, xc, xc + run if cb + 1 < g.Cb else NULL,
                       dy + off, dx + off, keep + (cb % 3) * kr, L, min(V, g.C - cb * V),
                       min(V, g.C - cb * V - V), V, g.pre, g.k, g.a)
        if cb > 0:
            j = cb - 1
            off = j * run + p0 * V
            _lrn4_bwd2(keep + ((j + 2) % 3) * kr if j > 0 else NULL, keep + (j % 3) * kr,
                       keep + ((j + 1) % 3) * kr if j + 1 < g.Cb else NULL, x + off, dx + off,
                       L, min(V, g.C - j * V), min(V, g.C - j * V - V), V, g.pre, g.cache)


cdef void _lrn_fwd_generic(const float* x, float* y, Py_ssize_t p0, int L,
                           const LrnGeom* g) noexcept nogil:
    cdef float rows[_ROWS]
    cdef float acc[_ROWS]
    cdef int cb
    cdef Py_ssize_t j, n
    cdef float s, r, k = g.k, a = g.a, beta = g.beta
    cdef const float* xc
    cdef float* yc
    n = <Py_ssize_t>L * g.V
    for cb in range(g.Cb):
        xc = x + (cb * g.HW + p0) * g.V
        yc = y + (cb * g.HW + p0) * g.V
        _block_window(x + p0 * g.V, g.HW * g.V, cb, L, g, True, rows, acc)
        # one loop per power so each vectorizes (s^-3/4 = 1 / (s^1/2 * s^1/4): no exp / log)
        if g.kind == _POW_075:
            for j in range(n):
                s = k + a * acc[j]
                r = sqrtf(s)
                yc[j] = xc[j] / (r * sqrtf(r))
        elif g.kind == _POW_050:
            for j in range(n):
                yc[j] = xc[j] / sqrtf(k + a * acc[j])
        elif g.kind == _POW_100:
            for j in range(n):
                yc[j] = xc[j] / (k + a * acc[j])
        else:
            for j in range(n):
                yc[j] = xc[j] * powf(k + a * acc[j], -beta)
        _zero_lanes(yc, cb, L, g)


cdef void _lrn_bwd_generic(const float* x, const float* dy, float* dx, Py_ssize_t p0, int L,
                           const LrnGeom* g, float* keep) noexcept nogil:
    # with p = scale^-beta and q = scale^(-beta-1):  dx = dy * p - cache * x * window of dy*x*q
    cdef float rows[_ROWS]
    cdef float acc[_ROWS]
    cdef int cb
    cdef Py_ssize_t j, n, off
    cdef float s, r, p, q, one = 1.0, k = g.k, a = g.a, beta = g.beta, c = g.cache
    cdef const float* xc
    cdef const float* gc
    cdef float* dc
    cdef float* kc
    n = <Py_ssize_t>L * g.V
    for cb in range(g.Cb):
        off = (cb * g.HW + p0) * g.V
        xc = x + off
        gc = dy + off
        dc = dx + off
        kc = keep + cb * n
        _block_window(x + p0 * g.V, g.HW * g.V, cb, L, g, True, rows, acc)
        if g.kind == _POW_075:
            for j in range(n):
                s = k + a * acc[j]
                r = sqrtf(s)
                q = one / (s * r * sqrtf(r))
                dc[j] = gc[j] * q * s
                kc[j] = gc[j] * xc[j] * q
        elif g.kind == _POW_050:
            for j in range(n):
                s = k + a * acc[j]
                q = one / (s * sqrtf(s))
                dc[j] = gc[j] * q * s
                kc[j] = gc[j] * xc[j] * q
        elif g.kind == _POW_100:
            for j in range(n):
                s = k + a * acc[j]
                q = one / (s * s)
                dc[j] = gc[j] * q * s
                kc[j] = gc[j] * xc[j] * q
        else:
            for j in range(n):
                s = k + a * acc[j]
                p = powf(s, -beta)
                dc[j] = gc[j] * p
                kc[j] = gc[j] * xc[j] * p / s
    for cb in range(g.Cb):
        off = (cb * g.HW + p0) * g.V
        xc = x + off
        dc = dx + off
        _block_window(keep, n, cb, L, g, False, rows, acc)
        for j in range(n):
            dc[j] -= c * xc[j] * acc[j]
        _zero_lanes(dc, cb, L, g)


cdef inline void _zero_lanes(float* run, int cb, int L, const LrnGeom* g) noexcept nogil:
    """Zero the lanes past C of block cb's run of L pixels."""
    cdef int t, lo = g.C - cb * g.V
    if lo >= g.V:
        return
    for t in range(L):
        memset(run + t * g.V + lo, 0, (g.V - lo) * sizeof(float))


cdef inline void _block_window(const float* src, Py_ssize_t bstride, int cb, int L,
                               const LrnGeom* g, bint square, float* rows,
                               float* acc) noexcept nogil:
    # literal widths, so that the loops over the lanes of a pixel are fixed-size vector ops
    if g.V == 8:
        _block_window_v(src, bstride, cb, L, g, square, rows, acc, 8)
    elif g.V == 16:
        _block_window_v(src, bstride, cb, L, g, square, rows, acc, 16)
    else:
        _block_window_v(src, bstride, cb, L, g, square, rows, acc, g.V)


cdef inline void _block_window_v(const float* src, Py_ssize_t bstride, int cb, int L,
                                 const LrnGeom* g, bint square, float* rows, float* acc,
                                 int V) noexcept nogil:
    """acc[t, v] = sum of f(channel cb * V + v + d) over |d| <= pre, for the L pixels t of a
    tile, where f is the square (or the identity) of src[c // V * bstride + t * V + c % V] for
    the real channels c and 0 elsewhere (past either end, and the lanes past C)."""
    cdef int W = g.W, pre = g.pre, C = g.C, e, c, t, v, nv
    cdef const float* s
    cdef float* row
    cdef float u
    # this block's lanes
    nv = min(V, C - cb * V)
    s = src + cb * bstride
    for t in range(L):
        row = rows + t * W + pre
        if square:
            for v in range(V):
                row[v] = s[v] * s[v]
        else:
            for v in range(V):
                row[v] = s[v]
        s += V
    if nv < V:
        for t in range(L):
            for v in range(nv, V):
                rows[t * W + pre + v] = 0.0
    # the `pre` channels on each side, from the neighbouring blocks (strided: one lane each)
    for e in range(2 * pre):
        c = cb * V - pre + e if e < pre else cb * V + V + e - pre
        row = rows + (e if e < pre else V + e)
        if c < 0 or c >= C:
            for t in range(L):
                row[t * W] = 0.0
        else:
            s = src + (c // V) * bstride + c % V
            for t in range(L):
                u = s[t * V]
                row[t * W] = u * u if square else u
    # window sums: `size` shifted loads of each row
    if pre == 2:            # local_size 5 (AlexNet, GoogLeNet)
        for t in range(L):
            row = rows + t * W
            for v in range(V):
                acc[t * V + v] = row[v] + row[v + 1] + row[v + 2] + row[v + 3] + row[v + 4]
    else:
        for t in range(L):
            row = rows + t * W
            for v in range(V):
                u = 0.0
                for e in range(2 * pre + 1):
                    u = u + row[v + e]
                acc[t * V + v] = u
