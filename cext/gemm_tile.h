/* The register tile of caffepy's own matrix products (cext/common_skinny.h for InnerProduct at
 * small batch, cext/gemm_panels.h for products OpenBLAS runs slowly): up to SK_MR rows x SK_Q
 * vectors of C summed in registers, each step of the reduction broadcasting one float of A per
 * row against one row of SK_Q vectors of B. */
#ifndef CAFFEPY_GEMM_TILE_H
#define CAFFEPY_GEMM_TILE_H
#include <stddef.h>

#ifdef __AVX512F__
#define SK_W 16                 /* floats per vector */
#define SK_Q 4                  /* vectors per row of the block: 6 x 4 sums of 32 registers */
#else
#define SK_W 8
#define SK_Q 2                  /* 6 x 2 sums of 16 registers */
#endif
#define SK_MR 6

typedef float sk_vec __attribute__((vector_size(SK_W * 4), aligned(4)));
typedef int sk_ivec __attribute__((vector_size(SK_W * 4), aligned(4)));

/* What a product's last pass does to C before it stores it: c * scale[j] (NULL: 1) + bias[j]
 * (NULL: 0) + add[i * ld_add + j] (NULL: 0), then max(c, 0) if relu, j and i the columns and
 * rows of C this struct starts at (sk_epi_at). A TEST net's BatchNorm, Scale, Eltwise SUM and
 * ReLU after a convolution (cext/nhwc.pyx) then cost no pass over C of their own, whose rows
 * came back from memory when C outgrew the cache. add_at_c: add is C itself (ld_add its ldc),
 * each value read where the product's is about to go, which only a product of one pass over K
 * may do (cext/nhwc.pyx add_may_be_y); the tile reads it through add as any other (below), the
 * flag only tells the panels' prefetch that C's lines are the add's. */
typedef struct {
    const float *scale, *bias, *add;
    long ld_add;
    int relu;
    int add_at_c;
} sk_epi;

/* e moved to row i, column j of C (into *at); NULL for none */
static inline const sk_epi *sk_epi_at(const sk_epi *e, long i, long j, sk_epi *at)
{
    if (e == NULL)
        return NULL;
    *at = *e;
    at->scale = e->scale ? e->scale + j : NULL;
    at->bias = e->bias ? e->bias + j : NULL;
    at->add = e->add ? e->add + i * e->ld_add + j : NULL;
    return at;
}

/* one value of C through e at row r, column j (e already at the tile) */
static inline float sk_epi_one(const sk_epi *e, int r, int j, float v)
{
    if (e->scale)
        v = v * e->scale[j];
    if (e->bias)
        v = v + e->bias[j];
    if (e->add)
        v = v + e->add[r * e->ld_add + j];
    return e->relu ? (v > 0.0f ? v : 0.0f) : v;
}

/* C rows [0, R), columns [0, Q * SK_W) (+)= A rows [0, R) x B over k < K, through e (NULL:
 * none) on the way out; A(i, k) at a[i * ai + k * ak]. Meanwhile the `fetch` lines of 16
 * floats from pf on are fetched into L2, one every K / fetch steps: in a burst between two
 * tiles, the fetches of the next panel's weights (gemm_panels.h) filled the line buffers and
 * held the core until memory answered. Q and R are constants at every call (sk_block's
 * switch). */
static inline __attribute__((always_inline)) void
sk_tile(int R, int Q, int K, const float *restrict a, long ai, long ak,
        const float *restrict b, long ldb, float *restrict c, long ldc, int accumulate,
        const sk_epi *e, const float *pf, int fetch)
{
    int every = fetch > 0 && K / fetch > 1 ? K / fetch : 1, due = 0, fetched = 0;
    sk_vec acc[SK_MR][SK_Q];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < Q; q++)
            acc[r][q] = (sk_vec){0};
    for (int k = 0; k < K; k++) {
        if (fetched < fetch && k == due) {
            __builtin_prefetch(pf + 16 * fetched, 0, 2);
            fetched++;
            due += every;
        }
        const float *restrict bk = b + k * ldb;
        sk_vec bv[SK_Q];
        for (int q = 0; q < Q; q++)
            bv[q] = *(const sk_vec *)(bk + q * SK_W);
        for (int r = 0; r < R; r++) {
            float x = a[r * ai + k * ak];
            for (int q = 0; q < Q; q++)
                acc[r][q] += x * bv[q];
        }
    }
    for (; fetched < fetch; fetched++)
        __builtin_prefetch(pf + 16 * fetched, 0, 2);
    if (e == NULL) {
        for (int r = 0; r < R; r++)
            for (int q = 0; q < Q; q++) {
                sk_vec *o = (sk_vec *)(c + r * ldc + q * SK_W);
                *o = accumulate ? *o + acc[r][q] : acc[r][q];
            }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < Q; q++) {
            sk_vec *o = (sk_vec *)(c + r * ldc + q * SK_W);
            sk_vec v = accumulate ? *o + acc[r][q] : acc[r][q];
            if (e->scale)
                v = v * *(const sk_vec *)(e->scale + q * SK_W);
            if (e->bias)
                v = v + *(const sk_vec *)(e->bias + q * SK_W);
            /* add_at_c's add is C itself, read here through e->add as any add: one code path,
             * so the compiler cannot contract the two differently (on AVX2 the one-vector
             * tile's sums differed by an ulp between them) */
            if (e->add)
                v = v + *(const sk_vec *)(e->add + r * e->ld_add + q * SK_W);
            if (e->relu)    /* NaN > 0 is false: 0, as the scalar max */
                v = (sk_vec)((sk_ivec)v & (sk_ivec)(v > (sk_vec){0}));
            *o = v;
        }
}

/* fetch 0 a constant in its own copy of the tile, which then has no test in its loop */
#define SK_TILE(R, Q)                                                                     \
    if (fetch > 0)                                                                        \
        sk_tile(R, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate, e, pf, fetch);            \
    else                                                                                  \
        sk_tile(R, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate, e, NULL, 0);

#define SK_ROWS(Q)                                                                       \
    switch (R) {                                                                         \
    case 6: SK_TILE(6, Q) break;                                                         \
    case 5: SK_TILE(5, Q) break;                                                         \
    case 4: SK_TILE(4, Q) break;                                                         \
    case 3: SK_TILE(3, Q) break;                                                         \
    case 2: SK_TILE(2, Q) break;                                                         \
    default: SK_TILE(1, Q) break;                                                        \
    }

static void sk_block(int R, int Q, int K, const float *a, long ai, long ak, const float *b,
                     long ldb, float *c, long ldc, int accumulate, const sk_epi *e,
                     const float *pf, int fetch)
{
    if (Q == SK_Q) { SK_ROWS(SK_Q) }
#if SK_Q == 4
    else if (Q == 3) { SK_ROWS(3) }
    else if (Q == 2) { SK_ROWS(2) }
#endif
    else { SK_ROWS(1) }
}

#endif
