/* AMX's tiles, as the int8 (int8_amx.h) and bf16 (bf16_gemm.h) kernels use them: Linux's
 * permission, and the one tile configuration both use (8 tiles of 16 rows x 64 bytes). */
#ifndef CAFFEPY_AMX_H
#define CAFFEPY_AMX_H
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Whether Linux lends this process the tile registers' state (8 KiB a thread): it does only
 * when asked (arch_prctl ARCH_REQ_XCOMP_PERM), once per process, which is asked here once per
 * module. The caller checks the CPU has AMX first. */
static inline int amx_permitted(void)
{
    static int state = -1;
#if defined(__AVX2__) && defined(SYS_arch_prctl)
    if (state < 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                        18 /* XFEATURE_XTILEDATA */) == 0;
#else
    state = 0;
#endif
    return state;
}

#ifdef __AVX2__
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Load this thread's tile configuration: tiles 0-7 of 16 rows x 64 bytes (palette 1). Each
 * thread that runs tiles loads it and ends with _tile_release(). */
__attribute__((target("amx-tile"))) static void amx_configure(void)
{
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    /* GCC's ldtilecfg builtin is not known to read the struct: without this it may drop the
     * stores to colsb and rows as dead (it did in int8_amx.h) */
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

/* The 2 x 2 sum tiles both kernels use: tile 0 (rows 0-15, columns 0-15), 1 (columns 16-31),
 * 2 (rows 16-31), 3 (both), of 4-byte sums (int32 or float) */
__attribute__((target("amx-tile"), always_inline)) static inline void amx_zero_sums(void)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* The sum tiles into c (rows ldc sums apart): tile 0, tile 1 with cols2, tiles 2 (and 3 with
 * cols2) with rows2 */
__attribute__((target("amx-tile"), always_inline)) static inline void
amx_store_sums(void *c, long ldc, int rows2, int cols2)
{
    char *c0 = (char *)c, *c2 = c0 + 16 * ldc * 4;
    _tile_stored(0, c0, ldc * 4);
    if (cols2)
        _tile_stored(1, c0 + 64, ldc * 4);
    if (rows2) {
        _tile_stored(2, c2, ldc * 4);
        if (cols2)
            _tile_stored(3, c2 + 64, ldc * 4);
    }
}
#endif

#endif
