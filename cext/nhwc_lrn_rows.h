/* Rows of the channels-last LRN (cext/nhwc.pyx), in C: `restrict` on the work rows lets GCC
 * vectorize the window sums, which Cython's loops left scalar (the work rows might have
 * aliased). GoogLeNet's conv2/norm2 (16 x 56 x 56 x 192) on Zen 4, forward / backward: 9 / 17
 * -> 4-5 / 6-7 ms.
 *
 * Per pixel, scale = k + a * (sum of x^2 over the `size` channels centred on c, zero past the
 * ends), y = x * scale^-beta. The backward recomputes the scale:
 *     dx = dy * scale^-beta - cache * x * window sum of dy * x * scale^(-beta-1)
 * with cache = 2 alpha beta / size. A window sum is `size` shifted reads of a row padded with
 * pre = (size - 1) / 2 zeros on each side, in the task's work memory (3 * C + size floats).
 * y may be x and dx may be dy: every write is to the element just read at the same index.
 * `kind` is lrn_pow.pxi's: 0 beta 0.75, 1 beta 0.5, 2 beta 1, 3 any other.
 */
#include <math.h>

/* acc[c] = row[c] + ... + row[c + size - 1] */
static inline void caffepy_lrn_window(const float *restrict row, float *restrict acc, int C,
                                      int size)
{
    /* shifted pointers, not row[c + e]: with int indices GCC gathered */
    if (size == 5) {
        const float *r1 = row + 1, *r2 = row + 2, *r3 = row + 3, *r4 = row + 4;
        for (long c = 0; c < C; c++)
            acc[c] = row[c] + r1[c] + r2[c] + r3[c] + r4[c];
        return;
    }
    for (long c = 0; c < C; c++)
        acc[c] = row[c];
    for (int e = 1; e < size; e++) {
        const float *re = row + e;
        for (long c = 0; c < C; c++)
            acc[c] += re[c];
    }
}

/* s[c] = k + a * window sum of x^2; p[c] = s[c]^-beta */
static inline void caffepy_lrn_scale(const float *x, float *restrict row, float *restrict s,
                                     float *restrict p, int C, int size, float k, float a,
                                     float beta, int kind)
{
    float *restrict mid = row + (size - 1) / 2;
    for (int c = 0; c < C; c++)
        mid[c] = x[c] * x[c];
    caffepy_lrn_window(row, s, C, size);
    for (int c = 0; c < C; c++)
        s[c] = k + a * s[c];
    if (kind == 0)
        for (int c = 0; c < C; c++) {
            float r = sqrtf(s[c]);
            p[c] = 1.f / (r * sqrtf(r));
        }
    else if (kind == 1)
        for (int c = 0; c < C; c++)
            p[c] = 1.f / sqrtf(s[c]);
    else if (kind == 2)
        for (int c = 0; c < C; c++)
            p[c] = 1.f / s[c];
    else
        for (int c = 0; c < C; c++)
            p[c] = powf(s[c], -beta);
}

static void caffepy_lrn_forward_rows(const float *x, float *y, long rows, int C, int size,
                                     float k, float a, float beta, int kind, float *w)
{
    int pre = (size - 1) / 2;
    float *restrict row = w, *restrict s = w + C + 2 * pre, *restrict p = s + C;
    for (int c = 0; c < pre; c++)
        row[c] = row[pre + C + c] = 0.f;
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        float *yr = y + r * C;
        caffepy_lrn_scale(xr, row, s, p, C, size, k, a, beta, kind);
        for (int c = 0; c < C; c++)
            yr[c] = xr[c] * p[c];
    }
}

static void caffepy_lrn_backward_rows(const float *x, const float *dy, float *dx, long rows,
                                      int C, int size, float k, float a, float beta, int kind,
                                      float cache, float *w)
{
    int pre = (size - 1) / 2;
    float *restrict row = w, *restrict s = w + C + 2 * pre, *restrict p = s + C;
    float *restrict mid = row + pre;
    for (int c = 0; c < pre; c++)
        row[c] = row[pre + C + c] = 0.f;
    for (long r = 0; r < rows; r++) {
        const float *restrict xr = x + r * C;
        const float *gr = dy + r * C;
        float *dr = dx + r * C;
        caffepy_lrn_scale(xr, row, s, p, C, size, k, a, beta, kind);
        /* row <- dy * x * scale^(-beta - 1); its window sum is the cross-channel term */
        for (int c = 0; c < C; c++)
            mid[c] = gr[c] * xr[c] * p[c] / s[c];
        caffepy_lrn_window(row, s, C, size);
        for (int c = 0; c < C; c++)
            dr[c] = gr[c] * p[c] - cache * xr[c] * s[c];
    }
}
