/* Row-major C = alpha A op(B) + beta C on one thread, for the products cext/blas.pxd routes here
 * instead of to OpenBLAS: A untransposed and read where it lies, B (the smaller operand: weights,
 * Winograd's U) copied once per call, times alpha, into panels of PG_NW columns, each panel its K
 * rows of PG_NW floats (zeros past N).
 *
 * Why: OpenBLAS also copies A, and with beta 0 first zeroes all of C, a pass that costs most when
 * K or N is small. ResNet-50's thin 1x1 products at batch 16 on two threads (Zen 3, AVX2;
 * benchmarks/bench_gemm.py): K 64 x N 256, 50176 rows, 125 GFLOP/s in OpenBLAS against 143
 * here; K 64 x N 64 127 against 142; 256 x 256 Winograd products of 144 rows 116 against 160.
 * In ResNet-50 b16 the 1x1 layers at 56 x 56 took 258-264 -> 236-243 ms, at 28 x 28 240-245 ->
 * 223-228 ms.
 *
 * Order: rows of C PG_MB at a time (their A stays in L2), then PG_KC steps of the reduction
 * (other figures for few rows at 16 lanes: pg_blocking), then panel by panel (a panel's steps
 * stay in L1) every SK_MR rows through the register tile. Meanwhile the next block's A is
 * prefetched into L2, spread over the block's panels: A streamed from memory otherwise held a
 * thread to 70 GFLOP/s on K 256 x N 64 over 50176 rows, 80 with it (85-87 on rows in cache). A
 * block's rows go through the tile in tiles of as equal heights as can be: 49 rows as 4 x 6 + 5
 * x 5 rather than 8 x 6 + 1, whose one-row tile has too few sums in flight to hide the FMA's
 * latency (one thread, Zen 3: M 49 x N 512 x K 512 76.8 -> 79.5 GFLOP/s, M 25 x 256 x 256 62.2
 * -> 66.1; the same sums, bit for bit).
 *
 * A B that stays from call to call (a TEST net's weights, Winograd's U) is packed once
 * (caffepy_panel_pack) and kept by its caller, which then runs caffepy_panel_gemm_packed: at
 * batch 1 packing cost as much as the product (benchmarks/bench_gemm.py --b1). */
#ifndef CAFFEPY_GEMM_PANELS_H
#define CAFFEPY_GEMM_PANELS_H
#include <stdlib.h>
#include <string.h>
#include "gemm_tile.h"

#define PG_NW (SK_Q * SK_W)     /* columns of a panel: one row of the register tile */
#define PG_MB 192               /* rows of C per block */
#define PG_KC 512               /* reduction steps per pass over a block */
#if SK_W == 16
/* A product of few rows at 16 lanes (a TEST net's at batch 1: the weights come cold from memory
 * and serve few rows). A panel row is 256 B: 512 steps of it (128 KB) outgrew the 48 KB L1 of
 * a Sapphire Rapids, 128 (32 KB) stay there. Blocks as equal as can be, up to 384 rows (A's
 * block, 192 KB, in L2): M 196 in one block, not 192 + 4 whose 4-row tile runs the weights
 * through a second time. And each panel's weights are fetched into L2 while the panel before
 * is computed (pg_next_panel). Against the constants above without the fetch, weights cold,
 * one thread (the machine shared; benchmarks/bench_gemm.py --nhwc times these products):
 * M 196 N 1024 K 256 115 -> 141 GFLOP/s, 196 x 256 x 2304 126 -> 156, 784 x 512 x 256 124 ->
 * 135, 49 x 512 x 4608 98 -> 110. Over many rows (ResNet-50 b16's tasks of ~1000) the weights
 * stay in cache and passes of 128 steps re-read a block's C and read A in shorter runs: its
 * 1 x 1 layers of K 512-1024 ran 5-11% slower with these, so such products keep the above. */
#define PG_FEW_ROWS 768
#define PG_FEW_MB 384
#define PG_FEW_KC 128
/* Threads split a product of few rows by its rows (each part reading all the weights) where a
 * part gets at least this many: the weights then serve enough rows to come from memory twice
 * at no cost, and at ResNet-50 b1's 196 rows the two parts of 98 rows beat two halves of the
 * panels (blas.pxd by_panels; in the net: K 1024 x N 256 0.41-0.43 -> 0.36 ms, MobileNet's
 * 196 x 512 x 512 0.33 -> 0.31). At 49 rows (25 a part) the weights' traffic decides: halves
 * of the panels (res5's 9.4 MB of 3 x 3 weights: 0.90 ms, 1.11 by rows). */
#define PG_SPLIT_ROWS 64
#else
#define PG_FEW_ROWS 0
#define PG_FEW_MB PG_MB
#define PG_FEW_KC PG_KC
#define PG_SPLIT_ROWS 0
#endif

/* The longest reduction whose sums take one pass over every row count (pg_blocking): the sums
 * of a longer one are stored in C between passes, so C may not hold the epilogue's add then. */
#define PG_ONE_PASS_K (PG_FEW_KC < PG_KC ? PG_FEW_KC : PG_KC)

/* The calling thread's packing buffer, grown as needed and kept (OpenMP's threads live on);
 * NULL when it cannot grow. */
static float *pg_buffer(size_t floats)
{
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (floats > cap) {
        free(buf);
        buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        cap = buf ? floats : 0;
    }
    return buf;
}

/* bp[p][k][j] = alpha * op(B)[k, p * PG_NW + j], 0 past column N. */
static void pg_pack(int trans_b, int N, int K, float alpha, const float *restrict b, long ldb,
                    float *restrict bp)
{
    for (int j0 = 0; j0 < N; j0 += PG_NW) {
        int nj = N - j0 < PG_NW ? N - j0 : PG_NW;
        float *restrict dst = bp + (long)(j0 / PG_NW) * K * PG_NW;
        for (int k = 0; k < K; k++, dst += PG_NW) {
            if (trans_b)
                for (int j = 0; j < nj; j++)
                    dst[j] = alpha * b[(long)(j0 + j) * ldb + k];
            else
                for (int j = 0; j < nj; j++)
                    dst[j] = alpha * b[(long)k * ldb + j0 + j];
            for (int j = nj; j < PG_NW; j++)
                dst[j] = 0.0f;
        }
    }
}

/* Rows [0, R) of a panel's columns [j0, j0 + nj) of C (+)= the tile's product, through e (NULL:
 * none; at the block's first row and column); a width that is not whole vectors goes through
 * `spare` (SK_MR x PG_NW floats). */
static void pg_block(int R, int nj, int K, const float *a, long lda, const float *panel, float *c,
                     long ldc, int accumulate, float *spare, const sk_epi *e, const float *pf,
                     int fetch)
{
    if (nj % SK_W == 0) {
        sk_block(R, nj / SK_W, K, a, lda, 1, panel, PG_NW, c, ldc, accumulate, e, pf, fetch);
        return;
    }
    for (int r = 0; r < R; r++) {
        memset(spare + r * PG_NW, 0, sizeof(float) * PG_NW);
        if (accumulate)
            memcpy(spare + r * PG_NW, c + r * ldc, sizeof(float) * nj);
    }
    sk_block(R, SK_Q, K, a, lda, 1, panel, PG_NW, spare, PG_NW, accumulate, NULL, pf, fetch);
    for (int r = 0; r < R; r++) {
        if (e == NULL) {
            memcpy(c + r * ldc, spare + r * PG_NW, sizeof(float) * nj);
            continue;
        }
        for (int j = 0; j < nj; j++)
            c[r * ldc + j] = sk_epi_one(e, r, j, spare[r * PG_NW + j]);
    }
}

/* Rows of C per block and reduction steps per pass for a product of M rows (the header says
 * why): few rows at 16 lanes in blocks as equal as can be. */
static inline void pg_blocking(int M, int *mb, int *kc)
{
    *mb = PG_MB;
    *kc = PG_KC;
    if (M <= PG_FEW_ROWS) {
        int blocks = M > PG_FEW_MB ? (M + PG_FEW_MB - 1) / PG_FEW_MB : 1;
        *mb = (M + blocks - 1) / blocks;
        *kc = PG_FEW_KC;
    }
}

/* The weights the panel after (j0, k0) reads next (the next panel's slice of this pass, else
 * the first panel's of the next pass), `lines` of 16 floats of them in *lines; NULL at the
 * last, and for a product of many rows, whose weights stay in cache (few: the header). */
static inline const float *pg_next_panel(int M, int N, int K, int j0, int k0, int kc,
                                         const float *bp, long *lines)
{
    int k1 = k0 + kc;
    *lines = 0;
    if (M > PG_FEW_ROWS)
        return NULL;
    if (j0 + PG_NW < N) {
        *lines = (long)(K - k0 < kc ? K - k0 : kc) * PG_NW / 16;
        return bp + (long)(j0 / PG_NW + 1) * K * PG_NW + (long)k0 * PG_NW;
    }
    if (k1 < K) {
        *lines = (long)(K - k1 < kc ? K - k1 : kc) * PG_NW / 16;
        return bp + (long)k1 * PG_NW;
    }
    return NULL;
}

/* Floats of op(B) [K, N] packed into panels (caffepy_panel_pack). */
static inline long caffepy_packed_floats(int N, int K)
{
    return (long)((N + PG_NW - 1) / PG_NW) * K * PG_NW;
}

/* bp [caffepy_packed_floats(N, K)] = alpha * op(B) in panels: a product's B packed once and
 * kept (a TEST net's weights), for caffepy_panel_gemm_packed. The layout follows PG_NW, so a
 * module packs for its own products only (the AVX-512 build's panels are wider). */
static inline void caffepy_panel_pack(int trans_b, int N, int K, float alpha, const float *b, long ldb,
                                      float *bp)
{
    pg_pack(trans_b, N, K, alpha, b, ldb, bp);
}

/* C [M, N] = A [M, K] x the panels bp + beta * C (beta 0: C written without being read), then
 * through e (NULL: none) as the last pass over K stores each tile. A slice of C's columns that
 * starts on a panel (j0 a multiple of PG_NW) is the same call on bp + (j0 / PG_NW) * K * PG_NW,
 * c + j0 and e moved to column j0 (sk_epi_at); a slice of rows on a + i0 * lda, c + i0 * ldc
 * and e moved to row i0. */
static void caffepy_panel_gemm_packed(int M, int N, int K, const float *a, long lda,
                                      const float *bp, float beta, float *c, long ldc,
                                      const sk_epi *e)
{
    float spare[SK_MR * PG_NW];
    if (beta != 0.0f && beta != 1.0f)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++)
                c[(long)i * ldc + j] *= beta;
    int mb, kc;
    pg_blocking(M, &mb, &kc);
    for (int i0 = 0; i0 < M; i0 += mb) {
        int i1 = M - i0 < mb ? M : i0 + mb;
        /* tiles of as equal heights as can be (the header says why) */
        int tiles = (i1 - i0 + SK_MR - 1) / SK_MR, base = (i1 - i0) / tiles;
        int taller = (i1 - i0) % tiles;
        for (int k0 = 0; k0 < K; k0 += kc) {
            int kn = K - k0 < kc ? K - k0 : kc;
            int accumulate = k0 > 0 || beta != 0.0f;
            for (int j0 = 0; j0 < N; j0 += PG_NW) {
                int nj = N - j0 < PG_NW ? N - j0 : PG_NW;
                const float *panel = bp + (long)(j0 / PG_NW) * K * PG_NW + (long)k0 * PG_NW;
                /* this panel's share of the next block's A lines, fetched into L2 */
                int lines = (kn + 15) / 16, panels = (N + PG_NW - 1) / PG_NW;
                int l0 = lines * (j0 / PG_NW) / panels, l1 = lines * (j0 / PG_NW + 1) / panels;
                /* and a share of the next panel's weights per tile, fetched into L2 */
                long next_lines;
                const float *next = pg_next_panel(M, N, K, j0, k0, kc, bp, &next_lines);
                /* a last pass that adds the epilogue's add (a block end): the next block's
                 * lines of this panel's add, and of C, which may be the add itself, fetched
                 * into L2 a tile's rows at a time, so the tiles' loads of the add do not wait
                 * for memory */
                int adds = k0 + kn >= K && i1 < M && e != NULL && e->add != NULL;
                const float *add = adds && !e->add_at_c ? e->add + j0 : NULL;
                int i = i0;
                for (int t = 0; t < tiles; t++) {
                    int h = base + (t < taller);
                    for (int r = i + mb; r < i + mb + h && r < M; r++) {
                        for (int l = l0; l < l1; l++)
                            __builtin_prefetch(a + (long)r * lda + k0 + 16 * l, 0, 2);
                        if (adds)
                            for (int l = 0; l < nj; l += 16) {
                                __builtin_prefetch(c + (long)r * ldc + j0 + l, 1, 2);
                                if (add != NULL)
                                    __builtin_prefetch(add + (long)r * e->ld_add + l, 0, 2);
                            }
                    }
                    long f0 = next_lines * t / tiles, f1 = next_lines * (t + 1) / tiles;
                    sk_epi at;
                    const sk_epi *ei = k0 + kn < K ? NULL : sk_epi_at(e, i, j0, &at);
                    pg_block(h, nj, kn, a + (long)i * lda + k0, lda, panel,
                             c + (long)i * ldc + j0, ldc, accumulate, spare, ei,
                             next + 16 * f0, (int)(f1 - f0));
                    i += h;
                }
            }
        }
    }
}

/* C [M, N] = alpha * A [M, K] op(B) + beta * C, op(B) = B [K, N] or, trans_b, B^T with B
 * [N, K]; beta 0 writes C without reading it. Returns 0 (nothing done) when the packing buffer
 * cannot be had. */
static int caffepy_panel_gemm(int trans_b, int M, int N, int K, float alpha, const float *a,
                              long lda, const float *b, long ldb, float beta, float *c, long ldc)
{
    float *bp = pg_buffer((size_t)caffepy_packed_floats(N, K));
    if (bp == NULL)
        return 0;
    pg_pack(trans_b, N, K, alpha, b, ldb, bp);
    caffepy_panel_gemm_packed(M, N, K, a, lda, bp, beta, c, ldc, NULL);
    return 1;
}

/* c[r] = alpha * (a . row r of b) + beta * c[r] for R rows (a constant at each call), two
 * vectors of each row a step in registers. */
static inline __attribute__((always_inline)) void
rg_dots(int R, int K, const float *restrict a, const float *restrict b, long ldb, float alpha,
        float beta, float *restrict c)
{
    sk_vec acc[4][2] = {{{0}, {0}}, {{0}, {0}}, {{0}, {0}}, {{0}, {0}}};
    int k = 0;
    for (; k + 2 * SK_W <= K; k += 2 * SK_W) {
        sk_vec x0 = *(const sk_vec *)(a + k), x1 = *(const sk_vec *)(a + k + SK_W);
        for (int r = 0; r < R; r++) {
            acc[r][0] += x0 * *(const sk_vec *)(b + r * ldb + k);
            acc[r][1] += x1 * *(const sk_vec *)(b + r * ldb + k + SK_W);
        }
    }
    for (int r = 0; r < R; r++) {
        sk_vec v = acc[r][0] + acc[r][1];
        float s = 0.0f;
        for (int l = 0; l < SK_W; l++)
            s += v[l];
        for (int kk = k; kk < K; kk++)
            s += a[kk] * b[r * ldb + kk];
        c[r] = alpha * s + (beta == 0.0f ? 0.0f : beta * c[r]);
    }
}

/* C [1, N] = alpha * a op(B) + beta * C for one row a, reading B once: the BLAS copies all of
 * B into its panels even for one row (ResNet-50's fc1000 at batch 1, 1000 x 2048 weights: 1.14
 * ms against 0.30 for this pass; Zen 3, two threads). trans_b (B [N, K], a row per output):
 * four rows' dot products at a time; else C's row is summed in place, four rows of B a step.
 * beta 0 writes C without reading it. */
static void caffepy_row_gemm(int trans_b, int N, int K, float alpha, const float *a,
                             const float *b, long ldb, float beta, float *c)
{
    if (trans_b) {
        int j = 0;
        for (; j + 4 <= N; j += 4)
            rg_dots(4, K, a, b + (long)j * ldb, ldb, alpha, beta, c + j);
        for (; j < N; j++)
            rg_dots(1, K, a, b + (long)j * ldb, ldb, alpha, beta, c + j);
        return;
    }
    for (int j = 0; j < N; j++)
        c[j] = beta == 0.0f ? 0.0f : beta * c[j];
    int k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *restrict b0 = b + (long)k * ldb, *restrict b1 = b0 + ldb;
        const float *restrict b2 = b1 + ldb, *restrict b3 = b2 + ldb;
        float x0 = alpha * a[k], x1 = alpha * a[k + 1], x2 = alpha * a[k + 2], x3 = alpha * a[k + 3];
        for (int j = 0; j < N; j++)
            c[j] += x0 * b0[j] + x1 * b1[j] + x2 * b2[j] + x3 * b3[j];
    }
    for (; k < K; k++) {
        const float *restrict bk = b + (long)k * ldb;
        float x = alpha * a[k];
        for (int j = 0; j < N; j++)
            c[j] += x * bk[j];
    }
}

/* Whether cext/blas.pxd runs C [M, N] = A [M, K] op(B) here rather than in the BLAS: where
 * benchmarks/bench_gemm.py and ResNet-50 measured it faster (N and K up to 512; at K 1024 the
 * two ran alike, at 2048 the BLAS 8-12% faster). Not for 512 x 512 (Winograd's U at 7 x 7):
 * alike alone, but ResNet-50's res5 3x3 layers took 135 -> 143 ms with it. */
static inline int caffepy_panels_wanted(int M, int N, int K)
{
    return M >= 48 && N >= 16 && N <= 512 && K >= 16 && K <= 512 && N * K <= 512 * 256;
}

#endif
