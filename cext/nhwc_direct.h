/* Direct convolution for few input channels (group 1) on the channels-last layout, for
 * cext/nhwc.pyx's conv_direct_forward / conv_direct_weight_grad.
 *
 * A first layer (LeNet's conv1: 1 channel, 5x5, 20 outputs) has K = C * kh * kw of 25-75 taps:
 * im2col then copies runs of only kw * C floats, and the GEMM is too thin for BLAS to reach its
 * speed. Here the image is read in place instead (a padded copy, so no tap needs a bounds
 * check), and the sums stay in registers: CD_Q vectors of CD_V outputs for CD_P neighbouring
 * pixels (forward) or for CD_T taps (weight gradient), each a GCC vector of CD_V floats.
 *
 * Tap k of an output pixel is the input float at the pixel's origin + off[k], origin
 * (oy * sh * Wp + ox * sw) * C in the padded image [Hp][Wp][C]. Weights come as wp[K][Op]
 * (Op = O rounded up to CD_V, zeros after O), so each tap's outputs are whole vectors; the
 * weight gradient is kept in that form too.
 *
 * An image is read with a pixel stride xs >= C (C for channels-last; the block width V for the
 * blocked layout's single channel block), and outputs (and dy) are addressed as blocks of B
 * channels: output o of pixel q at (o / B) * bs + q * ys + o % B (channels-last: B = ys = O;
 * blocked: B = ys = V, bs = one block's plane).
 */
#include <string.h>
#include <unistd.h>

/* Register blocks: CD_P pixels by CD_FQ vectors of outputs (forward), CD_T taps by CD_Q
 * vectors (weight gradient). One register per vector: with a 16-float vector on AVX2 (two
 * registers each) GCC kept the accumulators on the stack, a load and a store around every FMA
 * (7x slower). On AVX2 two vectors a block make 12 sums of 16 registers, and each tap's float
 * feeds two FMAs. On AVX-512 the forward's 6 x 4 block (24 sums of 32 registers) loads 4
 * weight vectors and 6 floats for 24 FMAs, where one vector a block (6 sums) loaded 7 for 6
 * and waited on the loads (AlexNet's conv1 1.2x at b16, GoogLeNet's 1.3x at b1; 2 vectors
 * where 4 vectors' weights overflow L1: cd_forward_vectors). The weight gradient's 8 x 2 (16
 * sums) for the same reason (6 x 4 was no faster). */
#ifdef __AVX512F__
#define CD_V 16     /* outputs per vector */
#define CD_Q 2      /* vectors per block of the weight gradient */
#define CD_FQ 4     /* vectors per block of the forward */
#define CD_P 6      /* output pixels per block of the forward */
#define CD_T 8      /* taps per block of the weight gradient */
#else
#define CD_V 8
#define CD_Q 2
#define CD_FQ 2
#define CD_P 6
#define CD_T 6
#endif
#define CD_ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float cd_vec __attribute__((vector_size(CD_V * sizeof(float))));

static inline cd_vec cd_load(const float *p)
{
    cd_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Rows r0 .. r1 - 1 of xp [Hp][Wp][C], the first C floats of each pixel of x [H][W][xs] from
 * row ph and column pw on, inside zeros (Hp >= H + 2ph: Caffe's output size lets the last
 * window run past the padding when the stride does not divide evenly). A band of output rows
 * pads only the rows it reads (cd_band_rows). */
static void cd_pad(const float *restrict x, int H, int W, int C, int xs, int ph, int pw, int Wp,
                   int r0, int r1, float *restrict xp)
{
    size_t row = (size_t)Wp * C;
    for (int r = r0; r < r1; r++) {
        float *d = xp + (size_t)r * row;
        const float *s;
        if (r < ph || r - ph >= H) {
            memset(d, 0, row * sizeof(float));
            continue;
        }
        s = x + (size_t)(r - ph) * W * xs;
        memset(d, 0, (size_t)pw * C * sizeof(float));
        if (xs == C)
            memcpy(d + (size_t)pw * C, s, (size_t)W * C * sizeof(float));
        else
            for (int x0 = 0; x0 < W; x0++)
                memcpy(d + (size_t)(pw + x0) * C, s + (size_t)x0 * xs, C * sizeof(float));
        memset(d + (size_t)(pw + W) * C, 0, (size_t)(Wp - pw - W) * C * sizeof(float));
    }
}

/* Where output o of pixel q lives (see the top of the file). */
typedef struct {
    int ys, B;
    size_t bs;
} cd_out;

static inline size_t cd_at(cd_out a, size_t q, int o)
{
    return (size_t)(o / a.B) * a.bs + q * a.ys + o % a.B;
}

/* y's outputs oc .. oc + n of pixel q = v[0 .. n), piece by piece across blocks */
static inline void cd_put(float *y, cd_out a, size_t q, int oc, int n, const float *v)
{
    for (int done = 0; done < n;) {
        int o = oc + done, lane = o % a.B, m = a.B - lane < n - done ? a.B - lane : n - done;
        memcpy(y + cd_at(a, q, o), v + done, m * sizeof(float));
        done += m;
    }
}

/* v[0 .. n) = y's outputs 0 .. n of pixel q */
static inline void cd_get(const float *y, cd_out a, size_t q, int n, float *v)
{
    for (int done = 0; done < n;) {
        int m = a.B - done % a.B < n - done ? a.B - done % a.B : n - done;
        memcpy(v + done, y + cd_at(a, q, done), m * sizeof(float));
        done += m;
    }
}

typedef int cd_ivec __attribute__((vector_size(CD_V * sizeof(int))));

/* `n` (<= CD_P) pixels q .. q + n - 1, tap 0 of pixel p at base[p], by `nq` (<= CD_FQ)
 * vectors of outputs from oc: y's outputs oc .. oc + nv (addressed by `a`) = bias + taps, then
 * max(0, that) with relu (NaN kept, as Caffe's ReLU: the lanes below zero cleared). Inlined
 * where n and nq are constants, so the sums stay in registers. */
CD_ALWAYS_INLINE void cd_fwd_tile(const float *const *base, int n, int nq,
                                  const int *restrict off, int K, const float *restrict wp,
                                  int Op, const float *restrict bp, float *restrict y, cd_out a,
                                  size_t q, int oc, int nv, int relu)
{
    cd_vec acc[CD_P][CD_FQ];
    for (int p = 0; p < n; p++)
        for (int j = 0; j < nq; j++)
            acc[p][j] = cd_load(bp + oc + j * CD_V);
    for (int k = 0; k < K; k++) {
        cd_vec w[CD_FQ];
        int o = off[k];
        for (int j = 0; j < nq; j++)
            w[j] = cd_load(wp + (size_t)k * Op + oc + j * CD_V);
        for (int p = 0; p < n; p++) {
            float x = base[p][o];
            for (int j = 0; j < nq; j++)
                acc[p][j] += x * w[j];
        }
    }
    if (relu) {
        const cd_vec zero = {0};
        for (int p = 0; p < n; p++)
            for (int j = 0; j < nq; j++)
                acc[p][j] = (cd_vec)((cd_ivec)acc[p][j] & ~(cd_ivec)(acc[p][j] < zero));
    }
    for (int j = 0; j < nq && j * CD_V < nv; j++) {
        int o = oc + j * CD_V, cnt = nv - j * CD_V < CD_V ? nv - j * CD_V : CD_V;
        int lane = o % a.B;
        if (cnt == CD_V && lane + CD_V <= a.B) {
            /* a whole vector inside one block: its address once a tile, a store a pixel (a
             * cd_put a pixel, two integer divisions and a memcpy call, took longer than the
             * sums themselves for a 1x1 layer of 64 channels) */
            float *dst = y + (size_t)(o / a.B) * a.bs + lane;
            for (int p = 0; p < n; p++)
                memcpy(dst + (q + p) * a.ys, &acc[p][j], sizeof(cd_vec));
        } else
            for (int p = 0; p < n; p++)
                cd_put(y, a, q + p, o, cnt, (const float *)&acc[p][j]);
    }
}

/* Vectors of outputs a forward block sums over K taps: CD_FQ, but 2 where CD_FQ vectors of
 * weights over all the taps outgrow 60% of L1 (the rest holds the input rows) and 2 do not:
 * each block read its weights from L2 again. GoogLeNet's and ResNet-50's conv1 (147 taps x
 * 64 outputs: 37.6 KB of weights against 48 KB of L1, a Sapphire Rapids) ran 1.19-1.25x faster
 * at b16 with 2 (the same at b1); AlexNet's (363 taps: neither fits) 4-18% slower, so it keeps
 * CD_FQ. */
static int cd_forward_vectors(int K)
{
    static long l1 = 0;         /* threads may race to set it: each finds the same size */
    if (l1 == 0) {
        long found = sysconf(_SC_LEVEL1_DCACHE_SIZE);
        l1 = found > 0 ? found : 32768;
    }
    long bytes = (long)K * CD_V * sizeof(float);
    return CD_FQ > 2 && bytes * CD_FQ * 10 > l1 * 6 && bytes * 2 * 10 <= l1 * 6 ? 2 : CD_FQ;
}

/* Output rows oy0 .. oy1 - 1 of one image: outputs 0 .. O - 1 of y (addressed by `a`) = the
 * convolution of the padded image xp + bias (bp [Op]), through a ReLU with relu (a TEST net's
 * unit: the pass of its own over a first layer's output cost as much as a third of the
 * sums at MobileNet b1); O may count a block's padding lanes,
 * whose weights and bias are zero. A block of CD_P pixels runs on across the end of a row, so
 * a width that is not a multiple of CD_P (LeNet conv2's 8) still fills whole blocks. */
static void cd_forward_rows(const float *restrict xp, int Wp, int C, int sh, int sw,
                            const int *restrict off, int K, const float *restrict wp,
                            const float *restrict bp, int Op, float *restrict y, cd_out a,
                            int oy0, int oy1, int ow, int O, int relu)
{
    size_t q0 = (size_t)oy0 * ow, q1 = (size_t)oy1 * ow;
    const float *base[CD_P];
    int fq = cd_forward_vectors(K);
    for (size_t q = q0; q < q1; q += CD_P) {
        int n = q1 - q < CD_P ? (int)(q1 - q) : CD_P;
        for (int p = 0; p < n; p++) {
            size_t oy = (q + p) / ow, ox = (q + p) % ow;
            base[p] = xp + (oy * sh * Wp + ox * sw) * C;
        }
        for (int oc = 0; oc < O; oc += CD_V * fq) {
            int nv = O - oc < CD_V * fq ? O - oc : CD_V * fq;
            int nq = (Op - oc) / CD_V < fq ? (Op - oc) / CD_V : fq;   /* vectors left */
            /* a constant count each, so the sums stay in registers */
            if (n == CD_P && nq == CD_FQ)
                cd_fwd_tile(base, CD_P, CD_FQ, off, K, wp, Op, bp, y, a, q, oc, nv, relu);
#if CD_FQ > 2
            else if (n == CD_P && nq == 3)
                cd_fwd_tile(base, CD_P, 3, off, K, wp, Op, bp, y, a, q, oc, nv, relu);
            else if (n == CD_P && nq == 2)
                cd_fwd_tile(base, CD_P, 2, off, K, wp, Op, bp, y, a, q, oc, nv, relu);
#endif
            else if (n == CD_P)
                cd_fwd_tile(base, CD_P, 1, off, K, wp, Op, bp, y, a, q, oc, nv, relu);
            else
                cd_fwd_tile(base, n, nq, off, K, wp, Op, bp, y, a, q, oc, nv, relu);
        }
    }
}

/* dwp's rows for taps off[0 .. CD_T), outputs oc .. oc + nq * CD_V, += those taps of `rows`
 * output rows from y0 times dy's (widened in dyp). Inlined where nq is a constant. */
CD_ALWAYS_INLINE void cd_wg_tile(int nq, const float *restrict xp, int Wp, int C, int sh,
                                 int step, const int *restrict off, const float *restrict dyp,
                                 int y0, int rows, int ow, int Op, int oc, float *restrict dwp)
{
    cd_vec acc[CD_T][CD_Q];
    for (int t = 0; t < CD_T; t++)
        for (int j = 0; j < nq; j++)
            acc[t][j] = (cd_vec){0};
    for (int r = 0; r < rows; r++) {
        const float *row = xp + (size_t)(y0 + r) * sh * Wp * C;
        const float *d = dyp + (size_t)r * ow * Op + oc;
        for (int ox = 0; ox < ow; ox++) {
            cd_vec g[CD_Q];
            for (int j = 0; j < nq; j++)
                g[j] = cd_load(d + (size_t)ox * Op + j * CD_V);
            const float *base = row + (size_t)ox * step;
            for (int t = 0; t < CD_T; t++) {
                float x = base[off[t]];
                for (int j = 0; j < nq; j++)
                    acc[t][j] += x * g[j];
            }
        }
    }
    for (int t = 0; t < CD_T; t++)
        for (int j = 0; j < nq; j++) {
            float *w = dwp + (size_t)t * Op + oc + j * CD_V;
            cd_vec s = cd_load(w);
            s += acc[t][j];
            memcpy(w, &s, sizeof s);
        }
}

/* Output rows oy0 .. oy1 - 1 of one image: dwp [Kp][Op] += the taps times dy's outputs
 * 0 .. O - 1 (addressed by `a`), dbp [Op] += their sums. `off` has Kp entries (K rounded up
 * to CD_T; the extra ones are 0, their rows of dwp are scratch). dyp is scratch for `band`
 * output rows of dy widened to Op floats a pixel. */
static void cd_weight_grad_rows(const float *restrict xp, int Wp, int C, int sh, int sw,
                                const int *restrict off, int Kp, const float *restrict dy,
                                cd_out a, int oy0, int oy1, int ow, int O, int Op, int band,
                                float *restrict dyp, float *restrict dwp, float *restrict dbp)
{
    int step = sw * C;
    for (int y0 = oy0; y0 < oy1; y0 += band) {
        int rows = oy1 - y0 < band ? oy1 - y0 : band;
        size_t pixels = (size_t)rows * ow;
        for (size_t p = 0; p < pixels; p++) {
            float *d = dyp + p * Op;
            cd_get(dy, a, (size_t)y0 * ow + p, O, d);
            memset(d + O, 0, (Op - O) * sizeof(float));
        }
        for (int oc = 0; oc < Op; oc += CD_V) {
            cd_vec sb = {0};
            for (size_t p = 0; p < pixels; p++)
                sb += cd_load(dyp + p * Op + oc);
            cd_vec db = cd_load(dbp + oc);
            db += sb;
            memcpy(dbp + oc, &db, sizeof db);
        }
        for (int oc = 0; oc < Op; oc += CD_V * CD_Q)
            for (int k0 = 0; k0 < Kp; k0 += CD_T) {
                if (Op - oc >= CD_V * CD_Q)
                    cd_wg_tile(CD_Q, xp, Wp, C, sh, step, off + k0, dyp, y0, rows, ow, Op, oc,
                               dwp + (size_t)k0 * Op);
                else            /* one vector left (CD_Q = 2) */
                    cd_wg_tile(1, xp, Wp, C, sh, step, off + k0, dyp, y0, rows, ow, Op, oc,
                               dwp + (size_t)k0 * Op);
            }
    }
}
