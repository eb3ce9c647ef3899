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
#include "gemm_tile.h"

#define SK_KC_STRIDED 512      /* reduction steps per pass when A is read down its columns */
#define SK_KC_ROWS 256         /* ... and along its rows, when C has several column blocks */

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
                         c + (long)m * N + n, N, accumulate || k0 > 0, NULL, NULL, 0);
            }
        }
    }
}
