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


@functools.lru_cache(maxsize=None)
def blas_kernel():
    """The kernel (core) OpenBLAS chose for this CPU, or that OPENBLAS_CORETYPE forced, as it
    names it ("Haswell", "SkylakeX", ...); None when the BLAS is not an OpenBLAS that says."""
    try:
        import ctypes
        from .kernels import common
        if common.blas_in_use() == "numpy":
            from numpy._core import _multiarray_umath
            lib, names = _multiarray_umath.__file__, ("scipy_openblas_get_corename64_",
                                                      "openblas_get_corename64_")
        else:
            from scipy.linalg import cython_blas
            lib, names = cython_blas.__file__, ("scipy_openblas_get_corename",
                                                "openblas_get_corename")
        lib = ctypes.CDLL(lib)
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    except Exception:  # BLAS details are a nicety; never fail on them
        pass
    return None


# vector_isa()'s names, narrowest first, and OpenBLAS's x86-64 kernels by the one they use
# (the others: SSE)
_ISAS = ("SSE", "AVX", "AVX2+FMA", "AVX-512")
_KERNEL_ISA = {"skylakex": "AVX-512", "cooperlake": "AVX-512", "sapphirerapids": "AVX-512",
               "haswell": "AVX2+FMA", "zen": "AVX2+FMA", "excavator": "AVX2+FMA",
               "sandybridge": "AVX", "bulldozer": "AVX", "piledriver": "AVX", "steamroller": "AVX"}


def blas_line():
    """The BLAS and the kernel it runs, as device_query and `caffepy time` print them."""
    kernel = blas_kernel()
    forced = os.environ.get("OPENBLAS_CORETYPE")
    return blas_name() + (f", {kernel} kernel" if kernel else "") + \
        (f" (OPENBLAS_CORETYPE={forced})" if forced and kernel else "")


@functools.lru_cache(maxsize=None)
def warn_forced_blas_kernel():
    """One warning per process when OPENBLAS_CORETYPE makes OpenBLAS run a kernel for an older
    vector ISA than this CPU has (on an AVX-512 CPU, Haswell's AVX2 kernel runs its matrix
    products at about half speed)."""
    forced, kernel = os.environ.get("OPENBLAS_CORETYPE"), blas_kernel()
    if not forced or not kernel:
        return
    isa, _ = vector_isa()
    theirs = _KERNEL_ISA.get(kernel.lower(), "SSE")
    if _ISAS.index(theirs) < _ISAS.index(isa):
        log.warning(f"OPENBLAS_CORETYPE={forced}: OpenBLAS runs its {kernel} kernel ({theirs}) "
                    f"on this {isa} CPU: its matrix products (most of a convolution's time) may "
                    f"run at half speed or less. Unset it to let OpenBLAS choose")


def engine_line():
    """The CPU's vector ISA, the kernels' path and the BLAS kernel, as `caffepy time`'s header
    says them."""
    from . import isa as isa_path
    isa, lanes = vector_isa()
    return (f"Engine: {cpu_model()}, vector ISA {isa} ({lanes} float32 lanes), "
            f"{threads_in_use()} threads; kernels {isa_path.describe()}; BLAS {blas_line()}")


def threads_in_use():
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env and env.isdigit() else len(os.sched_getaffinity(0))


def query():
    isa, lanes = vector_isa()
    log.info(f"Device: CPU ({cpu_model()})")
    log.info(f"Cores available to this process: {len(os.sched_getaffinity(0))} (of {os.cpu_count()})")
    from . import isa as isa_path
    log.info(f"Vector ISA: {isa} ({lanes} float32 lanes)")
    log.info(f"Kernels: {isa_path.describe()}; IntelPack block width {isa_path.lanes()}; "
             f"CAFFEPY_ISA={'|'.join(isa_path.PATHS)} forces a path")
    for path in isa_path.PATHS:
        if isa_path.unavailable(path):
            log.info(f"  {isa_path.skip_reason(path)}")
    from . import quantization
    log.info(f"int8 kernels (quantization_param): {quantization.describe()}")
    from . import precision
    log.info(f"bf16 (-precision bf16): {precision.availability()}")
    log.info(f"Threads in use: {threads_in_use()} (set OMP_NUM_THREADS to change)")
    log.info(f"BLAS: {blas_line()}")
    warn_forced_blas_kernel()
    try:
        from mpi4py import MPI
        log.info(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()} "
                 f"(standard {'.'.join(map(str, MPI.Get_version()))}, {MPI.COMM_WORLD.Get_size()} rank(s))")
    except Exception as e:  # mpi4py missing or no MPI runtime: report, do not fail
        log.info(f"MPI: not available ({e})")


def summary_line():
    """One line naming the machine as the benchmarks print it."""
    isa, _ = vector_isa()
    return (f"{cpu_model()}, {isa}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs; "
            f"BLAS {blas_line()}; Python {platform.python_version()}")
