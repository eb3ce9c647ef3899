/* Rows of the channels-last depthwise convolution (cext/nhwc.pyx: dw_forward, dw_backward).
 *
 * Each output (forward), input gradient (stride 1) and weight-gradient row sum is kept in
 * vector variables over its taps or pixels and stored once, with four sums (32 channels) in
 * flight at a time, so the chains of additions overlap. The Cython loops added every product
 * into the output row or the weight gradient in memory (a load and a store per multiply-add),
 * and one sum at a time ran at the latency of its chain of adds. MobileNet's conv2_1/dw
 * (16 x 112 x 112 x 32), old and new builds alternating, min ms on 2 threads: forward 5.7-7.4
 * -> 2.9-3.4, data gradient 8.1-8.2 -> 3.3-4.5, weight and bias gradients 6.7-7.1 -> 4.5-4.8.
 * The functions are not inlined: inside the threaded loop GCC spilled their indices to vector
 * registers (the data gradient ran 1.4x slower). A strided data gradient stays in Cython
 * (_dw_dx_row: the taps that reach a pixel are no run of i and j then).
 *
 * Pixels are [..][W][C] floats, weights [kh * kw][C]. Eight channels at a time in GCC's vector
 * extension (unaligned: a pixel's channels start anywhere), the rest one by one; the AVX-512
 * build takes runs of 64 channels as four 16-float sums first (DW_BLOCKS): MobileNet's layers
 * of 64-1024 channels.
 */
#include <stddef.h>

/* Vectors of float alias only float (GCC), so a store through one never makes the compiler
 * reload the geometry and indices (with a may_alias type it did: the forward ran 2x slower). */
typedef float dw_v8 __attribute__((vector_size(32), aligned(4)));

typedef int dw_i8 __attribute__((vector_size(32), aligned(4)));

#define DW_LOAD(p) (*(const dw_v8 *)(p))
#define DW_STORE(p, v) (*(dw_v8 *)(p) = (v))

/* For vector type VT of V floats (ints IT of its width): NAME_relu, max(0, v) lane by lane,
 * NaN kept (Caffe's ReLU: std::max(v, 0) returns a NaN v), the lanes below zero cleared; and
 * the blocks of four sums (4 V channels) that dw_gather_row and dw_dw_row run first,
 * NAME_gather4 and NAME_wgrad4. Each lane sums its channel's products in the same order at any
 * width, so the widths give the same floats. */
#define DW_BLOCKS(NAME, VT, IT, V)                                                             \
static inline VT NAME##_relu(VT v)                                                             \
{                                                                                              \
    const VT zero = {0};                                                                       \
    return (VT)((IT)v & ~(IT)(v < zero));                                                      \
}                                                                                              \
                                                                                               \
static inline __attribute__((always_inline)) void NAME##_gather4(                              \
    const float *restrict src, int width, int C, const float *restrict w, int kw, int r0,      \
    int rs, int x0, int cs, int ilo, int ihi, int jlo, int jhi, const float *restrict bias,    \
    float *restrict op, int c, int relu)                                                       \
{                                                                                              \
    VT a[4];                                                                                   \
    for (int k = 0; k < 4; k++)                                                                \
        a[k] = bias ? *(const VT *)(bias + c + k * V) : (VT){0};                               \
    for (int i = ilo; i < ihi; i++) {                                                          \
        const float *sr = src + (ptrdiff_t)(r0 + i * rs) * width * C + c;                      \
        const float *wr = w + (size_t)i * kw * C + c;                                          \
        for (int j = jlo; j < jhi; j++) {                                                      \
            const float *wp = wr + (size_t)j * C, *sp = sr + (ptrdiff_t)(x0 + j * cs) * C;     \
            for (int k = 0; k < 4; k++)                                                        \
                a[k] += *(const VT *)(wp + k * V) * *(const VT *)(sp + k * V);                 \
        }                                                                                      \
    }                                                                                          \
    for (int k = 0; k < 4; k++)                                                                \
        *(VT *)(op + c + k * V) = relu ? NAME##_relu(a[k]) : a[k];                             \
}                                                                                              \
                                                                                               \
static inline __attribute__((always_inline)) void NAME##_wgrad4(                               \
    const float *restrict xp, const float *restrict gp, size_t xs, int C, int lo, int hi,      \
    float *restrict wr)                                                                        \
{                                                                                              \
    VT a[4] = {{0}};                                                                           \
    for (int ox = lo; ox < hi; ox++, xp += xs, gp += C)                                        \
        for (int k = 0; k < 4; k++)                                                            \
            a[k] += *(const VT *)(xp + k * V) * *(const VT *)(gp + k * V);                     \
    for (int k = 0; k < 4; k++)                                                                \
        *(VT *)(wr + k * V) = *(const VT *)(wr + k * V) + a[k];                                \
}

DW_BLOCKS(dw8, dw_v8, dw_i8, 8)
#ifdef __AVX512F__
typedef float dw_v16 __attribute__((vector_size(64), aligned(4)));
typedef int dw_i16 __attribute__((vector_size(64), aligned(4)));
DW_BLOCKS(dw16, dw_v16, dw_i16, 16)
#endif

/* The geometry of a depthwise convolution of N images [H][W][C] into [oh][ow][C] (the rows
 * read all but N, which nhwc.pyx's loops use). */
typedef struct {
    int N, H, W, C, oh, ow, kh, kw, ph, pw, sh, sw, dh, dw;
} dw_geom;

/* The taps t, 0 <= t < n, with 0 <= start + t * step < limit: lo <= t < hi. */
static inline void dw_taps(int start, int step, int n, int limit, int *lo, int *hi)
{
    int a = start < 0 ? (-start + step - 1) / step : 0;
    int b = limit - start <= 0 ? 0 : (limit - start + step - 1) / step;
    *lo = a;
    *hi = b < n ? b : n;
}

/* The taps of dw_taps for a step of either sign. */
static inline void dw_taps_signed(int start, int step, int n, int limit, int *lo, int *hi)
{
    if (step > 0)
        dw_taps(start, step, n, limit, lo, hi);
    else
        dw_taps(limit - 1 - start, -step, n, limit, lo, hi);
}

/* The gather both directions share: out[p][c] = bias[c] (or 0) + the sum over taps (i, j) of
 * w[i * kw + j][c] * src[r0 + i * rs][p * ps + c0 + j * cs][c], over the taps whose source
 * pixel lies inside src [rows][width][C], for 0 <= p < n; overwritten, with relu by
 * max(0, that) (a TEST net's ReLU after the forward, in the same store; NaN stays NaN, as
 * Caffe's ReLU leaves it). The forward reads x with
 * the taps (rs = dh, cs = dw); the stride-1 data gradient reads dy against them (rs = -dh,
 * cs = -dw): the taps that reach an input pixel then form a run of i and of j too. */
static inline __attribute__((always_inline)) void dw_gather_px(
    const float *restrict src, int width, int C, const float *restrict w, int kw, int r0,
    int rs, int ps, int c0, int cs, int ilo, int ihi, const float *restrict bias,
    float *restrict out, int p0, int p1, int relu)
{
    for (int p = p0; p < p1; p++) {
        float *op = out + (size_t)p * C;
        const int x0 = p * ps + c0;
        int jlo, jhi, c = 0;
        dw_taps_signed(x0, cs, kw, width, &jlo, &jhi);
        /* four sums at once: four chains of adds */
#ifdef __AVX512F__
        for (; c + 64 <= C; c += 64)
            dw16_gather4(src, width, C, w, kw, r0, rs, x0, cs, ilo, ihi, jlo, jhi, bias, op, c,
                         relu);
#endif
        for (; c + 32 <= C; c += 32)
            dw8_gather4(src, width, C, w, kw, r0, rs, x0, cs, ilo, ihi, jlo, jhi, bias, op, c,
                        relu);
        for (; c + 8 <= C; c += 8) {
            dw_v8 acc = bias ? DW_LOAD(bias + c) : (dw_v8){0};
            for (int i = ilo; i < ihi; i++) {
                const float *sr = src + (ptrdiff_t)(r0 + i * rs) * width * C + c;
                const float *wr = w + (size_t)i * kw * C + c;
                for (int j = jlo; j < jhi; j++)
                    acc += DW_LOAD(wr + (size_t)j * C) * DW_LOAD(sr + (ptrdiff_t)(x0 + j * cs) * C);
            }
            DW_STORE(op + c, relu ? dw8_relu(acc) : acc);
        }
        for (; c < C; c++) {
            float acc = bias ? bias[c] : 0.0f;
            for (int i = ilo; i < ihi; i++)
                for (int j = jlo; j < jhi; j++)
                    acc += w[((size_t)i * kw + j) * C + c]
                         * src[((ptrdiff_t)(r0 + i * rs) * width + x0 + j * cs) * C + c];
            op[c] = relu && acc < 0.0f ? 0.0f : acc;
        }
    }
}

/* the build's vector: 16 sums of 16 floats and 2 weight vectors, 18 of the 32 registers; at
 * 8 lanes 8 sums and 2, 10 of the 16 */
#ifdef __AVX512F__
#define DW_V 16
#define DW_U 8
#define DW_VT dw_v16
#define DW_RELU dw16_relu
#else
#define DW_V 8
#define DW_U 4
#define DW_VT dw_v8
#define DW_RELU dw8_relu
#endif

/* Interior pixels, where every tap lies inside the row, in tiles of U pixels x B vectors of
 * channels: each tap's weight vectors are loaded once for the U pixels (the per-pixel gather
 * loads a weight for every product, two loads a multiply-add, and its tap loops' bounds are
 * worked out pixel by pixel). The sums run in the gather's order (bias, then taps i, j
 * ascending), so a pixel gets the same floats either way. The kernel alone on warm caches, 2
 * threads, AVX-512, old and new builds: MobileNet v1's conv2_1/dw (112 x 112 x 32) at batch 16
 * 2.19 -> 1.35 ms, at batch 1 0.114 -> 0.064-0.077; the wider layers, bound by memory, alike. */
#define DW_TILE(B)                                                                             \
static inline __attribute__((always_inline)) void dw_tile_##B(                                 \
    const float *restrict sp, ptrdiff_t rstep, ptrdiff_t jstep, ptrdiff_t pstep,               \
    const float *restrict wp, size_t wrow, int C, int ilo, int ihi, int kw,                    \
    const float *restrict bias, float *restrict op, int relu)                                  \
{                                                                                              \
    DW_VT a[DW_U][B];                                                                          \
    _Pragma("GCC unroll 16") for (int u = 0; u < DW_U; u++)                                    \
        _Pragma("GCC unroll 4") for (int b = 0; b < B; b++)                                    \
            a[u][b] = bias ? *(const DW_VT *)(bias + b * DW_V) : (DW_VT){0};                   \
    for (int i = ilo; i < ihi; i++) {                                                          \
        const float *sr = sp + i * rstep, *wr = wp + (size_t)i * wrow;                         \
        for (int j = 0; j < kw; j++, sr += jstep, wr += C) {                                   \
            DW_VT wv[B];                                                                       \
            _Pragma("GCC unroll 4") for (int b = 0; b < B; b++)                                \
                wv[b] = *(const DW_VT *)(wr + b * DW_V);                                       \
            _Pragma("GCC unroll 16") for (int u = 0; u < DW_U; u++)                            \
                _Pragma("GCC unroll 4") for (int b = 0; b < B; b++)                            \
                    a[u][b] += wv[b] * *(const DW_VT *)(sr + u * pstep + b * DW_V);            \
        }                                                                                      \
    }                                                                                          \
    _Pragma("GCC unroll 16") for (int u = 0; u < DW_U; u++)                                    \
        _Pragma("GCC unroll 4") for (int b = 0; b < B; b++)                                    \
            *(DW_VT *)(op + (size_t)u * C + b * DW_V) = relu ? DW_RELU(a[u][b]) : a[u][b];     \
}

DW_TILE(2)
DW_TILE(1)

static __attribute__((noinline)) void dw_gather_row(
    const float *restrict src, int rows, int width, int C, const float *restrict w, int kh,
    int kw, int r0, int rs, int ps, int c0, int cs, const float *restrict bias,
    float *restrict out, int n, int relu)
{
    int ilo, ihi;
    dw_taps_signed(r0, rs, kh, rows, &ilo, &ihi);
    /* the interior [plo, phi): p * ps + c0 + j * cs inside [0, width) for every tap j */
    const int lo_tap = cs < 0 ? (kw - 1) * cs : 0, hi_tap = cs > 0 ? (kw - 1) * cs : 0;
    int plo = c0 + lo_tap >= 0 ? 0 : (-(c0 + lo_tap) + ps - 1) / ps;
    int phi = width - 1 - c0 - hi_tap < 0 ? 0 : (width - 1 - c0 - hi_tap) / ps + 1;
    if (phi > n)
        phi = n;
    if (C % DW_V != 0 || phi - plo < DW_U) {
        dw_gather_px(src, width, C, w, kw, r0, rs, ps, c0, cs, ilo, ihi, bias, out, 0, n, relu);
        return;
    }
    const int pend = plo + (phi - plo) / DW_U * DW_U;
    dw_gather_px(src, width, C, w, kw, r0, rs, ps, c0, cs, ilo, ihi, bias, out, 0, plo, relu);
    const ptrdiff_t rstep = (ptrdiff_t)rs * width * C, jstep = (ptrdiff_t)cs * C;
    const ptrdiff_t pstep = (ptrdiff_t)ps * C;
    for (int p = plo; p < pend; p += DW_U) {
        const float *sp = src + ((ptrdiff_t)r0 * width + (ptrdiff_t)p * ps + c0) * C;
        float *op = out + (size_t)p * C;
        int c = 0;
        for (; c + 2 * DW_V <= C; c += 2 * DW_V)
            dw_tile_2(sp + c, rstep, jstep, pstep, w + c, (size_t)kw * C, C, ilo, ihi, kw,
                      bias ? bias + c : NULL, op + c, relu);
        if (c < C)
            dw_tile_1(sp + c, rstep, jstep, pstep, w + c, (size_t)kw * C, C, ilo, ihi, kw,
                      bias ? bias + c : NULL, op + c, relu);
    }
    dw_gather_px(src, width, C, w, kw, r0, rs, ps, c0, cs, ilo, ihi, bias, out, pend, n, relu);
}

/* Output row oy of one image: y[oy][ox][c] = bias[c] (or 0) + sum over taps in the image of
 * w[tap][c] * x[tap's pixel][c]; with relu, max(0, that). */
static void dw_fwd_row(const dw_geom *g, const float *x, const float *w, const float *bias,
                       float *y, int oy, int relu)
{
    dw_gather_row(x, g->H, g->W, g->C, w, g->kh, g->kw, oy * g->sh - g->ph, g->dh, g->sw,
                  -g->pw, g->dw, bias, y + (size_t)oy * g->ow * g->C, g->ow, relu);
}

/* Input-gradient row iy of one image for stride 1, as a gather (no two rows write one pixel):
 * dx[iy][ix][c] = sum over the taps (i, j) whose output (iy + ph - i dh, ix + pw - j dw) is
 * inside dy of w[i * kw + j][c] * dy[that output][c]; overwritten. */
static void dw_dx_row_s1(const dw_geom *g, const float *dy, const float *w, float *dx, int iy)
{
    dw_gather_row(dy, g->oh, g->ow, g->C, w, g->kh, g->kw, iy + g->ph, -g->dh, 1, g->pw, -g->dw,
                  NULL, dx + (size_t)iy * g->W * g->C, g->W, 0);
}

/* Weight- and bias-gradient sums of output row oy of one image, added to dw [kh * kw][C] and
 * db [C] (either may be NULL): per tap, the products over the row's pixels summed in vector
 * variables, four chains of additions at once (32 channels, else two for eight). */
static __attribute__((noinline)) void dw_dw_row(const dw_geom *g, const float *restrict x,
                                                const float *restrict dy, float *restrict dw,
                                                float *restrict db, int oy)
{
    const int C = g->C;
    const float *gr = dy + (size_t)oy * g->ow * C;
    if (db != NULL) {
        int c = 0;
        for (; c + 8 <= C; c += 8) {
            dw_v8 a0 = {0}, a1 = {0};
            int ox = 0;
            for (; ox + 2 <= g->ow; ox += 2) {
                a0 += DW_LOAD(gr + (size_t)ox * C + c);
                a1 += DW_LOAD(gr + (size_t)(ox + 1) * C + c);
            }
            if (ox < g->ow)
                a0 += DW_LOAD(gr + (size_t)ox * C + c);
            DW_STORE(db + c, DW_LOAD(db + c) + a0 + a1);
        }
        for (; c < C; c++) {
            float a = 0.0f;
            for (int ox = 0; ox < g->ow; ox++)
                a += gr[(size_t)ox * C + c];
            db[c] += a;
        }
    }
    if (dw == NULL)
        return;
    for (int i = 0; i < g->kh; i++) {
        int iy = oy * g->sh - g->ph + i * g->dh;
        if (iy < 0 || iy >= g->H)
            continue;
        const float *xr = x + (size_t)iy * g->W * C;
        for (int j = 0; j < g->kw; j++) {
            /* the outputs whose tap (i, j) falls inside the row: lo <= ox < hi */
            int off = j * g->dw - g->pw, lo, hi;
            dw_taps(off, g->sw, g->ow, g->W, &lo, &hi);
            float *wr = dw + (size_t)(i * g->kw + j) * C;
            const size_t xs = (size_t)g->sw * C;
            int c = 0;
            /* four sums at once, one per vector of channels */
#ifdef __AVX512F__
            for (; c + 64 <= C; c += 64)
                dw16_wgrad4(xr + (size_t)(lo * g->sw + off) * C + c, gr + (size_t)lo * C + c, xs,
                            C, lo, hi, wr + c);
#endif
            for (; c + 32 <= C; c += 32)
                dw8_wgrad4(xr + (size_t)(lo * g->sw + off) * C + c, gr + (size_t)lo * C + c, xs,
                           C, lo, hi, wr + c);
            for (; c + 8 <= C; c += 8) {
                const float *xp = xr + (size_t)(lo * g->sw + off) * C + c;
                const float *gp = gr + (size_t)lo * C + c;
                dw_v8 a0 = {0}, a1 = {0};
                int ox = lo;
                for (; ox + 2 <= hi; ox += 2, xp += 2 * xs, gp += 2 * (size_t)C) {
                    a0 += DW_LOAD(xp) * DW_LOAD(gp);
                    a1 += DW_LOAD(xp + xs) * DW_LOAD(gp + C);
                }
                if (ox < hi)
                    a0 += DW_LOAD(xp) * DW_LOAD(gp);
                DW_STORE(wr + c, DW_LOAD(wr + c) + a0 + a1);
            }
            for (; c < C; c++) {
                float a = 0.0f;
                for (int ox = lo; ox < hi; ox++)
                    a += xr[(size_t)(ox * g->sw + off) * C + c] * gr[(size_t)ox * C + c];
                wr[c] += a;
            }
        }
    }
}
