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
from ..blas import gemm_into
from ..kernels import vision as kv
from ..layer import BLOCKED, LAYERS, NHWC, PLAIN, register
from .common import InnerProduct, param_wanted
from .vision import Convolution

ALGORITHM = "bf16 emulated: bf16-rounded operands, float32 GEMM"


def _wanted(request):
    """Under bf16, unless the layer is int8 or another variant for plain blobs wants it (the
    model-parallel InnerProduct: its split of the weights across ranks matters more; it runs
    float32, and the net's `Precision per layer:` line says so)."""
    if precision.current() != precision.BF16 or quantization.quantized(
            request.param, request.phase, request.net, request.source):
        return False
    others = [cls for variant, cls in LAYERS[request.param.type].items()
              if variant not in (PLAIN, precision.BF16) and cls.layout not in (BLOCKED, NHWC)]
    return not any(cls.wanted(request) for cls in others)


class _Rounded:
    """bf16-rounded copies of a layer's operands, one buffer per role, reused while its shape
    holds."""

    def __init__(self):
        self.buffers = {}

    def __call__(self, role, a):
        buf = self.buffers.get(role)
        if buf is None or buf.shape != a.shape:
            buf = self.buffers[role] = np.empty(a.shape, np.float32)
        return precision.round_bf16(a, buf)


@register(variant=precision.BF16)
class BF16Convolution(Convolution):
    """Convolution in bf16 (see the module docstring): convolution_param as Convolution."""
    type = "Convolution"

    @classmethod
    def wanted(cls, request):
        return _wanted(request)

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.rounded = _Rounded()
        self.algorithm, self.tuning = ALGORITHM, "rule"

    def forward(self, bottom, top):
        w = self.rounded("w", self.blobs[0].data)
        for b, t in zip(bottom, top):
            kv.conv_forward(self.rounded("x", b.data), w, self._bias(), t.data, self.col_buffer,
                            *self.conv_args())
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if self.fused is not None:
            top, propagate_down, bottom = self.fused.backward(top, propagate_down, bottom)
        wdiff, bdiff = self.param_diffs()
        w = self.rounded("w", self.blobs[0].data)
        for t, down, b in zip(top, propagate_down, bottom):
            kv.conv_backward(self.rounded("dy", t.diff), self.rounded("x", b.data), w, wdiff, bdiff,
                             b.diff if down else None, self._ensure_backward_buffer(b),
                             *self.conv_args())


@register(variant=precision.BF16)
class BF16InnerProduct(InnerProduct):
    """InnerProduct in bf16 (see the module docstring): inner_product_param as InnerProduct."""
    type = "InnerProduct"

    @classmethod
    def wanted(cls, request):
        return _wanted(request)

    def setup(self, bottom, top):
        self.rounded = _Rounded()
        super().setup(bottom, top)

    def _choose(self, bottom, top):
        self._skinny = {"forward": False, "data": False}
        self.algorithm, self.tuning = ALGORITHM, "rule"

    def _weights(self):
        w = self.rounded("w", self.blobs[0].data)
        return w.T if self.transpose else w         # [num_output, K]

    def forward(self, bottom, top):
        x = self.rounded("x", bottom[0].data.reshape(self.M, self.K))
        y = top[0].data.reshape(self.M, self.num_output)
        gemm_into(x, self._weights().T, y)
        if self.bias_term:
            y += self.blobs[1].data
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if self.fused is not None:
            top, propagate_down, bottom = self.fused.backward(top, propagate_down, bottom)
        dy = self.rounded("dy", top[0].diff.reshape(self.M, self.num_output))
        if param_wanted(self, 0):
            x = self.rounded("x", bottom[0].data.reshape(self.M, self.K))
            if self.transpose:
                gemm_into(x.T, dy, self.blobs[0].diff, 1.0)     # dW[K, N] += x^T dy
            else:
                gemm_into(dy.T, x, self.blobs[0].diff, 1.0)     # dW[N, K] += dy^T x
        if self.bias_term and param_wanted(self, 1):
            self.blobs[1].diff[...] += dy.sum(axis=0)
        if propagate_down[0]:
            gemm_into(dy, self._weights(), bottom[0].diff.reshape(self.M, self.K))
