/* The write half of cext/nhwc.pyx's reverse_axes tiles, eight by eight: rows of a tile held in
 * `buf` (row a at buf + a * ld) go out as runs of a, one per column j, each run where
 * caffepy_reverse_runs puts it. Eight rows are transposed in registers (three rounds of GCC
 * vector shuffles) and stored as eight-float runs instead of one float at a time: on one core,
 * ResNet-50's 2048 x 1024 pointwise weights 2.6 -> 1.3-1.5 ms, 512 x 512 x 3 x 3 3.3 -> 1.3-1.6
 * ms (a model's weights go through here every forward, their gradients every backward); small
 * ones, 64 x 32 x 5 x 5, stay at 20 us. Columns and rows past the last whole block of eight go
 * one float at a time.
 */
typedef float caffepy_t8 __attribute__((vector_size(32)));
typedef int caffepy_i8 __attribute__((vector_size(32)));

static inline caffepy_t8 caffepy_t8_load(const float *p)
{
    caffepy_t8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* c[k] = column k of the 8 x 8 block whose rows are r[0 .. 8) */
static inline void caffepy_transpose8(const caffepy_t8 r[8], caffepy_t8 c[8])
{
    const caffepy_i8 lo1 = {0, 8, 1, 9, 4, 12, 5, 13}, hi1 = {2, 10, 3, 11, 6, 14, 7, 15};
    const caffepy_i8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const caffepy_i8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    caffepy_t8 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], lo1);
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], hi1);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = __builtin_shuffle(t[i], t[i + 2], lo2);
        u[i + 1] = __builtin_shuffle(t[i], t[i + 2], hi2);
        u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], lo2);
        u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], hi2);
    }
    for (int k = 0; k < 4; k++) {
        c[k] = __builtin_shuffle(u[k], u[k + 4], lo4);
        c[k + 4] = __builtin_shuffle(u[k], u[k + 4], hi4);
    }
}

/* For j in [j0, j1): the run of n floats at dp + (j % S) * d0 + (j / S) * d1 = (or += with
 * add) buf[a * ld + j - j0] for a < n. */
static void caffepy_reverse_runs(const float *buf, long ld, long n, long j0, long j1, long S,
                                 float *dp, long d0, long d1, int add)
{
    long j = j0;
    for (; j + 8 <= j1; j += 8) {
        float *run[8];
        for (int k = 0; k < 8; k++)
            run[k] = dp + ((j + k) % S) * d0 + ((j + k) / S) * d1;
        long a = 0;
        for (; a + 8 <= n; a += 8) {
            caffepy_t8 r[8], c[8];
            for (int i = 0; i < 8; i++)
                r[i] = caffepy_t8_load(buf + (a + i) * ld + j - j0);
            caffepy_transpose8(r, c);
            for (int k = 0; k < 8; k++) {
                if (add)
                    c[k] += caffepy_t8_load(run[k] + a);
                __builtin_memcpy(run[k] + a, &c[k], sizeof c[k]);
            }
        }
        for (; a < n; a++)
            for (int k = 0; k < 8; k++) {
                float v = buf[a * ld + j + k - j0];
                run[k][a] = add ? run[k][a] + v : v;
            }
    }
    for (; j < j1; j++) {
        float *out = dp + (j % S) * d0 + (j / S) * d1;
        for (long a = 0; a < n; a++) {
            float v = buf[a * ld + j - j0];
            out[a] = add ? out[a] + v : v;
        }
    }
}
