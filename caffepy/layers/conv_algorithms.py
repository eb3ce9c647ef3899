"""The convolution algorithms of caffepy's fast paths, for both of their layouts: one module
that the channels-last Convolution (layers/nhwc.py, NHWCConvolution) and the blocked one
(layers/intel.py, BlockedConvolution) pick among, per shape, by measurement
(caffepy/autotune.py) or by their rules. Which algorithms a layer tries, and the keys it
measures them under, stay with the layer; what each algorithm computes lives here.

    channels-last   Gemm (im2col + GEMM; a pointwise convolution's GEMM over the pixels),
                    Direct (few input channels, cext/nhwc_direct.h), Depthwise (group =
                    channels), Winograd F(m, r) (cext/winograd.pyx); under bf16, BF16Amx
                    (a TEST net's forward on AMX tiles, cext/bf16_nhwc.h)
    blocked         BlockedGemm (Caffe's: blocked im2col + sgemm, cext/intel.pyx),
                    BlockedWinograd, and Direct with the block width (a first layer whose
                    channels fit one block)

An algorithm is built for a layer and a bottom shape, keeps a weak reference to its layer,
and has a `name`, `forward(bottom, top, params=None)` and `backward(top, propagate_down,
bottom, need_w, need_b)` (bottom diffs overwritten, parameter diffs accumulated, as Caffe).
The forward computes with the layer's blobs, or with `params` = (weights in the blob's shape,
bias [O] or None) in their place: a TEST net's weights with the BatchNorm after them folded in
(caffepy/net_rules.py). All compute Caffe's numbers up to float rounding.
"""
import functools
import os
import weakref

import numpy as np

from .. import memory, precision
from ..blob import Blob, Seen
from ..errors import CaffepyError
from ..proto import caffe_pb2

try:
    from ..kernels import bf16 as _bf16
    from ..kernels import intel as _ki
    from ..kernels import nhwc as _k
    from ..kernels import winograd as _winograd
except ImportError:     # the layers report it when they are built
    _k = _ki = _winograd = _bf16 = None

_EMPTY = np.zeros(0, np.float32)
_EMPTY2 = np.zeros((0, 0), np.float32)


def kernels_built():
    """Whether the compiled kernels the algorithms run are there."""
    return _k is not None and _ki is not None and _winograd is not None


def _workspace(name, shape, dtype=np.float32):
    """Scratch shared by the algorithms (the layers run one at a time)."""
    return memory.grown(_WORKSPACE, (name, dtype), shape, dtype, _WORKSPACE_VIEWS)


_WORKSPACE, _WORKSPACE_VIEWS = {}, {}


def block_width():
    """V: CAFFEPY_BLOCK_WIDTH if set, else the float32 lanes of the kernels' ISA path (caffepy.isa:
    the width their tile code is unrolled for)."""
    env = os.environ.get("CAFFEPY_BLOCK_WIDTH")
    if env:
        if not env.isdigit() or int(env) not in (4, 8, 16, 32):
            raise CaffepyError(f"CAFFEPY_BLOCK_WIDTH: must be 4, 8, 16 or 32, got '{env}'")
        return int(env)
    from .. import isa
    return isa.lanes()


# A direct convolution is a candidate up to this many taps (input channels x kernel area), the
# rule's choice up to DIRECT_RULE_TAPS: the first layers of LeNet (25), CIFAR-10 (75) and
# ImageNet nets (147 for 7x7, 363 for 11x11), which im2col serves badly. Beyond that, and for
# pointwise convolutions (a plain GEMM's forward), its weight gradient still often wins
# (measured: 3x3 over 64 channels; 1x1 256 -> 64), so it stays a candidate.
DIRECT_MAX_TAPS = 1200
DIRECT_RULE_TAPS = 400


def forward_params(layer, params):
    """(weights, bias or None) a forward computes with: `params`, else the layer's blobs."""
    if params is not None:
        return params
    return layer.blobs[0].read_data, (layer.blobs[1].read_data if layer.bias_term else None)


def weight_source(layer, params):
    """What a value derived from the forward's weights depends on, for blob.Seen: the layer's
    weight blob, or the weights in `params` (a folded convolution's, made read-only). A caller
    checks it before it takes the blob's array: a reference of its own to that array would look
    like a user's, which may write it (blob.Writes), and cost a compare."""
    return layer.blobs[0] if params is None else params[0]


def values(source):
    """The array of a weight_source."""
    return source.read_data if isinstance(source, Blob) else source


def channel_sums(a):
    """Per-channel float64 sums of a [M, C], threaded: NumPy's sum(axis=0, dtype=float64) took
    6.8 ms over GoogLeNet's 50176 x 192 bias gradient, this 2.5 (its sums of products with
    itself come free: the pass is bound by memory)."""
    c = a.shape[1]
    threads = _k.max_threads()
    work = _workspace("reduce_work", (threads, 2 * c))
    partial = _workspace("reduce_partial", (threads, 2 * c), np.float64)
    s1, s2 = np.empty(c), np.empty(c)
    _k.channel_dots(a, a, s1, s2, work, partial, None)
    return s1


# ---------------------------------------------------------------------------------------------
# Winograd's tiles and transforms

# Winograd output tiles m tried per kernel size r. Float32 stays within ~1e-5 of the direct sum
# (relative to its largest value) up to tile side m + r - 1 = 8 with the points of matrices():
# over 256 channels F(4, 3) 7e-6, F(5, 3) 3e-6, F(4, 5) 9e-6 (tests/layers/test_winograd.py
# holds every flavour to 2e-5). F(6, 3) is left out: even with constant tables for its
# transforms (tried 2026-11-28, AVX2) it only matched F(4, 3) where it needs 9% fewer
# multiplies (ResNet-50 b16's 28x28 and 56x56: forward alike, backward up to 12% slower), and
# gained 3-9% only on VGG-16 b4's 112x112 and 224x224 layers (18% fewer), too little for the
# build time and the extra trial per layer. F(7, 3) (side 9, one tile per 14x14 or 7x7 image)
# errs by 2e-4 over 256 channels with any ninth point tried (4, 1/4, -1/4, 3/2).
WINOGRAD_TILES = {3: (2, 3, 4, 5), 5: (2, 3, 4)}


def winograd_products(m, r, oh, ow):
    """Multiplies per channel pair of F(m, r) over an oh x ow output, partial tiles padded."""
    return (m + r - 1) ** 2 * -(-oh // m) * -(-ow // m)


def winograd_tile(r, oh, ow):
    """The output tile m for an r x r kernel with the fewest GEMM multiplies over an oh x ow
    output (the smaller m on a tie)."""
    return min(WINOGRAD_TILES[r], key=lambda m: (winograd_products(m, r, oh, ow), m))


_NO_DU, _NO_DX = np.zeros((1,) * 4, np.float32), np.zeros((1,) * 5, np.float32)


@functools.lru_cache(maxsize=None)
def winograd_matrices(m, r):
    return _winograd.matrices(m, r)


def winograd_weights(weights, gm, group, forward, workspace, layer=None, packs=False):
    """(U, None) with U = G W G^T of `weights` [O, Cg, r, r] (gm = G [a, r]) in a workspace
    ("wino_u"), in the forward's layout [a*a, group * Cg, O / group] or the backward's
    [a*a, O, Cg] (cext/winograd.pyx); `workspace(name, shape)` gives the scratch. The forward
    of a TEST net's `layer` keeps a U of its own instead, transformed again only when the
    weights' floats change: at inference the weights stay, and their transform was redone
    every forward. With `packs` (the channels-last forward's) it keeps that U packed for its
    GEMMs alone (winograd.pack_u, after the transform into the workspace), in place of the
    None, and the U returned is the workspace's, for its shape: the GEMMs pack nothing and
    the layer holds one U, not two. `weights` may be a weight_source (a Blob: its data)."""
    o, cg = weights.shape[:2]
    a2 = gm.shape[0] ** 2
    if not forward:
        u = workspace("wino_u", (a2, o, cg))
        _winograd.weight_transform(values(weights), gm, u)
        return u, None
    shape = (a2, group * cg, o // group)
    if layer is None or layer.phase != caffe_pb2.TEST:
        u = workspace("wino_u", shape)
        _winograd.weight_transform(values(weights), gm, u, group)
        return u, None
    # on the layer, per tile size (a, r) and packing: kept across batch sizes (an algorithm is
    # built per bottom shape)
    kept = layer.winograd_kept
    if kept is None:
        kept = layer.winograd_kept = {}
    seen, held, held_shape = kept.get((gm.shape, packs)) or (Seen(), None, None)
    if held_shape != shape:
        held = memory.line_empty(_winograd.packed_u_floats(a2, group, cg, o // group) if packs
                                 else a2 * group * cg * (o // group))
        seen = Seen()
    u = workspace("wino_u", shape) if packs else held.reshape(shape)
    if seen.changed(weights):
        _winograd.weight_transform(values(weights), gm, u, group)
        if packs:
            _winograd.pack_u(u, group, held)
        seen.keep(weights)
    kept[gm.shape, packs] = seen, held, shape
    return u, held if packs else None


def winograd_buffers(vshape, mshape, workspace):
    """The tile buffers (vbuf, mbuf) of scratch_shapes in a workspace ("wino_v", "wino_m"), their
    positions spaced by cext/winograd.pyx's scratch_view. The views are kept per workspace
    buffer and shape: making one (as_strided) took 15 us, twice in every Winograd forward
    (0.5 ms of ResNet-50's at batch 1)."""
    views = []
    for name, shape in (("wino_v", vshape), ("wino_m", mshape)):
        raw = workspace(name, (_winograd.scratch_floats(shape),))
        owner, kept = _WINOGRAD_VIEWS.get(name, (None, None))
        if owner is not raw.base:       # the workspace grew: views of the old buffer go
            owner, kept = raw.base, {}
            _WINOGRAD_VIEWS[name] = owner, kept
        view = kept.get(shape)
        if view is None:
            view = kept[shape] = _winograd.scratch_view(raw, shape)
        views.append(view)
    return tuple(views)


_WINOGRAD_VIEWS = {}    # name -> (its workspace buffer, {shape: view of it})


# ---------------------------------------------------------------------------------------------
# Channels-last

# Pixels per task of a pointwise convolution's backward (about; see Gemm)
POINTWISE_TASK = 1024


def pointwise_backward_rows(pixels, threads):
    """Rows per task of a pointwise convolution's backward over `pixels` rows: tasks of about
    POINTWISE_TASK, the same number for each thread, when each thread gets at least one; else
    the whole batch."""
    if pixels < threads * POINTWISE_TASK:
        return pixels
    tasks = threads * -(-pixels // (threads * POINTWISE_TASK))
    return -(-pixels // tasks)


def _back_reference(layer):
    """An algorithm's reference to its layer, which holds the algorithm: weak, so that a layer
    (its weights and workspaces) is freed when the net lets it go, not at the next cyclic
    garbage collection (a script building nets in a loop grew by each net's convolutions)."""
    return weakref.proxy(layer)


class Gemm:
    """im2col + one GEMM per group and row chunk; a pointwise convolution needs no im2col: one
    GEMM over the batch's pixels, threaded by BLAS, after taking every stride-th pixel into a
    buffer if it is strided (ResNet's projections; 0-12% faster than im2col there).

    A pointwise backward runs instead in tasks of about POINTWISE_TASK pixels, one thread
    each, so that the data gradient's GEMM and the weight gradient's read a task's dy while it
    is in cache, rather than each GEMM passing over the whole batch (ResNet-50 b16 at 56 x 56,
    64 -> 256 channels: 25.3 -> 22.6 ms; at 28 x 28 2-4% faster, at 14 x 14 alike).

    Outside TRAIN, the GEMMs read the weights packed once into their panels
    (nhwc.pack_weights) rather than packing them on every call, in every task, as the BLAS and
    the panel kernel of a plain product do; at batch 1 threads split the output channels
    (cext/blas.pxd packed_split). The packing is redone when blob.Seen finds the weights may
    have changed. That check reads no float while nothing outside the blob holds its data
    (blob.Writes); when it compared the weights with a copy every forward, packing the
    1 x 1 kernels (which need no reordering, so no copy of their own) cost more than it saved
    (ResNet-50 b1 68 -> 75 ms); without that compare, ResNet-50 b1 is 1.13x faster than with
    both (in one process, alternating)."""

    def __init__(self, layer, n, h, w):
        L = layer
        self.layer = _back_reference(L)
        (kh, kw), (ph, pw), (sh, sw), (dh, dw) = L.window
        pointwise = (kh, kw, ph, pw) == (1, 1, 0, 0)
        self.direct = pointwise and (sh, sw) == (1, 1)
        self.stride = (sh, sw) if pointwise and not self.direct else None
        if self.stride:
            sh = sw = 1
        self.args = (L.num_output, kh, kw, ph, pw, sh, sw, dh, dw, L.group)
        cg, og = L.channels // L.group, L.num_output // L.group
        self.kg = cg * kh * kw
        self.rows = n * L.oh * L.ow if pointwise else _k.conv_rows(L.channels, kh, kw)
        self.backward_rows = (pointwise_backward_rows(self.rows, _k.max_threads()) if pointwise
                              else self.rows)
        # with an epilogue, a pointwise forward runs in the backward's tasks too: each thread
        # applies it to the rows its own GEMM has just written, while they are in cache,
        # rather than the calling thread to the whole output after a GEMM the BLAS split
        self.epilogue_rows = self.backward_rows
        self.col_floats = 0 if pointwise else _k.conv_col_floats(L.channels, kh, kw, L.oh, L.ow,
                                                                   self.rows)
        self.name = "gemm" if self.direct else "strided gemm" if self.stride else "im2col+gemm"
        # a 1 x 1 kernel's GEMMs take Caffe's [O, C] weights and diff as they are (transposed
        # operands); larger ones read weights reordered to the columns' (kh, kw, C) order
        self.caffe_order = (kh, kw) == (1, 1)
        self.wt = None if self.caffe_order else np.empty((L.group, self.kg, og), np.float32)
        self.packs = L.phase != caffe_pb2.TRAIN
        self.packed = None
        self.reordered = Seen()     # the weights that wt and packed hold

    def _input(self, x):
        """What the GEMM reads: x, or for a strided pointwise convolution the pixels it reads,
        [N, oh, ow, C] (a workspace)."""
        if not self.stride:
            return x
        L = self.layer
        sh, sw = self.stride
        taken = _workspace("taken", (len(x), L.oh, L.ow, L.channels))
        _k.take_pixels(x, taken, sh, sw)
        return taken

    def _weights(self, fresh=True, params=None):
        """The weights (the layer's, or those of forward `params`) as the kernels take them,
        reordered (and packed when the forward `packs`) first if `fresh` and they changed."""
        L = self.layer
        g, og = L.group, L.num_output // L.group
        source = weight_source(L, params)
        if fresh and (self.packs or not self.caffe_order) and self.reordered.changed(source):
            self._reorder(values(source))
            self.reordered.keep(source)
        if self.caffe_order:
            return values(source).reshape(g, og, -1)
        return self.wt

    def _reorder(self, weights):
        """wt (unless the GEMMs read Caffe's order) and, when the forward packs, packed."""
        L = self.layer
        g, og = L.group, L.num_output // L.group
        if self.caffe_order:
            wt = weights.reshape(g, og, -1)
        else:
            (kh, kw) = L.window.kernel
            cg = L.channels // g
            w = weights.reshape(g, og, cg, kh * kw)
            wt = self.wt.reshape(g, kh * kw, cg, -1)
            for gi in range(g):
                _k.reverse_axes(w[gi], wt[gi])
            wt = self.wt
        if self.packs:
            if self.packed is None:
                self.packed = memory.line_empty(_k.packed_floats(g, og, self.kg))
            _k.pack_weights(wt, self.caffe_order, self.packed)

    def _col(self):
        return _workspace("col", (_k.max_threads(), self.col_floats))

    # the forward takes an `epilogue` (scale [O], bias [O], relu, add): y * scale + bias in
    # place of the layer's bias, + add (None, or a channels-last blob of the top's shape), then
    # max(y, 0) if relu, on the rows each GEMM has just written
    epilogue = True
    # the forward writes into `out`, a run of a wider channels-last blob's channels, when given
    # (a TEST net's concat written in place: net_rules.ConcatSlot)
    writes_slices = True

    def adds_in_place(self):
        """Whether the forward writes over the epilogue's add (the same memory) in place: on
        the packed weights, when the kernel sums each value in one pass over its products
        (nhwc.add_may_be_y; a 1 x 1 product by its rows a task and threads). Elsewhere the
        kernel would copy the add aside first: no gain."""
        L = self.layer
        pixels = self.rows if self.direct or self.stride else 0
        return self.packs and _k.add_may_be_y(self.kg, pixels, self.epilogue_rows,
                                              L.num_output // L.group, _k.max_threads())

    def forward(self, bottom, top, params=None, epilogue=None, out=None):
        bias = forward_params(self.layer, params)[1]
        scale, relu, add = None, False, None
        if epilogue is not None:
            scale, bias, relu, add = epilogue
        wt = self._weights(params=params)
        bias = _EMPTY if bias is None else bias
        col = self._col()
        rows = self.rows if epilogue is None else self.epilogue_rows
        for b, t in zip(bottom, top):
            _k.conv_forward(self._input(b.raw_data), wt, bias, t.raw_data if out is None else out,
                            col, *self.args, rows, self.caffe_order, scale, relu,
                            None if add is None else add.raw_data, self.packed)

    def backward(self, top, propagate_down, bottom, need_w, need_b):
        L = self.layer
        # reordered afresh when they are read: the forward may have run another algorithm
        wt = self._weights(fresh=any(propagate_down))
        col = self._col()
        threads = col.shape[0]
        dwt = _workspace("dwt", (threads, wt.size)) if need_w else _EMPTY2
        # a 1 x 1 kernel's weight gradient goes straight into the diff (a flat view of it)
        dw_sum = None
        if need_w and self.caffe_order and L.blobs[0].diff.flags.c_contiguous:
            dw_sum = L.blobs[0].diff.reshape(-1)
        db = _workspace("db", (threads, L.num_output)) if need_b else _EMPTY2
        (kh, kw) = L.window.kernel
        g, cg = L.group, L.channels // L.group
        for i, (b, t) in enumerate(zip(bottom, top)):
            need_x = bool(propagate_down[i])
            if not (need_x or need_w or need_b):
                continue
            x = self._input(b.raw_data)
            dx = x                  # not written unless need_x
            if need_x:
                dx = _workspace("taken_diff", x.shape) if self.stride else b.raw_diff
            _k.conv_backward(x, wt, t.raw_diff, dx, dwt, db, col, *self.args,
                             self.backward_rows, need_x, need_w, need_b, self.caffe_order, dw_sum)
            if need_x and self.stride:      # the pixels it skips get no gradient
                _k.put_pixels(dx, b.raw_diff, *self.stride)
            if need_w and dw_sum is None and self.caffe_order:
                L.blobs[0].diff[...] += dwt[0].reshape(L.blobs[0].shape)
            elif need_w and dw_sum is None:
                grad = dwt[0].reshape(g, kh * kw, cg, -1)
                diff = L.blobs[0].diff.reshape(g, -1, cg, kh * kw)
                for gi in range(g):
                    _k.reverse_axes(grad[gi], diff[gi], True)
            if need_b:
                L.blobs[1].diff[...] += db[0]


class BF16Amx:
    """bf16 (caffepy/precision.py) on AMX tiles for a TEST net's channels-last Convolution
    (cext/bf16_nhwc.h; groups too): the input converted to bf16 once, the weights rounded and packed
    once per weights version (blob.Seen), the products on TDPBF16PS, float32 sums, and Gemm's
    epilogue (a TEST unit's BatchNorm, Scale, Eltwise SUM and ReLU applied to the float32 sums;
    the weights are never folded, so they are rounded as the net defines them). It writes
    slices as Gemm does. The backward (pycaffe's net.backward on a TEST net) is the emulation's
    arithmetic: the float32 Gemm's over bf16-rounded copies of the input, the top diff and the
    weights."""
    name = "bf16 amx"
    epilogue = True
    writes_slices = True

    def __init__(self, layer, n, h, w):
        L = layer
        self.layer = _back_reference(layer)
        (kh, kw) = L.window.kernel
        self.packed = np.empty(_bf16.nhwc_packed_size(L.num_output, L.channels, kh, kw, L.group),
                               np.uint16)
        self.packed_from = Seen()
        self.scratch = _bf16.nhwc_scratch_bytes(n, h, w, L.channels, L.num_output, kh, kw,
                                                _k.max_threads(), L.group)
        self.gemm = _RoundedGemm(layer, n, h, w)

    def forward(self, bottom, top, params=None, epilogue=None, out=None):
        L = self.layer
        source = weight_source(L, params)
        if self.packed_from.changed(source):
            _bf16.nhwc_pack_weights(values(source), self.packed, L.group)
            self.packed_from.keep(source)
        bias = forward_params(L, params)[1]
        scale, relu, add = None, False, None
        if epilogue is not None:
            scale, bias, relu, add = epilogue
        scratch = _workspace("bf16_scratch", (self.scratch,), np.uint8)
        (kh, kw), (ph, pw), (sh, sw), (dh, dw) = L.window
        for b, t in zip(bottom, top):
            _bf16.conv_forward_nhwc(b.raw_data, self.packed, _EMPTY if bias is None else bias,
                                    t.raw_data if out is None else out, scratch, kh, kw, ph, pw,
                                    sh, sw, dh, dw, scale, relu,
                                    None if add is None else add.raw_data, 0, L.group)

    def backward(self, top, propagate_down, bottom, need_w, need_b):
        rounded_top = [_Rounded(raw_diff=precision.round_bf16(t.raw_diff)) for t in top]
        rounded_bottom = [_Rounded(raw_data=precision.round_bf16(b.raw_data), raw_diff=b.raw_diff)
                          for b in bottom]
        self.gemm.backward(rounded_top, propagate_down, rounded_bottom, need_w, need_b)


class BF16Depthwise:
    """bf16 (caffepy/precision.py) for a TEST net's channels-last depthwise Convolution: the
    float32 depthwise kernel on bf16-rounded operands (the input rounded into a scratch copy,
    the weights as they are reordered). A bf16 product is exact in float32 and the sums are
    float32, so this is bf16's arithmetic; no bf16 instruction helps a kernel that makes one
    product per weight and pixel (the NCHW bf16 path ran MobileNet v1's depthwise layers as a
    GEMM per channel: 3.6-3.9x slower than float32). A unit's BatchNorm and Scale (`affine`:
    the epilogue's per-channel s, t) scale the rounded weights, never the other way round: the
    weights are rounded as the net defines them, as BF16Amx's epilogue has it."""
    name = "bf16 depthwise"
    fuses_relu = True

    def __init__(self, layer, n, h, w):
        self.depthwise = Depthwise(layer, n, h, w)
        self.scaled = np.empty_like(self.depthwise.w)

    def _rounded(self, a, role):
        flat = a.reshape(-1)
        out = _workspace(f"bf16_rounded_{role}", flat.shape)
        _bf16.round_floats(flat, out)
        return out.reshape(a.shape)

    def _pack(self):
        d = self.depthwise
        d._pack()
        _bf16.round_floats(d.w.reshape(-1), d.w.reshape(-1))      # idempotent

    def forward(self, bottom, top, params=None, relu=False, affine=None):
        assert params is None, "bf16 rounds the net's own weights, never folded ones"
        self._pack()
        w, bias = self.depthwise.w, forward_params(self.depthwise.layer, None)[1]
        if affine is not None:
            scale, bias = affine
            np.multiply(w, scale, out=self.scaled)
            w = self.scaled
        bias = _EMPTY if bias is None else bias
        for b, t in zip(bottom, top):
            _k.dw_forward(self._rounded(b.raw_data, "x"), w, bias, t.raw_data,
                          *self.depthwise.args, relu)

    def backward(self, top, propagate_down, bottom, need_w, need_b):
        self._pack()
        rounded_top = [_Rounded(raw_diff=self._rounded(t.raw_diff, "dy")) for t in top]
        rounded_bottom = [_Rounded(raw_data=self._rounded(b.raw_data, "x"), raw_diff=b.raw_diff)
                          for b in bottom]
        self.depthwise.backward(rounded_top, propagate_down, rounded_bottom, need_w, need_b,
                                packed=True)


class _Rounded:
    """A blob's arrays as BF16Amx's backward hands them to Gemm: rounded copies, the diff to
    write."""

    def __init__(self, raw_data=None, raw_diff=None):
        self.raw_data, self.raw_diff = raw_data, raw_diff


class _RoundedGemm(Gemm):
    """Gemm reading the layer's weights rounded to bf16 (kept while the blob is unchanged)."""

    def __init__(self, layer, n, h, w):
        super().__init__(layer, n, h, w)
        self.rounded_from = Seen()
        self.rounded = None

    def _weights(self, fresh=True, params=None):
        blob = self.layer.blobs[0]
        if self.rounded_from.changed(blob):
            self.rounded = precision.round_bf16(blob.read_data)
            self.rounded.flags.writeable = False        # blob.Seen knows it by identity
            self.rounded_from.keep(blob)
        return super()._weights(fresh, (self.rounded, None))


class Direct:
    """Direct convolution for few input channels (group 1, cext/nhwc_direct.h): the image read
    in place instead of through im2col, the sums in registers. Channels-last blobs, or with
    `width` the blocked layout's (caffepy/layers/intel.py) when the channels fit one block. Its
    data gradient (rarely wanted: such layers are mostly first layers) is `gemm`'s, the GEMM
    algorithm of the same layer and layout (Gemm or BlockedGemm). It takes a TEST net's ReLU
    into the store of its sums (`fuses_relu`)."""
    name = "direct"
    fuses_relu = True

    def __init__(self, layer, n, h, w, gemm, width=None):
        L = layer
        self.layer = _back_reference(layer)
        (kh, kw) = L.window.kernel
        v, t = _k.direct_widths()
        self.h, self.w, self.width = h, w, width
        self.writes_slices = width is None      # channels-last (Gemm says what that is)
        self.k = kh * kw * L.channels
        # outputs written a pixel: a block's padding lanes too (their weights and bias are 0)
        self.lanes = L.num_output if width is None else -(-L.num_output // width) * width
        self.op = -(-self.lanes // v) * v
        self.op_grad = -(-L.num_output // v) * v      # the weight gradient's: real outputs only
        self.kp = -(-self.k // t) * t
        self.plane = _k.conv_direct_plane(h, w, L.channels, *self._args())
        self.band = max(1, (1 << 14) // (L.ow * self.op))     # dy rows widened at once: 64 KB
        self.wp = np.zeros((self.k, self.op), np.float32)
        self.reordered = Seen()
        self.bp = np.zeros(self.op, np.float32)
        self.gemm = gemm

    def _args(self):
        (kh, kw), (ph, pw), (sh, sw), (dh, dw) = self.layer.window
        return kh, kw, ph, pw, sh, sw, dh, dw

    def _arrays(self, x, y):
        """x as [N, H, W, floats a pixel], y as [N, floats an image], and y's addressing (pixel
        stride, lanes a block, block stride: nhwc_direct.h)."""
        n, L = len(x), self.layer
        if self.width is None:
            return x, y.reshape(n, -1), L.num_output, L.num_output, 0
        v = self.width
        return (x.reshape(n, self.h, self.w, v), y.reshape(n, -1), v, v, L.oh * L.ow * v)

    def forward(self, bottom, top, params=None, relu=False, out=None):
        L = self.layer
        o = L.num_output
        source = weight_source(L, params)
        if self.reordered.changed(source):
            _k.reverse_axes(values(source).reshape(o, L.channels, -1),
                            self.wp[:self.k, :o].reshape(-1, L.channels, o))
            self.reordered.keep(source)
        bias = forward_params(L, params)[1]
        self.bp[:o] = 0 if bias is None else bias
        xpad = _workspace("direct_x", (_k.max_threads(), self.plane))
        for b, t in zip(bottom, top):
            x, y, ys, lanes, bs = self._arrays(b.raw_data, t.raw_data)
            if out is not None:         # its pixels ps floats apart, as [N, floats an image]
                ps = out.strides[2] // 4
                y = np.lib.stride_tricks.as_strided(
                    out, (len(out), (L.oh * L.ow - 1) * ps + o), (out.strides[0], 4))
                ys = ps
            _k.conv_direct_forward(x, L.channels, self.wp, self.bp, y, self.lanes, ys, lanes, bs,
                                   xpad, *self._args(), relu=relu)

    def backward(self, top, propagate_down, bottom, need_w, need_b):
        L = self.layer
        o, (kh, kw) = L.num_output, L.window.kernel
        threads = _k.max_threads()
        if need_w or need_b:
            op = self.op_grad
            dwp = _workspace("direct_dw", (threads, self.kp * op))
            dbp = _workspace("direct_db", (threads, op))
            xpad = _workspace("direct_x", (threads, self.plane))
            dyp = _workspace("direct_dy", (threads, self.band * L.ow * op))
            for b, t in zip(bottom, top):
                x, dy, ys, lanes, bs = self._arrays(b.raw_data, t.raw_diff)
                _k.conv_direct_weight_grad(x, L.channels, dy, o, ys, lanes, bs, dwp, dbp, xpad,
                                           dyp, self.band, *self._args())
                if need_w:
                    grad = dwp[0].reshape(self.kp, op)[:self.k, :o]
                    _k.reverse_axes(grad.reshape(kh * kw, L.channels, o),
                                    L.blobs[0].diff.reshape(o, L.channels, kh * kw), True)
                if need_b:
                    L.blobs[1].diff[...] += dbp[0, :o]
        if any(propagate_down):
            self.gemm.backward(top, propagate_down, bottom, False, False)


class Depthwise:
    """Direct depthwise convolution (group = channels = outputs), vectorized over channels. Its
    weights are kept reordered to [taps, C] between forwards (blob.Seen), and it takes a TEST
    net's ReLU into the store of its sums (`fuses_relu`): MobileNet's depthwise layers at
    batch 1 run at 0.05-0.2 ms, where a pass of their own over the output counts."""
    name = "depthwise"
    fuses_relu = True

    def __init__(self, layer, n, h, w):
        L = layer
        self.layer = _back_reference(layer)
        (kh, kw), (ph, pw), (sh, sw), (dh, dw) = L.window
        self.args = (kh, kw, ph, pw, sh, sw, dh, dw)
        self.w = np.empty((kh * kw, L.channels), np.float32)
        self.reordered = Seen()

    def _pack(self, params=None):
        L = self.layer
        source = weight_source(L, params)
        if self.reordered.changed(source):
            np.copyto(self.w, values(source).reshape(L.channels, -1).T)
            self.reordered.keep(source)

    def forward(self, bottom, top, params=None, relu=False):
        self._pack(params)
        bias = forward_params(self.layer, params)[1]
        bias = _EMPTY if bias is None else bias
        for b, t in zip(bottom, top):
            _k.dw_forward(b.raw_data, self.w, bias, t.raw_data, *self.args, relu)

    def backward(self, top, propagate_down, bottom, need_w, need_b, packed=False):
        L = self.layer
        if any(propagate_down) and not packed:
            self._pack()            # the forward may have run another algorithm
        threads = _k.max_threads()
        dw = _workspace("dw_acc", (threads,) + self.w.shape)
        db = _workspace("dw_db", (threads, L.channels))
        for i, (b, t) in enumerate(zip(bottom, top)):
            need_x = bool(propagate_down[i])
            if not (need_x or need_w or need_b):
                continue
            dx = b.raw_diff if need_x else b.raw_data
            _k.dw_backward(b.raw_data, self.w, t.raw_diff, dx, dw, db, *self.args, need_x, need_w,
                           need_b)
            if need_w:
                L.blobs[0].diff.reshape(L.channels, -1)[...] += dw[0].T
            if need_b:
                L.blobs[1].diff[...] += db[0]


class Winograd:
    """Winograd F(m x m, r x r) on the channels-last layout (cext/winograd.pyx), for stride-1
    undilated square kernels: a*a GEMMs over tiles instead of one over pixels. It takes a TEST
    net's ReLU into its output transform's store (`fuses_relu`): GoogLeNet b1's 3 x 3 and 5 x 5
    layers ran their ReLUs as 14 passes of their own. Like Gemm it `writes_slices`."""
    fuses_relu = True
    writes_slices = True

    def __init__(self, layer, n, h, w, m):
        L = layer
        self.layer = _back_reference(layer)
        self.m, self.r = m, L.window.kernel[0]
        self.name = f"winograd F({m},{self.r})"
        self.v = block_width()
        self.ph, self.pw = L.window.pad
        self.vshape, self.mshape = _winograd.scratch_shapes(_k.max_threads(), n, L.channels,
                                                            L.num_output, h, w, self.v, m, self.r,
                                                            self.ph, self.pw, L.group)

    def _setup(self, forward, params=None):
        L = self.layer
        at, gm, bt = winograd_matrices(self.m, self.r)
        u, packed = winograd_weights(weight_source(L, params), gm, L.group, forward, _workspace,
                                     L, packs=True)
        return (at, bt, gm, u, packed) + winograd_buffers(self.vshape, self.mshape, _workspace)

    def forward(self, bottom, top, params=None, relu=False, out=None):
        L = self.layer
        given = forward_params(L, params)[1]
        at, bt, _, u, packed, vbuf, mbuf = self._setup(True, params)
        bias = _workspace("wino_bias", (self.mshape[3],))
        bias[...] = 0
        if given is not None:
            bias[:L.num_output] = given
        for b, t in zip(bottom, top):
            _winograd.conv_forward_nhwc(b.raw_data, u, bias, t.raw_data if out is None else out,
                                        vbuf, mbuf, at, bt, self.v, L.num_output, self.m, self.r,
                                        self.ph, self.pw, L.group, packed, relu)

    def backward(self, top, propagate_down, bottom, need_w, need_b):
        L = self.layer
        at, bt, gm, u, _, vbuf, mbuf = self._setup(False)
        du = _workspace("wino_du", (vbuf.shape[0],) + u.shape) if need_w else np.zeros((1, 1, 1, 1), np.float32)
        for i, (b, t) in enumerate(zip(bottom, top)):
            need_x = bool(propagate_down[i])
            if need_b:
                L.blobs[1].diff[...] += channel_sums(t.raw_diff.reshape(-1, t.shape[1]))
            if not (need_x or need_w):
                continue
            dx = b.raw_diff if need_x else b.raw_data
            _winograd.conv_backward_nhwc(b.raw_data, u, t.raw_diff, dx, du, vbuf, mbuf, at, bt,
                                         self.v, L.num_output, self.m, self.r, self.ph, self.pw,
                                         L.group, need_x, need_w)
            if need_w:
                _winograd.weight_grad_add(du[0], gm, L.blobs[0].diff)


# ---------------------------------------------------------------------------------------------
# Blocked (N, ceil(C/V), H, W, V)

class BlockedGemm:
    """Caffe's algorithm on the blocked layout: per image, blocked im2col and one sgemm per
    group (cext/intel.pyx), for every shape; the weights reordered to the columns' order
    first (lane-major when the groups' channels are whole blocks)."""
    name = "im2col+gemm"

    def __init__(self, layer):
        L = layer
        self.layer = _back_reference(layer)
        cg = L.channels // L.group
        self.vec = _ki.conv_uses_vec_order(L.channels, L.group, L.width)
        self.wt = np.empty((L.group, cg * L.kh * L.kw, L.num_output // L.group), np.float32)

    def _args(self):
        L = self.layer
        return (L.channels, L.num_output, L.kh, L.kw, L.ph, L.pw, L.sh, L.sw, L.dh, L.dw, L.group)

    def _scratch(self):
        L = self.layer
        threads = _ki.max_threads()
        p, k = L.oh * L.ow, L.channels * L.kh * L.kw
        return (_workspace("col", (threads, p, k)), _workspace("ybuf", (threads, p, L.num_output)))

    def _pack_weights(self):
        L = self.layer
        g, o, cg, kh, kw = L.group, L.num_output, L.channels // L.group, L.kh, L.kw
        w = L.blobs[0].data
        if self.vec:
            v = L.width
            src = w.reshape(g, o // g, cg // v, v, kh, kw).transpose(0, 2, 4, 5, 3, 1)
        else:
            src = w.reshape(g, o // g, cg * kh * kw).transpose(0, 2, 1)
        np.copyto(self.wt.reshape(src.shape), src)

    def _add_weight_diff(self, dwt):
        L = self.layer
        g, o, cg, kh, kw = L.group, L.num_output, L.channels // L.group, L.kh, L.kw
        if self.vec:
            v = L.width
            grad = dwt.reshape(g, cg // v, kh, kw, v, o // g).transpose(0, 5, 1, 4, 2, 3)
        else:
            grad = dwt.transpose(0, 2, 1)
        L.blobs[0].diff.reshape(grad.shape)[...] += grad

    def forward(self, bottom, top):
        L = self.layer
        self._pack_weights()
        bias = L.blobs[1].data if L.bias_term else _EMPTY
        col, ybuf = self._scratch()
        for b, t in zip(bottom, top):
            _ki.conv_forward(b.data, self.wt, bias, t.data, col, ybuf, *self._args())

    def backward(self, top, propagate_down, bottom, need_w, need_b):
        L = self.layer
        self._pack_weights()
        col, ybuf = self._scratch()
        threads = col.shape[0]
        dwt = _workspace("dwt", (threads,) + self.wt.shape) if need_w else np.zeros((1, 1, 1, 1), np.float32)
        db = _workspace("db", (threads, L.num_output)) if need_b else np.zeros((1, 1), np.float32)
        empty = np.zeros((1, 1, 1, 1, 1), np.float32)
        for i, (b, t) in enumerate(zip(bottom, top)):
            need_x = bool(propagate_down[i])
            if not (need_x or need_w or need_b):
                continue
            _ki.conv_backward(b.data, self.wt, t.diff, b.diff if need_x else empty, dwt, db, col,
                              ybuf, *self._args(), need_x, need_w, need_b)
            if need_w:
                self._add_weight_diff(dwt[0])
            if need_b:
                L.blobs[1].diff[...] += db[0]


class BlockedWinograd:
    """Winograd F(m x m, r x r) on the blocked layout (cext/winograd.pyx), for stride-1
    undilated square kernels: a*a GEMMs over tiles instead of one over pixels."""

    def __init__(self, layer, m):
        self.layer = _back_reference(layer)
        self.m = m
        self.name = f"winograd F({m},{layer.kh})"

    def _setup(self, n, h, w, forward):
        """(matrices, U of the current weights, vbuf, mbuf) for F(m, kernel); U in the
        forward's layout or the backward's (cext/winograd.pyx)."""
        L = self.layer
        at, gm, bt = winograd_matrices(self.m, L.kh)
        u, _ = winograd_weights(L.blobs[0], gm, L.group, forward, _workspace, L)
        vshape, mshape = _winograd.scratch_shapes(_ki.max_threads(), n, L.channels, L.num_output,
                                                  h, w, L.width, self.m, L.kh, L.ph, L.pw, L.group)
        return (at, bt, gm, u) + winograd_buffers(vshape, mshape, _workspace)

    def forward(self, bottom, top):
        L = self.layer
        n, _, h, w, v = bottom[0].shape
        at, bt, _, u, vbuf, mbuf = self._setup(n, h, w, True)
        bias = _workspace("wino_bias", (-(-L.num_output // v) * v,))
        bias[...] = 0
        if L.bias_term:
            bias[:L.num_output] = L.blobs[1].data
        for b, t in zip(bottom, top):
            _winograd.conv_forward(b.data, u, bias, t.data, vbuf, mbuf, at, bt, L.channels,
                                   L.num_output, self.m, L.kh, L.ph, L.pw, L.group)

    def backward(self, top, propagate_down, bottom, need_w, need_b):
        L = self.layer
        n, _, h, w, v = bottom[0].shape
        at, bt, gm, u, vbuf, mbuf = self._setup(n, h, w, False)
        du = _workspace("wino_du", (vbuf.shape[0],) + u.shape) if need_w else _NO_DU
        for i, (b, t) in enumerate(zip(bottom, top)):
            need_x = bool(propagate_down[i])
            if need_b:
                # a kernel: NumPy's reduce over the middle axes took 18.6 ms for AlexNet's conv2
                # at b64, and a product with ones through NumPy's BLAS left that BLAS's threads
                # spinning, which slowed the layers after it
                db = _workspace("wino_db", (t.shape[1] * v,), np.float64)
                _ki.channel_sums(t.diff, db)
                L.blobs[1].diff[...] += db[:L.num_output]
            if not (need_x or need_w):
                continue
            _winograd.conv_backward(b.data, u, t.diff, b.diff if need_x else _NO_DX, du, vbuf, mbuf,
                                    at, bt, L.channels, L.num_output, self.m, L.kh, L.ph, L.pw,
                                    L.group, need_x, need_w)
            if need_w:
                _winograd.weight_grad_add(du[0], gm, L.blobs[0].diff)
