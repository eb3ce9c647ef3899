/* The vectorizable pieces of the SoftmaxWithLoss kernels, for cext/loss.pyx: exp without a libm
 * call, row maxima, and sums of exponentials.
 */
#include <stdint.h>
#include <string.h>
/* Written without float compares or branches: under GCC's default -ftrapping-math a
   float compare or a speculated float operation keeps a loop scalar, so selects are
   made on integer bit patterns instead. */
static inline int32_t caffepy_bits(float x) { int32_t b; memcpy(&b, &x, 4); return b; }
static inline float caffepy_float(int32_t b) { float x; memcpy(&x, &b, 4); return x; }
/* a monotone map of float bit patterns to int32 (its own inverse) */
static inline int32_t caffepy_order(int32_t b) { return b ^ ((b >> 31) & 0x7FFFFFFF); }

/* exp(x) in float32 for x <= 88, about 1 ulp: x = n ln2 + r with |r| <= ln2/2, exp(r)
   by its Taylor series to r^7 (relative error < 1e-8 there), times 2^n built in the
   exponent bits. Below -87.3 (where exp(x) < FLT_MIN) the result is held at FLT_MIN:
   for a softmax term that is zero to within float precision of the sum. */
static inline float caffepy_exp(float x) {
    const int32_t lo = caffepy_bits(-87.33654f);
    int32_t xb = caffepy_bits(x);
    int32_t k = -((xb > lo) & (xb < 0));     /* negative and below lo */
    x = caffepy_float((lo & k) | (xb & ~k));
    /* round(x / ln2) by the 1.5 * 2^23 trick: exact float operations */
    float t = x * 1.44269504088896341f + 12582912.0f;
    float n = t - 12582912.0f;
    float r = x - n * 0.693359375f;          /* ln2 split in two parts so n * ln2 */
    r = r - n * -2.12194440e-4f;             /* is subtracted without rounding */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * caffepy_float(((int32_t)n + 127) << 23);
}

static float caffepy_row_max(const float* x, long n) {
    int32_t m = caffepy_order(caffepy_bits(x[0]));
    for (long i = 1; i < n; i++) {
        int32_t k = caffepy_order(caffepy_bits(x[i]));
        m = k > m ? k : m;
    }
    return caffepy_float(caffepy_order(m));
}

/* out = exp(x - m); returns the sum of out (16 partial sums so the loop vectorizes) */
static float caffepy_exp_sum(const float* x, float m, float* out, long n) {
    float acc[16] = {0};
    long i = 0, l;
    for (; i + 16 <= n; i += 16)
        for (l = 0; l < 16; l++) {
            out[i + l] = caffepy_exp(x[i + l] - m);
            acc[l] += out[i + l];
        }
    float s = 0.0f;
    for (; i < n; i++) {
        out[i] = caffepy_exp(x[i] - m);
        s += out[i];
    }
    for (l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* running max over classes for L positions, kept as ordered int32 */
static void caffepy_max_update(const float* x, int32_t* m, long L) {
    for (long j = 0; j < L; j++) {
        int32_t k = caffepy_order(caffepy_bits(x[j]));
        m[j] = k > m[j] ? k : m[j];
    }
}

/* out = exp(x - m), s += out for L positions */
static void caffepy_exp_acc(const float* x, const float* m, float* out, float* s, long L) {
    for (long j = 0; j < L; j++) {
        out[j] = caffepy_exp(x[j] - m[j]);
        s[j] += out[j];
    }
}
