# How an LRN kernel raises its scale to -beta: the betas of the reference nets get square roots
# or a division instead of powf (exp and log), each in its own loop so it vectorizes.
# Included (not cimported) by the NCHW (normalization.pyx) and blocked (intel.pyx) LRN kernels.

cdef enum:
    _POW_075 = 0
    _POW_050 = 1
    _POW_100 = 2
    _POW_ANY = 3


cdef int _pow_kind(float beta) noexcept nogil:
    if beta == 0.75:
        return _POW_075
    if beta == 0.5:
        return _POW_050
    if beta == 1.0:
        return _POW_100
    return _POW_ANY
