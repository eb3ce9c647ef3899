/* The AVX-512 VNNI path of the channels-last int8 convolution (int8_nhwc.h, isa I8_VNNI):
 * vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and adds each group of four products
 * into one of 16 int32 sums, with no intermediate saturation (|4 x 255 x 128| fits int16's
 * double), so the sums are the same integers as the int16-pair kernels' and the tops agree to
 * the bit with every other path.
 *
 * Layouts: a pixel's quantized channels are bytes in quads, q[pixel][4 Jq] (Jq = ceil(C / 4),
 * zeros past C), and the weights' column tiles w[O16 / 16][taps Jq][16][4] (int8): for one quad
 * of k, the 16 output channels' four weights are one 64-byte vector, the pair layout's bytes
 * with quads for pairs. A register tile is 6 pixels by up to 4 column tiles (24 sums).
 *
 * vpdpbusd's first factor is unsigned: an unsigned (u8) input is stored as it is; a signed one
 * (s8, Intel's is_negative_input) is stored plus 128 (the zero point), every value a pixel
 * outside the image reads holds 128 too, and each output's sum then carries 128 times its
 * weights' sum, taken out again with the bias (i8v_shifted_bias). The functions here are only
 * called when the CPU has AVX-512 F, BW, VL and VNNI (i8_isa_available). */
#ifndef CAFFEPY_INT8_VNNI_H
#define CAFFEPY_INT8_VNNI_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define I8_VNNI 2           /* the isa number of this path (int8_nhwc.h i8_isa_available) */
#define I8V_NT 4            /* column tiles of 16 per register tile */
#define I8V_ZERO_POINT 128  /* a signed input's offset */

static inline int i8v_zero_point(float lo)
{
    return lo < 0 ? I8V_ZERO_POINT : 0;
}

#ifdef __AVX2__
#define I8V_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* q[0 .. n) = the quantized x[0 .. n) plus zp, as bytes (i8_quantize's rounding and
 * saturation: max(v, lo) gives lo for a NaN, as there) */
I8V_TARGET static void i8v_quantize_run(const float *x, long n, float scale, float lo, float hi,
                                        int zp, uint8_t *q)
{
    long i = 0;
    const __m512 s = _mm512_set1_ps(scale), l = _mm512_set1_ps(lo), h = _mm512_set1_ps(hi);
    const __m512i z = _mm512_set1_epi32(zp);
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(
            _mm512_mul_ps(_mm512_loadu_ps(x + i), s), l), h));
        /* 0 .. 255 after the offset: vpmovdb's truncation keeps it */
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, z)));
    }
    for (; i < n; i++)
        q[i] = (uint8_t)(i8_quantize(x[i], scale, lo, hi) + zp);
}

/* q[p][0 .. 4 Jq) = the quantized x[p][0 .. C) plus zp, zero past C; rows p in [p0, p1). */
static void i8v_quantize_rows(const float *x, long p0, long p1, int C, float scale, float lo,
                              float hi, int zp, uint8_t *q)
{
    int C4 = 4 * ((C + 3) / 4);
    if (C == C4) {
        i8v_quantize_run(x + p0 * C, (p1 - p0) * C, scale, lo, hi, zp, q + p0 * C);
        return;
    }
    for (long p = p0; p < p1; p++) {
        i8v_quantize_run(x + p * C, C, scale, lo, hi, zp, q + p * C4);
        memset(q + p * C4 + C, 0, (size_t)(C4 - C));
    }
}

/* c[r][16 i .. 16 i + 16) = sum over taps t and quads j < Jq of rows[t][r][j] . the quad j of
 * column tile i (w + i ws bytes), r < 6, i < nt. Inlined with a constant nt, its 6 nt sums
 * stay in registers. */
I8V_TARGET static inline __attribute__((always_inline)) void
i8v_tile_n(const int nt, int taps, int Jq, const int32_t *const *rows, const int8_t *w, long ws,
           int32_t *c)
{
    __m512i acc[6][I8V_NT];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
        for (int i = 0; i < nt; i++)
            acc[r][i] = _mm512_setzero_si512();
    for (int t = 0; t < taps; t++) {
        const int32_t *const *rt = rows + t * 6;
        const int32_t *a0 = rt[0], *a1 = rt[1], *a2 = rt[2], *a3 = rt[3], *a4 = rt[4], *a5 = rt[5];
        const int8_t *b = w + (long)t * Jq * 64;
        for (int j = 0; j < Jq; j++, b += 64) {
            __m512i bv[I8V_NT];
#pragma GCC unroll 4
            for (int i = 0; i < nt; i++)
                bv[i] = _mm512_loadu_si512((const void *)(b + i * ws));
            __m512i x;
#define I8V_ROW(r, a)                                                                       \
            x = _mm512_set1_epi32(a[j]);                                                    \
            _Pragma("GCC unroll 4")                                                         \
            for (int i = 0; i < nt; i++)                                                    \
                acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], x, bv[i]);
            I8V_ROW(0, a0) I8V_ROW(1, a1) I8V_ROW(2, a2) I8V_ROW(3, a3) I8V_ROW(4, a4)
            I8V_ROW(5, a5)
#undef I8V_ROW
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
        for (int i = 0; i < nt; i++)
            _mm512_storeu_si512((void *)(c + r * 16 * I8V_NT + i * 16), acc[r][i]);
}

I8V_TARGET static void i8v_tile1(int taps, int Jq, const int32_t *const *rows, const int8_t *w,
                                 long ws, int32_t *c)
{
    i8v_tile_n(1, taps, Jq, rows, w, ws, c);
}
I8V_TARGET static void i8v_tile2(int taps, int Jq, const int32_t *const *rows, const int8_t *w,
                                 long ws, int32_t *c)
{
    i8v_tile_n(2, taps, Jq, rows, w, ws, c);
}
I8V_TARGET static void i8v_tile3(int taps, int Jq, const int32_t *const *rows, const int8_t *w,
                                 long ws, int32_t *c)
{
    i8v_tile_n(3, taps, Jq, rows, w, ws, c);
}
I8V_TARGET static void i8v_tile4(int taps, int Jq, const int32_t *const *rows, const int8_t *w,
                                 long ws, int32_t *c)
{
    i8v_tile_n(4, taps, Jq, rows, w, ws, c);
}

/* The register tile of nt (1 .. 4) column tiles; c [6][64] */
static inline void i8v_tile(int nt, int taps, int Jq, const int32_t *const *rows,
                            const int8_t *w, long ws, int32_t *c)
{
    switch (nt) {
    case 1: i8v_tile1(taps, Jq, rows, w, ws, c); break;
    case 2: i8v_tile2(taps, Jq, rows, w, ws, c); break;
    case 3: i8v_tile3(taps, Jq, rows, w, ws, c); break;
    default: i8v_tile4(taps, Jq, rows, w, ws, c); break;
    }
}
#endif

/* bias[o] - zp x (the sum of output o's weights), o < O, into out: the bias a shifted input's
 * sums need (w: the column tiles above, k quads per tile; bias NULL: zeros) */
static void i8v_shifted_bias(const int8_t *w, int O, long k, int zp, const int32_t *bias,
                             int32_t *out)
{
    for (int o = 0; o < O; o++) {
        const int8_t *col = w + (long)(o / 16) * k * 64 + (o % 16) * 4;
        int32_t sum = 0;
        for (long j = 0; j < k; j++)
            sum += col[j * 64] + col[j * 64 + 1] + col[j * 64 + 2] + col[j * 64 + 3];
        out[o] = (bias ? bias[o] : 0) - zp * sum;
    }
}

#endif
