# cython: language_level=3
"""bf16 matrix products (cext/bf16_gemm.h; caffepy/precision.py says what bf16 means and picks
the path): float32 operands rounded to bf16 when packed, products and sums in float32, on AMX
tiles or AVX512_BF16. Convolution's products run the same header from cext/vision.pyx. The NumPy
reference is in caffepy/kernels/reference/bf16.py.

Call these only with a path the CPU has: AVX512 = AVX512_BF16, AMX = AMX-BF16, the latter after
amx_permitted() returned True.
"""
from rules cimport dims, need, threads_for_macs

cdef extern from "amx.h" nogil:
    int _amx_permitted "amx_permitted"()

cdef extern from "bf16_gemm.h" nogil:
    ctypedef struct bf_mat:
        const float *p
        long rs, cs
    int BF_AVX512, BF_AMX
    int bf_gemm(int path, long M, long N, long K, bf_mat a, bf_mat b, float *c, long ldc,
                int accumulate, int threads, const unsigned short *packed)

AVX512 = BF_AVX512
AMX = BF_AMX
NAMES = {BF_AVX512: "AVX512_BF16", BF_AMX: "AMX-BF16"}

def amx_permitted():
    """Whether Linux lets this process use the AMX tiles (asked once; a kernel without AMX
    support, or one that refuses, says no)."""
    return bool(_amx_permitted())


cdef inline bf_mat _mat(const float[:, :] x):
    cdef bf_mat m
    m.p = &x[0, 0]
    m.rs = x.strides[0] // <Py_ssize_t>sizeof(float)
    m.cs = x.strides[1] // <Py_ssize_t>sizeof(float)
    return m


def gemm(const float[:, :] a, const float[:, :] b, float[:, ::1] c, bint accumulate, int path):
    """c[M, N] = a[M, K] @ b[K, N] in bf16 (c += with `accumulate`). a and b are any float32
    views (a transposed view is read in place; one with a unit stride packs fastest)."""
    cdef long M = a.shape[0], K = a.shape[1], N = b.shape[1]
    need(b.shape[0] == K, "bf16.gemm", "b", f"needs {K} rows (a's columns)", dims(b.shape, 2))
    need(c.shape[0] == M and c.shape[1] == N, "bf16.gemm", "c", f"needs shape {(M, N)}",
         dims(c.shape, 2))
    need(path == BF_AVX512 or (path == BF_AMX and _amx_permitted()), "bf16.gemm", "path",
         "must be AVX512, or AMX once amx_permitted()", path)
    if M == 0 or N == 0:
        return
    cdef bf_mat am, bm
    cdef int ok
    if K == 0:
        am.p = bm.p = NULL
        am.rs = am.cs = bm.rs = bm.cs = 1
    else:
        am, bm = _mat(a), _mat(b)
    with nogil:
        ok = bf_gemm(path, M, N, K, am, bm, &c[0, 0], c.shape[1], accumulate,
                     threads_for_macs(M * N * K), NULL)
    if not ok:
        raise MemoryError("bf16.gemm: no memory for the packing buffers")
