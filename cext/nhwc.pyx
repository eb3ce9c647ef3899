# cython: language_level=3
"""Kernels of the channels-last family (caffepy/layers/nhwc.py): the fast path's layout
(N, H, W, C), where one pixel's channels are contiguous, so that

- a 1x1 convolution is one GEMM over the rows (pixels) of the batch, with no im2col
  (pointwise, stride 1): Y[N*H*W, O] = X[N*H*W, C] @ W^T;
- im2col copies whole runs of kw * C floats (the taps of one kernel row are adjacent pixels);
- the per-channel layers (BatchNorm, Scale, pooling, LRN, depthwise convolution) run their
  inner loops over the channels of a pixel, which are contiguous, so they vectorize.

The Winograd algorithm of the channels-last Convolution is in winograd.pyx (shared with the
blocked layout).

Conventions (Caffe's): top and bottom diffs are OVERWRITTEN, weight and bias diffs ACCUMULATE
(here: into per-thread partials the caller sums, or into the caller's float64 sums). Every
kernel writes into buffers the caller allocated (scratch included) and runs without the GIL.
The NumPy reference of the layout is caffepy/kernels/reference/nhwc.py (pack, unpack); the
computations are compared with the NCHW references of reference/vision.py and
reference/normalization.py on the packed arrays (tests/layers/test_nhwc.py).
"""

from cython.parallel cimport prange, threadid
cimport openmp
from libc.stdint cimport int32_t
from libc.string cimport memcmp, memcpy, memset
from cpython cimport array
import array

from blas cimport (PG_FEW_ROWS, PG_KC, PG_ONE_PASS_K, PackedSplit, by_panels,
                   caffepy_packed_floats, caffepy_panel_pack, gemm_ld, packed_part, packed_split,
                   sk_epi)
from rules cimport dims, need, need_shape, pixel_stride, threads_for

include "blas_threads.pxi"
include "lrn_pow.pxi"


def max_threads():
    """Threads the kernels use (OMP_NUM_THREADS, else all cores): size of per-thread scratch."""
    return openmp.omp_get_max_threads()


cdef enum:
    _ROWS = 64            # pixels per task of the per-channel passes


cdef inline Py_ssize_t _row_tasks(Py_ssize_t M) noexcept nogil:
    return (M + _ROWS - 1) // _ROWS


# ---------------------------------------------------------------------------------------------
# Pack / unpack: per image, the [C, H*W] <-> [H*W, C] transpose in 32 x 32 tiles, so both sides
# are read and written in cache lines.

cdef enum:
    _TILE = 32


cdef void _transpose_tile(const float* src, Py_ssize_t ld_src, float* dst, Py_ssize_t ld_dst,
                          Py_ssize_t rows, Py_ssize_t cols) noexcept nogil:
    """dst[c, r] = src[r, c] for r < rows, c < cols."""
    cdef Py_ssize_t r, c
    for c in range(cols):
        for r in range(rows):
            dst[c * ld_dst + r] = src[r * ld_src + c]


cdef void _transpose_images(const float* src, float* dst, Py_ssize_t N, Py_ssize_t R,
                            Py_ssize_t Cn) noexcept nogil:
    """Per image, dst[Cn, R] = src[R, Cn]^T, tiled; tasks are (image, tile row)."""
    cdef Py_ssize_t tr = (R + _TILE - 1) // _TILE, item, n, r0, c0
    for item in prange(N * tr, schedule="static", num_threads=threads_for(N * R * Cn)):
        n = item // tr
        r0 = (item % tr) * _TILE
        c0 = 0
        while c0 < Cn:
            _transpose_tile(src + n * R * Cn + r0 * Cn + c0, Cn, dst + n * R * Cn + c0 * R + r0, R,
                            min(<Py_ssize_t>_TILE, R - r0), min(<Py_ssize_t>_TILE, Cn - c0))
            c0 = c0 + _TILE


cdef extern from "nhwc_transpose.h" nogil:
    void caffepy_reverse_runs(const float* buf, long ld, long n, long j0, long j1, long S,
                              float* dp, long d0, long d1, int add)


cdef enum:
    _RA = 16              # reverse_axes: a's per tile (one cache line of dst)
    _RJ = 64              # reverse_axes: (b, s) pairs per tile


cdef void _reverse_tile(const float* sp, Py_ssize_t s0, Py_ssize_t S, Py_ssize_t a0, Py_ssize_t a1,
                        Py_ssize_t j0, Py_ssize_t j1, float* dp, Py_ssize_t d0, Py_ssize_t d1,
                        bint add) noexcept nogil:
    """A tile of reverse_axes for a source whose rows are contiguous over (b, s): read whole
    row pieces into `buf`, then write whole runs of a. Going through `buf` keeps the reads
    sequential: a tile of rows a power-of-two floats apart would share cache sets."""
    cdef float buf[_RA * _RJ]
    cdef Py_ssize_t a, n = a1 - a0
    for a in range(n):
        memcpy(&buf[a * _RJ], sp + (a0 + a) * s0 + j0, (j1 - j0) * sizeof(float))
    caffepy_reverse_runs(buf, _RJ, n, j0, j1, S, dp + a0, d0, d1, add)


def reverse_axes(const float[:, :, :] src, float[:, :, :] dst, bint add=False):
    """dst[s, b, a] = src[a, b, s], or += with add: a convolution's weights between Caffe's
    order [O, C, kh * kw] and a GEMM's [kh * kw, C, O], and their gradients back (either side
    may be a view into a padded matrix). In tiles, so both sides move in whole cache lines:
    NumPy's transposing copy of 2048 x 1024 weights took 11.6 ms."""
    cdef Py_ssize_t A = src.shape[0], B = src.shape[1], S = src.shape[2]
    need_shape("reverse_axes", "dst", dims(dst.shape, 3), (S, B, A))
    if A * B * S == 0:
        return
    cdef Py_ssize_t f = sizeof(float)
    cdef Py_ssize_t s0 = src.strides[0] // f, s1 = src.strides[1] // f, s2 = src.strides[2] // f
    cdef Py_ssize_t d0 = dst.strides[0] // f, d1 = dst.strides[1] // f, d2 = dst.strides[2] // f
    if A == 1 and S > 1:
        # a pointwise gradient [1, C, O] -> [O, C, 1]: the tiles below run over a, which here
        # would write one float per 8 KB; as [C, O, 1] -> [1, O, C] it is the 2-D transpose
        # it is (2048 x 512: 6.3 -> 0.7 ms)
        A, B, S, s0, s1, s2, d0, d1, d2 = B, S, 1, s1, s2, 1, 0, d0, d1
    cdef Py_ssize_t ta = (A + _RA - 1) // _RA, tj = (B * S + _RJ - 1) // _RJ, t, a, a0, j0, j, b, s
    cdef const float* sp = &src[0, 0, 0]
    cdef float* dp = &dst[0, 0, 0]
    cdef bint tiled = s2 == 1 and s1 == S and d2 == 1
    with nogil:
        for t in prange(ta * tj, schedule="static", num_threads=threads_for(A * B * S)):
            a0 = (t // tj) * _RA
            j0 = (t % tj) * _RJ
            if tiled:
                _reverse_tile(sp, s0, S, a0, min(a0 + _RA, A), j0, min(j0 + _RJ, B * S), dp, d0,
                              d1, add)
                continue
            for j in range(j0, min(j0 + _RJ, B * S)):
                b = j // S
                s = j % S
                for a in range(a0, min(a0 + _RA, A)):
                    if add:
                        dp[s * d0 + b * d1 + a * d2] += sp[a * s0 + b * s1 + s * s2]
                    else:
                        dp[s * d0 + b * d1 + a * d2] = sp[a * s0 + b * s1 + s * s2]


def same_floats(const float[::1] a, const float[::1] b):
    """Whether a and b hold the same bits: whether weights changed since a copy was kept. In
    slices over the thread rule's threads: the compare streams both from memory, which one
    core does not saturate."""
    if a.shape[0] != b.shape[0]:
        return False
    cdef Py_ssize_t n = a.shape[0], step, part
    cdef int nt = threads_for(n), differ = 0
    if n == 0:
        return True
    with nogil:
        if nt == 1:
            differ = memcmp(&a[0], &b[0], n * sizeof(float)) != 0
        else:
            step = (n + nt - 1) // nt
            for part in prange(nt, num_threads=nt, schedule="static"):
                if part * step < n:
                    differ += memcmp(&a[part * step], &b[part * step],
                                     min(step, n - part * step) * sizeof(float)) != 0
    return differ == 0


def take_pixels(const float[:, :, :, ::1] x, float[:, :, :, ::1] out, int sh, int sw):
    """out[n, i, j] = x[n, i * sh, j * sw]: the pixels a strided 1 x 1 convolution reads."""
    cdef Py_ssize_t N = out.shape[0], oh = out.shape[1], ow = out.shape[2], C = out.shape[3]
    need(sh >= 1 and sw >= 1, "take_pixels", "stride", "must be >= 1", (sh, sw))
    need_shape("take_pixels", "out", dims(out.shape, 4), (x.shape[0], (x.shape[1] - 1) // sh + 1,
                                                        (x.shape[2] - 1) // sw + 1, x.shape[3]))
    cdef Py_ssize_t row, n, i, j
    if N * oh * ow * C == 0:
        return
    with nogil:
        for row in prange(N * oh, schedule="static", num_threads=threads_for(N * oh * ow * C)):
            n = row // oh
            i = row % oh
            for j in range(ow):
                memcpy(&out[n, i, j, 0], &x[n, i * sh, j * sw, 0], C * sizeof(float))


def put_pixels(const float[:, :, :, ::1] d, float[:, :, :, ::1] dx, int sh, int sw):
    """dx[n, i * sh, j * sw] = d[n, i, j], every other pixel of dx 0: take_pixels' gradient,
    each float of dx written once."""
    cdef Py_ssize_t N = dx.shape[0], H = dx.shape[1], W = dx.shape[2], C = dx.shape[3]
    cdef Py_ssize_t oh = d.shape[1], ow = d.shape[2]
    need(sh >= 1 and sw >= 1, "put_pixels", "stride", "must be >= 1", (sh, sw))
    need_shape("put_pixels", "d", dims(d.shape, 4), (N, (H - 1) // sh + 1, (W - 1) // sw + 1, C))
    cdef Py_ssize_t row, n, y, x
    if N * H * W * C == 0:
        return
    with nogil:
        for row in prange(N * H, schedule="static", num_threads=threads_for(N * H * W * C)):
            n = row // H
            y = row % H
            if y % sh or y // sh >= oh:
                memset(&dx[n, y, 0, 0], 0, W * C * sizeof(float))
                continue
            for x in range(W):
                if x % sw or x // sw >= ow:
                    memset(&dx[n, y, x, 0], 0, C * sizeof(float))
                else:
                    memcpy(&dx[n, y, x, 0], &d[n, y // sh, x // sw, 0], C * sizeof(float))


def pack(const float[:, :, :, ::1] x, float[:, :, :, ::1] y):
    """y[n, h, w, c] = x[n, c, h, w] (NCHW -> channels-last; overwritten)."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    need_shape("pack", "y", dims(y.shape, 4), (N, H, W, C))
    if N * C * H * W == 0:
        return
    with nogil:
        _transpose_images(&x[0, 0, 0, 0], &y[0, 0, 0, 0], N, C, H * W)


def unpack(const float[:, :, :, ::1] y, float[:, :, :, ::1] x):
    """x[n, c, h, w] = y[n, h, w, c] (channels-last -> NCHW; overwritten)."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    need_shape("unpack", "y", dims(y.shape, 4), (N, H, W, C))
    if N * C * H * W == 0:
        return
    with nogil:
        _transpose_images(&y[0, 0, 0, 0], &x[0, 0, 0, 0], N, H * W, C)


# ---------------------------------------------------------------------------------------------
# Convolution by GEMM. The column matrix of one image has a row per output pixel and, per
# group, the taps (i, j) in order with the group's Cg channels of each tap contiguous:
#     col[p, gr * Kg + (i * kw + j) * Cg + c] = x[oy * sh - ph + i * dh, ox * sw - pw + j * dw,
#                                                 gr * Cg + c]           (0 outside the image)
# and the weight is given in the same order as wt[group, Kg, Og] (the layer builds it from
# Caffe's [O, Cg, kh, kw]), so Y[p, gr * Og + o] = col_gr[p, :] @ wt[gr, :, o] (+ bias).
# A pointwise stride-1 unpadded convolution (`direct`) needs no column matrix: the input rows are
# it, for the whole batch at once. Work is split into tasks: chunks of `rows` rows of the batch's
# matrix (direct), or whole images, several per task when an image has fewer than `rows`
# pixels (so every GEMM has about `rows` rows), an image's pixels going through the column
# buffer `rows` at a time when it has more. A task owns its images, so the scatter of the data
# gradient (col2im) never races. Threads take whole tasks, each with its own scratch and a
# single-threaded BLAS; with one task, or a small problem (the thread rule), the BLAS threads
# each GEMM instead.

cdef inline int _out_size(int n, int pad, int k, int s, int d) noexcept nogil:
    """Caffe's output size along one axis: windows of k taps d apart, stride s, over n + 2 pad."""
    return (n + 2 * pad - (d * (k - 1) + 1)) // s + 1


cdef struct CGeom:
    int N, H, W, C, O, oh, ow
    int kh, kw, ph, pw, sh, sw, dh, dw, group
    int Cg, Og, Kg, Ktot
    Py_ssize_t P            # output pixels per image
    Py_ssize_t rows         # pixels per GEMM: per pass through the column buffer
    int images              # images per task (not direct)
    bint direct
    bint caffe_order        # wt is [group, Og, Kg] (Caffe's own, for a 1 x 1 kernel), not [group, Kg, Og]
    Py_ssize_t ldy          # floats between the forward's output pixels: O, or more when y is
                            # a run of a wider channels-last blob's channels (a concat's top)
    const float* scale      # the forward's epilogue: y * scale[o] (NULL: none) + bias[o],
    const float* add        # + add[pixel, o] (NULL: none; an array of y's shape, y0 its base),
    const float* y0
    bint add_at_y           # add is y itself (packed, each sum in one pass: add_may_be_y)
    bint relu               # then max(y, 0) if relu
    const float* packed     # the weights as caffepy_panel_pack packs them, each group's
    Py_ssize_t packed_group # op(wt[gr]) [Kg, Og] at packed + gr * packed_group (NULL: none)


cdef CGeom _cgeom(str kernel, x, y, int O, int kh, int kw, int ph, int pw, int sh, int sw,
                  int dh, int dw, int group, Py_ssize_t rows, bint caffe_order=False) except *:
    cdef CGeom g
    g.ldy = O
    g.relu = False
    g.scale = NULL
    g.add = NULL
    g.add_at_y = False
    g.packed = NULL
    g.N, g.H, g.W, g.C = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    g.O = O
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and dh >= 1 and dw >= 1 and ph >= 0
         and pw >= 0, kernel, "geometry", "kernel, stride and dilation must be >= 1 and pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} dilation {dh}x{dw} pad {ph}x{pw}")
    need(group >= 1 and g.C % group == 0 and O % group == 0, kernel, "group",
         f"must divide {g.C} input and {O} output channels", group)
    g.kh, g.kw, g.ph, g.pw, g.sh, g.sw, g.dh, g.dw, g.group = kh, kw, ph, pw, sh, sw, dh, dw, group
    g.oh, g.ow = _out_size(g.H, ph, kh, sh, dh), _out_size(g.W, pw, kw, sw, dw)
    need(g.oh >= 1 and g.ow >= 1, kernel, "geometry", f"kernel {kh}x{kw} (dilation {dh}x{dw}, "
         f"pad {ph}x{pw}) does not fit the image", f"{g.H}x{g.W}")
    if y is not None:
        need_shape(kernel, "y", tuple(y.shape[:4]), (g.N, g.oh, g.ow, O))
    g.Cg, g.Og = g.C // group, O // group
    g.Kg = g.Cg * kh * kw
    g.Ktot = g.Kg * group
    g.P = <Py_ssize_t>g.oh * g.ow
    g.direct = kh == 1 and kw == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0
    need(rows >= 1, kernel, "rows", "must be positive", rows)
    g.images = 1
    if g.direct:
        g.rows = rows
    elif rows < g.P:
        g.rows = rows
    else:
        g.images = <int>min(rows // g.P, <Py_ssize_t>max(g.N, 1))
        g.rows = g.images * g.P
    need(not caffe_order or (kh == 1 and kw == 1), kernel, "caffe_order", "needs a 1 x 1 kernel",
         f"{kh}x{kw}")
    g.caffe_order = caffe_order
    return g


def conv_rows(int C, int kh, int kw):
    """Pixels per GEMM of an im2col convolution: about 4 MB of columns, at least 256 rows."""
    cdef Py_ssize_t k = <Py_ssize_t>C * kh * kw
    return max(256, (1 << 20) // max(k, 1))


def packed_floats(int group, int Og, int Kg):
    """Floats of pack_weights' output for `group` products of [Kg, Og] weights."""
    return group * caffepy_packed_floats(Og, Kg)


def pack_weights(const float[:, :, ::1] wt, bint caffe_order, float[::1] out):
    """out [packed_floats] = conv_forward's wt [group, Kg, Og] (caffe_order: [group, Og, Kg])
    packed once into its GEMMs' panels (cext/gemm_panels.h, at this build's width), for
    conv_forward's `packed`: a TEST net's weights, packed again only when they change."""
    cdef int G = wt.shape[0], Og = wt.shape[1] if caffe_order else wt.shape[2]
    cdef int Kg = wt.shape[2] if caffe_order else wt.shape[1], gr
    cdef Py_ssize_t each = caffepy_packed_floats(Og, Kg)
    need(out.shape[0] == G * each, "pack_weights", "out", f"needs {G * each} floats",
         out.shape[0])
    if G * each:
        with nogil:
            for gr in range(G):
                caffepy_panel_pack(caffe_order, Og, Kg, 1.0, &wt[gr, 0, 0], wt.shape[2],
                                   &out[gr * each])


def conv_col_floats(int C, int kh, int kw, int oh, int ow, Py_ssize_t rows):
    """Floats of one thread's column buffer for conv_forward / conv_backward."""
    cdef Py_ssize_t P = <Py_ssize_t>oh * ow
    cdef Py_ssize_t chunk = rows if rows < P else (rows // P) * P
    return chunk * C * kh * kw


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


cdef void _im2col(const float* x, const CGeom* g, Py_ssize_t p0, Py_ssize_t p1,
                  float* col) noexcept nogil:
    """col[p - p0] for the output pixels p0 .. p1 - 1 of image x [H, W, C]."""
    cdef Py_ssize_t p
    cdef int oy, ox, i, j, gr, iy, ix, ix0, lo = 0, hi = 0, C = g.C, Cg = g.Cg
    cdef float* row
    cdef float* dst
    cdef const float* src
    for p in range(p0, p1):
        oy = <int>(p // g.ow)
        ox = <int>(p % g.ow)
        row = col + (p - p0) * g.Ktot
        ix0 = ox * g.sw - g.pw
        for i in range(g.kh):
            iy = oy * g.sh - g.ph + i * g.dh
            if g.group == 1:
                dst = row + i * g.kw * C
                if iy < 0 or iy >= g.H:
                    memset(dst, 0, g.kw * C * sizeof(float))
                    continue
                src = x + <Py_ssize_t>iy * g.W * C
                if g.dw == 1:
                    _jrange(ix0, g.kw, g.W, &lo, &hi)
                    memset(dst, 0, lo * C * sizeof(float))
                    memcpy(dst + lo * C, src + <Py_ssize_t>(ix0 + lo) * C, (hi - lo) * C * sizeof(float))
                    memset(dst + hi * C, 0, (g.kw - hi) * C * sizeof(float))
                else:
                    for j in range(g.kw):
                        ix = ix0 + j * g.dw
                        if ix < 0 or ix >= g.W:
                            memset(dst + j * C, 0, C * sizeof(float))
                        else:
                            memcpy(dst + j * C, src + <Py_ssize_t>ix * C, C * sizeof(float))
            else:
                for j in range(g.kw):
                    ix = ix0 + j * g.dw
                    for gr in range(g.group):
                        dst = row + gr * g.Kg + (i * g.kw + j) * Cg
                        if iy < 0 or iy >= g.H or ix < 0 or ix >= g.W:
                            memset(dst, 0, Cg * sizeof(float))
                        else:
                            memcpy(dst, x + (<Py_ssize_t>iy * g.W + ix) * C + gr * Cg,
                                   Cg * sizeof(float))


cdef void _col2im(const float* col, const CGeom* g, Py_ssize_t p0, Py_ssize_t p1,
                  float* x) noexcept nogil:
    """x [H, W, C] += the columns of output pixels p0 .. p1 - 1 scattered back."""
    cdef Py_ssize_t p, t, n
    cdef int oy, ox, i, j, gr, iy, ix, ix0, lo = 0, hi = 0, C = g.C, Cg = g.Cg
    cdef const float* row
    cdef const float* src
    cdef float* dst
    for p in range(p0, p1):
        oy = <int>(p // g.ow)
        ox = <int>(p % g.ow)
        row = col + (p - p0) * g.Ktot
        ix0 = ox * g.sw - g.pw
        for i in range(g.kh):
            iy = oy * g.sh - g.ph + i * g.dh
            if iy < 0 or iy >= g.H:
                continue
            if g.group == 1 and g.dw == 1:
                _jrange(ix0, g.kw, g.W, &lo, &hi)
                src = row + (i * g.kw + lo) * C
                dst = x + (<Py_ssize_t>iy * g.W + ix0 + lo) * C
                n = <Py_ssize_t>(hi - lo) * C
                for t in range(n):
                    dst[t] += src[t]
                continue
            for j in range(g.kw):
                ix = ix0 + j * g.dw
                if ix < 0 or ix >= g.W:
                    continue
                dst = x + (<Py_ssize_t>iy * g.W + ix) * C
                for gr in range(g.group):
                    src = row + gr * g.Kg + (i * g.kw + j) * Cg
                    for t in range(Cg):
                        dst[gr * Cg + t] += src[t]


cdef void _epilogue(float* y, Py_ssize_t rows, int O, int ld, const float* scale,
                    const float* bias, const float* add, bint relu) noexcept nogil:
    """y = y * scale (NULL: 1) + bias (NULL: 0) + add (NULL: 0; rows x O as y, rows ld apart),
    then max(y, 0) if relu, per output channel: on the rows the GEMM has just left in cache (a
    TEST net's BatchNorm, Scale, the Eltwise SUM with a shortcut and the ReLU after the
    convolution cost no pass of their own). -O3 unswitches the tests on scale, bias and relu,
    so each case vectorizes; the one on add is taken by hand: left to the compiler it became a
    masked load from add + offset even when add is NULL, and such a load from an unmapped page
    costs a microcode assist on every vector (a fifth of ResNet-50's forward on Zen 3)."""
    cdef Py_ssize_t r
    cdef int o
    cdef float v
    cdef float* yr
    cdef const float* ar
    if add == NULL:
        for r in range(rows):
            yr = y + r * ld
            for o in range(O):
                v = yr[o]
                if scale != NULL:
                    v = v * scale[o]
                if bias != NULL:
                    v = v + bias[o]
                if relu:
                    v = max(v, 0.0)
                yr[o] = v
        return
    for r in range(rows):
        yr = y + r * ld
        ar = add + r * ld
        for o in range(O):
            v = yr[o]
            if scale != NULL:
                v = v * scale[o]
            if bias != NULL:
                v = v + bias[o]
            v = v + ar[o]
            if relu:
                v = max(v, 0.0)
            yr[o] = v


cdef void _sum_rows(const float* y, Py_ssize_t rows, int O, float* acc) noexcept nogil:
    """acc[o] += sum over the rows of y[r, o]."""
    cdef Py_ssize_t r
    cdef int o
    cdef const float* yr
    for r in range(rows):
        yr = y + r * O
        for o in range(O):
            acc[o] = acc[o] + yr[o]


cdef inline void _fwd_epilogue(const CGeom* g, const float* bias, float* y, Py_ssize_t rows,
                               int o0, int o1) noexcept nogil:
    """The epilogue of output channels [o0, o1) of y [rows, O]."""
    if o1 > o0 and (bias != NULL or g.scale != NULL or g.add != NULL or g.relu):
        _epilogue(y + o0, rows, o1 - o0, g.ldy, g.scale + o0 if g.scale != NULL else NULL,
                  bias + o0 if bias != NULL else NULL,
                  g.add + (y - g.y0) + o0 if g.add != NULL else NULL, g.relu)


cdef void _fwd_part(const CGeom* g, PackedSplit s, int part, const float* a, Py_ssize_t lda,
                    const float* bias, float* y, int rows) noexcept nogil:
    """Part `part` of split s of _fwd_rows on the packed weights: each group's block of rows or
    of output channels, the epilogue applied as the GEMM stores each tile (gemm_tile.h sk_epi:
    no pass of its own over y, whose rows of a wide layer came back from memory)."""
    cdef int gr, o
    cdef sk_epi e
    cdef sk_epi* ep = NULL
    if bias != NULL or g.scale != NULL or g.add != NULL or g.relu:
        e.ld_add = g.ldy
        e.relu = g.relu
        e.add_at_c = g.add_at_y
        ep = &e
    for gr in range(g.group):
        if ep != NULL:
            o = gr * g.Og
            e.scale = g.scale + o if g.scale != NULL else NULL
            e.bias = bias + o if bias != NULL else NULL
            e.add = g.add + (y - g.y0) + o if g.add != NULL else NULL
        packed_part(s, part, rows, g.Og, g.Kg, a + gr * g.Kg, <int>lda,
                    g.packed + gr * g.packed_group, 0.0, y + gr * g.Og, <int>g.ldy, ep)


cdef void _fwd_rows(const CGeom* g, const float* a, Py_ssize_t lda, const float* wt,
                    const float* bias, float* y, Py_ssize_t rows) noexcept nogil:
    """y[rows, O] = a[rows, Ktot] @ wt per group, then the epilogue (_epilogue). On the packed
    weights (a TEST net's) the panels apply it as they store each tile (_fwd_part), and outside
    a parallel region the threads split the rows or the output channels (packed_split)."""
    cdef int gr, part
    cdef PackedSplit s
    if g.packed != NULL:
        s = packed_split(<int>rows, g.Og, g.Kg, g.group)
        if s.parts == 1:
            _fwd_part(g, s, 0, a, lda, bias, y, <int>rows)
        else:
            for part in prange(s.parts, num_threads=s.parts, schedule="static"):
                _fwd_part(g, s, part, a, lda, bias, y, <int>rows)
        return
    for gr in range(g.group):
        gemm_ld(False, g.caffe_order, <int>rows, g.Og, g.Kg, 1.0, a + gr * g.Kg, <int>lda,
                wt + <Py_ssize_t>gr * g.Kg * g.Og, g.Kg if g.caffe_order else g.Og, 0.0,
                y + gr * g.Og, <int>g.ldy)
    _fwd_epilogue(g, bias, y, rows, 0, g.O)


cdef void _fwd_task(const CGeom* g, Py_ssize_t task, const float* x, const float* wt,
                    const float* bias, float* y, float* col) noexcept nogil:
    cdef Py_ssize_t r0, p0, n
    if g.direct:
        r0 = task * g.rows
        _fwd_rows(g, x + r0 * g.C, g.C, wt, bias, y + r0 * g.ldy,
                  min(g.rows, <Py_ssize_t>g.N * g.P - r0))
        return
    cdef Py_ssize_t plane = <Py_ssize_t>g.H * g.W * g.C, i, n1
    n = task * g.images
    n1 = min(n + g.images, <Py_ssize_t>g.N)
    if g.images > 1:
        for i in range(n, n1):
            _im2col(x + i * plane, g, 0, g.P, col + (i - n) * g.P * g.Ktot)
        _fwd_rows(g, col, g.Ktot, wt, bias, y + n * g.P * g.ldy, (n1 - n) * g.P)
        return
    p0 = 0
    while p0 < g.P:
        _im2col(x + n * plane, g, p0, min(p0 + g.rows, g.P), col)
        _fwd_rows(g, col, g.Ktot, wt, bias, y + (n * g.P + p0) * g.ldy, min(g.rows, g.P - p0))
        p0 = p0 + g.rows


cdef inline void _data_grad(const CGeom* g, int gr, const float* wt, const float* dy,
                            Py_ssize_t rows, float* da, Py_ssize_t ldda) noexcept nogil:
    """Group gr's da = dy wt^T (in Caffe's order, dy wt)."""
    cdef Py_ssize_t wo = <Py_ssize_t>gr * g.Kg * g.Og
    gemm_ld(False, not g.caffe_order, <int>rows, g.Kg, g.Og, 1.0, dy + gr * g.Og, g.O,
            wt + wo, g.Kg if g.caffe_order else g.Og, 0.0, da + gr * g.Kg, <int>ldda)


cdef void _bwd_rows(const CGeom* g, const float* a, Py_ssize_t lda, const float* wt,
                    const float* dy, Py_ssize_t rows, float* da, Py_ssize_t ldda, float* dwt,
                    float* db) noexcept nogil:
    """dwt += a^T dy, db += column sums of dy, da = dy wt^T, per group (each when not NULL);
    in Caffe's order, dwt += dy^T a and da = dy wt. da comes first unless it overwrites a (an
    im2col buffer): the panel kernel brings dy into cache with its prefetches, where the BLAS's
    weight product then finds it (ResNet-50 b16's 1x1 backward at 56x56, 64 -> 256 channels:
    22.5 -> 21.0 ms)."""
    cdef int gr
    cdef Py_ssize_t wo
    cdef bint da_first = da != NULL and da != a
    if db != NULL:
        _sum_rows(dy, rows, g.O, db)
    for gr in range(g.group):
        wo = <Py_ssize_t>gr * g.Kg * g.Og
        if da_first:
            _data_grad(g, gr, wt, dy, rows, da, ldda)
        if dwt != NULL and g.caffe_order:
            gemm_ld(True, False, g.Og, g.Kg, <int>rows, 1.0, dy + gr * g.Og, g.O,
                    a + gr * g.Kg, <int>lda, 1.0, dwt + wo, g.Kg)
        elif dwt != NULL:
            gemm_ld(True, False, g.Kg, g.Og, <int>rows, 1.0, a + gr * g.Kg, <int>lda,
                    dy + gr * g.Og, g.O, 1.0, dwt + wo, g.Og)
        if da != NULL and not da_first:
            _data_grad(g, gr, wt, dy, rows, da, ldda)


cdef void _bwd_task(const CGeom* g, Py_ssize_t task, const float* x, const float* wt,
                    const float* dy, float* dx, float* dwt, float* db, float* col) noexcept nogil:
    cdef Py_ssize_t r0, p0, n, n1, i, rows, plane = <Py_ssize_t>g.H * g.W * g.C
    if g.direct:
        r0 = task * g.rows
        rows = min(g.rows, <Py_ssize_t>g.N * g.P - r0)
        _bwd_rows(g, x + r0 * g.C, g.C, wt, dy + r0 * g.O, rows,
                  dx + r0 * g.C if dx != NULL else NULL, g.C, dwt, db)
        return
    n = task * g.images
    n1 = min(n + g.images, <Py_ssize_t>g.N)
    if g.images > 1:
        if dwt != NULL:
            for i in range(n, n1):
                _im2col(x + i * plane, g, 0, g.P, col + (i - n) * g.P * g.Ktot)
        _bwd_rows(g, col, g.Ktot, wt, dy + n * g.P * g.O, (n1 - n) * g.P,
                  col if dx != NULL else NULL, g.Ktot, dwt, db)
        if dx != NULL:
            memset(dx + n * plane, 0, (n1 - n) * plane * sizeof(float))
            for i in range(n, n1):
                _col2im(col + (i - n) * g.P * g.Ktot, g, 0, g.P, dx + i * plane)
        return
    if dx != NULL:
        memset(dx + n * plane, 0, plane * sizeof(float))
    p0 = 0
    while p0 < g.P:
        rows = min(g.rows, g.P - p0)
        if dwt != NULL:
            _im2col(x + n * plane, g, p0, p0 + rows, col)
        _bwd_rows(g, col, g.Ktot, wt, dy + (n * g.P + p0) * g.O, rows,
                  col if dx != NULL else NULL, g.Ktot, dwt, db)
        if dx != NULL:
            _col2im(col, g, p0, p0 + rows, dx + n * plane)
        p0 = p0 + g.rows


cdef inline Py_ssize_t _tasks(const CGeom* g) noexcept nogil:
    if g.direct:
        return (<Py_ssize_t>g.N * g.P + g.rows - 1) // g.rows
    return (g.N + g.images - 1) // g.images


cdef _check_conv(str kernel, const CGeom* g, wt, col, int T):
    need_shape(kernel, "wt", tuple(wt.shape[:3]),
               (g.group, g.Og, g.Kg) if g.caffe_order else (g.group, g.Kg, g.Og))
    if not g.direct:
        need(col.shape[0] >= T and col.shape[1] >= g.rows * g.Ktot, kernel, "col",
             f"needs shape (>= {T}, >= {g.rows * g.Ktot})", tuple(col.shape[:2]))


cdef Py_ssize_t _fewest_part_rows(Py_ssize_t rows, int og, int threads) noexcept nogil:
    """The fewest rows a part of _fwd_rows' product of `rows` rows may have on any count of
    parts up to `threads` (packed_split: all the rows where the parts split the channels'
    panels, by_panels, else a share of the rows)."""
    cdef Py_ssize_t fewest = rows, step
    cdef int parts
    for parts in range(2, <int>min(<Py_ssize_t>threads, rows) + 1):
        if by_panels(rows, og, parts):
            continue
        step = (rows + parts - 1) // parts
        fewest = min(fewest, rows - (parts - 1) * step)
    return fewest


# products a packed GEMM sums in one pass over K at any row count (128 at 16 lanes, 512 at 8)
ONE_PASS_K = PG_ONE_PASS_K


cpdef bint add_may_be_y(int kg, Py_ssize_t pixels=0, Py_ssize_t task_rows=0, int og=0,
                        int threads=1):
    """Whether conv_forward on packed weights may write each sum over its add (add as y
    itself) for a convolution of kg products per sum: where every product sums them in one
    pass over K (gemm_panels.h): kg <= PG_ONE_PASS_K, or, for a 1 x 1 convolution of `pixels`
    rows in tasks of `task_rows` (its `rows`) and og outputs a group on up to `threads`
    threads, kg <= PG_KC and no product part of PG_FEW_ROWS rows or fewer."""
    cdef Py_ssize_t last
    if kg <= PG_ONE_PASS_K:
        return True
    if kg > PG_KC or pixels <= 0 or task_rows <= 0:
        return False
    task_rows = min(task_rows, pixels)
    last = pixels - (pixels - 1) // task_rows * task_rows       # the last task's rows
    return min(_fewest_part_rows(task_rows, og, threads),
               _fewest_part_rows(last, og, threads)) > PG_FEW_ROWS


def conv_forward(const float[:, :, :, ::1] x, const float[:, :, ::1] wt, const float[::1] bias,
                 float[:, :, :, :] y, float[:, ::1] col, int O, int kh, int kw, int ph, int pw,
                 int sh, int sw, int dh, int dw, int group, Py_ssize_t rows,
                 bint caffe_order=False, const float[::1] scale=None, bint relu=False,
                 const float[:, :, :, ::1] add=None, const float[::1] packed=None):
    """y [N, oh, ow, O] = conv(x [N, H, W, C], wt) * scale (None: 1) + bias (empty: none)
    + add (None: none; y's shape), max(y, 0) of that with relu (scale, add and relu: a TEST
    net's BatchNorm, Scale, Eltwise SUM and ReLU after the convolution, caffepy/net_rules.py);
    overwritten. add may be y itself on packed weights (a TEST net's block end writing its sum
    over the shortcut, caffepy/net_memory.py): y is then written where its add was just read
    where every sum takes one pass over K (add_may_be_y), and otherwise from a copy of add
    taken first (the same floats either way). y may be a run of a wider channels-last array's
    channels (a slice of its last axis: its pixels then ldy floats apart; not with add).
    Scratch col [T, rows * Ktot] (unused by a direct convolution) for T threads. wt is
    [group, Kg, Og], or with caffe_order (1 x 1 kernels) [group, Og, Kg]: the weights as Caffe
    stores them, with no copy. packed (None: none): wt as pack_weights packed it, the GEMMs'
    operand instead of wt (then read for its shape only)."""
    cdef CGeom g = _cgeom("conv_forward", x, y, O, kh, kw, ph, pw, sh, sw, dh, dw, group, rows,
                          caffe_order)
    g.relu = relu
    g.ldy = pixel_stride("conv_forward", y, O)
    if scale is not None:
        need(scale.shape[0] == O, "conv_forward", "scale", f"needs {O} values", scale.shape[0])
        g.scale = &scale[0]
    cdef int T = col.shape[0], nt, tid, saved = 0
    cdef float[:, :, :, ::1] aside
    _check_conv("conv_forward", &g, wt, col, T)
    if packed is not None:
        g.packed_group = caffepy_packed_floats(g.Og, g.Kg)
        need(packed.shape[0] == group * g.packed_group, "conv_forward", "packed",
             f"needs {group * g.packed_group} floats (pack_weights of wt)", packed.shape[0])
        g.packed = &packed[0]
    if add is not None:
        need_shape("conv_forward", "add", dims(add.shape, 4), dims(y.shape, 4))
        need(g.ldy == O, "conv_forward", "add", "needs y's own channels (not a slice)", g.ldy)
        if add.shape[0] * add.shape[1] * add.shape[2] * add.shape[3]:
            g.add, g.y0 = &add[0, 0, 0, 0], &y[0, 0, 0, 0]
            g.add_at_y = g.add == g.y0
            need(not g.add_at_y or g.packed != NULL, "conv_forward", "add",
                 "may be y only on packed weights", "y, unpacked")
            if g.add_at_y and not add_may_be_y(g.Kg, <Py_ssize_t>g.N * g.P if g.direct else 0,
                                               g.rows, g.Og, T):
                # a product that stores partial sums in y: its add kept aside first
                aside = add.copy()
                g.add, g.add_at_y = &aside[0, 0, 0, 0], False
    need(bias.shape[0] in (0, O), "conv_forward", "bias", f"needs {O} values or none", bias.shape[0])
    cdef const float* b = &bias[0] if bias.shape[0] else NULL
    cdef Py_ssize_t tasks = _tasks(&g), task, cs = col.shape[1]
    cdef float* cp = &col[0, 0] if col.shape[1] else NULL
    if g.N == 0:
        return
    nt = _task_threads(T, tasks, <Py_ssize_t>g.N * g.P * g.O * g.Kg)
    with nogil:
        if nt == 1:
            for task in range(tasks):
                _fwd_task(&g, task, &x[0, 0, 0, 0], &wt[0, 0, 0], b, &y[0, 0, 0, 0], cp)
        else:
            saved = _blas_get_threads()
            _blas_set_threads(1)
            for task in prange(tasks, num_threads=nt, schedule="dynamic"):
                tid = threadid()
                _fwd_task(&g, task, &x[0, 0, 0, 0], &wt[0, 0, 0], b, &y[0, 0, 0, 0],
                          cp + tid * cs if cp != NULL else NULL)
            _blas_set_threads(saved)


def conv_backward(const float[:, :, :, ::1] x, const float[:, :, ::1] wt,
                  const float[:, :, :, ::1] dy, float[:, :, :, ::1] dx, float[:, ::1] dwt,
                  float[:, ::1] db, float[:, ::1] col, int O, int kh, int kw, int ph, int pw,
                  int sh, int sw, int dh, int dw, int group, Py_ssize_t rows, bint need_x,
                  bint need_w, bint need_b, bint caffe_order=False, float[::1] dw_sum=None):
    """Gradients of conv_forward: dx (overwritten) if need_x; dwt[0] = the gradient of wt
    (in wt's order) and db[0] = the bias gradient [O] summed over the batch, if need_w /
    need_b (dwt [T, ...] and db [T, O] are per-thread scratch; the caller adds row 0 to its
    diffs). With dw_sum (a weight diff in wt's order) the weight gradient is added to it
    instead, dwt[0] unused. col and caffe_order as for conv_forward."""
    cdef CGeom g = _cgeom("conv_backward", x, dy, O, kh, kw, ph, pw, sh, sw, dh, dw, group, rows,
                          caffe_order)
    cdef int T = col.shape[0], nt, tid, t, saved = 0
    _check_conv("conv_backward", &g, wt, col, T)
    cdef Py_ssize_t ws = <Py_ssize_t>group * g.Kg * g.Og, i
    if need_x:
        need_shape("conv_backward", "dx", dims(dx.shape, 4), dims(x.shape, 4))
    if need_w:
        need(dwt.shape[0] >= T and dwt.shape[1] == ws, "conv_backward", "dwt",
             f"needs shape (>= {T}, {ws})", dims(dwt.shape, 2))
        if dw_sum is not None:
            need(dw_sum.shape[0] == ws, "conv_backward", "dw_sum", f"needs {ws} values",
                 dw_sum.shape[0])
    if need_b:
        need(db.shape[0] >= T and db.shape[1] == O, "conv_backward", "db",
             f"needs shape (>= {T}, {O})", dims(db.shape, 2))
    cdef float* dxp = &dx[0, 0, 0, 0] if need_x else NULL
    cdef float* dwp = &dwt[0, 0] if need_w else NULL
    cdef float* dbp = &db[0, 0] if need_b else NULL
    cdef float* dw0 = dwp         # thread 0's weight gradient, the sum of the others' too
    if need_w and dw_sum is not None:
        dw0 = &dw_sum[0]
    cdef Py_ssize_t tasks = _tasks(&g), task, cs = col.shape[1]
    cdef float* cp = &col[0, 0] if col.shape[1] else NULL
    if g.N == 0 or not (need_x or need_w or need_b):
        return
    nt = _task_threads(T, tasks, <Py_ssize_t>g.N * g.P * g.O * g.Kg)
    with nogil:
        for t in range(nt):
            if need_w and (t > 0 or dw0 == dwp):
                memset(dwp + t * ws, 0, ws * sizeof(float))
            if need_b:
                memset(dbp + t * O, 0, O * sizeof(float))
        if nt == 1:
            for task in range(tasks):
                _bwd_task(&g, task, &x[0, 0, 0, 0], &wt[0, 0, 0], &dy[0, 0, 0, 0], dxp, dw0, dbp,
                          cp)
        else:
            saved = _blas_get_threads()
            _blas_set_threads(1)
            for task in prange(tasks, num_threads=nt, schedule="dynamic"):
                tid = threadid()
                _bwd_task(&g, task, &x[0, 0, 0, 0], &wt[0, 0, 0], &dy[0, 0, 0, 0], dxp,
                          (dwp + tid * ws if tid > 0 else dw0) if need_w else NULL,
                          dbp + tid * O if need_b else NULL,
                          cp + tid * cs if cp != NULL else NULL)
            _blas_set_threads(saved)
            for t in range(1, nt):
                if need_w:
                    for i in prange(ws, schedule="static", num_threads=threads_for(ws)):
                        dw0[i] += dwp[t * ws + i]
                if need_b:
                    for i in range(O):
                        dbp[i] += dbp[t * O + i]


# ---------------------------------------------------------------------------------------------
# Direct convolution for few input channels (group 1): the image read in place, the sums kept in
# registers (nhwc_direct.h says how). Weights wp [K, Op] and their gradient [Kp, Op] with
# K = kh * kw * C taps in (i, j, c) order, Op = O rounded up to direct_widths()[0], Kp = K
# rounded up to direct_widths()[1]; scratch per thread for the padded image (and dy's rows).

cdef extern from "nhwc_direct.h" nogil:
    enum:
        CD_V
        CD_T
    ctypedef struct cd_out:
        int ys, B
        size_t bs
    void cd_pad(const float* x, int H, int W, int C, int xs, int ph, int pw, int Wp, int r0,
                int r1, float* xp)
    void cd_forward_rows(const float* xp, int Wp, int C, int sh, int sw, const int* off, int K,
                         const float* wp, const float* bp, int Op, float* y, cd_out a, int oy0,
                         int oy1, int ow, int O, int relu)
    void cd_weight_grad_rows(const float* xp, int Wp, int C, int sh, int sw, const int* off,
                             int Kp, const float* dy, cd_out a, int oy0, int oy1, int ow, int O,
                             int Op, int band, float* dyp, float* dwp, float* dbp)


def direct_widths():
    """(outputs per vector, taps per weight-gradient block): what Op and Kp are rounded to."""
    return CD_V, CD_T


cdef CGeom _direct_geom(str kernel, x, int C, y, int O, int ys, int B, Py_ssize_t bs, int kh,
                        int kw, int ph, int pw, int sh, int sw, int dh, int dw) except *:
    """The geometry of a direct convolution of the first C of x's xs floats a pixel, into O
    outputs a pixel of y [N, floats an image] addressed by (ys, B, bs) (nhwc_direct.h)."""
    cdef CGeom g = _cgeom(kernel, x, None, O, kh, kw, ph, pw, sh, sw, dh, dw, 1, 1)
    need(1 <= C <= g.C, kernel, "C", f"must be 1 .. {g.C} (x's floats a pixel)", C)
    need(O >= 1 and B >= 1 and ys >= 1 and bs >= 0, kernel, "O, ys, B, bs",
         "must be positive (bs >= 0)", (O, ys, B, bs))
    g.C = g.Cg = C
    g.Kg = g.Ktot = C * kh * kw
    cdef Py_ssize_t last = 0, i
    for i in range(O):      # one past the furthest float an output is written to
        last = max(last, (i // B) * bs + (g.P - 1) * ys + i % B + 1)
    need(y.shape[0] == g.N and y.shape[1] >= last, kernel, "y",
         f"needs shape ({g.N}, >= {last})", tuple(y.shape[:2]))
    return g


cdef inline int _padded(int n, int pad, int out, int k, int s, int d) noexcept nogil:
    """Rows (columns) of the padded image: every window's, the last one's past the padding."""
    return max(n + 2 * pad, (out - 1) * s + d * (k - 1) + 1)


def conv_direct_plane(int H, int W, int C, int kh, int kw, int ph, int pw, int sh, int sw,
                      int dh, int dw):
    """Floats of one thread's padded image (the xpad scratch of the direct kernels)."""
    return <Py_ssize_t>_padded(H, ph, _out_size(H, ph, kh, sh, dh), kh, sh, dh) \
        * _padded(W, pw, _out_size(W, pw, kw, sw, dw), kw, sw, dw) * C


cdef int[::1] _direct_offsets(const CGeom* g, int Kp):
    """Tap k's float offset from its output pixel's origin in the padded image; 0 past K."""
    cdef int[::1] off = array.clone(array.array("i"), Kp, zero=True)
    cdef int i, j, c, Wp = _padded(g.W, g.pw, g.ow, g.kw, g.sw, g.dw)
    for i in range(g.kh):
        for j in range(g.kw):
            for c in range(g.C):
                off[(i * g.kw + j) * g.C + c] = (i * g.dh * Wp + j * g.dw) * g.C + c
    return off


cdef enum:
    # Multiply-adds a band of rows must hold to be a task of its own (~20 us on one core). When
    # threads slept at once after a region, waking one took ~50 us on a 2-core VM and bands of
    # 4M were the least that paid; with the short spin of caffepy/threads.py the team is awake
    # between a forward's layers, and bands of 1M took cifar10_quick's batch-1 forward from
    # 0.47 to 0.41 ms (benchmarks/bench_threads.py, b1 forward).
    _BAND_MACS = 1 << 20


cdef int _direct_split(const CGeom* g, int T, int* nt) noexcept nogil:
    """Tasks per image (bands of output rows), and in nt the threads for them (the thread
    rule's, at most T and the task count): 1 band when the batch gives every thread two
    images, else enough that a small batch still does, as far as each band is worth a thread,
    and a multiple of the threads when the batch is one image (2 threads, 3 bands: no gain)."""
    cdef Py_ssize_t image = <Py_ssize_t>g.P * g.O * g.Kg, split = 1
    cdef int t = max(1, min(threads_for_macs(g.N * image), T))
    if t > 1 and g.N < 2 * t:
        split = max(1, min(<Py_ssize_t>g.oh, (2 * t + g.N - 1) // g.N, image // _BAND_MACS))
        while split > t and (g.N * split) % t:
            split -= 1
    nt[0] = <int>min(<Py_ssize_t>t, g.N * split)
    return <int>split


cdef inline int _band_row(const CGeom* g, int split, int b) noexcept nogil:
    return <int>(<Py_ssize_t>g.oh * b // split)


def conv_direct_forward(const float[:, :, :, ::1] x, int C, const float[:, ::1] wp,
                        const float[::1] bp, float[:, :] y, int O, int ys, int B, Py_ssize_t bs,
                        float[:, ::1] xpad, int kh, int kw, int ph, int pw, int sh, int sw,
                        int dh, int dw, bint relu=False):
    """Outputs 0 .. O - 1 of y [N, floats an image] (addressed by ys, B, bs: nhwc_direct.h) =
    conv(the first C floats a pixel of x [N, H, W, xs], wp) + bp (bp [Op]: zeros for no bias),
    with relu max(0, that) (NaN kept); overwritten. y's images may lie further apart than its
    floats (a run of a wider blob's channels: ys its pixel stride). Scratch xpad [T,
    conv_direct_plane(...)] for T threads."""
    need(y.strides[1] == sizeof(float), "conv_direct_forward", "y", "needs its floats in a row",
         tuple([y.strides[i] for i in range(2)]))
    cdef CGeom g = _direct_geom("conv_direct_forward", x, C, y, O, ys, B, bs, kh, kw, ph, pw, sh,
                                sw, dh, dw)
    cdef int Op = wp.shape[1], T = xpad.shape[0], nt, tid, split, b, oy0, oy1
    cdef int Hp = _padded(g.H, ph, g.oh, kh, sh, dh), Wp = _padded(g.W, pw, g.ow, kw, sw, dw)
    cdef Py_ssize_t plane = <Py_ssize_t>Hp * Wp * C, n, task
    cdef cd_out a
    a.ys, a.B, a.bs = ys, B, bs
    need_shape("conv_direct_forward", "wp", dims(wp.shape, 2), (g.Kg, (O + CD_V - 1) // CD_V * CD_V))
    need_shape("conv_direct_forward", "bp", dims(bp.shape, 1), (Op,))
    need(T >= 1 and xpad.shape[1] >= plane, "conv_direct_forward", "xpad",
         f"needs shape (>= 1, >= {plane})", dims(xpad.shape, 2))
    cdef int[::1] off = _direct_offsets(&g, g.Kg)
    if g.N == 0:
        return
    split = _direct_split(&g, T, &nt)
    with nogil:
        for task in prange(<Py_ssize_t>g.N * split, num_threads=nt, schedule="static"):
            tid = threadid()
            n = task // split
            b = <int>(task % split)
            oy0 = _band_row(&g, split, b)
            oy1 = _band_row(&g, split, b + 1)
            cd_pad(&x[n, 0, 0, 0], g.H, g.W, C, x.shape[3], ph, pw, Wp, oy0 * sh,
                   (oy1 - 1) * sh + (kh - 1) * dh + 1, &xpad[tid, 0])
            cd_forward_rows(&xpad[tid, 0], Wp, C, sh, sw, &off[0], g.Kg, &wp[0, 0],
                            &bp[0], Op, &y[n, 0], a, oy0, oy1, g.ow, O, relu)


def conv_direct_weight_grad(const float[:, :, :, ::1] x, int C, const float[:, ::1] dy, int O,
                            int ys, int B, Py_ssize_t bs, float[:, ::1] dwp, float[:, ::1] dbp,
                            float[:, ::1] xpad, float[:, ::1] dyp, int band, int kh, int kw,
                            int ph, int pw, int sh, int sw, int dh, int dw):
    """dwp[0] = the weight gradient [Kp * Op] and dbp[0] = the bias gradient [Op] of
    conv_direct_forward for dy's outputs 0 .. O - 1 (addressed as its y), summed over the batch
    (overwritten; rows 1.. are the other threads' partials). Scratch xpad as for the forward,
    dyp [T, band * ow * Op]."""
    cdef CGeom g = _direct_geom("conv_direct_weight_grad", x, C, dy, O, ys, B, bs, kh, kw, ph,
                                pw, sh, sw, dh, dw)
    cdef int Op = (O + CD_V - 1) // CD_V * CD_V, Kp = (g.Kg + CD_T - 1) // CD_T * CD_T
    cdef int T = min(xpad.shape[0], min(dwp.shape[0], min(dbp.shape[0], dyp.shape[0]))), nt, tid, t
    cdef int split, b, oy0, oy1
    cdef int Hp = _padded(g.H, ph, g.oh, kh, sh, dh), Wp = _padded(g.W, pw, g.ow, kw, sw, dw)
    cdef Py_ssize_t plane = <Py_ssize_t>Hp * Wp * C, n, i, task
    cdef Py_ssize_t ws = <Py_ssize_t>Kp * Op
    cdef cd_out a
    a.ys, a.B, a.bs = ys, B, bs
    need(T >= 1 and dwp.shape[1] == ws, "conv_direct_weight_grad", "dwp",
         f"needs shape (>= 1, {ws})", dims(dwp.shape, 2))
    need(dbp.shape[1] == Op, "conv_direct_weight_grad", "dbp", f"needs shape (>= 1, {Op})",
         dims(dbp.shape, 2))
    need(xpad.shape[1] >= plane, "conv_direct_weight_grad", "xpad",
         f"needs shape (>= 1, >= {plane})", dims(xpad.shape, 2))
    need(band >= 1 and dyp.shape[1] >= <Py_ssize_t>band * g.ow * Op, "conv_direct_weight_grad",
         "dyp", f"needs shape (>= 1, >= {band} * {g.ow} * {Op})", dims(dyp.shape, 2))
    cdef int[::1] off = _direct_offsets(&g, Kp)
    split = _direct_split(&g, T, &nt)
    with nogil:
        memset(&dwp[0, 0], 0, nt * ws * sizeof(float))
        for t in range(nt):
            memset(&dbp[t, 0], 0, Op * sizeof(float))
        for task in prange(<Py_ssize_t>g.N * split, num_threads=nt, schedule="static"):
            tid = threadid()
            n = task // split
            b = <int>(task % split)
            oy0 = _band_row(&g, split, b)
            oy1 = _band_row(&g, split, b + 1)
            cd_pad(&x[n, 0, 0, 0], g.H, g.W, C, x.shape[3], ph, pw, Wp, oy0 * sh,
                   (oy1 - 1) * sh + (kh - 1) * dh + 1, &xpad[tid, 0])
            cd_weight_grad_rows(&xpad[tid, 0], Wp, C, sh, sw, &off[0], Kp, &dy[n, 0], a, oy0, oy1,
                                g.ow, O,
                                Op, band, &dyp[tid, 0], &dwp[tid, 0], &dbp[tid, 0])
        for t in range(1, nt):
            for i in range(ws):
                dwp[0, i] += dwp[t, i]
            for i in range(Op):
                dbp[0, i] += dbp[t, i]


# ---------------------------------------------------------------------------------------------
# Depthwise convolution (group = C = O, MobileNet's): y[p, c] = sum over taps of
# w[tap, c] * x[tap's pixel, c] (+ bias[c]), computed straight from the image, vectorized over
# the channels of a pixel. Tasks are output rows (forward, weight gradient) or input rows
# (data gradient, written as the gather of the transposed convolution, so no two tasks write
# one pixel). The weight is given as wdw[kh * kw, C] (Caffe's [C, 1, kh, kw] transposed).
# The rows are C (nhwc_dw_rows.h), but for the strided data gradient's.

cdef extern from "nhwc_dw_rows.h" nogil:
    ctypedef struct dw_geom:
        int N, H, W, C, oh, ow, kh, kw, ph, pw, sh, sw, dh, dw
    void dw_fwd_row(const dw_geom* g, const float* x, const float* w, const float* bias, float* y,
                    int oy, int relu)
    void dw_dx_row_s1(const dw_geom* g, const float* dy, const float* w, float* dx, int iy)
    void dw_dw_row(const dw_geom* g, const float* x, const float* dy, float* dw, float* db, int oy)


cdef dw_geom _dgeom(str kernel, x, y, w, int kh, int kw, int ph, int pw, int sh, int sw, int dh,
                    int dw) except *:
    cdef dw_geom g
    g.N, g.H, g.W, g.C = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and dh >= 1 and dw >= 1 and ph >= 0
         and pw >= 0, kernel, "geometry", "kernel, stride and dilation must be >= 1 and pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} dilation {dh}x{dw} pad {ph}x{pw}")
    g.kh, g.kw, g.ph, g.pw, g.sh, g.sw, g.dh, g.dw = kh, kw, ph, pw, sh, sw, dh, dw
    g.oh, g.ow = _out_size(g.H, ph, kh, sh, dh), _out_size(g.W, pw, kw, sw, dw)
    need(g.oh >= 1 and g.ow >= 1, kernel, "geometry", f"kernel {kh}x{kw} does not fit the image",
         f"{g.H}x{g.W}")
    need_shape(kernel, "y", tuple(y.shape[:4]), (g.N, g.oh, g.ow, g.C))
    need_shape(kernel, "w", tuple(w.shape[:2]), (kh * kw, g.C))
    return g


def dw_forward(const float[:, :, :, ::1] x, const float[:, ::1] w, const float[::1] bias,
               float[:, :, :, ::1] y, int kh, int kw, int ph, int pw, int sh, int sw, int dh,
               int dw, bint relu=False):
    """y [N, oh, ow, C] = depthwise conv(x [N, H, W, C], w [kh * kw, C]) + bias (empty: none);
    with relu, max(0, that) (NaN kept)."""
    cdef dw_geom g = _dgeom("dw_forward", x, y, w, kh, kw, ph, pw, sh, sw, dh, dw)
    need(bias.shape[0] in (0, g.C), "dw_forward", "bias", f"needs {g.C} values or none", bias.shape[0])
    cdef const float* b = &bias[0] if bias.shape[0] else NULL
    cdef Py_ssize_t item, n
    if g.N * g.C == 0:
        return
    with nogil:
        for item in prange(<Py_ssize_t>g.N * g.oh, schedule="static",
                           num_threads=threads_for(<Py_ssize_t>g.N * g.oh * g.ow * g.C * kh * kw)):
            n = item // g.oh
            dw_fwd_row(&g, &x[0, 0, 0, 0] + n * g.H * g.W * g.C, &w[0, 0], b,
                       &y[0, 0, 0, 0] + n * g.oh * g.ow * g.C, <int>(item % g.oh), relu)


cdef void _dw_dx_row(const dw_geom* g, const float* dy, const float* w, float* dx,
                     int iy) noexcept nogil:
    cdef int ix, i, j, oy, ox, ty, tx, c, C = g.C
    cdef float* dr
    cdef const float* gr
    cdef const float* wr
    memset(dx + <Py_ssize_t>iy * g.W * C, 0, <Py_ssize_t>g.W * C * sizeof(float))
    for i in range(g.kh):
        ty = iy + g.ph - i * g.dh
        if ty < 0 or ty % g.sh:
            continue
        oy = ty // g.sh
        if oy >= g.oh:
            continue
        for j in range(g.kw):
            wr = w + (i * g.kw + j) * C
            for ix in range(g.W):
                tx = ix + g.pw - j * g.dw
                if tx < 0 or tx % g.sw:
                    continue
                ox = tx // g.sw
                if ox >= g.ow:
                    continue
                gr = dy + (<Py_ssize_t>oy * g.ow + ox) * C
                dr = dx + (<Py_ssize_t>iy * g.W + ix) * C
                for c in range(C):
                    dr[c] = dr[c] + wr[c] * gr[c]


def dw_backward(const float[:, :, :, ::1] x, const float[:, ::1] w,
                const float[:, :, :, ::1] dy, float[:, :, :, ::1] dx, float[:, :, ::1] dw_acc,
                float[:, ::1] db, int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw,
                bint need_x, bint need_w, bint need_b):
    """Gradients of dw_forward: dx (overwritten) if need_x; dw_acc[0] [kh * kw, C] and db[0]
    [C] = the weight and bias gradients summed over the batch if need_w / need_b (per-thread
    scratch [T, ...]; the caller adds row 0 to its diffs)."""
    cdef dw_geom g = _dgeom("dw_backward", x, dy, w, kh, kw, ph, pw, sh, sw, dh, dw)
    cdef int T = max(dw_acc.shape[0], db.shape[0]), t, tid
    if need_x:
        need_shape("dw_backward", "dx", dims(dx.shape, 4), dims(x.shape, 4))
    if need_w:
        need(dims(dw_acc.shape + 1, 2) == (kh * kw, g.C), "dw_backward", "dw_acc",
             f"needs shape (T, {kh * kw}, {g.C})", dims(dw_acc.shape, 3))
    if need_b:
        need(db.shape[1] == g.C and (not need_w or db.shape[0] == dw_acc.shape[0]), "dw_backward",
             "db", f"needs shape ({T}, {g.C})", dims(db.shape, 2))
    cdef Py_ssize_t ws = <Py_ssize_t>kh * kw * g.C, item, n, i
    cdef Py_ssize_t xs = <Py_ssize_t>g.H * g.W * g.C, ys = <Py_ssize_t>g.oh * g.ow * g.C
    cdef float* dwp = &dw_acc[0, 0, 0] if need_w else NULL
    cdef float* dbp = &db[0, 0] if need_b else NULL
    cdef int nt = threads_for(<Py_ssize_t>g.N * g.oh * g.ow * g.C * kh * kw)
    if nt > T:
        nt = T
    if g.N * g.C == 0:
        return
    with nogil:
        if need_x:
            for item in prange(<Py_ssize_t>g.N * g.H, schedule="static", num_threads=nt):
                n = item // g.H
                if sh == 1 and sw == 1:
                    dw_dx_row_s1(&g, &dy[0, 0, 0, 0] + n * ys, &w[0, 0],
                                 &dx[0, 0, 0, 0] + n * xs, <int>(item % g.H))
                else:
                    _dw_dx_row(&g, &dy[0, 0, 0, 0] + n * ys, &w[0, 0], &dx[0, 0, 0, 0] + n * xs,
                               <int>(item % g.H))
        if need_w or need_b:
            for t in range(nt):
                if need_w:
                    memset(dwp + t * ws, 0, ws * sizeof(float))
                if need_b:
                    memset(dbp + t * g.C, 0, g.C * sizeof(float))
            for item in prange(<Py_ssize_t>g.N * g.oh, schedule="static", num_threads=nt):
                tid = threadid()
                n = item // g.oh
                dw_dw_row(&g, &x[0, 0, 0, 0] + n * xs, &dy[0, 0, 0, 0] + n * ys,
                          dwp + tid * ws if need_w else NULL,
                          dbp + tid * g.C if need_b else NULL, <int>(item % g.oh))
            for t in range(1, nt):
                if need_w:
                    for i in range(ws):
                        dwp[i] += dwp[t * ws + i]
                if need_b:
                    for i in range(g.C):
                        dbp[i] += dbp[t * g.C + i]


# ---------------------------------------------------------------------------------------------
# Pooling: windows as Caffe's (cext/vision.pyx), over the C channels of a pixel at once. Tasks
# are output rows (forward) or images (backward: windows overlap).

cdef _check_pool(str kernel, str xname, x, str yname, y, int kh, int kw, int sh, int sw, int ph,
                 int pw):
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and ph >= 0 and pw >= 0, kernel,
         "geometry", "kernel and stride must be >= 1, pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} pad {ph}x{pw}")
    need(x.shape[0] == y.shape[0] and x.shape[3] == y.shape[3] and y.shape[1] >= 1
         and y.shape[2] >= 1, kernel, yname, f"does not fit {xname} {tuple(x.shape[:4])}",
         tuple(y.shape[:4]))
    need((y.shape[1] - 1) * sh - ph < x.shape[1] and (y.shape[2] - 1) * sw - pw < x.shape[2],
         kernel, yname, f"has windows past {xname} {tuple(x.shape[:4])}", tuple(y.shape[:4]))


cdef extern from "nhwc_pool_rows.h" nogil:
    void caffepy_max_row(const float* x, float* y, int32_t* mask, int H, int W, int C, int ow,
                         int py, int kh, int kw, int sh, int sw, int ph, int pw)


def pool_max_forward(const float[:, :, :, ::1] x, float[:, :, :, ::1] y,
                     int32_t[:, :, :, ::1] mask, int kh, int kw, int sh, int sw, int ph, int pw):
    """y = max over each window (padding ignored); mask = h * W + w of the first maximum
    (mask None: the maxima alone)."""
    _check_pool("pool_max_forward", "x", x, "y", y, kh, kw, sh, sw, ph, pw)
    if mask is not None:
        need_shape("pool_max_forward", "mask", dims(mask.shape, 4), dims(y.shape, 4))
    cdef int N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3]
    cdef int oh = y.shape[1], ow = y.shape[2]
    cdef Py_ssize_t item, n
    cdef int32_t* mk = &mask[0, 0, 0, 0] if mask is not None else NULL
    if N * C == 0:
        return
    with nogil:
        for item in prange(<Py_ssize_t>N * oh, schedule="static",
                           num_threads=threads_for(<Py_ssize_t>N * oh * ow * C * kh * kw)):
            n = item // oh
            caffepy_max_row(&x[0, 0, 0, 0] + n * H * W * C,
                            &y[0, 0, 0, 0] + (n * oh + item % oh) * ow * C,
                            mk + (n * oh + item % oh) * ow * C if mk != NULL else NULL, H, W, C,
                            ow, <int>(item % oh), kh, kw, sh, sw, ph, pw)


def pool_max_backward(const float[:, :, :, ::1] dy, const int32_t[:, :, :, ::1] mask,
                      float[:, :, :, ::1] dx):
    """dx = top diffs routed to their argmax (zeroed first: overwritten)."""
    need_shape("pool_max_backward", "mask", dims(mask.shape, 4), dims(dy.shape, 4))
    need(dx.shape[0] == dy.shape[0] and dx.shape[3] == dy.shape[3], "pool_max_backward", "dx",
         f"does not fit dy {dims(dy.shape, 4)}", dims(dx.shape, 4))
    cdef int N = dx.shape[0], C = dx.shape[3], c
    cdef Py_ssize_t HW = <Py_ssize_t>dx.shape[1] * dx.shape[2], OHW = <Py_ssize_t>dy.shape[1] * dy.shape[2]
    cdef Py_ssize_t n, p
    cdef float* d
    cdef const float* g
    cdef const int32_t* mk
    if N * C == 0:
        return
    with nogil:
        for n in prange(N, schedule="static", num_threads=threads_for(N * (HW + OHW) * C)):
            d = &dx[0, 0, 0, 0] + n * HW * C
            g = &dy[0, 0, 0, 0] + n * OHW * C
            mk = &mask[0, 0, 0, 0] + n * OHW * C
            memset(d, 0, HW * C * sizeof(float))
            for p in range(OHW):
                for c in range(C):
                    if mk[p * C + c] >= 0:
                        d[<Py_ssize_t>mk[p * C + c] * C + c] += g[p * C + c]


cdef void _ave_row(const float* x, float* y, int H, int W, int C, int ow, int py, int kh, int kw,
                   int sh, int sw, int ph, int pw) noexcept nogil:
    cdef int px, h, w, hs, he, ws, we, c
    cdef float inv
    cdef const float* src
    cdef float* out
    hs = py * sh - ph
    he = min(hs + kh, H + ph)
    for px in range(ow):
        ws = px * sw - pw
        we = min(ws + kw, W + pw)
        inv = 1.0 / ((he - hs) * (we - ws))
        out = y + <Py_ssize_t>px * C
        for c in range(C):
            out[c] = 0.0
        for h in range(max(hs, 0), min(he, H)):
            for w in range(max(ws, 0), min(we, W)):
                src = x + (<Py_ssize_t>h * W + w) * C
                for c in range(C):
                    out[c] = out[c] + src[c]
        for c in range(C):
            out[c] = out[c] * inv


def pool_ave_forward(const float[:, :, :, ::1] x, float[:, :, :, ::1] y, int kh, int kw, int sh,
                     int sw, int ph, int pw):
    """y = window sum / window size clipped to the padded image (Caffe's AVE; overwritten)."""
    _check_pool("pool_ave_forward", "x", x, "y", y, kh, kw, sh, sw, ph, pw)
    cdef int N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3]
    cdef int oh = y.shape[1], ow = y.shape[2]
    cdef Py_ssize_t item, n
    if N * C == 0:
        return
    with nogil:
        for item in prange(<Py_ssize_t>N * oh, schedule="static",
                           num_threads=threads_for(<Py_ssize_t>N * oh * ow * C * kh * kw)):
            n = item // oh
            _ave_row(&x[0, 0, 0, 0] + n * H * W * C, &y[0, 0, 0, 0] + (n * oh + item % oh) * ow * C,
                     H, W, C, ow, <int>(item % oh), kh, kw, sh, sw, ph, pw)


def pool_ave_backward(const float[:, :, :, ::1] dy, float[:, :, :, ::1] dx, int kh, int kw,
                      int sh, int sw, int ph, int pw):
    """dx = each top diff spread evenly over its window (zeroed first: overwritten)."""
    _check_pool("pool_ave_backward", "dx", dx, "dy", dy, kh, kw, sh, sw, ph, pw)
    cdef int N = dx.shape[0], H = dx.shape[1], W = dx.shape[2], C = dx.shape[3]
    cdef int oh = dy.shape[1], ow = dy.shape[2], py, px, h, w, hs, he, ws, we, c
    cdef Py_ssize_t n
    cdef float inv
    cdef float* d
    cdef float* cell
    cdef const float* g
    if N * C == 0:
        return
    with nogil:
        for n in prange(N, schedule="static",
                        num_threads=threads_for(<Py_ssize_t>N * oh * ow * C * kh * kw)):
            d = &dx[0, 0, 0, 0] + n * H * W * C
            memset(d, 0, <Py_ssize_t>H * W * C * sizeof(float))
            for py in range(oh):
                hs = py * sh - ph
                he = min(hs + kh, H + ph)
                for px in range(ow):
                    ws = px * sw - pw
                    we = min(ws + kw, W + pw)
                    inv = 1.0 / ((he - hs) * (we - ws))
                    g = &dy[0, 0, 0, 0] + ((n * oh + py) * ow + px) * C
                    for h in range(max(hs, 0), min(he, H)):
                        for w in range(max(ws, 0), min(we, W)):
                            cell = d + (<Py_ssize_t>h * W + w) * C
                            for c in range(C):
                                cell[c] = cell[c] + g[c] * inv


# ---------------------------------------------------------------------------------------------
# Per-channel passes over [M, C] (M = N * H * W pixels): BatchNorm, Scale. Tasks are runs of
# _ROWS pixels; reductions keep float sums per task (one pixel's C channels are one vector
# operation) and add the tasks up in float64, per thread, then across threads.

cdef extern from "nhwc_bn_rows.h" nogil:
    void caffepy_moments_rows(const float* x, long rows, int C, const float* shift, float* s1,
                              float* s2)
    void caffepy_dots_rows(const float* a, const float* b, long rows, int C, float* s1, float* s2)
    void caffepy_bn_scale_relu_rows(const float* x, float* y, float* xn, long rows, int C,
                                    const float* sub, const float* mul, const float* gamma,
                                    const float* beta, float slope)
    void caffepy_relu_dots_rows(const float* dy, const float* xn, long rows, int C,
                                const float* gamma, const float* beta, float slope, float* s1,
                                float* s2)
    void caffepy_bn_relu_grad_rows(const float* dy, const float* xn, float* dx, long rows, int C,
                                   const float* p, const float* q, const float* r,
                                   const float* gamma, const float* beta, float slope)


cdef struct Relu:               # a ReLU fused after BatchNorm + Scale: y = relu(xn * gamma + beta)
    const float* gamma          # NULL: no ReLU
    const float* beta
    float slope


cdef Relu _NO_RELU = Relu(NULL, NULL, 0)


cdef void _reduce(const float* a, const float* b, Py_ssize_t M, int C, const float* shift,
                  double* out1, double* out2, float* work, double* partial, int T,
                  Relu relu) noexcept nogil:
    """out1 = sum over rows of (a - shift) and out2 of (a - shift)^2 (b NULL), or of a and
    a * b, with a through the fused ReLU's gradient if relu.gamma; work [T, 2C] floats,
    partial [T, 2C] doubles."""
    cdef Py_ssize_t tasks = _row_tasks(M), task, r0
    cdef int nt = threads_for(M * C), tid, c, t
    cdef float* w
    cdef double* p
    if nt > T:
        nt = T
    memset(partial, 0, <Py_ssize_t>nt * 2 * C * sizeof(double))
    for task in prange(tasks, schedule="static", num_threads=nt):
        tid = threadid()
        w = work + <Py_ssize_t>tid * 2 * C
        p = partial + <Py_ssize_t>tid * 2 * C
        r0 = task * _ROWS
        if b == NULL:
            caffepy_moments_rows(a + r0 * C, min(<Py_ssize_t>_ROWS, M - r0), C, shift, w, w + C)
        elif relu.gamma == NULL:
            caffepy_dots_rows(a + r0 * C, b + r0 * C, min(<Py_ssize_t>_ROWS, M - r0), C, w, w + C)
        else:
            caffepy_relu_dots_rows(a + r0 * C, b + r0 * C, min(<Py_ssize_t>_ROWS, M - r0), C,
                                   relu.gamma, relu.beta, relu.slope, w, w + C)
        for c in range(2 * C):
            p[c] = p[c] + w[c]
    for c in range(C):
        out1[c] = 0.0
        out2[c] = 0.0
        for t in range(nt):
            out1[c] += partial[t * 2 * C + c]
            out2[c] += partial[t * 2 * C + C + c]


cdef _scratch_ok(str kernel, work, partial, int C):
    need(work.shape[0] >= 1 and work.shape[1] >= 2 * C, kernel, "work",
         f"needs shape (threads, >= {2 * C})", tuple(work.shape[:2]))
    need(partial.shape[0] >= work.shape[0] and partial.shape[1] >= 2 * C, kernel, "partial",
         f"needs shape (>= {work.shape[0]}, >= {2 * C})", tuple(partial.shape[:2]))


def channel_moments(const float[:, ::1] x, const float[::1] shift, double[::1] s1, double[::1] s2,
                    float[:, ::1] work, double[:, ::1] partial):
    """Per channel c of x [M, C]: s1[c] = sum of (x - shift[c]), s2[c] = sum of its squares
    (overwritten). work [T, 2C], partial [T, 2C]: per-thread scratch."""
    cdef Py_ssize_t M = x.shape[0]
    cdef int C = x.shape[1]
    need_shape("channel_moments", "shift", dims(shift.shape, 1), (C,))
    need(s1.shape[0] == C and s2.shape[0] == C, "channel_moments", "s1, s2", f"need {C} values",
         (s1.shape[0], s2.shape[0]))
    _scratch_ok("channel_moments", work, partial, C)
    if C == 0:
        return
    with nogil:
        _reduce(&x[0, 0], NULL, M, C, &shift[0], &s1[0], &s2[0], &work[0, 0], &partial[0, 0],
                work.shape[0], _NO_RELU)


cdef Relu _relu_args(str kernel, relu, int C) except *:
    """The Relu of an optional (gamma, beta, slope), checked."""
    cdef Relu r
    cdef const float[::1] gamma
    cdef const float[::1] beta
    r.gamma, r.beta, r.slope = NULL, NULL, 0
    if relu is None:
        return r
    gamma, beta = relu[0], relu[1]
    need(gamma.shape[0] == C and beta.shape[0] == C, kernel, "relu", f"needs gamma and beta of "
         f"{C} values", (gamma.shape[0], beta.shape[0]))
    r.gamma, r.beta, r.slope = &gamma[0], &beta[0], relu[2]
    return r


def channel_dots(const float[:, ::1] a, const float[:, ::1] b, double[::1] sa, double[::1] sab,
                 float[:, ::1] work, double[:, ::1] partial, relu=None):
    """Per channel c of a, b [M, C]: sa[c] = sum of a, sab[c] = sum of a * b (overwritten).
    With relu = (gamma, beta, slope), a is first taken through the gradient of a ReLU of
    b * gamma + beta with that negative slope (a fused BatchNorm + Scale + ReLU's backward)."""
    cdef Py_ssize_t M = a.shape[0]
    cdef int C = a.shape[1]
    need_shape("channel_dots", "b", dims(b.shape, 2), dims(a.shape, 2))
    need(sa.shape[0] == C and sab.shape[0] == C, "channel_dots", "sa, sab", f"need {C} values",
         (sa.shape[0], sab.shape[0]))
    _scratch_ok("channel_dots", work, partial, C)
    cdef Relu r = _relu_args("channel_dots", relu, C)
    if C == 0:
        return
    with nogil:
        _reduce(&a[0, 0], &b[0, 0], M, C, NULL, &sa[0], &sab[0], &work[0, 0], &partial[0, 0],
                work.shape[0], r)


cdef void _affine_rows(const float* x, float* y, float* keep, bint keep_output, Py_ssize_t rows,
                       int C, const float* sub, const float* mul, const float* add) noexcept nogil:
    cdef Py_ssize_t r
    cdef int c
    cdef const float* xr
    cdef float* yr
    cdef float* kr
    for r in range(rows):
        xr = x + r * C
        yr = y + r * C
        kr = keep + r * C if keep != NULL else NULL
        if kr != NULL and not keep_output:
            for c in range(C):
                kr[c] = xr[c]
        if add == NULL:
            for c in range(C):
                yr[c] = (xr[c] - sub[c]) * mul[c]
        else:
            for c in range(C):
                yr[c] = xr[c] * mul[c] + add[c]
        if kr != NULL and keep_output:
            for c in range(C):
                kr[c] = yr[c]


def channel_affine(const float[:, ::1] x, const float[::1] sub, const float[::1] mul,
                   const float[::1] add, float[:, ::1] y, float[:, ::1] keep, bint keep_output=False):
    """Per channel c of x [M, C]: y = (x - sub[c]) * mul[c] when `add` is empty (BatchNorm), else
    y = x * mul[c] + add[c] (Scale; `sub` unused). When `keep` is not empty it gets a copy of x
    (an in-place Scale keeps its input) or, with keep_output, of y (BatchNorm keeps its
    normalized output). y may be x."""
    cdef Py_ssize_t M = x.shape[0], task, r0
    cdef int C = x.shape[1]
    cdef bint has_add = add.shape[0] > 0, has_keep = keep.shape[0] > 0
    need_shape("channel_affine", "y", dims(y.shape, 2), dims(x.shape, 2))
    need_shape("channel_affine", "mul", dims(mul.shape, 1), (C,))
    need(sub.shape[0] == C or has_add, "channel_affine", "sub", f"needs {C} values", sub.shape[0])
    if has_add:
        need_shape("channel_affine", "add", dims(add.shape, 1), (C,))
    if has_keep:
        need_shape("channel_affine", "keep", dims(keep.shape, 2), dims(x.shape, 2))
    if M * C == 0:
        return
    cdef const float* sp = &sub[0] if sub.shape[0] else NULL
    cdef const float* ap = &add[0] if has_add else NULL
    cdef float* kp = &keep[0, 0] if has_keep else NULL
    with nogil:
        for task in prange(_row_tasks(M), schedule="static", num_threads=threads_for(M * C)):
            r0 = task * _ROWS
            _affine_rows(&x[0, 0] + r0 * C, &y[0, 0] + r0 * C, kp + r0 * C if kp != NULL else NULL,
                         keep_output, min(<Py_ssize_t>_ROWS, M - r0), C, sp, &mul[0], ap)


def bn_scale_forward(const float[:, ::1] x, const float[::1] sub, const float[::1] mul,
                     const float[::1] gamma, const float[::1] beta, float[:, ::1] y,
                     float[:, ::1] xn, relu=None):
    """BatchNorm and the Scale after it in one pass over x [M, C]: per channel c,
    xn = (x - sub[c]) * mul[c] (kept for the backward) and y = xn * gamma[c] + beta[c], then
    y = max(y, 0) + slope * min(y, 0) if relu is a ReLU's negative slope. y may be x; xn may
    not."""
    cdef Py_ssize_t M = x.shape[0], task, r0
    cdef int C = x.shape[1]
    need_shape("bn_scale_forward", "y", dims(y.shape, 2), dims(x.shape, 2))
    need_shape("bn_scale_forward", "xn", dims(xn.shape, 2), dims(x.shape, 2))
    for name, v in (("sub", sub), ("mul", mul), ("gamma", gamma), ("beta", beta)):
        need(v.shape[0] == C, "bn_scale_forward", name, f"needs {C} values", v.shape[0])
    cdef float slope = 1.0 if relu is None else relu      # slope 1: the identity, exactly
    if M * C == 0:
        return
    with nogil:
        for task in prange(_row_tasks(M), schedule="static", num_threads=threads_for(M * C)):
            r0 = task * _ROWS
            caffepy_bn_scale_relu_rows(&x[0, 0] + r0 * C, &y[0, 0] + r0 * C, &xn[0, 0] + r0 * C,
                                       min(<Py_ssize_t>_ROWS, M - r0), C, &sub[0], &mul[0],
                                       &gamma[0], &beta[0], slope)


cdef void _bn_grad_rows(const float* dy, const float* xn, float* dx, Py_ssize_t rows, int C,
                        const float* p, const float* q, const float* r, Relu relu) noexcept nogil:
    cdef Py_ssize_t i
    cdef int c
    cdef const float* g
    cdef const float* z
    cdef float* d
    if relu.gamma != NULL:
        caffepy_bn_relu_grad_rows(dy, xn, dx, rows, C, p, q, r, relu.gamma, relu.beta, relu.slope)
        return
    for i in range(rows):
        g = dy + i * C
        z = xn + i * C
        d = dx + i * C
        for c in range(C):
            d[c] = p[c] * g[c] + q[c] * z[c] + r[c]


def bn_backward_apply(const float[:, ::1] dy, const float[:, ::1] xn, const float[::1] p,
                      const float[::1] q, const float[::1] r, float[:, ::1] dx, relu=None):
    """dx = p[c] dy + q[c] xn + r[c] per channel (BatchNorm's gradient from its sums; dx may be
    dy), with dy first through a fused ReLU's gradient if relu (as channel_dots)."""
    cdef Py_ssize_t M = dy.shape[0], task, r0
    cdef int C = dy.shape[1]
    need_shape("bn_backward_apply", "xn", dims(xn.shape, 2), dims(dy.shape, 2))
    need_shape("bn_backward_apply", "dx", dims(dx.shape, 2), dims(dy.shape, 2))
    for name, v in (("p", p), ("q", q), ("r", r)):
        need(v.shape[0] == C, "bn_backward_apply", name, f"needs {C} values", v.shape[0])
    cdef Relu fused = _relu_args("bn_backward_apply", relu, C)
    if M * C == 0:
        return
    with nogil:
        for task in prange(_row_tasks(M), schedule="static", num_threads=threads_for(M * C)):
            r0 = task * _ROWS
            _bn_grad_rows(&dy[0, 0] + r0 * C, &xn[0, 0] + r0 * C, &dx[0, 0] + r0 * C,
                          min(<Py_ssize_t>_ROWS, M - r0), C, &p[0], &q[0], &r[0], fused)


# ---------------------------------------------------------------------------------------------
# Concat along channels: a run of each pixel's channels, copied pixel by pixel on threads.

def copy_columns(const float[:, ::1] src, int s0, float[:, ::1] dst, int d0, int n):
    """dst[:, d0:d0 + n] = src[:, s0:s0 + n] (rows: pixels; columns: channels)."""
    cdef Py_ssize_t M = src.shape[0], r, task, lo, hi, rows
    need_shape("copy_columns", "dst rows", (dst.shape[0],), (M,))
    need(0 <= s0 and n >= 0 and s0 + n <= src.shape[1], "copy_columns", "s0, n",
         f"must lie within src's {src.shape[1]} columns", (s0, n))
    need(0 <= d0 and d0 + n <= dst.shape[1], "copy_columns", "d0, n",
         f"must lie within dst's {dst.shape[1]} columns", (d0, n))
    if M == 0 or n == 0:
        return
    rows = max(1, (1 << 14) // n)
    for task in prange((M + rows - 1) // rows, nogil=True, schedule="static",
                       num_threads=threads_for(M * n)):
        lo = task * rows
        hi = min(lo + rows, M)
        for r in range(lo, hi):
            memcpy(&dst[r, d0], &src[r, s0], n * sizeof(float))


# ---------------------------------------------------------------------------------------------
# LRN across channels: the rows are C (cext/nhwc_lrn_rows.h).

cdef extern from "nhwc_lrn_rows.h" nogil:
    void caffepy_lrn_forward_rows(const float* x, float* y, long rows, int C, int size, float k,
                                  float a, float beta, int kind, float* w)
    void caffepy_lrn_backward_rows(const float* x, const float* dy, float* dx, long rows, int C,
                                   int size, float k, float a, float beta, int kind, float cache,
                                   float* w)


def lrn_work_size(int C, int size):
    """Floats of work memory per thread for lrn_forward / lrn_backward."""
    return 3 * C + size


def lrn_forward(const float[:, ::1] x, float[:, ::1] y, int size, float alpha, float beta,
                float k, float[:, ::1] work):
    """y = x * (k + alpha/size * window sum of x^2 across the channels of a pixel)^-beta for
    x [M, C] (overwritten); work [T, lrn_work_size(C, size)]."""
    cdef Py_ssize_t M = x.shape[0], task, r0
    cdef int C = x.shape[1], kind = _pow_kind(beta), tid
    need_shape("lrn_forward", "y", dims(y.shape, 2), dims(x.shape, 2))
    need(size >= 1 and size % 2 == 1, "lrn_forward", "local_size", "must be odd and positive", size)
    need(work.shape[1] >= 3 * C + size, "lrn_forward", "work",
         f"needs shape (threads, >= {3 * C + size})", dims(work.shape, 2))
    cdef int nt = min(threads_for(M * C * size), <int>work.shape[0])
    if M * C == 0:
        return
    with nogil:
        for task in prange(_row_tasks(M), schedule="static", num_threads=nt):
            tid = threadid()
            r0 = task * _ROWS
            caffepy_lrn_forward_rows(&x[0, 0] + r0 * C, &y[0, 0] + r0 * C,
                                     min(<Py_ssize_t>_ROWS, M - r0), C, size, k, alpha / size,
                                     beta, kind, &work[tid, 0])


def lrn_backward(const float[:, ::1] x, const float[:, ::1] dy, float[:, ::1] dx, int size,
                 float alpha, float beta, float k, float[:, ::1] work):
    """The LRN's bottom diff from x and dy (overwritten); work as for lrn_forward."""
    cdef Py_ssize_t M = x.shape[0], task, r0
    cdef int C = x.shape[1], kind = _pow_kind(beta), tid
    need_shape("lrn_backward", "dy", dims(dy.shape, 2), dims(x.shape, 2))
    need_shape("lrn_backward", "dx", dims(dx.shape, 2), dims(x.shape, 2))
    need(size >= 1 and size % 2 == 1, "lrn_backward", "local_size", "must be odd and positive", size)
    need(work.shape[1] >= 3 * C + size, "lrn_backward", "work",
         f"needs shape (threads, >= {3 * C + size})", dims(work.shape, 2))
    cdef int nt = min(threads_for(M * C * size * 2), <int>work.shape[0])
    if M * C == 0:
        return
    with nogil:
        for task in prange(_row_tasks(M), schedule="static", num_threads=nt):
            tid = threadid()
            r0 = task * _ROWS
            caffepy_lrn_backward_rows(&x[0, 0] + r0 * C, &dy[0, 0] + r0 * C,
                                      &dx[0, 0] + r0 * C, min(<Py_ssize_t>_ROWS, M - r0), C,
                                      size, k, alpha / size, beta, kind,
                                      2.0 * alpha * beta / size, &work[tid, 0])
