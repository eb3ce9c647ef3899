/* The channels-last bf16 convolution's forward on AMX tiles (a TEST net's Convolution under
 * -precision bf16: caffepy/layers/bf16.py, BF16NHWCConvolution). What bf16 means is
 * caffepy/precision.py's: operands rounded to bf16 (nearest, ties to even; a NaN stays a NaN;
 * subnormals to zero as the hardware reads them), products and sums in float32.
 *
 * The input x [N][H][W][C] is converted once into rows of G x Cp bf16 a pixel (each group's Cg
 * channels padded to even Cp with zeros: TDPBF16PS takes k in pairs; a 1 x 1 convolution without
 * padding converts each block's pixels straight into its rows instead). A group's weights and sums
 * are those of a convolution of its own (groups: AlexNet's). The weights are packed once per
 * weights version into column tiles of 16 output channels, each k = (tap, channel) over taps x Cp,
 * padded with zeros to whole chunks of 32 (bfn_k): a chunk of a column tile is an AMX B tile (16
 * pairs of k x 16 channels x 2 bf16 = 1 KiB) read as it lies. A block of 32 output pixels at a
 * time: each pixel's taps are copied into a row of K bf16, then each pair of column tiles runs
 * 2 x 2 sum tiles over the chunks (bf_tiles: tiles 0-3 the sums, 4-5 the A tiles, 6-7 the B tiles),
 * the sums of all output channels of the block are kept, and the epilogue (scale, bias, summand,
 * ReLU) writes them pixel by pixel. OpenMP over the blocks (dynamic: BFN_CONVERT); each thread
 * loads the tile configuration and releases the tiles.
 *
 * Call it only where the CPU has AMX-BF16 and amx_permitted() said yes (precision.kernel()). */
#ifndef CAFFEPY_BF16_NHWC_H
#define CAFFEPY_BF16_NHWC_H
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "bf16_gemm.h"

#define BFN_M 32                /* output pixels a block */
/* Pixels converted a task. The tasks (and the blocks) are taken dynamically: with a static
 * share, a thread that another process keeps off its core for a time slice held up the other
 * (GoogLeNet b1 ran 4x slower on two threads than on one while another build ran) */
#define BFN_CONVERT 256

/* What the forward writes: y[p * ldy + o] = sum * scale[o] (NULL: 1) + bias[o] (NULL: 0)
 * + add[p * O + o] (NULL: none), then max(., 0) if relu: the f32 channels-last convolution's
 * epilogue (cext/nhwc.pyx conv_forward) */
typedef struct {
    const float *scale, *bias, *add;
    float *y;
    long ldy;
    int relu;
} bfn_epilogue;

/* Where a convolution's taps read the converted pixels */
typedef struct {
    int N, H, W, C, Cp, O, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW, G;
} bfn_geom;

static inline int bfn_cp(int C) { return (C + 1) & ~1; }

/* k of a column tile: taps x Cp bf16 rounded up to whole chunks of 32 */
static inline long bfn_k(int taps, int Cp) { return ((long)taps * Cp + 31) / 32 * 32; }

/* uint16 values of one group's packed weights (Og outputs over Cg channels) */
static long bfn_packed_size(int Og, int Cg, int kh, int kw)
{
    return (long)(Og + 15) / 16 * 16 * bfn_k(kh * kw, bfn_cp(Cg));
}

/* the bf16 bits of x as the hardware's conversion gives them (bf_round: subnormals to zero) */
static inline uint16_t bfn_bits(float x)
{
    float r = bf_round(x);
    uint32_t u;
    memcpy(&u, &r, 4);
    return (uint16_t)(u >> 16);
}

/* Caffe's weights w [O][C][kh][kw] (C: a group's channels) into column tiles, group after group
 * (bfn_packed_size each): out[t][k / 2][o][k % 2] with k = tap * Cp + c, zeros past taps x Cp and
 * past the group's outputs */
static void bfn_pack_weights(const float *w, int O, int C, int kh, int kw, int G, uint16_t *out)
{
    int Cp = bfn_cp(C), taps = kh * kw, Og = O / G;
    long K = bfn_k(taps, Cp), tile = K * 16, each = bfn_packed_size(Og, C, kh, kw);
    memset(out, 0, sizeof(uint16_t) * (size_t)(each * G));
    for (int o = 0; o < O; o++) {
        uint16_t *col = out + (o / Og) * each + (o % Og / 16) * tile + (o % Og % 16) * 2;
        for (int c = 0; c < C; c++)
            for (int t = 0; t < taps; t++) {
                long k = (long)t * Cp + c;
                col[(k / 2) * 32 + (k & 1)] = bfn_bits(w[((long)o * C + c) * taps + t]);
            }
    }
}

/* the rows of the block's sums: all output channels, rounded up to a pair of column tiles */
static inline long bfn_ldc(int O) { return (long)(O + 31) / 32 * 32; }

/* Bytes of one thread's buffers: a block's rows of taps (a group's), then its sums */
static long bfn_thread_bytes(int C, int O, int kh, int kw, int G)
{
    return BFN_M * (bfn_k(kh * kw, bfn_cp(C / G)) * 2 + G * bfn_ldc(O / G) * 4) + 64;
}

/* Bytes of bfn_conv's scratch for `threads` threads: the converted pixels, a pixel of zeros,
 * each thread's buffers */
static long bfn_scratch_bytes(int N, int H, int W, int C, int O, int kh, int kw, int G,
                              int threads)
{
    long pixels = ((long)N * H * W + 1) * G * bfn_cp(C / G) * 2;
    return (pixels + 63) / 64 * 64 + (long)threads * bfn_thread_bytes(C, O, kh, kw, G) + 64;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

/* rows [p0, p1) of x (G groups of C floats each) into q (G groups of Cp bf16 each, a zero past
 * C) */
static void bfn_convert(const float *x, long p0, long p1, int C, int G, uint16_t *q)
{
    int Cp = bfn_cp(C);
    for (long p = p0; p < p1; p++)
        for (int gr = 0; gr < G; gr++) {
            const float *src = x + (p * G + gr) * C;
            uint16_t *dst = q + (p * G + gr) * Cp;
            for (int c = 0; c < Cp; c += 16)
                _mm256_mask_storeu_epi16(dst + c, bf_mask(Cp - c), bf_cvt16(src + c, C - c));
        }
}

/* n bf16 from src to dst: a few masked vectors (the runs are short: a tap's channels, or a
 * kernel row's; a call of memcpy each cost more than the copy) */
static inline void bfn_copy(uint16_t *dst, const uint16_t *src, long n)
{
    for (long i = 0; i < n; i += 32) {
        __mmask32 m = n - i >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (n - i)) - 1);
        _mm512_mask_storeu_epi16(dst + i, m, _mm512_maskz_loadu_epi16(m, src + i));
    }
}

/* output pixel p's sums c[n] of outputs [o0, o0 + n) through the epilogue into its row of y
 * (of O outputs) */
static inline void bfn_finish(const float *c, long p, int o0, int n, int O,
                              const bfn_epilogue *e)
{
    float *y = e->y + p * e->ldy + o0;
    const float *add = e->add ? e->add + p * O + o0 : NULL;
    for (int o = 0; o < n; o += 16) {
        __mmask16 m = bf_mask(n - o);
        __m512 v = _mm512_loadu_ps(c + o);
        if (e->scale)
            v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, e->scale + o0 + o));
        if (e->bias)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, e->bias + o0 + o));
        if (add)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, add + o));
        if (e->relu)
            v = _mm512_max_ps(v, _mm512_setzero_ps());
        _mm512_mask_storeu_ps(y + o, m, v);
    }
}

/* The blocks of BFN_M output pixels, in this thread's share (see the top of the file); w the
 * packed weights, buf bfn_thread_bytes */
static void bfn_blocks(const bfn_geom *g, const float *x, const uint16_t *q, const uint16_t *zeros,
                       const uint16_t *w, char *buf, const bfn_epilogue *e)
{
    int taps = g->kh * g->kw, Cp = g->Cp, G = g->G, O = g->O, Og = O / G, Cg = g->C / G;
    int tiles = (Og + 15) / 16;
    long K = bfn_k(taps, Cp), ldg = bfn_ldc(Og), ldc = G * ldg, M = (long)g->N * g->OH * g->OW;
    long qp = (long)G * Cp, each = bfn_packed_size(Og, Cg, g->kh, g->kw);
    long blocks = (M + BFN_M - 1) / BFN_M, plane = (long)g->OH * g->OW;
    uint16_t *a = (uint16_t *)buf;
    float *c = (float *)(((uintptr_t)(buf + BFN_M * K * 2) + 63) & ~(uintptr_t)63);
    /* a 1 x 1 convolution without padding converts its pixels from x straight into the
     * block's rows: a pass converting the input first (written, then read back) cost more than
     * the products of one with few channels (GoogLeNet b16's 192 -> 64 at 28 x 28: 70 GMAC/s) */
    int pointwise = taps == 1 && g->ph == 0 && g->pw == 0;
    amx_configure();
    #pragma omp for schedule(dynamic)
    for (long b = 0; b < blocks; b++) {
        long p0 = b * BFN_M;
        int R = M - p0 < BFN_M ? (int)(M - p0) : BFN_M;
        for (int gr = 0; gr < G; gr++) {
            if (pointwise) {
                for (int r = 0; r < R; r++) {
                    long p = p0 + r, n = p / plane, rest = p % plane;
                    long src = (n * g->H + rest / g->OW * g->sh) * g->W + rest % g->OW * g->sw;
                    bfn_convert(x + src * g->C + gr * Cg, 0, 1, Cg, 1, a + r * K);
                    memset(a + r * K + Cp, 0, (size_t)(K - Cp) * 2);
                }
            } else {
                for (int r = 0; r < R; r++) {
                    long p = p0 + r, n = p / plane, rest = p % plane;
                    int oh = (int)(rest / g->OW), ow = (int)(rest % g->OW);
                    uint16_t *row = a + r * K;
                    int x0 = ow * g->sw - g->pw;
                    int whole = G == 1 && g->dw == 1 && x0 >= 0 && x0 + g->kw <= g->W;
                    for (int i = 0; i < g->kh; i++) {
                        int y = oh * g->sh - g->ph + i * g->dh;
                        if (whole && y >= 0 && y < g->H) {   /* the kernel row's taps in a run */
                            bfn_copy(row + i * g->kw * Cp, q + ((n * g->H + y) * g->W + x0) * Cp,
                                     (long)g->kw * Cp);
                            continue;
                        }
                        for (int j = 0; j < g->kw; j++) {
                            int xx = x0 + j * g->dw;
                            const uint16_t *src = y >= 0 && y < g->H && xx >= 0 && xx < g->W
                                ? q + ((n * g->H + y) * g->W + xx) * qp + gr * Cp : zeros;
                            bfn_copy(row + (i * g->kw + j) * Cp, src, Cp);
                        }
                    }
                    memset(row + (long)taps * Cp, 0, (size_t)(K - (long)taps * Cp) * 2);
                }
                /* the rows past R only feed sums that are never stored */
            }
            for (int t = 0; t < tiles; t += 2) {
                const uint16_t *b0 = w + gr * each + (long)t * K * 16;
                bf_tiles(a, K * 2, K / 32, R > 16 ? 2 : 1, b0, t + 1 < tiles ? b0 + K * 16 : NULL,
                         c + gr * ldg + t * 16, ldc);
            }
        }
        for (int r = 0; r < R; r++)
            for (int gr = 0; gr < G; gr++)
                bfn_finish(c + r * ldc + gr * ldg, p0 + r, gr * Og, Og, O, e);
    }
    _tile_release();
}

/* x [N][H][W][C] -> e->y [N][OH][OW][O] (pixels e->ldy floats apart) in G groups with the packed
 * weights w (bfn_pack_weights), on `threads` threads; scratch: bfn_scratch_bytes, 64-byte aligned */
static void bfn_conv(int threads, const float *x, int N, int H, int W, int C, int O, int kh,
                     int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH, int OW,
                     int G, const uint16_t *w, char *scratch, const bfn_epilogue *e)
{
    int Cp = bfn_cp(C / G);
    long pixels = (long)N * H * W;
    uint16_t *q = (uint16_t *)scratch;
    long qbytes = ((pixels + 1) * G * Cp * 2 + 63) / 64 * 64;
    uint16_t *zeros = q + pixels * G * Cp;
    char *bufs = scratch + qbytes;
    bfn_geom g = {N, H, W, C, Cp, O, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW, G};
    long each = bfn_thread_bytes(C, O, kh, kw, G);
    int pointwise = kh == 1 && kw == 1 && ph == 0 && pw == 0;     /* bfn_blocks converts */
    long chunks = pointwise ? 0 : (pixels + BFN_CONVERT - 1) / BFN_CONVERT;
    memset(zeros, 0, (size_t)Cp * 2);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(dynamic)
        for (long i = 0; i < chunks; i++) {
            long p1 = (i + 1) * BFN_CONVERT;
            bfn_convert(x, i * BFN_CONVERT, p1 < pixels ? p1 : pixels, C / G, G, q);
        }
        /* implicit barrier */
        bfn_blocks(&g, x, q, zeros, w, bufs + omp_get_thread_num() * each, e);
    }
}

/* y[0 .. n) = x[0 .. n) rounded to bf16 as the tiles' conversion rounds it, as float32 (low 16
 * bits zero): the operands of a layer that runs bf16's arithmetic on float32 kernels */
static void bfn_round(const float *x, long n, float *y, int threads)
{
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < n; i += 4096) {
        long end = i + 4096 < n ? i + 4096 : n;
        for (long j = i; j < end; j += 16) {
            __m256i h = bf_cvt16(x + j, end - j);
            __m512i f = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_mask_storeu_ps(y + j, bf_mask(end - j), _mm512_castsi512_ps(f));
        }
    }
}

#pragma GCC pop_options
#endif
