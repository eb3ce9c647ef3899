"""Builds every cext/*.pyx into caffepy.kernels.<name> with OpenMP and -O3.

Set CAFFEPY_MARCH to choose the target ISA (default: native, so the widest
vector unit of the build machine is used; `x86-64-v2` gives a portable build).
Cython and the C compiler run one job per core (CAFFEPY_BUILD_JOBS=N to choose;
`build_ext -j N` too): pip's install, editable or not, cannot pass -j itself.
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

JOBS = int(os.environ.get("CAFFEPY_BUILD_JOBS")
           or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
# Cython's own helpers (memoryviews, argument parsing, ...) in one module the kernels import,
# rather than a copy in each: most of every generated .c, so most of the compile time
SHARED = "caffepy.kernels._cyutility"
FIRST = "winograd.pyx"


class ParallelBuildExt(build_ext):
    """build_ext compiling the extensions side by side unless -j says otherwise."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = JOBS

march = os.environ.get("CAFFEPY_MARCH", "native")
# -fno-trapping-math: no kernel reads the FP exception flags, and with them assumed live GCC may
# not compute both arms of a select (`v > 0 ? v : v * slope`) for a blend, so on AVX2 (no masked
# multiply) such loops stayed scalar with a branch per float: BatchNorm + Scale + ReLU ran 10x
# slower on data of mixed signs. Results are unchanged (no reassociation).
# -g0: Python's own CFLAGS ask for debug information, a quarter of the compile time
compile_args = ["-O3", "-fopenmp", f"-march={march}", "-fno-math-errno", "-fno-trapping-math", "-g0"]
extensions = [
    Extension(
        f"caffepy.kernels.{os.path.splitext(os.path.basename(path))[0]}",
        [path],
        include_dirs=[numpy.get_include(), "cext"],
        extra_compile_args=compile_args,
        extra_link_args=["-fopenmp"],
        depends=glob.glob("cext/*.h"),          # C headers the kernels include
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    # the longest compiles first, so that the parallel build ends with short ones filling the
    # cores: winograd (its tile transforms, unrolled for every tile size and vector width, took
    # 84 of the 147 s of CPU the C compiler spent on all the kernels), then by size
    for path in sorted(glob.glob("cext/*.pyx"), key=lambda p: (FIRST not in p, -os.path.getsize(p)))
] + [Extension(SHARED, ["cext/_cyutility.c"], extra_compile_args=["-O2", "-g0"])]

setup(
    cmdclass={"build_ext": ParallelBuildExt},
    ext_modules=cythonize(
        extensions,
        nthreads=JOBS if JOBS > 1 else 0,
        shared_utility_qualified_name=SHARED,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False,
                             "cdivision": True, "initializedcheck": False},
    )
)
