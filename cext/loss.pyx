# cython: language_level=3
"""Kernels of the loss layers (caffepy/layers/loss.py): SoftmaxWithLoss over an
(outer, classes, inner) view: softmax, the summed -log p[label] and the backward
(p - onehot) * scale (or its label-smoothed form), each in one sweep of the data.

Labels come in validated as int32 with -1 for positions that are ignored. exp is a
vectorizable polynomial (loss_softmax.h) instead of libm's scalar expf. The NumPy references
are in caffepy/kernels/reference/loss.py (SoftmaxWithLoss runs them when the kernels are not
built); tests/layers/test_loss.py runs both and compares.
"""
from cython.parallel cimport prange
from libc.math cimport log

from rules cimport dims, need_shape, threads_for

cdef extern from "loss_softmax.h":
    float c_exp "caffepy_exp"(float x) noexcept nogil
    float row_max "caffepy_row_max"(const float* x, long n) noexcept nogil
    float exp_sum "caffepy_exp_sum"(const float* x, float m, float* out, long n) noexcept nogil
    void max_update "caffepy_max_update"(const float* x, int* m, long L) noexcept nogil
    void exp_acc "caffepy_exp_acc"(const float* x, const float* m, float* out, float* s,
                                   long L) noexcept nogil
    int order "caffepy_order"(int b) noexcept nogil
    int bits "caffepy_bits"(float x) noexcept nogil
    float as_float "caffepy_float"(int b) noexcept nogil
    float log1p_unit "caffepy_log1p_unit"(float e) noexcept nogil
    float sigmoid_ce_sum "caffepy_sigmoid_ce_sum"(const float* x, const float* t, long n,
                                                  int use_ignore, long long ignore,
                                                  long* kept) noexcept nogil
    void sigmoid_ce_grad "caffepy_sigmoid_ce_grad"(const float* x, const float* t, float scale,
                                                   float* d, long n, int use_ignore,
                                                   long long ignore) noexcept nogil

# -log(FLT_MIN): Caffe takes log(max(p, FLT_MIN)), so one term never exceeds this
cdef double _MAX_TERM = 87.33654475055310898657


cdef inline double _term(float xl, float m, float s) noexcept nogil:
    cdef double t = <double>m + log(<double>s) - xl
    # written so a NaN score stays NaN (Caffe's loss goes NaN too; the solver then stops)
    return _MAX_TERM if t > _MAX_TERM else t


cdef enum:
    _BLOCK = 256              # inner positions handled together (vectors run over them)


def exp_array(const float[::1] x, float[::1] out):
    """out = exp(x) by the kernels' polynomial; exposed for its test."""
    need_shape("exp_array", "out", dims(out.shape, 1), dims(x.shape, 1))
    with nogil:
        exp_sum(&x[0], 0.0, &out[0], x.shape[0])


def log1p_array(const float[::1] e, float[::1] out):
    """out = log(1 + e) for e in [0, 1] by the kernels' polynomial; exposed for its test."""
    cdef Py_ssize_t i
    need_shape("log1p_array", "out", dims(out.shape, 1), dims(e.shape, 1))
    with nogil:
        for i in range(e.shape[0]):
            out[i] = log1p_unit(e[i])


cdef enum:
    _CHUNK = 4096             # SigmoidCrossEntropyLoss: elements per task


def sigmoid_ce_forward(const float[::1] x, const float[::1] t, ignore=None):
    """(sum, count) over the positions whose target is not `ignore` (an int, or None for
    all) of max(x, 0) - x t + log(1 + exp(-|x|)): SigmoidCrossEntropyLoss's loss before its
    normalization, float sums of 4096 terms added in double."""
    cdef Py_ssize_t n = x.shape[0], chunks = (x.shape[0] + _CHUNK - 1) // _CHUNK, c, lo
    cdef bint use_ignore = ignore is not None
    cdef long long ig = ignore if use_ignore else 0
    cdef double total = 0.0
    cdef long count = 0, kept
    need_shape("sigmoid_ce_forward", "t", dims(t.shape, 1), (n,))
    with nogil:
        for c in prange(chunks, schedule="static", num_threads=threads_for(n * 16)):
            lo = c * _CHUNK
            kept = 0                  # assigned here, so private to each thread
            total += sigmoid_ce_sum(&x[lo], &t[lo], min(<Py_ssize_t>_CHUNK, n - lo), use_ignore,
                                    ig, &kept)
            count += kept
    return total, count


def sigmoid_ce_backward(const float[::1] x, const float[::1] t, float scale, float[::1] diff,
                        ignore=None):
    """diff = (sigmoid(x) - t) * scale, 0 where the target is `ignore` (an int, or None)."""
    cdef Py_ssize_t n = x.shape[0], chunks = (x.shape[0] + _CHUNK - 1) // _CHUNK, c, lo
    cdef bint use_ignore = ignore is not None
    cdef long long ig = ignore if use_ignore else 0
    need_shape("sigmoid_ce_backward", "t", dims(t.shape, 1), (n,))
    need_shape("sigmoid_ce_backward", "diff", dims(diff.shape, 1), (n,))
    with nogil:
        for c in prange(chunks, schedule="static", num_threads=threads_for(n * 16)):
            lo = c * _CHUNK
            sigmoid_ce_grad(&x[lo], &t[lo], scale, &diff[lo], min(<Py_ssize_t>_CHUNK, n - lo),
                            use_ignore, ig)


cdef double _rows_forward(const float* x, const int* lab, float* prob, Py_ssize_t C) noexcept nogil:
    """One item with inner == 1: softmax of C contiguous scores; returns -log p[label]
    (0 when the label is -1)."""
    cdef Py_ssize_t c
    cdef float m = row_max(x, C)
    cdef float s = exp_sum(x, m, prob, C)
    cdef float inv = 1.0 / s
    for c in range(C):
        prob[c] = prob[c] * inv
    if lab[0] < 0:
        return 0.0
    return _term(x[lab[0]], m, s)


cdef double _block_forward(const float* x, const int* lab, float* prob, Py_ssize_t C,
                           Py_ssize_t inner, Py_ssize_t L) noexcept nogil:
    """L positions (stride 1) of one item with inner > 1: classes are `inner` apart."""
    cdef int mo[_BLOCK]
    cdef float m[_BLOCK]
    cdef float s[_BLOCK]
    cdef Py_ssize_t c, j
    cdef float* pc
    cdef double loss = 0.0
    cdef int l
    for j in range(L):
        mo[j] = order(bits(x[j]))
        s[j] = 0.0
    for c in range(1, C):
        max_update(x + c * inner, mo, L)
    for j in range(L):
        m[j] = as_float(order(mo[j]))
    for c in range(C):
        exp_acc(x + c * inner, m, prob + c * inner, s, L)
    for j in range(L):
        l = lab[j]
        if l >= 0:
            loss += _term(x[l * inner + j], m[j], s[j])
        s[j] = 1.0 / s[j]
    for c in range(C):
        pc = prob + c * inner
        for j in range(L):
            pc[j] = pc[j] * s[j]
    return loss


def softmax_loss_forward(const float[:, :, ::1] x, const int[:, ::1] labels, float[:, :, ::1] prob):
    """prob = softmax of x over axis 1; returns the sum over labelled positions of
    -log p[label], computed as max + log(sum) - x[label] (no log of a tiny p) and capped
    at -log(FLT_MIN) as Caffe's is.
    Labels must be in [0, classes) or -1 (ignored)."""
    cdef Py_ssize_t outer = x.shape[0], C = x.shape[1], inner = x.shape[2]
    cdef Py_ssize_t nblocks = (inner + _BLOCK - 1) // _BLOCK, item, i, j0
    cdef int nt = threads_for(outer * C * inner)
    cdef double loss = 0.0
    need_shape("softmax_loss_forward", "prob", dims(prob.shape, 3), dims(x.shape, 3))
    need_shape("softmax_loss_forward", "labels", dims(labels.shape, 2), (outer, inner))
    if outer * C * inner == 0:
        return 0.0
    with nogil:
        if inner == 1:
            for i in prange(outer, schedule="static", num_threads=nt):
                loss += _rows_forward(&x[i, 0, 0], &labels[i, 0], &prob[i, 0, 0], C)
        else:
            for item in prange(outer * nblocks, schedule="static", num_threads=nt):
                i = item // nblocks
                j0 = (item % nblocks) * _BLOCK
                loss += _block_forward(&x[i, 0, j0], &labels[i, j0], &prob[i, 0, j0], C, inner,
                                       min(<Py_ssize_t>_BLOCK, inner - j0))
    return loss


def softmax_loss_backward(const float[:, :, ::1] prob, const int[:, ::1] labels, float scale,
                          float[:, :, ::1] diff, float ratio=1.0, float hit=1.0, float miss=0.0):
    """diff = (ratio * prob - target) * scale with target = hit at the label's class and miss
    at the others (Intel's label smoothing; the defaults give (prob - onehot(label)) * scale
    bit for bit), 0 at ignored (-1) positions."""
    cdef Py_ssize_t outer = prob.shape[0], C = prob.shape[1], inner = prob.shape[2]
    cdef Py_ssize_t r, c, j
    cdef int nt = threads_for(outer * C * inner)
    cdef float sv
    cdef const float* p
    cdef float* d
    cdef const int* lab
    need_shape("softmax_loss_backward", "diff", dims(diff.shape, 3), dims(prob.shape, 3))
    need_shape("softmax_loss_backward", "labels", dims(labels.shape, 2), (outer, inner))
    if outer * C * inner == 0:
        return
    with nogil:
        if inner == 1:
            for r in prange(outer, schedule="static", num_threads=nt):
                lab = &labels[r, 0]
                p = &prob[r, 0, 0]
                d = &diff[r, 0, 0]
                sv = scale * <float>(lab[0] >= 0)
                for c in range(C):
                    d[c] = (p[c] * ratio - miss) * sv
                if lab[0] >= 0:
                    d[lab[0]] -= (hit - miss) * scale
        else:
            for r in prange(outer * C, schedule="static", num_threads=nt):
                c = r % C
                lab = &labels[0, 0] + (r // C) * inner
                p = &prob[0, 0, 0] + r * inner
                d = &diff[0, 0, 0] + r * inner
                for j in range(inner):
                    d[j] = (p[j] * ratio - (hit if lab[j] == c else miss)) * (scale * <float>(lab[j] >= 0))
