/* Winograd tile transforms for cext/winograd.pyx, in C for `restrict` (Cython cannot say that
 * the work buffers do not alias, and without it GCC keeps every sum in memory, scalar).
 *
 * A tile is [rows][cols][V] floats: V channels of one pixel, contiguous. Each transform is one
 * sandwich M X M^T of small matrices, reading or writing the GEMMs' tile buffers in place, with
 * the thread's work memory (3 * a * a * V floats) for the rest. The wg_* entry points dispatch
 * on V and the tile size so the loops have constant trip counts.
 *
 * An image plane is read and written through its pixel stride `ps`: V for the blocked layout
 * (a block's plane [H][W][V]), the channel count for the channels-last one ([H][W][C], the block
 * being V channels of each pixel). Only the `nv` real lanes of a block are read or written,
 * except that `pad_lanes` (the blocked layout) writes zeros to the others.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

#define WG_INLINE static inline __attribute__((always_inline))

/* The small products below work on elements of V floats (a pixel's lanes): element (i, j) of
 * an R x J matrix of them lives at base + (i * J + j) * stride, so a transform can read or write
 * the tile buffers, one tile position `pstride` apart, in place.
 *
 * Lanes go a vector at a time in a vector variable when V allows (the unrolled tiles a whole
 * WG_VL, the generic code eight), which GCC keeps in a register across the sum (in a float array
 * it kept every partial sum in memory, a load and a store per term). The vector
 * sums multiply by zero coefficients rather than test for them: a test and branch per term
 * took longer than the multiply (AlexNet's conv2 forward 44 -> 38 ms on Zen 4), and an array
 * of sums across j, for more independent sums, went back to memory (41 ms). */
typedef float wg_v8 __attribute__((vector_size(32), aligned(4), may_alias));

/* WG_VL: the block width this build's layers run (caffepy.isa: 16 floats in the AVX-512 build,
 * 8 in the AVX2 one), the only width the tile transforms are unrolled for; wg_vl, a vector of it
 * (one register in either build). Other widths run the generic code. */
#ifdef __AVX512F__
#define WG_VL 16
#else
#define WG_VL 8
#endif
typedef float wg_vl __attribute__((vector_size(WG_VL * 4), aligned(4), may_alias));

/* dst (r, j) = sum_k c[r * cr + j * cj + k] * src (r, j, k), for r < R, j < J, k < K, with
 * src (r, j, k) at src + r * sr + j * sj + k * sk and dst (r, j) at dst + (r * J + j) * ds
 * (offsets in floats): a left product takes its coefficient row by r, a right one by j. */
WG_INLINE void wg_product(const float *restrict c, int cr, int cj, int R, int J, int K,
                          const float *restrict src, long sr, long sj, long sk,
                          float *restrict dst, long ds, int V)
{
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) {
            const float *restrict cc = c + r * cr + j * cj;
            const float *restrict s = src + r * sr + j * sj;
            float *restrict d = dst + (r * J + j) * ds;
            if (V % 8 == 0) {
                for (int q = 0; q < V; q += 8) {
                    wg_v8 acc = {0};
                    for (int k = 0; k < K; k++)
                        acc += cc[k] * *(const wg_v8 *)(s + k * sk + q);
                    *(wg_v8 *)(d + q) = acc;
                }
                continue;
            }
            for (int v = 0; v < V; v++)
                d[v] = 0.f;
            for (int k = 0; k < K; k++)
                if (cc[k] != 0.f)
                    for (int v = 0; v < V; v++)
                        d[v] += cc[k] * s[k * sk + v];
        }
}

/* dst [R][R] = M src M^T for src [K][K] (element strides ss, ds) and M [R][K]; tmp holds R * K
 * elements */
WG_INLINE void wg_sandwich(const float *restrict M, int R, int K, const float *restrict src,
                           long ss, float *restrict tmp, float *restrict dst, long ds, int V)
{
    /* tmp (r, j) = sum_k M[r][k] src (k, j);  dst (r, j) = sum_k tmp (r, k) M[j][k] */
    wg_product(M, K, 0, R, K, K, src, 0, ss, K * ss, tmp, V, V);
    wg_product(M, 0, K, R, R, K, tmp, (long)K * V, 0, V, dst, ds, V);
}

/* e[0 .. V) = the nv floats at src, then zeros; of constant size when nv == V, so GCC inlines
 * the copy (GoogLeNet's conv2/3x3 forward spent 10% of its time in memcpy calls, one per
 * pixel; inlined, the layer took as long: the time is in reading the image). */
WG_INLINE void wg_lanes(float *restrict e, const float *restrict src, int nv, int V)
{
    if (nv == V) {
        memcpy(e, src, sizeof(float) * V);
        return;
    }
    memcpy(e, src, sizeof(float) * nv);
    memset(e + nv, 0, sizeof(float) * (V - nv));
}

/* As wg_product, for coefficients known at compile time (the tables below, inlined with
 * constant sizes): there the test per term is decided by the compiler, which drops the zero
 * terms and turns the unit ones into adds. Coefficient (r, j, k) is c[r * cr + j * cj + k * ck].
 * V a multiple of WG_VL. */
WG_INLINE void wg_product_k(const float *restrict c, int cr, int cj, int ck, int R, int J, int K,
                            const float *restrict src, long sr, long sj, long sk,
                            float *restrict dst, long ds, int V)
{
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < J; j++) {
            const float *restrict s = src + r * sr + j * sj;
            float *restrict d = dst + (r * J + j) * ds;
            for (int q = 0; q < V; q += WG_VL) {
                wg_vl acc = {0};
#pragma GCC unroll 8
                for (int k = 0; k < K; k++) {
                    float ce = c[r * cr + j * cj + k * ck];
                    if (ce != 0.f)
                        acc += ce * *(const wg_vl *)(s + k * sk + q);
                }
                *(wg_vl *)(d + q) = acc;
            }
        }
}

/* wg_sandwich with M [R][K] a table: M[r][k] = M[r * mr + k * mk] (mr = 1, mk = R reads a
 * K x R table transposed). V a multiple of WG_VL. */
WG_INLINE void wg_sandwich_k(const float *restrict M, int mr, int mk, int R, int K,
                             const float *restrict src, long ss, float *restrict tmp,
                             float *restrict dst, long ds, int V)
{
    wg_product_k(M, mr, 0, mk, R, K, K, src, 0, ss, K * ss, tmp, V, V);
    wg_product_k(M, 0, mr, mk, R, R, K, tmp, (long)K * V, 0, V, dst, ds, V);
}

/* AT [m][a] and BT [a][a] of matrices() (cext/winograd.pyx) for the tiles WG_DISPATCH names,
 * as tables the compiler can read: F(4, 3)'s BT has 22 nonzero terms of 36, 8 of them +-1
 * (the forward of ResNet-50's 64-channel 3x3 layers, 13 -> 10-11 ms). BT depends on the
 * points only, so on a alone. The kernels use them when the caller's matrices are these
 * (wg_fixed); tests/layers/test_winograd.py holds them to matrices(). */
static const float WG_BT4[] = {-1, 0, 1, 0,  0, 1, 1, 0,  0, -1, 1, 0,  0, -1, 0, 1};
static const float WG_BT5[] = {2, -1, -2, 1, 0,  0, -2, -1, 1, 0,  0, 2, -3, 1, 0,
                               0, -1, 0, 1, 0,  0, 2, -1, -2, 1};
static const float WG_BT6[] = {4, 0, -5, 0, 1, 0,  0, -4, -4, 1, 1, 0,  0, 4, -4, -1, 1, 0,
                               0, -2, -1, 2, 1, 0,  0, 2, -1, -2, 1, 0,  0, 4, 0, -5, 0, 1};
static const float WG_BT7[] = {-2, 4, 2.5, -5, -0.5, 1, 0,  0, 2, -2, -4.5, 0.5, 1, 0,
                               0, -2, 6, -3.5, -1.5, 1, 0,  0, 1, -1.5, -2, 1.5, 1, 0,
                               0, -1, 2.5, 0, -2.5, 1, 0,  0, 4, 0, -5, 0, 1, 0,
                               0, -2, 4, 2.5, -5, -0.5, 1};
static const float WG_BT8[] = {-1, 0, 5.25, 0, -5.25, 0, 1, 0,  0, 1, 1, -4.25, -4.25, 1, 1, 0,
                               0, -1, 1, 4.25, -4.25, -1, 1, 0,  0, 0.5, 0.25, -2.5, -1.25, 2, 1, 0,
                               0, -0.5, 0.25, 2.5, -1.25, -2, 1, 0,  0, 2, 4, -2.5, -5, 0.5, 1, 0,
                               0, -2, 4, 2.5, -5, -0.5, 1, 0,  0, -1, 0, 5.25, 0, -5.25, 0, 1};
static const float WG_AT2_4[] = {1, 1, 1, 0,  0, 1, -1, 1};
static const float WG_AT3_5[] = {1, 1, 1, 1, 0,  0, 1, -1, 2, 0,  0, 1, 1, 4, 1};
static const float WG_AT2_6[] = {1, 1, 1, 1, 1, 0,  0, 1, -1, 2, -2, 1};
static const float WG_AT4_6[] = {1, 1, 1, 1, 1, 0,  0, 1, -1, 2, -2, 0,  0, 1, 1, 4, 4, 0,
                                 0, 1, -1, 8, -8, 1};
static const float WG_AT3_7[] = {1, 1, 1, 1, 1, 1, 0,  0, 1, -1, 2, -2, 0.5, 0,
                                 0, 1, 1, 4, 4, 0.25, 1};
static const float WG_AT5_7[] = {1, 1, 1, 1, 1, 1, 0,  0, 1, -1, 2, -2, 0.5, 0,
                                 0, 1, 1, 4, 4, 0.25, 0,  0, 1, -1, 8, -8, 0.125, 0,
                                 0, 1, 1, 16, 16, 0.0625, 1};
static const float WG_AT4_8[] = {1, 1, 1, 1, 1, 1, 1, 0,  0, 1, -1, 2, -2, 0.5, -0.5, 0,
                                 0, 1, 1, 4, 4, 0.25, 0.25, 0,  0, 1, -1, 8, -8, 0.125, -0.125, 1};

static const float *wg_table_at(int m, int a)
{
    if (m == 2 && a == 4) return WG_AT2_4;
    if (m == 3 && a == 5) return WG_AT3_5;
    if (m == 2 && a == 6) return WG_AT2_6;
    if (m == 4 && a == 6) return WG_AT4_6;
    if (m == 3 && a == 7) return WG_AT3_7;
    if (m == 5 && a == 7) return WG_AT5_7;
    if (m == 4 && a == 8) return WG_AT4_8;
    return NULL;
}

static const float *wg_table_bt(int a)
{
    if (a == 4) return WG_BT4;
    if (a == 5) return WG_BT5;
    if (a == 6) return WG_BT6;
    if (a == 7) return WG_BT7;
    if (a == 8) return WG_BT8;
    return NULL;
}

/* Whether AT [m][a] and BT [a][a] are the tables' (then the kernels run on those). */
static int wg_fixed(int m, int a, const float *at, const float *bt)
{
    const float *kat = wg_table_at(m, a), *kbt = wg_table_bt(a);
    if (kat == NULL || kbt == NULL)
        return 0;
    for (int i = 0; i < m * a; i++)
        if (at[i] != kat[i])
            return 0;
    for (int i = 0; i < a * a; i++)
        if (bt[i] != kbt[i])
            return 0;
    return 1;
}

/* out[p * pstride] = (BT d BT^T)[p] for the a x a tile of plane x [H][W] (pixel stride ps) at
 * (iy0, ix0), zero outside the plane and in lanes >= nv. */
WG_INLINE void wg_input_v(const float *restrict x, int H, int W, int iy0, int ix0, int a,
                          const float *restrict bt, const float *kbt, float *restrict w,
                          float *restrict out, long pstride, int V, long ps, int nv)
{
    float *restrict d = w, *restrict tmp = w + a * a * V;
    int inside = iy0 >= 0 && ix0 >= 0 && iy0 + a <= H && ix0 + a <= W;
    for (int i = 0; i < a; i++) {
        int iy = iy0 + i;
        if (inside && ps == V && nv == V) {
            memcpy(d + i * a * V, x + ((long)iy * W + ix0) * V, sizeof(float) * a * V);
            continue;
        }
        for (int j = 0; j < a; j++) {
            int ix = ix0 + j;
            float *restrict e = d + (i * a + j) * V;
            if (iy >= 0 && iy < H && ix >= 0 && ix < W)
                wg_lanes(e, x + ((long)iy * W + ix) * ps, nv, V);
            else
                memset(e, 0, sizeof(float) * V);
        }
    }
    if (kbt)
        wg_sandwich_k(kbt, a, 1, a, a, d, V, tmp, out, pstride, V);
    else
        wg_sandwich(bt, a, a, d, V, tmp, out, pstride, V);
}

/* max(0, v), NaN kept (Caffe's ReLU returns a NaN v): a TEST net's ReLU in the output's store. */
#define WG_RELU(v) ((v) < 0.f ? 0.f : (v))

/* The m x m output tile of plane y [oh][ow] (pixel stride ps) at (oy0, ox0) = AT M AT^T + bias,
 * with relu max(0, that), the part inside the plane, lanes < nv (and zeros in the others with
 * pad_lanes). M[p] is at mb + p * pstride. */
WG_INLINE void wg_output_v(const float *restrict mb, long pstride, int m, int a,
                           const float *restrict at, const float *kat,
                           const float *restrict bias, int nv,
                           float *restrict y, int oh, int ow, int oy0, int ox0,
                           float *restrict w, int V, long ps, int pad_lanes, int relu)
{
    float *restrict tmp = w, *restrict res = tmp + a * a * V;
    if (kat)
        wg_sandwich_k(kat, a, 1, m, a, mb, pstride, tmp, res, V, V);
    else
        wg_sandwich(at, m, a, mb, pstride, tmp, res, V, V);
    for (int i = 0; i < m && oy0 + i < oh; i++)
        for (int j = 0; j < m && ox0 + j < ow; j++) {
            float *restrict o = y + ((long)(oy0 + i) * ow + ox0 + j) * ps;
            const float *restrict s = res + (i * m + j) * V;
            if (nv == V && relu) {
                for (int v = 0; v < V; v++)
                    o[v] = WG_RELU(s[v] + bias[v]);
                continue;
            }
            if (nv == V) {
                for (int v = 0; v < V; v++)
                    o[v] = s[v] + bias[v];
                continue;
            }
            for (int v = 0; v < nv; v++)
                o[v] = relu ? WG_RELU(s[v] + bias[v]) : s[v] + bias[v];
            if (pad_lanes)
                for (int v = nv; v < V; v++)
                    o[v] = 0.f;
        }
}

/* out[p * pstride] = (A dY A^T)[p], A = AT^T given as am [a][m], for the m x m tile of the
 * gradient plane dy [oh][ow] (pixel stride ps) at (oy0, ox0), zero past the plane and in lanes
 * >= nv. */
WG_INLINE void wg_dy_v(const float *restrict dy, int oh, int ow, int oy0, int ox0, int m, int a,
                       const float *restrict am, const float *kat, float *restrict w,
                       float *restrict out, long pstride, int V, long ps, int nv)
{
    float *restrict t = w, *restrict tmp = w + a * a * V;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < m; j++) {
            float *restrict e = t + (i * m + j) * V;
            if (oy0 + i < oh && ox0 + j < ow)
                wg_lanes(e, dy + ((long)(oy0 + i) * ow + ox0 + j) * ps, nv, V);
            else
                memset(e, 0, sizeof(float) * V);
        }
    if (kat)                    /* A = AT^T */
        wg_sandwich_k(kat, 1, a, a, m, t, V, tmp, out, pstride, V);
    else
        wg_sandwich(am, a, m, t, V, tmp, out, pstride, V);
}

/* Plane dx [H][W] (pixel stride ps) at the a x a tile (iy0, ix0), inside the plane, lanes < nv,
 * += B dV B^T, with B = BT^T given as bm; dV[p] at dv + p * pstride, lanes >= nv read as 0. */
WG_INLINE void wg_dx_v(const float *restrict dv, long pstride, int a, const float *restrict bm,
                       const float *kbt, int nv, float *restrict dx, int H, int W, int iy0,
                       int ix0, float *restrict w, int V, long ps)
{
    float *restrict t = w, *restrict tmp = w + a * a * V, *restrict res = tmp + a * a * V;
    const float *src = dv;
    long ss = pstride;
    if (nv < V) {               /* lanes past nv hold no data: zeros, not whatever is there */
        for (int p = 0; p < a * a; p++)
            for (int v = 0; v < V; v++)
                t[p * V + v] = v < nv ? dv[p * pstride + v] : 0.f;
        src = t;
        ss = V;
    }
    if (kbt)                    /* B = BT^T */
        wg_sandwich_k(kbt, 1, a, a, a, src, ss, tmp, res, V, V);
    else
        wg_sandwich(bm, a, a, src, ss, tmp, res, V, V);
    for (int i = 0; i < a; i++) {
        int iy = iy0 + i;
        if (iy < 0 || iy >= H)
            continue;
        for (int j = 0; j < a; j++) {
            int ix = ix0 + j;
            if (ix < 0 || ix >= W)
                continue;
            float *restrict o = dx + ((long)iy * W + ix) * ps;
            const float *restrict s = res + (i * a + j) * V;
            if (nv == V) {
                for (int v = 0; v < V; v++)
                    o[v] += s[v];
            } else
                for (int v = 0; v < nv; v++)
                    o[v] += s[v];
        }
    }
}

/* Entry points: constant sizes for the usual F(m, r) (a = m + r - 1) with the tables and the
 * build's own block width, so that the compiler unrolls the small products completely; anything
 * else (other tiles, widths or matrices: tests, CAFFEPY_BLOCK_WIDTH) runs the generic code.
 * Unrolling for both widths and with the callers' matrices too took 2.5 times the compile time
 * (84 s of the build's 147 s of CPU) for paths the layers never take. */
#define WG_TILE(mm, aa, call)                                                             \
    if (fixed && V == WG_VL && m == mm && a == aa) {                                      \
        const int m_ = mm, a_ = aa, V_ = WG_VL;                                           \
        const float *kat_ = wg_table_at(mm, aa), *kbt_ = wg_table_bt(aa); call;           \
    }
#define WG_DISPATCH(call)                                                                 \
    WG_TILE(4, 6, call)                                                                   \
    else WG_TILE(3, 7, call)                                                              \
    else WG_TILE(2, 6, call)                                                              \
    else WG_TILE(2, 4, call)                                                              \
    else WG_TILE(3, 5, call)                                                              \
    else WG_TILE(5, 7, call)                                                              \
    else WG_TILE(4, 8, call)                                                              \
    else { const int m_ = m, a_ = a, V_ = V; const float *kat_ = NULL, *kbt_ = NULL; call; }

static void wg_input(const float *x, int H, int W, int iy0, int ix0, int m, int a,
                     const float *bt, int fixed, float *w, float *out, long pstride, int V,
                     long ps, int nv)
{
    WG_DISPATCH((void)m_; (void)kat_;
                wg_input_v(x, H, W, iy0, ix0, a_, bt, kbt_, w, out, pstride, V_, ps, nv))
}

static void wg_output(const float *mb, long pstride, int m, int a, const float *at, int fixed,
                      const float *bias, int nv, float *y, int oh, int ow, int oy0, int ox0,
                      float *w, int V, long ps, int pad_lanes, int relu)
{
    WG_DISPATCH((void)kbt_; wg_output_v(mb, pstride, m_, a_, at, kat_, bias, nv, y, oh, ow, oy0,
                                        ox0, w, V_, ps, pad_lanes, relu))
}

static void wg_dy(const float *dy, int oh, int ow, int oy0, int ox0, int m, int a,
                  const float *am, int fixed, float *w, float *out, long pstride, int V, long ps,
                  int nv)
{
    WG_DISPATCH((void)kbt_; wg_dy_v(dy, oh, ow, oy0, ox0, m_, a_, am, kat_, w, out, pstride, V_,
                                    ps, nv))
}

static void wg_dx(const float *dv, long pstride, int m, int a, const float *bm, int fixed,
                  int nv, float *dx, int H, int W, int iy0, int ix0, float *w, int V, long ps)
{
    WG_DISPATCH((void)m_; (void)kat_; wg_dx_v(dv, pstride, a_, bm, kbt_, nv, dx, H, W, iy0, ix0,
                                              w, V_, ps))
}
/* Weight transforms between Caffe's W [O][Cg][r][r] and the GEMM layouts of U (a*a positions
 * of O x Cg or Cg x O; output channel o of group g is row g * Og + o): for each (o, c),
 * U = G W G^T, and back, dW += G^T dU G. Rows o0 .. o1 - 1 (or input channels gc0 .. gc1 - 1)
 * only, so OpenMP threads can split them. WG_CB channels at a time, one per lane, so the small
 * products vectorize.
 *
 * The positions lie a whole O x Cg apart (1 MB for ResNet-50's 512 channels), and 32-byte
 * pieces of all a*a of them at a time kept the hardware from streaming. So both directions go
 * through a local [a*a][WG_RUN] buffer, a run of WG_RUN channels of every position: the weight
 * gradient reads dU so (7.3 -> 3.5 ms for those layers' 38 MB dU), and the transforms write U
 * so (256 channels, F(5, 3): 1.16 -> 0.7 ms; 512 channels alike, 4.1-4.5 ms). */
#define WG_CB 8
#define WG_RUN 128

/* x[q][v] = src[v * vs + q] for q < nq, lanes v < nv (zeros past them): WG_CB (o, c) pairs'
 * kernels side by side, one per lane. */
WG_INLINE void wg_gather(float *restrict x, const float *restrict src, long vs, int nq, int nv)
{
    if (nv >= WG_CB) {
        for (int q = 0; q < nq; q++)
            for (int v = 0; v < WG_CB; v++)
                x[q * WG_CB + v] = src[v * vs + q];
        return;
    }
    for (int q = 0; q < nq; q++)
        for (int v = 0; v < WG_CB; v++)
            x[q * WG_CB + v] = v < nv ? src[v * vs + q] : 0.f;
}

/* dst[0 .. n) = src[0 .. n); with `stream`, in non-temporal stores where dst is 32-byte aligned
 * and n whole vectors (the caller fences). */
WG_INLINE void wg_put(float *restrict dst, const float *restrict src, int n, int stream)
{
#ifdef __AVX__
    if (stream && n % 8 == 0 && (uintptr_t)dst % 32 == 0) {
        for (int j = 0; j < n; j += 8)
            _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, sizeof(float) * n);
}

/* Orders a thread's wg_put streams before what it does next (its threads then meet). */
WG_INLINE void wg_fence(int stream)
{
#ifdef __AVX__
    if (stream)
        _mm_sfence();
#endif
    (void)stream;
}

/* dst[p * ps + j] = (G W_j G^T)[p] for j < len, W_j the r x r kernel at src + j * vs: one row
 * of U (an output's input channels, or an input channel's outputs), WG_CB kernels a lane each,
 * written through a run of WG_RUN of every position (streamed past the cache with `stream`). */
WG_INLINE void wg_weight_row(const float *restrict src, long vs, int len, float *restrict dst,
                             long ps, const float *restrict gm, int r, int a, int stream)
{
    float x[8 * 8 * WG_CB], tmp[8 * 8 * WG_CB], res[8 * 8 * WG_CB], run[8 * 8 * WG_RUN];
    for (int j1 = 0; j1 < len; j1 += WG_RUN) {
        int n = len - j1 < WG_RUN ? len - j1 : WG_RUN;
        for (int j0 = 0; j0 < n; j0 += WG_CB) {
            wg_gather(x, src + (j1 + j0) * vs, vs, r * r, n - j0);
            wg_sandwich(gm, a, r, x, WG_CB, tmp, res, WG_CB, WG_CB);              /* G W G^T */
            for (int p = 0; p < a * a; p++)
                memcpy(run + p * WG_RUN + j0, res + p * WG_CB, sizeof(float) * WG_CB);
        }
        for (int p = 0; p < a * a; p++)
            wg_put(dst + p * ps + j1, run + p * WG_RUN, n, stream);
    }
}

/* U = G W G^T for outputs o0 <= o < o1 into u[a*a, O, Cg] (the backward's layout). */
WG_INLINE void wg_weights_v(const float *restrict w, float *restrict u, const float *restrict gm,
                            int O, int Cg, int r, int a, int o0, int o1, int stream)
{
    for (int o = o0; o < o1; o++)
        wg_weight_row(w + (long)o * Cg * r * r, r * r, Cg, u + (long)o * Cg, (long)O * Cg, gm, r,
                      a, stream);
}

/* The same U for the input channels gc0 <= gc < gc1 (gc = group * Cg + c) into the forward's
 * layout u[a*a, O / og * Cg, og]: per group of og outputs its Cg x og block, which the forward's
 * GEMMs read untransposed (this BLAS runs the small ones faster so). */
WG_INLINE void wg_weights_t_v(const float *restrict w, float *restrict u, const float *restrict gm,
                              int O, int Cg, int r, int a, int og, int gc0, int gc1,
                              int stream)
{
    for (int gc = gc0; gc < gc1; gc++) {
        int gr = gc / Cg, c = gc % Cg;
        wg_weight_row(w + ((long)gr * og * Cg + c) * r * r, (long)Cg * r * r, og,
                      u + (long)gc * og, (long)O * Cg, gm, r, a, stream);
    }
}

/* dW += G^T dU G for outputs o0 <= o < o1, dU in u's backward layout [a*a, O, Cg]. */
WG_INLINE void wg_weight_grad_v(const float *restrict du, float *restrict dw,
                                const float *restrict gm, int O, int Cg, int r, int a, int o0,
                                int o1)
{
    long ps = (long)O * Cg;
    float gt[8 * 8], run[8 * 8 * WG_RUN], x[8 * 8 * WG_CB], tmp[8 * 8 * WG_CB], res[8 * 8 * WG_CB];
    for (int i = 0; i < a; i++)
        for (int k = 0; k < r; k++)
            gt[k * a + i] = gm[i * r + k];
    for (int o = o0; o < o1; o++)
        for (int c1 = 0; c1 < Cg; c1 += WG_RUN) {
            int n = Cg - c1 < WG_RUN ? Cg - c1 : WG_RUN;
            for (int p = 0; p < a * a; p++)
                memcpy(run + p * WG_RUN, du + p * ps + (long)o * Cg + c1, sizeof(float) * n);
            for (int c0 = 0; c0 < n; c0 += WG_CB) {
                int nc = n - c0 < WG_CB ? n - c0 : WG_CB;
                for (int p = 0; p < a * a; p++)
                    wg_lanes(x + p * WG_CB, run + p * WG_RUN + c0, nc, WG_CB);
                wg_sandwich(gt, r, a, x, WG_CB, tmp, res, WG_CB, WG_CB);      /* G^T dU G */
                float *restrict d = dw + ((long)o * Cg + c1 + c0) * r * r;
                for (int v = 0; v < nc; v++)
                    for (int q = 0; q < r * r; q++)
                        d[v * r * r + q] += res[q * WG_CB + v];
            }
        }
}

/* Entry points of the weight transforms, with constant (a, r) for the usual tiles so that the
 * small products unroll (with a and r read at run time, ResNet-50's 512-channel U took 5.6 ms). */
#define WG_KERNEL_DISPATCH(call)                                                          \
    if (a == 6 && r == 3) { const int a_ = 6, r_ = 3; call; }                             \
    else if (a == 7 && r == 3) { const int a_ = 7, r_ = 3; call; }                        \
    else if (a == 4 && r == 3) { const int a_ = 4, r_ = 3; call; }                        \
    else if (a == 5 && r == 3) { const int a_ = 5, r_ = 3; call; }                        \
    else if (a == 6 && r == 5) { const int a_ = 6, r_ = 5; call; }                        \
    else if (a == 7 && r == 5) { const int a_ = 7, r_ = 5; call; }                        \
    else if (a == 8 && r == 5) { const int a_ = 8, r_ = 5; call; }                        \
    else { const int a_ = a, r_ = r; call; }

/* The entry points' `stream` writes U past the cache (wg_put, then wg_fence): for a U larger
 * than the cache, which the GEMMs read back from memory anyway. */
static void wg_weights(const float *w, float *u, const float *gm, int O, int Cg, int r, int a,
                       int o0, int o1, int stream)
{
    WG_KERNEL_DISPATCH(wg_weights_v(w, u, gm, O, Cg, r_, a_, o0, o1, stream))
    wg_fence(stream);
}

static void wg_weights_t(const float *w, float *u, const float *gm, int O, int Cg, int r, int a,
                         int og, int gc0, int gc1, int stream)
{
    WG_KERNEL_DISPATCH(wg_weights_t_v(w, u, gm, O, Cg, r_, a_, og, gc0, gc1, stream))
    wg_fence(stream);
}

static void wg_weight_grad(const float *du, float *dw, const float *gm, int O, int Cg, int r,
                           int a, int o0, int o1)
{
    WG_KERNEL_DISPATCH(wg_weight_grad_v(du, dw, gm, O, Cg, r_, a_, o0, o1))
}
