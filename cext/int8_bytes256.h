/* The channels-last int8 kernels on bytes in 256-bit vectors, written once for the two paths
 * that run them (int8_avxvnni.h includes this file once for each): I8X_FN(name) names a
 * function of the path, I8X_TARGET its target, I8X_DPBUSD(acc, x, w) the product: acc plus,
 * in each int32 lane, the four products of x's unsigned bytes by w's signed bytes. No include
 * guard: each inclusion defines the other path's functions. */
/* q[0 .. n) = the quantized x[0 .. n) plus zp, as bytes: i8v_quantize_run in 8 lanes (the
 * same rounding, saturation and NaN rule) */
I8X_TARGET static void I8X_FN(quantize_run)(const float *x, long n, float scale, float lo,
                                            float hi, int zp, uint8_t *q)
{
    long i = 0;
    const __m256 s = _mm256_set1_ps(scale), l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    const __m256i z = _mm256_set1_epi32(zp);
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
            _mm256_mul_ps(_mm256_loadu_ps(x + i), s), l), h)), z);
        /* 0 .. 255: both packs keep the values */
        __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packus_epi16(w, w));
    }
    for (; i < n; i++)
        q[i] = (uint8_t)(i8_quantize(x[i], scale, lo, hi) + zp);
}

/* c[r][16 i .. 16 i + 16) (r < 6, i < nt, rows of c 16 I8V_NT apart) = i8v_tile's sums, one
 * column tile at a time: its 6 x 2 sums, two weight vectors and a broadcast fill the 16
 * registers */
I8X_TARGET static void I8X_FN(tile)(int nt, int taps, int Jq, const int32_t *const *rows,
                                    const int8_t *w, long ws, int32_t *c)
{
    for (int i = 0; i < nt; i++) {
        __m256i acc[6][2];
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++)
            acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int t = 0; t < taps; t++) {
            const int32_t *const *rt = rows + t * 6;
            const int32_t *a0 = rt[0], *a1 = rt[1], *a2 = rt[2], *a3 = rt[3], *a4 = rt[4],
                          *a5 = rt[5];
            const int8_t *b = w + (long)i * ws + (long)t * Jq * 64;
            for (int j = 0; j < Jq; j++, b += 64) {
                __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
                __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 32));
                __m256i x;
#define I8X_ROW(r, a)                                                                       \
                x = _mm256_set1_epi32(a[j]);                                                \
                acc[r][0] = I8X_DPBUSD(acc[r][0], x, b0);                      \
                acc[r][1] = I8X_DPBUSD(acc[r][1], x, b1);
                I8X_ROW(0, a0) I8X_ROW(1, a1) I8X_ROW(2, a2) I8X_ROW(3, a3) I8X_ROW(4, a4)
                I8X_ROW(5, a5)
#undef I8X_ROW
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
            int32_t *cr = c + r * 16 * I8V_NT + i * 16;
            _mm256_storeu_si256((__m256i *)cr, acc[r][0]);
            _mm256_storeu_si256((__m256i *)(cr + 8), acc[r][1]);
        }
    }
}
/* Depthwise on bytes, as the VNNI path's (int8_vnni.h i8v_dw_quads, i8v_dw_row: the same tap
 * quads, weights and sums) in 8 lanes: each 64-byte quad block of 16 channels is two halves
 * of 8 channels. */

/* i8v_dw_quads: each tap's 16 bytes are broadcast to both 128-bit lanes and vpshufb (within a
 * lane) moves half h's channels 8 h + 4 L .. 8 h + 4 L + 3 to their places; the picks are
 * i8v_dw_picks' bytes 32 h .. 32 h + 31 */
I8X_TARGET static void I8X_FN(dw_quads)(const uint8_t *in, int W, int C, long rb, int kw, int pw,
                                        int sw, int dw, int OW, const uint8_t *zps,
                                        const uint8_t (*picks)[64], uint8_t *t)
{
    int G = (C + 15) / 16, J = (kw + 3) / 4;
    __m256i pick[4][2];
    for (int k = 0; k < 4; k++)
        for (int h = 0; h < 2; h++)
            pick[k][h] = _mm256_loadu_si256((const __m256i *)(picks[k] + 32 * h));
    for (int ox = 0; ox < OW; ox++) {
        int x0 = ox * sw - pw;
        for (int j = 0; j < J; j++) {
            const uint8_t *p[4];        /* the pixels under taps 4 j .. 4 j + 3 */
            i8v_dw_taps(in, W, rb, kw, dw, x0, j, zps, p);
            uint8_t *tj = t + ((long)ox * J + j) * 64;
            for (int g = 0; g < G; g++, tj += (long)OW * J * 64) {
                __m256i q0 = _mm256_setzero_si256(), q1 = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m256i src = _mm256_broadcastsi128_si256(
                        _mm_loadu_si128((const __m128i *)(p[k] + 16 * g)));
                    q0 = _mm256_or_si256(q0, _mm256_shuffle_epi8(src, pick[k][0]));
                    q1 = _mm256_or_si256(q1, _mm256_shuffle_epi8(src, pick[k][1]));
                }
                _mm256_storeu_si256((__m256i *)tj, q0);
                _mm256_storeu_si256((__m256i *)(tj + 32), q1);
            }
        }
    }
}

/* i8v_dw_row: acc[ox][c] = base[c] + the kernel rows' sums (rows[i] the tap quads of kernel
 * row ky[i], i < n), half a quad block (8 channels) at a time, 4 pixels' chains at once; the
 * halves past C masked */
I8X_TARGET static void I8X_FN(dw_row)(const uint8_t *const *rows, const int *ky, int n, int OW,
                                      int C, int kw, const int8_t *w, const int32_t *base,
                                      int32_t *acc)
{
    int G = (C + 15) / 16, J = (kw + 3) / 4;
    long step = (long)J * 64;     /* one output column's quads */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int g = 0; g < G; g++)
        for (int h = 0; h < 2; h++) {
            int c0 = 16 * g + 8 * h, left = C - c0;
            if (left <= 0)
                break;
            __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
            __m256i b = _mm256_maskload_epi32(base + c0, m);
            int ox = 0;
            for (; ox + 4 <= OW; ox += 4) {
                __m256i a0 = b, a1 = b, a2 = b, a3 = b;
                for (int i = 0; i < n; i++) {
                    const uint8_t *q = rows[i] + ((long)g * OW + ox) * step + 32 * h;
                    const int8_t *wr = w + ((long)ky[i] * G + g) * J * 64 + 32 * h;
                    for (int j = 0; j < J; j++, q += 64, wr += 64) {
                        __m256i wv = _mm256_loadu_si256((const __m256i *)wr);
#define I8X_PIXEL(a, u) \
                        a = I8X_DPBUSD(a, _mm256_loadu_si256((const __m256i *)(q + (u) * step)), wv);
                        I8X_PIXEL(a0, 0) I8X_PIXEL(a1, 1) I8X_PIXEL(a2, 2) I8X_PIXEL(a3, 3)
#undef I8X_PIXEL
                    }
                }
                _mm256_maskstore_epi32(acc + (long)ox * C + c0, m, a0);
                _mm256_maskstore_epi32(acc + (long)(ox + 1) * C + c0, m, a1);
                _mm256_maskstore_epi32(acc + (long)(ox + 2) * C + c0, m, a2);
                _mm256_maskstore_epi32(acc + (long)(ox + 3) * C + c0, m, a3);
            }
            for (; ox < OW; ox++) {
                __m256i a = b;
                for (int i = 0; i < n; i++) {
                    const uint8_t *q = rows[i] + ((long)g * OW + ox) * step + 32 * h;
                    const int8_t *wr = w + ((long)ky[i] * G + g) * J * 64 + 32 * h;
                    for (int j = 0; j < J; j++, q += 64, wr += 64)
                        a = I8X_DPBUSD(a, _mm256_loadu_si256((const __m256i *)q),
                                                    _mm256_loadu_si256((const __m256i *)wr));
                }
                _mm256_maskstore_epi32(acc + (long)ox * C + c0, m, a);
            }
        }
}
