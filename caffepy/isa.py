"""Which instruction set the compiled kernels run: the one place that decides.

setup.py builds every kernel module for x86-64-v3 (AVX2 + FMA) into caffepy/kernels/, and the
modules whose loops run at the vector width a second time for x86-64-v4 (AVX-512) into
caffepy/kernels/avx512/ (same module names). When caffepy.kernels is first imported, `install`
picks a path and, for avx512, puts that directory first on the package's search path: every
`from caffepy.kernels import winograd` then loads the AVX-512 build, and the modules built once
load from the baseline. The blocked layout's block width and the channels-last Winograd's lanes
follow the path (`lanes()`), so the unrolled tile code of the build in use is the code that runs.

The rule (CAFFEPY_ISA=avx2|avx512 overrides it; a path this machine cannot run is refused with a
warning and the rule's choice runs):
- avx512 when the CPU has AVX-512 F, BW, DQ and VL (x86-64-v4) and the AVX-512 build is there,
- except on AMD family 19h (Zen 4, whose 512-bit operations run through 256-bit halves, FMA at
  half the instruction rate): there both builds run a Winograd forward (`measure`, a few tens of
  milliseconds at the first import) and avx512 only when at least 5% faster.
"""
import functools
import glob
import importlib.machinery
import importlib.util
import os
import time

from . import log

PATHS = ("avx2", "avx512")
LANES = {"avx2": 8, "avx512": 16}
NAMES = {"avx2": "AVX2+FMA", "avx512": "AVX-512"}
NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl")}
KERNELS = os.path.join(os.path.dirname(__file__), "kernels")
# the measured rule's margin: wider must win by this much
MARGIN = 1.05


def directory(path):
    return KERNELS if path == "avx2" else os.path.join(KERNELS, path)


def built(path):
    """Module names of `path`'s build (the baseline: all)."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return sorted({os.path.basename(f).split(".")[0] for s in suffixes
                   for f in glob.glob(os.path.join(directory(path), "*" + s))})


def unavailable(path, flags=None):
    """Why `path` cannot run here ("CPU lacks avx512f", "not built"), or None."""
    from .device import cpu_flags
    flags = cpu_flags() if flags is None else flags
    lacking = [f for f in NEEDS[path] if f not in flags]
    if lacking:
        return f"CPU lacks {', '.join(lacking)}"
    if not built(path):
        return "not built (setup.py: CAFFEPY_ISAS, or a compiler without it)"
    return None


def skip_reason(path):
    """A test's skip message for a path this machine cannot run, or None."""
    why = unavailable(path)
    return f"{NAMES[path]} path: {why}" if why else None


def _zen4(vendor, family):
    return vendor == "AuthenticAMD" and family == 0x19


def choose(flags, vendor, family, env, measure):
    """(path, how it was chosen): the rule of the module docstring. `measure()` gives the AVX2
    build's time over the AVX-512 build's for one Winograd forward."""
    possible = [p for p in PATHS if unavailable(p, flags) is None]
    rule = "avx512" if "avx512" in possible else "avx2"
    how = "the widest this CPU and build have"
    if rule == "avx512" and _zen4(vendor, family):
        ratio = measure()
        rule = "avx512" if ratio >= MARGIN else "avx2"
        how = f"measured: the AVX2 build took {ratio:.2f}x the AVX-512 build's time"
    if env:
        if env not in PATHS:
            log.warning(f"CAFFEPY_ISA: must be one of {', '.join(PATHS)}, got '{env}'; running {rule}")
        elif env not in possible:
            log.warning(f"CAFFEPY_ISA={env}: {NAMES[env]} path {unavailable(env, flags)}; running {rule}")
        else:
            return env, "CAFFEPY_ISA"
    return rule, how


def _cpu_id():
    vendor, family = "", -1
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id":
                    vendor = value.strip()
                elif key == "cpu family":
                    family = int(value)
                    break
    except (OSError, ValueError):
        pass
    return vendor, family


_selected = None


def selected():
    """(path, how it was chosen) of this process, decided once."""
    global _selected
    if _selected is None:
        from .device import cpu_flags
        vendor, family = _cpu_id()
        _selected = choose(cpu_flags(), vendor, family, os.environ.get("CAFFEPY_ISA", ""), measure)
    return _selected


def install(package_path):
    """Puts the selected build first on caffepy.kernels' search path (caffepy/kernels/__init__)."""
    path, _ = selected()
    if path != "avx2" and directory(path) not in package_path:
        package_path.insert(0, directory(path))


def lanes():
    """float32 lanes of the path in use: the blocked layout's default block width."""
    return LANES[selected()[0]]


def describe():
    """The path in use, as device_query and `caffepy time` say it."""
    path, how = selected()
    mods = f"{', '.join(built(path))}; " if path != "avx2" else ""
    return f"{NAMES[path]} ({mods}{how})"


def _from_file(name, path):
    """Module `name` of `path`'s build, loaded under its own name but outside sys.modules."""
    file = next(f for s in importlib.machinery.EXTENSION_SUFFIXES
                for f in glob.glob(os.path.join(directory(path), name + s)))
    spec = importlib.util.spec_from_file_location(f"caffepy.kernels.{name}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def load(name, path):
    """Kernel module `name` of `path`'s build: the one in use when `path` is the selected one
    (or has no build of its own of it), else that build loaded beside it, for the tests of every
    path. The caller checks unavailable(path) first."""
    import importlib
    in_use = importlib.import_module(f"caffepy.kernels.{name}")
    if os.path.dirname(in_use.__file__) == directory(path) or name not in built(path):
        return in_use
    return _from_file(name, path)


def _winograd_seconds(wg, v, reps=3):
    """Best time of a 3x3 F(4, 3) forward, 64 -> 64 channels on 28 x 28, channels-last, at
    block width v, one thread (the lanes' arithmetic, not the memory, is what differs)."""
    import numpy as np
    n, c, h, m, r = 1, 64, 28, 4, 3
    at, g, bt = wg.matrices(m, r)
    u = np.empty(((m + r - 1) ** 2, c, c), np.float32)
    wg.weight_transform(np.full((c, c, r, r), 0.01, np.float32), g, u, 1)
    vshape, mshape = wg.scratch_shapes(1, n, c, c, h, h, v, m, r, 1, 1)
    x, y = np.ones((n, h, h, c), np.float32), np.empty((n, h, h, c), np.float32)
    vb, mb, bias = np.empty(vshape, np.float32), np.empty(mshape, np.float32), np.zeros(c, np.float32)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        wg.conv_forward_nhwc(x, u, bias, y, vb, mb, at, bt, v, c, m, r, 1, 1, 1)
        best = min(best, time.perf_counter() - t)
    return best


def measure():
    """The AVX2 build's time over the AVX-512 build's for the same Winograd forward (> 1: the
    AVX-512 build is faster)."""
    narrow, wide = _from_file("winograd", "avx2"), _from_file("winograd", "avx512")
    _winograd_seconds(narrow, 8, 1), _winograd_seconds(wide, 16, 1)     # warm-up
    return _winograd_seconds(narrow, 8) / _winograd_seconds(wide, 16)
