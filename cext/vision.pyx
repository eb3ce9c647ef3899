# cython: language_level=3
"""Kernels of the vision layers (caffepy/layers/vision.py): im2col/col2im for Im2col and the
convolutions, Convolution and Deconvolution (im2col + sgemm), Pooling (MAX, AVE), ROIPooling.

Every kernel takes float32 C-contiguous arrays (int32 for the max-pooling mask), writes into
buffers the caller allocated, and runs without the GIL. Shapes are read from the arrays; the
geometry (pad, stride, dilation, kernel) is passed as ints. The NumPy references of every
kernel are in caffepy/kernels/reference/vision.py.

Conventions (Caffe's):
- im2col row index = (c * kh + i) * kw + j, column index = oy * ow + ox; out-of-image taps are 0.
- conv / deconv weight diffs and bias diffs ACCUMULATE (+=); top and bottom diffs are OVERWRITTEN.
- output sizes are the caller's (Caffe's rules: caffepy/geometry.py); AVE pooling divides by the
  window clipped to the padded extent, MAX ignores the padding and records the argmax as h * W + w.
"""

import numpy as np

from cython.parallel cimport prange, threadid
cimport openmp
from libc.float cimport FLT_MAX
from libc.stdint cimport int32_t
from libc.string cimport memset

from blas cimport gemm
from rules cimport dims, need, need_shape, threads_for, threads_for_macs


# ---------------------------------------------------------------------------------------------
# Threading of the convolution image loop.
#
# Two ways to use the cores: images in turn, each one's im2col split over channels and each
# GEMM over blocks of its output (blas.pxd), or every OpenMP thread on its own images, with its
# own column buffer and a single-threaded BLAS. The second sets the BLAS thread count to 1 for
# the loop and restores it after (the count is process-wide: two Python threads running
# convolutions at once may oversubscribe, never miscompute). benchmarks/bench_kernels.py
# measures both: per-image threads win on every AlexNet layer (3-10x at batch 64 on 2 cores),
# since the other way pays a fork/join per image and per product. A batch smaller than the
# thread count, or a problem too small for several threads (the thread rule of rules.pxd), runs
# images in turn, each region sized by the rule.

include "blas_threads.pxi"

cdef enum:
    _PER_IMAGE = 0
    _BLAS_THREADS = 1

cdef int _conv_threading = _PER_IMAGE


def set_conv_threading(str mode):
    """'images': OpenMP over the batch, one BLAS thread each; 'blas': images in turn, each
    product threaded (blas.pxd).

    'images' needs a BLAS whose thread count can be set (OpenBLAS); without one, 'blas' is used.
    """
    global _conv_threading
    if mode == "images":
        _conv_threading = _PER_IMAGE
    elif mode == "blas":
        _conv_threading = _BLAS_THREADS
    else:
        raise ValueError(f"conv threading must be 'images' or 'blas', got {mode!r}")


def get_conv_threading():
    return "images" if _conv_threading == _PER_IMAGE and _blas_set_threads != NULL else "blas"


cdef int _image_threads(int n_images, Py_ssize_t buffer_floats, Py_ssize_t per_thread,
                        Py_ssize_t work) noexcept nogil:
    """How many threads the image loop uses: 1 means images in turn (see above)."""
    cdef int t = openmp.omp_get_max_threads()
    if _conv_threading != _PER_IMAGE:
        return 1
    if per_thread > 0 and buffer_floats // per_thread < t:
        t = <int>(buffer_floats // per_thread)
    return _task_threads(t, n_images, work)


# ---------------------------------------------------------------------------------------------
# im2col / col2im

cdef struct Geom:
    # image side (bottom of a conv, top of a deconv) and column side (top of a conv)
    int C, H, W, O, oh, ow
    int kh, kw, ph, pw, sh, sw, dh, dw, group
    int Cg, Og, Kg, P        # channels per group, outputs per group, col rows per group, oh*ow
    bint direct              # 1x1, stride 1, pad 0: the image is already the column matrix
    int bf16                 # the products: 0 float32 sgemm, else a bf16 path (bf16_gemm.h)
    const unsigned short* wpack   # bf16: the weights as the pass's products read them, packed
    Py_ssize_t wpack_group        # once for all images (_pack_weights); per group


cdef extern from "vision_im2col.h":
    void vi_im2col_channel(const float* plane, int H, int W, int oh, int ow, int kh, int kw,
                           int ph, int pw, int sh, int sw, int dh, int dw, float* col) noexcept nogil
    void vi_col2im_channel(const float* col, int H, int W, int oh, int ow, int kh, int kw,
                           int ph, int pw, int sh, int sw, int dh, int dw, float* plane) noexcept nogil
    void _valid_cols "vi_valid_cols"(int off, int s, int W, int ow, int* lo, int* hi) noexcept nogil


cdef inline void _im2col_channel(const float* im, int c, const Geom* g, float* col) noexcept nogil:
    vi_im2col_channel(im + <Py_ssize_t>c * g.H * g.W, g.H, g.W, g.oh, g.ow, g.kh, g.kw, g.ph,
                      g.pw, g.sh, g.sw, g.dh, g.dw, col + <Py_ssize_t>c * g.kh * g.kw * g.P)


cdef inline void _col2im_channel(const float* col, int c, const Geom* g, float* im) noexcept nogil:
    vi_col2im_channel(col + <Py_ssize_t>c * g.kh * g.kw * g.P, g.H, g.W, g.oh, g.ow, g.kh, g.kw,
                      g.ph, g.pw, g.sh, g.sw, g.dh, g.dw, im + <Py_ssize_t>c * g.H * g.W)


cdef void _im2col(const float* im, const Geom* g, float* col) noexcept nogil:
    cdef int c, nt = threads_for(<Py_ssize_t>g.C * g.kh * g.kw * g.P)
    if nt == 1:
        for c in range(g.C):
            _im2col_channel(im, c, g, col)
    else:
        for c in prange(g.C, num_threads=nt, schedule="static"):
            _im2col_channel(im, c, g, col)


cdef void _col2im(const float* col, const Geom* g, float* im) noexcept nogil:
    # each channel owns its image plane and its rows of the column matrix: no races
    cdef int c, nt = threads_for(<Py_ssize_t>g.C * g.kh * g.kw * g.P)
    if nt == 1:
        for c in range(g.C):
            _col2im_channel(col, c, g, im)
    else:
        for c in prange(g.C, num_threads=nt, schedule="static"):
            _col2im_channel(col, c, g, im)


cdef Geom _geom(int C, int H, int W, int O, int kh, int kw, int ph, int pw, int sh, int sw,
                int dh, int dw, int group, str kernel) except *:
    cdef Geom g
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and dh >= 1 and dw >= 1 and ph >= 0
         and pw >= 0, kernel, "geometry", "kernel, stride and dilation must be >= 1 and pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} dilation {dh}x{dw} pad {ph}x{pw}")
    need(group >= 1 and C % group == 0 and O % group == 0, kernel, "group",
         f"must divide {C} input and {O} output channels", group)
    g.C, g.H, g.W, g.O = C, H, W, O
    g.kh, g.kw, g.ph, g.pw, g.sh, g.sw, g.dh, g.dw, g.group = kh, kw, ph, pw, sh, sw, dh, dw, group
    g.oh = (H + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    g.ow = (W + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    need(g.oh >= 1 and g.ow >= 1, kernel, "geometry", f"kernel {kh}x{kw} (dilation {dh}x{dw}, "
         f"pad {ph}x{pw}) does not fit the image", f"{H}x{W}")
    g.Cg = C // group
    g.Og = O // group
    g.Kg = g.Cg * kh * kw
    g.P = g.oh * g.ow
    g.direct = kh == 1 and kw == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0
    g.bf16 = 0
    g.wpack = NULL
    return g


def im2col(const float[:, :, ::1] data_im, int kh, int kw, int pad_h, int pad_w,
           int stride_h, int stride_w, int dil_h, int dil_w, float[:, ::1] data_col):
    """data_col[C*kh*kw, oh*ow] = columns of data_im[C, H, W] (overwritten)."""
    cdef Geom g = _geom(data_im.shape[0], data_im.shape[1], data_im.shape[2], 1, kh, kw,
                        pad_h, pad_w, stride_h, stride_w, dil_h, dil_w, 1, "im2col")
    need_shape("im2col", "data_col", dims(data_col.shape, 2), (g.C * kh * kw, g.P))
    with nogil:
        _im2col(&data_im[0, 0, 0], &g, &data_col[0, 0])


def col2im(const float[:, ::1] data_col, int kh, int kw, int pad_h, int pad_w,
           int stride_h, int stride_w, int dil_h, int dil_w, float[:, :, ::1] data_im):
    """data_im[C, H, W] = sum of the columns back onto the image (zeroed first: overwritten)."""
    cdef Geom g = _geom(data_im.shape[0], data_im.shape[1], data_im.shape[2], 1, kh, kw,
                        pad_h, pad_w, stride_h, stride_w, dil_h, dil_w, 1, "col2im")
    need_shape("col2im", "data_col", dims(data_col.shape, 2), (g.C * kh * kw, g.P))
    with nogil:
        _col2im(&data_col[0, 0], &g, &data_im[0, 0, 0])


def im2col_batch(const float[:, :, :, ::1] data_im, int kh, int kw, int pad_h, int pad_w,
                 int stride_h, int stride_w, int dil_h, int dil_w, float[:, :, ::1] data_col):
    """data_col[N, C*kh*kw, oh*ow] = im2col of every image of data_im[N, C, H, W]."""
    cdef Geom g = _geom(data_im.shape[1], data_im.shape[2], data_im.shape[3], 1, kh, kw,
                        pad_h, pad_w, stride_h, stride_w, dil_h, dil_w, 1, "im2col_batch")
    cdef int N = data_im.shape[0]
    need_shape("im2col_batch", "data_col", dims(data_col.shape, 3), (N, g.C * kh * kw, g.P))
    cdef Py_ssize_t item, n, im_size = <Py_ssize_t>g.C * g.H * g.W
    cdef Py_ssize_t col_size = <Py_ssize_t>g.C * kh * kw * g.P
    if N == 0:
        return
    with nogil:
        for item in prange(<Py_ssize_t>N * g.C, schedule="static",
                           num_threads=threads_for(N * col_size)):
            n = item // g.C
            _im2col_channel(&data_im[0, 0, 0, 0] + n * im_size, <int>(item % g.C), &g,
                            &data_col[0, 0, 0] + n * col_size)


# ---------------------------------------------------------------------------------------------
# The convolutions' products: float32 (the BLAS), or bf16 (bf16_gemm.h) for layers/bf16.py's
# Convolution, which passes the path the CPU has (caffepy/precision.py).

cdef extern from "bf16_gemm.h" nogil:
    ctypedef struct bf_mat:
        const float *p
        long rs, cs
    int bf_gemm(int path, long M, long N, long K, bf_mat a, bf_mat b, float *c, long ldc,
                int accumulate, int threads, const unsigned short *packed)
    float bf_round(float x)
    long bf_packed_size(long M, long K)
    void bf_pack_all(bf_mat a, long M, long K, unsigned short *ap)


cdef inline bf_mat _bf_mat(bint trans, const float* p, long cols) noexcept nogil:
    # a row-major matrix of `cols` columns, read transposed or not
    cdef bf_mat m
    m.p = p
    m.rs, m.cs = (1, cols) if trans else (cols, 1)
    return m


cdef inline void _product(const Geom* g, bint ta, bint tb, int M, int N, int K, const float* a,
                          const float* b, float beta, float* c, int gr) noexcept nogil:
    """c[M, N] = op(a) op(b) + beta c (beta 0 or 1), all row-major and unstrided; gr >= 0: a is
    the weights of group gr, read from g.wpack when packed."""
    if g.bf16 == 0:
        gemm(ta, tb, M, N, K, 1.0, a, b, beta, c)
    else:
        # the packing buffers come from aligned_alloc once per thread; a refusal is an
        # exhausted machine, caught by the layer's own allocations first
        bf_gemm(g.bf16, M, N, K, _bf_mat(ta, a, M if ta else K), _bf_mat(tb, b, K if tb else N),
                c, N, beta != 0, threads_for_macs(<Py_ssize_t>M * N * K),
                g.wpack + gr * g.wpack_group if g.wpack != NULL and gr >= 0 else NULL)


cdef object _pack_weights(Geom* g, const float* w, bint trans):
    """The weights of every group as the products read them (W, or W^T for the data gradient),
    packed to bf16 once for all the images: an array to keep alive while g.wpack is used."""
    cdef long M = g.Kg if trans else g.Og, K = g.Og if trans else g.Kg
    g.wpack_group = bf_packed_size(M, K)
    cdef unsigned short[::1] buf = np.empty(g.group * g.wpack_group, np.uint16)
    cdef int gr
    with nogil:
        for gr in prange(g.group, num_threads=threads_for(<Py_ssize_t>g.O * g.Kg), schedule="static"):
            bf_pack_all(_bf_mat(trans, w + <Py_ssize_t>gr * g.Og * g.Kg, M if trans else K), M, K,
                        &buf[0] + gr * g.wpack_group)
    g.wpack = &buf[0]
    return buf


# ---------------------------------------------------------------------------------------------
# Convolution on one image. Weight is [O, C/g * kh * kw] row-major, group gr uses rows
# [gr*Og, (gr+1)*Og), image channels [gr*Cg, (gr+1)*Cg) and col rows [gr*Kg, (gr+1)*Kg).

cdef void _add_bias_image(float* out, const float* bias, int rows, Py_ssize_t plane) noexcept nogil:
    cdef int r
    cdef Py_ssize_t p
    cdef float b
    cdef float* dst
    if bias == NULL:
        return
    for r in prange(rows, num_threads=threads_for(rows * plane), schedule="static"):
        b = bias[r]
        dst = out + r * plane
        for p in range(plane):
            dst[p] = dst[p] + b


cdef void _fwd_image(const Geom* g, const float* im, const float* w, const float* bias,
                     float* out, float* col) noexcept nogil:
    """out[O, P] = W (*) im + bias: im2col then one GEMM per group."""
    cdef const float* src = im
    cdef int gr
    if not g.direct:
        _im2col(im, g, col)
        src = col
    for gr in range(g.group):
        _product(g, False, False, g.Og, g.P, g.Kg, w + <Py_ssize_t>gr * g.Og * g.Kg,
                 src + <Py_ssize_t>gr * g.Kg * g.P, 0.0, out + <Py_ssize_t>gr * g.Og * g.P, gr)
    _add_bias_image(out, bias, g.O, g.P)


cdef void _bwd_data_image(const Geom* g, const float* out, const float* w, const float* bias,
                          float* im, float* col) noexcept nogil:
    """im[C, H, W] = col2im(W^T out) + bias (overwritten; the bias is a deconv's)."""
    cdef float* dst = im if g.direct else col
    cdef int gr
    for gr in range(g.group):
        _product(g, True, False, g.Kg, g.P, g.Og, w + <Py_ssize_t>gr * g.Og * g.Kg,
                 out + <Py_ssize_t>gr * g.Og * g.P, 0.0, dst + <Py_ssize_t>gr * g.Kg * g.P, gr)
    if not g.direct:
        _col2im(col, g, im)
    _add_bias_image(im, bias, g.C, <Py_ssize_t>g.H * g.W)


cdef void _bwd_weight_image(const Geom* g, const float* im, const float* out, float* wdiff,
                            float* col) noexcept nogil:
    """wdiff[O, Kg] += out @ im2col(im)^T."""
    cdef const float* src = im
    cdef int gr
    if not g.direct:
        _im2col(im, g, col)
        src = col
    for gr in range(g.group):
        _product(g, False, True, g.Og, g.Kg, g.P, out + <Py_ssize_t>gr * g.Og * g.P,
                 src + <Py_ssize_t>gr * g.Kg * g.P, 1.0, wdiff + <Py_ssize_t>gr * g.Og * g.Kg, -1)


cdef void _bias_diff(const Geom* g, int N, const float* out_diff, float* bias_diff) noexcept nogil:
    cdef Py_ssize_t o, n, p
    cdef float acc
    cdef const float* src
    for o in prange(g.O, schedule="static",
                    num_threads=threads_for(<Py_ssize_t>N * g.O * g.P)):
        acc = 0.0
        for n in range(N):
            src = out_diff + (n * g.O + o) * g.P
            if g.bf16:
                for p in range(g.P):
                    acc = acc + bf_round(src[p])      # the rounded top diff, as the products
            else:
                for p in range(g.P):
                    acc = acc + src[p]
        bias_diff[o] += acc


# The batch drivers. `op` picks the per-image work; every image reads `a[n]` and writes `b[n]`.
cdef enum:
    _OP_FWD = 0          # b[n] (column side) = W (*) a[n] (image side)
    _OP_BWD_DATA = 1     # b[n] (image side) = W^T (*) a[n] (column side)
    _OP_BWD_WEIGHT = 2   # wdiff += a[n] (column side) x b[n] (image side)


cdef inline void _one_image(const Geom* g, int op, int n, const float* a, const float* w,
                            const float* bias, float* b, float* wdiff,
                            float* col) noexcept nogil:
    cdef Py_ssize_t im_floats = <Py_ssize_t>g.C * g.H * g.W
    cdef Py_ssize_t out_floats = <Py_ssize_t>g.O * g.P
    if op == _OP_FWD:
        _fwd_image(g, a + n * im_floats, w, bias, b + n * out_floats, col)
    elif op == _OP_BWD_DATA:
        _bwd_data_image(g, a + n * out_floats, w, bias, b + n * im_floats, col)
    else:
        _bwd_weight_image(g, b + n * im_floats, a + n * out_floats, wdiff, col)


cdef void _run_images(const Geom* g, int N, int op, const float* a, const float* w,
                      const float* bias, float* b, float* wdiff, float* ws,
                      Py_ssize_t ws_floats) noexcept nogil:
    cdef Py_ssize_t col_floats = 0 if g.direct else <Py_ssize_t>g.Kg * g.group * g.P
    cdef Py_ssize_t w_floats = <Py_ssize_t>g.O * g.Kg
    # a weight-diff pass needs, past thread 0, a private weight-diff sum per thread
    cdef Py_ssize_t per_thread = col_floats + (w_floats if op == _OP_BWD_WEIGHT else 0)
    cdef int T = _image_threads(N, ws_floats + (w_floats if op == _OP_BWD_WEIGHT else 0),
                                per_thread, <Py_ssize_t>N * g.O * g.P * g.Kg)
    # whole rounds of T images run in parallel
    cdef int n_par = N - N % T if T > 1 else 0
    cdef int n, t, tid, saved
    cdef float* partials = ws + T * col_floats - w_floats
    cdef Py_ssize_t i
    if n_par > 0:
        # ws = T column matrices, then (weight-diff pass) T - 1 private weight-diff sums;
        # thread 0 sums straight into wdiff
        saved = _blas_get_threads()
        _blas_set_threads(1)
        if op == _OP_BWD_WEIGHT:
            memset(partials + w_floats, 0, (T - 1) * w_floats * sizeof(float))
        for n in prange(n_par, num_threads=T, schedule="static", chunksize=1):
            tid = threadid()
            _one_image(g, op, n, a, w, bias, b,
                       wdiff if tid == 0 else partials + tid * w_floats,
                       ws + tid * col_floats)
        _blas_set_threads(saved)
        if op == _OP_BWD_WEIGHT:
            for i in prange(w_floats, num_threads=threads_for(w_floats * T), schedule="static"):
                for t in range(1, T):
                    wdiff[i] += partials[t * w_floats + i]
    # the rest in turn; each region inside (im2col, the products, the bias) sized by the rule
    for n in range(n_par, N):
        _one_image(g, op, n, a, w, bias, b, wdiff, ws)


def conv_workspace_size(int C, int kh, int kw, int out_h, int out_w, int weight_count,
                        bint backward=True):
    """Floats of `col_buffer` that lets every OpenMP thread work on its own images.

    A smaller buffer works too (down to one column matrix, C*kh*kw*out_h*out_w floats, or 0 for
    a 1x1 stride-1 pad-0 convolution): fewer images then run at once. For a deconvolution, pass
    the geometry of the convolution it inverts (C = its top channels, out = its bottom size).
    """
    cdef Py_ssize_t col = <Py_ssize_t>C * kh * kw * out_h * out_w
    cdef int T = openmp.omp_get_max_threads()
    if _conv_threading != _PER_IMAGE or _blas_set_threads == NULL:
        T = 1
    return T * col + ((T - 1) * <Py_ssize_t>weight_count if backward else 0)


cdef Geom _conv_geom(tuple im_shape, tuple out_shape, tuple w_shape, int ph, int pw, int sh,
                     int sw, int dh, int dw, int group, str im_name, str out_name,
                     str kernel) except *:
    cdef Geom g
    need(im_shape[0] == out_shape[0], kernel, out_name,
         f"needs the {im_shape[0]} images of {im_name}", out_shape[0])
    g = _geom(im_shape[1], im_shape[2], im_shape[3], out_shape[1], w_shape[2], w_shape[3],
              ph, pw, sh, sw, dh, dw, group, kernel)
    need_shape(kernel, "weight", w_shape, (g.O, g.Cg, w_shape[2], w_shape[3]))
    need_shape(kernel, out_name, out_shape, (out_shape[0], g.O, g.oh, g.ow))
    return g


cdef Py_ssize_t _ws_floats(const Geom* g, float[::1] col_buffer, str kernel) except -1:
    cdef Py_ssize_t floats = 0 if g.direct else <Py_ssize_t>g.Kg * g.group * g.P
    cdef Py_ssize_t have = 0 if col_buffer is None else col_buffer.shape[0]
    need(have >= floats, kernel, "col_buffer",
         f"needs at least {floats} floats (one column matrix)", have)
    return have


cdef inline float* _ptr(float[::1] buf) noexcept:
    return NULL if buf is None or buf.shape[0] == 0 else &buf[0]


cdef inline const float* _cptr(const float[::1] buf) noexcept:
    if buf is None or buf.shape[0] == 0:
        return NULL
    return &buf[0]


def conv_forward(const float[:, :, :, ::1] bottom, const float[:, :, :, ::1] weight,
                 const float[::1] bias, float[:, :, :, ::1] top, float[::1] col_buffer,
                 int pad_h, int pad_w, int stride_h, int stride_w, int dil_h, int dil_w,
                 int group, int bf16=0):
    """top[N, O, oh, ow] = conv(bottom[N, C, H, W], weight[O, C/group, kh, kw]) + bias[O].

    top is overwritten; bias may be None. col_buffer: see conv_workspace_size. bf16: 0 for
    float32 products, else the bf16 path (kernels.bf16.AVX512 or AMX) the CPU has: bottom and
    weight rounded to bf16 as the products read them, sums in float32.
    """
    cdef Geom g = _conv_geom(dims(bottom.shape, 4), dims(top.shape, 4),
                             dims(weight.shape, 4), pad_h, pad_w, stride_h, stride_w,
                             dil_h, dil_w, group, "bottom", "top", "conv_forward")
    g.bf16 = bf16
    cdef Py_ssize_t ws_floats = _ws_floats(&g, col_buffer, "conv_forward")
    cdef int N = bottom.shape[0]
    cdef float* ws = _ptr(col_buffer)
    if bias is not None:
        need_shape("conv_forward", "bias", dims(bias.shape, 1), (g.O,))
    if N == 0:
        return
    cdef const float* b = _cptr(bias)
    packed = _pack_weights(&g, &weight[0, 0, 0, 0], False) if bf16 else None
    with nogil:
        _run_images(&g, N, _OP_FWD, &bottom[0, 0, 0, 0], &weight[0, 0, 0, 0], b,
                    &top[0, 0, 0, 0], NULL, ws, ws_floats)


def conv_backward(const float[:, :, :, ::1] top_diff, const float[:, :, :, ::1] bottom,
                  const float[:, :, :, ::1] weight, float[:, :, :, ::1] weight_diff,
                  float[::1] bias_diff, float[:, :, :, ::1] bottom_diff, float[::1] col_buffer,
                  int pad_h, int pad_w, int stride_h, int stride_w, int dil_h, int dil_w,
                  int group, int bf16=0):
    """Gradients of conv_forward.

    weight_diff += dL/dweight (None skips it), bias_diff += dL/dbias (None skips it),
    bottom_diff = dL/dbottom (overwritten; None skips it). bf16 as conv_forward's: the top diff,
    bottom and weight rounded, the bias diff the float32 sum of the rounded top diff.
    """
    cdef Geom g = _conv_geom(dims(bottom.shape, 4), dims(top_diff.shape, 4),
                             dims(weight.shape, 4), pad_h, pad_w, stride_h, stride_w,
                             dil_h, dil_w, group, "bottom", "top_diff", "conv_backward")
    g.bf16 = bf16
    cdef Py_ssize_t ws_floats = _ws_floats(&g, col_buffer, "conv_backward")
    cdef int N = bottom.shape[0]
    cdef float* ws = _ptr(col_buffer)
    if weight_diff is not None:
        need_shape("conv_backward", "weight_diff", dims(weight_diff.shape, 4), dims(weight.shape, 4))
    if bias_diff is not None:
        need_shape("conv_backward", "bias_diff", dims(bias_diff.shape, 1), (g.O,))
    if bottom_diff is not None:
        need_shape("conv_backward", "bottom_diff", dims(bottom_diff.shape, 4), dims(bottom.shape, 4))
    if N == 0:
        return
    if bias_diff is not None:
        with nogil:
            _bias_diff(&g, N, &top_diff[0, 0, 0, 0], &bias_diff[0])
    if weight_diff is not None:
        with nogil:
            _run_images(&g, N, _OP_BWD_WEIGHT, &top_diff[0, 0, 0, 0], &weight[0, 0, 0, 0],
                        NULL, <float*>&bottom[0, 0, 0, 0], &weight_diff[0, 0, 0, 0], ws,
                        ws_floats)
    if bottom_diff is not None:
        packed = _pack_weights(&g, &weight[0, 0, 0, 0], True) if bf16 else None
        with nogil:
            _run_images(&g, N, _OP_BWD_DATA, &top_diff[0, 0, 0, 0], &weight[0, 0, 0, 0],
                        NULL, &bottom_diff[0, 0, 0, 0], NULL, ws, ws_floats)


def deconv_forward(const float[:, :, :, ::1] bottom, const float[:, :, :, ::1] weight,
                   const float[::1] bias, float[:, :, :, ::1] top, float[::1] col_buffer,
                   int pad_h, int pad_w, int stride_h, int stride_w, int dil_h, int dil_w,
                   int group):
    """top[N, Co, Ho, Wo] = deconv(bottom[N, Ci, H, W], weight[Ci, Co/group, kh, kw]) + bias[Co].

    Caffe's Deconvolution: the data-gradient of the convolution from top to bottom with the
    same weight and geometry; Ho = geometry.deconv_output_shape(H, ...). top is overwritten.
    """
    cdef Geom g = _conv_geom(dims(top.shape, 4), dims(bottom.shape, 4),
                             dims(weight.shape, 4), pad_h, pad_w, stride_h, stride_w,
                             dil_h, dil_w, group, "top", "bottom", "deconv_forward")
    cdef Py_ssize_t ws_floats = _ws_floats(&g, col_buffer, "deconv_forward")
    cdef int N = bottom.shape[0]
    cdef float* ws = _ptr(col_buffer)
    if bias is not None:
        need_shape("deconv_forward", "bias", dims(bias.shape, 1), (g.C,))
    if N == 0:
        return
    cdef const float* b = _cptr(bias)
    with nogil:
        _run_images(&g, N, _OP_BWD_DATA, &bottom[0, 0, 0, 0], &weight[0, 0, 0, 0], b,
                    &top[0, 0, 0, 0], NULL, ws, ws_floats)


def deconv_backward(const float[:, :, :, ::1] top_diff, const float[:, :, :, ::1] bottom,
                    const float[:, :, :, ::1] weight, float[:, :, :, ::1] weight_diff,
                    float[::1] bias_diff, float[:, :, :, ::1] bottom_diff, float[::1] col_buffer,
                    int pad_h, int pad_w, int stride_h, int stride_w, int dil_h, int dil_w,
                    int group):
    """Gradients of deconv_forward; the same accumulate/overwrite rules as conv_backward."""
    cdef Geom g = _conv_geom(dims(top_diff.shape, 4), dims(bottom.shape, 4),
                             dims(weight.shape, 4), pad_h, pad_w, stride_h, stride_w,
                             dil_h, dil_w, group, "top_diff", "bottom", "deconv_backward")
    cdef Py_ssize_t ws_floats = _ws_floats(&g, col_buffer, "deconv_backward")
    cdef int N = bottom.shape[0]
    cdef float* ws = _ptr(col_buffer)
    cdef Geom gb
    if weight_diff is not None:
        need_shape("deconv_backward", "weight_diff", dims(weight_diff.shape, 4), dims(weight.shape, 4))
    if bias_diff is not None:
        need_shape("deconv_backward", "bias_diff", dims(bias_diff.shape, 1), (g.C,))
    if bottom_diff is not None:
        need_shape("deconv_backward", "bottom_diff", dims(bottom_diff.shape, 4), dims(bottom.shape, 4))
    if N == 0:
        return
    if bias_diff is not None:
        gb = g
        gb.O = g.C
        gb.P = g.H * g.W
        with nogil:
            _bias_diff(&gb, N, &top_diff[0, 0, 0, 0], &bias_diff[0])
    if weight_diff is not None:
        with nogil:
            _run_images(&g, N, _OP_BWD_WEIGHT, &bottom[0, 0, 0, 0], &weight[0, 0, 0, 0],
                        NULL, <float*>&top_diff[0, 0, 0, 0], &weight_diff[0, 0, 0, 0], ws,
                        ws_floats)
    if bottom_diff is not None:
        with nogil:
            _run_images(&g, N, _OP_FWD, &top_diff[0, 0, 0, 0], &weight[0, 0, 0, 0],
                        NULL, &bottom_diff[0, 0, 0, 0], NULL, ws, ws_floats)


# ---------------------------------------------------------------------------------------------
# Pooling: one (n, c) plane per task. Window of output (py, px): rows [py*sh - ph, +kh) and
# columns [px*sw - pw, +kw), clipped to the image (MAX; AVE's divisor clips to the padded image).

cdef _check_pool(str kernel, str bottom, tuple b, str top, tuple t, int kh, int kw, int sh,
                 int sw, int ph, int pw):
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and ph >= 0 and pw >= 0, kernel,
         "geometry", "kernel and stride must be >= 1, pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} pad {ph}x{pw}")
    need(ph < kh and pw < kw, kernel, "geometry", f"pad must be smaller than the kernel {kh}x{kw}",
         f"pad {ph}x{pw}")
    need(b[0] == t[0] and b[1] == t[1] and t[2] >= 1 and t[3] >= 1, kernel, top,
         f"does not fit {bottom} {b}", t)
    # every window must overlap the image, else MAX has no argmax and AVE no divisor
    need((t[2] - 1) * sh - ph < b[2] and (t[3] - 1) * sw - pw < b[3], kernel, top,
         f"has windows past {bottom} {b} (see pool_output_shape)", t)


def max_pool_forward(const float[:, :, :, ::1] bottom, float[:, :, :, ::1] top,
                     int32_t[:, :, :, ::1] mask, int kh, int kw, int sh, int sw, int ph, int pw):
    """top = max over each window; mask = argmax as h * W + w (first max wins; both overwritten)."""
    _check_pool("max_pool_forward", "bottom", dims(bottom.shape, 4), "top", dims(top.shape, 4),
                kh, kw, sh, sw, ph, pw)
    need_shape("max_pool_forward", "mask", dims(mask.shape, 4), dims(top.shape, 4))
    cdef int H = bottom.shape[2], W = bottom.shape[3], oh = top.shape[2], ow = top.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>bottom.shape[0] * bottom.shape[1], pl
    if planes == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                          num_threads=threads_for(planes * oh * ow * kh * kw)):
            _max_pool_plane(&bottom[0, 0, 0, 0] + pl * H * W, &top[0, 0, 0, 0] + pl * oh * ow,
                            &mask[0, 0, 0, 0] + pl * oh * ow, H, W, oh, ow, kh, kw, sh, sw, ph, pw)


cdef void _max_pool_plane(const float* x, float* y, int32_t* mask, int H, int W, int oh, int ow,
                          int kh, int kw, int sh, int sw, int ph, int pw) noexcept nogil:
    # Branch-free selects: on real data '>' is a coin flip that a branch predictor loses (3x
    # slower measured); '>' keeps the first maximum in row-major order, as Caffe's scan does.
    cdef int py, px, h, w, hs, he, ws, we, arg
    cdef float m, v
    cdef const float* xr
    for py in range(oh):
        hs = py * sh - ph
        he = min(hs + kh, H)
        hs = max(hs, 0)
        for px in range(ow):
            ws = px * sw - pw
            we = min(ws + kw, W)
            ws = max(ws, 0)
            m = -FLT_MAX
            arg = -1
            for h in range(hs, he):
                xr = x + h * W
                for w in range(ws, we):
                    v = xr[w]
                    arg = h * W + w if v > m else arg
                    m = v if v > m else m
            y[py * ow + px] = m
            mask[py * ow + px] = arg


def max_pool_backward(const float[:, :, :, ::1] top_diff, const int32_t[:, :, :, ::1] mask,
                      float[:, :, :, ::1] bottom_diff):
    """bottom_diff = top_diff routed to each window's argmax (zeroed first: overwritten)."""
    need_shape("max_pool_backward", "mask", dims(mask.shape, 4), dims(top_diff.shape, 4))
    need(dims(bottom_diff.shape, 2) == dims(top_diff.shape, 2), "max_pool_backward",
         "bottom_diff", f"does not fit top_diff {dims(top_diff.shape, 4)}",
         dims(bottom_diff.shape, 4))
    cdef Py_ssize_t HW = <Py_ssize_t>bottom_diff.shape[2] * bottom_diff.shape[3]
    cdef Py_ssize_t OHW = <Py_ssize_t>top_diff.shape[2] * top_diff.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>top_diff.shape[0] * top_diff.shape[1], pl, i
    cdef float* dst
    cdef const float* src
    cdef const int32_t* arg
    if planes == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                          num_threads=threads_for(planes * (HW + OHW))):
            dst = &bottom_diff[0, 0, 0, 0] + pl * HW
            src = &top_diff[0, 0, 0, 0] + pl * OHW
            arg = &mask[0, 0, 0, 0] + pl * OHW
            memset(dst, 0, HW * sizeof(float))
            for i in range(OHW):
                if arg[i] >= 0 and arg[i] < HW:
                    dst[arg[i]] += src[i]


def ave_pool_forward(const float[:, :, :, ::1] bottom, float[:, :, :, ::1] top,
                     int kh, int kw, int sh, int sw, int ph, int pw):
    """top = window sum / window size clipped to the padded image (overwritten)."""
    _check_pool("ave_pool_forward", "bottom", dims(bottom.shape, 4), "top", dims(top.shape, 4),
                kh, kw, sh, sw, ph, pw)
    cdef int H = bottom.shape[2], W = bottom.shape[3], oh = top.shape[2], ow = top.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>bottom.shape[0] * bottom.shape[1], pl
    if planes == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                          num_threads=threads_for(planes * oh * ow * kh * kw)):
            _ave_pool_plane(&bottom[0, 0, 0, 0] + pl * H * W, &top[0, 0, 0, 0] + pl * oh * ow,
                            H, W, oh, ow, kh, kw, sh, sw, ph, pw)


cdef void _ave_pool_plane(const float* x, float* y, int H, int W, int oh, int ow,
                          int kh, int kw, int sh, int sw, int ph, int pw) noexcept nogil:
    cdef int py, px, h, j, hs, he, lo, hi, off, ws, we
    cdef float* yr
    cdef const float* xr
    for py in range(oh):
        yr = y + py * ow
        for px in range(ow):
            yr[px] = 0.0
        hs = py * sh - ph
        he = min(hs + kh, H + ph)
        for h in range(max(hs, 0), min(he, H)):
            xr = x + h * W
            for j in range(kw):
                off = j - pw
                _valid_cols(off, sw, W, ow, &lo, &hi)
                for px in range(lo, hi):
                    yr[px] += xr[px * sw + off]
        for px in range(ow):
            ws = px * sw - pw
            we = min(ws + kw, W + pw)
            yr[px] = yr[px] / ((he - hs) * (we - ws))


def ave_pool_backward(const float[:, :, :, ::1] top_diff, float[:, :, :, ::1] bottom_diff,
                      int kh, int kw, int sh, int sw, int ph, int pw):
    """bottom_diff = each top_diff spread evenly over its window (zeroed first: overwritten)."""
    _check_pool("ave_pool_backward", "bottom_diff", dims(bottom_diff.shape, 4), "top_diff",
                dims(top_diff.shape, 4), kh, kw, sh, sw, ph, pw)
    cdef int H = bottom_diff.shape[2], W = bottom_diff.shape[3]
    cdef int oh = top_diff.shape[2], ow = top_diff.shape[3]
    cdef Py_ssize_t planes = <Py_ssize_t>top_diff.shape[0] * top_diff.shape[1], pl
    if planes == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static",
                          num_threads=threads_for(planes * oh * ow * kh * kw)):
            _ave_unpool_plane(&top_diff[0, 0, 0, 0] + pl * oh * ow,
                              &bottom_diff[0, 0, 0, 0] + pl * H * W,
                              H, W, oh, ow, kh, kw, sh, sw, ph, pw)


cdef void _ave_unpool_plane(const float* dy, float* dx, int H, int W, int oh, int ow,
                            int kh, int kw, int sh, int sw, int ph, int pw) noexcept nogil:
    cdef int py, px, h, w, hs, he, ws, we
    cdef float g
    cdef float* xr
    memset(dx, 0, <Py_ssize_t>H * W * sizeof(float))
    for py in range(oh):
        hs = py * sh - ph
        he = min(hs + kh, H + ph)
        for px in range(ow):
            ws = px * sw - pw
            we = min(ws + kw, W + pw)
            g = dy[py * ow + px] / ((he - hs) * (we - ws))
            for h in range(max(hs, 0), min(he, H)):
                xr = dx + h * W
                for w in range(max(ws, 0), min(we, W)):
                    xr[w] += g


# ---------------------------------------------------------------------------------------------
# ROIPooling (Fast R-CNN): max over each region of interest's bins

def roi_pool_forward(const float[:, :, :, ::1] bottom, const int32_t[::1] batch,
                     const int32_t[:, ::1] hstart, const int32_t[:, ::1] hend,
                     const int32_t[:, ::1] wstart, const int32_t[:, ::1] wend,
                     float[:, :, :, ::1] top, int32_t[:, :, :, ::1] argmax):
    """top[r, c, i, j] = max of plane (batch[r], c) over rows [hstart[r, i], hend[r, i]) and
    columns [wstart[r, j], wend[r, j]); argmax = h * W + w of the first maximum in row-major
    order (Caffe's scan). An empty bin gives 0 and argmax -1. The bins are the caller's, within
    the map; batch indices in [0, N). Both outputs overwritten."""
    cdef int N = bottom.shape[0], C = bottom.shape[1], H = bottom.shape[2], W = bottom.shape[3]
    cdef int R = top.shape[0], PH = top.shape[2], PW = top.shape[3]
    need(top.shape[1] == C and dims(argmax.shape, 4) == dims(top.shape, 4), "roi_pool_forward", "top",
         f"does not fit bottom {dims(bottom.shape, 4)} and argmax {dims(argmax.shape, 4)}", dims(top.shape, 4))
    need(batch.shape[0] == R and dims(hstart.shape, 2) == (R, PH) and dims(hend.shape, 2) == (R, PH)
         and dims(wstart.shape, 2) == (R, PW) and dims(wend.shape, 2) == (R, PW), "roi_pool_forward", "bins",
         f"need R x {PH} rows and R x {PW} columns for {R} rois",
         (dims(hstart.shape, 2), dims(wstart.shape, 2)))
    cdef Py_ssize_t planes = <Py_ssize_t>R * C, pl
    cdef int r, c, i, j, h, w, arg
    cdef float m, v
    cdef const float* x
    for r in range(R):
        need(0 <= batch[r] < N, "roi_pool_forward", "batch", f"must lie in [0, {N})", batch[r])
        for i in range(PH):
            need(0 <= hstart[r, i] and hend[r, i] <= H, "roi_pool_forward", "hstart/hend",
                 f"must lie in [0, {H}]", (hstart[r, i], hend[r, i]))
        for j in range(PW):
            need(0 <= wstart[r, j] and wend[r, j] <= W, "roi_pool_forward", "wstart/wend",
                 f"must lie in [0, {W}]", (wstart[r, j], wend[r, j]))
    if planes == 0:
        return
    with nogil:
        for pl in prange(planes, schedule="static", num_threads=threads_for(planes * PH * PW * 4)):
            r = <int>(pl // C)
            c = <int>(pl % C)
            x = &bottom[batch[r], c, 0, 0]
            for i in range(PH):
                for j in range(PW):
                    arg = -1
                    m = 0
                    for h in range(hstart[r, i], hend[r, i]):
                        for w in range(wstart[r, j], wend[r, j]):
                            v = x[h * W + w]
                            if arg < 0 or v > m:
                                m = v
                                arg = h * W + w
                    top[r, c, i, j] = m
                    argmax[r, c, i, j] = arg
