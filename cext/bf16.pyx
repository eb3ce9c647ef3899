# cython: language_level=3
"""bf16 matrix products (cext/bf16_gemm.h; caffepy/precision.py says what bf16 means and picks
the path): float32 operands rounded to bf16 when packed, products and sums in float32, on AMX
tiles or AVX512_BF16. Convolution's products run the same header from cext/vision.pyx. The NumPy
reference is in caffepy/kernels/reference/bf16.py.

Call these only with a path the CPU has: AVX512 = AVX512_BF16, AMX = AMX-BF16, the latter after
amx_permitted() returned True.
"""
from rules cimport MACS_PER_OP, dims, need, need_shape, pixel_stride, threads_for, threads_for_macs

cdef extern from "amx.h" nogil:
    int _amx_permitted "amx_permitted"()

cdef extern from "bf16_gemm.h" nogil:
    ctypedef struct bf_mat:
        const float *p
        long rs, cs
    int BF_AVX512, BF_AMX
    int bf_gemm(int path, long M, long N, long K, bf_mat a, bf_mat b, float *c, long ldc,
                int accumulate, int threads, const unsigned short *packed)
    long bf_packed_size(long M, long K)
    void bf_pack_all(bf_mat a, long M, long K, unsigned short *ap)

AVX512 = BF_AVX512
AMX = BF_AMX
NAMES = {BF_AVX512: "AVX512_BF16", BF_AMX: "AMX-BF16"}

def amx_permitted():
    """Whether Linux lets this process use the AMX tiles (asked once; a kernel without AMX
    support, or one that refuses, says no)."""
    return bool(_amx_permitted())


cdef inline bf_mat _mat(const float[:, :] x):
    cdef bf_mat m
    m.p = &x[0, 0]
    m.rs = x.strides[0] // <Py_ssize_t>sizeof(float)
    m.cs = x.strides[1] // <Py_ssize_t>sizeof(float)
    return m


def packed_size(long M, long K):
    """uint16 values of pack's output for an [M, K] operand."""
    return bf_packed_size(M, K)


def pack(const float[:, :] a, unsigned short[::1] out):
    """a [M, K] (any float32 view) rounded to bf16 and packed as gemm's `packed` reads it: a
    left operand used for many products (a TEST net's InnerProduct weights)."""
    cdef long M = a.shape[0], K = a.shape[1]
    need(out.shape[0] == bf_packed_size(M, K), "bf16.pack", "out",
         f"needs {bf_packed_size(M, K)} values", out.shape[0])
    cdef bf_mat am
    if M and K:
        am = _mat(a)
        with nogil:
            bf_pack_all(am, M, K, &out[0])


def gemm(const float[:, :] a, const float[:, :] b, float[:, ::1] c, bint accumulate, int path,
         const unsigned short[::1] packed=None):
    """c[M, N] = a[M, K] @ b[K, N] in bf16 (c += with `accumulate`). a and b are any float32
    views (a transposed view is read in place; one with a unit stride packs fastest). With
    `packed` (pack's output for a) a is read for its shape only."""
    cdef long M = a.shape[0], K = a.shape[1], N = b.shape[1]
    need(b.shape[0] == K, "bf16.gemm", "b", f"needs {K} rows (a's columns)", dims(b.shape, 2))
    need(c.shape[0] == M and c.shape[1] == N, "bf16.gemm", "c", f"needs shape {(M, N)}",
         dims(c.shape, 2))
    need(path == BF_AVX512 or (path == BF_AMX and _amx_permitted()), "bf16.gemm", "path",
         "must be AVX512, or AMX once amx_permitted()", path)
    if packed is not None:
        need(packed.shape[0] == bf_packed_size(M, K), "bf16.gemm", "packed",
             f"needs {bf_packed_size(M, K)} values (pack of a)", packed.shape[0])
    if M == 0 or N == 0:
        return
    cdef bf_mat am, bm
    cdef int ok
    if K == 0:
        am.p = bm.p = NULL
        am.rs = am.cs = bm.rs = bm.cs = 1
    else:
        am, bm = _mat(a), _mat(b)
    with nogil:
        ok = bf_gemm(path, M, N, K, am, bm, &c[0, 0], c.shape[1], accumulate,
                     threads_for_macs(M * N * K), &packed[0] if packed is not None else NULL)
    if not ok:
        raise MemoryError("bf16.gemm: no memory for the packing buffers")


cdef extern from "bf16_nhwc.h" nogil:
    ctypedef struct bfn_epilogue:
        const float *scale
        const float *bias
        const float *add
        float *y
        long ldy
        int relu
    void bfn_round(const float *x, long n, float *y, int threads)
    long bfn_packed_size(int Og, int Cg, int kh, int kw)
    void bfn_pack_weights(const float *w, int O, int C, int kh, int kw, int G, unsigned short *out)
    long bfn_scratch_bytes(int N, int H, int W, int C, int O, int kh, int kw, int G, int threads)
    void bfn_conv(int threads, const float *x, int N, int H, int W, int C, int O, int kh, int kw,
                  int ph, int pw, int sh, int sw, int dh, int dw, int OH, int OW, int G,
                  const unsigned short *w, char *scratch, const bfn_epilogue *e)


cdef enum:
    # AMX-BF16's multiply-adds per sgemm multiply-add, by time on one core (the channels-last
    # convolution: 300-1000 GMAC/s on two cores, sgemm about 100): the thread rule's work is the
    # time it takes, and a small layer of a batch-1 net woke the second thread for a few us
    AMX_SPEEDUP = 8


def nhwc_packed_size(int O, int C, int kh, int kw, int group=1):
    """uint16 values of nhwc_pack_weights's output for O x (C / group) x kh x kw weights."""
    return group * bfn_packed_size(O // group, C // group, kh, kw)


def nhwc_pack_weights(const float[:, :, :, ::1] w, unsigned short[::1] out, int group=1):
    """Caffe's convolution weights w [O, C / group, kh, kw] rounded to bf16 and packed as
    conv_forward_nhwc reads them (cext/bf16_nhwc.h: column tiles of 16 output channels, group
    after group)."""
    cdef int O = w.shape[0], Cg = w.shape[1], kh = w.shape[2], kw = w.shape[3]
    need(group >= 1 and O % group == 0, "bf16.nhwc_pack_weights", "group",
         f"must divide {O} outputs", group)
    cdef long size = group * bfn_packed_size(O // group, Cg, kh, kw)
    need(out.shape[0] == size, "bf16.nhwc_pack_weights", "out", f"needs {size} values",
         out.shape[0])
    with nogil:
        bfn_pack_weights(&w[0, 0, 0, 0], O, Cg, kh, kw, group, &out[0])


def nhwc_scratch_bytes(int N, int H, int W, int C, int O, int kh, int kw, int threads,
                       int group=1):
    """Bytes of conv_forward_nhwc's scratch for `threads` threads."""
    return bfn_scratch_bytes(N, H, W, C, O, kh, kw, group, threads)


def conv_forward_nhwc(const float[:, :, :, ::1] x, const unsigned short[::1] packed,
                      const float[::1] bias, float[:, :, :, :] y, unsigned char[::1] scratch,
                      int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw,
                      const float[::1] scale=None, bint relu=False,
                      const float[:, :, :, ::1] add=None, int threads=0, int group=1):
    """y [N, oh, ow, O] = conv(x [N, H, W, C], the packed weights; `group` groups) in bf16 on AMX tiles
    (cext/bf16_nhwc.h), * scale (None: 1) + bias (empty: none) + add (None: none; y's shape,
    not y), then max(y, 0) with relu: the epilogue of nhwc.conv_forward. y may be a run of a
    wider channels-last array's channels (not with add). scratch: nhwc_scratch_bytes for
    `threads` (0: the thread rule's count for the work) threads, 64-byte aligned. Only where
    precision.kernel() is AMX-BF16."""
    cdef int N = x.shape[0], H = x.shape[1], W = x.shape[2], C = x.shape[3], O = y.shape[3]
    cdef int OH = y.shape[1], OW = y.shape[2]
    cdef str k = "bf16.conv_forward_nhwc"
    need(_amx_permitted(), k, "path", "needs AMX-BF16 and Linux's permission for the tiles",
         "no AMX")
    need(kh >= 1 and kw >= 1 and sh >= 1 and sw >= 1 and dh >= 1 and dw >= 1 and ph >= 0
         and pw >= 0, k, "geometry", "kernel, stride and dilation must be >= 1 and pad >= 0",
         f"kernel {kh}x{kw} stride {sh}x{sw} dilation {dh}x{dw} pad {ph}x{pw}")
    need(OH == (H + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
         and OW == (W + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1 and OH >= 1 and OW >= 1
         and y.shape[0] == N, k, "y", "needs the convolution's output shape", dims(y.shape, 4))
    need(group >= 1 and C % group == 0 and O % group == 0, k, "group",
         f"must divide {C} input and {O} output channels", group)
    cdef long size = group * bfn_packed_size(O // group, C // group, kh, kw)
    need(packed.shape[0] == size, k, "packed", f"needs {size} values (nhwc_pack_weights)",
         packed.shape[0])
    need(bias.shape[0] in (0, O), k, "bias", f"needs {O} values or none", bias.shape[0])
    cdef bfn_epilogue e
    e.ldy = pixel_stride(k, y, O)
    e.y = &y[0, 0, 0, 0]
    e.bias = &bias[0] if bias.shape[0] else NULL
    e.scale = NULL
    e.add = NULL
    e.relu = relu
    if scale is not None:
        need(scale.shape[0] == O, k, "scale", f"needs {O} values", scale.shape[0])
        e.scale = &scale[0]
    if add is not None:
        need_shape(k, "add", dims(add.shape, 4), dims(y.shape, 4))
        need(e.ldy == O, k, "add", "needs y's own channels (not a slice)", e.ldy)
        need(&add[0, 0, 0, 0] != e.y, k, "add", "may not be y", "y")
        e.add = &add[0, 0, 0, 0]
    if threads <= 0:
        threads = threads_for(<Py_ssize_t>N * OH * OW * O * (C // group) * kh * kw
                              // (MACS_PER_OP * AMX_SPEEDUP))
    need(scratch.shape[0] >= bfn_scratch_bytes(N, H, W, C, O, kh, kw, group, threads)
         and <size_t>&scratch[0] % 64 == 0, k, "scratch",
         f"needs {bfn_scratch_bytes(N, H, W, C, O, kh, kw, group, threads)} bytes, 64-byte aligned",
         scratch.shape[0])
    if N == 0:
        return
    with nogil:
        bfn_conv(threads, &x[0, 0, 0, 0], N, H, W, C, O, kh, kw, ph, pw, sh, sw, dh, dw, OH, OW,
                 group, &packed[0], <char *>&scratch[0], &e)


def round_floats(const float[::1] x, float[::1] y):
    """y = x rounded to bf16 as the AMX and AVX512_BF16 kernels' conversion rounds it (nearest,
    ties to even; values below 2^-126 to zero), as float32; y may be x. Call it only where the
    CPU has AVX512_BF16."""
    need(y.shape[0] == x.shape[0], "bf16.round_floats", "y", f"needs {x.shape[0]} floats",
         y.shape[0])
    cdef long n = x.shape[0]
    if n == 0:
        return
    with nogil:
        bfn_round(&x[0], n, &y[0], threads_for(n))
