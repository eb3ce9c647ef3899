# OpenBLAS thread control for kernels that call BLAS (blas.pxd): every module that cimports
# blas includes this file, which binds the module's own BLAS thread setter (blas_threads.h)
# when it loads. Loops whose OpenMP threads each call a single-threaded BLAS set the count to
# 1 around the loop and restore it after (two thread pools at once oversubscribe the cores).

from blas cimport _sgemm64_fn     # the sgemm's type, declared once beside its caller
from rules cimport threads_for_macs

ctypedef void (*_set_threads_fn)(int) noexcept nogil
ctypedef int (*_get_threads_fn)() noexcept nogil

cdef extern from "blas_threads.h":
    _set_threads_fn _blas_set_threads "caffepy_blas_set_threads"
    _get_threads_fn _blas_get_threads "caffepy_blas_get_threads"
    _sgemm64_fn _blas_sgemm64 "caffepy_sgemm64"


cdef size_t _address(lib, str name):
    import ctypes
    fn = getattr(lib, name, None)
    return 0 if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


cdef _bind_blas():
    # A BLAS is a dependency of the extension module that links it (NumPy's core, scipy's
    # cython_blas), so the dynamic loader finds its symbols through that module's own handle.
    # NumPy's OpenBLAS first, its sgemm and thread count together (blas_threads.h says why).
    global _blas_set_threads, _blas_get_threads, _blas_sgemm64
    import ctypes
    from scipy.linalg import cython_blas
    try:
        from numpy._core import _multiarray_umath
        lib = ctypes.CDLL(_multiarray_umath.__file__)
        sgemm = _address(lib, "scipy_sgemm_64_")
        setter = _address(lib, "scipy_openblas_set_num_threads64_")
        getter = _address(lib, "scipy_openblas_get_num_threads64_")
        if sgemm and setter and getter:
            _blas_sgemm64 = <_sgemm64_fn>sgemm
            _blas_set_threads = <_set_threads_fn>setter
            _blas_get_threads = <_get_threads_fn>getter
            return
    except (ImportError, OSError):
        pass
    try:
        lib = ctypes.CDLL(cython_blas.__file__)
    except OSError:
        return
    for prefix in ("scipy_openblas", "openblas"):
        setter = _address(lib, prefix + "_set_num_threads")
        getter = _address(lib, prefix + "_get_num_threads")
        if setter and getter:
            _blas_set_threads = <_set_threads_fn>setter
            _blas_get_threads = <_get_threads_fn>getter
            return


def blas_in_use():
    """Which BLAS this module's matrix products call: "numpy" (NumPy's own OpenBLAS) or
    "scipy" (scipy.linalg.cython_blas)."""
    return "numpy" if _blas_sgemm64 != NULL else "scipy"


_bind_blas()


cdef inline int _task_threads(int T, Py_ssize_t tasks, Py_ssize_t macs) noexcept nogil:
    """OpenMP threads for a loop over `tasks` that each call a single-threaded BLAS, `macs`
    multiply-adds in all: the thread rule's count (rules.threads_for_macs), at most T and at
    most one per task; 1 when this BLAS's thread count cannot be set (its own threads would
    then multiply with ours)."""
    cdef int t = threads_for_macs(macs)
    if t > T:
        t = T
    if t > tasks:
        t = <int>tasks
    if t > 1 and _blas_set_threads == NULL:
        t = 1
    return t if t > 1 else 1
