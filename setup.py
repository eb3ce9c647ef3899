"""Builds every cext/*.pyx into caffepy.kernels.<name> with OpenMP and -O3.

The kernels are built for x86-64-v3 (AVX2 + FMA, any x86 CPU since 2013-2015), and the hot ones
(AVX512_MODULES) a second time for x86-64-v4 (AVX-512) into caffepy/kernels/avx512/: caffepy.isa
picks one of the two at run time, so a build runs on any x86-64-v3 machine at its best width.
CAFFEPY_MARCH replaces the baseline's -march (`native` for a build tuned to this machine alone,
`x86-64-v2` for older CPUs); CAFFEPY_ISAS=avx2 skips the AVX-512 builds (a compiler that cannot
target AVX-512 skips them too, with a note).
Cython and the C compiler run one job per core (CAFFEPY_BUILD_JOBS=N to choose;
`build_ext -j N` too): pip's install, editable or not, cannot pass -j itself.
The bf16 kernels (cext/bf16_gemm.h, in bf16.pyx and vision.pyx; cext/bf16_nhwc.h in bf16.pyx) need AVX512_BF16 and AMX: the
header asks for them with a target pragma around its own functions, so no module is built with
flags past its baseline (Cython's glue stays runnable anywhere) and caffepy.precision calls them
only on a CPU that has them.
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
# The modules whose loops run at the vector width (Winograd tiles, BatchNorm, pooling, transposes,
# depthwise and direct convolutions, the blocked layout's kernels, LRN): the others are built once
AVX512_MODULES = ("winograd", "nhwc", "intel", "normalization")
AVX512_ARGS = ["-march=x86-64-v4", "-mprefer-vector-width=512"]
ISAS = os.environ.get("CAFFEPY_ISAS", "avx2,avx512").split(",")


class ParallelBuildExt(build_ext):
    """build_ext compiling the extensions side by side unless -j says otherwise."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = JOBS

    def copy_extensions_to_source(self):
        # an --inplace (editable) build's copy does not make the directory of modules outside
        # any package
        os.makedirs(os.path.join("caffepy", "kernels", "avx512"), exist_ok=True)
        super().copy_extensions_to_source()

    def build_extensions(self):
        variants = [e for e in self.extensions if ".avx512." in e.name]
        if variants and not self._compiles(AVX512_ARGS):
            print("note: this compiler cannot target x86-64-v4 (AVX-512): building the AVX2 kernels only")
            self.extensions = [e for e in self.extensions if e not in variants]
        super().build_extensions()

    def _compiles(self, args):
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.write("#include <immintrin.h>\n"
                        "__m512 probe(__m512 a) { return _mm512_fmadd_ps(a, a, a); }\n")
            try:
                self.compiler.compile([src], output_dir=tmp, extra_postargs=args)
                return True
            except Exception:
                return False

march = os.environ.get("CAFFEPY_MARCH", "x86-64-v3")
# -fno-trapping-math: no kernel reads the FP exception flags, and with them assumed live GCC may
# not compute both arms of a select (`v > 0 ? v : v * slope`) for a blend, so on AVX2 (no masked
# multiply) such loops stayed scalar with a branch per float: BatchNorm + Scale + ReLU ran 10x
# slower on data of mixed signs. Results are unchanged (no reassociation).
# -g0: Python's own CFLAGS ask for debug information, a quarter of the compile time
common_args = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-g0"]


def kernel(name, sources, isa_args, depends=()):
    return Extension(name, sources, include_dirs=[numpy.get_include(), "cext"],
                     extra_compile_args=common_args + isa_args, extra_link_args=["-fopenmp"],
                     depends=glob.glob("cext/*.h") + list(depends),   # the headers they include
                     define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")])


def avx512_variant(name):
    """caffepy.kernels.avx512.<name>: the C Cython wrote for caffepy.kernels.<name>, compiled for
    AVX-512 through a one-line file of its own (its own object file, beside the baseline's). Its
    module keeps the baseline's name: caffepy.isa loads it in the baseline's place."""
    wrapper = os.path.join("build", "avx512", f"{name}.c")
    os.makedirs(os.path.dirname(wrapper), exist_ok=True)
    line = f'#include "{os.path.abspath(os.path.join("cext", name + ".c"))}"\n'
    if not os.path.exists(wrapper) or open(wrapper).read() != line:
        with open(wrapper, "w") as f:
            f.write(line)
    return kernel(f"caffepy.kernels.avx512.{name}", [wrapper], AVX512_ARGS,
                  depends=[os.path.join("cext", name + ".c")])


# the longest compiles first, so that the parallel build ends with short ones filling the cores:
# winograd (its tile transforms, unrolled for every tile size), then by size
pyx = sorted(glob.glob("cext/*.pyx"), key=lambda p: (FIRST not in p, -os.path.getsize(p)))
names = [os.path.splitext(os.path.basename(p))[0] for p in pyx]
*baseline, shared = cythonize(
    [kernel(f"caffepy.kernels.{n}", [p], [f"-march={march}"]) for n, p in zip(names, pyx)]
    + [Extension(SHARED, ["cext/_cyutility.c"], extra_compile_args=["-O2", "-g0"])],
    nthreads=JOBS if JOBS > 1 else 0,
    shared_utility_qualified_name=SHARED,
    language_level=3,
    compiler_directives={"boundscheck": False, "wraparound": False,
                         "cdivision": True, "initializedcheck": False},
)
# each AVX-512 build right after its baseline's, so that the short modules still end the build
variants = {n: avx512_variant(n) for n in names if n in AVX512_MODULES and "avx512" in ISAS}
extensions = []
for n, e in zip(names, baseline):
    extensions += [e] + ([variants[n]] if n in variants else [])
extensions.append(shared)

setup(cmdclass={"build_ext": ParallelBuildExt}, ext_modules=extensions)
