"""NumPy reference of bf16 rounding (caffepy.precision.round_bf16), written another way: by
comparing distances in float64 rather than by the carry trick."""
import numpy as np


def round_bf16(x):
    """float32 `x` rounded to the nearest bf16 (ties to even) as float32: of x truncated to its
    upper 16 bits and the next bf16 away from zero, the nearer in float64, the one with an even
    last kept bit on a tie. Infinities stay; NaNs stay NaNs of their sign; finite values past
    bf16's largest become infinities (the next bf16 up from it is the infinity)."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    down = (u & 0xFFFF0000).astype(np.uint32)
    up = (down.astype(np.uint64) + 0x10000).astype(np.uint32)
    with np.errstate(invalid="ignore"):
        lo, hi = down.view(np.float32).astype(np.float64), up.view(np.float32).astype(np.float64)
        # past bf16's largest the next step up is 2^128, which float32 calls infinity
        hi = np.where(np.isinf(hi) & np.isfinite(x), np.copysign(2.0 ** 128, x.astype(np.float64)), hi)
        exact = x.astype(np.float64)
        d_lo, d_hi = np.abs(exact - lo), np.abs(hi - exact)
        take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ((down >> 16) & 1 == 1))
    out = np.where(take_hi, up, down).view(np.float32)
    special = ~np.isfinite(x)
    out[special] = x[special]        # inf stays inf; a NaN stays a NaN (its payload aside)
    return out


def gemm(a, b):
    """bf16's product of float32 matrices a [M, K] and b [K, N] (kernels.bf16.gemm's reference):
    both rounded to bf16, then multiplied and summed in float64 (the products are exact in
    float32 too; only the sums round there)."""
    return round_bf16(a).astype(np.float64) @ round_bf16(b).astype(np.float64)
