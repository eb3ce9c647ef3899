/* The AMX path of the channels-last int8 convolution (int8_nhwc.h, isa I8_AMX): the VNNI
 * path's bytes (int8_vnni.h: quads of u8 channels, a signed input plus 128, s8 weights) on
 * AMX tiles. tdpbusd multiplies a 16 x 64-byte tile of unsigned bytes by a 16 x 64-byte tile of
 * signed quads into 16 x 16 int32 sums, each a sum of groups of four products as vpdpbusd's, so
 * the integers, and the tops, are every other path's to the bit.
 *
 * A block of 32 output pixels at a time: their taps' quads are copied into rows of K4 bytes
 * (taps J quads padded with zeros to a multiple of 64 bytes: an A tile is 16 rows by one
 * 64-byte chunk of k), then for each pair of column tiles of 16 output channels, four sum
 * tiles (2 x 16 pixels by 2 x 16 channels) take every chunk: tiles 0-3 the sums, 4-5 the two
 * A tiles, 6-7 the two B tiles. The weights are the VNNI path's column tiles with each padded
 * to a multiple of 16 quads of zeros (nhwc_weights(isa='amx')), so a B tile (16 quads by 16
 * channels, 64 bytes a quad) is 1 KiB read as it lies.
 *
 * The path is offered only where Linux lends the tiles (amx.h); the tile configuration is a
 * thread's: each thread of a run loads it and releases the tiles. */
#ifndef CAFFEPY_INT8_AMX_H
#define CAFFEPY_INT8_AMX_H
#include <stdint.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "amx.h"
#include "int8_vnni.h"

#define I8_AMX 3                /* the isa number of this path (int8_nhwc.h i8_isa_available) */
#define I8A_M 32                /* output pixels a block */
#define I8A_K 16                /* quads of k a tile chunk */

/* Whether the CPU has AMX-INT8 and Linux lends this process its tiles */
static int i8a_usable(void)
{
#ifdef __AVX2__
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8")
           && amx_permitted();
#else
    return 0;
#endif
}

/* the quads of a column tile in the weights: taps J rounded up to whole chunks */
static inline long i8a_quads(int taps, int J)
{
    return ((long)taps * J + I8A_K - 1) / I8A_K * I8A_K;
}

/* Whether a convolution of few channels (int8_nhwc.h i8n_wide: a tap is a kernel row of J
 * quads) loads its taps' rows where they lie: the rows of 16 neighbouring output pixels' tap
 * are sw C bytes apart in the wide rows, so one tile load at that stride reads them, each tap
 * a chunk of its own (J <= 16 quads, the rest of the 64 bytes times zero weights) instead of
 * each pixel's taps copied side by side (ResNet-50's conv1: 7 copies of 24 bytes a pixel,
 * an eighth of its int8 forward at b16). Strides up to the kernel's width (the slack past the
 * rows, i8n_amx_pixels, assumes it). */
static inline int i8a_wide_rows(int wide, int J, int sw, int kw)
{
    return wide && J <= I8A_K && sw <= kw;
}

/* The quads of a column tile: i8a_quads, or a chunk a tap where the taps' rows are loaded in
 * place (i8a_wide_rows) */
static inline long i8a_tile_quads(int taps, int J, int wide_rows)
{
    return wide_rows ? (long)taps * I8A_K : i8a_quads(taps, J);
}

#ifdef __AVX2__
#define I8A_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl")))

I8A_TARGET static void i8a_begin(void)
{
    amx_configure();
}

I8A_TARGET static void i8a_end(void)
{
    _tile_release();
}

/* One chunk of k into the sum tiles: 16 rows from a0 (rows lda0 bytes apart) and 16 from a1
 * (lda1 apart), times the chunk of column tile b0 and of b1 (NULL: b0 alone) */
I8A_TARGET static inline __attribute__((always_inline)) void
i8a_chunk(const uint8_t *a0, long lda0, const uint8_t *a1, long lda1, const int8_t *b0,
          const int8_t *b1)
{
    _tile_loadd(4, a0, lda0);
    _tile_loadd(5, a1, lda1);
    _tile_loadd(6, b0, 64);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(2, 5, 6);
    if (b1) {
        _tile_loadd(7, b1, 64);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(3, 5, 7);
    }
}

/* c[r][0 .. 16) and c[r][16 .. 32) (r < 32, rows ldc int32 apart) = rows a[32][chunks 64
 * bytes] (rows lda bytes apart) times the column tiles b0 and b1 (b1 NULL: only the first) */
I8A_TARGET static void i8a_tile(const uint8_t *a, long lda, long chunks, const int8_t *b0,
                                const int8_t *b1, int32_t *c, long ldc)
{
    amx_zero_sums();
    for (long k = 0; k < chunks; k++)
        i8a_chunk(a + k * 64, lda, a + 16 * lda + k * 64, lda, b0 + k * 1024,
                  b1 ? b1 + k * 1024 : NULL);
    amx_store_sums(c, ldc, 1, b1 != NULL);
}

/* i8a_tile with each chunk t's rows loaded where they lie: the first 16 rows from a0[t], rows
 * lda0[t] bytes apart, the next 16 from a1[t], lda1[t] apart (0: one row for all 16) */
I8A_TARGET static void i8a_tile_taps(const uint8_t *const *a0, const long *lda0,
                                     const uint8_t *const *a1, const long *lda1, int chunks,
                                     const int8_t *b0, const int8_t *b1, int32_t *c, long ldc)
{
    amx_zero_sums();
    for (int k = 0; k < chunks; k++)
        i8a_chunk(a0[k], lda0[k], a1[k], lda1[k], b0 + (long)k * 1024,
                  b1 ? b1 + (long)k * 1024 : NULL);
    amx_store_sums(c, ldc, 1, b1 != NULL);
}
#endif

#endif
