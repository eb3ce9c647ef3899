# OpenBLAS thread control for kernels that thread over images themselves: each OpenMP
# thread then calls a single-threaded BLAS (two thread pools at once oversubscribe the cores).
# Included (not cimported) by each kernel module: every module binds its own pointers.

from rules cimport threads_for

ctypedef void (*_set_threads_fn)(int) noexcept nogil
ctypedef int (*_get_threads_fn)() noexcept nogil
cdef _set_threads_fn _blas_set_threads = NULL
cdef _get_threads_fn _blas_get_threads = NULL


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


cdef inline int _task_threads(int T, Py_ssize_t tasks, Py_ssize_t work) noexcept nogil:
    """OpenMP threads for a loop over `tasks` that each call a single-threaded BLAS: the thread
    rule's count for `work` (rules.threads_for), at most T and at most one per task; 1 when this
    BLAS's thread count cannot be set (its own threads would then multiply with ours)."""
    cdef int t = threads_for(work)
    if t > T:
        t = T
    if t > tasks:
        t = <int>tasks
    if t > 1 and _blas_set_threads == NULL:
        t = 1
    return t if t > 1 else 1
