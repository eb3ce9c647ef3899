/* The vectorizable pieces of the loss kernels, for cext/loss.pyx: exp and log1p without a libm
 * call, row maxima, sums of exponentials, and SigmoidCrossEntropyLoss's terms.
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

/* log(1 + e) for e in [0, 1], about 1 ulp, e itself kept exact (no rounding of 1 + e): with
   k = 1 when 1 + e > sqrt 2, log(1 + e) = k ln2 + log(1 + z), z = e or (e - 1) / 2 in
   [-0.293, 0.415], and log(1 + z) = z - z^2 / 2 + z^3 P(z) with Cephes' logf coefficients. */
static inline float caffepy_log1p_unit(float e) {
    int32_t k = -(caffepy_bits(e) > caffepy_bits(0.41421356f));         /* 0 or -1 */
    float z = caffepy_float((caffepy_bits((e - 1.0f) * 0.5f) & k) | (caffepy_bits(e) & ~k));
    float z2 = z * z;
    float p = 7.0376836292e-2f;
    p = p * z - 1.1514610310e-1f;
    p = p * z + 1.1676998740e-1f;
    p = p * z - 1.2420140846e-1f;
    p = p * z + 1.4249322787e-1f;
    p = p * z - 1.6668057665e-1f;
    p = p * z + 2.0000714765e-1f;
    p = p * z - 2.4999993993e-1f;
    p = p * z + 3.3333331174e-1f;
    float n = (float)(-k);
    float y = p * z * z2 + n * -2.12194440e-4f - 0.5f * z2;
    return z + y + n * 0.693359375f;
}

/* |x|'s negation without a float compare */
static inline float caffepy_minus_abs(float x) {
    return caffepy_float(caffepy_bits(x) | (int32_t)0x80000000);
}

/* One element of SigmoidCrossEntropyLoss, with e = exp(-|x|) in (0, 1] (no overflow for any
   x): the loss term max(x, 0) - x t + log(1 + e), and sigmoid(x) = (x < 0 ? e : 1) / (1 + e). */
static inline float caffepy_sigmoid_ce_term(float x, float t) {
    int32_t neg = caffepy_bits(x) >> 31;
    float e = caffepy_exp(caffepy_minus_abs(x));
    return caffepy_float(caffepy_bits(x) & ~neg) - x * t + caffepy_log1p_unit(e);
}

static inline float caffepy_sigmoid(float x) {
    int32_t neg = caffepy_bits(x) >> 31;
    float e = caffepy_exp(caffepy_minus_abs(x));
    return caffepy_float((caffepy_bits(e) & neg) | (caffepy_bits(1.0f) & ~neg)) / (1.0f + e);
}

/* Whether target t is the ignore label: Caffe compares t cast to int (a target outside the
   int64 range, or NaN, is never ignored here rather than undefined) */
static inline int caffepy_ignored(float t, long long ignore) {
    return t > -9.2e18f && t < 9.2e18f && (long long)t == ignore;
}

/* The sum of the loss terms of n elements (16 partial sums so the loop vectorizes); with
   use_ignore, of those whose target is not `ignore`, their number in *kept. */
static float caffepy_sigmoid_ce_sum(const float* x, const float* t, long n, int use_ignore,
                                    long long ignore, long* kept) {
    float acc[16] = {0}, s = 0.0f;
    long i = 0, l, k = 0;
    if (use_ignore) {
        for (; i < n; i++)
            if (!caffepy_ignored(t[i], ignore)) {
                s += caffepy_sigmoid_ce_term(x[i], t[i]);
                k++;
            }
        *kept = k;
        return s;
    }
    for (; i + 16 <= n; i += 16)
        for (l = 0; l < 16; l++)
            acc[l] += caffepy_sigmoid_ce_term(x[i + l], t[i + l]);
    for (; i < n; i++)
        s += caffepy_sigmoid_ce_term(x[i], t[i]);
    for (l = 0; l < 16; l++) s += acc[l];
    *kept = n;
    return s;
}

/* d = (sigmoid(x) - t) * scale over n elements, 0 where the target is `ignore` */
static void caffepy_sigmoid_ce_grad(const float* x, const float* t, float scale, float* d, long n,
                                    int use_ignore, long long ignore) {
    for (long i = 0; i < n; i++)
        d[i] = (caffepy_sigmoid(x[i]) - t[i]) * scale;
    if (use_ignore)
        for (long i = 0; i < n; i++)
            if (caffepy_ignored(t[i], ignore))
                d[i] = 0.0f;
}
