/* Which BLAS the kernels call, and its thread count: for cext/blas.pxd and
 * cext/blas_threads.pxi.
 *
 * The sgemm: NumPy's own OpenBLAS when blas_threads.pxi finds it (NumPy's wheels ship a
 * 64-bit-integer OpenBLAS; here 0.3.31 against scipy's 0.3.30, 15-40% faster on one core on
 * the transposed products of weight gradients, dW = dy^T x, and alike on the others), else
 * scipy's (scipy.linalg.cython_blas). Both take Fortran arguments.
 *
 * caffepy threads its matrix products itself (one thread rule, one pool of briefly spinning
 * threads): every BLAS call of a kernel runs with the BLAS set to one thread, and the count the
 * user had is restored when the kernel is done. Static: each kernel module has its own pair of
 * pointers, bound by blas_threads.pxi when the module loads; NULL when scipy's BLAS is not an
 * OpenBLAS (its count cannot be set: it then threads each call itself, and nothing nests).
 */
typedef void (*caffepy_sgemm64_fn)(const char*, const char*, const long long*, const long long*,
                                   const long long*, const float*, const float*,
                                   const long long*, const float*, const long long*,
                                   const float*, float*, const long long*);
static caffepy_sgemm64_fn caffepy_sgemm64 = 0;

typedef void (*caffepy_set_threads_fn)(int);
typedef int (*caffepy_get_threads_fn)(void);
static caffepy_set_threads_fn caffepy_blas_set_threads = 0;
static caffepy_get_threads_fn caffepy_blas_get_threads = 0;

/* Set the BLAS to one thread; returns the count to restore (0: nothing to restore). */
static inline int caffepy_blas_serial(void) {
    int saved;
    if (caffepy_blas_set_threads == 0) return 0;
    saved = caffepy_blas_get_threads();
    if (saved == 1) return 0;
    caffepy_blas_set_threads(1);
    return saved;
}

static inline void caffepy_blas_restore(int saved) {
    if (saved > 1) caffepy_blas_set_threads(saved);
}

static inline int caffepy_blas_settable(void) {
    return caffepy_blas_set_threads != 0;
}
