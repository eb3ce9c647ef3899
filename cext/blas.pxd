# Row-major single-precision GEMM callable without the GIL, for every kernel module.
#
# `from blas cimport gemm` in any cext/*.pyx: the functions are inline, so no runtime
# module `blas` is imported; the call goes straight to NumPy's own OpenBLAS when the module's
# blas_threads.pxi found it, else to the BLAS that scipy ships (scipy.linalg.cython_blas;
# blas_threads.h says why that order). Both take Fortran (column-major) arguments.
# A row-major C = op(A) @ op(B) is the column-major C^T = op(B)^T @ op(A)^T, so the
# operands and the sizes M, N are swapped on the way in; no data is moved. Products with A
# untransposed that the BLAS runs slowly (caffepy_panels_wanted) go to caffepy's own instead
# (gemm_panels.h). A product whose B is packed once and kept (a TEST net's weights) runs on
# the panels alone: gemm_packed, or packed_split and packed_part for a caller that splits the
# threads itself (cext/nhwc.pyx, whose epilogue the panels apply as they store C: sk_epi).
#
# Threads: inside a parallel region a product runs on the calling thread (the region set the
# BLAS to one thread: blas_threads.pxi). Outside one, a product gets threads_for_macs(M*N*K)
# OpenMP threads, each computing a slice of C with a single-threaded BLAS, so matrix products
# follow the thread rule of rules.pxd like every other kernel. A module that calls these must
# include blas_threads.pxi, which binds the BLAS and its thread setter; without it (or without
# an OpenBLAS) each product is one call to scipy's BLAS, which threads itself.

cimport openmp
from cython.parallel cimport prange
from scipy.linalg.cython_blas cimport sgemm as _fortran_sgemm

from rules cimport threads_for, threads_for_macs

ctypedef void (*_sgemm64_fn)(const char*, const char*, const long long*, const long long*,
                             const long long*, const float*, const float*, const long long*,
                             const float*, const long long*, const float*, float*,
                             const long long*) noexcept nogil

cdef extern from "gemm_panels.h" nogil:
    int caffepy_panel_gemm(int trans_b, int M, int N, int K, float alpha, const float* a,
                           long lda, const float* b, long ldb, float beta, float* c, long ldc)
    bint caffepy_panels_wanted(int M, int N, int K)
    void caffepy_row_gemm(int trans_b, int N, int K, float alpha, const float* a,
                          const float* b, long ldb, float beta, float* c)
    long caffepy_packed_floats(int N, int K)
    void caffepy_panel_pack(int trans_b, int N, int K, float alpha, const float* b, long ldb,
                            float* bp)
    ctypedef struct sk_epi:     # gemm_tile.h: what the last pass does to C as it stores it
        const float* scale
        const float* bias
        const float* add
        long ld_add
        int relu
        int add_at_c
    const sk_epi* sk_epi_at(const sk_epi* e, long i, long j, sk_epi* at)
    void caffepy_panel_gemm_packed(int M, int N, int K, const float* a, long lda,
                                   const float* bp, float beta, float* c, long ldc,
                                   const sk_epi* e)
    enum: PG_NW
    enum: PG_ONE_PASS_K
    enum: PG_KC
    enum: PG_FEW_ROWS
    enum: PG_SPLIT_ROWS

cdef extern from "blas_threads.h":
    _sgemm64_fn caffepy_sgemm64
    int caffepy_blas_serial() noexcept nogil
    void caffepy_blas_restore(int saved) noexcept nogil
    bint caffepy_blas_settable() noexcept nogil


cdef inline void _sgemm(bint trans_a, bint trans_b, int M, int N, int K, float alpha,
                        const float* A, int lda, const float* B, int ldb, float beta, float* C,
                        int ldc, bint panels) noexcept nogil:
    cdef char ta = b'T' if trans_a else b'N'
    cdef char tb = b'T' if trans_b else b'N'
    cdef long long m = M, n = N, k = K, la = lda, lb = ldb, lc = ldc
    if panels and M == 1 and not trans_a:
        caffepy_row_gemm(trans_b, N, K, alpha, A, B, ldb, beta, C)
        return
    if panels and not trans_a and caffepy_panels_wanted(M, N, K) \
            and caffepy_panel_gemm(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc):
        return
    if caffepy_sgemm64 != NULL:
        caffepy_sgemm64(&tb, &ta, &n, &m, &k, &alpha, B, &lb, A, &la, &beta, C, &lc)
        return
    _fortran_sgemm(&tb, &ta, &N, &M, &K, &alpha, <float*>B, &ldb, <float*>A, &lda,
                   &beta, C, &ldc)


cdef inline void _sgemm_split(int nt, bint trans_a, bint trans_b, int M, int N, int K,
                              float alpha, const float* A, int lda, const float* B, int ldb,
                              float beta, float* C, int ldc, bint panels) noexcept nogil:
    """The product on nt threads, each computing a block of C's columns (or of its rows, when
    C has more rows), blocks a multiple of 16 floats wide."""
    cdef int part, lo, hi, step
    if N >= M:
        step = ((N + nt - 1) // nt + 15) // 16 * 16
        for part in prange(nt, num_threads=nt, schedule="static"):
            lo = part * step
            hi = N if lo + step > N else lo + step
            if lo < hi:
                _sgemm(trans_a, trans_b, M, hi - lo, K, alpha, A, lda,
                       B + (<Py_ssize_t>lo * ldb if trans_b else lo), ldb, beta, C + lo, ldc,
                       panels)
    else:
        step = (M + nt - 1) // nt
        for part in prange(nt, num_threads=nt, schedule="static"):
            lo = part * step
            hi = M if lo + step > M else lo + step
            if lo < hi:
                _sgemm(trans_a, trans_b, hi - lo, N, K, alpha,
                       A + (lo if trans_a else <Py_ssize_t>lo * lda), lda, B, ldb, beta,
                       C + <Py_ssize_t>lo * ldc, ldc, panels)


cdef inline void gemm_ld(bint trans_a, bint trans_b, int M, int N, int K,
                         float alpha, const float* A, int lda, const float* B, int ldb,
                         float beta, float* C, int ldc) noexcept nogil:
    """C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major with leading dims.

    beta == 0 overwrites C without reading it (NaNs in C do not propagate).
    """
    gemm_ld_by(True, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)


cdef inline void gemm_ld_by(bint panels, bint trans_a, bint trans_b, int M, int N, int K,
                            float alpha, const float* A, int lda, const float* B, int ldb,
                            float beta, float* C, int ldc) noexcept nogil:
    """gemm_ld, with panels False: every product by the BLAS (for tests and benchmarks)."""
    cdef int nt, saved
    if M <= 0 or N <= 0:
        return
    if K <= 0:
        # BLAS leaves C untouched when K == 0 only if beta == 1; make the result explicit.
        _scale_rows(M, N, beta, C, ldc)
        return
    if openmp.omp_in_parallel() or not caffepy_blas_settable():
        _sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, panels)
        return
    # a product of one row (caffepy_row_gemm) does one multiply-add per float of B it reads:
    # an element operation each, not a quarter of one
    nt = (threads_for(<Py_ssize_t>N * K) if M == 1 and panels and not trans_a
          else threads_for_macs(<Py_ssize_t>M * N * K))
    saved = caffepy_blas_serial()
    if nt > 1:
        _sgemm_split(nt, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc,
                     panels)
    else:
        _sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, panels)
    caffepy_blas_restore(saved)


cdef inline void gemm(bint trans_a, bint trans_b, int M, int N, int K,
                      float alpha, const float* A, const float* B,
                      float beta, float* C) noexcept nogil:
    """C[M,N] = alpha * op(A) @ op(B) + beta * C for packed row-major operands.

    A is stored [M,K] (or [K,M] when trans_a), B is [K,N] (or [N,K] when trans_b).
    """
    gemm_ld(trans_a, trans_b, M, N, K, alpha, A, K if not trans_a else M,
            B, N if not trans_b else K, beta, C, N)


cdef inline void _scale_rows(int M, int N, float beta, float* C, int ldc) noexcept nogil:
    cdef int i, j
    for i in range(M):
        for j in range(N):
            C[i * ldc + j] = 0.0 if beta == 0.0 else beta * C[i * ldc + j]


cdef struct PackedSplit:
    int parts           # threads, one part of C each
    bint by_cols        # parts of whole panels (else of rows)


cdef inline bint by_panels(Py_ssize_t M, int N, int parts) noexcept nogil:
    """Whether `parts` threads split a product C [M, N] by ranges of its panels (each thread
    reading all of A) rather than of its rows: few rows (M <= N) and panels enough for the
    parts, unless each part would get PG_SPLIT_ROWS rows or more of a product of few rows (M <=
    PG_FEW_ROWS: the parts keep its blocking; gemm_panels.h says why)."""
    return (M <= N and (N + PG_NW - 1) // PG_NW >= parts
            and not (PG_SPLIT_ROWS > 0 and PG_SPLIT_ROWS * <Py_ssize_t>parts <= M <= PG_FEW_ROWS))


cdef inline PackedSplit packed_split(int M, int N, int K, int groups) noexcept nogil:
    """How `groups` products C [M, N] = A [M, K] x packed panels share the thread rule's threads:
    few rows (M <= N), each thread takes a range of every product's panels and reads all of A
    (the panels, the larger, are read once between the threads); many, a range of rows, each
    thread reading all the panels, and so too a product of few rows that gives each part
    PG_SPLIT_ROWS rows or more (by_panels). One part inside a parallel region."""
    cdef PackedSplit s
    s.parts = 1 if openmp.omp_in_parallel() else threads_for_macs(<Py_ssize_t>M * N * K * groups)
    s.by_cols = by_panels(M, N, s.parts)
    if not s.by_cols and s.parts > M:
        s.parts = max(M, 1)
    return s


cdef inline int packed_start(PackedSplit s, int part, int M, int N) noexcept nogil:
    """The first row (or column, on a panel) of part `part` of split s; part s.parts: the end."""
    cdef int step
    if s.by_cols:
        step = ((N + PG_NW - 1) // PG_NW + s.parts - 1) // s.parts * PG_NW
        return min(N, part * step)
    step = (M + s.parts - 1) // s.parts
    return min(M, part * step)


cdef inline void packed_part(PackedSplit s, int part, int M, int N, int K, const float* A,
                             int lda, const float* BP, float beta, float* C,
                             int ldc, const sk_epi* e=NULL) noexcept nogil:
    """Part `part` of split s of C [M, N] = A [M, K] x BP + beta * C on the calling thread,
    through the epilogue e (NULL: none; at C's first row and column) as it is stored."""
    cdef int lo = packed_start(s, part, M, N), hi = packed_start(s, part + 1, M, N)
    cdef sk_epi at
    if hi <= lo:
        return
    if s.by_cols:
        caffepy_panel_gemm_packed(M, hi - lo, K, A, lda,
                                  BP + <Py_ssize_t>(lo // PG_NW) * K * PG_NW, beta, C + lo, ldc,
                                  sk_epi_at(e, 0, lo, &at))
    else:
        caffepy_panel_gemm_packed(hi - lo, N, K, A + <Py_ssize_t>lo * lda, lda, BP, beta,
                                  C + <Py_ssize_t>lo * ldc, ldc, sk_epi_at(e, lo, 0, &at))


cdef inline void gemm_packed(int M, int N, int K, const float* A, int lda, const float* BP,
                             float beta, float* C, int ldc) noexcept nogil:
    """C [M, N] = A [M, K] x BP + beta * C (beta 0: C written without being read), BP the
    alpha * op(B) [K, N] that caffepy_panel_pack packed, on packed_split's threads."""
    cdef PackedSplit s
    cdef int part
    if M <= 0 or N <= 0:
        return
    s = packed_split(M, N, K, 1)
    if s.parts == 1:
        packed_part(s, 0, M, N, K, A, lda, BP, beta, C, ldc)
        return
    for part in prange(s.parts, num_threads=s.parts, schedule="static"):
        packed_part(s, part, M, N, K, A, lda, BP, beta, C, ldc)
