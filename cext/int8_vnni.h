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

/* A run of values quantized into bytes plus zp (i8v_quantize_run, or AVX-VNNI's i8x_) */
typedef void (*i8v_run_fn)(const float *x, long n, float scale, float lo, float hi, int zp,
                           uint8_t *q);

/* q[p][0 .. 4 Jq) = the quantized x[p][0 .. C) plus zp, zero past C; rows p in [p0, p1), each
 * by `run` */
static void i8v_quantize_rows_by(i8v_run_fn run, const float *x, long p0, long p1, int C,
                                 float scale, float lo, float hi, int zp, uint8_t *q)
{
    int C4 = 4 * ((C + 3) / 4);
    if (C == C4) {
        run(x + p0 * C, (p1 - p0) * C, scale, lo, hi, zp, q + p0 * C);
        return;
    }
    for (long p = p0; p < p1; p++) {
        run(x + p * C, C, scale, lo, hi, zp, q + p * C4);
        memset(q + p * C4 + C, 0, (size_t)(C4 - C));
    }
}

static void i8v_quantize_rows(const float *x, long p0, long p1, int C, float scale, float lo,
                              float hi, int zp, uint8_t *q)
{
    i8v_quantize_rows_by(i8v_quantize_run, x, p0, p1, C, scale, lo, hi, zp, q);
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

/* Depthwise on bytes. vpdpbusd sums 4 byte products into a channel's int32 when the 4 bytes
 * are that channel's inputs under 4 taps of a kernel row: so each input row is rearranged once
 * into tap quads, t[g][ox][j][16][4] = the bytes under taps 4 j .. 4 j + 3 of the row for
 * output column ox, channels 16 g .. 16 g + 15 (the zero point where a tap falls outside the
 * image, as a staged tap reads it; anything past the kernel or past C, whose weights are
 * zero; a group's columns in a run, as the sums read them), and every output row that reads
 * the input row sums from it: kh J vpdpbusd per 16 channels of an output pixel (J = ceil(kw /
 * 4)), where float32 took kh kw multiply-adds on four times the bytes. MobileNet's depthwise
 * layers at b16: 1.5-2x (conv3_1/dw 4.2 -> 2.2 ms, conv2_1/dw 3.7 -> 2.5). */

/* bytes of one input row's tap quads */
static inline long i8v_dw_quad_row(int OW, int C, int kw)
{
    return (long)OW * ((C + 15) / 16) * ((kw + 3) / 4) * 64;
}

/* i8v_dw_quads' vpshufb indices, one vector a tap k < 4: byte 4 c + k of lane L takes
 * channel 4 L + c of the tap's 16 (the others zero) */
static void i8v_dw_picks(uint8_t pick[4][64])
{
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 64; b++)
            pick[k][b] = b % 4 == k ? (uint8_t)(b / 16 * 4 + b % 16 / 4) : 0x80;
}

/* p[k] = the pixel of row `in` (W pixels of rb bytes) under tap 4 j + k of an output column
 * whose window starts at x0, or the zero points zps where the tap is outside the image or past
 * the kernel */
static inline void i8v_dw_taps(const uint8_t *in, int W, long rb, int kw, int dw, int x0, int j,
                               const uint8_t *zps, const uint8_t *p[4])
{
    for (int k = 0; k < 4; k++) {
        int kx = 4 * j + k, x = x0 + kx * dw;
        p[k] = kx < kw && x >= 0 && x < W ? in + x * rb : zps;
    }
}

/* The tap quads of one input row: `in` its W pixels, rb bytes apart, then 16 bytes of slack;
 * zps rb + 16 bytes of zero points; picks from i8v_dw_picks. Each tap's 16 bytes are broadcast
 * to the 4 lanes of a vector and vpshufb moves lane L's channels 4 L .. 4 L + 3 to their
 * places in the quads (no lane crossing, so AVX512BW alone does it). */
I8V_TARGET static void i8v_dw_quads(const uint8_t *in, int W, int C, long rb, int kw, int pw,
                                    int sw, int dw, int OW, const uint8_t *zps,
                                    const uint8_t (*picks)[64], uint8_t *t)
{
    int G = (C + 15) / 16, J = (kw + 3) / 4;
    __m512i pick[4];
    for (int k = 0; k < 4; k++)
        pick[k] = _mm512_loadu_si512((const void *)picks[k]);
    for (int ox = 0; ox < OW; ox++) {
        int x0 = ox * sw - pw;
        for (int j = 0; j < J; j++) {
            const uint8_t *p[4];        /* the pixels under taps 4 j .. 4 j + 3 */
            i8v_dw_taps(in, W, rb, kw, dw, x0, j, zps, p);
            uint8_t *tj = t + ((long)ox * J + j) * 64;
            for (int g = 0; g < G; g++, tj += (long)OW * J * 64) {
                __m512i q = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    q = _mm512_or_si512(q, _mm512_shuffle_epi8(_mm512_broadcast_i32x4(
                        _mm_loadu_si128((const __m128i *)(p[k] + 16 * g))), pick[k]));
                _mm512_storeu_si512((void *)tj, q);
            }
        }
    }
}

/* i8v_dw_row for kernels at most 4 taps wide (one quad a kernel row) and nr kernel rows
 * inside the image, nr a constant when inlined: the weights stay in registers, and 8 pixels'
 * chains of vpdpbusd run at once */
I8V_TARGET static inline __attribute__((always_inline)) void
i8v_dw_row_quad(const int nr, const uint8_t *const *rows, const int *ky, int OW, int C,
                const int8_t *w, const int32_t *base, int32_t *acc)
{
    int G = (C + 15) / 16;
    const long step = 64;
    for (int g = 0; g < G; g++) {
        int left = C - 16 * g;
        __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512i b = _mm512_maskz_loadu_epi32(m, base + 16 * g), wv[4];
        const uint8_t *q[4];
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            wv[i] = _mm512_loadu_si512((const void *)(w + ((long)ky[i] * G + g) * 64));
            q[i] = rows[i] + (long)g * OW * 64;
        }
        int32_t *out = acc + 16 * g;
        int ox = 0;
        for (; ox + 8 <= OW; ox += 8) {
            __m512i a[8];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++)
                a[u] = b;
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++)
#pragma GCC unroll 8
                for (int u = 0; u < 8; u++)
                    a[u] = _mm512_dpbusd_epi32(a[u], _mm512_loadu_si512(
                        (const void *)(q[i] + (ox + u) * step)), wv[i]);
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++)
                _mm512_mask_storeu_epi32(out + (long)(ox + u) * C, m, a[u]);
        }
        for (; ox < OW; ox++) {
            __m512i a = b;
#pragma GCC unroll 4
            for (int i = 0; i < nr; i++)
                a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512((const void *)(q[i] + ox * step)),
                                        wv[i]);
            _mm512_mask_storeu_epi32(out + (long)ox * C, m, a);
        }
    }
}

/* acc[ox][c] (c < C, ox < OW) = base[c] + the sums of the kernel rows whose input rows are
 * inside the image: rows[i] the tap quads of kernel row ky[i], i < n; w [kh][G][J][64] the
 * weights as quads. A kernel row outside the image reads zero points only: the same sum for
 * every pixel, which base holds. */
I8V_TARGET static void i8v_dw_row(const uint8_t *const *rows, const int *ky, int n, int OW,
                                  int C, int kw, const int8_t *w, const int32_t *base,
                                  int32_t *acc)
{
    int G = (C + 15) / 16, J = (kw + 3) / 4;
    if (J == 1 && n <= 4) {
        switch (n) {
        case 0: i8v_dw_row_quad(0, rows, ky, OW, C, w, base, acc); return;
        case 1: i8v_dw_row_quad(1, rows, ky, OW, C, w, base, acc); return;
        case 2: i8v_dw_row_quad(2, rows, ky, OW, C, w, base, acc); return;
        case 3: i8v_dw_row_quad(3, rows, ky, OW, C, w, base, acc); return;
        default: i8v_dw_row_quad(4, rows, ky, OW, C, w, base, acc); return;
        }
    }
    long step = (long)J * 64;     /* one output column's quads */
    for (int g = 0; g < G; g++) {
        int left = C - 16 * g;
        __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512i b = _mm512_maskz_loadu_epi32(m, base + 16 * g);
        for (int ox = 0; ox < OW; ox++) {
            __m512i a0 = b;
            for (int i = 0; i < n; i++) {
                const uint8_t *q = rows[i] + ((long)g * OW + ox) * step;
                const int8_t *wr = w + ((long)ky[i] * G + g) * J * 64;
                for (int j = 0; j < J; j++, q += 64, wr += 64)
                    a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512((const void *)q),
                                             _mm512_loadu_si512((const void *)wr));
            }
            _mm512_mask_storeu_epi32(acc + (long)ox * C + 16 * g, m, a0);
        }
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
