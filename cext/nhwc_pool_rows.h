/* One output row of the channels-last MAX pooling (cext/nhwc.pyx), in C: each run of eight
 * channels keeps its maximum and argmax in registers across the window (GCC's vector
 * extension), where the Cython loop loaded, compared and stored both in memory at every
 * window position. GoogLeNet b16, old and new builds alternating, min ms forward:
 * inception_3a/pool (3x3 s1, 28 x 28 x 192) 5.7 -> 3.8, pool1/3x3_s2 (112 x 112 x 64) 8.2 -> 5.8.
 *
 * y[px][c] = max over the window (padding ignored) of x[h][w][c]; mask[px][c] = h * W + w of
 * its first maximum in row-major order (strict >: Caffe's rule), -1 for an empty window.
 */
#include <float.h>
#include <stdint.h>

typedef float caffepy_pf8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t caffepy_pi8 __attribute__((vector_size(32), aligned(4), may_alias));

/* Channels c .. c + 8 * R of one output pixel, window rows hs .. he, columns ws .. we: R runs
 * of eight channels at once, so R independent compare-and-blend chains overlap (one run at a
 * time waited on each blend's latency: cifar10_quick's pool1, 16 x 16 x 32 outputs of 3x3
 * windows, took 18 us on one core). Called with a constant R, which GCC unrolls, and mk NULL
 * (a TEST net's forward: the maxima alone, half the stores) as a constant where it is, so that
 * the positions' blends drop out. */
static inline __attribute__((always_inline)) void
caffepy_max_runs(const float *x, float *out, int32_t *mk, int W, int C, int c, int R,
                 int hs, int he, int ws, int we)
{
    caffepy_pf8 best[4];
    caffepy_pi8 arg[4];
    for (int r = 0; r < R; r++) {
        best[r] = (caffepy_pf8){-FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX,
                                -FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX};
        arg[r] = (caffepy_pi8){-1, -1, -1, -1, -1, -1, -1, -1};
    }
    for (int h = hs; h < he; h++)
        for (int w = ws; w < we; w++) {
            const float *p = x + ((long)h * W + w) * C + c;
            caffepy_pi8 at = {0, 0, 0, 0, 0, 0, 0, 0};
            at += h * W + w;
            for (int r = 0; r < R; r++) {
                caffepy_pf8 v = *(const caffepy_pf8 *)(p + 8 * r);
                caffepy_pi8 gt = v > best[r];              /* all ones where greater */
                best[r] = (caffepy_pf8)(((caffepy_pi8)v & gt) | ((caffepy_pi8)best[r] & ~gt));
                if (mk)
                    arg[r] = (at & gt) | (arg[r] & ~gt);
            }
        }
    for (int r = 0; r < R; r++) {
        *(caffepy_pf8 *)(out + c + 8 * r) = best[r];
        if (mk)
            *(caffepy_pi8 *)(mk + c + 8 * r) = arg[r];
    }
}

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
