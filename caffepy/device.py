"""`caffepy device_query`: what this machine offers the engine."""
import functools
import os
import platform

from . import log


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def vector_isa(flags=None):
    """The widest vector unit: (name, float32 lanes)."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "AVX-512", 16
    if "avx2" in flags and "fma" in flags:
        return "AVX2+FMA", 8
    if "avx" in flags:
        return "AVX", 8
    return "SSE", 4


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.lru_cache(maxsize=None)
def blas_name():
    """The BLAS behind the kernels' matrix products (cext/blas_threads.h picks NumPy's own
    OpenBLAS when it can, else scipy's), as its build reports it: "numpy: scipy-openblas
    0.3.31.188.0"; "unknown" when the kernels are not built or the build does not say."""
    try:
        from .kernels import common
        which = common.blas_in_use()
        config = __import__(which).show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{which}: {config.get('name')} {config.get('version', '')}".strip()
    except Exception:  # BLAS details are a nicety; never fail on them
        return "unknown"


def threads_in_use():
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env and env.isdigit() else len(os.sched_getaffinity(0))


def query():
    isa, lanes = vector_isa()
    log.info(f"Device: CPU ({cpu_model()})")
    log.info(f"Cores available to this process: {len(os.sched_getaffinity(0))} (of {os.cpu_count()})")
    log.info(f"Vector ISA: {isa} ({lanes} float32 lanes; IntelPack block width {lanes})")
    from . import quantization
    log.info(f"int8 kernels (quantization_param): {quantization.isa()} (exact int32 sums; no "
             f"VNNI path yet: CPUs with AVX-512 VNNI or AVX-VNNI run the AVX2 kernels)")
    log.info(f"Threads in use: {threads_in_use()} (set OMP_NUM_THREADS to change)")
    log.info(f"BLAS: {blas_name()}")
    try:
        from mpi4py import MPI
        log.info(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()} "
                 f"(standard {'.'.join(map(str, MPI.Get_version()))}, {MPI.COMM_WORLD.Get_size()} rank(s))")
    except Exception as e:  # mpi4py missing or no MPI runtime: report, do not fail
        log.info(f"MPI: not available ({e})")
