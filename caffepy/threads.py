"""How caffepy uses the cores: the OpenMP and BLAS defaults, set before their runtimes load.

The kernels run on one pool of OpenMP threads, matrix products included (cext/blas.pxd calls
scipy's OpenBLAS single-threaded on those threads). Each parallel region is sized by its work
and by the cores that other processes leave free (the thread rule: cext/rules.pxd, rules.h), so
a small layer runs on the calling thread and a shared machine costs no more than one thread.

Idle threads spin briefly, then sleep. OpenMP runtimes spin long by default between parallel
regions (libgomp for up to ~300,000 iterations, OpenBLAS's own pool for up to 2^28 cycles after
every call): on a machine whose cores are all busy, a spinning thread takes the core that the
thread a region waits for needs, and batch-1 cifar10_quick ran 9-100x slower on two threads than
on one (issue 12). Threads that sleep at once cost the other way: waking one took 15-50 us, and
much more on a virtual machine whose idle vCPU the host had descheduled, so GoogLeNet b16
trained 6-10% slower than with a spin of about a millisecond (GOMP_SPINCOUNT=30000 here), which
bridges the gaps between one layer's regions and the next's. The spin is bounded and the thread
rule measures other processes' load without our own threads (rules.h), so a busy machine still
gets one thread. `set_defaults()` runs when caffepy is imported, before any kernel loads libgomp
and before numpy and scipy load their OpenBLAS, and sets for this process and its children,
unless you set them yourself:

    GOMP_SPINCOUNT=30000         (unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set)
    OPENBLAS_THREAD_TIMEOUT=4    (OpenBLAS's threads sleep 2^4 cycles after a call)

OMP_WAIT_POLICY=PASSIVE sleeps at once; OMP_WAIT_POLICY=ACTIVE spins for the lowest latency, and
the thread rule then uses every thread (OMP_NUM_THREADS, else the cores) whatever the load: the
cores are yours. A runtime that loaded before caffepy (a library imported first that links the
same libgomp) keeps what it read then.
"""
import os

DEFAULTS = {
    "GOMP_SPINCOUNT": ("30000", ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")),
    "OPENBLAS_THREAD_TIMEOUT": ("4", ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")),
}


def set_defaults(environ=os.environ):
    """Set each default of DEFAULTS unless one of the variables that decide it is set."""
    for name, (value, deciding) in DEFAULTS.items():
        if not any(environ.get(var) for var in deciding):
            environ[name] = value


set_defaults()
