/* The two 256-bit byte paths of the channels-last int8 convolution (int8_nhwc.h), the VNNI
 * path's layouts in 8-lane vectors (int8_vnni.h: bytes in quads, a signed input shifted by its
 * zero point, the weights' column tiles of 16 channels, nhwc_weights(isa='vnni')'s; a column
 * tile is two 8-lane vectors here, the depthwise convolution on bytes the VNNI path's in
 * halves of 8 channels). The epilogue and integer Winograd run the AVX2 path's kernels, the
 * byte MAX pooling a portable one (int8_nhwc.h). Their kernels are written once
 * (int8_bytes256.h) and built here for each:
 *
 * - AVX-VNNI (isa I8_AVXVNNI): the VEX-encoded vpdpbusd of CPUs that have VNNI without
 *   AVX-512 (Alder Lake and later cores, Xeon 6 E-cores). The same integers as every path.
 * - AVX2 on bytes (isa I8_AVX2BYTES, opt-in): vpdpbusd's sums by vpmaddubsw (u8 x s8, each
 *   pair of products summed into int16 with saturation), then vpmaddwd by ones (the int16
 *   pairs into int32) and vpaddd: 32 products in three instructions, where the AVX2 path's
 *   int16 pairs (int8_gemm.h) take two for 16. A pair's sum is exact only while it fits int16,
 *   |x1 w1 + x2 w2| <= 255 (|w1| + |w2|) <= 32767, so this path's weights are quantized at
 *   half the scale, |w| <= 64 (caffepy/quantization.py): as MKL-DNN quantizes them on CPUs
 *   without VNNI. The sums are then exact, but of other weights than the other paths': not
 *   their integers. */
#ifndef CAFFEPY_INT8_AVXVNNI_H
#define CAFFEPY_INT8_AVXVNNI_H
#include <stdint.h>
#include <string.h>
#include "int8_vnni.h"

#define I8_AVXVNNI 4        /* the isa numbers of these paths (int8_nhwc.h i8_isa_mask) */
#define I8_AVX2BYTES 5
#define I8_HALF_WEIGHT_MAX 64   /* the AVX2 byte path's weights lie in [-64, 64] */

#ifdef __AVX2__
#define I8H_BUILT 1
/* acc + vpdpbusd's sums, exact for weights in [-64, 64] (above) */
static inline __attribute__((always_inline)) __m256i i8h_dpbusd(__m256i acc, __m256i x,
                                                                 __m256i w)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w),
                                                    _mm256_set1_epi16(1)));
}
#define I8X_TARGET __attribute__((target("avx2,fma")))
#define I8X_FN(name) i8h_##name
#define I8X_DPBUSD(acc, x, w) i8h_dpbusd(acc, x, w)
#include "int8_bytes256.h"
#undef I8X_TARGET
#undef I8X_FN
#undef I8X_DPBUSD
#endif

/* compilers that know the avxvnni target (GCC 11, clang 12); an older one builds without it */
#if defined(__AVX2__) && ((defined(__clang__) && __clang_major__ >= 12) \
                          || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define I8X_BUILT 1
#define I8X_TARGET __attribute__((target("avx2,fma,avxvnni")))
#define I8X_FN(name) i8x_##name
#define I8X_DPBUSD(acc, x, w) _mm256_dpbusd_avx_epi32(acc, x, w)
#include "int8_bytes256.h"
#undef I8X_TARGET
#undef I8X_FN
#undef I8X_DPBUSD
#endif

#endif
