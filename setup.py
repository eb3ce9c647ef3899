"""Builds every cext/*.pyx into caffepy.kernels.<name> with OpenMP and -O3.

Set CAFFEPY_MARCH to choose the target ISA (default: native, so the widest
vector unit of the build machine is used; `x86-64-v2` gives a portable build).
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

march = os.environ.get("CAFFEPY_MARCH", "native")
# -fno-trapping-math: no kernel reads the FP exception flags, and with them assumed live GCC may
# not compute both arms of a select (`v > 0 ? v : v * slope`) for a blend, so on AVX2 (no masked
# multiply) such loops stayed scalar with a branch per float: BatchNorm + Scale + ReLU ran 10x
# slower on data of mixed signs. Results are unchanged (no reassociation).
compile_args = ["-O3", "-fopenmp", f"-march={march}", "-fno-math-errno", "-fno-trapping-math"]
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
    for path in sorted(glob.glob("cext/*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={"boundscheck": False, "wraparound": False,
                             "cdivision": True, "initializedcheck": False},
    )
)
