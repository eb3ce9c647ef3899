# OpenBLAS thread control for kernels that call BLAS (blas.pxd): every module that cimports
# blas includes this file, which binds the module's own BLAS thread setter (blas_threads.h)
# when it loads. Loops whose OpenMP threads each call a single-threaded BLAS set the count to
# 1 around the loop and restore it after (two thread pools at once oversubscribe the cores).

from rules cimport threads_for_macs

ctypedef void (*_set_threads_fn)(int) noexcept nogil
ctypedef int (*_get_threads_fn)() noexcept nogil

cdef extern from "blas_threads.h":
    _set_threads_fn _blas_set_threads "caffepy_blas_set_threads"
    _get_threads_fn _blas_get_threads "caffepy_blas_get_threads"


cdef _bind_blas_threads():
    # The BLAS behind scipy.linalg.cython_blas is a dependency of that extension module, so the
    # dynamic loader finds its thread setters through the module's own handle.
    global _blas_set_threads, _blas_get_threads
    import ctypes
    from scipy.linalg import cython_blas
    try:
        lib = ctypes.CDLL(cython_blas.__file__)
    except OSError:
        return
    for prefix in ("scipy_openblas", "openblas"):
        setter = getattr(lib, prefix + "_set_num_threads", None)
        getter = getattr(lib, prefix + "_get_num_threads", None)
        if setter is not None and getter is not None:
            _blas_set_threads = <_set_threads_fn><size_t>ctypes.cast(setter, ctypes.c_void_p).value
            _blas_get_threads = <_get_threads_fn><size_t>ctypes.cast(getter, ctypes.c_void_p).value
            return


_bind_blas_threads()


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
