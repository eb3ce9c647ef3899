/* One output row of the channels-last MAX pooling (cext/nhwc.pyx), in C: each run of eight
 * channels (sixteen in the AVX-512 build) keeps its maximum and argmax in registers across the
 * window (GCC's vector extension), where the Cython loop loaded, compared and stored both in
 * memory at every window position. GoogLeNet b16, old and new builds alternating, min ms forward:
 * inception_3a/pool (3x3 s1, 28 x 28 x 192) 5.7 -> 3.8, pool1/3x3_s2 (112 x 112 x 64) 8.2 -> 5.8.
 *
 * y[px][c] = max over the window (padding ignored) of x[h][w][c]; mask[px][c] = h * W + w of
 * its first maximum in row-major order (strict >: Caffe's rule), -1 for an empty window.
 */
#include <float.h>
#include <stdint.h>

typedef float caffepy_pf8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t caffepy_pi8 __attribute__((vector_size(32), aligned(4), may_alias));

/* NAME(x, out, mk, W, C, c, R, hs, he, ws, we): channels c .. c + V * R of one output pixel,
 * window rows hs .. he, columns ws .. we, for vectors VF of V floats (VI of V ints): R runs of V
 * channels at once, so R independent compare-and-blend chains overlap (one run at a time
 * waited on each blend's latency: cifar10_quick's pool1, 16 x 16 x 32 outputs of 3x3 windows,
 * took 18 us on one core). Called with a constant R, which GCC unrolls, and mk NULL (a TEST
 * net's forward: the maxima alone, half the stores) as a constant where it is, so that the
 * positions' blends drop out. The AVX-512 build runs 64 channels as four 16-float runs first. */
#define CAFFEPY_MAX_RUNS(NAME, VF, VI, V)                                                      \
static inline __attribute__((always_inline)) void                                              \
NAME(const float *x, float *out, int32_t *mk, int W, int C, int c, int R, int hs, int he,     \
     int ws, int we)                                                                           \
{                                                                                              \
    VF best[4];                                                                                \
    VI arg[4];                                                                                 \
    for (int r = 0; r < R; r++) {                                                              \
        best[r] = (VF){0} - FLT_MAX;                                                           \
        arg[r] = (VI){0} - 1;                                                                  \
    }                                                                                          \
    for (int h = hs; h < he; h++)                                                              \
        for (int w = ws; w < we; w++) {                                                        \
            const float *p = x + ((long)h * W + w) * C + c;                                    \
            VI at = (VI){0} + (h * W + w);                                                     \
            for (int r = 0; r < R; r++) {                                                      \
                VF v = *(const VF *)(p + V * r);                                               \
                VI gt = v > best[r];                    /* all ones where greater */           \
                best[r] = (VF)(((VI)v & gt) | ((VI)best[r] & ~gt));                            \
                if (mk)                                                                        \
                    arg[r] = (at & gt) | (arg[r] & ~gt);                                       \
            }                                                                                  \
        }                                                                                      \
    for (int r = 0; r < R; r++) {                                                              \
        *(VF *)(out + c + V * r) = best[r];                                                    \
        if (mk)                                                                                \
            *(VI *)(mk + c + V * r) = arg[r];                                                  \
    }                                                                                          \
}

CAFFEPY_MAX_RUNS(caffepy_max_runs, caffepy_pf8, caffepy_pi8, 8)
#ifdef __AVX512F__
typedef float caffepy_pf16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t caffepy_pi16 __attribute__((vector_size(64), aligned(4), may_alias));
CAFFEPY_MAX_RUNS(caffepy_max_runs16, caffepy_pf16, caffepy_pi16, 16)
#endif

/* One output row; mask NULL: the maxima alone. */
static void caffepy_max_row(const float *x, float *y, int32_t *mask, int H, int W, int C,
                            int ow, int py, int kh, int kw, int sh, int sw, int ph, int pw)
{
    int hs = py * sh - ph, he = hs + kh < H ? hs + kh : H;
    hs = hs > 0 ? hs : 0;
    for (int px = 0; px < ow; px++) {
        int ws = px * sw - pw, we = ws + kw < W ? ws + kw : W;
        ws = ws > 0 ? ws : 0;
        float *out = y + (long)px * C;
        int32_t *mk = mask ? mask + (long)px * C : NULL;
        int c = 0;
#ifdef __AVX512F__
        if (!mask)
            for (; c + 64 <= C; c += 64)
                caffepy_max_runs16(x, out, NULL, W, C, c, 4, hs, he, ws, we);
        for (; c + 64 <= C; c += 64)
            caffepy_max_runs16(x, out, mk, W, C, c, 4, hs, he, ws, we);
#endif
        if (!mask) {
            for (; c + 32 <= C; c += 32)
                caffepy_max_runs(x, out, NULL, W, C, c, 4, hs, he, ws, we);
            for (; c + 8 <= C; c += 8)
                caffepy_max_runs(x, out, NULL, W, C, c, 1, hs, he, ws, we);
        }
        for (; c + 32 <= C; c += 32)
            caffepy_max_runs(x, out, mk, W, C, c, 4, hs, he, ws, we);
        for (; c + 8 <= C; c += 8)
            caffepy_max_runs(x, out, mk, W, C, c, 1, hs, he, ws, we);
        for (; c < C; c++) {
            float best = -FLT_MAX;
            int32_t arg = -1;
            for (int h = hs; h < he; h++)
                for (int w = ws; w < we; w++) {
                    float v = x[((long)h * W + w) * C + c];
                    if (v > best) {
                        best = v;
                        arg = h * W + w;
                    }
                }
            out[c] = best;
            if (mk)
                mk[c] = arg;
        }
    }
}
