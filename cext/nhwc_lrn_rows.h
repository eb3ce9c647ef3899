/* Rows of the channels-last LRN (cext/nhwc.pyx), in C: `restrict` on the work rows lets GCC
 * vectorize the window sums, which Cython's loops left scalar (the work rows might have
 * aliased). GoogLeNet's conv2/norm2 (16 x 56 x 56 x 192) on Zen 4, forward / backward: 9 / 17
 * -> 4-5 / 6-7 ms.
 *
 * Per pixel, scale = k + a * (sum of x^2 over the `size` channels centred on c, zero past the
 * ends), y = x * scale^-beta. The backward recomputes the scale:
 *     dx = dy * scale^-beta - cache * x * window sum of dy * x * scale^(-beta-1)
 * with cache = 2 alpha beta / size. A window sum is `size` shifted reads of a row padded with
 * pre = (size - 1) / 2 zeros on each side, in the task's work memory (3 * C + size floats).
 * y may be x and dx may be dy: every write is to the element just read at the same index.
 * `kind` is lrn_pow.pxi's: 0 beta 0.75, 1 beta 0.5, 2 beta 1, 3 any other.
 */
#include <math.h>
#include <immintrin.h>

/* scale^-0.5 and scale^-0.75 by the reciprocal square root estimate and one Newton step
 * (y' = y (1.5 - 0.5 s y^2): 14 or 12 bits to about 23), s^-0.75 = y^2 rsqrt(y): a few
 * multiply-adds where sqrt, sqrt and a division each took the divider (10-12 cycles a
 * 16-float vector: half of GoogLeNet's conv2/norm2). Within a few ulp of powf, as the
 * exact-rounded sqrt chain was. */
#if defined(__AVX512F__)
#define LRN_W 16
typedef __m512 lrn_vec;
#define LRN_LOAD _mm512_loadu_ps
#define LRN_STORE _mm512_storeu_ps
#define LRN_SET1 _mm512_set1_ps
#define LRN_MUL _mm512_mul_ps
#define LRN_FNMADD _mm512_fnmadd_ps
#define LRN_RSQRT _mm512_rsqrt14_ps
#elif defined(__AVX2__)
#define LRN_W 8
typedef __m256 lrn_vec;
#define LRN_LOAD _mm256_loadu_ps
#define LRN_STORE _mm256_storeu_ps
#define LRN_SET1 _mm256_set1_ps
#define LRN_MUL _mm256_mul_ps
#define LRN_FNMADD _mm256_fnmadd_ps
#define LRN_RSQRT _mm256_rsqrt_ps
#endif

#ifdef LRN_W
/* s^-0.5, refined once */
static inline lrn_vec lrn_rsqrt(lrn_vec s)
{
    lrn_vec y = LRN_RSQRT(s), h = LRN_MUL(s, LRN_SET1(0.5f));
    /* y (1.5 - h y^2) */
    return LRN_MUL(y, LRN_FNMADD(h, LRN_MUL(y, y), LRN_SET1(1.5f)));
}
#endif

#if defined(LRN_W) && LRN_W == 16
/* s[c] = k + a * (x[c - 2]^2 + ... + x[c + 2]^2, zero outside [0, C)), c < C: the window of 5
 * (AlexNet's, GoogLeNet's) from the 16-channel vectors of x, the shifted ones made from
 * neighbouring vectors by valignd. Squaring into a row and reading it back shifted waited on
 * the stores (a load across two pending stores is not forwarded): GoogLeNet's conv2/norm2
 * at b16 5.9 -> 3.6 ms with the inverse root below (one call, old module against new). */
static inline void lrn_window5(const float *x, float *restrict s, int C, float k, float a)
{
    const __m512 kv = _mm512_set1_ps(k), av = _mm512_set1_ps(a);
    __m512i prev = _mm512_setzero_si512();
    __m512i cur = _mm512_maskz_loadu_epi32(C < 16 ? (__mmask16)((1u << C) - 1) : 0xFFFF, x);
    for (int c = 0; c < C; c += 16) {
        int rest = C - c - 16;
        __mmask16 m = rest >= 0 ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c)) - 1);
        __m512i next = rest <= 0 ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi32(
            rest >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rest) - 1), x + c + 16);
        __m512 v0 = _mm512_castsi512_ps(_mm512_alignr_epi32(cur, prev, 14));
        __m512 v1 = _mm512_castsi512_ps(_mm512_alignr_epi32(cur, prev, 15));
        __m512 v2 = _mm512_castsi512_ps(cur);
        __m512 v3 = _mm512_castsi512_ps(_mm512_alignr_epi32(next, cur, 1));
        __m512 v4 = _mm512_castsi512_ps(_mm512_alignr_epi32(next, cur, 2));
        __m512 acc = _mm512_fmadd_ps(v1, v1, _mm512_mul_ps(v0, v0));
        acc = _mm512_fmadd_ps(v2, v2, acc);
        acc = _mm512_fmadd_ps(v3, v3, acc);
        acc = _mm512_fmadd_ps(v4, v4, acc);
        _mm512_mask_storeu_ps(s + c, m, _mm512_fmadd_ps(av, acc, kv));
        prev = cur;
        cur = next;
    }
}
#endif

/* p[c] = s[c]^-0.75 (quarter 0) or s[c]^-0.5, c < C */
static inline void lrn_inverse_root(const float *restrict s, float *restrict p, int C,
                                    int quarter)
{
    int c = 0;
#ifdef LRN_W
    for (; c + LRN_W <= C; c += LRN_W) {
        lrn_vec y = lrn_rsqrt(LRN_LOAD(s + c));
        LRN_STORE(p + c, quarter ? LRN_MUL(LRN_MUL(y, y), lrn_rsqrt(y)) : y);
    }
#endif
    for (; c < C; c++) {
        float r = sqrtf(s[c]);
        p[c] = quarter ? 1.f / (r * sqrtf(r)) : 1.f / r;
    }
}

/* acc[c] = row[c] + ... + row[c + size - 1] */
static inline void caffepy_lrn_window(const float *restrict row, float *restrict acc, int C,
                                      int size)
{
    /* shifted pointers, not row[c + e]: with int indices GCC gathered */
    if (size == 5) {
        const float *r1 = row + 1, *r2 = row + 2, *r3 = row + 3, *r4 = row + 4;
        for (long c = 0; c < C; c++)
            acc[c] = row[c] + r1[c] + r2[c] + r3[c] + r4[c];
        return;
    }
    for (long c = 0; c < C; c++)
        acc[c] = row[c];
    for (int e = 1; e < size; e++) {
        const float *re = row + e;
        for (long c = 0; c < C; c++)
            acc[c] += re[c];
    }
}

/* s[c] = k + a * window sum of x^2; p[c] = s[c]^-beta */
static inline void caffepy_lrn_scale(const float *x, float *restrict row, float *restrict s,
                                     float *restrict p, int C, int size, float k, float a,
                                     float beta, int kind)
{
#if defined(LRN_W) && LRN_W == 16
    if (size == 5) {
        lrn_window5(x, s, C, k, a);
    } else
#endif
    {
        float *restrict mid = row + (size - 1) / 2;
        for (int c = 0; c < C; c++)
            mid[c] = x[c] * x[c];
        caffepy_lrn_window(row, s, C, size);
        for (int c = 0; c < C; c++)
            s[c] = k + a * s[c];
    }
    if (kind == 0 || kind == 1)
        lrn_inverse_root(s, p, C, kind == 0);
    else if (kind == 2)
        for (int c = 0; c < C; c++)
            p[c] = 1.f / s[c];
    else
        for (int c = 0; c < C; c++)
            p[c] = powf(s[c], -beta);
}

static void caffepy_lrn_forward_rows(const float *x, float *y, long rows, int C, int size,
                                     float k, float a, float beta, int kind, float *w)
{
    int pre = (size - 1) / 2;
    float *restrict row = w, *restrict s = w + C + 2 * pre, *restrict p = s + C;
    for (int c = 0; c < pre; c++)
        row[c] = row[pre + C + c] = 0.f;
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        float *yr = y + r * C;
        caffepy_lrn_scale(xr, row, s, p, C, size, k, a, beta, kind);
        for (int c = 0; c < C; c++)
            yr[c] = xr[c] * p[c];
    }
}

static void caffepy_lrn_backward_rows(const float *x, const float *dy, float *dx, long rows,
                                      int C, int size, float k, float a, float beta, int kind,
                                      float cache, float *w)
{
    int pre = (size - 1) / 2;
    float *restrict row = w, *restrict s = w + C + 2 * pre, *restrict p = s + C;
    float *restrict mid = row + pre;
    for (int c = 0; c < pre; c++)
        row[c] = row[pre + C + c] = 0.f;
    for (long r = 0; r < rows; r++) {
        const float *restrict xr = x + r * C;
        const float *gr = dy + r * C;
        float *dr = dx + r * C;
        caffepy_lrn_scale(xr, row, s, p, C, size, k, a, beta, kind);
        /* row <- dy * x * scale^(-beta - 1); its window sum is the cross-channel term */
        for (int c = 0; c < C; c++)
            mid[c] = gr[c] * xr[c] * p[c] / s[c];
        caffepy_lrn_window(row, s, C, size);
        for (int c = 0; c < C; c++)
            dr[c] = gr[c] * p[c] - cache * xr[c] * s[c];
    }
}
