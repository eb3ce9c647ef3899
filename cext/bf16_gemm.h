/* bf16 matrix products (caffepy/precision.py: what bf16 means here): C[M][N] (+)= op(A) op(B)
 * with float32 operands in memory, rounded to bf16 when packed (nearest, ties to even; a NaN
 * stays a NaN of its sign), the products and sums in float32 by the hardware's bf16 dot
 * products: AMX tiles (TDPBF16PS) or AVX512_BF16 (VDPBF16PS).
 *
 * Both instructions treat bf16 subnormal inputs as zero and flush subnormal results (as does
 * the conversion VCVTNEPS2BF16): only values below 2^-126 differ from the emulation.
 *
 * Layouts, shared by both paths: a block of op(A) is packed in strips of 16 rows, each row kcp
 * bf16 (k padded with zeros to a multiple of 32): an AMX A tile (16 rows x 32 bf16) is one strided
 * load, and the AVX512 kernel broadcasts a row's pair of k as one int32. A block of op(B) is
 * packed in strips of 16 columns, each [kcp / 2][16][2] (a pair of consecutive k per column):
 * AMX's B tile layout, and one 512-bit load per pair of k for VDPBF16PS. Rows and columns past
 * the matrix are packed as zeros; the results past it are computed and never stored.
 *
 * The code past the target pragma uses AVX-512 and AMX: call it only when the CPU has them
 * (caffepy/precision.py decides), and AMX only after amx_permitted() said yes. */
#ifndef CAFFEPY_BF16_GEMM_H
#define CAFFEPY_BF16_GEMM_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>
#include "amx.h"

enum { BF_NONE = 0, BF_AVX512 = 1, BF_AMX = 2 };

#define BF_KC 512        /* k per block: an A strip (16 KiB) stays in L1 */
#define BF_NC 1024       /* columns per block: the B block (1 MiB) stays in L2 */
#define BF_MC 256        /* rows per block */

/* x rounded to bf16 as the packing rounds it, as float32 (the bias gradient's sum of the
 * rounded top diff): subnormals to zero as VCVTNEPS2BF16 does. */
static inline float bf_round(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu))
        u = (u | 0x400000u) & 0xFFFF0000u;
    else if ((u & 0x7F800000u) == 0)
        u &= 0x80000000u;
    else
        u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

/* op(X)(r, c) = p[r * rs + c * cs]; one of rs, cs is 1 */
typedef struct { const float *p; long rs, cs; } bf_mat;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

static inline __mmask16 bf_mask(long n)
{
    return n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

/* 16 floats (the first n of them, zeros after) as 16 bf16 */
static inline __m256i bf_cvt16(const float *p, long n)
{
    return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(bf_mask(n), p));
}

/* lane i = (lo[i], hi[i]) as one int32: the pair of two k for one row or column */
static inline __m512i bf_pairs(__m256i lo, __m256i hi)
{
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

/* 16 elements of op(X) from (r, c) along the unit stride, (n of them valid), gathered when the
 * unit stride is not along the direction wanted: then a scalar load each */
static inline __m256i bf_run(bf_mat x, long r, long c, long n, int along_rows)
{
    const float *p = x.p + r * x.rs + c * x.cs;
    long step = along_rows ? x.rs : x.cs;
    if (step == 1)
        return bf_cvt16(p, n);
    float t[16];
    for (long i = 0; i < 16; i++)
        t[i] = i < n ? p[i * step] : 0.0f;
    return bf_cvt16(t, 16);
}

/* r[16] as a 16 x 16 matrix of int32 (a bf16 pair each), transposed in place */
static inline void bf_transpose16(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* u[4q + c], 128-bit lane L: rows 4q..4q+3 of column 4L + c */
    for (int h = 0; h < 16; h += 8)
        for (int c = 0; c < 4; c++) {
            t[h + c] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0x88);
            t[h + 4 + c] = _mm512_shuffle_i32x4(u[h + c], u[h + 4 + c], 0xDD);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    }
}

/* rows [i0, i0+mc) x k [k0, k0+kc) of op(A) into strips of 16 rows x kcp */
static void bf_pack_a(bf_mat a, long i0, long k0, long mc, long kc, long kcp, uint16_t *ap)
{
    long strips = (mc + 15) / 16;
    if (a.cs == 1) {                  /* rows contiguous along k */
        for (long i = 0; i < strips * 16; i++) {
            uint16_t *row = ap + i * kcp;
            for (long k = 0; k < kcp; k += 16) {
                __m256i v = i < mc && k < kc ? bf_cvt16(a.p + (i0 + i) * a.rs + k0 + k, kc - k)
                                             : _mm256_setzero_si256();
                _mm256_storeu_si256((__m256i *)(row + k), v);
            }
        }
        return;
    }
    /* columns along i: pairs of k for 16 rows, 16 pairs at a time, transposed to the rows */
    for (long s = 0; s < strips; s++) {
        long n = mc - s * 16;
        for (long k = 0; k < kcp; k += 32) {
            __m512i r[16];
            for (int q = 0; q < 16; q++) {
                long kk = k + 2 * q;
                __m256i lo = kk < kc ? bf_run(a, i0 + s * 16, k0 + kk, n, 1) : _mm256_setzero_si256();
                __m256i hi = kk + 1 < kc ? bf_run(a, i0 + s * 16, k0 + kk + 1, n, 1)
                                         : _mm256_setzero_si256();
                r[q] = bf_pairs(lo, hi);
            }
            bf_transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512(ap + (s * 16 + i) * kcp + k, r[i]);
        }
    }
}

/* k [k0, k0+kc) x columns [j0, j0+nc) of op(B) into strips of 16 columns, [kcp/2][16][2] */
static void bf_pack_b(bf_mat b, long k0, long j0, long kc, long nc, long kcp, uint16_t *bp)
{
    long strips = (nc + 15) / 16;
    if (b.rs != 1) {                  /* rows of k contiguous along j (or neither) */
        for (long s = 0; s < strips; s++) {
            long n = nc - s * 16;
            __m512i *dst = (__m512i *)(bp + s * 16 * kcp);
            for (long kp = 0; kp < kcp / 2; kp++) {
                long k = 2 * kp;
                __m256i lo = k < kc ? bf_run(b, k0 + k, j0 + s * 16, n, 0) : _mm256_setzero_si256();
                __m256i hi = k + 1 < kc ? bf_run(b, k0 + k + 1, j0 + s * 16, n, 0)
                                        : _mm256_setzero_si256();
                _mm512_storeu_si512(dst + kp, bf_pairs(lo, hi));
            }
        }
        return;
    }
    /* columns contiguous along k: 32 k of a column are 16 pairs; 16 columns' are transposed */
    for (long s = 0; s < strips; s++) {
        long n = nc - s * 16;
        for (long k = 0; k < kcp; k += 32) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const float *col = b.p + (j0 + s * 16 + j) * b.cs + k0 + k;
                r[j] = j < n ? (__m512i)_mm512_cvtne2ps_pbh(
                                   _mm512_maskz_loadu_ps(bf_mask(kc - k - 16), col + 16),
                                   _mm512_maskz_loadu_ps(bf_mask(kc - k), col))
                             : _mm512_setzero_si512();
            }
            bf_transpose16(r);
            for (int q = 0; q < 16; q++)
                _mm512_storeu_si512(bp + s * 16 * kcp + (k / 2 + q) * 32, r[q]);
        }
    }
}

/* c[i][j] (+)= r[i][j] for i < mr, j < nr; r a 16-float row each */
static inline void bf_store_row(float *c, __m512 r, long nr, int add)
{
    __mmask16 m = bf_mask(nr);
    if (add)
        r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(m, c));
    _mm512_mask_storeu_ps(c, m, r);
}

/* one strip of A (16 rows) x one strip of B (16 columns) with VDPBF16PS */
static void bf_micro_avx512(const uint16_t *a, const uint16_t *b, long kcp, float *c, long ldc,
                            long mr, long nr, int add)
{
    __m512 acc[16];
    const int32_t *a32 = (const int32_t *)a;
    long kh = kcp / 2;
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();
    for (long kp = 0; kp < kh; kp++) {
        __m512bh bv = (__m512bh)_mm512_loadu_si512(b + kp * 32);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(a32[i * kh + kp]), bv);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        if (i < mr)
            bf_store_row(c + i * ldc, acc[i], nr, add);
}

/* c[r][0 .. 16) and c[r][16 .. 32) (r < 16 ms, rows ldc floats apart) = rows a[16 ms][chunks
 * of 32 bf16] (lda bytes apart) times the column tiles b0 and b1 (b1 NULL: b0 alone) */
static void bf_tiles(const uint16_t *a, long lda, long chunks, int ms, const uint16_t *b0,
                     const uint16_t *b1, float *c, long ldc)
{
    const char *a0 = (const char *)a, *a1 = a0 + 16 * lda;
    amx_zero_sums();
    for (long k = 0; k < chunks; k++) {
        _tile_loadd(4, a0 + k * 64, lda);
        _tile_loadd(6, b0 + k * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (b1) {
            _tile_loadd(7, b1 + k * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (ms > 1) {
            _tile_loadd(5, a1 + k * 64, lda);
            _tile_dpbf16ps(2, 5, 6);
            if (b1)
                _tile_dpbf16ps(3, 5, 7);
        }
    }
    amx_store_sums(c, ldc, ms > 1, b1 != NULL);
}

/* up to two strips of A x two strips of B (ms, ns: 1 or 2) with TDPBF16PS, into c's mr x nr
 * (added to it with `add`) */
static void bf_micro_amx(const uint16_t *a, int ms, const uint16_t *b, int ns, long kcp,
                         float *c, long ldc, long mr, long nr, int add)
{
    float out[32 * 32] __attribute__((aligned(64)));
    bf_tiles(a, kcp * 2, kcp / 32, ms, b, ns > 1 ? b + 16 * kcp : NULL, out, 32);
    long rows = mr < 16 * ms ? mr : 16 * ms;
    for (long i = 0; i < rows; i++)
        for (int t = 0; t < ns; t++)
            bf_store_row(c + i * ldc + 16 * t, _mm512_load_ps(out + 32 * i + 16 * t),
                         nr - 16 * t, add);
}

/* each thread's packing buffers, kept for the thread's life (a per-call allocation of this
 * size is an mmap and its page faults each time) */
static __thread uint16_t *bf_abuf, *bf_bbuf;

static int bf_buffers(void)
{
    if (!bf_abuf)
        bf_abuf = aligned_alloc(64, (size_t)BF_MC * BF_KC * 2);
    if (!bf_bbuf)
        bf_bbuf = aligned_alloc(64, (size_t)BF_KC * BF_NC * 2);
    return bf_abuf && bf_bbuf;
}

/* bf16 values of op(A) [M][K] packed once for several products (a convolution's weights, the
same for every image): its K blocks one after the other, each strips of 16 rows x kcp */
static long bf_packed_size(long M, long K)
{
    return (M + 15) / 16 * 16 * ((K + 31) / 32 * 32);
}

static void bf_pack_all(bf_mat a, long M, long K, uint16_t *ap)
{
    long mp = (M + 15) / 16 * 16;
    for (long pc = 0; pc < K; pc += BF_KC) {
        long kc = K - pc < BF_KC ? K - pc : BF_KC;
        bf_pack_a(a, 0, pc, M, kc, (kc + 31) / 32 * 32, ap + mp * pc);
    }
}

/* C[M][N] (row stride ldc) (+)= op(A) op(B) on the calling thread; packed (or NULL): all of
 * op(A) packed by bf_pack_all, of mp rows, this product's rows from row0 */
static void bf_gemm_serial(int path, long M, long N, long K, bf_mat a, bf_mat b, float *c,
                           long ldc, int accumulate, const uint16_t *packed, long mp, long row0)
{
    uint16_t *ap = bf_abuf, *bp = bf_bbuf;
    for (long jc = 0; jc < N; jc += BF_NC) {
        long nc = N - jc < BF_NC ? N - jc : BF_NC;
        for (long pc = 0; pc < K; pc += BF_KC) {
            long kc = K - pc < BF_KC ? K - pc : BF_KC, kcp = (kc + 31) / 32 * 32;
            int add = accumulate || pc > 0;
            bf_pack_b(b, pc, jc, kc, nc, kcp, bp);
            for (long ic = 0; ic < M; ic += BF_MC) {
                long mc = M - ic < BF_MC ? M - ic : BF_MC;
                if (packed)
                    ap = (uint16_t *)packed + mp * pc + (row0 + ic) * kcp;
                else
                    bf_pack_a(a, ic, pc, mc, kc, kcp, ap);
                float *cb = c + ic * ldc + jc;
                if (path == BF_AMX) {
                    for (long i = 0; i < mc; i += 32)
                        for (long j = 0; j < nc; j += 32)
                            bf_micro_amx(ap + i * kcp, mc - i > 16 ? 2 : 1, bp + j * kcp,
                                         nc - j > 16 ? 2 : 1, kcp, cb + i * ldc + j, ldc,
                                         mc - i, nc - j, add);
                } else {
                    for (long i = 0; i < mc; i += 16)
                        for (long j = 0; j < nc; j += 16)
                            bf_micro_avx512(ap + i * kcp, bp + j * kcp, kcp, cb + i * ldc + j,
                                            ldc, mc - i, nc - j, add);
                }
            }
        }
    }
}

/* The product (A from `packed` when not NULL: bf_pack_all's of op(A)) on `threads` OpenMP
 * threads, each computing its own columns of C (or rows, when C has more rows than columns), in
 * multiples of 32. Returns 0 when a thread could not get its
 * packing buffers (then C is unspecified). */
static int bf_gemm(int path, long M, long N, long K, bf_mat a, bf_mat b, float *c, long ldc,
                   int accumulate, int threads, const uint16_t *packed)
{
    int ok = 1;
    if (M <= 0 || N <= 0)
        return 1;
    if (K <= 0) {
        if (!accumulate)
            for (long i = 0; i < M; i++)
                memset(c + i * ldc, 0, N * sizeof(float));
        return 1;
    }
#pragma omp parallel num_threads(threads) reduction(&& : ok)
    {
        long T = omp_get_num_threads(), t = omp_get_thread_num();
        int by_rows = M > N;
        long size = by_rows ? M : N;
        long part = ((size + T - 1) / T + 31) / 32 * 32;
        long lo = t * part, hi = lo + part < size ? lo + part : size;
        if (!bf_buffers()) {
            ok = 0;
        } else if (lo < hi) {
            bf_mat a2 = a, b2 = b;
            if (by_rows)
                a2.p += lo * a.rs;
            else
                b2.p += lo * b.cs;
            if (path == BF_AMX)
                amx_configure();
            bf_gemm_serial(path, by_rows ? hi - lo : M, by_rows ? N : hi - lo, K, a2, b2,
                           c + (by_rows ? lo * ldc : lo), ldc, accumulate, packed,
                           (M + 15) / 16 * 16, by_rows ? lo : 0);
            if (path == BF_AMX)
                _tile_release();
        }
    }
    return ok;
}

#pragma GCC pop_options
#endif
