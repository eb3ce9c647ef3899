# cython: language_level=3
"""Winograd convolution F(m x m, r x r) on the SIMD-blocked layout [N, Cb, H, W, V] and on the
channels-last one [N, H, W, C]: an algorithm of the blocked Convolution (caffepy/layers/intel.py
picks it per layer shape) and of the channels-last one (caffepy/layers/nhwc.py, by measurement).

Its own module, shared by the two layout families: it shares nothing with their im2col paths
but the layouts. The two differ only in where a block of V channels of a pixel lives: in the
blocked layout a block is a plane [H][W][V] (pixel stride V), channels-last it is V channels of
each pixel [H][W][C] (pixel stride C); the transforms take the pixel stride, the rest is common.

For stride-1, undilated r x r kernels, each m x m tile of output is computed from an
a x a tile of input (a = m + r - 1) with a*a products per channel pair instead of m*m*r*r:

    Y = AT [ sum_c (G g G^T) . (BT d BT^T) ] AT^T           (. = elementwise)

so the sum over channels becomes a*a independent GEMMs, one per tile position p:
M_p[tiles, O] = V_p[tiles, C] @ U_p[O, C]^T. For AlexNet's 13x13 3x3 layers, F(4x4, 3x3) does
2.6x fewer multiplies than im2col + GEMM, and F(3x3, 5x5) 4.6x on its 27x27 5x5 layer (padding
to whole tiles included).

Backward, with dM = AT^T dY AT per output tile:
    dV_p = dM_p @ U_p,     dx = sum over tiles of BT^T dV BT      (input gradient)
    dU_p = dM_p^T @ V_p,   dW = G^T dU G                           (weight gradient)

The matrices come from `matrices(m, r)` (Toom-Cook on the points 0, +-1, +-2, 1/2, ..., infinity).
The tile and weight transforms are C in winograd_tiles.h; the GEMMs go to scipy's BLAS.
Each OpenMP thread takes an equal share of the images and runs it with a single-threaded BLAS,
in passes over a few dozen to a few hundred tiles, so that its tile buffers stay in cache
between the transforms and the GEMMs (scratch_shapes sizes them). In the blocked layout,
channel lanes past C or O are padding: written as zeros, never read as data (as every kernel of
caffepy.kernels.intel); channels-last, the last block of a pixel is only read and written up to
C or O.

The NumPy reference is the NCHW convolution of caffepy/kernels/reference/vision.py on the
unpacked arrays (tests/layers/test_winograd.py, tests/layers/test_nhwc.py); `matrices` is
checked against the correlation it computes.
"""

cimport openmp
from cython.parallel cimport prange, threadid
from libc.string cimport memcpy, memset

import numpy as np

from blas cimport caffepy_packed_floats, caffepy_panel_pack, gemm_ld, gemm_packed
from rules cimport MACS_PER_OP, dims, need, need_shape, pixel_stride, threads_for

include "blas_threads.pxi"

DEF MAX_A = 8        # largest tile side a = m + r - 1
DEF MAX_V = 32       # widest channel block
# A pass over a thread's tile buffers (scratch_shapes): PASS_BYTES of them, at least MIN_ROWS
# tiles (the GEMMs' rows), and the whole task in one pass when U is larger than U_CACHED.
PASS_BYTES = 2 << 20
MIN_ROWS = 32
U_CACHED = 4 << 20
SPREAD_BYTES = 32 << 20
# weight_transform writes a U of this size or more past the cache (see there)
STREAM_U = 8 << 20


def matrices(int m, int r):
    """(AT [m, a], G [a, r], BT [a, a]) float32 for F(m, r), a = m + r - 1 <= 8.

    AT and G are the Vandermonde rows of the interpolation points (G scaled by 1 / prod(p - q));
    BT is then the unique matrix making AT[(G g) . (BT d)] the correlation of d with g, solved
    for exactly (least squares with a zero residual, checked).
    """
    cdef int a = m + r - 1
    need(m >= 1 and r >= 1 and a <= MAX_A, "matrices", "m, r",
         f"tile side m + r - 1 must be 1..{MAX_A}", f"F({m}, {r})")
    candidates = [0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5]
    points = candidates[:a - 1]
    at = np.zeros((m, a))
    g = np.zeros((a, r))
    for j, p in enumerate(points):
        scale = np.prod([p - q for q in points if q != p])
        at[:, j] = [p ** i for i in range(m)]
        g[j] = [p ** k / scale for k in range(r)]
    at[m - 1, a - 1] = 1.0
    g[a - 1, r - 1] = 1.0
    # sum_j AT[i, j] G[j, k] BT[j, l] == [l == i + k] for all i, k, l: linear in BT
    system = np.zeros((m * r * a, a * a))
    rhs = np.zeros(m * r * a)
    row = 0
    for i in range(m):
        for k in range(r):
            for l in range(a):
                for j in range(a):
                    system[row, j * a + l] = at[i, j] * g[j, k]
                rhs[row] = 1.0 if l == i + k else 0.0
                row += 1
    bt = np.linalg.lstsq(system, rhs, rcond=None)[0]
    need(np.abs(system @ bt - rhs).max() <= 1e-9, "matrices", "m, r",
         "no input transform for these points", f"F({m}, {r})")
    bt = np.round(bt.reshape(a, a), 9)
    return at.astype(np.float32), g.astype(np.float32), bt.astype(np.float32)


cdef struct WGeom:
    int N, C, Cb, H, W, O, Ob, oh, ow, V
    int m, r, a, ph, pw, group, Cg, Og
    int th, tw                    # tiles per image along y, x
    int chunk                     # images per task (a thread's unit of work)
    Py_ssize_t tiles              # tiles per pass over the buffers (rows of every GEMM)
    Py_ssize_t cpad, opad         # channel columns of the V and M buffers (Cb * V, Ob * V)
    Py_ssize_t vps, mps           # floats between tile positions in the V and M buffers
    Py_ssize_t xn, xb, xp         # x's strides: image, block of V channels, pixel
    Py_ssize_t yn, yb, yp         # y's (and dy's) strides
    bint pad_lanes                # blocked: lanes past O are written as zeros
    bint relu                     # the forward's output through max(0, y) (a TEST net's ReLU)
    bint fixed                    # at, bt are the tile transforms' tables (wg_fixed)
    float at[MAX_A * MAX_A]       # AT [m, a] and its transpose am [a, m]
    float am[MAX_A * MAX_A]
    float bt[MAX_A * MAX_A]       # BT [a, a] and its transpose bm
    float bm[MAX_A * MAX_A]
    const float* up               # the forward's U packed (pack_u; NULL: none), pair j's
    Py_ssize_t up_each            # panels at up + j * up_each


cdef WGeom _geom(str kernel, tuple xs, str yname, tuple ys, bint blocked, int V, int C, int O,
                 int m, int r, int ph, int pw, int group, vbuf, mbuf, const float[:, ::1] at,
                 const float[:, ::1] bt) except *:
    """The geometry of x (shape xs) and y (ys): blocked [N, Cb, H, W, V] or channels-last
    [N, H, W, C] with blocks of V channels."""
    cdef WGeom g
    cdef int i, j
    if blocked:
        g.N, g.Cb, g.H, g.W, g.V = xs[0], xs[1], xs[2], xs[3], xs[4]
        need(C <= g.Cb * g.V, kernel, "x", f"needs the blocks of width {g.V} that hold {C} channels",
             f"{g.Cb} blocks")
    else:
        g.N, g.H, g.W, g.V = xs[0], xs[1], xs[2], V
        need(xs[3] == C, kernel, "x", f"needs {C} channels", xs[3])
        g.Cb = (C + V - 1) // V
    g.C, g.O, g.m, g.r, g.a, g.ph, g.pw, g.group = C, O, m, r, m + r - 1, ph, pw, group
    need(g.a <= MAX_A and m >= 1 and r >= 1, kernel, "m, r",
         f"tile side m + r - 1 must be 1..{MAX_A}", f"F({m}, {r})")
    need(1 <= g.V <= MAX_V, kernel, "x", f"needs a block width of 1 to {MAX_V}", g.V)
    need(group >= 1 and C % group == 0 and O % group == 0, kernel, "group",
         f"must divide {C} input and {O} output channels", group)
    g.Ob = (O + g.V - 1) // g.V
    g.oh = g.H + 2 * ph - r + 1
    g.ow = g.W + 2 * pw - r + 1
    need(g.oh >= 1 and g.ow >= 1, kernel, "geometry",
         f"kernel {r}x{r} (pad {ph}x{pw}) does not fit the image", f"{g.H}x{g.W}")
    if blocked:
        need_shape(kernel, yname, ys, (g.N, g.Ob, g.oh, g.ow, g.V))
        g.xp, g.xb, g.xn = g.V, <Py_ssize_t>g.H * g.W * g.V, <Py_ssize_t>g.Cb * g.H * g.W * g.V
        g.yp, g.yb, g.yn = g.V, <Py_ssize_t>g.oh * g.ow * g.V, <Py_ssize_t>g.Ob * g.oh * g.ow * g.V
    else:
        need_shape(kernel, yname, ys, (g.N, g.oh, g.ow, O))
        g.xp, g.xb, g.xn = C, g.V, <Py_ssize_t>g.H * g.W * C
        g.yp, g.yb, g.yn = O, g.V, <Py_ssize_t>g.oh * g.ow * O
    g.pad_lanes = blocked
    g.relu = False
    g.Cg, g.Og = C // group, O // group
    g.th, g.tw = (g.oh + m - 1) // m, (g.ow + m - 1) // m
    g.cpad, g.opad = <Py_ssize_t>g.Cb * g.V, <Py_ssize_t>g.Ob * g.V
    g.tiles = vbuf.shape[2]
    need(g.tiles > 0, kernel, "vbuf", "needs room for a tile", g.tiles)
    g.chunk = max(1, (g.N + vbuf.shape[0] - 1) // vbuf.shape[0])
    need_shape(kernel, "at", dims(at.shape, 2), (m, g.a))
    need_shape(kernel, "bt", dims(bt.shape, 2), (g.a, g.a))
    for i in range(g.a):
        for j in range(g.a):
            g.bt[i * g.a + j], g.bm[j * g.a + i] = bt[i, j], bt[i, j]
            if i < m:
                g.at[i * g.a + j], g.am[j * m + i] = at[i, j], at[i, j]
    g.fixed = wg_fixed(m, g.a, g.at, g.bt)
    g.up = NULL
    need(vbuf.shape[1] == g.a * g.a and vbuf.shape[3] == g.cpad, kernel, "vbuf",
         f"needs shape (threads, {g.a * g.a}, tiles, {g.cpad})", tuple(vbuf.shape[:4]))
    need(mbuf.shape[0] >= vbuf.shape[0] and tuple(mbuf.shape[1:4]) == (g.a * g.a, g.tiles, g.opad),
         kernel, "mbuf", f"needs shape (>= {vbuf.shape[0]}, {g.a * g.a}, {g.tiles}, {g.opad})",
         tuple(mbuf.shape[:4]))
    g.vps, g.mps = vbuf.strides[1] // 4, mbuf.strides[1] // 4
    need(vbuf.strides[3] == 4 and mbuf.strides[3] == 4
         and vbuf.strides[2] == g.cpad * 4 and mbuf.strides[2] == g.opad * 4
         and g.vps >= g.tiles * g.cpad and g.mps >= g.tiles * g.opad
         and vbuf.strides[0] >= g.a * g.a * vbuf.strides[1]
         and mbuf.strides[0] >= g.a * g.a * mbuf.strides[1], kernel, "vbuf, mbuf",
         "need contiguous rows of tiles and positions that do not overlap",
         (vbuf.strides[:3], mbuf.strides[:3]))
    return g


def packed_u_floats(int a2, int group, int Cg, int Og):
    """Floats of pack_u's output for a U of a2 positions, `group` blocks each of Cg x Og."""
    return <Py_ssize_t>a2 * group * caffepy_packed_floats(Og, Cg)


def pack_u(const float[:, :, ::1] u, int group, float[::1] out):
    """out [packed_u_floats] = the forward's U [a*a, group * Cg, O / group] (weight_transform
    with group) packed once into its GEMMs' panels (cext/gemm_panels.h, this build's width),
    for conv_forward_nhwc's `packed`: each (position, group) block, as its GEMM reads it."""
    cdef int a2 = u.shape[0], Og = u.shape[2], Cg, j
    need(group >= 1 and u.shape[1] % group == 0, "pack_u", "group",
         f"must divide U's {u.shape[1]} rows", group)
    Cg = u.shape[1] // group
    cdef Py_ssize_t each = caffepy_packed_floats(Og, Cg)
    need(out.shape[0] == a2 * group * each, "pack_u", "out", f"needs {a2 * group * each} floats",
         out.shape[0])
    if a2 * group * each:
        with nogil:
            for j in range(a2 * group):
                caffepy_panel_pack(0, Og, Cg, 1.0, &u[j // group, (j % group) * Cg, 0], Og,
                                   &out[j * each])


def scratch_shapes(int threads, int N, int C, int O, int H, int W, int V, int m, int r,
                   int ph, int pw, int group=1, long budget=PASS_BYTES, spread=None):
    """Shapes of (vbuf, mbuf) for `threads` threads. Each thread's task is an equal share of
    the images, whole ones (its data gradient sums overlapping tiles, which no other thread may
    touch), run in passes of about equal size over its tiles. A pass takes as many tiles as fit
    `budget` bytes of its buffers (V and M), so that they stay in cache between the transforms
    and the GEMMs, but at least a quarter of Cg + Og (each GEMM packs an Og x Cg block of U,
    which its rows must outweigh). Every pass reads all of U, so a U too large to stay in
    cache (U_CACHED) takes the whole task in one pass.

    Spread instead (one slice: the whole batch, shared by all threads; `spread` None = the rule)
    when U is that large and the batch's buffers fit SPREAD_BYTES: each GEMM then reads its U_p
    once for all the tiles, instead of every thread reading all of U for its thinner GEMMs. And
    spread whenever the batch has fewer images than threads: a task is whole images, so all
    but N threads would wait (a batch of 1 ran on one thread). Spread at batch 1 on 2 threads,
    alternating with the tasks in one process (Zen 3): 28x28 128->128 F(4,3) 1.07 -> 0.77 ms,
    56x56 64->64 1.35 -> 1.17, 14x14 256->256 F(2,3) 0.84 -> 0.73, 224x224 64->64 17.5 ->
    11.6 (its buffers past SPREAD_BYTES); the same bits."""
    cdef int oh = H + 2 * ph - r + 1, ow = W + 2 * pw - r + 1
    # Python ints below: ceil division with positive operands only
    per_image = max(1, ((oh + m - 1) // m) * ((ow + m - 1) // m))
    cb, ob = (C + V - 1) // V, (O + V - 1) // V
    a2 = (m + r - 1) ** 2
    group = max(group, 1)
    rows = max(MIN_ROWS, (C // group + O // group) // 4, budget // (a2 * (cb + ob) * V * 4))
    large_u = a2 * O * (C // group) * 4 > U_CACHED
    if large_u:
        rows = N * per_image
    total = max(1, (N + threads - 1) // threads) * per_image        # a task's tiles
    passes = (total + rows - 1) // rows
    tiles = (total + passes - 1) // passes
    if spread is None:
        spread = threads > 1 and (N < threads or (
            large_u and N * per_image * a2 * (cb + ob) * V * 4 <= SPREAD_BYTES))
    if spread:
        threads, tiles = 1, max(1, N) * per_image
    return (threads, a2, tiles, cb * V), (threads, a2, tiles, ob * V)


def position_stride(Py_ssize_t rows, Py_ssize_t cols):
    """Floats between tile positions in a buffer of `rows` x `cols` floats a position: one cache
    line past a multiple of 4 KB. At a multiple, the a*a floats of a tile that a transform reads
    or writes, one per position, all fall in the same cache set; AlexNet's conv2 forward ran
    9-12% slower at 44 KB apart than at 45 (Zen 4)."""
    cdef Py_ssize_t s = rows * cols
    return s + ((16 - s) % 1024 + 1024) % 1024       # C remainders (cdivision)


def scratch_floats(shape):
    """Floats to allocate for a (vbuf or mbuf) buffer of `shape` from scratch_shapes, for
    scratch_view."""
    return shape[0] * shape[1] * position_stride(shape[2], shape[3]) + 16


def scratch_view(float[::1] raw, shape):
    """The buffer of `shape` (threads, a*a, tiles, cols) over `raw` (scratch_floats of them):
    cache-line aligned, positions position_stride apart."""
    cdef Py_ssize_t s = position_stride(shape[2], shape[3])
    need(raw.shape[0] >= scratch_floats(shape), "scratch_view", "raw",
         f"needs {scratch_floats(shape)} floats", raw.shape[0])
    arr = np.asarray(raw)
    skip = (-(arr.ctypes.data % 64) % 64) // 4
    return np.lib.stride_tricks.as_strided(arr[skip:], shape,
                                           (shape[1] * s * 4, s * 4, shape[3] * 4, 4))


# ---------------------------------------------------------------------------------------------
# Tile transforms: in C (cext/winograd_tiles.h) for `restrict`, which lets GCC vectorize them.

cdef extern from "winograd_tiles.h" nogil:
    void wg_input(const float* x, int H, int W, int iy0, int ix0, int m, int a, const float* bt,
                  int fixed, float* w, float* out, long pstride, int V, long ps, int nv)
    void wg_output(const float* mb, long pstride, int m, int a, const float* at, int fixed,
                   const float* bias, int nv, float* y, int oh, int ow, int oy0, int ox0,
                   float* w, int V, long ps, int pad_lanes, int relu)
    void wg_dy(const float* dy, int oh, int ow, int oy0, int ox0, int m, int a,
               const float* am, int fixed, float* w, float* out, long pstride, int V, long ps,
               int nv)
    void wg_dx(const float* dv, long pstride, int m, int a, const float* bm, int fixed, int nv,
               float* dx, int H, int W, int iy0, int ix0, float* w, int V, long ps)
    const float* wg_table_at(int m, int a)
    const float* wg_table_bt(int a)
    int wg_fixed(int m, int a, const float* at, const float* bt)


def tables(int m, int a):
    """(AT [m, a], BT [a, a]) the tile transforms hold as compile-time tables for F(m, a - m + 1),
    or None: the kernels run on them when given these matrices (tests compare them to
    matrices())."""
    cdef const float* kat = wg_table_at(m, a)
    cdef const float* kbt = wg_table_bt(a)
    if kat == NULL or kbt == NULL:
        return None
    return (np.array(<float[:m * a]>kat, np.float32).reshape(m, a),
            np.array(<float[:a * a]>kbt, np.float32).reshape(a, a))


# ---------------------------------------------------------------------------------------------
# Per-pass steps (one thread, single-threaded BLAS). A pass is `count` tiles from tile t0 of
# image n0 on, counted across the images of a task: tile t = (image - n0) * th * tw + ty * tw + tx,
# at row t - t0 of the buffers. Loops run tile by tile with the channel blocks innermost, so the
# V-float pieces a tile writes into each buffer row are adjacent.

cdef inline int _real(const WGeom* g, int block, int channels) noexcept nogil:
    """Channels of `block` below `channels`: V, but fewer in the last block."""
    cdef int nv = channels - block * g.V
    return g.V if nv > g.V else nv


cdef inline int _lanes(const WGeom* g, int block, int channels) noexcept nogil:
    """Lanes of `block` to read: its real channels, or all V in the blocked layout (whose
    padding lanes hold zeros and are read as such)."""
    return g.V if g.pad_lanes else _real(g, block, channels)


cdef inline Py_ssize_t _tile(const WGeom* g, int n0, Py_ssize_t t, int* ty, int* tx) noexcept nogil:
    """Tile t of a task starting at image n0: its image (returned), row and column."""
    cdef Py_ssize_t per = <Py_ssize_t>g.th * g.tw, k = t % per
    ty[0] = <int>(k // g.tw)
    tx[0] = <int>(k % g.tw)
    return n0 + t // per


cdef void _inputs(const WGeom* g, const float* x, int n0, Py_ssize_t t0, Py_ssize_t count,
                  float* vb, float* w) noexcept nogil:
    cdef int cb, ty, tx, V = g.V
    cdef Py_ssize_t i, pstride = g.vps
    cdef const float* img
    for i in range(count):
        img = x + _tile(g, n0, t0 + i, &ty, &tx) * g.xn
        for cb in range(g.Cb):
            wg_input(img + cb * g.xb, g.H, g.W, ty * g.m - g.ph, tx * g.m - g.pw, g.m, g.a, g.bt,
                     g.fixed, w, vb + i * g.cpad + cb * V, pstride, V, g.xp, _lanes(g, cb, g.C))


cdef inline Py_ssize_t _vblock(const WGeom* g, int j) noexcept nogil:
    """Offset of pair j's block in the V buffer (j = p * group + gr: tile position p, group gr)."""
    return (j // g.group) * g.vps + (j % g.group) * g.Cg


cdef inline Py_ssize_t _mblock(const WGeom* g, int j) noexcept nogil:
    """Offset of pair j's block in the M buffer."""
    return (j // g.group) * g.mps + (j % g.group) * g.Og


cdef inline Py_ssize_t _ublock(const WGeom* g, int j) noexcept nogil:
    """Offset of pair j's Og x Cg block of U, in either layout of weight_transform."""
    return (<Py_ssize_t>(j // g.group) * g.O + (j % g.group) * g.Og) * g.Cg


cdef void _fwd_gemms(const WGeom* g, const float* ut, Py_ssize_t count, const float* vb,
                     float* mb, int j0, int j1) noexcept nogil:
    """M_p = V_p U_p^T for the (position, group) pairs j0 <= j < j1 (j = p * group + gr), with
    U in the forward's layout (weight_transform with group): each block read untransposed, or
    packed once (g.up)."""
    cdef int j
    for j in range(j0, j1):
        if g.up != NULL:
            gemm_packed(<int>count, g.Og, g.Cg, vb + _vblock(g, j), <int>g.cpad,
                        g.up + j * g.up_each, 0.0, mb + _mblock(g, j), <int>g.opad)
            continue
        gemm_ld(False, False, <int>count, g.Og, g.Cg, 1.0, vb + _vblock(g, j), <int>g.cpad,
                ut + _ublock(g, j), g.Og, 0.0, mb + _mblock(g, j), <int>g.opad)


cdef void _outputs(const WGeom* g, const float* bias, float* y, int n0, Py_ssize_t t0,
                   Py_ssize_t count, const float* mb, float* w) noexcept nogil:
    cdef int ob, ty, tx, V = g.V
    cdef Py_ssize_t i, mstride = g.mps
    cdef float* img
    for i in range(count):
        img = y + _tile(g, n0, t0 + i, &ty, &tx) * g.yn
        for ob in range(g.Ob):
            wg_output(mb + i * g.opad + ob * V, mstride, g.m, g.a, g.at, g.fixed, bias + ob * V,
                      _real(g, ob, g.O), img + ob * g.yb, g.oh, g.ow, ty * g.m, tx * g.m, w, V,
                      g.yp, g.pad_lanes, g.relu)


cdef void _fwd_pass(const WGeom* g, const float* x, const float* u, const float* bias, float* y,
                    int n0, Py_ssize_t t0, Py_ssize_t count, float* vb, float* mb,
                    float* w) noexcept nogil:
    _inputs(g, x, n0, t0, count, vb, w)
    _fwd_gemms(g, u, count, vb, mb, 0, g.a * g.a * g.group)
    _outputs(g, bias, y, n0, t0, count, mb, w)


cdef void _dms(const WGeom* g, const float* dy, int n0, Py_ssize_t t0, Py_ssize_t count,
               float* mb, float* w) noexcept nogil:
    """dM = AT^T dY AT, tile by tile."""
    cdef int ob, ty, tx, V = g.V
    cdef Py_ssize_t i, mstride = g.mps
    cdef const float* dimg
    for i in range(count):
        dimg = dy + _tile(g, n0, t0 + i, &ty, &tx) * g.yn
        for ob in range(g.Ob):
            wg_dy(dimg + ob * g.yb, g.oh, g.ow, ty * g.m, tx * g.m, g.m, g.a, g.am, g.fixed, w,
                  mb + i * g.opad + ob * V, mstride, V, g.yp, _lanes(g, ob, g.O))


cdef void _weight_gemms(const WGeom* g, Py_ssize_t count, const float* vb, const float* mb,
                        float* du, float beta, int j0, int j1) noexcept nogil:
    """dU_p = V_p^T dM_p + beta * dU_p for the pairs j0 <= j < j1."""
    cdef int j
    for j in range(j0, j1):
        gemm_ld(True, False, g.Og, g.Cg, <int>count, 1.0, mb + _mblock(g, j), <int>g.opad,
                vb + _vblock(g, j), <int>g.cpad, beta, du + _ublock(g, j), g.Cg)


cdef void _data_gemms(const WGeom* g, const float* u, Py_ssize_t count, const float* mb,
                      float* vb, int j0, int j1) noexcept nogil:
    """dV_p = dM_p U_p for the pairs j0 <= j < j1 (into the V buffer)."""
    cdef int j
    for j in range(j0, j1):
        gemm_ld(False, False, <int>count, g.Cg, g.Og, 1.0, mb + _mblock(g, j), <int>g.opad,
                u + _ublock(g, j), g.Cg, 0.0, vb + _vblock(g, j), <int>g.cpad)


cdef void _dxs(const WGeom* g, float* dx, int n0, Py_ssize_t t0, Py_ssize_t count,
               const float* vb, float* w) noexcept nogil:
    """dx += BT^T dV BT, tile by tile (tiles overlap: one thread per image at a time)."""
    cdef int cb, ty, tx, V = g.V
    cdef Py_ssize_t i, vstride = g.vps
    cdef float* ximg
    for i in range(count):
        ximg = dx + _tile(g, n0, t0 + i, &ty, &tx) * g.xn
        for cb in range(g.Cb):
            wg_dx(vb + i * g.cpad + cb * V, vstride, g.m, g.a, g.bm, g.fixed, _real(g, cb, g.C),
                  ximg + cb * g.xb, g.H, g.W, ty * g.m - g.ph, tx * g.m - g.pw, w, V, g.xp)


cdef void _bwd_pass(const WGeom* g, const float* x, const float* u, const float* dy, float* dx,
                    float* du, int n0, Py_ssize_t t0, Py_ssize_t count, float* vb, float* mb,
                    float* w) noexcept nogil:
    """dU += this pass's share if du, dx += it if dx (zeroed by the task beforehand)."""
    cdef int pairs = g.a * g.a * g.group
    _dms(g, dy, n0, t0, count, mb, w)
    if du != NULL:
        _inputs(g, x, n0, t0, count, vb, w)
        _weight_gemms(g, count, vb, mb, du, 1.0, 0, pairs)
    if dx != NULL:
        _data_gemms(g, u, count, mb, vb, 0, pairs)
        _dxs(g, dx, n0, t0, count, vb, w)


cdef void _fwd_task(const WGeom* g, const float* x, const float* u, const float* bias, float* y,
                    int c, float* vb, float* mb, float* w) noexcept nogil:
    """Task c: images c * chunk on, in passes of up to g.tiles tiles."""
    cdef int n0 = c * g.chunk, cnt = g.N - n0 if g.N - n0 < g.chunk else g.chunk
    cdef Py_ssize_t total = <Py_ssize_t>cnt * g.th * g.tw
    cdef Py_ssize_t t0 = 0
    while t0 < total:
        _fwd_pass(g, x, u, bias, y, n0, t0, min(g.tiles, total - t0), vb, mb, w)
        t0 += g.tiles


cdef void _bwd_task(const WGeom* g, const float* x, const float* u, const float* dy, float* dx,
                    float* du, int c, float* vb, float* mb, float* w) noexcept nogil:
    cdef int n0 = c * g.chunk, cnt = g.N - n0 if g.N - n0 < g.chunk else g.chunk
    cdef Py_ssize_t total = <Py_ssize_t>cnt * g.th * g.tw
    if dx != NULL:
        memset(dx + <Py_ssize_t>n0 * g.xn, 0, cnt * g.xn * sizeof(float))
    cdef Py_ssize_t t0 = 0
    while t0 < total:
        _bwd_pass(g, x, u, dy, dx, du, n0, t0, min(g.tiles, total - t0), vb, mb, w)
        t0 += g.tiles


# ---------------------------------------------------------------------------------------------
# Weight transforms: U = G W G^T into the GEMM layout u[a*a, O, Cg], dW += G^T dU G back out.

cdef extern from "winograd_tiles.h" nogil:
    void wg_weights(const float* w, float* u, const float* gm, int O, int Cg, int r, int a,
                    int o0, int o1, int stream)
    void wg_weights_t(const float* w, float* u, const float* gm, int O, int Cg, int r, int a,
                      int og, int gc0, int gc1, int stream)
    void wg_weight_grad(const float* du, float* dw, const float* gm, int O, int Cg, int r, int a,
                        int o0, int o1)


cdef _check_weights(str kernel, str wname, w, str uname, u, gm):
    cdef int O = w.shape[0], Cg = w.shape[1], r = w.shape[2], a = gm.shape[0]
    need(w.shape[3] == r, kernel, wname, "needs square kernels", tuple(w.shape[:4]))
    need(gm.shape[1] == r and 1 <= a <= MAX_A, kernel, "gm", f"needs shape (1..{MAX_A}, {r})",
         tuple(gm.shape[:2]))
    need_shape(kernel, uname, tuple(u.shape[:3]), (a * a, O, Cg))


def weight_transform(const float[:, :, :, ::1] w, const float[:, ::1] gm, float[:, :, ::1] u,
                     int group=0, int stream=-1):
    """u[i * a + j, o, c] = (G W[o, c] G^T)[i, j]; w is [O, Cg, r, r], gm is G [a, r]. With
    group > 0, the forward's layout: u [a*a, group * Cg, O / group], each group's block
    transposed: u[i * a + j, g * Cg + c, k] for output o = g * (O / group) + k.

    stream: write u past the cache (1) or not (0); by default when u is at least STREAM_U
    bytes."""
    cdef int O = w.shape[0], Cg = w.shape[1], og = 0, rows, t, lo, hi
    if group > 0:
        need(O % group == 0, "weight_transform", "group", f"must divide {O} outputs", group)
        og = O // group
        need_shape("weight_transform", "u", dims(u.shape, 3),
                   (gm.shape[0] * gm.shape[0], group * Cg, og))
        need(w.shape[3] == w.shape[2] and gm.shape[1] == w.shape[2] and 1 <= gm.shape[0] <= MAX_A,
             "weight_transform", "w, gm", "need square kernels and G [a, r]",
             (dims(w.shape, 4), dims(gm.shape, 2)))
    else:
        _check_weights("weight_transform", "w", w, "u", u, gm)
    cdef Py_ssize_t floats = <Py_ssize_t>u.shape[0] * u.shape[1] * u.shape[2]
    if stream < 0:
        stream = floats * 4 >= STREAM_U
    cdef int nt = threads_for(floats * w.shape[2])
    rows = group * Cg if og else O
    with nogil:
        # one range of rows a thread: each range ends with one fence when streaming
        for t in prange(nt, schedule="static", num_threads=nt):
            lo = <int>(<long>rows * t // nt)
            hi = <int>(<long>rows * (t + 1) // nt)
            if og:
                wg_weights_t(&w[0, 0, 0, 0], &u[0, 0, 0], &gm[0, 0], O, Cg, w.shape[2],
                             gm.shape[0], og, lo, hi, stream)
            else:
                wg_weights(&w[0, 0, 0, 0], &u[0, 0, 0], &gm[0, 0], O, Cg, w.shape[2],
                           gm.shape[0], lo, hi, stream)


def weight_grad_add(const float[:, :, ::1] du, const float[:, ::1] gm, float[:, :, :, ::1] dw):
    """dw[o, c] += G^T dU[:, o, c] G, with du laid out as weight_transform's u."""
    _check_weights("weight_grad_add", "dw", dw, "du", du, gm)
    cdef int O = dw.shape[0], o
    with nogil:
        for o in prange(O, schedule="static", num_threads=threads_for(du.shape[0] * du.shape[1]
                                                                       * du.shape[2] * dw.shape[2])):
            wg_weight_grad(&du[0, 0, 0], &dw[0, 0, 0, 0], &gm[0, 0], O, dw.shape[1], dw.shape[2],
                           gm.shape[0], o, o + 1)


# ---------------------------------------------------------------------------------------------
# Entry points

_WORK = np.empty((0, 0), np.float32)


def _work_buffer(int threads):
    """Per-thread tile memory, kept between calls (no allocation in steady state)."""
    global _WORK
    cdef Py_ssize_t row = 3 * MAX_A * MAX_A * MAX_V, skip
    if _WORK.shape[0] < threads:
        # Cache-line aligned: NumPy puts large arrays 16 bytes past a page boundary, and a work
        # buffer at that same page offset as the images and tile buffers it copies between
        # makes loads wait on unrelated stores (4K aliasing): the transforms took up to twice
        # as long, depending on where the buffer happened to land (measured on Zen 4).
        raw = np.empty(threads * row + 16, np.float32)
        skip = (-(raw.ctypes.data % 64) % 64) // 4
        _WORK = raw[skip:skip + threads * row].reshape(threads, row)
    return _WORK


cdef inline Py_ssize_t _work(const WGeom* g) noexcept nogil:
    """The size the thread rule sees, in multiply-adds of matrix products: the tile GEMMs'
    over the batch, and the tile transforms' (2 a^3 multiply-adds per tile and channel, in
    and out), counted as element operations (rules.pxd: MACS_PER_OP GEMM multiply-adds each).
    The GEMMs alone kept on one thread small layers whose transforms weigh as much: GoogLeNet
    b1's 14 x 14 5 x 5 F(4,5) units (a = 8), 0.19-0.26 ms on one thread, 1.15-1.26x faster on
    two (Zen 3, one process, alternating with the old rule)."""
    cdef Py_ssize_t tiles = <Py_ssize_t>g.N * g.th * g.tw
    return (tiles * g.a * g.a * g.O * g.Cg
            + MACS_PER_OP * tiles * (g.Cb + g.Ob) * g.V * 2 * g.a * g.a * g.a)


cdef void _run_forward(const WGeom* g, const float* x, const float* u, const float* bias,
                       float* y, float[:, :, :, :] vbuf, float[:, :, :, :] mbuf,
                       float[:, ::1] work) noexcept nogil:
    cdef int tasks = (g.N + g.chunk - 1) // g.chunk, T = vbuf.shape[0], nt, c, tid
    cdef int saved = 0
    if _spread(g, T):
        nt = _task_threads(work.shape[0], g.a * g.a * g.group, _work(g))
        saved = _blas_get_threads()
        _blas_set_threads(1)
        _spread_forward(g, x, u, bias, y, &vbuf[0, 0, 0, 0], &mbuf[0, 0, 0, 0], work, nt)
        _blas_set_threads(saved)
        return
    nt = _task_threads(T, tasks, _work(g))
    if nt == 1:
        for c in range(tasks):
            _fwd_task(g, x, u, bias, y, c, &vbuf[0, 0, 0, 0], &mbuf[0, 0, 0, 0], &work[0, 0])
    else:
        saved = _blas_get_threads()
        _blas_set_threads(1)
        for c in prange(tasks, num_threads=nt, schedule="dynamic"):
            tid = threadid()
            _fwd_task(g, x, u, bias, y, c, &vbuf[tid, 0, 0, 0], &mbuf[tid, 0, 0, 0], &work[tid, 0])
        _blas_set_threads(saved)


cdef void _run_backward(const WGeom* g, const float* x, const float* u, const float* dy,
                        float* dx, float* du, float[:, :, :, :] vbuf, float[:, :, :, :] mbuf,
                        float[:, ::1] work) noexcept nogil:
    cdef int tasks = (g.N + g.chunk - 1) // g.chunk, T = vbuf.shape[0], nt, c, tid, t
    cdef int saved = 0
    cdef Py_ssize_t us = <Py_ssize_t>g.a * g.a * g.O * g.Cg, i
    if _spread(g, T):
        nt = _task_threads(work.shape[0], g.a * g.a * g.group, _work(g))
        saved = _blas_get_threads()
        _blas_set_threads(1)
        _spread_backward(g, x, u, dy, dx, du, &vbuf[0, 0, 0, 0], &mbuf[0, 0, 0, 0], work, nt)
        _blas_set_threads(saved)
        return
    nt = _task_threads(T, tasks, _work(g))
    if du != NULL:
        memset(du, 0, nt * us * sizeof(float))
    if nt == 1:
        for c in range(tasks):
            _bwd_task(g, x, u, dy, dx, du, c, &vbuf[0, 0, 0, 0], &mbuf[0, 0, 0, 0], &work[0, 0])
    else:
        saved = _blas_get_threads()
        _blas_set_threads(1)
        for c in prange(tasks, num_threads=nt, schedule="dynamic"):
            tid = threadid()
            _bwd_task(g, x, u, dy, dx, du + tid * us if du != NULL else NULL, c,
                      &vbuf[tid, 0, 0, 0], &mbuf[tid, 0, 0, 0], &work[tid, 0])
        _blas_set_threads(saved)
        if du != NULL:
            for t in range(1, nt):
                for i in prange(us, schedule="static", num_threads=threads_for(us)):
                    du[i] += du[t * us + i]


# Spread: the whole batch in one pass that all threads share (scratch_shapes decides), for small
# images, where each thread's share of tiles would make thin GEMMs that all re-read U. The
# transforms split the tiles among the threads, the GEMMs the (position, group) pairs, each
# over every tile of the batch; the data gradient splits the images (their tiles overlap).

cdef inline bint _spread(const WGeom* g, int slices) noexcept nogil:
    return slices == 1 and g.tiles >= <Py_ssize_t>g.N * g.th * g.tw


cdef inline Py_ssize_t _piece(const WGeom* g, int nt) noexcept nogil:
    """Tiles per piece of a transform step: four pieces a thread, for balance."""
    cdef Py_ssize_t total = <Py_ssize_t>g.N * g.th * g.tw
    return max(1, (total + 4 * nt - 1) // (4 * nt))


cdef void _spread_forward(const WGeom* g, const float* x, const float* u, const float* bias,
                          float* y, float* vb, float* mb, float[:, ::1] work, int nt) noexcept nogil:
    cdef Py_ssize_t total = <Py_ssize_t>g.N * g.th * g.tw, piece = _piece(g, nt), k, t0, cnt
    cdef int j, tid
    for k in prange((total + piece - 1) // piece, num_threads=nt, schedule="static"):
        tid = threadid()
        t0 = k * piece
        cnt = min(piece, total - t0)
        _inputs(g, x, 0, t0, cnt, vb + t0 * g.cpad, &work[tid, 0])
    for j in prange(g.a * g.a * g.group, num_threads=nt, schedule="dynamic"):
        _fwd_gemms(g, u, total, vb, mb, j, j + 1)
    for k in prange((total + piece - 1) // piece, num_threads=nt, schedule="static"):
        tid = threadid()
        t0 = k * piece
        cnt = min(piece, total - t0)
        _outputs(g, bias, y, 0, t0, cnt, mb + t0 * g.opad, &work[tid, 0])


cdef void _spread_backward(const WGeom* g, const float* x, const float* u, const float* dy,
                           float* dx, float* du, float* vb, float* mb, float[:, ::1] work,
                           int nt) noexcept nogil:
    """du (one slice, overwritten) and dx (overwritten) as _run_backward's."""
    cdef Py_ssize_t total = <Py_ssize_t>g.N * g.th * g.tw, piece = _piece(g, nt), k, t0, cnt
    cdef Py_ssize_t per = <Py_ssize_t>g.th * g.tw
    cdef int j, tid, n, pairs = g.a * g.a * g.group
    for k in prange((total + piece - 1) // piece, num_threads=nt, schedule="static"):
        tid = threadid()
        t0 = k * piece
        cnt = min(piece, total - t0)
        _dms(g, dy, 0, t0, cnt, mb + t0 * g.opad, &work[tid, 0])
    if du != NULL:
        for k in prange((total + piece - 1) // piece, num_threads=nt, schedule="static"):
            tid = threadid()
            t0 = k * piece
            cnt = min(piece, total - t0)
            _inputs(g, x, 0, t0, cnt, vb + t0 * g.cpad, &work[tid, 0])
        for j in prange(pairs, num_threads=nt, schedule="dynamic"):
            _weight_gemms(g, total, vb, mb, du, 0.0, j, j + 1)
    if dx != NULL:
        for j in prange(pairs, num_threads=nt, schedule="dynamic"):
            _data_gemms(g, u, total, mb, vb, j, j + 1)
        for n in prange(g.N, num_threads=nt, schedule="static"):
            tid = threadid()
            memset(dx + n * g.xn, 0, g.xn * sizeof(float))
            _dxs(g, dx, n, 0, per, vb + n * per * g.cpad, &work[tid, 0])


cdef _check_forward(str kernel, const WGeom* g, u, bias):
    need_shape(kernel, "u", tuple(u.shape[:3]), (g.a * g.a, g.group * g.Cg, g.Og))
    need_shape(kernel, "bias", tuple(bias.shape[:1]), (g.opad,))


cdef _check_backward(str kernel, const WGeom* g, u, du, int T, bint need_w):
    need_shape(kernel, "u", tuple(u.shape[:3]), (g.a * g.a, g.O, g.Cg))
    if need_w:
        need(du.shape[0] >= T and tuple(du.shape[1:4]) == (g.a * g.a, g.O, g.Cg), kernel,
             "du", f"needs shape (>= {T}, {g.a * g.a}, {g.O}, {g.Cg})", tuple(du.shape[:4]))


def conv_forward(const float[:, :, :, :, ::1] x, const float[:, :, ::1] u,
                 const float[::1] bias, float[:, :, :, :, ::1] y,
                 float[:, :, :, :] vbuf, float[:, :, :, :] mbuf,
                 const float[:, ::1] at, const float[:, ::1] bt,
                 int C, int O, int m, int r, int ph, int pw, int group):
    """y (blocked, O channels) = conv(x, W) + bias with U = G W G^T in the forward's layout,
    u[a*a, group * Cg, O / group] (weight_transform with group; the backward takes the other).

    bias: O values padded to a whole number of blocks (zeros for no bias).
    Scratch vbuf, mbuf as `scratch_shapes` gives them (one slice per thread).
    """
    cdef WGeom g = _geom("conv_forward", dims(x.shape, 5), "y", dims(y.shape, 5), True, 0, C, O,
                         m, r, ph, pw, group, vbuf, mbuf, at, bt)
    _check_forward("conv_forward", &g, u, bias)
    cdef float[:, ::1] work = _work_buffer(openmp.omp_get_max_threads())
    if g.N == 0:
        return
    with nogil:
        _run_forward(&g, &x[0, 0, 0, 0, 0], &u[0, 0, 0], &bias[0], &y[0, 0, 0, 0, 0], vbuf, mbuf,
                     work)


def conv_backward(const float[:, :, :, :, ::1] x, const float[:, :, ::1] u,
                  const float[:, :, :, :, ::1] dy, float[:, :, :, :, ::1] dx,
                  float[:, :, :, ::1] du, float[:, :, :, :] vbuf, float[:, :, :, :] mbuf,
                  const float[:, ::1] at, const float[:, ::1] bt,
                  int C, int O, int m, int r, int ph, int pw, int group, bint need_x, bint need_w):
    """Gradients of conv_forward: dx (blocked, overwritten) if need_x; du[0] = the gradient
    with respect to U summed over the batch if need_w (du[T, a*a, O, Cg] is per-thread
    scratch; the caller turns row 0 into dW = G^T dU G and adds it to its diff)."""
    cdef WGeom g = _geom("conv_backward", dims(x.shape, 5), "dy", dims(dy.shape, 5), True, 0, C,
                         O, m, r, ph, pw, group, vbuf, mbuf, at, bt)
    _check_backward("conv_backward", &g, u, du, vbuf.shape[0], need_w)
    if need_x:
        need_shape("conv_backward", "dx", dims(dx.shape, 5), dims(x.shape, 5))
    cdef float* dup = &du[0, 0, 0, 0] if need_w else NULL
    cdef float* dxp = &dx[0, 0, 0, 0, 0] if need_x else NULL
    cdef float[:, ::1] work = _work_buffer(openmp.omp_get_max_threads())
    if g.N == 0 or not (need_x or need_w):
        return
    with nogil:
        _run_backward(&g, &x[0, 0, 0, 0, 0], &u[0, 0, 0], &dy[0, 0, 0, 0, 0], dxp, dup, vbuf,
                      mbuf, work)


def conv_forward_nhwc(const float[:, :, :, ::1] x, const float[:, :, ::1] u,
                      const float[::1] bias, float[:, :, :, :] y,
                      float[:, :, :, :] vbuf, float[:, :, :, :] mbuf,
                      const float[:, ::1] at, const float[:, ::1] bt,
                      int V, int O, int m, int r, int ph, int pw, int group,
                      const float[::1] packed=None, bint relu=False):
    """conv_forward on channels-last x [N, H, W, C], y [N, oh, ow, O], in blocks of V channels
    (bias padded to whole blocks; scratch_shapes with this V). packed (None: none): u as pack_u
    packed it, which the GEMMs then read instead (a TEST net's, kept in place of its U); u is
    then read for its shape only. relu: y = max(0, that) as the output transform stores it (NaN
    kept), a TEST net's ReLU without a pass of its own. y may be a run of a wider channels-last
    array's channels (a slice of its last axis)."""
    cdef WGeom g = _geom("conv_forward_nhwc", dims(x.shape, 4), "y", dims(y.shape, 4), False, V,
                         x.shape[3], O, m, r, ph, pw, group, vbuf, mbuf, at, bt)
    _check_forward("conv_forward_nhwc", &g, u, bias)
    g.relu = relu
    g.yp = pixel_stride("conv_forward_nhwc", y, O)    # more than O: a concat's top's run
    g.yn = y.strides[0] // sizeof(float)
    if packed is not None:
        g.up_each = caffepy_packed_floats(g.Og, g.Cg)
        need(packed.shape[0] == g.a * g.a * group * g.up_each, "conv_forward_nhwc", "packed",
             f"needs {g.a * g.a * group * g.up_each} floats (pack_u of u)", packed.shape[0])
        g.up = &packed[0]
    cdef float[:, ::1] work = _work_buffer(openmp.omp_get_max_threads())
    if g.N == 0:
        return
    with nogil:
        _run_forward(&g, &x[0, 0, 0, 0], &u[0, 0, 0], &bias[0], &y[0, 0, 0, 0], vbuf, mbuf, work)


def conv_backward_nhwc(const float[:, :, :, ::1] x, const float[:, :, ::1] u,
                       const float[:, :, :, ::1] dy, float[:, :, :, ::1] dx,
                       float[:, :, :, ::1] du, float[:, :, :, :] vbuf, float[:, :, :, :] mbuf,
                       const float[:, ::1] at, const float[:, ::1] bt,
                       int V, int O, int m, int r, int ph, int pw, int group, bint need_x,
                       bint need_w):
    """conv_backward on channels-last arrays, as conv_forward_nhwc."""
    cdef WGeom g = _geom("conv_backward_nhwc", dims(x.shape, 4), "dy", dims(dy.shape, 4), False,
                         V, x.shape[3], O, m, r, ph, pw, group, vbuf, mbuf, at, bt)
    _check_backward("conv_backward_nhwc", &g, u, du, vbuf.shape[0], need_w)
    if need_x:
        need_shape("conv_backward_nhwc", "dx", dims(dx.shape, 4), dims(x.shape, 4))
    cdef float* dup = &du[0, 0, 0, 0] if need_w else NULL
    cdef float* dxp = &dx[0, 0, 0, 0] if need_x else NULL
    cdef float[:, ::1] work = _work_buffer(openmp.omp_get_max_threads())
    if g.N == 0 or not (need_x or need_w):
        return
    with nogil:
        _run_backward(&g, &x[0, 0, 0, 0], &u[0, 0, 0], &dy[0, 0, 0, 0], dxp, dup, vbuf, mbuf,
                      work)
