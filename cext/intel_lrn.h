/* The fast path of the blocked LRN across channels, for cext/intel.pyx (lrn_forward,
 * lrn_backward): 128-bit quarters of a channel block held in registers, window sums by in-register
 * shifts (alignr), the power s^-3/4 from two square roots. The layout of the work and why 128-bit
 * vectors are in intel.pyx, above its `cdef extern from "intel_lrn.h"`.
 *
 * CAFFEPY_LRN4 is 0 on a build without FMA and SSSE3, and the kernels then take the generic path.
 */
#if defined(__FMA__) && defined(__SSSE3__)
#include <immintrin.h>
#define CAFFEPY_LRN4 1

/* lanes [0, n) of a quarter set (n may be <= 0 or >= 4) */
static inline __m128 caffepy_lrn4_lanes(int n) {
    return _mm_castsi128_ps(_mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3)));
}

#define CAFFEPY_ALIGNR4(hi, lo, bytes) _mm_castsi128_ps(_mm_alignr_epi8( \
    _mm_castps_si128(hi), _mm_castps_si128(lo), bytes))

/* window sum over channels v - pre .. v + pre of quarter c, b / a being the quarters of the
   four channels before / after it (pre <= 4) */
static inline __attribute__((always_inline)) __m128 caffepy_lrn4_window(
        __m128 b, __m128 c, __m128 a, const int pre) {
    __m128 w = c;
    if (pre >= 1)
        w = _mm_add_ps(w, _mm_add_ps(CAFFEPY_ALIGNR4(a, c, 4), CAFFEPY_ALIGNR4(c, b, 12)));
    if (pre >= 2)
        w = _mm_add_ps(w, _mm_add_ps(CAFFEPY_ALIGNR4(a, c, 8), CAFFEPY_ALIGNR4(c, b, 8)));
    if (pre >= 3)
        w = _mm_add_ps(w, _mm_add_ps(CAFFEPY_ALIGNR4(a, c, 12), CAFFEPY_ALIGNR4(c, b, 4)));
    if (pre >= 4)
        w = _mm_add_ps(w, _mm_add_ps(a, b));
    return w;
}

/* p = s^-3/4 = 1 / (s^1/2 * s^1/4), no exp / log, and *q = p / s, with one division */
static inline __attribute__((always_inline)) __m128 caffepy_lrn4_pow(__m128 s, __m128* q) {
    const __m128 r = _mm_sqrt_ps(s);
    *q = _mm_div_ps(_mm_set1_ps(1.0f), _mm_mul_ps(_mm_mul_ps(s, r), _mm_sqrt_ps(r)));
    return _mm_mul_ps(*q, s);
}

/* The quarters around pixel t of a block run, as m + 2 quarters: the last of the block
   before (zero when cp is NULL), the m of this block, the first of the block after (zero
   when cn is NULL), squared if sq; lanes past the real channels are zeroed (unless full:
   all of them are real). */
static inline __attribute__((always_inline)) void caffepy_lrn4_load(
        __m128* q, const float* cp, const float* cc, const float* cn, long t, const int m,
        int nv, int nn, int sq, const int full) {
    const long V = 4 * m;
    int j;
    q[0] = cp ? _mm_loadu_ps(cp + V * t + V - 4) : _mm_setzero_ps();
    for (j = 0; j < m; j++) {
        q[j + 1] = _mm_loadu_ps(cc + V * t + 4 * j);
        if (!full)
            q[j + 1] = _mm_and_ps(q[j + 1], caffepy_lrn4_lanes(nv - 4 * j));
    }
    q[m + 1] = cn ? _mm_loadu_ps(cn + V * t) : _mm_setzero_ps();
    if (!full)
        q[m + 1] = _mm_and_ps(q[m + 1], caffepy_lrn4_lanes(nn));
    if (sq)
        for (j = 0; j < m + 2; j++)
            q[j] = _mm_mul_ps(q[j], q[j]);
}

/* x, zeroed past the real lanes unless full */
#define CAFFEPY_LRN4_MASK(x, j) (full ? (x) : _mm_and_ps((x), caffepy_lrn4_lanes(nv - 4 * (j))))

/* Forward of one block run of L pixels (V = 4 m lanes): xc this block, xp / xn the blocks
   before / after (NULL: none), nv / nn the real lanes of this block / the next. */
static inline __attribute__((always_inline)) void caffepy_lrn4_fwd_mp(
        const float* xp, const float* xc, const float* xn, float* y, long L, int nv, int nn,
        float k, float a, const int m, const int pre, const int full) {
    const __m128 vk = _mm_set1_ps(k), va = _mm_set1_ps(a);
    __m128 q[18], s, r, x, out;
    long t;
    int j;
    for (t = 0; t < L; t++) {
        caffepy_lrn4_load(q, xp, xc, xn, t, m, nv, nn, 1, full);
        for (j = 0; j < m; j++) {
            s = _mm_fmadd_ps(va, caffepy_lrn4_window(q[j], q[j + 1], q[j + 2], pre), vk);
            x = _mm_loadu_ps(xc + 4 * (m * t + j));
            r = _mm_sqrt_ps(s);     /* x / (s^1/2 * s^1/4) */
            out = _mm_div_ps(x, _mm_mul_ps(r, _mm_sqrt_ps(r)));
            _mm_storeu_ps(y + 4 * (m * t + j), CAFFEPY_LRN4_MASK(out, j));
        }
    }
}

/* Backward pass 1 over one block run: dx = dy * s^-beta, keep = dy * x * s^(-beta-1) */
static inline __attribute__((always_inline)) void caffepy_lrn4_bwd1_mp(
        const float* xp, const float* xc, const float* xn, const float* dy, float* dx,
        float* keep, long L, int nv, int nn, float k, float a, const int m,
        const int pre, const int full) {
    const __m128 vk = _mm_set1_ps(k), va = _mm_set1_ps(a);
    __m128 q[18], s, p, inv, g;
    long t, o;
    int j;
    for (t = 0; t < L; t++) {
        caffepy_lrn4_load(q, xp, xc, xn, t, m, nv, nn, 1, full);
        for (j = 0; j < m; j++) {
            o = 4 * (m * t + j);
            s = _mm_fmadd_ps(va, caffepy_lrn4_window(q[j], q[j + 1], q[j + 2], pre), vk);
            p = caffepy_lrn4_pow(s, &inv);
            g = _mm_loadu_ps(dy + o);
            _mm_storeu_ps(dx + o, _mm_mul_ps(g, p));
            /* lanes past C kept at 0: pass 2's windows read them */
            _mm_storeu_ps(keep + o, CAFFEPY_LRN4_MASK(
                _mm_mul_ps(_mm_mul_ps(g, _mm_loadu_ps(xc + o)), inv), j));
        }
    }
}

/* Backward pass 2 over one block run: dx -= cache * x * window of keep (kp / kn: NULL
   past the ends); lanes past C of dx get 0 */
static inline __attribute__((always_inline)) void caffepy_lrn4_bwd2_mp(
        const float* kp, const float* kc, const float* kn, const float* xc, float* dx, long L,
        int nv, int nn, float cache, const int m, const int pre, const int full) {
    const __m128 vc = _mm_set1_ps(cache);
    __m128 q[18], d;
    long t, o;
    int j;
    for (t = 0; t < L; t++) {
        caffepy_lrn4_load(q, kp, kc, kn, t, m, nv, nn, 0, full);
        for (j = 0; j < m; j++) {
            o = 4 * (m * t + j);
            d = _mm_fnmadd_ps(_mm_mul_ps(vc, _mm_loadu_ps(xc + o)),
                              caffepy_lrn4_window(q[j], q[j + 1], q[j + 2], pre),
                              _mm_loadu_ps(dx + o));
            _mm_storeu_ps(dx + o, CAFFEPY_LRN4_MASK(d, j));
        }
    }
}

/* one copy of each for V = 8 and 16, local_size 1, 3, 5, 7, 9 and full or partial blocks,
   so the quarter and shift loops unroll and full blocks skip the lane masks */
#define CAFFEPY_LRN4_PRE(call, M, F) switch (pre) { case 0: call(M, 0, F); break; \
    case 1: call(M, 1, F); break; case 2: call(M, 2, F); break; \
    case 3: call(M, 3, F); break; default: call(M, 4, F); }
#define CAFFEPY_LRN4_DISPATCH(call) { \
    const int full_ = nv >= V && (nn >= 4 || nn <= 0); \
    if (V == 8) { if (full_) CAFFEPY_LRN4_PRE(call, 2, 1) else CAFFEPY_LRN4_PRE(call, 2, 0) } \
    else { if (full_) CAFFEPY_LRN4_PRE(call, 4, 1) else CAFFEPY_LRN4_PRE(call, 4, 0) } }

static void caffepy_lrn4_fwd(const float* xp, const float* xc, const float* xn, float* y,
                             long L, int nv, int nn, int V, int pre, float k, float a) {
    #define CAFFEPY_CALL(M, P, F) caffepy_lrn4_fwd_mp(xp, xc, xn, y, L, nv, nn, k, a, M, P, F)
    CAFFEPY_LRN4_DISPATCH(CAFFEPY_CALL)
    #undef CAFFEPY_CALL
}
static void caffepy_lrn4_bwd1(const float* xp, const float* xc, const float* xn,
                              const float* dy, float* dx, float* keep, long L, int nv, int nn,
                              int V, int pre, float k, float a) {
    #define CAFFEPY_CALL(M, P, F) caffepy_lrn4_bwd1_mp(xp, xc, xn, dy, dx, keep, L, nv, nn, \
                                                       k, a, M, P, F)
    CAFFEPY_LRN4_DISPATCH(CAFFEPY_CALL)
    #undef CAFFEPY_CALL
}
static void caffepy_lrn4_bwd2(const float* kp, const float* kc, const float* kn,
                              const float* xc, float* dx, long L, int nv, int nn, int V,
                              int pre, float cache) {
    #define CAFFEPY_CALL(M, P, F) caffepy_lrn4_bwd2_mp(kp, kc, kn, xc, dx, L, nv, nn, cache, M, P, F)
    CAFFEPY_LRN4_DISPATCH(CAFFEPY_CALL)
    #undef CAFFEPY_CALL
}
#else
#define CAFFEPY_LRN4 0
static void caffepy_lrn4_fwd(const float* xp, const float* xc, const float* xn, float* y,
                             long L, int nv, int nn, int V, int pre, float k, float a) {}
static void caffepy_lrn4_bwd1(const float* xp, const float* xc, const float* xn,
                              const float* dy, float* dx, float* keep, long L, int nv, int nn,
                              int V, int pre, float k, float a) {}
static void caffepy_lrn4_bwd2(const float* kp, const float* kc, const float* kn,
                              const float* xc, float* dx, long L, int nv, int nn, int V,
                              int pre, float cache) {}
#endif
