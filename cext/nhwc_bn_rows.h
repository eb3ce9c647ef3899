/* Rows of a BatchNorm + Scale (+ ReLU) run as one (cext/nhwc.pyx), in C: `restrict` on the
 * buffers no other argument shares, and the ReLU as a C conditional, let GCC vectorize the
 * loops. In Cython the ReLU's select compiled to a branch (5-30x slower, depending on the
 * data's signs), and even the loop without it ran 3x slower than this one (3136 x 512: 0.63
 * against 0.22 ms). On AVX2 the select vectorizes only under -fno-trapping-math (setup.py):
 * without it these loops were scalar there, 10x slower on data of mixed signs. Without a
 * ReLU the forward runs with slope 1, the identity.
 *
 * The ReLU's input is v = xn * gamma + beta; its gradient passes g where v > 0 and g * slope
 * elsewhere, with v recomputed from the kept xn the way the forward computed it.
 */
#include <string.h>
#include <stdint.h>
#include <immintrin.h>
typedef float bn_v8 __attribute__((vector_size(32), aligned(4)));

/* xn = (x - sub) * mul; y = relu(xn * gamma + beta) (slope 1: no ReLU). y may be x.
 * xn is read again only by the backward: on AVX, when its rows are whole aligned vectors, it is
 * written with non-temporal stores, which skip reading each line before writing it and leave
 * the cache to the layers that come next (ResNet-50 b16's BatchNorm units forward: 75-82 ->
 * 67-75 ms). That path spells out the loop below's arithmetic, so it rounds the same way. */
static void caffepy_bn_scale_relu_rows(const float* x, float* y, float* restrict xn, long rows,
                                       int C, const float* restrict sub,
                                       const float* restrict mul, const float* restrict gamma,
                                       const float* restrict beta, float slope) {
#ifdef __AVX__
    if (C % 8 == 0 && (uintptr_t)xn % 32 == 0) {
        for (long r = 0; r < rows; r++) {
            const float* xr = x + r * C;
            float* yr = y + r * C;
            float* nr = xn + r * C;
            for (int c = 0; c < C; c += 8) {
                bn_v8 z = (*(const bn_v8*)(xr + c) - *(const bn_v8*)(sub + c))
                          * *(const bn_v8*)(mul + c);
                bn_v8 v = z * *(const bn_v8*)(gamma + c) + *(const bn_v8*)(beta + c);
                _mm256_stream_ps(nr + c, (__m256)z);
                *(bn_v8*)(yr + c) = (bn_v8)_mm256_blendv_ps((__m256)(v * slope), (__m256)v,
                                                             _mm256_cmp_ps((__m256)v,
                                                                           _mm256_setzero_ps(),
                                                                           _CMP_GT_OQ));
            }
        }
        _mm_sfence();
        return;
    }
#endif
    for (long r = 0; r < rows; r++) {
        const float* xr = x + r * C;
        float* yr = y + r * C;
        float* restrict nr = xn + r * C;
        for (int c = 0; c < C; c++) {
            float z = (xr[c] - sub[c]) * mul[c];
            float v = z * gamma[c] + beta[c];
            nr[c] = z;
            yr[c] = v > 0.0f ? v : v * slope;
        }
    }
}

/* The moments keep the sums of BN_CB channels in vector variables over BN_RB rows at a time
 * (GCC holds them in registers). Summed into the arrays row after row, every vector of sums
 * took a load and a store per row, and the pass ran at half the speed of memory or less:
 * 50176 x 64 0.6 -> 0.17 ms, 50176 x 256 2.8 -> 2.25, 3136 x 2048 0.68 -> 0.44. The sums of
 * products below (two arrays) gained only on narrow rows done so, and lost from 256 channels
 * on (the blocks broke up the two streams that a long row keeps), so they sum row by row.
 * Each channel's rows are added in the same order either way, so the sums are the same.
 * Channels past the last whole block go one at a time. */
#define BN_CB 32
#define BN_RB 8

/* s1 = sum of (x - shift), s2 = sum of its squares over the rows, per channel (float sums of
 * one task's rows; the caller adds the tasks in float64). In Cython, which cannot say that the
 * sums do not alias x, this loop ran scalar. */
static void caffepy_moments_rows(const float* restrict x, long rows, int C,
                                 const float* restrict shift, float* restrict s1,
                                 float* restrict s2) {
    int cv = C / BN_CB * BN_CB;
    memset(s1, 0, sizeof(float) * C);
    memset(s2, 0, sizeof(float) * C);
    for (long r0 = 0; r0 < rows; r0 += BN_RB) {
        long r1 = r0 + BN_RB < rows ? r0 + BN_RB : rows;
        for (int c0 = 0; c0 < cv; c0 += BN_CB) {
            bn_v8 a1[BN_CB / 8], a2[BN_CB / 8], sh[BN_CB / 8];
            for (int k = 0; k < BN_CB / 8; k++) {
                a1[k] = *(bn_v8*)(s1 + c0 + 8 * k);
                a2[k] = *(bn_v8*)(s2 + c0 + 8 * k);
                sh[k] = *(const bn_v8*)(shift + c0 + 8 * k);
            }
            for (long r = r0; r < r1; r++)
                for (int k = 0; k < BN_CB / 8; k++) {
                    bn_v8 d = *(const bn_v8*)(x + r * C + c0 + 8 * k) - sh[k];
                    a1[k] += d;
                    a2[k] += d * d;
                }
            for (int k = 0; k < BN_CB / 8; k++) {
                *(bn_v8*)(s1 + c0 + 8 * k) = a1[k];
                *(bn_v8*)(s2 + c0 + 8 * k) = a2[k];
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        const float* restrict xr = x + r * C;
        for (int c = cv; c < C; c++) {
            float d = xr[c] - shift[c];
            s1[c] += d;
            s2[c] += d * d;
        }
    }
}

/* s1 = sum of a, s2 = sum of a * b over the rows, per channel (as caffepy_moments_rows). */
static void caffepy_dots_rows(const float* restrict a, const float* restrict b, long rows, int C,
                              float* restrict s1, float* restrict s2) {
    for (int c = 0; c < C; c++) {
        s1[c] = 0.0f;
        s2[c] = 0.0f;
    }
    for (long r = 0; r < rows; r++) {
        const float* restrict ar = a + r * C;
        const float* restrict br = b + r * C;
        for (int c = 0; c < C; c++) {
            s1[c] += ar[c];
            s2[c] += ar[c] * br[c];
        }
    }
}

/* s1 = sum of g, s2 = sum of g * xn over the rows (g = dy through the ReLU), per channel. */
static void caffepy_relu_dots_rows(const float* restrict dy, const float* restrict xn, long rows,
                                   int C, const float* restrict gamma,
                                   const float* restrict beta, float slope, float* restrict s1,
                                   float* restrict s2) {
    for (int c = 0; c < C; c++) {
        s1[c] = 0.0f;
        s2[c] = 0.0f;
    }
    for (long r = 0; r < rows; r++) {
        const float* restrict gr = dy + r * C;
        const float* restrict nr = xn + r * C;
        for (int c = 0; c < C; c++) {
            float g = nr[c] * gamma[c] + beta[c] > 0.0f ? gr[c] : gr[c] * slope;
            s1[c] += g;
            s2[c] += g * nr[c];
        }
    }
}

/* dx = p * g + q * xn + r per channel (g = dy through the ReLU). dx may be dy. */
static void caffepy_bn_relu_grad_rows(const float* dy, const float* restrict xn, float* dx,
                                      long rows, int C, const float* restrict p,
                                      const float* restrict q, const float* restrict r,
                                      const float* restrict gamma, const float* restrict beta,
                                      float slope) {
    for (long i = 0; i < rows; i++) {
        const float* gi = dy + i * C;
        const float* restrict ni = xn + i * C;
        float* di = dx + i * C;
        for (int c = 0; c < C; c++) {
            float g = ni[c] * gamma[c] + beta[c] > 0.0f ? gi[c] : gi[c] * slope;
            di[c] = p[c] * g + q[c] * ni[c] + r[c];
        }
    }
}
