# cython: language_level=3
"""Kernels of Intel Caffe's int8 inference (caffepy/quantization.py): the convolution and the
inner product on 8-bit integers with int32 sums (cext/int8_gemm.h), and the quantization of
weights. Exact integer arithmetic: every ISA gives the same integers, and the float32 epilogue
runs the same operations in the same order, so the paths agree to the bit. The NumPy
references are in caffepy/kernels/reference/int8.py.
"""
import numpy as np

from libc.stdint cimport int8_t, int16_t, int32_t, uint8_t
from rules cimport dims, need, need_shape, threads_for, threads_for_macs

cdef extern from "int8_gemm.h" nogil:
    int I8_NR, I8_MR
    ctypedef struct i8_epilogue:
        const int32_t *bias
        const float *mult
        const float *summand
        float sum_scale
        int relu
        float slope
        int quantize
        float lo, hi
        float inv_scale_out
        float *out
        long so, sp
        uint8_t *out8
        long row8
        int zp8
        const uint8_t *summand8
        long srow8
        int szp8
        float s_inv
    void i8_conv_image(int isa, int threads, const float *x, int C, int H, int W, int G, int Mg,
                       int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH,
                       int OW, float scale, float lo, float hi, const int16_t *w, int32_t *q,
                       int32_t *b, int32_t *c, const i8_epilogue *e)
    void i8_depthwise_image(int isa, int threads, const float *x, int C, int H, int W, int kh,
                            int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH, int OW,
                            float scale, float lo, float hi, const int16_t *w, int32_t *q,
                            int32_t *acc, const i8_epilogue *e)
    void i8_inner_product(int isa, int threads, const float *x, int M, int K, int N, int Kp,
                          float scale, float lo, float hi, const int16_t *w, int32_t *b,
                          int32_t *c, const i8_epilogue *e)

cdef extern from "int8_nhwc.h" nogil:
    int I8_VNNI, I8_AMX, I8_AVXVNNI, I8_AVX2BYTES, I8_HALF_WEIGHT_MAX
    bint i8n_bytes(int isa)       # the byte paths (vnni, amx, avxvnni, avx2bytes): 8-bit tops as bytes
    bint i8n_avx512(int isa)      # those with AVX-512 kernels of their own (vnni, amx)
    void i8n_conv(int isa, int threads, const float *x, int N, int H, int W, int C, int O,
                  int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH,
                  int OW, float scale, float lo, float hi, const void *w, void *q,
                  const uint8_t *staged, const i8_epilogue *e)
    long i8n_staged_bytes(int N, int H, int W, int C)
    void i8n_pool_max(int avx512, int threads, const uint8_t *x, int N, int H, int W, long row,
                      int OH, int OW, int kh, int kw, int sh, int sw, int ph, int pw, uint8_t *y)
    void i8n_copy_channels(int threads, const uint8_t *src, long P, long sr, int C,
                           uint8_t *dst, long dr, int offset)
    void i8n_fill_floats(int threads, const uint8_t *b, long P, long row, int C, int zp,
                         float inv, float *out)
    int i8_isa_available()
    int i8_isa_mask()
    long i8n_scratch(int isa, int N, int H, int W, int C, int O, int kh, int kw, int ph,
                     int pw, int dw, int threads)
    long i8a_quads(int taps, int J)
    int i8a_wide_rows(int wide, int J, int sw, int kw)
    long i8a_tile_quads(int taps, int J, int wide_rows)
    int i8n_wide(int C, int kw, int dw)
    long i8n_dw_scratch(int isa, int H, int W, int C, int kh, int kw, int sh, int dh, int OH,
                        int OW, int threads)
    int I8W_MAX_C
    long i8w_scratch(int Cp)
    void i8w_conv(int isa, int threads, const float *x, int N, int H, int W, int C, int O,
                  int ph, int pw, int OH, int OW, float scale, float lo, float hi,
                  const int16_t *u, int16_t *q, int32_t *scratch, const i8_epilogue *e)
    void i8n_depthwise(int isa, int threads, const float *x, int N, int H, int W, int C,
                       int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw, int OH,
                       int OW, float scale, float lo, float hi, const float *w, float *qf,
                       float *accs, int32_t *iaccs, const uint8_t *staged, int zp,
                       const i8_epilogue *e)

NR, MR = I8_NR, I8_MR
# 'vnni' and 'amx': AVX-512 VNNI or AMX tiles for the channels-last convolution's products
# (their own weights layouts: nhwc_weights), AVX2 for the rest; 'avxvnni': the 256-bit VNNI
# of CPUs without AVX-512 for those products (the 'vnni' weights), AVX2 for the rest;
# 'avx2bytes' (opt-in): the 'avxvnni' path's kernels with AVX2's vpmaddubsw for the products,
# exact only for weights in [-HALF_WEIGHT_MAX, HALF_WEIGHT_MAX] (int8_avxvnni.h). A tuple
# index is the kernels' isa number.
ISAS = ("generic", "avx2", "vnni", "amx", "avxvnni", "avx2bytes")
VNNI, AMX, AVXVNNI, AVX2BYTES = I8_VNNI, I8_AMX, I8_AVXVNNI, I8_AVX2BYTES
BYTE_ISAS = tuple(isa for i, isa in enumerate(ISAS) if i8n_bytes(i))     # quads of bytes
HALF_WEIGHT_MAX = I8_HALF_WEIGHT_MAX


def _half_weights(str kernel, str arg, w):
    """avx2bytes's products are exact only for weights in [-HALF_WEIGHT_MAX, HALF_WEIGHT_MAX]
    (int8_avxvnni.h): refuse others in one line."""
    if np.asarray(w).size:
        top = np.abs(np.asarray(w, np.float64)).max()
        need(top <= HALF_WEIGHT_MAX, kernel, arg,
             f"needs weights in [-{HALF_WEIGHT_MAX}, {HALF_WEIGHT_MAX}] on avx2bytes",
             int(top) if top == int(top) else float(top))


def best_isa():
    """The fastest ISA the int8 kernels can run here: 'amx' where the CPU has AMX-INT8 and Linux
    grants its tiles, 'vnni' where it has AVX-512 VNNI, 'avxvnni' where it has AVX-VNNI, 'avx2'
    where it has AVX2 (and the module was built for it), else 'generic' (portable C). Never
    'avx2bytes', whose weights are not the other paths'."""
    return ISAS[i8_isa_available()]


def available_isas():
    """Every ISA the int8 kernels can run here, the portable C first."""
    mask = i8_isa_mask()
    return tuple(isa for i, isa in enumerate(ISAS) if mask & (1 << i))


cdef int _isa(str isa) except -1:
    need(isa in ISAS, "int8", "isa", f"must be one of {ISAS}", isa)
    need(i8_isa_mask() & (1 << ISAS.index(isa)), "int8", "isa", "not available here", isa)
    return ISAS.index(isa)


def padded(int k):
    """The weights' row length for k products: even (pairs)."""
    return k + (k & 1)


def conv_weights(wq):
    """Quantized convolution weights [O, C / group, kh, kw] in the kernels' order: row o holds
    k = (kernel row, kernel column, channel) with the channels padded to even (a pair is two
    channels of one pixel)."""
    o, cg, kh, kw = wq.shape
    out = np.zeros((o, kh, kw, padded(cg)), np.int16)
    out[..., :cg] = np.transpose(wq, (0, 2, 3, 1))
    return out.reshape(o, -1)


def columns(long p):
    """The right-hand side's column count for p columns (whole register tiles)."""
    return (p + I8_NR - 1) // I8_NR * I8_NR


def quantize_weights(const float[:, ::1] w, const float[::1] scales, int16_t[:, ::1] out):
    """out[o, k] = saturate_s8(rint(w[o, k] * scales[o or 0])), zero past w's columns (out has
    padded(K) of them)."""
    cdef Py_ssize_t O = w.shape[0], K = w.shape[1], o, k
    cdef bint one = scales.shape[0] == 1
    cdef float s, v
    need(one or scales.shape[0] == O, "quantize_weights", "scales", f"needs 1 or {O}", scales.shape[0])
    need_shape("quantize_weights", "out", dims(out.shape, 2), (O, padded(K)))
    with nogil:
        for o in range(O):
            s = scales[0] if one else scales[o]
            for k in range(K):
                v = w[o, k] * s
                v = -128.0 if not v > -128.0 else v
                v = 127.0 if v > 127.0 else v
                out[o, k] = <int16_t>_rint(v)
            for k in range(K, out.shape[1]):
                out[o, k] = 0


cdef extern from "math.h" nogil:
    float _rint "rintf"(float)


cdef int _check_epilogue(str kernel, int O, const int32_t[::1] bias, const float[::1] mult,
                         summand, tuple top) except -1:
    """The epilogue's arguments, checked alike for every kernel: mult and bias (or None) one per
    output channel (O), summand None or float32 of the top's shape."""
    cdef const float[:, :, :, ::1] s4
    need_shape(kernel, "mult", dims(mult.shape, 1), (O,))
    if bias is not None:
        need_shape(kernel, "bias", dims(bias.shape, 1), (O,))
    if summand is not None:
        s4 = summand
        need_shape(kernel, "summand", dims(s4.shape, 4), top)
    return 0


cdef i8_epilogue _epilogue(const int32_t[::1] bias, const float[::1] mult, summand,
                           float sum_scale, bint relu, float slope, bint quantize, float lo,
                           float hi, float inv_scale_out, float[::1] out, long so, long sp,
                           out_bytes=None, summand_bytes=None):
    """out_bytes, summand_bytes: Bytes-like (array, row, zp, inv) for the channels-last
    kernels' 8-bit top written as bytes (out then unused: None) and a summand read as bytes."""
    cdef i8_epilogue e
    cdef const float[::1] s
    cdef uint8_t[::1] o8
    cdef const uint8_t[::1] s8
    e.bias = &bias[0] if bias is not None else NULL
    e.mult = &mult[0]
    e.summand = NULL
    if summand is not None:
        s = summand
        e.summand = &s[0]
    e.sum_scale, e.relu, e.slope = sum_scale, relu, slope
    e.quantize, e.lo, e.hi, e.inv_scale_out = quantize, lo, hi, inv_scale_out
    e.out, e.so, e.sp = (&out[0] if out is not None else NULL), so, sp
    e.out8, e.row8, e.zp8 = NULL, 0, 0
    e.summand8, e.srow8, e.szp8, e.s_inv = NULL, 0, 0, 1
    if out_bytes is not None:
        o8 = out_bytes.array
        e.out8, e.row8, e.zp8 = &o8[0], out_bytes.row, out_bytes.zp
    if summand_bytes is not None:
        s8 = summand_bytes.array
        e.summand8, e.srow8 = &s8[0], summand_bytes.row
        e.szp8, e.s_inv = summand_bytes.zp, summand_bytes.inv
    return e


def staged_bytes(int N, int H, int W, int C):
    """Bytes of an 8-bit channels-last top held for the next layers' kernels: its pixels, 4
    ceil(C / 4) bytes each (conv_forward_nhwc's `staged`), then the zero points its readers'
    taps outside the image read."""
    return i8n_staged_bytes(N, H, W, C)


def pool_max_bytes(x, y, kernel, stride, pad, str isa=None):
    """Max pooling of an 8-bit channels-last top held as Bytes (x) into Bytes (y) of the
    pooled shape (the same scale and zero point): AVX-512 on the byte paths vnni and amx,
    portable C (AVX2) on avxvnni; isa None: the best the CPU has."""
    n, h, w, c = x.shape
    yn, oh, ow, yc = y.shape
    need(yn == n and yc == c and x.row == y.row and x.zp == y.zp, "pool_max_bytes", "y",
         f"needs {n} images of {c} channels and zero point {x.zp}", (y.shape, y.zp))
    cdef int which = _isa(best_isa() if isa is None else isa)
    need(i8n_bytes(which), "pool_max_bytes", "isa", f"needs a byte path {BYTE_ISAS}", isa)
    need(kernel[0] > pad[0] and kernel[1] > pad[1], "pool_max_bytes", "pad",
         "needs windows that hold a pixel (pad below the kernel)", (tuple(kernel), tuple(pad)))
    cdef const uint8_t[::1] xv = x.array
    cdef uint8_t[::1] yv = y.array
    need(xv.shape[0] >= <long>n * h * w * x.row and yv.shape[0] >= <long>n * oh * ow * y.row,
         "pool_max_bytes", "x", "needs its pixels' bytes", (xv.shape[0], yv.shape[0]))
    cdef int kh = kernel[0], kw = kernel[1], sh = stride[0], sw = stride[1]
    cdef int ph = pad[0], pw = pad[1], N = n, H = h, W = w, OH = oh, OW = ow
    cdef long row = x.row
    cdef int threads = threads_for(<Py_ssize_t>n * oh * ow * c * kh * kw)
    if n * oh * ow == 0:
        return
    with nogil:
        i8n_pool_max(i8n_avx512(which), threads if threads > 0 else 1, &xv[0], N, H, W, row,
                     OH, OW, kh, kw, sh, sw, ph, pw, &yv[0])


def fill_floats(x, float[::1] out):
    """out[: pixels * C] = the floats of Bytes x (channels-last), as its writer computes them."""
    n, h, w, c = x.shape
    cdef long P = <long>n * h * w, row = x.row
    cdef int C = c, zp = x.zp
    cdef float inv = x.inv
    cdef const uint8_t[::1] xv = x.array
    need(out.shape[0] >= P * C and xv.shape[0] >= P * row, "fill_floats", "out",
         f"needs {P * C} floats and the bytes' pixels", (out.shape[0], xv.shape[0]))
    cdef int threads = threads_for(P * C)
    if P * C:
        with nogil:
            i8n_fill_floats(threads if threads > 0 else 1, &xv[0], P, row, C, zp, inv, &out[0])


def concat_bytes(parts, y):
    """Bytes `parts` (of y's pixels, their channels in order) concatenated along channels
    into Bytes y."""
    n, h, w, c = y.shape
    cdef long P = <long>n * h * w
    cdef int offset = 0, C
    cdef long xr, yr = y.row
    cdef const uint8_t[::1] xv
    cdef uint8_t[::1] yv = y.array
    need(sum(x.shape[3] for x in parts) == c and all(x.shape[:3] == y.shape[:3] for x in parts),
         "concat_bytes", "parts", f"need {n} x {h} x {w} pixels of {c} channels in all",
         [x.shape for x in parts])
    need(yv.shape[0] >= P * y.row, "concat_bytes", "y", "needs its pixels' bytes", yv.shape[0])
    cdef int threads = threads_for(P * c)
    for x in parts:
        if x.whole is y and x.offset == offset:       # written in place by its layer
            offset += x.shape[3]
            continue
        xv, C, xr = x.array, x.shape[3], x.row
        need(xv.shape[0] >= P * xr, "concat_bytes", "parts", "need their pixels' bytes",
             xv.shape[0])
        if P:
            with nogil:
                i8n_copy_channels(threads if threads > 0 else 1, &xv[0], P, xr, C, &yv[0], yr,
                                  offset)
        offset += C


def _input_shape(str kernel, x, staged, shape):
    """(N, H, W, C) of a channels-last kernel's input: x's, or `shape` where it is staged."""
    need((staged is None) != (x is None), kernel, "staged", "needs x None (and x staged None)",
         staged)
    return tuple(x.shape) if x is not None else tuple(shape)


cdef const float *_floats(x) except? NULL:
    """x's first float (x outlives the pointer: the caller holds it), or NULL for None."""
    cdef const float[:, :, :, ::1] xv
    if x is None:
        return NULL
    xv = x
    return &xv[0, 0, 0, 0]


cdef const uint8_t *_staged(str kernel, staged, tuple shape, float lo_in) except? NULL:
    """The bytes of an input staged as Bytes (checked against its shape and range), or NULL."""
    cdef const uint8_t[::1] sv
    if staged is None:
        return NULL
    _bytes_epilogue(kernel, staged, None, True, shape)
    need(staged.zp == (128 if lo_in < 0 else 0), kernel, "staged",
         "needs the zero point of this layer's input range", staged.zp)
    sv = staged.array
    return &sv[0]


def _bytes_epilogue(str kernel, out_bytes, summand_bytes, bint quantize, tuple top):
    """Check the 8-bit top and summand given as bytes against the top's shape. A top may be a
    concat's slot (quantization.Bytes.slot): its pixels' channels in wider rows."""
    n, h, w, c = top
    for what, b in (("out_bytes", out_bytes), ("summand_bytes", summand_bytes)):
        if b is None:
            continue
        if what == "out_bytes" and b.row > 4 * ((c + 3) // 4):
            need(b.array.dtype == np.uint8 and b.array.shape[0] >= (n * h * w - 1) * b.row + c,
                 kernel, what, "needs uint8 rows holding the pixels' channels",
                 (b.array.shape, b.row))
            continue
        need(b.row == 4 * ((c + 3) // 4) and b.array.dtype == np.uint8
             and b.array.shape[0] >= staged_bytes(n, h, w, c), kernel, what,
             "needs staged_bytes of uint8 rows of 4 ceil(C / 4) bytes", (b.array.shape, b.row))
    need(out_bytes is None or quantize, kernel, "out_bytes", "needs an 8-bit top (quantize)",
         quantize)


def conv_forward(const float[:, :, :, ::1] x, const int16_t[:, ::1] w, const int32_t[::1] bias,
                 const float[::1] mult, float[:, :, :, ::1] top, summand, int group,
                 kernel, pad, stride, dilation, float scale_in, float lo_in, float hi_in,
                 float sum_scale, bint relu, float slope, bint quantize, float lo, float hi,
                 float inv_scale_out, str isa):
    """top = the int8 convolution of x (see int8_gemm.h): x quantized with scale_in into
    [lo_in, hi_in], weights w [O][...] quantized and ordered by conv_weights, int32 sums
    plus bias (or None), then per output y = sum * mult[o] (+ summand * sum_scale) (ReLU of
    slope) (rounded and saturated to [lo, hi] when quantize) times inv_scale_out. summand: None
    or float32 of top's shape."""
    cdef int N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef int O = w.shape[0], G = group, kh = kernel[0], kw = kernel[1]
    cdef int ph = pad[0], pw = pad[1], sh = stride[0], sw = stride[1]
    cdef int dh = dilation[0], dw = dilation[1], OH = top.shape[2], OW = top.shape[3]
    cdef int Cp = (C // G + 1) // 2, J = kh * kw * Cp, K = C // G * kh * kw, Mg = O // G, i, threads
    cdef long P = <long>OH * OW, Np = columns(P), HW = <long>H * W
    cdef int which = _isa(isa)
    need(C % G == 0 and O % G == 0, "conv_forward", "group", f"must divide {C} and {O}", G)
    need_shape("conv_forward", "w", dims(w.shape, 2), (O, 2 * J))
    need_shape("conv_forward", "top", dims(top.shape, 4), (N, O, OH, OW))
    _check_epilogue("conv_forward", O, bias, mult, summand, (N, O, OH, OW))
    threads = threads_for_macs(<Py_ssize_t>O * K * P)
    if threads < 1:
        threads = 1
    cdef bint depthwise = G == C and O == C
    # q the quantized input, c each thread's int32 sums (a depthwise output row, or a column
    # tile's rows), b the GEMM's right-hand side (depthwise has none)
    q = np.empty(G * Cp * HW, np.int32)
    c = np.empty(threads * (OW if depthwise else max(Mg, I8_MR) * I8_NR), np.int32)
    b = np.empty(1 if depthwise else G * J * Np, np.int32)
    cdef int32_t[::1] qv = q, bv = b, cv = c
    cdef i8_epilogue e
    cdef float[::1] flat = np.asarray(top).reshape(-1)
    for i in range(N):
        e = _epilogue(bias, mult, None if summand is None else np.asarray(summand[i]).reshape(-1),
                      sum_scale, relu, slope, quantize, lo, hi, inv_scale_out,
                      flat[i * O * P:(i + 1) * O * P], P, 1)
        with nogil:
            if depthwise:
                i8_depthwise_image(which, threads, &x[i, 0, 0, 0], C, H, W, kh, kw, ph, pw, sh,
                                   sw, dh, dw, OH, OW, scale_in, lo_in, hi_in, &w[0, 0], &qv[0],
                                   &cv[0], &e)
            else:
                i8_conv_image(which, threads, &x[i, 0, 0, 0], C, H, W, G, Mg, kh, kw, ph, pw,
                              sh, sw, dh, dw, OH, OW, scale_in, lo_in, hi_in, &w[0, 0], &qv[0],
                              &bv[0], &cv[0], &e)


def inner_product(const float[:, ::1] x, const int16_t[:, ::1] w, const int32_t[::1] bias,
                  const float[::1] mult, float[:, ::1] top, float scale_in, float lo_in,
                  float hi_in, bint relu, float slope, bint quantize, float lo, float hi,
                  float inv_scale_out, str isa, packed=None):
    """top [M, N] = the int8 inner product of x [M, K] with w [N][padded(K)], as conv_forward.
    On the byte paths (BYTE_ISAS) it is the channels-last 1 x 1 convolution of M pixels of K
    channels (the same integers and epilogue; top's rows are its pixels): `packed`, w as
    nhwc_weights(w, K, isa=isa) packs it (None: packed here, for each call)."""
    cdef int M = x.shape[0], K = x.shape[1], N = w.shape[0], Kp = padded(K), threads
    cdef long Np = columns(M)
    cdef int which = _isa(isa)
    need_shape("inner_product", "w", dims(w.shape, 2), (N, Kp))
    need_shape("inner_product", "top", dims(top.shape, 2), (M, N))
    _check_epilogue("inner_product", N, bias, mult, None, None)
    if i8n_bytes(which):
        conv_forward_nhwc(np.asarray(x).reshape(M, 1, 1, K),
                          nhwc_weights(np.asarray(w), K, isa=isa) if packed is None else packed,
                          bias, mult, np.asarray(top).reshape(M, 1, 1, N), None, (1, 1), (0, 0),
                          (1, 1), (1, 1), scale_in, lo_in, hi_in, 0.0, relu, slope, quantize, lo,
                          hi, inv_scale_out, isa)
        return
    threads = threads_for_macs(<Py_ssize_t>M * N * K)
    if threads < 1:
        threads = 1
    b = np.empty((Kp // 2) * Np, np.int32)
    c = np.empty(threads * I8_MR * I8_NR, np.int32)
    cdef int32_t[::1] bv = b, cv = c
    cdef float[::1] flat = np.asarray(top).reshape(-1)
    cdef i8_epilogue e = _epilogue(bias, mult, None, 0, relu, slope, quantize, lo, hi,
                                   inv_scale_out, flat, 1, N)
    with nogil:
        i8_inner_product(which, threads, &x[0, 0], M, K, N, Kp, scale_in, lo_in, hi_in, &w[0, 0],
                         &bv[0], &cv[0], &e)


# ---------------------------------------------------------------------------------------------
# Channels-last (cext/int8_nhwc.h): the same integers and epilogue as above, to the bit.

def nhwc_units(int channels, kernel, dilation, str isa="avx2"):
    """The units of one tap of conv_forward_nhwc's weights (pairs of channels, quads on the
    VNNI, AMX and AVX-VNNI paths), and its taps."""
    kh, kw = kernel
    per = 4 if isa in BYTE_ISAS else 2
    if i8n_wide(channels, kw, dilation[1]):
        return (kw * channels + per - 1) // per, kh
    return (channels + per - 1) // per, kh * kw


def amx_quads(int channels, kernel, dilation, stride):
    """(quads of a column tile of the AMX path's weights, whether each tap is a chunk of its
    own): int8_amx.h i8a_tile_quads, i8a_wide_rows."""
    units, taps = nhwc_units(channels, kernel, dilation, "amx")
    wide_rows = i8a_wide_rows(i8n_wide(channels, kernel[1], dilation[1]), units, stride[1],
                              kernel[1])
    return i8a_tile_quads(taps, units, wide_rows), bool(wide_rows)


def nhwc_weights(wq, int channels, kernel=(1, 1), dilation=(1, 1), str isa="avx2",
                 stride=(1, 1)):
    """conv_weights' rows [O][kh kw padded(C)] as the channels-last kernel's column tiles
    [ceil(O / 16)][J][16][2] int16 (pairs), or for the byte paths (BYTE_ISAS)
    [ceil(O / 16)][J][16][4] int8
    (quads; AMX: amx_quads, J rounded up to whole chunks of 16, or each tap a chunk where the
    taps' rows load in place), zero past O and past each tap's channels. For few channels
    (int8_nhwc.h i8n_wide) a tap is a kernel row: its (kernel column, channel) values, then
    zero weights. The avx2bytes path's products are exact only for weights in
    [-HALF_WEIGHT_MAX, HALF_WEIGHT_MAX]: others are refused."""
    o = wq.shape[0]
    if isa == "avx2bytes":
        _half_weights("nhwc_weights", "wq", wq)
    kh, kw = kernel
    units, taps = nhwc_units(channels, kernel, dilation, isa)
    per = 4 if isa in BYTE_ISAS else 2         # as nhwc_units
    w = np.asarray(wq).reshape(o, kh, kw, padded(channels))[..., :channels]
    w = w.reshape(o, taps, -1)          # a tap's values: one pixel's channels, or a kernel row's
    o16 = (o + 15) // 16
    out = np.zeros((o16 * 16, taps, units * per), np.int8 if per == 4 else np.int16)
    out[:o, :, :w.shape[2]] = w
    quads, wide_rows = (amx_quads(channels, kernel, dilation, stride) if isa == "amx"
                        else (taps * units, False))
    if wide_rows:       # a chunk a tap
        out = np.pad(out.reshape(-1, taps, units, per), ((0, 0), (0, 0), (0, 16 - units), (0, 0)))
    out = out.reshape(o16, 16, -1, per)
    out = np.pad(out, ((0, 0), (0, 0), (0, quads - out.shape[2]), (0, 0)))
    return np.ascontiguousarray(out.transpose(0, 2, 1, 3))


WINOGRAD_MAX_C = I8W_MAX_C
# G' = 2 G of Winograd F(2, 3): integer, so U' = G' g G'^T is the exact 4 U
_G2 = np.array([[2, 0, 0], [1, 1, 1], [1, -1, 1], [0, 0, 2]], np.int32)


def winograd_applies(kernel, stride, dilation, int channels):
    """Whether winograd_nhwc runs this convolution (group 1): 3 x 3, stride 1, dilation 1,
    fewer than WINOGRAD_MAX_C input channels (its int32 sums then cannot overflow)."""
    return (tuple(kernel) == (3, 3) and tuple(stride) == (1, 1) and tuple(dilation) == (1, 1)
            and channels < I8W_MAX_C)


def winograd_nhwc_weights(wq):
    """conv_weights' rows [O][9 Cp2] of a 3 x 3 convolution as U' = G' g G'^T (int16: at most
    9 * 128), one nhwc_weights tile set per product: [16][ceil(O / 16)][Cp][16][2]."""
    o, kp = wq.shape
    g = np.asarray(wq, np.int32).reshape(o, 3, 3, kp // 9)
    u = np.einsum("ai,oijc,bj->aboc", _G2, g, _G2)
    return np.stack([nhwc_weights(u[a, b].astype(np.int16), kp // 9)
                     for a in range(4) for b in range(4)])


def depthwise_nhwc_weights(wq, int kh, int kw):
    """conv_weights' rows [C][2 kh kw] of a depthwise convolution as floats [kh kw][C]."""
    return np.ascontiguousarray(np.asarray(wq)[:, 0::2][:, :kh * kw].T.astype(np.float32))


def conv_forward_nhwc(x, w,
                      const int32_t[::1] bias, const float[::1] mult, float[:, :, :, ::1] top,
                      summand, kernel, pad, stride, dilation, float scale_in, float lo_in,
                      float hi_in, float sum_scale, bint relu, float slope, bint quantize,
                      float lo, float hi, float inv_scale_out, str isa, staged=None,
                      out_bytes=None, summand_bytes=None, shape=None):
    """conv_forward (group 1) on channels-last arrays: x [N][H][W][C], top [N][OH][OW][O],
    summand None or top's shape; w from nhwc_weights for the same isa. On the byte paths
    (vnni, amx): staged (Bytes-like: array, row, zp) the input already quantized as this layer
    quantizes it (x then None and `shape` x's), out_bytes the 8-bit top as bytes instead of
    top's floats (top unwritten), summand_bytes the summand."""
    shape_in = _input_shape("conv_forward_nhwc", x, staged, shape)
    cdef int N = shape_in[0], H = shape_in[1], W = shape_in[2], C = shape_in[3]
    cdef int OH = top.shape[1], OW = top.shape[2], O = top.shape[3]
    cdef int kh = kernel[0], kw = kernel[1]
    cdef int ph = pad[0], pw = pad[1], sh = stride[0], sw = stride[1]
    cdef int dh = dilation[0], dw = dilation[1]
    cdef int which = _isa(isa), threads
    cdef const int16_t[:, :, :, ::1] w16
    cdef const int8_t[:, :, :, ::1] w8
    cdef const void *wp
    units, taps = nhwc_units(C, kernel, dilation, isa)
    if i8n_bytes(which):
        w8 = w
        need_shape("conv_forward_nhwc", "w", dims(w8.shape, 4), ((O + 15) // 16, taps * units
                   if which != AMX else amx_quads(C, kernel, dilation, stride)[0], 16, 4))
        wp = &w8[0, 0, 0, 0]
    else:
        w16 = w
        need_shape("conv_forward_nhwc", "w", dims(w16.shape, 4), ((O + 15) // 16, taps * units, 16, 2))
        wp = &w16[0, 0, 0, 0]
    _check_epilogue("conv_forward_nhwc", O, bias, mult, summand, (N, OH, OW, O))
    _bytes_epilogue("conv_forward_nhwc", out_bytes, summand_bytes, quantize, (N, OH, OW, O))
    need(staged is None or (i8n_bytes(which) and not i8n_wide(C, kw, dilation[1])),
         "conv_forward_nhwc", "staged", f"needs a byte path {BYTE_ISAS}", isa)
    cdef const float *xp = _floats(x)
    cdef const uint8_t *sp = _staged("conv_forward_nhwc", staged, shape_in, lo_in)
    cdef i8_epilogue e = _epilogue(bias, mult, None if summand is None else
                                   np.asarray(summand).reshape(-1), sum_scale, relu, slope,
                                   quantize, lo, hi, inv_scale_out,
                                   np.asarray(top).reshape(-1), 0, 1, out_bytes, summand_bytes)
    threads = threads_for_macs(<Py_ssize_t>O * C * kh * kw * N * OH * OW)
    if threads < 1:
        threads = 1
    q = _scratch(np.uint8, i8n_scratch(which, N, H, W, C, O, kh, kw, ph, pw, dw, threads))
    cdef uint8_t[::1] qv = q
    with nogil:
        i8n_conv(which, threads, xp, N, H, W, C, O, kh, kw, ph, pw, sh, sw,
                 dh, dw, OH, OW, scale_in, lo_in, hi_in, wp, &qv[0], sp, &e)


def winograd_nhwc(const float[:, :, :, ::1] x, const int16_t[:, :, :, :, ::1] u,
                  const int32_t[::1] bias, const float[::1] mult, float[:, :, :, ::1] top,
                  summand, kernel, pad, stride, dilation, float scale_in, float lo_in,
                  float hi_in, float sum_scale, bint relu, float slope, bint quantize,
                  float lo, float hi, float inv_scale_out, str isa, out_bytes=None,
                  summand_bytes=None):
    """conv_forward_nhwc of a convolution winograd_applies to, by integer Winograd F(2x2, 3x3)
    (the same integers: see int8_nhwc.h); u from winograd_nhwc_weights."""
    cdef int N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3]
    cdef int OH = top.shape[1], OW = top.shape[2], O = top.shape[3], Cp = (C + 1) // 2
    cdef int ph = pad[0], pw = pad[1]
    cdef int which = _isa(isa), threads
    need(winograd_applies(kernel, stride, dilation, C), "winograd_nhwc", "kernel",
         f"needs 3 x 3, stride 1, dilation 1 and fewer than {I8W_MAX_C} channels",
         (tuple(kernel), tuple(stride), tuple(dilation), C))
    need_shape("winograd_nhwc", "top", dims(top.shape, 4), (N, H + 2 * ph - 2, W + 2 * pw - 2, O))
    need_shape("winograd_nhwc", "u", dims(u.shape, 5), (16, (O + 15) // 16, Cp, 16, 2))
    _check_epilogue("winograd_nhwc", O, bias, mult, summand, (N, OH, OW, O))
    _bytes_epilogue("winograd_nhwc", out_bytes, summand_bytes, quantize, (N, OH, OW, O))
    cdef i8_epilogue e = _epilogue(bias, mult, None if summand is None else
                                   np.asarray(summand).reshape(-1), sum_scale, relu, slope,
                                   quantize, lo, hi, inv_scale_out,
                                   np.asarray(top).reshape(-1), 0, 1, out_bytes, summand_bytes)
    threads = threads_for_macs(<Py_ssize_t>O * C * 9 * N * OH * OW)
    if threads < 1:
        threads = 1
    q = _scratch(np.int16, (<long>N * H * W + 1) * 2 * Cp)
    s = _scratch(np.int32, threads * i8w_scratch(Cp), 3)
    cdef int16_t[::1] qv = q
    cdef int32_t[::1] sv = s
    with nogil:
        i8w_conv(which, threads, &x[0, 0, 0, 0], N, H, W, C, O, ph, pw, OH, OW, scale_in, lo_in,
                 hi_in, &u[0, 0, 0, 0, 0], &qv[0], &sv[0], &e)


def depthwise_nhwc(x, const float[:, ::1] w, const int32_t[::1] bias,
                   const float[::1] mult, float[:, :, :, ::1] top, summand, kernel, pad, stride,
                   dilation, float scale_in, float lo_in, float hi_in, float sum_scale, bint relu,
                   float slope, bint quantize, float lo, float hi, float inv_scale_out, str isa,
                   out_bytes=None, summand_bytes=None, staged=None, shape=None):
    """conv_forward of a depthwise convolution on channels-last arrays; w from
    depthwise_nhwc_weights; staged, out_bytes, summand_bytes as conv_forward_nhwc's."""
    shape_in = _input_shape("depthwise_nhwc", x, staged, shape)
    cdef int N = shape_in[0], H = shape_in[1], W = shape_in[2], C = shape_in[3]
    cdef int OH = top.shape[1], OW = top.shape[2], kh = kernel[0], kw = kernel[1]
    cdef int ph = pad[0], pw = pad[1], sh = stride[0], sw = stride[1]
    cdef int dh = dilation[0], dw = dilation[1]
    cdef int which = _isa(isa), threads
    need(kh * kw < 512, "depthwise_nhwc", "kernel", "needs fewer than 512 taps", kh * kw)
    need_shape("depthwise_nhwc", "w", dims(w.shape, 2), (kh * kw, C))
    if which == AVX2BYTES:
        _half_weights("depthwise_nhwc", "w", w)
    need_shape("depthwise_nhwc", "top", dims(top.shape, 4), (N, OH, OW, C))
    _check_epilogue("depthwise_nhwc", C, bias, mult, summand, (N, OH, OW, C))
    _bytes_epilogue("depthwise_nhwc", out_bytes, summand_bytes, quantize, (N, OH, OW, C))
    cdef const float *xp = _floats(x)
    cdef const uint8_t *sp = _staged("depthwise_nhwc", staged, shape_in, lo_in)
    cdef int zp = 0 if staged is None else staged.zp
    cdef i8_epilogue e = _epilogue(bias, mult, None if summand is None else
                                   np.asarray(summand).reshape(-1), sum_scale, relu, slope,
                                   quantize, lo, hi, inv_scale_out,
                                   np.asarray(top).reshape(-1), 0, 1, out_bytes, summand_bytes)
    threads = threads_for(<Py_ssize_t>N * OH * OW * C * kh * kw)
    if threads < 1:
        threads = 1
    qf = _scratch(np.float32, i8n_dw_scratch(which, H, W, C, kh, kw, sh, dh, OH, OW, threads))
    accs = _scratch(np.float32, threads * OW * C, 1)
    iaccs = _scratch(np.int32, threads * OW * C, 2)
    cdef float[::1] qv = qf, av = accs
    cdef int32_t[::1] iv = iaccs
    with nogil:
        i8n_depthwise(which, threads, xp, N, H, W, C, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW,
                      scale_in, lo_in, hi_in, &w[0, 0], &qv[0], &av[0], &iv[0], sp, zp, &e)


_SCRATCH = {}


def _scratch(dtype, long n, int slot=0):
    """A flat scratch array of at least n items, kept between calls (the layers run one at a
    time; a fresh array per call cost page faults on every forward)."""
    key = (np.dtype(dtype).str, slot)
    a = _SCRATCH.get(key)
    if a is None or a.shape[0] < n:
        a = _SCRATCH[key] = np.empty(max(n, 1), dtype)
    return a[:max(n, 1)]
