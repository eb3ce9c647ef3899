/* Intel Caffe's int8 convolution and inner product (caffepy/quantization.py), exactly:
 * activations quantized to 8-bit integers, weights to signed 8-bit, products summed in int32,
 * then one float32 epilogue per output (output scale, summand, ReLU, rounding, saturation).
 *
 * The 8-bit values are held as int16 pairs and multiplied by vpmaddwd (int16 x int16, the two
 * products of a pair summed into int32): |u8 x s8| <= 255 * 128, so a pair's sum fits int32 and
 * nothing saturates. vpmaddubsw (u8 x s8 summed into int16), which Intel's AVX2 kernels use,
 * saturates when both products of a pair are large (2 * 255 * 127 > 32767); it is not used.
 *
 * Layouts: weights a[M][Kp] (Kp even, zero past K), read as int32 pairs; the right-hand side
 * b[Kp / 2][Np][2] (a pair of consecutive k for each column, Np a multiple of I8_NR, zero past
 * the real columns), so one 256-bit load is 8 columns' pairs. */
#ifndef CAFFEPY_INT8_GEMM_H
#define CAFFEPY_INT8_GEMM_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* no fused multiply-add in the epilogue: y * mult + summand * sum_scale rounds each product
 * apart, as the reference (and every ISA) does */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

#define I8_NR 16        /* columns per register tile (two vectors of 8 int32) */
#define I8_MR 6         /* rows per register tile: 12 sums of 16 registers */
#define I8_KB 256       /* k pairs per block: the block of b (16 KiB) stays in L1 */

typedef struct {
    const int32_t *bias;     /* per output row, or NULL */
    const float *mult;       /* per output row: scale_out / (scale_in * scale_params[row]) */
    const float *summand;    /* indexed as out, or NULL */
    float sum_scale;
    int relu;
    float slope;
    int quantize;            /* round and saturate to [lo, hi] (an 8-bit top) */
    float lo, hi;
    float inv_scale_out;     /* the top's floats: the result times 1 / scale_out */
    float *out;
    long so, sp;             /* out[row * so + column * sp] */
} i8_epilogue;

/* The ISA the int8 kernels run: 1 AVX2, 0 the portable C (the same integers, slower). */
static int i8_isa_available(void)
{
#ifdef __AVX2__
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

static inline int16_t i8_quantize(float v, float scale, float lo, float hi)
{
    float s = v * scale;
    /* saturate first, so the conversion of a huge or NaN value stays in range */
    s = s > lo ? s : lo;
    s = s < hi ? s : hi;
    return (int16_t)rintf(s);      /* nearest, ties to even (the default rounding mode) */
}

static void i8_quantize_plane(const float *x, long n, float scale, float lo, float hi,
                              int16_t *q)
{
    for (long i = 0; i < n; i++)
        q[i] = i8_quantize(x[i], scale, lo, hi);
}

/* Columns of one group of one image, from the quantized image q[C][H][W]: row k = (c, i, j) of
 * the window, column p = (oh, ow); zero outside the image, past K and past P. */
static void i8_pack_conv_rows(const int16_t *q, int H, int W, int kh, int kw, int ph, int pw,
                              int sh, int sw, int dh, int dw, int OH, int OW, int c0, int K,
                              int k0, int k1, long Np, int16_t *b)
{
    long P = (long)OH * OW;
    for (int k = k0; k < k1; k++) {
        int16_t *row = b + (long)(k >> 1) * Np * 2 + (k & 1);
        if (k >= K) {
            for (long p = 0; p < Np; p++)
                row[2 * p] = 0;
            continue;
        }
        int c = k / (kh * kw), r = k % (kh * kw), i = r / kw, j = r % kw;
        const int16_t *plane = q + (long)(c0 + c) * H * W;
        long p = 0;
        for (int oh = 0; oh < OH; oh++) {
            int y = oh * sh - ph + i * dh;
            if (y < 0 || y >= H) {
                for (int ow = 0; ow < OW; ow++, p++)
                    row[2 * p] = 0;
                continue;
            }
            const int16_t *line = plane + (long)y * W;
            for (int ow = 0; ow < OW; ow++, p++) {
                int x = ow * sw - pw + j * dw;
                row[2 * p] = (x >= 0 && x < W) ? line[x] : 0;
            }
        }
        for (; p < Np; p++)
            row[2 * p] = 0;
        (void)P;
    }
}

/* The inner product's right-hand side: column m = item m of x[M][K], quantized. */
static void i8_pack_items(const float *x, int M, int K, float scale, float lo, float hi,
                          int k0, int k1, long Np, int16_t *b)
{
    for (int k = k0; k < k1; k++) {
        int16_t *row = b + (long)(k >> 1) * Np * 2 + (k & 1);
        long m = 0;
        if (k < K)
            for (; m < M; m++)
                row[2 * m] = i8_quantize(x[(long)m * K + k], scale, lo, hi);
        for (; m < Np; m++)
            row[2 * m] = 0;
    }
}

/* c[r][0..16) (+)= sum over pairs j < J of a(r, j) . b(j, 0..16), rows r < R. */
static inline __attribute__((always_inline)) void
i8_tile_c(int R, int J, const int16_t *a, long lda, const int16_t *b, long ldb, int32_t *c,
          int accumulate)
{
    for (int r = 0; r < R; r++) {
        int32_t acc[I8_NR];
        for (int n = 0; n < I8_NR; n++)
            acc[n] = accumulate ? c[r * I8_NR + n] : 0;
        const int16_t *ar = a + r * lda;
        for (int j = 0; j < J; j++) {
            int32_t a0 = ar[2 * j], a1 = ar[2 * j + 1];
            const int16_t *bj = b + (long)j * ldb;
            for (int n = 0; n < I8_NR; n++)
                acc[n] += a0 * bj[2 * n] + a1 * bj[2 * n + 1];
        }
        for (int n = 0; n < I8_NR; n++)
            c[r * I8_NR + n] = acc[n];
    }
}

#ifdef __AVX2__
static inline __attribute__((always_inline)) void
i8_tile_avx2(int R, int J, const int16_t *a, long lda, const int16_t *b, long ldb, int32_t *c,
             int accumulate)
{
    __m256i acc[I8_MR][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = accumulate ? _mm256_loadu_si256((const __m256i *)(c + r * I8_NR))
                               : _mm256_setzero_si256();
        acc[r][1] = accumulate ? _mm256_loadu_si256((const __m256i *)(c + r * I8_NR + 8))
                               : _mm256_setzero_si256();
    }
    for (int j = 0; j < J; j++) {
        const int16_t *bj = b + (long)j * ldb;
        __m256i b0 = _mm256_loadu_si256((const __m256i *)bj);
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(bj + 16));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, a + r * lda + 2 * j, 4);
            __m256i av = _mm256_set1_epi32(pair);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(av, b0));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(av, b1));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i *)(c + r * I8_NR), acc[r][0]);
        _mm256_storeu_si256((__m256i *)(c + r * I8_NR + 8), acc[r][1]);
    }
}

#define I8_TILE i8_tile_avx2
static void i8_block_avx2(int R, int J, const int16_t *a, long lda, const int16_t *b, long ldb,
                          int32_t *c, int accumulate)
{
    switch (R) {
    case 6: I8_TILE(6, J, a, lda, b, ldb, c, accumulate); break;
    case 5: I8_TILE(5, J, a, lda, b, ldb, c, accumulate); break;
    case 4: I8_TILE(4, J, a, lda, b, ldb, c, accumulate); break;
    case 3: I8_TILE(3, J, a, lda, b, ldb, c, accumulate); break;
    case 2: I8_TILE(2, J, a, lda, b, ldb, c, accumulate); break;
    default: I8_TILE(1, J, a, lda, b, ldb, c, accumulate); break;
    }
}
#undef I8_TILE
#endif

static void i8_block_c(int R, int J, const int16_t *a, long lda, const int16_t *b, long ldb,
                       int32_t *c, int accumulate)
{
    i8_tile_c(R, J, a, lda, b, ldb, c, accumulate);
}

static inline float i8_finish(int32_t acc, int row, long idx, const i8_epilogue *e)
{
    float y = (float)(e->bias ? acc + e->bias[row] : acc) * e->mult[row];
    if (e->summand)
        y += e->summand[idx] * e->sum_scale;
    if (e->relu && !(y > 0))
        y *= e->slope;
    if (e->quantize) {
        y = y > e->lo ? y : e->lo;
        y = y < e->hi ? y : e->hi;
        y = rintf(y) + 0.0f;        /* an integer, so no -0 (an 8-bit top has none) */
    }
    return y * e->inv_scale_out;
}

/* Rows [0, M) x columns [n0, n0 + 16) of a . b, finished into e->out: one column tile, its
 * int32 sums in c (M x 16, the caller's scratch). Rows are e's rows from row0. */
static void i8_column_tile(int isa, int M, int Kp, const int16_t *a, const int16_t *b, long Np,
                           long n0, long P, int row0, int32_t *c, const i8_epilogue *e)
{
    int J = Kp / 2;
    for (int j0 = 0; j0 < J; j0 += I8_KB) {
        int jn = J - j0 < I8_KB ? J - j0 : I8_KB;
        const int16_t *bb = b + (long)j0 * Np * 2 + n0 * 2;
        for (int m = 0; m < M; m += I8_MR) {
            int R = M - m < I8_MR ? M - m : I8_MR;
            const int16_t *aa = a + (long)m * Kp + 2L * j0;
#ifdef __AVX2__
            if (isa)
                i8_block_avx2(R, jn, aa, Kp, bb, Np * 2, c + (long)m * I8_NR, j0 > 0);
            else
#endif
                i8_block_c(R, jn, aa, Kp, bb, Np * 2, c + (long)m * I8_NR, j0 > 0);
        }
    }
    long nn = P - n0 < I8_NR ? P - n0 : I8_NR;
    for (int m = 0; m < M; m++) {
        int row = row0 + m;
        for (long n = 0; n < nn; n++) {
            long idx = row * e->so + (n0 + n) * e->sp;
            e->out[idx] = i8_finish(c[(long)m * I8_NR + n], row, idx, e);
        }
    }
}

/* One image of a grouped convolution: x [C][H][W] floats in; q (C * H * W int16), b (G x
 * Kp / 2 x Np x 2 int16) and c (threads x Mg x 16 int32) scratch; e->out [G * Mg][P]. Weights
 * w [G * Mg][Kp]. One OpenMP region. */
static void i8_conv_image(int isa, int threads, const float *x, int C, int H, int W, int G,
                          int Mg, int K, int Kp, int kh, int kw, int ph, int pw, int sh, int sw,
                          int dh, int dw, int OH, int OW, float scale, float lo, float hi,
                          const int16_t *w, int16_t *q, int16_t *b, int32_t *c,
                          const i8_epilogue *e)
{
    long P = (long)OH * OW, Np = (P + I8_NR - 1) / I8_NR * I8_NR, HW = (long)H * W;
    long tiles = Np / I8_NR;
    int Cg = C / G;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long i = 0; i < C; i++)
            i8_quantize_plane(x + i * HW, HW, scale, lo, hi, q + i * HW);
        #pragma omp for schedule(static)
        for (long gk = 0; gk < (long)G * (Kp / 2); gk++) {
            int g = gk / (Kp / 2), k = 2 * (gk % (Kp / 2));
            i8_pack_conv_rows(q, H, W, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW, g * Cg, K, k,
                              k + 2, Np, b + (long)g * (Kp / 2) * Np * 2);
        }
        int32_t *cc = c + (long)omp_get_thread_num() * Mg * I8_NR;
        #pragma omp for schedule(static)
        for (long gt = 0; gt < G * tiles; gt++) {
            long g = gt / tiles, t = gt % tiles;
            i8_column_tile(isa, Mg, Kp, w + g * Mg * Kp, b + g * (Kp / 2) * Np * 2, Np,
                           t * I8_NR, P, (int)(g * Mg), cc, e);
        }
    }
}

/* An inner product: x [M][K] floats in; b (Kp / 2 x Np x 2 int16) and c (threads x N x 16
 * int32) scratch; e->out [M][N] (so 1, sp N). Weights w [N][Kp]. */
static void i8_inner_product(int isa, int threads, const float *x, int M, int K, int N, int Kp,
                             float scale, float lo, float hi, const int16_t *w, int16_t *b,
                             int32_t *c, const i8_epilogue *e)
{
    long Np = ((long)M + I8_NR - 1) / I8_NR * I8_NR, tiles = Np / I8_NR;
    long rows = (N + I8_MR - 1) / I8_MR;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long j = 0; j < Kp / 2; j++)
            i8_pack_items(x, M, K, scale, lo, hi, 2 * j, 2 * j + 2, Np, b);
        int32_t *cc = c + (long)omp_get_thread_num() * I8_MR * I8_NR;
        /* split over row tiles too: at small batch there is one column tile */
        #pragma omp for schedule(static)
        for (long rt = 0; rt < rows * tiles; rt++) {
            long r = rt / tiles, t = rt % tiles;
            int m0 = (int)(r * I8_MR), R = N - m0 < I8_MR ? N - m0 : I8_MR;
            i8_column_tile(isa, R, Kp, w + (long)m0 * Kp, b, Np, t * I8_NR, M, m0, cc, e);
        }
    }
}
#pragma GCC pop_options
#endif
