# cython: language_level=3
"""The bfloat16 wire of caffepy/parallel/ring.py (CAFFEPY_MPI_WIRE_TYPE=bfloat16): float32 to
bfloat16 bits and back, and the reduce-scatter step's add, each one pass in the allreduce
thread. NumPy needed two to four passes each (2.6 ms per million floats to pack against a
fraction of that here), CPU taken from the compute threads the exchange hides behind.
References: caffepy/kernels/reference/parallel.py.

bfloat16 is the top 16 bits of a float32; rounding to nearest adds half of the dropped part
(0x8000) before dropping it (ties away from zero; a carry into the exponent is the right
rounding, up to inf past bfloat16's largest). One thread: the allreduce thread runs beside the
compute threads, which have the cores.
"""
from libc.stdint cimport uint16_t, uint32_t
from libc.string cimport memcpy

from rules cimport dims, need_shape


cdef inline uint32_t _bits(float x) noexcept nogil:
    cdef uint32_t u
    memcpy(&u, &x, 4)
    return u


cdef inline float _float(uint32_t u) noexcept nogil:
    cdef float x
    memcpy(&x, &u, 4)
    return x


def to_bf16(const float[::1] src, uint16_t[::1] out):
    """out = the bfloat16 bits of src, rounded to nearest."""
    cdef Py_ssize_t i, n = src.shape[0]
    need_shape("to_bf16", "out", dims(out.shape, 1), (n,))
    with nogil:
        for i in range(n):
            out[i] = <uint16_t>((_bits(src[i]) + 0x8000u) >> 16)


def from_bf16(const uint16_t[::1] src, float[::1] out):
    """out = the float32 values of the bfloat16 bits src (exact)."""
    cdef Py_ssize_t i, n = src.shape[0]
    need_shape("from_bf16", "out", dims(out.shape, 1), (n,))
    with nogil:
        for i in range(n):
            out[i] = _float(<uint32_t>src[i] << 16)


def add_bf16(float[::1] out, const uint16_t[::1] piece, float scale, bint round_result):
    """out = (out + float32(piece)) * scale, then with round_result rounded to bfloat16 values
    (scale 1: no scaling)."""
    cdef Py_ssize_t i, n = out.shape[0]
    cdef float v
    need_shape("add_bf16", "piece", dims(piece.shape, 1), (n,))
    with nogil:
        if round_result:
            for i in range(n):
                v = (out[i] + _float(<uint32_t>piece[i] << 16)) * scale
                out[i] = _float((_bits(v) + 0x8000u) & 0xFFFF0000u)
        else:
            for i in range(n):
                out[i] = (out[i] + _float(<uint32_t>piece[i] << 16)) * scale
