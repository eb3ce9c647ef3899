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
#include <string.h>

#define WG_INLINE static inline __attribute__((always_inline))

/* The small products below work on elements of V floats (a pixel's lanes): element (i, j) of
 * an R x J matrix of them lives at base + (i * J + j) * stride, so a transform can read or write
 * the tile buffers, one tile position `pstride` apart, in place.
 *
 * Lanes go eight at a time in a vector variable when V allows, which GCC keeps in a register
 * across the sum (in a float array it kept every partial sum in memory, a load and a store per
 * term); 256 bits is native with AVX2, and Zen 4 splits 512-bit operations anyway. The vector
 * sums multiply by zero coefficients rather than test for them: a test and branch per term
 * took longer than the multiply (AlexNet's conv2 forward 44 -> 38 ms on Zen 4), and an array
 * of sums across j, for more independent sums, went back to memory (41 ms). */
typedef float wg_v8 __attribute__((vector_size(32), aligned(4), may_alias));

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

/* out[p * pstride] = (BT d BT^T)[p] for the a x a tile of plane x [H][W] (pixel stride ps) at
 * (iy0, ix0), zero outside the plane and in lanes >= nv. */
WG_INLINE void wg_input_v(const float *restrict x, int H, int W, int iy0, int ix0, int a,
                          const float *restrict bt, float *restrict w, float *restrict out,
                          long pstride, int V, long ps, int nv)
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
    wg_sandwich(bt, a, a, d, V, tmp, out, pstride, V);
}

/* The m x m output tile of plane y [oh][ow] (pixel stride ps) at (oy0, ox0) = AT M AT^T + bias,
 * the part inside the plane, lanes < nv (and zeros in the others with pad_lanes). M[p] is at
 * mb + p * pstride. */
WG_INLINE void wg_output_v(const float *restrict mb, long pstride, int m, int a,
                           const float *restrict at, const float *restrict bias, int nv,
                           float *restrict y, int oh, int ow, int oy0, int ox0,
                           float *restrict w, int V, long ps, int pad_lanes)
{
    float *restrict tmp = w, *restrict res = tmp + a * a * V;
    wg_sandwich(at, m, a, mb, pstride, tmp, res, V, V);
    for (int i = 0; i < m && oy0 + i < oh; i++)
        for (int j = 0; j < m && ox0 + j < ow; j++) {
            float *restrict o = y + ((long)(oy0 + i) * ow + ox0 + j) * ps;
            const float *restrict s = res + (i * m + j) * V;
            if (nv == V) {
                for (int v = 0; v < V; v++)
                    o[v] = s[v] + bias[v];
                continue;
            }
            for (int v = 0; v < nv; v++)
                o[v] = s[v] + bias[v];
            if (pad_lanes)
                for (int v = nv; v < V; v++)
                    o[v] = 0.f;
        }
}

/* out[p * pstride] = (A dY A^T)[p], A = AT^T given as am [a][m], for the m x m tile of the
 * gradient plane dy [oh][ow] (pixel stride ps) at (oy0, ox0), zero past the plane and in lanes
 * >= nv. */
WG_INLINE void wg_dy_v(const float *restrict dy, int oh, int ow, int oy0, int ox0, int m, int a,
                       const float *restrict am, float *restrict w, float *restrict out,
                       long pstride, int V, long ps, int nv)
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
    wg_sandwich(am, a, m, t, V, tmp, out, pstride, V);
}

/* Plane dx [H][W] (pixel stride ps) at the a x a tile (iy0, ix0), inside the plane, lanes < nv,
 * += B dV B^T, with B = BT^T given as bm; dV[p] at dv + p * pstride, lanes >= nv read as 0. */
WG_INLINE void wg_dx_v(const float *restrict dv, long pstride, int a, const float *restrict bm,
                       int nv, float *restrict dx, int H, int W, int iy0, int ix0,
                       float *restrict w, int V, long ps)
{
    float *restrict t = w, *restrict tmp = w + a * a * V, *restrict res = tmp + a * a * V;
    if (nv == V)
        wg_sandwich(bm, a, a, dv, pstride, tmp, res, V, V);
    else {                      /* lanes past nv hold no data: zeros, not whatever is there */
        for (int p = 0; p < a * a; p++)
            for (int v = 0; v < V; v++)
                t[p * V + v] = v < nv ? dv[p * pstride + v] : 0.f;
        wg_sandwich(bm, a, a, t, V, tmp, res, V, V);
    }
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

/* Entry points: constant lane counts for the usual block widths and constant tile sizes for the
 * usual F(m, r) (a = m + r - 1), so the compiler unrolls the small products completely. */
#define WG_LANES(call)                                                                    \
    switch (V) {                                                                          \
    case 8: { const int V_ = 8; call; break; }                                            \
    case 16: { const int V_ = 16; call; break; }                                          \
    default: { const int V_ = V; call; break; }                                           \
    }
#define WG_DISPATCH(call)                                                                 \
    if (m == 4 && a == 6) { const int m_ = 4, a_ = 6; WG_LANES(call) }                   \
    else if (m == 3 && a == 7) { const int m_ = 3, a_ = 7; WG_LANES(call) }              \
    else if (m == 2 && a == 6) { const int m_ = 2, a_ = 6; WG_LANES(call) }              \
    else if (m == 2 && a == 4) { const int m_ = 2, a_ = 4; WG_LANES(call) }              \
    else if (m == 3 && a == 5) { const int m_ = 3, a_ = 5; WG_LANES(call) }              \
    else if (m == 5 && a == 7) { const int m_ = 5, a_ = 7; WG_LANES(call) }              \
    else if (m == 4 && a == 8) { const int m_ = 4, a_ = 8; WG_LANES(call) }              \
    else { const int m_ = m, a_ = a; WG_LANES(call) }

static void wg_input(const float *x, int H, int W, int iy0, int ix0, int m, int a,
                     const float *bt, float *w, float *out, long pstride, int V, long ps, int nv)
{
    WG_DISPATCH((void)m_; wg_input_v(x, H, W, iy0, ix0, a_, bt, w, out, pstride, V_, ps, nv))
}

static void wg_output(const float *mb, long pstride, int m, int a, const float *at,
                      const float *bias, int nv, float *y, int oh, int ow, int oy0, int ox0,
                      float *w, int V, long ps, int pad_lanes)
{
    WG_DISPATCH(wg_output_v(mb, pstride, m_, a_, at, bias, nv, y, oh, ow, oy0, ox0, w, V_, ps,
                            pad_lanes))
}

static void wg_dy(const float *dy, int oh, int ow, int oy0, int ox0, int m, int a,
                  const float *am, float *w, float *out, long pstride, int V, long ps, int nv)
{
    WG_DISPATCH(wg_dy_v(dy, oh, ow, oy0, ox0, m_, a_, am, w, out, pstride, V_, ps, nv))
}

static void wg_dx(const float *dv, long pstride, int m, int a, const float *bm, int nv,
                  float *dx, int H, int W, int iy0, int ix0, float *w, int V, long ps)
{
    WG_DISPATCH((void)m_; wg_dx_v(dv, pstride, a_, bm, nv, dx, H, W, iy0, ix0, w, V_, ps))
}

/* Weight transforms between Caffe's W [O][Cg][r][r] and the GEMM layouts of U (a*a positions
 * of O x Cg or Cg x O; output channel o of group g is row g * Og + o): for each (o, c),
 * U = G W G^T, and back, dW += G^T dU G. Rows o0 .. o1 - 1 (or input channels gc0 .. gc1 - 1)
 * only, so OpenMP threads can split them. WG_CB channels at a time, one per lane, so the small
 * products vectorize.
 *
 * The weight gradient reads dU a run of WG_RUN channels of every position at a time, into a
 * local [a*a][WG_RUN] buffer: the positions lie a whole O x Cg apart (1 MB for ResNet-50's 512
 * channels), and 32-byte pieces of a*a of them at a time kept the hardware from streaming
 * (7.3 -> 3.5 ms for those layers' 38 MB dU). The transforms write U WG_CB floats of every
 * position at a time: staged in runs like this, they took longer (5.5 -> 7.8 ms). */
#define WG_CB 8
#define WG_RUN 128

/* dst[0 .. n) = src[0 .. n), n <= WG_CB: of constant size in the usual case n == WG_CB, so GCC
 * inlines it as one vector move (a memcpy call per 8 floats took a fifth of the transforms'
 * time: ResNet-50's 512-channel U, 6.8 -> 5.5 ms). */
WG_INLINE void wg_run(float *restrict dst, const float *restrict src, int n)
{
    if (n == WG_CB)
        memcpy(dst, src, sizeof(float) * WG_CB);
    else
        memcpy(dst, src, sizeof(float) * n);
}

/* U = G W G^T for outputs o0 <= o < o1 into u[a*a, O, Cg] (the backward's layout). */
static void wg_weights(const float *restrict w, float *restrict u, const float *restrict gm,
                       int O, int Cg, int r, int a, int o0, int o1)
{
    long ps = (long)O * Cg;
    float x[8 * 8 * WG_CB], tmp[8 * 8 * WG_CB], res[8 * 8 * WG_CB];
    for (int o = o0; o < o1; o++)
        for (int c0 = 0; c0 < Cg; c0 += WG_CB) {
            int nc = Cg - c0 < WG_CB ? Cg - c0 : WG_CB;
            for (int q = 0; q < r * r; q++)
                for (int v = 0; v < WG_CB; v++)
                    x[q * WG_CB + v] = v < nc ? w[((long)o * Cg + c0 + v) * r * r + q] : 0.f;
            wg_sandwich(gm, a, r, x, WG_CB, tmp, res, WG_CB, WG_CB);          /* G W G^T */
            for (int p = 0; p < a * a; p++)
                wg_run(u + p * ps + (long)o * Cg + c0, res + p * WG_CB, nc);
        }
}

/* The same U for the input channels gc0 <= gc < gc1 (gc = group * Cg + c) into the forward's
 * layout u[a*a, O / og * Cg, og]: per group of og outputs its Cg x og block, which the forward's
 * GEMMs read untransposed (this BLAS runs the small ones faster so). Runs of WG_CB outputs at a
 * time, so that every store is a contiguous run. */
static void wg_weights_t(const float *restrict w, float *restrict u, const float *restrict gm,
                         int O, int Cg, int r, int a, int og, int gc0, int gc1)
{
    long ps = (long)O * Cg;
    float x[8 * 8 * WG_CB], tmp[8 * 8 * WG_CB], res[8 * 8 * WG_CB];
    for (int gc = gc0; gc < gc1; gc++) {
        int gr = gc / Cg, c = gc % Cg;
        for (int k0 = 0; k0 < og; k0 += WG_CB) {
            int nk = og - k0 < WG_CB ? og - k0 : WG_CB;
            for (int q = 0; q < r * r; q++)
                for (int v = 0; v < WG_CB; v++)
                    x[q * WG_CB + v] = v < nk
                        ? w[(((long)gr * og + k0 + v) * Cg + c) * r * r + q] : 0.f;
            wg_sandwich(gm, a, r, x, WG_CB, tmp, res, WG_CB, WG_CB);          /* G W G^T */
            for (int p = 0; p < a * a; p++)
                wg_run(u + p * ps + (long)gc * og + k0, res + p * WG_CB, nk);
        }
    }
}

/* dW += G^T dU G for outputs o0 <= o < o1, dU in u's backward layout [a*a, O, Cg]. */
static void wg_weight_grad(const float *restrict du, float *restrict dw, const float *restrict gm,
                           int O, int Cg, int r, int a, int o0, int o1)
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
