# Row-major single-precision GEMM callable without the GIL, for every kernel module.
#
# `from blas cimport gemm` in any cext/*.pyx: the functions are inline, so no runtime
# module `blas` is imported; the call goes straight to the BLAS that scipy ships
# (scipy.linalg.cython_blas), which takes Fortran (column-major) arguments.
# A row-major C = op(A) @ op(B) is the column-major C^T = op(B)^T @ op(A)^T, so the
# operands and the sizes M, N are swapped on the way in; no data is moved.

from scipy.linalg.cython_blas cimport sgemm as _fortran_sgemm


cdef inline void gemm_ld(bint trans_a, bint trans_b, int M, int N, int K,
                         float alpha, const float* A, int lda, const float* B, int ldb,
                         float beta, float* C, int ldc) noexcept nogil:
    """C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, row-major with leading dims.

    beta == 0 overwrites C without reading it (NaNs in C do not propagate).
    """
    cdef char ta = b'T' if trans_a else b'N'
    cdef char tb = b'T' if trans_b else b'N'
    if M <= 0 or N <= 0:
        return
    if K <= 0:
        # BLAS leaves C untouched when K == 0 only if beta == 1; make the result explicit.
        _scale_rows(M, N, beta, C, ldc)
        return
    _fortran_sgemm(&tb, &ta, &N, &M, &K, &alpha, <float*>B, &ldb, <float*>A, &lda,
                   &beta, C, &ldc)


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
