# The two rules every kernel module shares, cimported by each cext/*.pyx (the functions are
# inline, so no runtime module `rules` is imported):
#
# - how many OpenMP threads a parallel region gets for its amount of work (threads_for);
# - how a kernel refuses an argument that does not fit: one message shape,
#   `<kernel>: <argument>: <problem>, got <value>` (need, need_shape), as a ValueError.
#
# The dtype and the contiguity of an array are checked by the typed memoryview of the kernel's
# signature (`const float[:, :, ::1] x`): Cython raises a ValueError naming the expected dtype,
# or "ndarray is not C-contiguous", before the kernel runs.

cimport openmp

cdef enum:
    # Element operations (roughly) below which a parallel region costs more than it saves: waking
    # the team is microseconds, and on a busy machine its barrier waits for descheduled threads.
    # Measured on the kernels whose copies differed (SoftmaxWithLoss, the solver update, which
    # had 1 << 20): benchmarks/bench_kernels.py, cext/README.md.
    SERIAL_BELOW = 1 << 16


cdef inline int threads_for(Py_ssize_t work) noexcept nogil:
    """OpenMP threads for a region of `work` element operations: 1 (the calling thread) below
    SERIAL_BELOW, else all of them (OMP_NUM_THREADS, else the cores)."""
    return 1 if work < SERIAL_BELOW else openmp.omp_get_max_threads()


cdef inline tuple dims(const Py_ssize_t* shape, int ndim):
    """The first `ndim` extents of a memoryview's shape, as a tuple for messages and compares."""
    return tuple([shape[i] for i in range(ndim)])


cdef inline int need(bint ok, str kernel, str arg, str problem, got) except -1:
    """Raise `<kernel>: <arg>: <problem>, got <got>` unless ok."""
    if not ok:
        raise ValueError(f"{kernel}: {arg}: {problem}, got {got}")
    return 0


cdef inline int need_shape(str kernel, str arg, tuple got, tuple want) except -1:
    """Raise unless an array's shape is `want`."""
    return need(got == want, kernel, arg, f"needs shape {want}", got)
