# The two rules every kernel module shares, cimported by each cext/*.pyx (the functions are
# inline, so no runtime module `rules` is imported):
#
# - how many OpenMP threads a parallel region gets for its amount of work (threads_for,
#   threads_for_macs);
# - how a kernel refuses an argument that does not fit: one message shape,
#   `<kernel>: <argument>: <problem>, got <value>` (need, need_shape), as a ValueError.
#
# The dtype and the contiguity of an array are checked by the typed memoryview of the kernel's
# signature (`const float[:, :, ::1] x`): Cython raises a ValueError naming the expected dtype,
# or "ndarray is not C-contiguous", before the kernel runs.

cimport openmp

cdef extern from "rules.h":
    int caffepy_team_limit() noexcept nogil

cdef enum:
    # The least work, in element operations (one float read, computed and written: ~0.15 ns on
    # one core), that pays for one more thread: waking a passively waiting thread and joining
    # it costs 15-20 us, and a region of PER_THREAD ops per thread takes ~40 us. Measured:
    # benchmarks/bench_threads.py, cext/README.md.
    PER_THREAD = 1 << 18
    # Multiply-adds of a matrix product (sgemm) per element operation, by time on one core.
    MACS_PER_OP = 4


cdef inline int threads_for(Py_ssize_t work) noexcept nogil:
    """OpenMP threads for a region of `work` element operations: one per PER_THREAD of work, at
    most the team limit of rules.h (OMP_NUM_THREADS, else the cores; fewer when other processes
    want the cores), and 1 inside a parallel region (no nested teams)."""
    cdef int limit
    if work < 2 * PER_THREAD or openmp.omp_in_parallel():
        return 1
    limit = caffepy_team_limit()
    return limit if work // PER_THREAD > limit else <int>(work // PER_THREAD)


cdef inline int threads_for_macs(Py_ssize_t macs) noexcept nogil:
    """threads_for a region of `macs` multiply-adds of matrix products."""
    return threads_for(macs // MACS_PER_OP)


cdef inline Py_ssize_t pixel_stride(str kernel, float[:, :, :, :] y, int O) except -1:
    """Floats between the pixels of a forward's channels-last output y [N, oh, ow, O]: O, or
    more for a run of a wider array's channels (a concat's top written in place), whose pixels
    must then be equally spaced throughout."""
    cdef Py_ssize_t ps = y.strides[2] // sizeof(float)
    need(y.strides[3] == sizeof(float) and ps >= O and y.strides[1] == y.shape[2] * y.strides[2]
         and y.strides[0] == y.shape[1] * y.strides[1], kernel, "y",
         "needs its pixels equally spaced (its own array, or a run of a wider one's channels)",
         tuple([y.strides[i] for i in range(4)]))
    return ps


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
