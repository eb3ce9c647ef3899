"""Which arithmetic precision the nets run in: float32 (the default) or bf16, decided here.

bf16 (bfloat16: float32's sign and 8-bit exponent, 7 stored mantissa bits) runs Convolution and
InnerProduct in bf16 as CPUs with AVX512_BF16 or AMX-BF16 do: their inputs and weights rounded
to bf16 (round to nearest, ties to even), the products summed in float32, the bias added and the
output written in float32. Every other layer stays float32. In training, the master weights,
their gradients' accumulation and the updates stay float32; the backward's two products take
bf16 operands too (the top diff, the layer's input and its weights rounded, as mixed-precision
training's backward does), the bias gradient sums the rounded top diff in float32.

Where the CPU has them, bf16 kernels run it (cext/bf16_gemm.h: Caffe's im2col, then products
that round their float32 operands to bf16 as they pack them): on AMX tiles (TDPBF16PS) when the
CPU has AMX-BF16 and Linux lends this process the tile registers, else on AVX512_BF16
(VDPBF16PS). Both treat bf16 subnormals (below 2^-126) as zero; nothing else differs. On AMX, a
TEST net's Convolutions of one group (or of 16 or more channels a group) run channels-last
instead (cext/bf16_nhwc.h: the input converted to bf16 once, the float32 path's TEST fusions
applied to the float32 sums), and its depthwise ones as the float32 depthwise kernel on
rounded operands (caffepy/layers/bf16.py).

Elsewhere bf16's arithmetic can be emulated: the operands rounded into float32 arrays (a bf16
value is a float32 whose low 16 bits are zero) and Caffe's im2col + float32 GEMM over them.
The product of two bf16 values is exact in float32, so the emulation computes the products the
hardware computes; only the order of the float32 sums differs. It is slower than float32, never
faster, and is for measuring bf16's accuracy. It runs only on request: without the kernels,
-precision bf16 (and caffe.set_precision('bf16')) is refused in one line unless
CAFFEPY_BF16=emulate is set. CAFFEPY_BF16=emulate runs the emulation where the kernels exist
too, and CAFFEPY_BF16=avx512_bf16 the AVX512_BF16 kernels where AMX is there (to compare them).

The setting is the process's, as pycaffe's modes are: it applies to the nets built after it
(the factory reads it when it picks a layer's implementation: caffepy/layers/bf16.py).
"""
import functools
import os

import numpy as np

from . import device, log
from .errors import CaffepyError, UsageError, quote

F32, BF16 = "f32", "bf16"
BF16_NHWC = "bf16_nhwc"     # the variant name of the channels-last bf16 Convolution
PRECISIONS = (F32, BF16)
ACCEPTED = "f32 (float32, the default) or bf16 (Convolution and InnerProduct in bfloat16)"
TYPES = ("Convolution", "InnerProduct")          # the layer types bf16 runs
HARDWARE_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512_BF16"))
# what each kernel path needs of the CPU (the AVX512_BF16 code uses AVX-512 BW and VL too)
KERNEL_NEEDS = {"AMX-BF16": ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"),
                "AVX512_BF16": ("avx512_bf16", "avx512bw", "avx512vl")}
SETTINGS = ("emulate", "avx512_bf16")     # CAFFEPY_BF16's values, besides unset

_current = F32


def problem(value):
    """What is wrong with precision `value`, or None."""
    return None if str(value).strip().lower() in PRECISIONS else "unknown precision"


def checked(value, where="-precision"):
    """The precision `value` names (f32 or bf16, any case), or a UsageError naming `where`
    (the flag or the call)."""
    wrong = problem(value)
    if wrong:
        raise UsageError(f"{where}: {wrong} '{quote(str(value))}'; accepted: {ACCEPTED}")
    return str(value).strip().lower()


def hardware(flags=None):
    """The bf16 instructions this CPU has ("AMX-BF16", "AVX512_BF16"), or None."""
    flags = device.cpu_flags() if flags is None else flags
    found = [name for flag, name in HARDWARE_FLAGS if flag in flags]
    return ", ".join(found) or None


def setting():
    """CAFFEPY_BF16's value: '' (unset), 'emulate' or 'avx512_bf16'; anything else is refused."""
    value = os.environ.get("CAFFEPY_BF16", "").strip()
    if value.lower() not in ("",) + SETTINGS:
        raise CaffepyError(f"CAFFEPY_BF16: must be 'emulate', 'avx512_bf16' or unset, got "
                           f"'{quote(value)}'")
    return value.lower()


def emulation_asked():
    """Whether CAFFEPY_BF16=emulate is set."""
    return setting() == "emulate"


def kernel(flags=None):
    """The bf16 kernel path that runs here, as (its kernels.bf16 code, its name), or None: AMX
    when the CPU has it and Linux lends the tiles, else AVX512_BF16; None without either, or
    under CAFFEPY_BF16=emulate. `flags` (a CPU's flags) for tests; the AMX permission is asked
    of Linux only for this process's own CPU."""
    asked = setting()
    if asked == "emulate":
        return None
    own = flags is None
    flags = device.cpu_flags() if own else flags
    from .kernels import bf16
    if asked != "avx512_bf16" and all(f in flags for f in KERNEL_NEEDS["AMX-BF16"]) and (
            not own or bf16.amx_permitted()):
        return bf16.AMX, "AMX-BF16"
    if all(f in flags for f in KERNEL_NEEDS["AVX512_BF16"]):
        return bf16.AVX512, "AVX512_BF16"
    return None


def availability(flags=None):
    """Where bf16 stands on this CPU: the kernels that run it, or why none does and what
    CAFFEPY_BF16=emulate does, in one line."""
    found = hardware(flags)
    emulated = ("bf16's arithmetic emulated (bf16-rounded operands, float32 sums), slower than "
                "float32, to measure its accuracy")
    if setting() == "emulate":
        return f"CAFFEPY_BF16=emulate: {emulated}"
    path = kernel(flags)
    if path:
        return (f"{path[1]} kernels (bf16-rounded operands, float32 sums; this CPU has {found}); "
                f"CAFFEPY_BF16=emulate runs the emulation instead")
    state = (f"this CPU has {found}, but not what caffepy's bf16 kernels need "
             f"(AVX512_BF16 with AVX-512 BW and VL)" if found else
             "this CPU has no bf16 instructions (AVX512_BF16 or AMX-BF16)")
    return f"{state}; CAFFEPY_BF16=emulate runs {emulated}"


def set_precision(value, where=None):
    """Run the nets built from now on in `value`'s precision (f32 or bf16). bf16 needs the
    kernels (kernel()) or CAFFEPY_BF16=emulate (see the module docstring), else a CaffepyError in
    one line; one line says which runs. `where` names the call in errors (the flag's words by
    default)."""
    global _current
    where = where or f"-precision {value}"
    name = checked(value, where)
    if name == BF16:
        path = kernel()
        if path:
            _say_kernel(path[1])
        elif emulation_asked():
            _warn_emulated()
        else:
            raise CaffepyError(f"{where}: {availability()}")
    _current = name


def current():
    """The precision nets built now run in."""
    return _current


@functools.lru_cache(maxsize=None)
def _say_kernel(name):
    log.info(f"bf16 on {name} kernels: Convolution and InnerProduct round their inputs and "
             f"weights to bf16 and sum in float32")


@functools.lru_cache(maxsize=None)
def _warn_emulated():
    found = hardware()
    flags = device.cpu_flags()
    if any(all(f in flags for f in needs) for needs in KERNEL_NEEDS.values()):
        why = f"asked for by CAFFEPY_BF16=emulate; this CPU's {found} would run the kernels"
    elif found:
        why = f"caffepy's bf16 kernels need AVX512_BF16 with AVX-512 BW and VL; this CPU has {found}"
    else:
        why = "this CPU has no AVX512_BF16 or AMX-BF16"
    log.warning(f"bf16 emulated (CAFFEPY_BF16=emulate): Convolution and InnerProduct round their "
                f"inputs and weights to bf16 and sum in float32, at float32's speed or below, not "
                f"bf16's ({why})")


def of(layer):
    """The precision `layer` computes in: bf16 for the bf16 variants, int8 for a layer an int8
    unit runs, else f32."""
    if getattr(layer, "variant", None) in (BF16, BF16_NHWC):
        return BF16
    return "int8" if getattr(layer, "int8", None) is not None else F32


def summary(layers):
    """One line: which layers compute in which precision (`caffepy time`'s header)."""
    by = {}
    for layer in layers:
        by.setdefault(of(layer), []).append(layer)
    parts = [f"{label}: {', '.join(layer.name for layer in by[name])}"
             for name, label in ((BF16, f"bf16 ({_kind(by.get(BF16))})"), ("int8", "int8"))
             if name in by]
    f32 = by.get(F32, [])
    stayed = [layer.name for layer in f32 if layer.type in TYPES] if _current == BF16 else []
    if f32:
        parts.append(f"f32: {'the other ' if parts else ''}{len(f32) - len(stayed)} layer(s)" +
                     (f", and {', '.join(stayed)} (no bf16 form in their layout or parallel "
                      f"variant)" if stayed else ""))
    return f"Precision per layer: {'; '.join(parts)}"


def _kind(layers):
    """How the bf16 layers run: 'emulated' or their kernels' name."""
    names = {getattr(layer, "kernel_name", None) or "emulated" for layer in layers or ()}
    return ", ".join(sorted(names))


def round_bf16(x, out=None):
    """`x` (float32) rounded to the nearest bf16, ties to even, as float32 (low 16 bits zero),
    into `out` (a float32 array of x's shape; may be x) or a new array. Infinities stay; a NaN
    stays a NaN of its sign (made quiet, as the hardware's conversion does); finite values past
    bf16's largest round to infinity."""
    x = np.ascontiguousarray(x, np.float32)
    if out is None:
        out = np.empty_like(x)
    u = x.view(np.uint32)
    r = out.view(np.uint32)
    nan = np.isnan(x)
    nans = u[nan] if nan.any() else None       # before `out` (which may be x) is written
    # add 0x7FFF and the lowest kept bit: carries into the kept bits exactly when the dropped
    # half exceeds a half step, or equals it and the kept value is odd
    lowest = np.right_shift(u, 16)
    np.bitwise_and(lowest, 1, out=lowest)
    lowest += 0x7FFF
    np.add(u, lowest, out=r)
    r &= np.uint32(0xFFFF0000)
    if nans is not None:
        r[nan] = (nans | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
    return out
