/* Intel Caffe's int8 convolution and inner product (caffepy/quantization.py), exactly:
 * activations quantized to 8-bit integers, weights to signed 8-bit, products summed in int32,
 * then one float32 epilogue per output (output scale, summand, ReLU, rounding, saturation).
 *
 * The 8-bit values are held as int16 pairs and multiplied by vpmaddwd (int16 x int16, the two
 * products of a pair summed into int32): |u8 x s8| <= 255 * 128, so a pair's sum fits int32 and
 * nothing saturates. vpmaddubsw (u8 x s8 summed into int16), which Intel's AVX2 kernels use,
 * saturates when both products of a pair are large (2 * 255 * 127 > 32767); it is not used.
 *
 * Layouts: weights a[M][Kp] (Kp even, zero past K; a convolution's k in the order (kernel row,
 * kernel column, channel), so that a pair is two channels of one input pixel, one int32 read
 * when packing), read as int32 pairs; the right-hand side
 * in column tiles of I8_NR, b[Np / 16][Kp / 2][16][2] (a pair of consecutive k for each column,
 * Np a multiple of 16, zero past the real columns): one 256-bit load is 8 columns' pairs, and a
 * tile's pairs follow each other in memory (with rows of Np columns, a pair's row was a page
 * apart from the next at 56 x 56: the 3 x 3 convolutions ran at a third of the 1 x 1's rate). */
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
    /* the channels-last kernels' 8-bit tops and summands (int8_nhwc.h i8n_finish): instead of
     * out, pixel p's channel o as the byte out8[p * row8 + o] = the 8-bit value plus zp8 (the
     * bytes the next layer's kernels read); a summand's value (summand8[p * srow8 + o] - szp8)
     * times s_inv, the float its writer would have stored */
    uint8_t *out8;
    long row8;
    int zp8;
    const uint8_t *summand8;
    long srow8;
    int szp8;
    float s_inv;
} i8_epilogue;

static inline int16_t i8_quantize(float v, float scale, float lo, float hi)
{
    float s = v * scale;
    /* saturate first, so the conversion of a huge or NaN value stays in range */
    s = s > lo ? s : lo;
    s = s < hi ? s : hi;
    return (int16_t)rintf(s);      /* nearest, ties to even (the default rounding mode) */
}

static inline int32_t i8_pair(float a, float b, float scale, float lo, float hi)
{
    return (uint16_t)i8_quantize(a, scale, lo, hi) | ((int32_t)i8_quantize(b, scale, lo, hi) << 16);
}

/* q[i] = the quantized pair (a[i], b[i]) as int32 (a in the low half), i < n; b NULL: zeros. */
static void i8_quantize_pairs(const float *a, const float *b, long n, float scale, float lo,
                              float hi, int32_t *q)
{
    long i = 0;
#ifdef __AVX2__
    const __m256 s = _mm256_set1_ps(scale), l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    const __m256i low = _mm256_set1_epi32(0xffff);
    for (; i + 8 <= n; i += 8) {
        /* max(v, lo) gives lo for a NaN v, as i8_quantize; cvtps rounds to nearest even */
        __m256i qa = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_mul_ps(_mm256_loadu_ps(a + i), s), l), h));
        __m256i qb = b ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_mul_ps(_mm256_loadu_ps(b + i), s), l), h)) : _mm256_setzero_si256();
        _mm256_storeu_si256((__m256i *)(q + i),
                            _mm256_or_si256(_mm256_and_si256(qa, low), _mm256_slli_epi32(qb, 16)));
    }
#endif
    for (; i < n; i++)
        q[i] = i8_pair(a[i], b ? b[i] : 0.0f, scale, lo, hi);
}

/* The right-hand side of one group of one image, from its quantized channel pairs
 * q[Cp][H][W] (int32: channels 2c, 2c + 1): pair row jj = (i, j, c) of the window (the
 * weights' k order is (i, j, channel)), column p = (oh, ow); zero outside the image and past
 * P. b is the group's [Np / 16][J][16] int32. */
static void i8_pack_conv_pairs(const int32_t *q, int Cp, int H, int W, int kw, int ph, int pw,
                               int sh, int sw, int dh, int dw, int OH, int OW, int J, int jj,
                               long Np, int32_t *b)
{
    int c = jj % Cp, r = jj / Cp, i = r / kw, j = r % kw;
    const int32_t *plane = q + (long)c * H * W;
    int32_t *row = b + (long)jj * 16;
    long tile = (long)J * 16;
#define I8_AT(p) row[((p) >> 4) * tile + ((p) & 15)]
    long p = 0;
    for (int oh = 0; oh < OH; oh++) {
        int y = oh * sh - ph + i * dh;
        if (y < 0 || y >= H) {
            for (int ow = 0; ow < OW; ow++, p++)
                I8_AT(p) = 0;
            continue;
        }
        const int32_t *line = plane + (long)y * W;
        for (int ow = 0; ow < OW; ow++, p++) {
            int x = ow * sw - pw + j * dw;
            I8_AT(p) = (x >= 0 && x < W) ? line[x] : 0;
        }
    }
    for (; p < Np; p++)
        I8_AT(p) = 0;
}

/* The inner product's right-hand side: column m = item m of x[M][K], pair row jj. */
static void i8_pack_items(const float *x, int M, int K, int J, float scale, float lo, float hi,
                          int jj, long Np, int32_t *b)
{
    int32_t *row = b + (long)jj * 16;
    long tile = (long)J * 16;
    int k = 2 * jj;
    long m = 0;
    for (; m < M; m++) {
        const float *xm = x + (long)m * K;
        I8_AT(m) = k + 1 < K ? i8_pair(xm[k], xm[k + 1], scale, lo, hi)
                             : (k < K ? i8_pair(xm[k], 0.0f, scale, lo, hi) : 0);
    }
    for (; m < Np; m++)
        I8_AT(m) = 0;
}
#undef I8_AT

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

/* c{r}0, c{r}1 (r < 6: twelve __m256i of the caller's, 8 columns each) += the sums over pairs
 * j < J of row r's int32 pair a_r[j] times the 16 columns' pairs at b + 32 j (int16), as inline
 * assembly: GCC's code for these 12 sums kept half of them on the stack (a load and a store per
 * multiply-add; the tile ran below float32's FMA tile in MACs per second, at twice the MACs per
 * instruction). The sums stay in ymm0-11 (the clobbers leave GCC no other registers for them),
 * b's two vectors in ymm12-13, a row's broadcast pair in ymm14, a product in ymm15. */
#define I8_ASM_ROW(reg, lo, hi)                                                         \
    "vpbroadcastd (%%" reg ",%%rax,4), %%ymm14\n\t"                                     \
    "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                            \
    "vpaddd %%ymm15, %[" lo "], %[" lo "]\n\t"                                          \
    "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"                                            \
    "vpaddd %%ymm15, %[" hi "], %[" hi "]\n\t"
/* rows: 6 row pointers (int32 pairs) in an array (30 operands at most: they are loaded into
 * r8-r13 inside) */
#define I8_MADD_6X16(J, rows, bp)                                                      \
    do {                                                                                \
        long n_ = (J);                                                                  \
        const int16_t *b_ = (bp);                                                       \
        const void *const *r_ = (const void *const *)(rows);                            \
        if (n_ > 0)                                                                     \
            __asm__ volatile(                                                           \
                "mov (%[r]), %%r8\n\t"                                                  \
                "mov 8(%[r]), %%r9\n\t"                                                 \
                "mov 16(%[r]), %%r10\n\t"                                               \
                "mov 24(%[r]), %%r11\n\t"                                               \
                "mov 32(%[r]), %%r12\n\t"                                               \
                "mov 40(%[r]), %%r13\n\t"                                               \
                "xor %%eax, %%eax\n\t"                                                  \
                "1:\n\t"                                                                \
                "vmovdqu (%[b]), %%ymm12\n\t"                                           \
                "vmovdqu 32(%[b]), %%ymm13\n\t"                                         \
                I8_ASM_ROW("r8", "c00", "c01") I8_ASM_ROW("r9", "c10", "c11")           \
                I8_ASM_ROW("r10", "c20", "c21") I8_ASM_ROW("r11", "c30", "c31")         \
                I8_ASM_ROW("r12", "c40", "c41") I8_ASM_ROW("r13", "c50", "c51")         \
                "add $64, %[b]\n\t"                                                     \
                "inc %%rax\n\t"                                                         \
                "cmp %[n], %%rax\n\t"                                                   \
                "jl 1b\n\t"                                                             \
                : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11),   \
                  [c20] "+x"(c20), [c21] "+x"(c21), [c30] "+x"(c30), [c31] "+x"(c31),   \
                  [c40] "+x"(c40), [c41] "+x"(c41), [c50] "+x"(c50), [c51] "+x"(c51),   \
                  [b] "+r"(b_)                                                          \
                : [r] "r"(r_), [n] "r"(n_)                                              \
                : "rax", "r8", "r9", "r10", "r11", "r12", "r13", "xmm12", "xmm13",      \
                  "xmm14", "xmm15", "cc", "memory");                                    \
    } while (0)
#define I8_ACC6_INIT(c, accumulate)                                                     \
    __m256i c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;                 \
    {                                                                                   \
        __m256i *acc_[12] = {&c00, &c01, &c10, &c11, &c20, &c21, &c30, &c31, &c40,      \
                             &c41, &c50, &c51};                                          \
        for (int k_ = 0; k_ < 12; k_++)                                                 \
            *acc_[k_] = (accumulate) ? _mm256_loadu_si256((const __m256i *)((c) + 8 * k_)) \
                                     : _mm256_setzero_si256();                          \
    }
#define I8_ACC6_STORE(c)                                                                \
    {                                                                                   \
        __m256i acc_[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51}; \
        for (int k_ = 0; k_ < 12; k_++)                                                 \
            _mm256_storeu_si256((__m256i *)((c) + 8 * k_), acc_[k_]);                   \
    }

/* The full 6-row tile (b's pairs 64 bytes apart: ldb 32, as every caller packs them). */
static void i8_tile6_avx2(int J, const int16_t *a, long lda, const int16_t *b, long ldb,
                          int32_t *c, int accumulate)
{
    (void)ldb;
    I8_ACC6_INIT(c, accumulate)
    const int16_t *rows[6] = {a, a + lda, a + 2 * lda, a + 3 * lda, a + 4 * lda, a + 5 * lda};
    I8_MADD_6X16(J, rows, b);
    I8_ACC6_STORE(c)
}

#define I8_TILE i8_tile_avx2
static void i8_block_avx2(int R, int J, const int16_t *a, long lda, const int16_t *b, long ldb,
                          int32_t *c, int accumulate)
{
    switch (R) {
    case 6: i8_tile6_avx2(J, a, lda, b, ldb, c, accumulate); break;
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

/* The result before its last product by inv_scale_out (an integer when quantized); summand
 * the summand's float, or NULL */
static inline float i8_level(int32_t acc, int row, const float *summand, const i8_epilogue *e)
{
    float y = (float)(e->bias ? acc + e->bias[row] : acc) * e->mult[row];
    if (summand)
        y += *summand * e->sum_scale;
    if (e->relu && !(y > 0))
        y *= e->slope;
    if (e->quantize) {
        y = y > e->lo ? y : e->lo;
        y = y < e->hi ? y : e->hi;
        y = rintf(y) + 0.0f;        /* an integer, so no -0 (an 8-bit top has none) */
    }
    return y;
}

static inline float i8_finish(int32_t acc, int row, long idx, const i8_epilogue *e)
{
    return i8_level(acc, row, e->summand ? e->summand + idx : NULL, e) * e->inv_scale_out;
}

#ifdef __AVX2__
/* i8_finish of 8 consecutive outputs from idx, with each output's bias and multiplier in a
 * vector: the same operations in the same order. Both layouts' vector epilogue (here a row's
 * outputs share one bias and multiplier; in int8_nhwc.h the 8 are channels, each its own). */
static inline __m256 i8_level8_avx2(__m256i acc, __m256i bias, __m256 mult, const float *summand,
                                    const i8_epilogue *e)
{
    __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc, bias)), mult);
    if (summand)
        y = _mm256_add_ps(y, _mm256_mul_ps(_mm256_loadu_ps(summand),
                                           _mm256_set1_ps(e->sum_scale)));
    /* Clamped at a lower bound of 0 or more, a ReLU of slope 0 changes nothing (max_ps gives
     * its second operand, the bound, for a NaN and for -0 alike) and no -0 is left to clear:
     * 4 of the 12 operations, skipped with the same bits */
    int clamped = e->quantize && e->lo >= 0;
    if (e->relu && !(clamped && e->slope == 0))
        y = _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_set1_ps(e->slope)), y,
                             _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ));
    if (e->quantize) {
        y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(e->lo)), _mm256_set1_ps(e->hi));
        y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (!clamped)
            y = _mm256_add_ps(y, _mm256_setzero_ps());
    }
    return y;
}

static inline void i8_finish8_avx2(__m256i acc, __m256i bias, __m256 mult, long idx,
                                   const i8_epilogue *e)
{
    __m256 y = i8_level8_avx2(acc, bias, mult, e->summand ? e->summand + idx : NULL, e);
    _mm256_storeu_ps(e->out + idx, _mm256_mul_ps(y, _mm256_set1_ps(e->inv_scale_out)));
}

/* i8_finish of 16 consecutive outputs of one row from idx. */
static inline void i8_finish16_avx2(const int32_t *acc, int row, long idx, const i8_epilogue *e)
{
    const __m256 mult = _mm256_set1_ps(e->mult[row]);
    const __m256i bias = _mm256_set1_epi32(e->bias ? e->bias[row] : 0);
    for (int h = 0; h < 2; h++)
        i8_finish8_avx2(_mm256_loadu_si256((const __m256i *)(acc + 8 * h)), bias, mult,
                        idx + 8 * h, e);
}
#endif

/* Rows [0, M) x columns [n0, n0 + 16) of a . b, finished into e->out: one column tile, its
 * int32 sums in c (M x 16, the caller's scratch). Rows are e's rows from row0. */
static void i8_column_tile(int isa, int M, int Kp, const int16_t *a, const int16_t *b, long Np,
                           long n0, long P, int row0, int32_t *c, const i8_epilogue *e)
{
    int J = Kp / 2;
    for (int j0 = 0; j0 < J; j0 += I8_KB) {
        int jn = J - j0 < I8_KB ? J - j0 : I8_KB;
        const int16_t *bb = b + (n0 / I8_NR * J + j0) * 32L;
        for (int m = 0; m < M; m += I8_MR) {
            int R = M - m < I8_MR ? M - m : I8_MR;
            const int16_t *aa = a + (long)m * Kp + 2L * j0;
#ifdef __AVX2__
            if (isa)
                i8_block_avx2(R, jn, aa, Kp, bb, 32, c + (long)m * I8_NR, j0 > 0);
            else
#endif
                i8_block_c(R, jn, aa, Kp, bb, 32, c + (long)m * I8_NR, j0 > 0);
        }
    }
    long nn = P - n0 < I8_NR ? P - n0 : I8_NR;
    for (int m = 0; m < M; m++) {
        int row = row0 + m;
#ifdef __AVX2__
        if (isa && nn == I8_NR && e->sp == 1) {
            i8_finish16_avx2(c + (long)m * I8_NR, row, row * e->so + n0, e);
            continue;
        }
#endif
        for (long n = 0; n < nn; n++) {
            long idx = row * e->so + (n0 + n) * e->sp;
            e->out[idx] = i8_finish(c[(long)m * I8_NR + n], row, idx, e);
        }
    }
}

/* One image of a grouped convolution: x [C][H][W] floats in; q (G * Cp * H * W int32, Cp =
 * the group's channels in pairs) and b (G x Np / 16 x J x 16 int32, J = kh * kw * Cp) and c
 * (threads x Mg x 16 int32) scratch; e->out [G * Mg][P]. Weights w [G * Mg][2 J], k in the order
 * (i, j, channel). One OpenMP region. */
static void i8_conv_image(int isa, int threads, const float *x, int C, int H, int W, int G,
                          int Mg, int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw,
                          int OH, int OW, float scale, float lo, float hi, const int16_t *w,
                          int32_t *q, int32_t *b, int32_t *c, const i8_epilogue *e)
{
    long P = (long)OH * OW, Np = (P + I8_NR - 1) / I8_NR * I8_NR, HW = (long)H * W;
    long tiles = Np / I8_NR;
    int Cg = C / G, Cp = (Cg + 1) / 2, J = kh * kw * Cp, Kp = 2 * J;
    (void)isa;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long gc = 0; gc < (long)G * Cp; gc++) {
            long g = gc / Cp, ch = g * Cg + 2 * (gc % Cp);
            const float *second = 2 * (gc % Cp) + 1 < Cg ? x + (ch + 1) * HW : NULL;
            i8_quantize_pairs(x + ch * HW, second, HW, scale, lo, hi, q + gc * HW);
        }
        #pragma omp for schedule(static)
        for (long gj = 0; gj < (long)G * J; gj++) {
            long g = gj / J;
            i8_pack_conv_pairs(q + g * Cp * HW, Cp, H, W, kw, ph, pw, sh, sw, dh, dw, OH, OW, J,
                               (int)(gj % J), Np, b + g * J * Np);
        }
        int32_t *cc = c + (long)omp_get_thread_num() * Mg * I8_NR;
        #pragma omp for schedule(static)
        for (long gt = 0; gt < G * tiles; gt++) {
            long g = gt / tiles, t = gt % tiles;
            i8_column_tile(isa, Mg, Kp, w + g * Mg * Kp, (const int16_t *)(b + g * J * Np), Np,
                           t * I8_NR, P, (int)(g * Mg), cc, e);
        }
    }
}

/* One image of a depthwise convolution (a group per channel, one input and one output channel
 * each): x [C][H][W] floats in; q (C * H * W int32) and acc (threads x OW int32) scratch;
 * e->out [C][P]. Weights as conv_weights orders them: w [C][2 kh kw], the tap (i, j) at
 * 2 (i kw + j). A direct sum per output row: as a GEMM, one row per group wasted the tile. */
static void i8_quantize_ints(const float *x, long n, float scale, float lo, float hi, int32_t *q)
{
    long i = 0;
#ifdef __AVX2__
    const __m256 s = _mm256_set1_ps(scale), l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_cvtps_epi32(_mm256_min_ps(
            _mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), l), h)));
#endif
    for (; i < n; i++)
        q[i] = i8_quantize(x[i], scale, lo, hi);
}

static void i8_depthwise_image(int isa, int threads, const float *x, int C, int H, int W, int kh,
                               int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH,
                               int OW, float scale, float lo, float hi, const int16_t *w,
                               int32_t *q, int32_t *acc, const i8_epilogue *e)
{
    long HW = (long)H * W, P = (long)OH * OW;
    int Kp = 2 * kh * kw;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < C; c++) {
        int32_t *plane = q + c * HW;
        i8_quantize_ints(x + c * HW, HW, scale, lo, hi, plane);
        int32_t *a = acc + (long)omp_get_thread_num() * OW;
        for (int oh = 0; oh < OH; oh++) {
            for (int ow = 0; ow < OW; ow++)
                a[ow] = 0;
            for (int i = 0; i < kh; i++) {
                int y = oh * sh - ph + i * dh;
                if (y < 0 || y >= H)
                    continue;
                const int32_t *line = plane + (long)y * W;
                for (int j = 0; j < kw; j++) {
                    int32_t wv = w[c * Kp + 2 * (i * kw + j)];
                    int x0 = j * dw - pw;
                    /* the columns whose input x = ow sw + x0 lies in [0, W) */
                    int first = x0 >= 0 ? 0 : (-x0 + sw - 1) / sw;
                    int last = W - 1 - x0 < 0 ? -1 : (W - 1 - x0) / sw;
                    if (last > OW - 1)
                        last = OW - 1;
                    if (sw == 1)            /* contiguous: vectorized */
                        for (int ow = first; ow <= last; ow++)
                            a[ow] += wv * line[ow + x0];
                    else
                        for (int ow = first; ow <= last; ow++)
                            a[ow] += wv * line[ow * sw + x0];
                }
            }
            long idx = c * e->so + (long)oh * OW;
            int ow = 0;
#ifdef __AVX2__
            if (isa && e->sp == 1)
                for (; ow + I8_NR <= OW; ow += I8_NR)
                    i8_finish16_avx2(a + ow, (int)c, idx + ow, e);
#endif
            for (; ow < OW; ow++)
                e->out[idx + ow] = i8_finish(a[ow], (int)c, idx + ow, e);
        }
    }
    (void)P;
}

/* An inner product: x [M][K] floats in; b (Np / 16 x Kp / 2 x 16 int32) and c (threads x 6 x
 * 16 int32) scratch; e->out [M][N] (so 1, sp N). Weights w [N][Kp]. */
static void i8_inner_product(int isa, int threads, const float *x, int M, int K, int N, int Kp,
                             float scale, float lo, float hi, const int16_t *w, int32_t *b,
                             int32_t *c, const i8_epilogue *e)
{
    long Np = ((long)M + I8_NR - 1) / I8_NR * I8_NR, tiles = Np / I8_NR;
    long rows = (N + I8_MR - 1) / I8_MR;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long j = 0; j < Kp / 2; j++)
            i8_pack_items(x, M, K, Kp / 2, scale, lo, hi, (int)j, Np, b);
        int32_t *cc = c + (long)omp_get_thread_num() * I8_MR * I8_NR;
        /* split over row tiles too: at small batch there is one column tile */
        #pragma omp for schedule(static)
        for (long rt = 0; rt < rows * tiles; rt++) {
            long r = rt / tiles, t = rt % tiles;
            int m0 = (int)(r * I8_MR), R = N - m0 < I8_MR ? N - m0 : I8_MR;
            i8_column_tile(isa, R, Kp, w + (long)m0 * Kp, (const int16_t *)b, Np, t * I8_NR, M, m0,
                           cc, e);
        }
    }
}
#pragma GCC pop_options
#endif
