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

/* C rows [0, R), columns [0, Q * SK_W) (+)= A rows [0, R) x B over k < K; A(i, k) at
 * a[i * ai + k * ak]. Q and R are constants at every call (sk_block's switch). */
static inline __attribute__((always_inline)) void
sk_tile(int R, int Q, int K, const float *restrict a, long ai, long ak,
        const float *restrict b, long ldb, float *restrict c, long ldc, int accumulate)
{
    sk_vec acc[SK_MR][SK_Q];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < Q; q++)
            acc[r][q] = (sk_vec){0};
    for (int k = 0; k < K; k++) {
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
    for (int r = 0; r < R; r++)
        for (int q = 0; q < Q; q++) {
            sk_vec *o = (sk_vec *)(c + r * ldc + q * SK_W);
            *o = accumulate ? *o + acc[r][q] : acc[r][q];
        }
}

#define SK_ROWS(Q)                                                                       \
    switch (R) {                                                                         \
    case 6: sk_tile(6, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate); break;              \
    case 5: sk_tile(5, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate); break;              \
    case 4: sk_tile(4, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate); break;              \
    case 3: sk_tile(3, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate); break;              \
    case 2: sk_tile(2, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate); break;              \
    default: sk_tile(1, Q, K, a, ai, ak, b, ldb, c, ldc, accumulate); break;             \
    }

static void sk_block(int R, int Q, int K, const float *a, long ai, long ak, const float *b,
                     long ldb, float *c, long ldc, int accumulate)
{
    if (Q == SK_Q) { SK_ROWS(SK_Q) }
#if SK_Q == 4
    else if (Q == 3) { SK_ROWS(3) }
    else if (Q == 2) { SK_ROWS(2) }
#endif
    else { SK_ROWS(1) }
}

#endif
