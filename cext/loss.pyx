# cython: language_level=3
"""Kernels of SoftmaxWithLoss over an (outer, classes, inner) view: softmax, the summed
-log p[label] and the backward (p - onehot) * scale, each in one sweep of the data.

Labels come in validated as int32 with -1 for positions that are ignored. exp is a
vectorizable polynomial (below) instead of libm's scalar expf. The NumPy reference is the
fallback path of SoftmaxWithLoss in caffepy/layers/loss.py; tests/layers/test_loss.py
runs both and compares.
"""
from cython.parallel cimport prange
cimport openmp
from libc.math cimport log

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* Written without float compares or branches: under GCC's default -ftrapping-math a
       float compare or a speculated float operation keeps a loop scalar, so selects are
       made on integer bit patterns instead. */
    static inline int32_t caffepy_bits(float x) { int32_t b; memcpy(&b, &x, 4); return b; }
    static inline float caffepy_float(int32_t b) { float x; memcpy(&x, &b, 4); return x; }
    /* a monotone map of float bit patterns to int32 (its own inverse) */
    static inline int32_t caffepy_order(int32_t b) { return b ^ ((b >> 31) & 0x7FFFFFFF); }

    /* exp(x) in float32 for x <= 88, about 1 ulp: x = n ln2 + r with |r| <= ln2/2, exp(r)
       by its Taylor series to r^7 (relative error < 1e-8 there), times 2^n built in the
       exponent bits. Below -87.3 (where exp(x) < FLT_MIN) the result is held at FLT_MIN:
       for a softmax term that is zero to within float precision of the sum. */
    static inline float caffepy_exp(float x) {
        const int32_t lo = caffepy_bits(-87.33654f);
        int32_t xb = caffepy_bits(x);
        int32_t k = -((xb > lo) & (xb < 0));     /* negative and below lo */
        x = caffepy_float((lo & k) | (xb & ~k));
        /* round(x / ln2) by the 1.5 * 2^23 trick: exact float operations */
        float t = x * 1.44269504088896341f + 12582912.0f;
        float n = t - 12582912.0f;
        float r = x - n * 0.693359375f;          /* ln2 split in two parts so n * ln2 */
        r = r - n * -2.12194440e-4f;             /* is subtracted without rounding */
        float p = 1.0f / 5040.0f;
        p = p * r + 1.0f / 720.0f;
        p = p * r + 1.0f / 120.0f;
        p = p * r + 1.0f / 24.0f;
        p = p * r + 1.0f / 6.0f;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        return p * caffepy_float(((int32_t)n + 127) << 23);
    }

    static float caffepy_row_max(const float* x, long n) {
        int32_t m = caffepy_order(caffepy_bits(x[0]));
        for (long i = 1; i < n; i++) {
            int32_t k = caffepy_order(caffepy_bits(x[i]));
            m = k > m ? k : m;
        }
        return caffepy_float(caffepy_order(m));
    }

    /* out = exp(x - m); returns the sum of out (16 partial sums so the loop vectorizes) */
    static float caffepy_exp_sum(const float* x, float m, float* out, long n) {
        float acc[16] = {0};
        long i = 0, l;
        for (; i + 16 <= n; i += 16)
            for (l = 0; l < 16; l++) {
                out[i + l] = caffepy_exp(x[i + l] - m);
                acc[l] += out[i + l];
            }
        float s = 0.0f;
        for (; i < n; i++) {
            out[i] = caffepy_exp(x[i] - m);
            s += out[i];
        }
        for (l = 0; l < 16; l++) s += acc[l];
        return s;
    }

    /* running max over classes for L positions, kept as ordered int32 */
    static void caffepy_max_update(const float* x, int32_t* m, long L) {
        for (long j = 0; j < L; j++) {
            int32_t k = caffepy_order(caffepy_bits(x[j]));
            m[j] = k > m[j] ? k : m[j];
        }
    }

    /* out = exp(x - m), s += out for L positions */
    static void caffepy_exp_acc(const float* x, const float* m, float* out, float* s, long L) {
        for (long j = 0; j < L; j++) {
            out[j] = caffepy_exp(x[j] - m[j]);
            s[j] += out[j];
        }
    }
    """
    float c_exp "caffepy_exp"(float x) noexcept nogil
    float row_max "caffepy_row_max"(const float* x, long n) noexcept nogil
    float exp_sum "caffepy_exp_sum"(const float* x, float m, float* out, long n) noexcept nogil
    void max_update "caffepy_max_update"(const float* x, int* m, long L) noexcept nogil
    void exp_acc "caffepy_exp_acc"(const float* x, const float* m, float* out, float* s,
                                   long L) noexcept nogil
    int order "caffepy_order"(int b) noexcept nogil
    int bits "caffepy_bits"(float x) noexcept nogil
    float as_float "caffepy_float"(int b) noexcept nogil

# -log(FLT_MIN): Caffe takes log(max(p, FLT_MIN)), so one term never exceeds this
cdef double _MAX_TERM = 87.33654475055310898657


cdef inline double _term(float xl, float m, float s) noexcept nogil:
    cdef double t = <double>m + log(<double>s) - xl
    # written so a NaN score stays NaN (Caffe's loss goes NaN too; the solver then stops)
    return _MAX_TERM if t > _MAX_TERM else t


cdef enum:
    _BLOCK = 256              # inner positions handled together (vectors run over them)
    _SERIAL_BELOW = 1048576   # values: below this one thread is faster than waking the team


cdef inline int _threads(Py_ssize_t work) noexcept nogil:
    return 1 if work < _SERIAL_BELOW else openmp.omp_get_max_threads()


def exp_array(const float[::1] x, float[::1] out):
    """out = exp(x) by the kernels' polynomial; exposed for its test."""
    with nogil:
        exp_sum(&x[0], 0.0, &out[0], x.shape[0])


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
    cdef int nt = _threads(outer * C * inner)
    cdef double loss = 0.0
    if (prob.shape[0], prob.shape[1], prob.shape[2]) != (outer, C, inner):
        raise ValueError("prob needs the shape of x")
    if (labels.shape[0], labels.shape[1]) != (outer, inner):
        raise ValueError(f"labels need shape {(outer, inner)}")
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
                          float[:, :, ::1] diff):
    """diff = (prob - onehot(label)) * scale, 0 at ignored (-1) positions."""
    cdef Py_ssize_t outer = prob.shape[0], C = prob.shape[1], inner = prob.shape[2]
    cdef Py_ssize_t r, c, j
    cdef int nt = _threads(outer * C * inner)
    cdef float sv
    cdef const float* p
    cdef float* d
    cdef const int* lab
    if (diff.shape[0], diff.shape[1], diff.shape[2]) != (outer, C, inner):
        raise ValueError("diff needs the shape of prob")
    if (labels.shape[0], labels.shape[1]) != (outer, inner):
        raise ValueError(f"labels need shape {(outer, inner)}")
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
                    d[c] = p[c] * sv
                if lab[0] >= 0:
                    d[lab[0]] -= scale
        else:
            for r in prange(outer * C, schedule="static", num_threads=nt):
                c = r % C
                lab = &labels[0, 0] + (r // C) * inner
                p = &prob[0, 0, 0] + r * inner
                d = &diff[0, 0, 0] + r * inner
                for j in range(inner):
                    d[j] = (p[j] - <float>(lab[j] == c)) * (scale * <float>(lab[j] >= 0))
