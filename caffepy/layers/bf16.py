"""The bf16 variants of Convolution and InnerProduct (caffepy/precision.py: what bf16 means here,
and why it is emulated).

The factory picks them for every Convolution and InnerProduct of a net built while the
precision is bf16, except the int8 layers (quantization_param in a TEST net stay int8) and
the model-parallel InnerProduct (caffepy/parallel/model_parallel.py), which stay as they are. They
run on NCHW blobs, so a bf16 net plans no channels-last region (layers/nhwc.py's Convolution is
not wanted under bf16) and its other layers run their plain float32 implementations.

Forward: top = round(W) (*) round(bottom) + b, summed in float32 (Caffe's im2col + GEMM, or the
GEMM of InnerProduct), the bias and any Intel fusion (ReLU, SUM) in float32. Backward: the
weight gradient round(top_diff) x round(bottom) accumulated into the float32 weight diff, the
bottom diff round(top_diff) x round(W), the bias gradient the float32 sum of round(top_diff).
The layer's blobs (the master weights) stay float32 and are never rounded in place; the
rounded operands are scratch copies, made again at each pass (pycaffe code may change a
blob's data between passes).
"""
import numpy as np

from .. import precision, quantization
from ..layer import BLOCKED, LAYERS, NHWC, PLAIN, register
from .common import InnerProduct
from .vision import Convolution

ALGORITHM = "bf16 emulated: bf16-rounded operands, float32 GEMM"


class _BF16:
    """The bf16 part of both variants: when the factory picks them, and their GEMM operands
    (the parent's `operand` hook) as bf16-rounded copies, one buffer per role, reused while
    its shape holds."""

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
        self.algorithm, self.tuning = ALGORITHM, "rule"

    def operand(self, role, a):
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

    def _choose(self, bottom, top):
        self._skinny = {"forward": False, "data": False}       # the BLAS's GEMM, not measured
