/* Intel Caffe's int8 convolution on channels-last blobs (the fast path's layout): the same
 * integers and the same float32 epilogue as int8_gemm.h, so both layouts agree to the bit.
 *
 * An implicit GEMM with the output pixels as rows and the output channels as columns: the
 * activations are quantized once into q[pixel][2 Cp] int16 (a pixel's channels, padded to an
 * even count, so a pair of channels is one int32), and each of a tile's 6 pixel rows reads, for
 * each kernel tap, the pixel under that tap in place (a row of zeros outside the image): no
 * im2col, and a 1x1 convolution reads its input as it lies. The weights are packed once into
 * column tiles of 16 output channels, w[O16 / 16][taps * Cp][16][2] (pairs k = (tap, channel
 * pair), as conv_weights orders them), so a tile's pairs for one k are one 64-byte line.
 * Products: vpmaddwd on int16 pairs into int32 (see int8_gemm.h: no int16 saturation). The
 * output's 16 columns are contiguous channels of one pixel: the epilogue's per-channel bias
 * and multiplier are vector loads. On a CPU with AVX-512 VNNI or AMX-INT8 the same drivers run
 * bytes in quads of channels instead of int16 pairs (int8_vnni.h, int8_amx.h: the same
 * integers), and so does a CPU with AVX-VNNI alone for the products (int8_avxvnni.h);
 * i8_isa_available (below) says which path this CPU has.
 *
 * Depthwise (a group per channel): every product u8 x s8 is an integer of at most 2^15 in
 * magnitude and a pixel sums kh * kw of them, so below 512 taps each partial sum is an integer
 * under 2^24, which float32 holds exactly: the sums run as float multiply-adds on the
 * quantized values (exact, in any order) and give the int32 sums the integer kernels give. The
 * byte paths sum a depthwise convolution in integers instead (int8_vnni.h i8v_dw_row). */
#ifndef CAFFEPY_INT8_NHWC_H
#define CAFFEPY_INT8_NHWC_H
#include "int8_gemm.h"
#include "nhwc_dw_rows.h"
#include "int8_vnni.h"
#include "int8_avxvnni.h"
#include "int8_amx.h"

/* as int8_gemm.h: no fused multiply-add in the epilogue (its i8_finish and i8_finish8_avx2
 * are inlined here too) */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

#define I8N_MR 6
#define I8N_NR 16
#define I8N_BLOCK_BYTES (192 * 1024)    /* the weights of a block of column tiles: in L2 */

/* Whether the path is one of the AVX-512 byte paths (VNNI, AMX), whose depthwise convolution
 * and epilogue have AVX-512 kernels of their own (AVX-VNNI's are the AVX2 path's) */
static inline int i8n_avx512(int isa)
{
    return isa == I8_VNNI || isa == I8_AMX;
}

/* q[0 .. n) = the int16 quantized x[0 .. n) */
static void i8n_quantize_run(const float *x, long n, float scale, float lo, float hi, int16_t *q)
{
    long i = 0;
#ifdef __AVX2__
    const __m256 s = _mm256_set1_ps(scale), l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    for (; i + 16 <= n; i += 16) {
        __m256i a = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_mul_ps(_mm256_loadu_ps(x + i), s), l), h));
        __m256i b = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), s), l), h));
        /* values in [-128, 255]: packs does not saturate; it interleaves 128-bit lanes */
        _mm256_storeu_si256((__m256i *)(q + i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
    }
#endif
    for (; i < n; i++)
        q[i] = i8_quantize(x[i], scale, lo, hi);
}

/* q[p][0 .. 2 Cp) = the int16 quantized x[p][0 .. C), zero past C; rows p in [p0, p1). */
static void i8n_quantize_rows(const float *x, long p0, long p1, int C, float scale, float lo,
                              float hi, int16_t *q)
{
    int Cp2 = 2 * ((C + 1) / 2);
    if (C == Cp2) {                 /* one flat run */
        i8n_quantize_run(x + p0 * C, (p1 - p0) * C, scale, lo, hi, q + p0 * C);
        return;
    }
    for (long p = p0; p < p1; p++) {
        for (int c = 0; c < C; c++)
            q[p * Cp2 + c] = i8_quantize(x[p * C + c], scale, lo, hi);
        q[p * Cp2 + C] = 0;
    }
}

/* c[r][0 .. 16) = sum over taps t and pairs j < Cp of rows[t][r][j] . b(t Cp + j, 0 .. 16),
 * r < 6 (rows of the absent pixels of a last tile point at zeros). */
static void i8n_tile_c(int taps, int Cp, const int32_t *const *rows, const int16_t *b, int32_t *c)
{
    for (int n = 0; n < I8N_MR * I8N_NR; n++)
        c[n] = 0;
    for (int t = 0; t < taps; t++)
        for (int r = 0; r < I8N_MR; r++) {
            const int16_t *a = (const int16_t *)rows[t * I8N_MR + r];
            const int16_t *bt = b + (long)t * Cp * 32;
            for (int j = 0; j < Cp; j++)
                for (int n = 0; n < I8N_NR; n++)
                    c[r * I8N_NR + n] += (int32_t)a[2 * j] * bt[j * 32 + 2 * n]
                                         + (int32_t)a[2 * j + 1] * bt[j * 32 + 2 * n + 1];
        }
}

#ifdef __AVX2__
static void i8n_tile_avx2(int taps, int Cp, const int32_t *const *rows, const int16_t *b,
                          int32_t *c)
{
    I8_ACC6_INIT(c, 0)
    for (int t = 0; t < taps; t++) {
        I8_MADD_6X16(Cp, rows + t * I8N_MR, b + (long)t * Cp * 32);
    }
    I8_ACC6_STORE(c)
}
#endif

/* The 6 x 16 tile by the ISA's kernel (1 AVX2, 0 the portable C) */
static inline void i8n_tile(int isa, int taps, int Cp, const int32_t *const *rows,
                            const int16_t *b, int32_t *c)
{
#ifdef __AVX2__
    if (isa) {
        i8n_tile_avx2(taps, Cp, rows, b, c);
        return;
    }
#endif
    (void)isa;
    i8n_tile_c(taps, Cp, rows, b, c);
}

#ifdef __AVX2__
/* i8n_finish 16 outputs an instruction, for the byte paths (their CPUs have AVX-512): the
 * same operations in the same order as i8_level and i8_level8_avx2, so the same bits. The
 * epilogue was 39% of ResNet-50's int8 forward at b16 on AMX in 8-float vectors, 31% so.
 *
 * i8n_level16: 16 outputs from their sums at acc (channels o0 + k ..), masked by m, up to the
 * level the top takes: as int32 plus the zero point for a byte top (out8), else as floats
 * before 1 / scale_out. Its flags are constants where i8n_finish_avx512 instantiates it, so
 * a variant's loop has no tests in it (they and the masked stores were a quarter of the
 * epilogue's time). cvt_roundps_epi32 rounds to nearest even as i8_level's rint does, so a
 * byte top skips the separate rounding. */
#define I8N_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
I8V_TARGET static inline __attribute__((always_inline)) __m512i
i8n_level16(const i8_epilogue *le, const int32_t *acc, const float *sum, const uint8_t *sum8,
            int o0, int k, __mmask16 m, int bias, int relu, int quantize, int clamped, int out8,
            __m512 *level)
{
    __m512i a = _mm512_maskz_loadu_epi32(m, acc + k);
    if (bias)
        a = _mm512_add_epi32(a, _mm512_maskz_loadu_epi32(m, le->bias + o0 + k));
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_maskz_loadu_ps(m, le->mult + o0 + k));
    if (sum8) {
        __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, sum8 + k));
        __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(b, _mm512_set1_epi32(le->szp8))),
                                 _mm512_set1_ps(le->s_inv));
        y = _mm512_add_ps(y, _mm512_mul_ps(s, _mm512_set1_ps(le->sum_scale)));
    } else if (sum) {
        y = _mm512_add_ps(y, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sum + k),
                                           _mm512_set1_ps(le->sum_scale)));
    }
    if (relu)
        y = _mm512_mask_mul_ps(y, ~_mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ), y,
                               _mm512_set1_ps(le->slope));
    if (quantize)
        y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(le->lo)), _mm512_set1_ps(le->hi));
    if (out8)
        return _mm512_add_epi32(_mm512_cvt_roundps_epi32(y, I8N_NEAREST),
                                _mm512_set1_epi32(le->zp8));
    if (quantize) {
        y = _mm512_roundscale_ps(y, I8N_NEAREST);
        if (!clamped)
            y = _mm512_add_ps(y, _mm512_setzero_ps());      /* -0 to +0, as i8_level */
    }
    *level = y;
    return _mm512_setzero_si512();
}

/* i8n_finish_avx512's rows. A byte top's full runs of 64 channels are packed from four
 * vectors into one store (its values lie in [0, 255], which both packs keep: the same bytes as
 * vpmovusdb, whose masked store to memory was the epilogue's hottest instruction); the rest
 * goes 16 at a time, the last masked. */
I8V_TARGET static inline __attribute__((always_inline)) void
i8n_finish_rows(const int32_t *acc, long lda, long p0, int R, int o0, int n, int O,
                const i8_epilogue *le, int bias, int sum_kind, int relu, int quantize,
                int clamped, int out8)
{
    /* packus works within 128-bit lanes: lane i of the packed vector holds 4 bytes of each
     * source in turn; this puts source j's 16 bytes back in place j */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int r = 0; r < R; r++, acc += lda) {
        long p = p0 + r, idx = p * O + o0;
        const float *sum = sum_kind == 1 ? le->summand + idx : NULL;
        const uint8_t *sum8 = sum_kind == 2 ? le->summand8 + p * le->srow8 + o0 : NULL;
        uint8_t *o8 = out8 ? le->out8 + p * le->row8 + o0 : NULL;
        float *of = out8 ? NULL : le->out + idx;
        __m512 y;
        int k = 0;
        if (out8)
            for (; k + 64 <= n; k += 64) {
                __m512i v[4];
                for (int j = 0; j < 4; j++)
                    v[j] = i8n_level16(le, acc, sum, sum8, o0, k + 16 * j, (__mmask16)0xFFFF,
                                       bias, relu, quantize, clamped, 1, &y);
                __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(v[0], v[1]),
                                                _mm512_packus_epi32(v[2], v[3]));
                _mm512_storeu_si512(o8 + k, _mm512_permutexvar_epi32(order, b));
            }
        for (; k < n; k += 16) {
            __mmask16 m = n - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - k)) - 1);
            __m512i v = i8n_level16(le, acc, sum, sum8, o0, k, m, bias, relu, quantize, clamped,
                                    out8, &y);
            if (out8)
                _mm_mask_storeu_epi8(o8 + k, m, _mm512_cvtusepi32_epi8(v));
            else
                _mm512_mask_storeu_ps(of + k, m,
                                      _mm512_mul_ps(y, _mm512_set1_ps(le->inv_scale_out)));
        }
    }
}

I8V_TARGET __attribute__((noinline)) static void
i8n_finish_avx512(const int32_t *acc, long lda, long p0, int R, int o0, int n, int O,
                  const i8_epilogue *e)
{
    const i8_epilogue le = *e;
    /* (i8_level8_avx2 says why a clamp at 0 or above skips the ReLU and the -0 clearing) */
    int clamped = le.quantize && le.lo >= 0;
    int relu = le.relu && !(clamped && le.slope == 0);
    int sum_kind = le.summand8 ? 2 : le.summand ? 1 : 0, bias = le.bias != NULL;
    /* the byte tops (every int8 layer between int8 layers) by constant flags */
#define I8N_BYTES(B, S, RL) \
    i8n_finish_rows(acc, lda, p0, R, o0, n, O, &le, B, S, RL, 1, clamped, 1)
    if (le.out8 && le.quantize) {
        switch (bias * 6 + sum_kind * 2 + relu) {
        case 0: I8N_BYTES(0, 0, 0); return;
        case 1: I8N_BYTES(0, 0, 1); return;
        case 2: I8N_BYTES(0, 1, 0); return;
        case 3: I8N_BYTES(0, 1, 1); return;
        case 4: I8N_BYTES(0, 2, 0); return;
        case 5: I8N_BYTES(0, 2, 1); return;
        case 6: I8N_BYTES(1, 0, 0); return;
        case 7: I8N_BYTES(1, 0, 1); return;
        case 8: I8N_BYTES(1, 1, 0); return;
        case 9: I8N_BYTES(1, 1, 1); return;
        case 10: I8N_BYTES(1, 2, 0); return;
        default: I8N_BYTES(1, 2, 1); return;
        }
    }
#undef I8N_BYTES
    i8n_finish_rows(acc, lda, p0, R, o0, n, O, &le, bias, sum_kind, relu, le.quantize, clamped,
                    le.out8 != NULL);
}
#endif

/* The outputs of pixels p0 .. p0 + R, channels [o0, o0 + n), from their int32 sums (pixel
 * p0 + r's at acc + r lda): into e->out [P][O], or as bytes into e->out8 (8-bit tops only);
 * a summand from e->summand [P][O] or e->summand8. */
static inline void i8n_finish(int isa, const int32_t *acc, long lda, long p0, int R, int o0,
                              int n, int O, const i8_epilogue *e)
{
#ifdef __AVX2__
    if (i8n_avx512(isa)) {
        i8n_finish_avx512(acc, lda, p0, R, o0, n, O, e);
        return;
    }
#endif
    /* a copy the stores below cannot alias, so its fields stay in registers */
    const i8_epilogue le = *e;
    for (int r = 0; r < R; r++, acc += lda) {
        long p = p0 + r;
        long idx = p * O + o0;
        const float *sum = le.summand ? le.summand + idx : NULL;
        const uint8_t *sum8 = le.summand8 ? le.summand8 + p * le.srow8 + o0 : NULL;
        uint8_t *out8 = le.out8 ? le.out8 + p * le.row8 + o0 : NULL;
        float s[8];
        int k = 0;
    #ifdef __AVX2__
        if (isa)
            for (; k + 8 <= n; k += 8) {
                const float *sk = sum ? sum + k : NULL;
                if (sum8) {
                    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sum8 + k)));
                    b = _mm256_sub_epi32(b, _mm256_set1_epi32(le.szp8));
                    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_cvtepi32_ps(b),
                                                      _mm256_set1_ps(le.s_inv)));
                    sk = s;
                }
                __m256i bias = le.bias ? _mm256_loadu_si256((const __m256i *)(le.bias + o0 + k))
                                       : _mm256_setzero_si256();
                __m256 y = i8_level8_avx2(_mm256_loadu_si256((const __m256i *)(acc + k)), bias,
                                          _mm256_loadu_ps(le.mult + o0 + k), sk, &le);
                if (out8) {
                    __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(y), _mm256_set1_epi32(le.zp8));
                    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v),
                                                 _mm256_extracti128_si256(v, 1));
                    _mm_storel_epi64((__m128i *)(out8 + k), _mm_packus_epi16(w, w));
                } else {
                    _mm256_storeu_ps(le.out + idx + k,
                                     _mm256_mul_ps(y, _mm256_set1_ps(le.inv_scale_out)));
                }
            }
    #endif
        for (; k < n; k++) {
            float sv = sum8 ? (float)(sum8[k] - le.szp8) * le.s_inv : 0.0f;
            float y = i8_level(acc[k], o0 + k, sum8 ? &sv : sum ? sum + k : NULL, &le);
            if (out8)
                out8[k] = (uint8_t)((int)y + le.zp8);
            else
                le.out[idx + k] = y * le.inv_scale_out;
        }
    }
}

/* A 1 x 1 convolution without padding: output pixel p reads one input pixel, so the pixels
 * are quantized a chunk at a time, into a buffer of the thread's that stays in L2 while the
 * chunk's tiles read it, and only the pixels a stride keeps. Quantizing the whole input first
 * (i8n_conv's way, which a k x k kernel needs) wrote it out as int16 and read it back from
 * memory: at b16 56 x 56 x 256 that pass cost more than the products of 64 output channels. */
#define I8N_CHUNK_BYTES (96 * 1024)

/* output tiles per chunk of i8n_conv1x1 */
static long i8n_chunk(int C)
{
    long chunk = I8N_CHUNK_BYTES / ((long)(C + 1) / 2 * 4 * I8N_MR);
    return chunk < 1 ? 1 : chunk;
}

/* Few input channels (an odd count under 8: an image's grey or RGB): pairs of a pixel's
 * channels would spend an int16 in C + 1 on zeros, over taps one or two pairs long each. Such a
 * convolution (dilation 1 along the width) reads "wide" rows instead: the input quantized with
 * its padding columns as zeros, q[n][y][W + 2 pw][C] unpaired, so that the kw pixels under a
 * kernel row are kw C contiguous values, one tap of (kw C + 1) / 2 pairs (ResNet-50's conv1: 7
 * taps of 11 pairs instead of 49 of 2). A pair may start at an odd int16 (vpbroadcastd does not
 * need alignment), and an odd row's last pair takes the next value, weighted by the zero the
 * packed weights hold there. The weights: conv_weights' k = (kernel row, (kernel column,
 * channel) padded to even), packed by the pyx's nhwc_weights. */
static inline int i8n_wide(int C, int kw, int dw)
{
    return (C & 1) && C < 8 && kw > 1 && dw == 1;
}

/* int16 zeros after i8n_wide's rows: a tap's (kw C + 1) / 2 pairs for a row outside the image,
 * and the one value past the last row that its last window's last pair reads */
static inline long i8n_wide_zeros(int C, int kw)
{
    return (long)kw * C + 2;
}

/* The 256-bit byte paths (int8_avxvnni.h): AVX-VNNI, and AVX2 on bytes */
static inline int i8n_bytes256(int isa)
{
    return isa == I8_AVXVNNI || isa == I8_AVX2BYTES;
}

/* Whether the path holds quantized values as bytes (VNNI, AMX, the 256-bit ones) rather than
 * int16 */
static inline int i8n_bytes(int isa)
{
    return isa == I8_VNNI || isa == I8_AMX || i8n_bytes256(isa);
}

#ifdef __AVX2__
/* The quantization of a run of values into bytes on byte path isa: 8 lanes on the 256-bit
 * paths, else VNNI's 16 (the AMX path's CPUs have AVX-512 VNNI) */
static inline i8v_run_fn i8n_byte_run(int isa)
{
#ifdef I8X_BUILT
    if (isa == I8_AVXVNNI)
        return i8x_quantize_run;
#endif
    if (isa == I8_AVX2BYTES)
        return i8h_quantize_run;
    (void)isa;
    return i8v_quantize_run;
}
#endif

/* The 4-byte units of a pixel's n values (int16 pairs; quads of bytes on the byte paths) */
static inline int i8n_units(int isa, long n)
{
    return i8n_bytes(isa) ? (int)((n + 3) / 4) : (int)((n + 1) / 2);
}

/* Bytes of one thread's buffers on the AMX path: a block's rows of taps (i8a_quads bytes a
 * pixel), then its int32 sums for every output channel */
static long i8n_amx_scratch(int taps, int J, int O)
{
    return I8A_M * (i8a_quads(taps, J) * 4 + (long)(O + 31) / 32 * 32 * 4);
}

/* Bytes of the zero points after i8n_wide's rows on the AMX path: a tap outside the image
 * reads 64 of them, and the rows loaded in place (i8a_wide_rows) read up to I8A_M pixels (of
 * kw C bytes at most) and a chunk past the last row */
static inline long i8n_amx_wide_zeros(int C, int kw)
{
    return (long)(I8A_M + 1) * kw * C + 128;
}

/* Bytes of the AMX path's quantized pixels and what follows them, to a 64-byte boundary (each
 * thread's buffers start there): i8n_wide's rows and their zeros, or the pixels and I8A_M rows
 * of slack that a stride-1 1 x 1 convolution's direct row loads read past the last one
 * (i8n_amx_blocks), the first of them the zeros of a tap outside the image */
static long i8n_amx_pixels(int N, int H, int W, int C, int kw, int pw, int wide, int J)
{
    long bytes = wide ? (long)N * H * (W + 2 * pw) * C + i8n_amx_wide_zeros(C, kw)
                      : ((long)N * H * W + I8A_M) * 4 * J + 64;
    return (bytes + 63) / 64 * 64;
}

/* Bytes of a staged input (i8n_conv): its N H W pixels of C channels in quads, then the rows
 * of zero points that every byte path's taps outside the image and past the last pixel read */
static long i8n_staged_bytes(int N, int H, int W, int C)
{
    return i8n_amx_pixels(N, H, W, C, 1, 0, 0, (C + 3) / 4);
}

/* Bytes of i8n_conv's scratch q for `threads` threads: the int16 layout's, which the byte
 * paths' (one a value, quads for pairs) never exceed; the AMX path quantizes every pixel */
static long i8n_scratch(int isa, int N, int H, int W, int C, int O, int kh, int kw, int ph,
                        int pw, int dw, int threads)
{
    long row = 4 * (long)((C + 1) / 2);
    if (isa == I8_AMX) {    /* the quantized pixels and zeros, then each thread's buffers */
        int wide = i8n_wide(C, kw, dw);
        int J = i8n_units(isa, wide ? (long)kw * C : C), taps = wide ? kh : kh * kw;
        return i8n_amx_pixels(N, H, W, C, kw, pw, wide, J) + threads * i8n_amx_scratch(taps, J, O);
    }
    if (kh == 1 && kw == 1 && ph == 0 && pw == 0)
        return threads * (i8n_chunk(C) * I8N_MR + 1) * row;
    if (i8n_wide(C, kw, dw))    /* the rows, then zeros for a tap outside the image */
        return 2 * ((long)N * H * (W + 2 * pw) * C + i8n_wide_zeros(C, kw));
    return ((long)N * H * W + 1) * row;
}

/* q's rows p in [p0, p1) of n values each, quantized as the path stores them (rows of units,
 * zeros past C; the VNNI path's bytes plus zp) */
static inline void i8n_quantize_any(int isa, const float *x, long p0, long p1, int C,
                                    float scale, float lo, float hi, int zp, void *q)
{
#ifdef __AVX2__
    if (i8n_bytes(isa)) {
        i8v_quantize_rows_by(i8n_byte_run(isa), x, p0, p1, C, scale, lo, hi, zp, (uint8_t *)q);
        return;
    }
#endif
    (void)zp;
    i8n_quantize_rows(x, p0, p1, C, scale, lo, hi, (int16_t *)q);
}

/* c[r][64 i + n] (r < 6, n < 16) = the sums of column tiles t .. t + nt (nt: 4 at most on the
 * VNNI path, 1 on the others), each `tile` bytes of w; returns c's row stride */
static inline int i8n_tiles(int isa, int nt, int taps, int J, const int32_t *const *rows,
                            const void *w, long tile, int32_t *c)
{
#ifdef __AVX2__
    if (isa == I8_VNNI) {
        i8v_tile(nt, taps, J, rows, (const int8_t *)w, tile, c);
        return 16 * I8V_NT;
    }
#endif
#ifdef I8X_BUILT
    if (isa == I8_AVXVNNI) {
        i8x_tile(nt, taps, J, rows, (const int8_t *)w, tile, c);
        return 16 * I8V_NT;
    }
#endif
#ifdef __AVX2__
    if (isa == I8_AVX2BYTES) {
        i8h_tile(nt, taps, J, rows, (const int8_t *)w, tile, c);
        return 16 * I8V_NT;
    }
#endif
    (void)nt;
    (void)tile;
    i8n_tile(isa, taps, J, rows, (const int16_t *)w, c);
    return I8N_NR;
}

/* The epilogue of a VNNI path's shifted input (i8v_shifted_bias), into *shifted with its own
 * bias array (freed by the caller); e itself otherwise */
static const i8_epilogue *i8n_shift(int isa, int zp, const void *w, int O, long k,
                                    const i8_epilogue *e, i8_epilogue *shifted)
{
    if (!i8n_bytes(isa) || !zp)
        return e;
    int32_t *bias = (int32_t *)malloc(sizeof(int32_t) * (size_t)O);
    i8v_shifted_bias((const int8_t *)w, O, k, zp, e->bias, bias);
    *shifted = *e;
    shifted->bias = bias;
    return shifted;
}

/* The column tiles t0 .. t1 of rows' register tile m (R real rows), the epilogue's outputs
 * written */
static inline void i8n_columns(int isa, int taps, int J, const int32_t *const *rows,
                               const char *w, long tile, int t0, int t1, long m, int R, int O,
                               int32_t *c, const i8_epilogue *e)
{
    int step = isa == I8_VNNI || i8n_bytes256(isa) ? I8V_NT : 1;
    for (int t = t0; t < t1; t += step) {
        int nt = t1 - t < step ? t1 - t : step;
        int cs = i8n_tiles(isa, nt, taps, J, rows, w + (long)t * tile, tile, c);
        for (int i = 0; i < nt; i++) {
            int n = O - (t + i) * I8N_NR < I8N_NR ? O - (t + i) * I8N_NR : I8N_NR;
            i8n_finish(isa, c + i * 16, cs, m * I8N_MR, R, (t + i) * I8N_NR, n, O, e);
        }
    }
}

/* q: i8n_scratch's bytes (each thread's chunk, then a row of zeros); staged: the input's
 * pixels already quantized (i8n_conv), or NULL */
static void i8n_conv1x1(int isa, int threads, const float *x, int N, int H, int W, int C,
                        int O, int sh, int sw, int OH, int OW, float scale, float lo, float hi,
                        const void *w, char *q, const uint8_t *staged, const i8_epilogue *e)
{
    int J = i8n_units(isa, C), tilesO = (O + I8N_NR - 1) / I8N_NR;
    int zp = i8n_bytes(isa) ? i8v_zero_point(lo) : 0;     /* never AMX here (i8n_conv) */
    long M = (long)N * OH * OW, mt = (M + I8N_MR - 1) / I8N_MR;
    long row_bytes = (long)J * 4, tile = row_bytes * 16;
    i8_epilogue shifted;
    e = i8n_shift(isa, zp, w, O, J, e, &shifted);
    int block = (int)(I8N_BLOCK_BYTES / tile);
    block = block < 1 ? 1 : block;
    /* as many chunks for each thread (a 56 x 56 image in 5 chunks kept one thread busy for
     * 3 while the other did 2), each at most what the buffer holds */
    long room = i8n_chunk(C), chunks = (mt + room - 1) / room;
    chunks = (chunks + threads - 1) / threads * threads;
    long chunk = (mt + chunks - 1) / chunks;
    chunks = (mt + chunk - 1) / chunk;
    int contiguous = sh == 1 && sw == 1 && OH == H && OW == W;
    #pragma omp parallel num_threads(threads)
    {
        /* the chunk's rows, then one row for the absent pixels of a last tile (never stored) */
        char *buf = q + omp_get_thread_num() * (room * I8N_MR + 1) * row_bytes;
        const int32_t *zeros = (const int32_t *)(buf + chunk * I8N_MR * row_bytes);
        const int32_t *rows[I8N_MR];
        int32_t c[I8N_MR * 16 * I8V_NT];
        memset(buf + chunk * I8N_MR * row_bytes, 0, (size_t)row_bytes);
        #pragma omp for schedule(static)
        for (long k = 0; k < chunks; k++) {
            long m0 = k * chunk, m1 = m0 + chunk < mt ? m0 + chunk : mt;
            long p0 = m0 * I8N_MR, p1 = m1 * I8N_MR < M ? m1 * I8N_MR : M;
            if (!staged) {     /* else its rows are read where they lie */
                if (contiguous)
                    i8n_quantize_any(isa, x + p0 * C, 0, p1 - p0, C, scale, lo, hi, zp, buf);
                else
                    for (long p = p0; p < p1; p++) {
                        long n = p / ((long)OH * OW), rest = p % ((long)OH * OW);
                        long src = (n * H + rest / OW * sh) * W + rest % OW * sw;
                        i8n_quantize_any(isa, x + src * C, 0, 1, C, scale, lo, hi, zp,
                                         buf + (p - p0) * row_bytes);
                    }
            }
            for (int t0 = 0; t0 < tilesO; t0 += block) {
                int t1 = t0 + block < tilesO ? t0 + block : tilesO;
                for (long m = m0; m < m1; m++) {
                    for (int r = 0; r < I8N_MR; r++) {
                        long p = m * I8N_MR + r, src = p;
                        if (staged && !contiguous && p < M) {
                            long n = p / ((long)OH * OW), rest = p % ((long)OH * OW);
                            src = (n * H + rest / OW * sh) * W + rest % OW * sw;
                        }
                        rows[r] = p >= M ? zeros
                                  : staged ? (const int32_t *)(staged + src * row_bytes)
                                  : (const int32_t *)(buf + (p - p0) * row_bytes);
                    }
                    int R = M - m * I8N_MR < I8N_MR ? (int)(M - m * I8N_MR) : I8N_MR;
                    i8n_columns(isa, 1, J, rows, (const char *)w, tile, t0, t1, m, R, O, c, e);
                }
            }
        }
    }
    if (e == &shifted)
        free((void *)shifted.bias);
}

/* The paths the int8 kernels can run here, bit k for isa k: 0 the portable C (always), 1 AVX2,
 * 4 AVX-VNNI (the channels-last convolution's products: int8_avxvnni.h), 2 AVX-512 VNNI
 * (int8_vnni.h; the other kernels run AVX2 on these three), 3 AMX (int8_amx.h). The same
 * integers everywhere, the portable C slower; but 5, AVX2 on bytes (int8_avxvnni.h), which
 * runs weights quantized at half the scale and is never chosen by default. */
static int i8_isa_mask(void)
{
    int mask = 1;
#ifdef __AVX2__
    if (!__builtin_cpu_supports("avx2"))
        return mask;
    mask |= 1 << 1 | 1 << I8_AVX2BYTES;
#ifdef I8X_BUILT
    if (__builtin_cpu_supports("avxvnni"))
        mask |= 1 << I8_AVXVNNI;
#endif
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl")) {
        mask |= 1 << I8_VNNI;
        if (i8a_usable())
            mask |= 1 << I8_AMX;
    }
#endif
    return mask;
}

/* The best of them: AMX, AVX-512 VNNI, AVX-VNNI, AVX2, the portable C, the first there is */
static int i8_isa_available(void)
{
    static const int best_first[] = {I8_AMX, I8_VNNI, I8_AVXVNNI, 1};
    int mask = i8_isa_mask();
    for (int i = 0; i < 4; i++)
        if (mask & (1 << best_first[i]))
            return best_first[i];
    return 0;
}

/* Where a convolution's taps read q (i8n_conv's layout) */
typedef struct {
    const char *q, *zeros;
    long M;                     /* output pixels */
    int H, W, OH, OW, kh, kw, ph, pw, sh, sw, dh, dw;
    int wide, Wq, C, vb, pix;
} i8n_reads;

/* out[t * step] (t < taps) = the address of output pixel p's tap t in q (i8n_wide: of its
 * kernel row t), or of the zeros for a tap outside the image (or a pixel p >= M) */
static inline void i8n_taps(const i8n_reads *g, long p, const int32_t **out, int step)
{
    int n = (int)(p / ((long)g->OH * g->OW)), rest = (int)(p % ((long)g->OH * g->OW));
    int oh = rest / g->OW, ow = rest % g->OW;
    for (int i = 0; i < g->kh; i++) {
        int y = oh * g->sh - g->ph + i * g->dh;
        int inside = p < g->M && y >= 0 && y < g->H;
        if (g->wide) {      /* the kernel row's pixels from padded column ow sw */
            out[i * step] = (const int32_t *)(inside
                ? g->q + (((long)n * g->H + y) * g->Wq + (long)ow * g->sw) * g->C * g->vb
                : g->zeros);
            continue;
        }
        for (int j = 0; j < g->kw; j++) {
            int xx = ow * g->sw - g->pw + j * g->dw;
            out[(i * g->kw + j) * step] = (const int32_t *)(
                inside && xx >= 0 && xx < g->W
                ? g->q + (((long)n * g->H + y) * g->W + xx) * g->pix : g->zeros);
        }
    }
}

/* Block b of the AMX paths that take one output row's pixels a block (segs blocks a row):
 * its output row (n OH + oh), first column ow0 and R pixels */
static inline long i8n_segment(const i8n_reads *g, long b, long segs, int *n, int *oh,
                               int *ow0, int *R)
{
    long row = b / segs;
    *n = (int)(row / g->OH);
    *oh = (int)(row % g->OH);
    *ow0 = (int)(b % segs) * I8A_M;
    *R = g->OW - *ow0 < I8A_M ? g->OW - *ow0 : I8A_M;
    return row;
}

#ifdef __AVX2__
/* The AMX path for i8a_wide_rows: blocks of up to I8A_M output pixels of one output row, each
 * tap a chunk whose 2 x 16 rows are loaded where they lie (sw C bytes apart; a kernel row
 * outside the image reads one row of zero points, stride 0); pixels past the row's end are
 * summed and dropped. c: the sums of all output channels (i8n_amx_scratch holds them). */
I8A_TARGET static void i8n_amx_wide(const i8n_reads *g, int taps, int O, const int8_t *w,
                                    int32_t *c, const i8_epilogue *e)
{
    long kq = i8a_tile_quads(taps, 0, 1), ldc = (O + 31) / 32 * 32;
    long stride = (long)g->sw * g->C, segs = (g->OW + I8A_M - 1) / I8A_M;
    long blocks = g->M / g->OW * segs;
    int tiles = (O + 15) / 16;
    const uint8_t *a0[taps], *a1[taps];
    long lda[taps];
    i8a_begin();
    #pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++) {
        int n, oh, ow0, R;
        long row = i8n_segment(g, b, segs, &n, &oh, &ow0, &R);
        for (int t = 0; t < taps; t++) {
            int y = oh * g->sh - g->ph + t * g->dh;
            if (y >= 0 && y < g->H) {
                a0[t] = (const uint8_t *)g->q + (((long)n * g->H + y) * g->Wq + (long)ow0 * g->sw)
                        * g->C;
                a1[t] = a0[t] + 16 * stride;
                lda[t] = stride;
            } else {
                a0[t] = a1[t] = (const uint8_t *)g->zeros;
                lda[t] = 0;
            }
        }
        for (int t = 0; t < tiles; t += 2) {
            const int8_t *b0 = w + (long)t * kq * 64;
            i8a_tile_taps(a0, lda, a1, lda, taps, b0, t + 1 < tiles ? b0 + kq * 64 : NULL,
                          c + t * 16, ldc);
        }
        i8n_finish(I8_AMX, c, ldc, row * g->OW + ow0, R, 0, O, O, e);
    }
    i8a_end();
}

/* n bytes from src to dst, 64 a move (the last masked) */
I8A_TARGET static inline __attribute__((always_inline)) void
i8n_copy_bytes(uint8_t *dst, const uint8_t *src, long n)
{
    long i = 0;
    for (; i + 64 <= n; i += 64)
        _mm512_storeu_si512(dst + i, _mm512_loadu_si512(src + i));
    if (i < n) {
        __mmask64 m = ((__mmask64)1 << (n - i)) - 1;
        _mm512_mask_storeu_epi8(dst + i, m, _mm512_maskz_loadu_epi8(m, src + i));
    }
}

/* The rows of i8n_amx_blocks' block of pixels p0 .. p0 + R: pixel p0 + r's taps' bytes side
 * by side from a + r K4 (i8n_wide's layout: a tap is a kernel row of the padded rows), zeros
 * past them and in the rows past R. The pixel's place is stepped from p0's and each tap's
 * bytes moved inline: a division per pixel and a call of memcpy per tap were 38% of
 * ResNet-50's res2 3 x 3 layers at b16. */
I8A_TARGET static void i8n_amx_rows(const i8n_reads *g, long p0, int R, long bytes, long K4,
                                    uint8_t *a)
{
    long plane = (long)g->OH * g->OW;
    int n = (int)(p0 / plane), rest = (int)(p0 % plane), oh = rest / g->OW, ow = rest % g->OW;
    const uint8_t *zeros = (const uint8_t *)g->zeros;
    for (int r = 0; r < I8A_M; r++) {
        uint8_t *row = a + r * K4;
        long done = 0;
        if (r < R) {
            for (int i = 0; i < g->kh; i++) {
                int y = oh * g->sh - g->ph + i * g->dh;
                int inside = y >= 0 && y < g->H;
                if (g->wide) {      /* the kernel row's pixels from padded column ow sw */
                    i8n_copy_bytes(row + done, inside ? (const uint8_t *)g->q + (((long)n * g->H
                                   + y) * g->Wq + (long)ow * g->sw) * g->C * g->vb : zeros,
                                   bytes);
                    done += bytes;
                    continue;
                }
                const uint8_t *line = inside ? (const uint8_t *)g->q
                                               + ((long)n * g->H + y) * g->W * g->pix : zeros;
                for (int j = 0; j < g->kw; j++, done += bytes) {
                    int xx = ow * g->sw - g->pw + j * g->dw;
                    i8n_copy_bytes(row + done, inside && xx >= 0 && xx < g->W
                                   ? line + (long)xx * g->pix : zeros, bytes);
                }
            }
            if (++ow == g->OW) {
                ow = 0;
                if (++oh == g->OH) {
                    oh = 0;
                    n++;
                }
            }
        }
        for (; done < K4; done += 64) {
            __mmask64 m = K4 - done >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K4 - done)) - 1;
            _mm512_mask_storeu_epi8(row + done, m, _mm512_setzero_si512());
        }
    }
}

/* Whether i8n_amx_blocks loads the taps' rows in place (i8n_amx_taps): a kernel of several
 * taps, each one chunk (J = 16 quads: 64 channels), and output rows whose blocks of I8A_M
 * pixels waste at most 15% on the row's end (28-32, 56-64, 112-128 wide). Taps of two chunks
 * or more (128 channels: ResNet-50's res3 3 x 3 layers, 0.92-1.34x) and strided 1 x 1 layers
 * (its res3a_branch1, 0.68-0.87x) measured no faster than copied, each unit alone, old and
 * new kernels alternating, on a noisy machine; ResNet-50's res2 3 x 3 layers 1.14-1.85x. */
static inline int i8n_amx_in_place(const i8n_reads *g, int taps, int J)
{
    long slots = (g->OW + I8A_M - 1) / I8A_M * I8A_M;
    return !g->wide && taps > 1 && J == I8A_K && slots * 20 <= (long)g->OW * 23;
}

/* The AMX path without the block's rows copied: blocks of up to I8A_M output pixels of one
 * output row, each tap's chunks loaded where the input lies. Sixteen neighbouring output
 * pixels' tap is sixteen input pixels sw apart (a tile load of stride sw pix), unless some of
 * them fall in the padding left or right: that half's tap alone is copied into its place in
 * the block's rows (a, as i8n_amx_rows lays them out), zero points for the pixels outside. A
 * kernel row outside the image reads the zero points (stride 0). Pixels past the row's end are
 * summed and dropped. The block's rows of taps were copied for every pixel before: 30-40% of
 * a 3 x 3 layer of 64 channels at 56 x 56. */
I8A_TARGET static void i8n_amx_taps(const i8n_reads *g, int taps, int J, int O, const int8_t *w,
                                    char *buf, const i8_epilogue *e)
{
    long K4 = (long)taps * J * 4, bytes = (long)J * 4, ldc = (O + 31) / 32 * 32;
    long stride = (long)g->sw * g->pix, segs = (g->OW + I8A_M - 1) / I8A_M;
    long blocks = g->M / g->OW * segs;
    int per = J / I8A_K, chunks = taps * per, tiles = (O + 15) / 16;
    uint8_t *a = (uint8_t *)buf;
    int32_t *c = (int32_t *)(buf + I8A_M * K4);
    const uint8_t *q = (const uint8_t *)g->q, *zeros = (const uint8_t *)g->zeros;
    const uint8_t *a0[chunks], *a1[chunks];
    long l0[chunks], l1[chunks];
    i8a_begin();
    #pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++) {
        int n, oh, ow0, R;
        long row = i8n_segment(g, b, segs, &n, &oh, &ow0, &R);
        for (int h = 0; h < 2; h++) {
            const uint8_t **at = h ? a1 : a0;
            long *lt = h ? l1 : l0;
            int first = ow0 + 16 * h;          /* the half's first output column */
            for (int i = 0; i < g->kh; i++) {
                int y = oh * g->sh - g->ph + i * g->dh, inside = y >= 0 && y < g->H && 16 * h < R;
                const uint8_t *line = inside ? q + ((long)n * g->H + y) * g->W * g->pix : zeros;
                for (int j = 0; j < g->kw; j++) {
                    int t = i * g->kw + j, x0 = first * g->sw - g->pw + j * g->dw;
                    const uint8_t *p = zeros;
                    long l = 0;
                    if (inside) {
                        if (x0 >= 0 && x0 + 15 * g->sw < g->W) {
                            p = line + (long)x0 * g->pix;
                            l = stride;
                        } else {
                            uint8_t *rows = a + 16 * h * K4 + t * bytes;
                            for (int r = 0; r < 16; r++) {
                                int x = x0 + r * g->sw;
                                i8n_copy_bytes(rows + r * K4, first + r < g->OW && x >= 0
                                               && x < g->W ? line + (long)x * g->pix : zeros,
                                               bytes);
                            }
                            p = rows;
                            l = K4;
                        }
                    }
                    for (int k = 0; k < per; k++) {
                        at[t * per + k] = p + k * 64;
                        lt[t * per + k] = l;
                    }
                }
            }
        }
        for (int t = 0; t < tiles; t += 2) {
            const int8_t *b0 = w + (long)t * K4 * 16;
            i8a_tile_taps(a0, l0, a1, l1, chunks, b0, t + 1 < tiles ? b0 + K4 * 16 : NULL,
                          c + t * 16, ldc);
        }
        i8n_finish(I8_AMX, c, ldc, row * g->OW + ow0, R, 0, O, O, e);
    }
    i8a_end();
}

/* The AMX path's blocks of I8A_M output pixels (int8_amx.h), in this thread's share: each
 * block's taps copied into rows of K4 bytes (zeros past taps J quads), every pair of column
 * tiles of the weights (w: kq quads a tile) on the tiles, the sums of all output channels
 * kept, then the epilogue pixel by pixel: a pixel's summand and top are read and written in
 * one run (column tile by column tile, 32 pixels' rows at a time, they were the hot spot: a
 * stride of O floats between 32 streams). buf: i8n_amx_scratch's bytes. */
static void i8n_amx_blocks(const i8n_reads *g, int taps, int J, int O, const int8_t *w,
                           char *buf, const i8_epilogue *e)
{
    long kq = i8a_quads(taps, J), K4 = kq * 4, bytes = (long)J * 4, ldc = (O + 31) / 32 * 32;
    long blocks = (g->M + I8A_M - 1) / I8A_M;
    int tiles = (O + 15) / 16;
    uint8_t *a = (uint8_t *)buf;
    int32_t *c = (int32_t *)(buf + I8A_M * K4);
    /* a 1 x 1 convolution of stride 1 reads its pixels' rows where they lie in q (a last
     * chunk reads into the next row, times the zero weights past J; q has i8n_scratch's slack
     * past its last row) */
    int direct = taps == 1 && !g->wide && g->sh == 1 && g->sw == 1 && g->OH == g->H
                 && g->OW == g->W;
    if (i8a_wide_rows(g->wide, J, g->sw, g->kw)) {
        i8n_amx_wide(g, taps, O, w, (int32_t *)buf, e);
        return;
    }
    if (!direct && i8n_amx_in_place(g, taps, J)) {
        i8n_amx_taps(g, taps, J, O, w, buf, e);
        return;
    }
    i8a_begin();
    #pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++) {
        long p0 = b * I8A_M;
        int R = g->M - p0 < I8A_M ? (int)(g->M - p0) : I8A_M;
        const uint8_t *rows_a = a;      /* the block's rows, lda bytes apart */
        long lda = K4;
        if (direct) {
            rows_a = (const uint8_t *)g->q + p0 * bytes;
            lda = bytes;
        } else {
            i8n_amx_rows(g, p0, R, bytes, K4, a);
        }
        for (int t = 0; t < tiles; t += 2) {
            const int8_t *b0 = w + (long)t * kq * 64;
            i8a_tile(rows_a, lda, K4 / 64, b0, t + 1 < tiles ? b0 + kq * 64 : NULL, c + t * 16,
                     ldc);
        }
        i8n_finish(I8_AMX, c, ldc, p0, R, 0, O, O, e);
    }
    i8a_end();
}
#endif

/* N images x[N][H][W][C] (floats) -> e->out [N][OH][OW][O]; weights w packed as above
 * (taps = kh kw of J units: ceil(C / 2) pairs, or on the VNNI and AMX paths ceil(C / 4)
 * quads; or i8n_wide's kh taps); q scratch of i8n_scratch's bytes: the quantized pixels, then
 * one pixel of zeros (of zero points) for the taps outside the image, or i8n_wide's rows, or
 * i8n_conv1x1's chunks (not on the AMX path). One OpenMP region.
 * staged (the byte paths, not i8n_wide): the pixels already quantized by the layer before (its
 * 8-bit top as bytes: i8n_staged_bytes, the zero points after them), x then unread. */
static void i8n_conv(int isa, int threads, const float *x, int N, int H, int W, int C, int O,
                     int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH,
                     int OW, float scale, float lo, float hi, const void *w, void *qv,
                     const uint8_t *staged, const i8_epilogue *e)
{
    char *q = (char *)qv;
    int amx = isa == I8_AMX;
    if (kh == 1 && kw == 1 && ph == 0 && pw == 0 && !amx) {
        i8n_conv1x1(isa, threads, x, N, H, W, C, O, sh, sw, OH, OW, scale, lo, hi, w, q, staged,
                    e);
        return;
    }
    int bytes = i8n_bytes(isa);
    int wide = i8n_wide(C, kw, dw), vb = bytes ? 1 : 2;
    int zp = bytes ? i8v_zero_point(lo) : 0;
    /* a tap: its units J, and the bytes of an input pixel in q (pixels of padded rows) */
    int J = i8n_units(isa, wide ? (long)kw * C : C), pix = wide ? C * vb : 4 * J;
    int Wq = wide ? W + 2 * pw : W, taps = wide ? kh : kh * kw;
    int tilesO = (O + I8N_NR - 1) / I8N_NR;
    long M = (long)N * OH * OW, mt = (M + I8N_MR - 1) / I8N_MR;
    long tile = (long)taps * J * 64;
    i8_epilogue shifted;
    long quads = amx ? i8a_tile_quads(taps, J, i8a_wide_rows(wide, J, sw, kw)) : (long)taps * J;
    e = i8n_shift(isa, zp, w, O, quads, e, &shifted);
    int block = (int)(I8N_BLOCK_BYTES / tile);
    block = block < 1 ? 1 : block;
    long qbytes = (long)N * H * Wq * pix;
    /* (wide: the byte paths' last quad may read 3 bytes past a row) */
    long zbytes = !wide ? pix : amx ? i8n_amx_wide_zeros(C, kw)
                  : vb == 1 ? (long)kw * C + 4 : 2 * i8n_wide_zeros(C, kw);
    const char *pixels = staged ? (const char *)staged : q;
    i8n_reads g = {pixels, pixels + qbytes, M, H, W, OH, OW, kh, kw, ph, pw, sh, sw, dh, dw,
                   wide, Wq, C, vb, pix};
    /* the AMX path's buffers: after the pixels, or all of q when they are staged */
    char *amx_buf = staged ? q : q + i8n_amx_pixels(N, H, W, C, kw, pw, wide, J);
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), me = omp_get_thread_num();
        if (staged) {
            /* nothing to quantize */
        } else if (wide) {
            long r0 = (long)N * H * me / nt, r1 = (long)N * H * (me + 1) / nt;
            long pad = (long)pw * C * vb;
            for (long r = r0; r < r1; r++) {
                char *qr = q + r * Wq * C * vb;
                memset(qr, zp, (size_t)pad);
#ifdef __AVX2__
                if (bytes)
                    i8n_byte_run(isa)(x + r * W * C, (long)W * C, scale, lo, hi, zp,
                                      (uint8_t *)qr + pad);
                else
#endif
                    i8n_quantize_run(x + r * W * C, (long)W * C, scale, lo, hi,
                                     (int16_t *)(qr + pad));
                memset(qr + pad + (long)W * C * vb, zp, (size_t)pad);
            }
        } else {
            long p0 = (long)N * H * W * me / nt, p1 = (long)N * H * W * (me + 1) / nt;
            i8n_quantize_any(isa, x, p0, p1, C, scale, lo, hi, zp, q);
        }
        if (!staged) {
            #pragma omp single
            memset(q + qbytes, zp, (size_t)zbytes);
            /* implicit barrier */
        }
#ifdef __AVX2__
        if (amx) {
            i8n_amx_blocks(&g, taps, J, O, (const int8_t *)w,
                           amx_buf + me * i8n_amx_scratch(taps, J, O), e);
        } else
#endif
        {
            const int32_t *rows[taps * I8N_MR];
            int32_t c[I8N_MR * 16 * I8V_NT];
            for (int t0 = 0; t0 < tilesO; t0 += block) {
                int t1 = t0 + block < tilesO ? t0 + block : tilesO;
                #pragma omp for schedule(static) nowait
                for (long m = 0; m < mt; m++) {
                    for (int r = 0; r < I8N_MR; r++)
                        i8n_taps(&g, m * I8N_MR + r, rows + r, I8N_MR);
                    int R = M - m * I8N_MR < I8N_MR ? (int)(M - m * I8N_MR) : I8N_MR;
                    i8n_columns(isa, taps, J, rows, (const char *)w, tile, t0, t1, m, R, O, c,
                                e);
                }
            }
        }
    }
    if (e == &shifted)
        free((void *)shifted.bias);
}

#ifdef __AVX2__
/* out[0 .. row) = the bytewise maximum of the pixels of rows [hs, he) and columns [ws, we) of
 * the image at x (W pixels a row, `row` bytes a pixel) */
I8V_TARGET static void i8n_window_max_avx512(const uint8_t *x, int W, long row, int hs, int he,
                                             int ws, int we, uint8_t *out)
{
    for (long c = 0; c < row; c += 64) {
        __mmask64 m = row - c >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (row - c)) - 1;
        __m512i best = _mm512_setzero_si512();
        for (int h = hs; h < he; h++)
            for (int w = ws; w < we; w++)
                best = _mm512_max_epu8(best, _mm512_maskz_loadu_epi8(
                    m, x + ((long)h * W + w) * row + c));
        _mm512_mask_storeu_epi8(out + c, m, best);
    }
}
#endif

/* i8n_window_max_avx512 in portable C (AVX2 where the module is built for it: the loop over a
 * pixel's bytes vectorizes), for the AVX-VNNI path's CPUs */
static void i8n_window_max(const uint8_t *x, int W, long row, int hs, int he, int ws, int we,
                           uint8_t *restrict out)
{
    memset(out, 0, (size_t)row);
    for (int h = hs; h < he; h++)
        for (int w = ws; w < we; w++) {
            const uint8_t *restrict in = x + ((long)h * W + w) * row;
            for (long c = 0; c < row; c++)
                out[c] = in[c] > out[c] ? in[c] : out[c];
        }
}

/* Max pooling of an 8-bit channels-last top held as bytes (quantization.Bytes: pixels of
 * `row` bytes): a larger value has a larger byte (a signed top's bytes are its values plus
 * 128) and its float is the byte's times a positive scale, so the bytes of the pooled floats
 * are the pooled bytes. Caffe's windows: clipped to the image, the padding never a candidate
 * (a window holds at least one pixel). Rows of output images in parallel; each window by the
 * AVX-512 kernel where the CPU has it (avx512: the byte paths VNNI and AMX), else portably. */
static void i8n_pool_max(int avx512, int threads, const uint8_t *x, int N, int H, int W,
                         long row, int OH, int OW, int kh, int kw, int sh, int sw, int ph,
                         int pw, uint8_t *y)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long item = 0; item < (long)N * OH; item++) {
        int n = (int)(item / OH), oy = (int)(item % OH);
        int hs = oy * sh - ph, he = hs + kh < H ? hs + kh : H;
        hs = hs > 0 ? hs : 0;
        const uint8_t *image = x + (long)n * H * W * row;
        for (int ox = 0; ox < OW; ox++) {
            int ws = ox * sw - pw, we = ws + kw < W ? ws + kw : W;
            ws = ws > 0 ? ws : 0;
            uint8_t *out = y + (item * OW + ox) * row;
#ifdef __AVX2__
            if (avx512) {
                i8n_window_max_avx512(image, W, row, hs, he, ws, we, out);
                continue;
            }
#endif
            i8n_window_max(image, W, row, hs, he, ws, we, out);
        }
    }
    (void)avx512;
}

/* q[0 .. C) = the values of one pixel's bytes b (value plus zp) */
static inline void i8n_bytes_to_floats(const uint8_t *b, int C, int zp, float *q)
{
    int c = 0;
#ifdef __AVX2__
    const __m256i z = _mm256_set1_epi32(zp);
    for (; c + 8 <= C; c += 8)
        _mm256_storeu_ps(q + c, _mm256_cvtepi32_ps(_mm256_sub_epi32(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + c))), z)));
#endif
    for (; c < C; c++)
        q[c] = (float)(b[c] - zp);
}

/* out[p][c] = (b[p][c] - zp) * inv for P pixels of C channels (rows of `row` bytes): the
 * floats of an 8-bit top held as bytes, as its writer computes them */
static void i8n_fill_floats(int threads, const uint8_t *b, long P, long row, int C, int zp,
                            float inv, float *out)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < P; p++) {
        float *o = out + p * C;
        i8n_bytes_to_floats(b + p * row, C, zp, o);
        for (int c = 0; c < C; c++)
            o[c] *= inv;
    }
}

/* A concat of bytes along channels: P pixels' C bytes (rows of sr bytes) into channels
 * [offset, offset + C) of rows of dr bytes */
static void i8n_copy_channels(int threads, const uint8_t *src, long P, long sr, int C,
                              uint8_t *dst, long dr, int offset)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < P; p++)
        memcpy(dst + p * dr + offset, src + p * sr, (size_t)C);
}

/* Winograd F(2x2, 3x3) on integers, stride 1, dilation 1: with B^T = [1 0 -1 0; 0 1 1 0;
 * 0 -1 1 0; 0 1 0 -1], G' = 2 G = [2 0 0; 1 1 1; 1 -1 1; 0 0 2] and A^T = [1 1 1 0; 0 1 -1 -1]
 * every transform is integer, and a 2 x 2 output tile's sums are
 *     4 acc = A^T [ sum over channels (G' g G'^T) . (B^T d B) ] A
 * exactly: V = B^T d B is at most 4 * 255 in magnitude (int16), U' = G' g G'^T at most 9 * 128
 * (int16, computed once by winograd_nhwc_weights), their pair products are vpmaddwd's, and the
 * sums may wrap in int32 on the way (addition modulo 2^32 keeps the result) as long as 4 acc
 * itself fits: below 2^29 per |acc|, i.e. fewer than I8W_MAX_C input channels (the caller's
 * check). acc = 4 acc >> 2 is then the direct kernel's int32 to the bit, and the epilogue is
 * i8n_finish: both paths' tops agree bit for bit. 16 products per channel pair and output per
 * 2 x 2 tile instead of 36.
 *
 * Tiles (n, th, tw) in row-major order over [N][ceil(OH / 2)][ceil(OW / 2)], in blocks of T
 * (a multiple of 6, the register tile's rows) per thread: V of a block [16][T][2 Cp] int16,
 * then per column tile of 16 output channels the 16 products' sums M [16][T][16] (the
 * channels-last register tile i8n_tile_* with one tap), then A^T M A and the epilogue. */
#define I8W_MAX_C 1792

/* V[xi][r][0 .. C2) of tiles t0 + r, r < T, from the quantized q (rows of C2 int16; zeros: a
 * row of zeros for the pixels outside the image and the tiles past the last). */
static void i8w_input(const int16_t *q, const int16_t *zeros, int H, int W, int C2, int ph,
                      int pw, int TH, int TW, long ntiles, long t0, int T, int16_t *V)
{
    for (int r = 0; r < T; r++) {
        long t = t0 + r;
        const int16_t *d[16];
        long n = t / ((long)TH * TW);
        int rest = (int)(t % ((long)TH * TW)), th = rest / TW, tw = rest % TW;
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) {
                int y = 2 * th - ph + i, x = 2 * tw - pw + j;
                d[i * 4 + j] = (t < ntiles && y >= 0 && y < H && x >= 0 && x < W)
                               ? q + ((n * H + y) * W + x) * C2 : zeros;
            }
        int16_t *v = V + (long)r * C2;
        long xs = (long)T * C2;     /* from one of the 16 products to the next */
        int c = 0;
#ifdef __AVX2__
        for (; c + 16 <= C2; c += 16) {
            __m256i m[16], u[16];
            for (int k = 0; k < 16; k++)
                m[k] = _mm256_loadu_si256((const __m256i *)(d[k] + c));
            for (int j = 0; j < 4; j++) {       /* B^T d, column by column */
                u[j] = _mm256_sub_epi16(m[j], m[8 + j]);
                u[4 + j] = _mm256_add_epi16(m[4 + j], m[8 + j]);
                u[8 + j] = _mm256_sub_epi16(m[8 + j], m[4 + j]);
                u[12 + j] = _mm256_sub_epi16(m[4 + j], m[12 + j]);
            }
            for (int i = 0; i < 4; i++) {       /* (B^T d) B, row by row */
                __m256i *ui = u + 4 * i;
                _mm256_storeu_si256((__m256i *)(v + (4 * i) * xs + c), _mm256_sub_epi16(ui[0], ui[2]));
                _mm256_storeu_si256((__m256i *)(v + (4 * i + 1) * xs + c), _mm256_add_epi16(ui[1], ui[2]));
                _mm256_storeu_si256((__m256i *)(v + (4 * i + 2) * xs + c), _mm256_sub_epi16(ui[2], ui[1]));
                _mm256_storeu_si256((__m256i *)(v + (4 * i + 3) * xs + c), _mm256_sub_epi16(ui[1], ui[3]));
            }
        }
#endif
        for (; c < C2; c++) {
            int u[16];
            for (int j = 0; j < 4; j++) {
                u[j] = d[j][c] - d[8 + j][c];
                u[4 + j] = d[4 + j][c] + d[8 + j][c];
                u[8 + j] = d[8 + j][c] - d[4 + j][c];
                u[12 + j] = d[4 + j][c] - d[12 + j][c];
            }
            for (int i = 0; i < 4; i++) {
                v[(4 * i) * xs + c] = (int16_t)(u[4 * i] - u[4 * i + 2]);
                v[(4 * i + 1) * xs + c] = (int16_t)(u[4 * i + 1] + u[4 * i + 2]);
                v[(4 * i + 2) * xs + c] = (int16_t)(u[4 * i + 2] - u[4 * i + 1]);
                v[(4 * i + 3) * xs + c] = (int16_t)(u[4 * i + 1] - u[4 * i + 3]);
            }
        }
    }
}

/* y[k][0 .. 16) (pixel k = 2 i + j of the tile) = (A^T M A) >> 2 of one tile's M[xi] =
 * m + xi * ms (16 int32 each); unsigned arithmetic: the wrap is meant (see above). */
static void i8w_output(int isa, const int32_t *m, long ms, int32_t *y)
{
    int h = 0;
#ifdef __AVX2__
    if (isa)
        for (; h < 16; h += 8) {
            __m256i v[16], s[8];
            for (int k = 0; k < 16; k++)
                v[k] = _mm256_loadu_si256((const __m256i *)(m + k * ms + h));
            for (int b = 0; b < 4; b++) {       /* A^T M */
                s[b] = _mm256_add_epi32(_mm256_add_epi32(v[b], v[4 + b]), v[8 + b]);
                s[4 + b] = _mm256_sub_epi32(_mm256_sub_epi32(v[4 + b], v[8 + b]), v[12 + b]);
            }
            for (int i = 0; i < 2; i++) {       /* (A^T M) A */
                __m256i *si = s + 4 * i;
                __m256i y0 = _mm256_add_epi32(_mm256_add_epi32(si[0], si[1]), si[2]);
                __m256i y1 = _mm256_sub_epi32(_mm256_sub_epi32(si[1], si[2]), si[3]);
                _mm256_storeu_si256((__m256i *)(y + (2 * i) * 16 + h), _mm256_srai_epi32(y0, 2));
                _mm256_storeu_si256((__m256i *)(y + (2 * i + 1) * 16 + h), _mm256_srai_epi32(y1, 2));
            }
        }
#endif
    for (; h < 16; h++) {
        uint32_t v[16], s[8];
        for (int k = 0; k < 16; k++)
            v[k] = (uint32_t)m[k * ms + h];
        for (int b = 0; b < 4; b++) {
            s[b] = v[b] + v[4 + b] + v[8 + b];
            s[4 + b] = v[4 + b] - v[8 + b] - v[12 + b];
        }
        for (int i = 0; i < 2; i++) {
            /* 4 acc fits int32, so the conversion is exact and the shift a division by 4 */
            y[(2 * i) * 16 + h] = (int32_t)(s[4 * i] + s[4 * i + 1] + s[4 * i + 2]) >> 2;
            y[(2 * i + 1) * 16 + h] = (int32_t)(s[4 * i + 1] - s[4 * i + 2] - s[4 * i + 3]) >> 2;
        }
    }
}

/* The tiles of a block: T, a multiple of 6, whose V (16 T 2 Cp int16) stays within ~96 KiB. */
static int i8w_block(int Cp)
{
    int T = (int)(96 * 1024 / (64L * Cp)) / I8N_MR * I8N_MR;
    return T < I8N_MR ? I8N_MR : (T > 96 ? 96 : T);
}

/* x[N][H][W][C] -> e->out [N][OH][OW][O], a 3 x 3 convolution of stride 1 and dilation 1, C <
 * I8W_MAX_C; u the transformed weights [16][O16 / 16][Cp][16][2] (winograd_nhwc_weights);
 * q scratch as i8n_conv's, s scratch per thread of i8w_scratch(Cp) int32. One OpenMP region. */
static long i8w_scratch(int Cp)
{
    int T = i8w_block(Cp);
    return (long)16 * T * Cp + (long)16 * T * 16 + 4 * 16;
}

static void i8w_conv(int isa, int threads, const float *x, int N, int H, int W, int C, int O,
                     int ph, int pw, int OH, int OW, float scale, float lo, float hi,
                     const int16_t *u, int16_t *q, int32_t *scratch, const i8_epilogue *e)
{
    int Cp = (C + 1) / 2, C2 = 2 * Cp, tilesO = (O + I8N_NR - 1) / I8N_NR;
    int TH = (OH + 1) / 2, TW = (OW + 1) / 2, T = i8w_block(Cp);
    long pixels = (long)N * H * W, ntiles = (long)N * TH * TW, blocks = (ntiles + T - 1) / T;
    const int16_t *zeros = q + pixels * C2;
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), me = omp_get_thread_num();
        long p0 = pixels * me / nt, p1 = pixels * (me + 1) / nt;
        i8n_quantize_rows(x, p0, p1, C, scale, lo, hi, q);
        #pragma omp single
        memset(q + pixels * C2, 0, (size_t)C2 * 2);
        /* implicit barrier */
        int32_t *s = scratch + (long)me * i8w_scratch(Cp);
        int16_t *V = (int16_t *)s;
        int32_t *M = s + (long)16 * T * Cp, *y = M + (long)16 * T * 16;
        const int32_t *rows[I8N_MR];
        #pragma omp for schedule(dynamic, 1)
        for (long blk = 0; blk < blocks; blk++) {
            long t0 = blk * T;
            int Tn = ntiles - t0 < T ? (int)(ntiles - t0) : T;
            int Tr = (Tn + I8N_MR - 1) / I8N_MR * I8N_MR;
            i8w_input(q, zeros, H, W, C2, ph, pw, TH, TW, ntiles, t0, Tr, V);
            for (int ot = 0; ot < tilesO; ot++) {
                for (int xi = 0; xi < 16; xi++) {
                    const int16_t *ux = u + ((long)xi * tilesO + ot) * Cp * 32;
                    for (int r6 = 0; r6 < Tr; r6 += I8N_MR) {
                        for (int r = 0; r < I8N_MR; r++)
                            rows[r] = (const int32_t *)(V + ((long)xi * Tr + r6 + r) * C2);
                        i8n_tile(isa, 1, Cp, rows, ux, M + ((long)xi * Tr + r6) * 16);
                    }
                }
                int n = O - ot * I8N_NR < I8N_NR ? O - ot * I8N_NR : I8N_NR;
                for (int r = 0; r < Tn; r++) {
                    long t = t0 + r, img = t / ((long)TH * TW);
                    int rest = (int)(t % ((long)TH * TW)), oh = 2 * (rest / TW), ow = 2 * (rest % TW);
                    i8w_output(isa, M + (long)r * 16, (long)Tr * 16, y);
                    for (int k = 0; k < 4; k++) {
                        int yy = oh + k / 2, xx = ow + k % 2;
                        if (yy < OH && xx < OW)
                            i8n_finish(isa, y + k * 16, 0, (img * OH + yy) * OW + xx, 1,
                                       ot * I8N_NR, n, O, e);
                    }
                }
            }
        }
    }
}

/* Depthwise: the input rows a band of output rows reads, quantized by the thread that sums
 * the band into a buffer of its own that stays in L2 (a whole image's quantized copy went to
 * L3, the whole batch's to memory and back: MobileNet b16's first depthwise layer ran at a
 * third of float32's speed). Rows that two neighbouring bands' windows both reach are quantized
 * by both. */
#define I8N_DW_BAND_BYTES (160 * 1024)

/* output rows per band */
static int i8n_dw_band(int W, int C, int kh, int sh, int dh, int OH)
{
    long row = (long)W * C * 4, span = (long)(kh - 1) * dh + 1;
    long band = (I8N_DW_BAND_BYTES / row - span) / sh + 1;
    return band < 1 ? 1 : band > OH ? OH : (int)band;
}

/* input rows of one band at most */
static long i8n_dw_rows(int H, int W, int C, int kh, int sh, int dh, int OH)
{
    long band = i8n_dw_band(W, C, kh, sh, dh, OH), span = (long)(kh - 1) * dh + 1;
    long rows = (band - 1) * sh + span;
    return rows < H ? rows : H;
}

/* Band `item` of the depthwise drivers (bands of `band` output rows, `bands` an image): its
 * image, output rows [oy0, oy1) and the input rows [r0, r1) they read, clipped to the image */
static inline long i8n_dw_item(long item, int bands, int band, int OH, int H, int kh, int sh,
                               int ph, int dh, int *oy0, int *oy1, int *r0, int *r1)
{
    *oy0 = (int)(item % bands) * band;
    *oy1 = *oy0 + band < OH ? *oy0 + band : OH;
    int lo = *oy0 * sh - ph, hi = (*oy1 - 1) * sh - ph + (kh - 1) * dh + 1;
    *r0 = lo < 0 ? 0 : lo;
    *r1 = hi > H ? H : hi;
    return item / bands;
}

/* bytes of one thread's scratch on the byte paths: the band's input rows as bytes (when they
 * are not staged), their tap quads (i8v_dw_quads), and an output row's base sums; to 64 */
static long i8n_dw_thread_bytes(int H, int W, int C, int kh, int kw, int sh, int dh, int OH,
                                int OW)
{
    long rows = i8n_dw_rows(H, W, C, kh, sh, dh, OH);
    long rb = (C + 3) / 4 * 4;      /* and zero points for taps outside, slack past both */
    long bytes = rows * ((long)W * rb + i8v_dw_quad_row(OW, C, kw)) + 4L * C + 2 * (rb + 64);
    return (bytes + 63) / 64 * 64;
}

/* floats of i8n_depthwise's scratch qf for `threads` threads */
static long i8n_dw_scratch(int isa, int H, int W, int C, int kh, int kw, int sh, int dh, int OH,
                           int OW, int threads)
{
    long floats = threads * i8n_dw_rows(H, W, C, kh, sh, dh, OH) * W * C;
    if (i8n_bytes(isa)) {   /* either path's: the byte path falls back to the float sums */
        long bytes = threads * i8n_dw_thread_bytes(H, W, C, kh, kw, sh, dh, OH, OW) + 64;
        return bytes / 4 + 1 > floats ? bytes / 4 + 1 : floats;
    }
    return floats;
}

#ifdef __AVX2__
/* The tap quads of one input row (i8v_dw_quads) on the byte path isa */
static inline void i8n_dw_quads(int isa, const uint8_t *in, int W, int C, long rb, int kw,
                                int pw, int sw, int dw, int OW, const uint8_t *zps,
                                const uint8_t (*picks)[64], uint8_t *t)
{
#ifdef I8X_BUILT
    if (isa == I8_AVXVNNI) {
        i8x_dw_quads(in, W, C, rb, kw, pw, sw, dw, OW, zps, picks, t);
        return;
    }
#endif
    if (isa == I8_AVX2BYTES) {
        i8h_dw_quads(in, W, C, rb, kw, pw, sw, dw, OW, zps, picks, t);
        return;
    }
    (void)isa;
    i8v_dw_quads(in, W, C, rb, kw, pw, sw, dw, OW, zps, picks, t);
}

/* An output row's depthwise sums (i8v_dw_row) on the byte path isa */
static inline void i8n_dw_row(int isa, const uint8_t *const *rows, const int *ky, int n, int OW,
                              int C, int kw, const int8_t *w, const int32_t *base, int32_t *acc)
{
#ifdef I8X_BUILT
    if (isa == I8_AVXVNNI) {
        i8x_dw_row(rows, ky, n, OW, C, kw, w, base, acc);
        return;
    }
#endif
    if (isa == I8_AVX2BYTES) {
        i8h_dw_row(rows, ky, n, OW, C, kw, w, base, acc);
        return;
    }
    (void)isa;
    i8v_dw_row(rows, ky, n, OW, C, kw, w, base, acc);
}

/* i8n_depthwise on the byte paths: the band's input rows as bytes (staged, or quantized here),
 * their tap quads, then each output row's sums (i8v_dw_row) and epilogue. Returns 0 where
 * memory for the packed weights is short (the caller then takes the float sums). */
static int i8n_depthwise_bytes(int isa, int threads, const float *x, int N, int H, int W, int C,
                               int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw,
                               int OH, int OW, float scale, float lo, float hi, const float *w,
                               void *scratch, int32_t *iaccs, const uint8_t *staged, int zp,
                               const i8_epilogue *e)
{
    int G = (C + 15) / 16, J = (kw + 3) / 4;
    long rb = (C + 3) / 4 * 4, line = (long)W * rb, quads = i8v_dw_quad_row(OW, C, kw);
    if (!staged)        /* quantized here: bytes as a staged input holds them */
        zp = i8v_zero_point(lo);
    /* the weights as quads [kh][G][J][16][4]; each kernel row's sums and base = -zp x the
     * sum of all taps (the zero points a shifted input adds) */
    int8_t *wq = (int8_t *)calloc((size_t)kh * G * J * 64, 1);
    int32_t *rowsum = (int32_t *)calloc((size_t)kh * C + C, sizeof(int32_t));
    if (!wq || !rowsum) {
        free(wq);
        free(rowsum);
        return 0;
    }
    int32_t *base = rowsum + (long)kh * C;
    for (int ky = 0; ky < kh; ky++)
        for (int kx = 0; kx < kw; kx++)
            for (int c = 0; c < C; c++) {
                int v = (int)w[(ky * kw + kx) * C + c];
                wq[(((long)ky * G + c / 16) * J + kx / 4) * 64 + (c % 16) * 4 + kx % 4] = (int8_t)v;
                rowsum[(long)ky * C + c] += v;
                base[c] -= zp * v;
            }
    uint8_t picks[4][64];
    i8v_dw_picks(picks);
    int band = i8n_dw_band(W, C, kh, sh, dh, OH), bands = (OH + band - 1) / band;
    long per_thread = i8n_dw_thread_bytes(H, W, C, kh, kw, sh, dh, OH, OW);
    uint8_t *first = (uint8_t *)(((uintptr_t)scratch + 63) / 64 * 64);
    #pragma omp parallel num_threads(threads)
    {
        int me = omp_get_thread_num();
        uint8_t *mine = first + me * per_thread;
        int32_t *iacc = iaccs + (long)me * OW * C;
        long rows_max = i8n_dw_rows(H, W, C, kh, sh, dh, OH);
        uint8_t *band_in = mine, *zps = mine + rows_max * line + 64;
        uint8_t *t = zps + (rb + 64) / 64 * 64;
        int32_t *row_base = (int32_t *)(t + rows_max * quads);
        memset(zps, zp, (size_t)rb + 16);
        #pragma omp for schedule(static)
        for (long item = 0; item < (long)N * bands; item++) {
            int oy0, oy1, r0, r1;
            long img = i8n_dw_item(item, bands, band, OH, H, kh, sh, ph, dh, &oy0, &oy1, &r0, &r1);
            const uint8_t *in;
            if (staged) {
                in = staged + (img * H + r0) * line;
            } else {
                i8n_quantize_any(isa, x + (img * H + r0) * W * (long)C, 0, (long)(r1 - r0) * W,
                                 C, scale, lo, hi, zp, band_in);
                in = band_in;
            }
            for (int r = r0; r < r1; r++)
                i8n_dw_quads(isa, in + (r - r0) * line, W, C, rb, kw, pw, sw, dw, OW, zps, picks,
                             t + (r - r0) * quads);
            for (int oy = oy0; oy < oy1; oy++) {
                const uint8_t *rows[64];
                int ky_in[64], n = 0, outside = 0;
                for (int ky = 0; ky < kh; ky++) {
                    int iy = oy * sh - ph + ky * dh;
                    if (iy >= 0 && iy < H) {
                        rows[n] = t + (iy - r0) * quads;
                        ky_in[n++] = ky;
                    } else {
                        outside = 1;
                    }
                }
                const int32_t *b = base;
                if (outside) {  /* a kernel row outside reads zero points: zp x its sum */
                    for (int c = 0; c < C; c++)
                        row_base[c] = base[c];
                    for (int ky = 0; ky < kh; ky++) {
                        int iy = oy * sh - ph + ky * dh;
                        if (iy < 0 || iy >= H)
                            for (int c = 0; c < C; c++)
                                row_base[c] += zp * rowsum[(long)ky * C + c];
                    }
                    b = row_base;
                }
                i8n_dw_row(isa, rows, ky_in, n, OW, C, kw, wq, b, iacc);
                i8n_finish(isa, iacc, C, (img * OH + oy) * OW, OW, 0, C, C, e);
            }
        }
    }
    free(wq);
    free(rowsum);
    return 1;
}
#endif

/* x[N][H][W][C] -> e->out [N][OH][OW][C]; w [kh kw][C] (the quantized weights as floats); qf
 * scratch of i8n_dw_scratch's floats; rows scratch threads x OW x C floats, iaccs as many
 * int32. The sums are the float depthwise kernel's (nhwc_dw_rows.h), exact below 512 taps (see
 * the top of this file). staged: the input's quantized values as bytes (i8n_conv's; their
 * zero point zp), x then unread. */
static void i8n_depthwise(int isa, int threads, const float *x, int N, int H, int W, int C,
                          int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH,
                          int OW, float scale, float lo, float hi, const float *w, float *qf,
                          float *rows, int32_t *iaccs, const uint8_t *staged, int zp,
                          const i8_epilogue *e)
{
#ifdef __AVX2__
    if (i8n_bytes(isa) && kh <= 64 &&
        i8n_depthwise_bytes(isa, threads, x, N, H, W, C, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW,
                            scale, lo, hi, w, qf, iaccs, staged, zp, e))
        return;
#endif
    long image = (long)H * W * C, line = (long)W * C;
    int band = i8n_dw_band(W, C, kh, sh, dh, OH), bands = (OH + band - 1) / band;
    long per_thread = i8n_dw_rows(H, W, C, kh, sh, dh, OH) * W * C;
    #pragma omp parallel num_threads(threads)
    {
        int me = omp_get_thread_num();
        float *q = qf + me * per_thread;
        float *row = rows + (long)me * OW * C;
        int32_t *iacc = iaccs + (long)me * OW * C;
        #pragma omp for schedule(static)
        for (long item = 0; item < (long)N * bands; item++) {
            int oy0, oy1, r0, r1;
            long img = i8n_dw_item(item, bands, band, OH, H, kh, sh, ph, dh, &oy0, &oy1, &r0, &r1);
            long i = 0, n = (long)(r1 - r0) * line;
            if (staged) {       /* the values from their bytes, pixel by pixel */
                long row = (C + 3) / 4 * 4;
                const uint8_t *bi = staged + (img * H * W + (long)r0 * W) * row;
                for (long p = 0; p < (long)(r1 - r0) * W; p++)
                    i8n_bytes_to_floats(bi + p * row, C, zp, q + p * C);
            } else {
                const float *xi = x + img * image + r0 * line;
#ifdef __AVX2__
                const __m256 s = _mm256_set1_ps(scale), l = _mm256_set1_ps(lo);
                const __m256 h = _mm256_set1_ps(hi);
                for (; i + 8 <= n; i += 8)
                    _mm256_storeu_ps(q + i, _mm256_round_ps(_mm256_min_ps(_mm256_max_ps(
                        _mm256_mul_ps(_mm256_loadu_ps(xi + i), s), l), h),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
                for (; i < n; i++)      /* fminf / fmaxf would be calls (their NaN rules) */
                    q[i] = (float)i8_quantize(xi[i], scale, lo, hi);
            }
            /* the image's rows as dw_gather_row indexes them: only [r0, r1) are read */
            const float *src = q - r0 * line;
            for (int oy = oy0; oy < oy1; oy++) {
                dw_gather_row(src, H, W, C, w, kh, kw, oy * sh - ph, dh, sw, -pw, dw, NULL, row,
                              OW, 0);
                /* the float sums are exact integers (see above) */
                for (long k = 0; k < (long)OW * C; k++)
                    iacc[k] = (int32_t)row[k];
                i8n_finish(isa, iacc, C, (img * OH + oy) * OW, OW, 0, C, C, e);
            }
        }
    }
}
#pragma GCC pop_options
#endif
