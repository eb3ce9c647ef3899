/* Products with one narrow side, for InnerProduct at small batch (cext/common.pyx, skinny_gemm):
 * C [M, N] = op(A) [M, K] B [K, N], N (the batch, padded) a multiple of SK_W, B and C packed
 * row-major, A row-major or transposed. AlexNet's fc6 at b64 as y^T = W x^T runs here at
 * 112 GFLOP/s on one Zen 4 core against 76 in OpenBLAS, and its data gradient 106 against 58
 * (benchmarks/bench_skinny.py): the BLAS packs all of W, the one large operand, for a product
 * that reads it once.
 *
 * Each step of the reduction broadcasts SK_MR floats of A (one per row) against a row of
 * SK_Q vectors of B, into SK_MR x SK_Q sums held in registers; B's rows stay in cache while A
 * streams through once. */
#include <stddef.h>

#ifdef __AVX512F__
#define SK_W 16                 /* floats per vector */
#define SK_Q 4                  /* vectors per row of the block: 6 x 4 sums of 32 registers */
#else
#define SK_W 8
#define SK_Q 2                  /* 6 x 2 sums of 16 registers */
#endif
#define SK_MR 6
#define SK_KC_STRIDED 512      /* reduction steps per pass when A is read down its columns */
#define SK_KC_ROWS 256         /* ... and along its rows, when C has several column blocks */

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

/* C rows [m0, m1) of the product, m0 a multiple of SK_MR; accumulate adds to C. */
static void skinny_rows(int trans_a, int m0, int m1, int N, int K, const float *a, long lda,
                        const float *b, float *c, int accumulate)
{
    long ai = trans_a ? 1 : lda, ak = trans_a ? lda : 1;
    int width = SK_Q * SK_W;
    /* The reduction in blocks, each over every row block and column block of C: read down A's
     * columns, a pass over all of K would touch K lines per row block, and 512 steps of them
     * stay in cache for the next rows (fc6's data gradient 69 -> 104 GFLOP/s); read along A's
     * rows for several column blocks, 256 steps of a row block stay in L1 for all of them (fc6
     * forward at b64 with 8-float vectors, 4 column blocks: 0.72x the BLAS with all of K at
     * once, 1.0x so). */
    int kc = trans_a ? SK_KC_STRIDED : N > width ? SK_KC_ROWS : K;
    for (int k0 = 0; k0 < K; k0 += kc) {
        int kn = K - k0 < kc ? K - k0 : kc;
        for (int m = m0; m < m1; m += SK_MR) {
            int R = m1 - m < SK_MR ? m1 - m : SK_MR;
            for (int n = 0; n < N; n += width) {
                int Q = (N - n) / SK_W < SK_Q ? (N - n) / SK_W : SK_Q;
                sk_block(R, Q, kn, a + m * ai + k0 * ak, ai, ak, b + (long)k0 * N + n, N,
                         c + (long)m * N + n, N, accumulate || k0 > 0);
            }
        }
    }
}
