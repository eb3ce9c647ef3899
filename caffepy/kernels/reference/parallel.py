"""NumPy references of the bfloat16 wire kernels (cext/parallel.pyx, caffepy.kernels.parallel)."""
import numpy as np


def to_bf16(src):
    """The bfloat16 bits (uint16) of float32 `src`, rounded to nearest (ties away from zero)."""
    return ((src.astype(np.float32).view(np.uint32) + np.uint32(0x8000)) >> 16).astype(np.uint16)


def from_bf16(bits):
    """float32 values of bfloat16 bits (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def add_bf16(out, piece, scale, round_result):
    """(out + float32(piece)) * scale, rounded to bfloat16 values with round_result."""
    v = (out.astype(np.float32) + from_bf16(piece)) * np.float32(scale)
    return from_bf16(to_bf16(v)) if round_result else v
