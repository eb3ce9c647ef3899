/* Blocked max pooling in SSE4.1 intrinsics, for cext/intel.pyx (pool_max_forward).
 * CAFFEPY_MAXPOOL4 is 0 on a build without SSE4.1: the kernel then takes its portable loop
 * (_max_plane in intel.pyx).
 */
#if defined(__SSE4_1__)
#include <immintrin.h>
#include <float.h>
#define CAFFEPY_MAXPOOL4 1
/* _max_plane by quarters of 4 lanes held in registers: compare, then blend both the
   maximum and its index (GCC left the per-lane selects of the Cython loop scalar, one
   compare and branch-free move per lane) */
static inline __attribute__((always_inline)) void caffepy_max_plane4_m(
        const float* x, float* y, int* mask, int H, int W, int oh, int ow, const int m,
        int kh, int kw, int sh, int sw, int ph, int pw) {
    const int V = 4 * m;
    __m128 best[16], idx[16], v, gt, at;
    int py, px, h, w, hs, he, ws, we, j;
    for (py = 0; py < oh; py++) {
        hs = py * sh - ph;
        he = hs + kh < H ? hs + kh : H;
        hs = hs > 0 ? hs : 0;
        for (px = 0; px < ow; px++) {
            ws = px * sw - pw;
            we = ws + kw < W ? ws + kw : W;
            ws = ws > 0 ? ws : 0;
            for (j = 0; j < m; j++) {
                best[j] = _mm_set1_ps(-FLT_MAX);
                idx[j] = _mm_castsi128_ps(_mm_set1_epi32(-1));
            }
            for (h = hs; h < he; h++)
                for (w = ws; w < we; w++) {
                    at = _mm_castsi128_ps(_mm_set1_epi32(h * W + w));
                    for (j = 0; j < m; j++) {
                        v = _mm_loadu_ps(x + (long)(h * W + w) * V + 4 * j);
                        /* strict '>' keeps the first maximum (Caffe's rule) */
                        gt = _mm_cmpgt_ps(v, best[j]);
                        best[j] = _mm_blendv_ps(best[j], v, gt);
                        idx[j] = _mm_blendv_ps(idx[j], at, gt);
                    }
                }
            for (j = 0; j < m; j++) {
                _mm_storeu_ps(y + 4 * j, best[j]);
                _mm_storeu_si128((__m128i*)(mask + 4 * j), _mm_castps_si128(idx[j]));
            }
            y += V;
            mask += V;
        }
    }
}
static void caffepy_max_plane4(const float* x, float* y, int* mask, int H, int W, int oh,
                               int ow, int V, int kh, int kw, int sh, int sw, int ph, int pw) {
    /* widths 8 and 16 get a copy each, so the quarter loops unroll */
    if (V == 8)
        caffepy_max_plane4_m(x, y, mask, H, W, oh, ow, 2, kh, kw, sh, sw, ph, pw);
    else if (V == 16)
        caffepy_max_plane4_m(x, y, mask, H, W, oh, ow, 4, kh, kw, sh, sw, ph, pw);
    else
        caffepy_max_plane4_m(x, y, mask, H, W, oh, ow, V / 4, kh, kw, sh, sw, ph, pw);
}
#else
#define CAFFEPY_MAXPOOL4 0
static void caffepy_max_plane4(const float* x, float* y, int* mask, int H, int W, int oh,
                               int ow, int V, int kh, int kw, int sh, int sw, int ph, int pw) {}
#endif
