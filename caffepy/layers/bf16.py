"""The bf16 variants of Convolution and InnerProduct (caffepy/precision.py: what bf16 means here,
and which kernels run it).

The factory picks them for every Convolution and InnerProduct of a net built while the
precision is bf16, except the int8 layers (quantization_param in a TEST net stay int8) and
the model-parallel InnerProduct (caffepy/parallel/model_parallel.py), which stay as they are.

A TEST net's Convolution runs channels-last (BF16NHWCConvolution) where the bf16 kernels are
AMX-BF16's, when it has one group or at least 16 input and output channels a group (AlexNet's
groups), or is depthwise (a group per channel: the float32 depthwise kernel on rounded
operands, conv_algorithms.BF16Depthwise; its products would fill a sixteenth of a tile's
columns): the net then plans its channels-last region as a float32 net does, with the same
TEST fusions (BatchNorm and Scale as a per-channel epilogue on the float32 sums, ReLU and
Eltwise SUM in it, concat tops written in place: caffepy/net_rules.py), and the blobs a user
reads hold what they hold in a float32 net's. Everywhere else (training nets, the AVX512_BF16
kernels, the emulation, other groups of fewer channels, Deconvolution) the variants below run
on NCHW blobs, the layers between them their plain float32 implementations.

Forward: top = round(W) (*) round(bottom) + b, summed in float32 (Caffe's im2col + GEMM, or the
GEMM of InnerProduct), the bias and any Intel fusion (ReLU, SUM) in float32. Backward: the
weight gradient round(top_diff) x round(bottom) accumulated into the float32 weight diff, the
bottom diff round(top_diff) x round(W), the bias gradient the float32 sum of round(top_diff).
The layer's blobs (the master weights) stay float32 and are never rounded in place: the bf16
kernels (precision.kernel()) round the operands as they pack them, at each pass (pycaffe code
may change a blob's data between passes); the emulation rounds them into scratch copies.
"""
import numpy as np

from .. import precision, quantization
from ..blob import Seen
from ..layer import BLOCKED, LAYERS, NHWC, PLAIN, register
from ..proto import caffe_pb2
from .common import InnerProduct
from .conv_algorithms import BF16Amx, BF16Depthwise
from .nhwc import Folded, NHWCConvolution
from .vision import Convolution

from ..kernels import bf16 as bf16_kernels

ALGORITHM = "bf16 emulated: bf16-rounded operands, float32 GEMM"


class _BF16:
    """The bf16 part of both variants: when the factory picks them, the products' kernel (the
    bf16 path precision.kernel() names, else the float32 GEMM), and the GEMM operands (the
    parent's `operand` hook) as bf16-rounded copies where no kernel rounds them, one buffer per
    role, reused while its shape holds."""
    rounded_by_kernel = ("w", "x", "dy")     # the roles the bf16 kernels round themselves

    @classmethod
    def wanted(cls, request):
        """Under bf16, unless the layer is int8 or another variant for plain blobs wants it (the
        model-parallel InnerProduct: its split of the weights across ranks matters more; it runs
        float32, and the net's `Precision per layer:` line says so)."""
        if precision.current() != precision.BF16 or quantization.quantized(
                request.param, request.phase, request.net, request.source):
            return False
        others = [c for variant, c in LAYERS[request.param.type].items()
                  if variant not in (PLAIN, precision.BF16) and c.layout not in (BLOCKED, NHWC)]
        return not any(c.wanted(request) for c in others)

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.rounded = {}
        path = precision.kernel()
        self.products, self.kernel_name = path if path else (0, None)
        self.algorithm = (f"bf16 {self.kernel_name}: bf16-rounded operands, float32 sums" if path
                          else ALGORITHM)
        self.tuning = "rule"

    def operand(self, role, a):
        if self.products and role in self.rounded_by_kernel:
            return a
        buf = self.rounded.get(role)
        if buf is None or buf.shape != a.shape:
            buf = self.rounded[role] = np.empty(a.shape, np.float32)
        return precision.round_bf16(a, buf)


@register(variant=precision.BF16)
class BF16Convolution(_BF16, Convolution):
    """Convolution in bf16 (see the module docstring): convolution_param as Convolution."""
    type = "Convolution"


@register(variant=precision.BF16)
class BF16InnerProduct(_BF16, InnerProduct):
    """InnerProduct in bf16 (see the module docstring): inner_product_param as InnerProduct."""
    type = "InnerProduct"
    rounded_by_kernel = ("w", "x")      # the bias gradient sums the top diff here: rounded first

    def setup(self, bottom, top):
        super().setup(bottom, top)
        # a TEST net's forward reads the weights rounded and packed once per weights version
        # (blob.Seen), not packed again from float32 at every forward: AlexNet b1's fc6 read
        # 151 MB and wrote 75 MB each time, slower than float32's product
        self.packs = bool(self.products) and self.phase == caffe_pb2.TEST
        self.packed_from = Seen()
        self.packed = None

    def _choose(self, bottom, top):
        self._skinny = {"forward": False, "data": False}       # the BLAS's GEMM, not measured

    def forward(self, bottom, top):
        if not self.packs:
            return super().forward(bottom, top)
        n, k = self.num_output, self.K
        if self.packed_from.changed(self.blobs[0]):
            if self.packed is None:
                self.packed = np.empty(bf16_kernels.packed_size(n, k), np.uint16)
            w = self.blobs[0].read_data
            bf16_kernels.pack(w.T if self.transpose else w, self.packed)
            del w                   # held by no one when kept (blob.Seen)
            self.packed_from.keep(self.blobs[0])
        # y^T [N, M] = W [N, K] x^T: the weights are the packed left operand
        yt = self.rounded.get("yt")
        if yt is None or yt.shape != (n, self.M):
            yt = self.rounded["yt"] = np.empty((n, self.M), np.float32)
        x = bottom[0].data.reshape(self.M, k)
        bf16_kernels.gemm(np.broadcast_to(np.float32(0), (n, k)), x.T, yt, False, self.products,
                          self.packed)
        y = top[0].data.reshape(self.M, n)
        np.copyto(y, yt.T)
        if self.bias_term:
            y += self.blobs[1].data
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def product(self, a, b, c, beta=0.0):
        if self.products:
            bf16_kernels.gemm(a, b, c, beta != 0, self.products)
        else:
            super().product(a, b, c, beta)


@register(variant=precision.BF16_NHWC)
class BF16NHWCConvolution(NHWCConvolution):
    """A TEST net's Convolution in bf16 on channels-last blobs (see the module docstring):
    NHWCConvolution's fields, fusions and epilogue with one algorithm, BF16Amx (AMX tiles)."""
    type = "Convolution"
    layout = NHWC
    kernel_name = "AMX-BF16 channels-last"

    @classmethod
    def wanted(cls, request):
        path = precision.kernel() if precision.current() == precision.BF16 else None
        if path is None or path[0] != bf16_kernels.AMX or request.phase != caffe_pb2.TEST \
                or not cls.fits(request):
            return False
        p = request.param.convolution_param
        groups, channels = max(p.group, 1), request.bottoms[0].shape[1]
        depthwise = groups == channels == p.num_output > 1
        return ((groups == 1 or min(channels, p.num_output) >= 16 * groups or depthwise)
                and not quantization.quantized(request.param, request.phase, request.net,
                                               request.source))

    def forward_folded(self, bottom, top, bn, scale=None, relu=False, add=None, out=None):
        """NHWCConvolution.forward_folded, but a depthwise layer's BatchNorm and Scale scale its
        rounded weights (BF16Depthwise) where the float32 path folds them into the weights
        before any rounding."""
        algo = self.algos["forward"]
        if not isinstance(algo, BF16Depthwise) or bn is None:
            return super().forward_folded(bottom, top, bn, scale, relu, add, out)
        assert add is None and out is None, "the depthwise kernel has no epilogue"
        if self._affine is None:
            self._affine = Folded(weights=False)
        algo.forward(bottom, top, relu=relu, affine=self._affine.params(self, bn, scale))
        return True

    def _candidates(self, n, h, w):
        depthwise = self.group == self.channels == self.num_output > 1
        algo = (BF16Depthwise if depthwise else BF16Amx)(self, n, h, w)
        return {algo.name: algo}, algo.name
