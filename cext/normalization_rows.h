/* Row reductions of the BatchNorm / MVN kernels, for cext/normalization.pyx.
 *
 * 16 float partial sums, the pattern GCC vectorizes without -ffast-math (each lane is its own
 * accumulator, so no reassociation is needed); the lanes and the tail are added in double.
 */
static double caffepy_row_sum(const float* x, long n, float shift) {
    float acc[16] = {0};
    long i = 0, l;
    double total = 0.0;
    for (; i + 16 <= n; i += 16)
        for (l = 0; l < 16; l++) acc[l] += x[i + l] - shift;
    for (; i < n; i++) total += x[i] - shift;
    for (l = 0; l < 16; l++) total += acc[l];
    return total;
}
static double caffepy_row_sumsq(const float* x, long n, float shift) {
    float acc[16] = {0};
    long i = 0, l;
    double total = 0.0;
    for (; i + 16 <= n; i += 16)
        for (l = 0; l < 16; l++) {
            float d = x[i + l] - shift;
            acc[l] += d * d;
        }
    for (; i < n; i++) {
        float d = x[i] - shift;
        total += d * d;
    }
    for (l = 0; l < 16; l++) total += acc[l];
    return total;
}
/* *sa += sum a, *sab += sum a * b */
static void caffepy_row_dots(const float* a, const float* b, long n, double* sa, double* sab) {
    float acc[16] = {0}, acc2[16] = {0};
    long i = 0, l;
    double t1 = 0.0, t2 = 0.0;
    for (; i + 16 <= n; i += 16)
        for (l = 0; l < 16; l++) {
            acc[l] += a[i + l];
            acc2[l] += a[i + l] * b[i + l];
        }
    for (; i < n; i++) {
        t1 += a[i];
        t2 += a[i] * b[i];
    }
    for (l = 0; l < 16; l++) {
        t1 += acc[l];
        t2 += acc2[l];
    }
    *sa += t1;
    *sab += t2;
}
