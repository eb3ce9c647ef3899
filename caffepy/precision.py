"""Which arithmetic precision the nets run in: float32 (the default) or bf16, decided here.

bf16 (bfloat16: float32's sign and 8-bit exponent, 7 stored mantissa bits) runs Convolution and
InnerProduct in bf16 as CPUs with AVX512_BF16 or AMX-BF16 do: their inputs and weights rounded
to bf16 (round to nearest, ties to even), the products summed in float32, the bias added and the
output written in float32. Every other layer stays float32. In training, the master weights,
their gradients' accumulation and the updates stay float32; the backward's two products take
bf16 operands too (the top diff, the layer's input and its weights rounded, as mixed-precision
training's backward does), the bias gradient sums the rounded top diff in float32.

caffepy has no bf16 kernels (vdpbf16ps, AMX tiles) yet, so bf16 runs nowhere at bf16's speed.
What it has is bf16's arithmetic emulated: the operands rounded into float32 arrays (a bf16
value is a float32 whose low 16 bits are zero) and Caffe's im2col + float32 GEMM over them.
The product of two bf16 values is exact in float32, so the emulation computes the products the
hardware computes; only the order of the float32 sums differs. It is slower than float32, never
faster, and is for measuring bf16's accuracy. It runs only on request: -precision bf16 (and
caffe.set_precision('bf16')) is refused in one line unless CAFFEPY_BF16=emulate is set.

The setting is the process's, as pycaffe's modes are: it applies to the nets built after it
(the factory reads it when it picks a layer's implementation: caffepy/layers/bf16.py).
"""
import functools
import os

import numpy as np

from . import device, log
from .errors import CaffepyError, UsageError, quote

F32, BF16 = "f32", "bf16"
PRECISIONS = (F32, BF16)
ACCEPTED = "f32 (float32, the default) or bf16 (Convolution and InnerProduct in bfloat16)"
TYPES = ("Convolution", "InnerProduct")          # the layer types bf16 runs
HARDWARE_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512_BF16"))

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


def emulation_asked():
    """Whether CAFFEPY_BF16=emulate is set (anything else but unset or empty is refused)."""
    value = os.environ.get("CAFFEPY_BF16", "").strip()
    if value.lower() not in ("", "emulate"):
        raise CaffepyError(f"CAFFEPY_BF16: must be 'emulate' or unset, got '{quote(value)}'")
    return value.lower() == "emulate"


def availability(flags=None):
    """Where bf16 stands on this CPU and what CAFFEPY_BF16=emulate does, in one line."""
    found = hardware(flags)
    state = (f"this CPU has {found}, but caffepy has no bf16 kernels yet" if found else
             "this CPU has no bf16 instructions (AVX512_BF16 or AMX-BF16)")
    return (f"{state}; CAFFEPY_BF16=emulate runs bf16's arithmetic emulated (bf16-rounded "
            f"operands, float32 sums), slower than float32, to measure its accuracy")


def set_precision(value, where=None):
    """Run the nets built from now on in `value`'s precision (f32 or bf16). bf16 needs
    CAFFEPY_BF16=emulate (see the module docstring), else a CaffepyError in one line; with it,
    one warning says the run is emulated. `where` names the call in errors (the flag's words by
    default)."""
    global _current
    where = where or f"-precision {value}"
    name = checked(value, where)
    if name == BF16:
        if not emulation_asked():
            raise CaffepyError(f"{where}: {availability()}")
        _warn_emulated()
    _current = name


def current():
    """The precision nets built now run in."""
    return _current


@functools.lru_cache(maxsize=None)
def _warn_emulated():
    found = hardware()
    why = f"caffepy has no kernels for this CPU's {found}" if found else \
        "this CPU has no AVX512_BF16 or AMX-BF16"
    log.warning(f"bf16 emulated (CAFFEPY_BF16=emulate): Convolution and InnerProduct round their "
                f"inputs and weights to bf16 and sum in float32, at float32's speed or below, not "
                f"bf16's ({why})")


def of(layer):
    """The precision `layer` computes in: bf16 for the bf16 variants, int8 for a layer an int8
    unit runs, else f32."""
    if getattr(layer, "variant", None) == BF16:
        return BF16
    return "int8" if getattr(layer, "int8", None) is not None else F32


def summary(layers):
    """One line: which layers compute in which precision (`caffepy time`'s header)."""
    by = {}
    for layer in layers:
        by.setdefault(of(layer), []).append(layer)
    parts = [f"{label}: {', '.join(layer.name for layer in by[name])}"
             for name, label in ((BF16, "bf16 (emulated)"), ("int8", "int8")) if name in by]
    f32 = by.get(F32, [])
    stayed = [layer.name for layer in f32 if layer.type in TYPES] if _current == BF16 else []
    if f32:
        parts.append(f"f32: {'the other ' if parts else ''}{len(f32) - len(stayed)} layer(s)" +
                     (f", and {', '.join(stayed)} (no bf16 form in their layout or parallel "
                      f"variant)" if stayed else ""))
    return f"Precision per layer: {'; '.join(parts)}"


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
