"""Common layers: InnerProduct, Concat, Slice, Split, Eltwise, Flatten, Reshape, Scale,
Bias, Softmax, ArgMax, Tile, Embed, Silence, Reduction, BatchReindex, Filter, Parameter."""
import numpy as np

from .. import autotune, quantization
from ..blas import gemm_into
from ..blob import Blob
from ..errors import ShapeError
from ..kernels import common as kernels
from ..kernels import neuron as neuron_kernels
from ..kernels import nhwc as nhwc_kernels
from ..layer import ANY, Layer, canonical_axis, count_from, register
from ..proto import caffe_pb2


def param_wanted(layer, i):
    """Whether parameter blob i wants a gradient (the Net sets it from lr_mult; unset means yes)."""
    return i >= len(layer.param_propagate_down) or bool(layer.param_propagate_down[i])


def _shape(s):
    return "x".join(str(d) for d in s) if s else "scalar"


def constant_filler(value):
    """A FillerParameter for the constant `value` (Caffe's defaults where a filler is unset)."""
    return caffe_pb2.FillerParameter(type="constant", value=value)


class FusedOutput:
    """Intel Caffe's fusions into a Convolution (convolution_param) or an InnerProduct
    (inner_product_param), applied to the layer's own output y = W x + b:
        fusion_type: SUM_FUSION   y = coeff[1] * y + coeff[0] * bottom[1]   (a Convolution)
        relu: true                y = max(y, 0) + negative_slope * min(y, 0), after the sum
    Intel's ConvSumFusion rule makes the first from a convolution, the Eltwise SUM after it and
    the ReLU after that: the Eltwise's other bottom becomes the convolution's second bottom (the
    summand) and the ReLU's top its top. `coeff` is empty (both 1) or two values: the summand's,
    then the convolution's, as Intel's int8 engine scales them (its float engine ignores them).

    The backward takes the ReLU's gradient from the output (whose sign is its input's for a
    negative_slope of at least 0), hands the summand coeff[0] times it and the layer's own
    backward coeff[1] times it through tops of its own (`grads`), so the top diffs stay as the
    net gave them."""

    @classmethod
    def of(cls, layer, field):
        """The fused output `layer`'s `field` (its *_param) asks for, or None when it asks for
        none; the fields are checked."""
        p = getattr(layer.param, field)
        summed = field == "convolution_param" and p.fusion_type == p.SUM_FUSION
        if field == "convolution_param" and len(p.coeff) and not summed:
            raise layer.error("convolution_param.coeff", "weighs the summand of fusion_type: "
                              "SUM_FUSION, which is not set", list(p.coeff))
        if not (p.relu or summed):
            return None
        return cls(layer, field, p, summed)

    @staticmethod
    def sum_fusion(param):
        return param.convolution_param.fusion_type == caffe_pb2.ConvolutionParameter.SUM_FUSION

    @classmethod
    def check_blob_counts(cls, layer, bottom, top):
        """A SUM_FUSION convolution's blobs: the input and the summand, one top. False for any
        other layer (its class's counts apply)."""
        if not cls.sum_fusion(layer.param):
            return False
        if len(bottom) != 2 or len(top) != 1:
            raise layer.error("convolution_param.fusion_type", "SUM_FUSION takes two bottoms (the "
                              "input and the summand) and one top",
                              f"{len(bottom)} bottom(s), {len(top)} top(s)")
        return True

    def __init__(self, layer, field, p, summed):
        self.relu, self.slope, self.summed = bool(p.relu), float(p.negative_slope), summed
        if self.relu and self.slope < 0:
            raise layer.error(f"{field}.negative_slope", "a fused ReLU takes a slope of at least 0 "
                              "(its gradient is read from the output's sign)", self.slope,
                              hint="Use a ReLU layer after the layer")
        coeff = [float(c) for c in p.coeff] if summed else []
        if coeff and len(coeff) != 2:
            raise layer.error(f"{field}.coeff", "needs two values (the summand's, the "
                              "convolution's) or none", coeff)
        self.coeff = coeff or [1.0, 1.0]
        self.layer_name = layer.name
        self.grads = []

    def inputs(self, bottom):
        """The bottoms the layer's own computation reads (all but the summand)."""
        return bottom[:1] if self.summed else bottom

    def reshape(self, layer, bottom, top):
        """Check the summand against the top, and shape the tops the gradients go through."""
        if self.summed and bottom[1].shape != top[0].shape:
            raise layer.error("bottom[1]", f"the summand of SUM_FUSION needs the top's shape "
                              f"{_shape(top[0].shape)}", _shape(bottom[1].shape), cls=ShapeError)
        if self.summed and bottom[1].layout != top[0].layout:
            raise layer.error("bottom[1]", "the summand of SUM_FUSION needs the top's layout",
                              bottom[1].layout, cls=ShapeError)
        while len(self.grads) < len(top):
            self.grads.append(Blob(name=f"{self.layer_name} fused gradient"))
        for g, t in zip(self.grads, top):
            g.layout = None
            g.reshape(t.shape)
            g.layout = t.layout
            g.share_data(t)

    def forward(self, bottom, top):
        y = top[0].raw_data.reshape(-1)
        if self.summed:
            s = bottom[1].raw_data.reshape(-1)
            c0, c1 = self.coeff
            if (c0, c1) == (1.0, 1.0) and self.relu:
                neuron_kernels.sum_relu_forward(y, s, y, self.slope)
                return
            if (c0, c1) == (1.0, 1.0):
                kernels.add(y, s, y)
                return
            y *= np.float32(c1)
            y += np.float32(c0) * s
        if self.relu:
            for t in top:
                y = t.raw_data.reshape(-1)
                neuron_kernels.relu_forward(y, y, self.slope)

    def backward(self, top, propagate_down, bottom):
        """The summand's diff (if wanted); returns the (tops, propagate_down, bottoms) the
        layer's own backward takes: tops whose diffs are the gradients at its output."""
        c0, c1 = self.coeff
        inner = self.inputs(bottom)
        if not self.relu and c1 == 1.0:
            grads = top
        else:
            grads = self.grads[:len(top)]
            for t, g in zip(top, grads):
                if self.relu:
                    neuron_kernels.relu_backward(t.raw_data.reshape(-1), t.raw_diff.reshape(-1),
                                                 g.raw_diff.reshape(-1), self.slope)
                else:
                    np.copyto(g.raw_diff, t.raw_diff)
        if self.summed and propagate_down[1]:
            np.multiply(grads[0].raw_diff, np.float32(c0), out=bottom[1].raw_diff)
        if c1 != 1.0:
            grads[0].raw_diff[...] *= np.float32(c1)
        return grads, propagate_down[:len(inner)], inner


@register
class Split(Layer):
    """One bottom to every top, which share its data as in Caffe (so a layer working in place
    on one top changes what the others read, as there); backward sums the top diffs (inserted
    by the Net where a blob feeds several layers)."""
    exact_bottoms = 1
    min_tops = 1
    layout = ANY
    reshape_from_blobs = True

    def reshape(self, bottom, top):
        for t in top:
            t.reshape(bottom[0].shape)
            if t.layout != bottom[0].layout:
                t.layout = bottom[0].layout     # what layer_setup gives a layout-free layer's tops
            t.share_data(bottom[0])

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        diff = bottom[0].raw_diff.reshape(-1)       # the tops share the bottom's layout
        if len(top) == 1:
            kernels.copy(top[0].raw_diff.reshape(-1), diff)
            return
        kernels.add(top[0].raw_diff.reshape(-1), top[1].raw_diff.reshape(-1), diff)
        for t in top[2:]:
            kernels.add(diff, t.raw_diff.reshape(-1), diff)


@register
class InnerProduct(Layer):
    """y = x W^T + b over x flattened from `axis` on (W^T stored as-is when `transpose`).

    inner_product_param { num_output bias_term weight_filler bias_filler axis transpose }, and
    Intel's fused ReLU { relu negative_slope } (FusedOutput). blobs: weights [num_output, K] ([K, num_output] when transpose), bias [num_output].
    """
    reshape_from_shapes = True
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.inner_product_param
        self.fused = FusedOutput.of(self, "inner_product_param")
        if p.num_output <= 0:
            raise self.error("inner_product_param.num_output", "must be positive", p.num_output)
        self.num_output, self.bias_term, self.transpose = p.num_output, p.bias_term, p.transpose
        axis = canonical_axis(self, p.axis, bottom[0].num_axes, "inner_product_param.axis")
        self.K = count_from(bottom[0].shape, axis)
        wshape = (self.K, self.num_output) if self.transpose else (self.num_output, self.K)
        specs = [(wshape, p.weight_filler)]
        if self.bias_term:
            specs.append(((self.num_output,), p.bias_filler))
        self.init_param_blobs(specs)
        self._column_buffers = {}          # _columns: (role, rows) -> buffer
        # run by net_rules.Int8Unit; the layer's own forward stays float32
        self.int8 = quantization.Int8(self) if quantization.quantized(
            self.param, self.phase, self.net_param, self.source) else None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        axis = canonical_axis(self, self.param.inner_product_param.axis, len(shape),
                              "inner_product_param.axis")
        if count_from(shape, axis) != self.K:
            raise self.error("bottom", f"input size from axis {axis} must be {self.K} (the weights' K)",
                             f"shape {_shape(shape)}", cls=ShapeError)
        self.M = count_from(shape, 0, axis)
        top[0].reshape(shape[:axis] + (self.num_output,))
        if self.fused is not None:
            self.fused.reshape(self, bottom, top)
        if getattr(self, "_chosen_for", None) != self.M:
            self._chosen_for = self.M
            self._choose(bottom, top)

    def _choose(self, bottom, top):
        """skinny_gemm or the BLAS for the forward and for the data gradient, each by
        measurement where both can run (autotune): which is faster depends on the vector width
        and the batch. The rule without measuring: skinny up to 4 vectors of batch items. On
        8-float vectors (Zen 3) skinny_gemm ran the forward 1.1-1.2x and the data gradient
        0.9-1.1x the BLAS's speed at batch 32, but 0.9-1.0x and 0.8x at 64, and 0.6-0.75x for
        the data gradient at 100 (AlexNet's fc6-8, the MNIST autoencoder's layers;
        benchmarks/bench_skinny.py); on 16-float vectors (Zen 4) fc6 at 64 1.5x."""
        self._skinny = {"forward": False, "data": False}
        if not self._skinny_fits():
            self.algorithm, self.tuning = "gemm", "only"
            return
        rule = "skinny" if self.M <= 4 * kernels.SKINNY_WIDTH else "gemm"
        passes = ["forward"]
        if self.phase == caffe_pb2.TRAIN and autotune.trial_propagate_down(self, bottom)[0]:
            passes.append("data")
        key = f"InnerProduct {self.M}x{self.K} -> {self.num_output}"
        x = bottom[0].data.reshape(self.M, self.K)
        w = self.blobs[0].data
        names, tunings = {}, {}
        for name in passes:
            if name == "forward":
                a, src, dst = w, x, top[0].data.reshape(self.M, self.num_output)
            else:
                a, src = w.T, top[0].diff.reshape(self.M, self.num_output)
                dst = bottom[0].diff.reshape(self.M, self.K)
            trials = {"skinny": lambda: self._by_columns(a, src, dst),
                      "gemm": lambda: gemm_into(src, a.T, dst)}
            names[name] = autotune.choose(self, f"{key} {name}", trials, rule, nhwc_kernels.max_threads())
            tunings[name] = self.tuning
            self._skinny[name] = names[name] == "skinny"
        self.algorithm, self.tuning = autotune.describe(names, tunings)

    def operand(self, role, a):
        """A GEMM operand as the GEMM reads it (role "w" the weights, "x" the bottom's data,
        "dy" the top's diff): itself; layers/bf16.py's variant rounds it to bf16."""
        return a

    def product(self, a, b, c, beta=0.0):
        """c = a @ b + beta c (beta 0 or 1): the BLAS; layers/bf16.py's variant runs it in bf16."""
        gemm_into(a, b, c, beta)

    def forward(self, bottom, top):
        x = self.operand("x", bottom[0].data.reshape(self.M, self.K))
        y = top[0].data.reshape(self.M, self.num_output)
        w = self.operand("w", self.blobs[0].data)
        if self._skinny["forward"]:
            self._by_columns(w, x, y)
        else:
            self.product(x, w if self.transpose else w.T, y)
        if self.bias_term:
            y += self.blobs[1].data
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if self.fused is not None:
            top, propagate_down, bottom = self.fused.backward(top, propagate_down, bottom)
        dy = self.operand("dy", top[0].diff.reshape(self.M, self.num_output))
        if param_wanted(self, 0):
            x = self.operand("x", bottom[0].data.reshape(self.M, self.K))
            if self.transpose:
                self.product(x.T, dy, self.blobs[0].diff, 1.0)     # dW[K, N] += x^T dy
            else:
                self.product(dy.T, x, self.blobs[0].diff, 1.0)     # dW[N, K] += dy^T x
        if self.bias_term and param_wanted(self, 1):
            self.blobs[1].diff[...] += dy.sum(axis=0)
        if propagate_down[0]:
            w = self.operand("w", self.blobs[0].data)
            dx = bottom[0].diff.reshape(self.M, self.K)
            if self._skinny["data"]:
                self._by_columns(w.T, dy, dx)
            else:
                self.product(dy, w.T if self.transpose else w, dx)

    def _skinny_fits(self):
        """Whether skinny_gemm may run: a small batch against many outputs and inputs, from 8
        items on (below that the kernel's columns are mostly padding: LeNet's ip1 at b2 took 4x
        the BLAS's time) or whenever W is large enough that reading it is the cost (AlexNet's
        fc6 at b1 1.6x faster; benchmarks/bench_skinny.py)."""
        return (not self.transpose and 4 * self.M <= min(self.num_output, self.K)
                and (self.M >= 8 or self.num_output * self.K >= 1 << 24))

    def _by_columns(self, a, x, y):
        """y [M, n] = x [M, k] a^T for a [n, k] as y^T = a x^T, one batch item a column
        (cext/common_skinny.h: AlexNet's fc6 at b64 1.5x the BLAS's speed, forward and back)."""
        xt = self._columns("in", x.shape[1])
        yt = self._columns("out", y.shape[1])
        # reverse_axes moves whole cache lines: NumPy's copy of fc6's x.T took 1.6 ms, it 0.2
        nhwc_kernels.reverse_axes(x[:, None, :], xt[:, None, :self.M])
        kernels.skinny_gemm(a, xt, yt)
        nhwc_kernels.reverse_axes(yt[:, None, :self.M], y[:, None, :])

    def _columns(self, role, rows):
        """A [rows, M padded to the kernel's width] buffer, cached per role and size; its
        padding columns stay zero."""
        width = -(-self.M // kernels.SKINNY_WIDTH) * kernels.SKINNY_WIDTH
        buf = self._column_buffers.get((role, rows))
        if buf is None or buf.shape[1] != width:
            buf = self._column_buffers[(role, rows)] = np.zeros((rows, width), np.float32)
        return buf


def _legacy_axis(layer, p, legacy, field):
    """`axis`, or the deprecated non-negative `<legacy>` field (never both)."""
    if p.HasField(legacy):
        if p.HasField("axis"):
            raise layer.error(field, f"set either axis or {legacy}, not both",
                              f"axis {p.axis}, {legacy} {getattr(p, legacy)}")
        return getattr(p, legacy)
    return p.axis


def refuse_concat_fusion(layer):
    """Intel's per_fla_fuse (the bottoms' Permute + Flatten done by the concat) runs in the plain
    Concat alone; the layout-specific ones are not chosen for it or refuse it."""
    if layer.param.concat_param.per_fla_fuse:
        raise layer.error("concat_param.per_fla_fuse", "the fused Permute + Flatten (Intel Caffe int8 "
                          "SSD) is not supported", True, hint="Use Permute and Flatten layers before "
                          "the Concat")


@register
class Concat(Layer):
    """Join the bottoms along `axis`; all other dimensions must agree.

    concat_param { axis (or legacy concat_dim), per_fla_fuse }. Intel's per_fla_fuse on axis 1
    (its int8 SSD nets feed the heads' convolutions straight in) joins each bottom as
    Permute (0, 2, 3, 1) + Flatten would give it: the top is (N, sum of C*H*W, 1, 1), each
    bottom's values in H, W, C order; bottoms need agree on N alone. On other axes Intel ignores it.
    """
    reshape_from_shapes = True
    min_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        self._axis = _legacy_axis(self, self.param.concat_param, "concat_dim", "concat_param")

    def reshape(self, bottom, top):
        first = bottom[0].shape
        self.axis = canonical_axis(self, self._axis, len(first), "concat_param.axis")
        self.channels_last = self.param.concat_param.per_fla_fuse and self.axis == 1
        if self.channels_last:
            for i, b in enumerate(bottom):
                if len(b.shape) != len(first) or b.shape[0] != first[0]:
                    raise self.error(f"bottom[{i}]", f"per_fla_fuse needs {len(first)} axes and "
                                     f"bottom[0]'s {first[0]} items", _shape(b.shape), cls=ShapeError)
            total = sum(int(np.prod(b.shape[1:])) for b in bottom)
            top[0].reshape((first[0], total) + (1,) * (len(first) - 2))
            return
        total = 0
        for i, b in enumerate(bottom):
            s = b.shape
            if len(s) != len(first) or s[:self.axis] + s[self.axis + 1:] != \
                    first[:self.axis] + first[self.axis + 1:]:
                raise self.error(f"bottom[{i}]", f"shape must match bottom[0] ({_shape(first)}) except on "
                                 f"axis {self.axis}", _shape(s), cls=ShapeError)
            total += s[self.axis]
        top[0].reshape(first[:self.axis] + (total,) + first[self.axis + 1:])

    def forward(self, bottom, top):
        if self.channels_last:
            n = top[0].shape[0]
            np.concatenate([np.moveaxis(b.data, 1, -1).reshape(n, -1) for b in bottom], axis=1,
                           out=top[0].data.reshape(n, -1))
            return
        np.concatenate([b.data for b in bottom], axis=self.axis, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if self.channels_last:
            diff, lo = top[0].diff.reshape(top[0].shape[0], -1), 0
            for b, down in zip(bottom, propagate_down):
                hi = lo + b.count // b.shape[0]
                if down:
                    last = (b.shape[0],) + b.shape[2:] + (b.shape[1],)
                    b.diff[...] = np.moveaxis(diff[:, lo:hi].reshape(last), -1, 1)
                lo = hi
            return
        lo = 0
        index = [slice(None)] * top[0].num_axes
        for b, down in zip(bottom, propagate_down):
            hi = lo + b.shape[self.axis]
            if down:
                index[self.axis] = slice(lo, hi)
                b.diff[...] = top[0].diff[tuple(index)]
            lo = hi


@register
class Slice(Layer):
    """Cut the bottom along `axis` at `slice_point`s (or into equal parts when none).

    slice_param { axis (or legacy slice_dim), slice_point }
    """
    exact_bottoms = 1
    min_tops = 1

    def setup(self, bottom, top):
        p = self.param.slice_param
        self._axis = _legacy_axis(self, p, "slice_dim", "slice_param")
        self.points = [int(v) for v in p.slice_point]
        if self.points and len(self.points) != len(top) - 1:
            raise self.error("slice_param.slice_point", f"needs one point fewer than tops ({len(top)})",
                             self.points)
        if any(b <= a for a, b in zip([0] + self.points, self.points)):
            raise self.error("slice_param.slice_point", "must be positive and strictly increasing",
                             self.points)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        self.axis = canonical_axis(self, self._axis, len(shape), "slice_param.axis")
        dim = shape[self.axis]
        if self.points:
            if self.points[-1] >= dim:
                raise self.error("slice_param.slice_point", f"must lie inside axis {self.axis} of size "
                                 f"{dim}", self.points, cls=ShapeError)
            bounds = [0] + self.points + [dim]
        else:
            if dim % len(top):
                raise self.error("bottom", f"axis {self.axis} of size {dim} does not split evenly into "
                                 f"{len(top)} tops", _shape(shape), "Give slice_point", ShapeError)
            step = dim // len(top)
            bounds = list(range(0, dim + 1, step))
        self.bounds = list(zip(bounds[:-1], bounds[1:]))
        for t, (lo, hi) in zip(top, self.bounds):
            t.reshape(shape[:self.axis] + (hi - lo,) + shape[self.axis + 1:])

    def _index(self, lo, hi, ndim):
        index = [slice(None)] * ndim
        index[self.axis] = slice(lo, hi)
        return tuple(index)

    def forward(self, bottom, top):
        x = bottom[0].data
        for t, (lo, hi) in zip(top, self.bounds):
            t.data[...] = x[self._index(lo, hi, x.ndim)]

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        for t, (lo, hi) in zip(top, self.bounds):
            dx[self._index(lo, hi, dx.ndim)] = t.diff


@register
class Eltwise(Layer):
    """Elementwise over same-shaped bottoms: PROD, SUM (with per-bottom coeff) or MAX.

    eltwise_param { operation coeff stable_prod_grad }. MAX ties go where Caffe sends them
    (bottom[1] over bottom[0], then the earliest).
    """
    reshape_from_shapes = True
    min_bottoms = 2
    exact_tops = 1
    layout = ANY
    fuses = frozenset({"Eltwise+ReLU(+Split)", "Convolution+BatchNorm(+Scale)+Eltwise+ReLU(+Split)"})
    PROD, SUM, MAX = caffe_pb2.EltwiseParameter.PROD, caffe_pb2.EltwiseParameter.SUM, \
        caffe_pb2.EltwiseParameter.MAX

    def setup(self, bottom, top):
        p = self.param.eltwise_param
        self.op = p.operation
        self.coeff = [float(c) for c in p.coeff]
        if self.coeff and self.op != self.SUM:
            raise self.error("eltwise_param.coeff", "only SUM takes coefficients", self.coeff)
        if self.coeff and len(self.coeff) != len(bottom):
            raise self.error("eltwise_param.coeff", f"needs one value per bottom ({len(bottom)})",
                             self.coeff)
        self.coeff = self.coeff or [1.0] * len(bottom)
        self.stable = p.stable_prod_grad

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != shape:
                raise self.error(f"bottom[{i}]", f"shape must match bottom[0] ({_shape(shape)})",
                                 _shape(b.shape), cls=ShapeError)
        top[0].reshape(shape)
        if self.op == self.MAX and getattr(self, "mask", np.zeros(0)).shape != shape:
            self.mask = np.zeros(shape, np.int32)

    def forward(self, bottom, top):
        y = top[0].data
        xs = [b.data for b in bottom]
        if self.op == self.SUM and self.coeff == [1.0, 1.0] and _one_layout(bottom + top):
            kernels.add(bottom[0].raw_data.reshape(-1), bottom[1].raw_data.reshape(-1),
                        top[0].raw_data.reshape(-1))       # ResNet's shortcut sum, threaded
        elif self.op == self.SUM:
            if self.coeff[0] == 1 and self.coeff[1] == 1:
                np.add(xs[0], xs[1], out=y)
                rest = 2
            else:
                np.multiply(xs[0], np.float32(self.coeff[0]), out=y)
                rest = 1
            for x, c in zip(xs[rest:], self.coeff[rest:]):
                if c == 1:
                    y += x
                else:
                    y += np.float32(c) * x
        elif self.op == self.PROD:
            np.multiply(xs[0], xs[1], out=y)
            for x in xs[2:]:
                y *= x
        else:
            np.copyto(self.mask, ~(xs[0] > xs[1]))      # bottom[1] wins a tie with bottom[0]
            np.maximum(xs[0], xs[1], out=y)
            for i, x in enumerate(xs[2:], 2):
                greater = x > y
                np.putmask(self.mask, greater, i)
                np.maximum(y, x, out=y)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        for i, (b, down) in enumerate(zip(bottom, propagate_down)):
            if not down:
                continue
            dx = b.diff
            if self.op == self.SUM:
                if b.shares_diff(top[0]) and self.coeff[i] == 1:
                    continue                    # its diff is the top's (Net shares them)
                if self.coeff[i] == 1 and _one_layout([b, top[0]]):
                    kernels.copy(top[0].raw_diff.reshape(-1), b.raw_diff.reshape(-1))
                elif self.coeff[i] == 1:
                    np.copyto(dx, dy)
                else:
                    np.multiply(dy, np.float32(self.coeff[i]), out=dx)
            elif self.op == self.PROD:
                if self.stable:
                    others = [o.data for j, o in enumerate(bottom) if j != i]
                    np.multiply(dy, others[0], out=dx)
                    for o in others[1:]:
                        dx *= o
                else:
                    np.divide(top[0].data, b.data, out=dx)
                    dx *= dy
            else:
                np.multiply(dy, self.mask == i, out=dx)


    def fuses_relu(self, bottom, top):
        """Whether a ReLU in place on the top can run with this layer as one unit
        (caffepy/net_rules.py): ResNet's shortcut, the SUM of two bottoms with coefficients 1, stored in one layout."""
        return self.op == self.SUM and self.coeff == [1.0, 1.0] and _one_layout(bottom + top)

    def forward_with_relu(self, bottom, top, relu):
        """This layer's forward and that of `relu` (in place on the top) in one pass."""
        neuron_kernels.sum_relu_forward(bottom[0].raw_data.reshape(-1),
                                        bottom[1].raw_data.reshape(-1),
                                        top[0].raw_data.reshape(-1), relu.slope)

    def backward_with_relu(self, top, relu, split_tops, propagate_down, bottom):
        """The backward of `relu` (in place on the top), then of this layer, and first of the
        Split whose tops are `split_tops` if given (it shares the top's data), in one pass: the
        top's diff gets the ReLU's gradient of the summed split diffs (or of the top's own
        diff), and each bottom that wants it a copy (coefficients 1), but a bottom whose diff is
        the top's (net_rules.EltwiseReLU.shortcut_bottom), which holds it already."""
        flat = [b.raw_diff.reshape(-1) for b in split_tops]
        d = top[0].raw_diff.reshape(-1)
        outs = [b.raw_diff.reshape(-1) for b, down in zip(bottom, propagate_down)
                if down and not b.shares_diff(top[0])]      # a shared one already holds d
        neuron_kernels.sum_relu_backward(top[0].raw_data.reshape(-1), flat[0] if flat else d,
                                         flat[1] if flat else None, d, outs, relu.slope)


def _one_layout(blobs):
    """The blobs store their values in one layout (so elementwise work can run on them as
    stored, flat)."""
    return all(b.layout == blobs[0].layout and b.raw_data.shape == blobs[0].raw_data.shape
               for b in blobs)


def _no_in_place(layer, bottom, top):
    if top[0] is bottom[0]:
        raise layer.error("top", "cannot be computed in place (the top is a view with another shape)",
                          f"'{layer.param.top[0]}'", "Give the top its own name")


@register
class Flatten(Layer):
    """Merge axes axis..end_axis into one; the top is a view of the bottom (no copy).

    flatten_param { axis end_axis }
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        _no_in_place(self, bottom, top)

    def reshape(self, bottom, top):
        p = self.param.flatten_param
        shape = bottom[0].shape
        start = canonical_axis(self, p.axis, len(shape), "flatten_param.axis")
        end = canonical_axis(self, p.end_axis, len(shape), "flatten_param.end_axis")
        if end < start:
            raise self.error("flatten_param.end_axis", f"must not come before axis ({start})", end)
        top[0].reshape(shape[:start] + (count_from(shape, start, end + 1),) + shape[end + 1:])
        # shared from the reshape on, not only from the forward on: a net that shares its
        # activations' memory plans it before the first forward, by buffer (net_memory.py)
        top[0].share_data(bottom[0])

    def forward(self, bottom, top):
        top[0].share_data(bottom[0])

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].share_diff(top[0])


@register
class Reshape(Layer):
    """Give the bottom a new shape (a view, no copy): 0 copies the bottom's dimension, one -1
    is inferred; only axes [axis, axis + num_axes) are replaced.

    reshape_param { shape { dim } axis num_axes }
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        _no_in_place(self, bottom, top)
        p = self.param.reshape_param
        if p.pixelshuffler != 1:
            raise self.error("reshape_param.pixelshuffler", "the pixel shuffle (Intel Caffe) is not "
                             "supported", p.pixelshuffler)
        self.dims = [int(d) for d in p.shape.dim]
        if self.dims.count(-1) > 1:
            raise self.error("reshape_param.shape", "at most one dimension may be -1", self.dims)
        if any(d < -1 for d in self.dims):
            raise self.error("reshape_param.shape", "dimensions must be >= -1", self.dims)
        if p.num_axes < -1:
            raise self.error("reshape_param.num_axes", "must be >= 0, or -1 for all remaining axes",
                             p.num_axes)

    def reshape(self, bottom, top):
        p = self.param.reshape_param
        shape = bottom[0].shape
        start = p.axis if p.axis >= 0 else len(shape) + p.axis + 1
        if not 0 <= start <= len(shape):
            raise self.error("reshape_param.axis", f"out of range for a {len(shape)}-axis bottom", p.axis,
                             cls=ShapeError)
        end = len(shape) if p.num_axes == -1 else start + p.num_axes
        if end > len(shape):
            raise self.error("reshape_param.num_axes", f"reaches past the {len(shape)} axes of the bottom "
                             f"from axis {start}", p.num_axes, cls=ShapeError)
        new = []
        for i, d in enumerate(self.dims):
            if d == 0:
                if start + i >= len(shape):
                    raise self.error("reshape_param.shape", f"dim {i} is 0 (copy) but the bottom has no "
                                     f"axis {start + i}", self.dims, cls=ShapeError)
                d = shape[start + i]
            new.append(d)
        out = list(shape[:start]) + new + list(shape[end:])
        if -1 in out:
            known = int(np.prod([d for d in out if d != -1], dtype=np.int64))
            if known == 0 or bottom[0].count % known:
                raise self.error("reshape_param.shape", f"cannot infer -1: {bottom[0].count} values do not "
                                 f"divide by {known}", self.dims, cls=ShapeError)
            out[out.index(-1)] = bottom[0].count // known
        if int(np.prod(out, dtype=np.int64)) != bottom[0].count:
            raise self.error("reshape_param.shape", f"gives {_shape(out)}, which does not hold the "
                             f"{bottom[0].count} values of bottom {_shape(shape)}", self.dims, cls=ShapeError)
        top[0].reshape(out)
        top[0].share_data(bottom[0])        # from the reshape on, as Flatten's

    def forward(self, bottom, top):
        top[0].share_data(bottom[0])

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].share_diff(top[0])


class _Broadcast(Layer):
    """Shared shape logic of Scale and Bias: a blob that lines up with bottom[0] from `axis`
    (a learned parameter, or bottom[1]) and repeats over the outer and inner dimensions."""
    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1
    field = None
    reshape_from_shapes = True

    def learned_shape(self, bottom, p):
        shape = bottom[0].shape
        axis = canonical_axis(self, p.axis, len(shape), f"{self.field}.axis")
        if p.num_axes < -1:
            raise self.error(f"{self.field}.num_axes", "must be >= 0, or -1 for all remaining axes",
                             p.num_axes)
        if p.num_axes >= 0 and axis + p.num_axes > len(shape):
            raise self.error(f"{self.field}.num_axes", f"reaches past bottom[0] ({_shape(shape)}) from "
                             f"axis {axis}", p.num_axes, cls=ShapeError)
        return shape[axis:] if p.num_axes == -1 else shape[axis:axis + p.num_axes]

    def line_up(self, bottom, other, what):
        """(outer, dim, inner) of bottom[0] around `other`, checking the shapes agree."""
        shape = bottom[0].shape
        p = getattr(self.param, self.field)
        # a scalar lines up anywhere; Caffe puts it at axis 0
        axis = 0 if other.num_axes == 0 else canonical_axis(self, p.axis, len(shape), f"{self.field}.axis")
        if shape[axis:axis + other.num_axes] != other.shape:
            raise self.error(what, f"shape {_shape(other.shape)} does not match bottom[0] "
                             f"{_shape(shape)} from axis {axis}", _shape(other.shape), cls=ShapeError)
        return (count_from(shape, 0, axis), other.count, count_from(shape, axis + other.num_axes))

    def view3(self, a):
        return a.reshape(self.dims)


@register
class Scale(_Broadcast):
    """y = x * s (+ b), s lined up with x from `axis` and repeated over the other axes.

    scale_param { axis num_axes filler (default 1) bias_term bias_filler (default 0) }.
    One bottom: s is learned (blobs[0]); two bottoms: s is bottom[1]. bias_term adds a learned
    bias of s's shape as the last blob.
    """
    field = "scale_param"

    def setup(self, bottom, top):
        p = self.param.scale_param
        specs = []
        if len(bottom) == 1:
            shape = self.learned_shape(bottom, p)
            specs.append((shape, p.filler if p.HasField("filler") else constant_filler(1.0)))
        if p.bias_term:
            shape = bottom[1].shape if len(bottom) == 2 else specs[0][0]
            specs.append((shape, p.bias_filler))
        self.init_param_blobs(specs)
        self.bias_term = p.bias_term
        self._saved = None

    def _scale(self, bottom):
        return self.blobs[0] if len(bottom) == 1 else bottom[1]

    def reshape(self, bottom, top):
        self.dims = self.line_up(bottom, self._scale(bottom), "scale" if len(bottom) == 1 else "bottom[1]")
        if self.bias_term and self.blobs[-1].count != self.dims[1]:
            raise self.error("blobs", "the bias must have the scale's shape", self.blobs[-1].shape,
                             cls=ShapeError)
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        x = self.view3(bottom[0].data)
        saved = None
        if top[0] is bottom[0]:
            if self._saved is None or self._saved.size < x.size:
                self._saved = np.empty(x.size, np.float32)
            saved = self._saved[: x.size].reshape(self.dims)
        bias = self.blobs[-1].data.reshape(-1) if self.bias_term else None
        kernels.scale_forward(x, self._scale(bottom).data.reshape(-1), bias, self.view3(top[0].data), saved)

    def backward(self, top, propagate_down, bottom):
        scale = self._scale(bottom)
        learned = len(bottom) == 1
        want_scale = (learned and param_wanted(self, 0)) or (not learned and propagate_down[1])
        want_bias = self.bias_term and param_wanted(self, len(self.blobs) - 1)
        sums = np.zeros(self.dims[1], np.float64) if want_scale else None
        bias_sums = np.zeros(self.dims[1], np.float64) if want_bias else None
        x = self._saved[: bottom[0].count].reshape(self.dims) if top[0] is bottom[0] \
            else self.view3(bottom[0].data)
        dx = self.view3(bottom[0].diff) if propagate_down[0] else None
        kernels.scale_backward(x, self.view3(top[0].diff), scale.data.reshape(-1), dx, sums, bias_sums)
        if want_bias:
            self.blobs[-1].diff.reshape(-1)[...] += bias_sums
        if want_scale:
            if learned:
                scale.diff.reshape(-1)[...] += sums
            else:
                scale.diff.reshape(-1)[...] = sums


@register
class Bias(_Broadcast):
    """y = x + b, b lined up with x from `axis` and repeated over the other axes.

    bias_param { axis num_axes filler (default 0) }. One bottom: b is learned (blobs[0]);
    two bottoms: b is bottom[1].
    """
    field = "bias_param"

    def setup(self, bottom, top):
        if len(bottom) == 1:
            p = self.param.bias_param
            self.init_param_blobs([(self.learned_shape(bottom, p), p.filler)])

    def _bias(self, bottom):
        return self.blobs[0] if len(bottom) == 1 else bottom[1]

    def reshape(self, bottom, top):
        self.dims = self.line_up(bottom, self._bias(bottom), "bias" if len(bottom) == 1 else "bottom[1]")
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        np.add(self.view3(bottom[0].data), self._bias(bottom).data.reshape(1, -1, 1),
               out=self.view3(top[0].data))

    def backward(self, top, propagate_down, bottom):
        dy = self.view3(top[0].diff)
        bias = self._bias(bottom)
        learned = len(bottom) == 1
        if (learned and param_wanted(self, 0)) or (not learned and propagate_down[1]):
            grad = dy.sum(axis=(0, 2))
            if learned:
                bias.diff.reshape(-1)[...] += grad
            else:
                bias.diff.reshape(-1)[...] = grad
        if propagate_down[0] and bottom[0] is not top[0]:
            np.copyto(bottom[0].diff, top[0].diff)


@register
class Softmax(Layer):
    """y = exp(x - max) / sum exp(x - max) along `axis` (the max keeps exp from overflowing).

    softmax_param { axis }. Backward: dx = y * (dy - sum(dy * y)).
    """
    exact_bottoms = 1
    exact_tops = 1
    reshape_from_shapes = True

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        axis = canonical_axis(self, self.param.softmax_param.axis, len(shape), "softmax_param.axis")
        self.dims = (count_from(shape, 0, axis), shape[axis], count_from(shape, axis + 1))
        top[0].reshape(shape)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.dims)
        y = top[0].data.reshape(self.dims)
        peak = x.max(axis=1, keepdims=True)
        np.subtract(x, peak, out=y)
        np.exp(y, out=y)
        y /= y.sum(axis=1, keepdims=True)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data.reshape(self.dims)
        dy = top[0].diff.reshape(self.dims)
        dot = np.einsum("oci,oci->oi", dy, y)[:, None, :]
        dx = bottom[0].diff.reshape(self.dims)
        np.subtract(dy, dot, out=dx)
        dx *= y


@register
class ArgMax(Layer):
    """The top_k largest values' indices (and values with out_max_val) per item, or along `axis`.

    argmax_param { out_max_val top_k axis }. Without axis each item (axis 0) is searched over
    all its values and the top is (N, 1 or 2, top_k); with axis the top keeps the bottom's
    shape with top_k on that axis and holds values if out_max_val else indices. Ties rank the
    later index first, as Caffe's sort does. No gradient.
    """
    exact_bottoms = 1
    exact_tops = 1
    differentiable = False

    def setup(self, bottom, top):
        p = self.param.argmax_param
        if p.top_k < 1:
            raise self.error("argmax_param.top_k", "must be at least 1", p.top_k)

    def reshape(self, bottom, top):
        p = self.param.argmax_param
        shape = bottom[0].shape
        if p.HasField("axis"):
            axis = canonical_axis(self, p.axis, len(shape), "argmax_param.axis")
            self.dims = (count_from(shape, 0, axis), shape[axis], count_from(shape, axis + 1))
            out = shape[:axis] + (p.top_k,) + shape[axis + 1:]
        else:
            self.dims = (shape[0] if shape else 1, count_from(shape, 1), 1)
            out = [1] * max(3, len(shape))
            out[0], out[1], out[2] = self.dims[0], 2 if p.out_max_val else 1, p.top_k
        if p.top_k > self.dims[1]:
            raise self.error("argmax_param.top_k", f"exceeds the {self.dims[1]} values searched", p.top_k,
                             cls=ShapeError)
        top[0].reshape(out)

    def forward(self, bottom, top):
        p = self.param.argmax_param
        k = p.top_k
        x = bottom[0].data.reshape(self.dims)
        dim = self.dims[1]
        # sort the reversed axis stably, largest first: equal values then rank the later index first
        if k == 1:
            order = dim - 1 - np.argmax(x[:, ::-1, :], axis=1)[:, None, :]
        else:
            order = dim - 1 - np.argsort(-x[:, ::-1, :], axis=1, kind="stable")[:, :k, :]
        values = np.take_along_axis(x, order, axis=1)
        if p.HasField("axis"):
            top[0].data.reshape(self.dims[0], k, self.dims[2])[...] = values if p.out_max_val else order
        else:
            y = top[0].data.reshape(self.dims[0], -1, k)
            y[:, 0, :] = order[:, :, 0]
            if p.out_max_val:
                y[:, 1, :] = values[:, :, 0]


@register
class Tile(Layer):
    """Repeat the bottom `tiles` times along `axis` (the whole block from axis on is repeated).

    tile_param { axis tiles }. Backward sums the copies.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        if self.param.tile_param.tiles < 1:
            raise self.error("tile_param.tiles", "must be at least 1", self.param.tile_param.tiles)

    def reshape(self, bottom, top):
        p = self.param.tile_param
        shape = bottom[0].shape
        axis = canonical_axis(self, p.axis, len(shape), "tile_param.axis")
        self.dims = (count_from(shape, 0, axis), p.tiles, count_from(shape, axis))
        top[0].reshape(shape[:axis] + (shape[axis] * p.tiles,) + shape[axis + 1:])

    def forward(self, bottom, top):
        outer, _, inner = self.dims
        top[0].data.reshape(self.dims)[...] = bottom[0].data.reshape(outer, 1, inner)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            outer, _, inner = self.dims
            top[0].diff.reshape(self.dims).sum(axis=1, out=bottom[0].diff.reshape(outer, inner))


@register
class Embed(Layer):
    """A lookup table: y[..., :] = W[index] (+ b) for every integer index in the bottom.

    embed_param { num_output input_dim bias_term weight_filler bias_filler }.
    blobs: W [input_dim, num_output], b [num_output]. No gradient to the indices.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.embed_param
        if p.num_output <= 0:
            raise self.error("embed_param.num_output", "must be positive", p.num_output)
        if p.input_dim <= 0:
            raise self.error("embed_param.input_dim", "must be positive", p.input_dim)
        self.num_output, self.input_dim, self.bias_term = p.num_output, p.input_dim, p.bias_term
        specs = [((self.input_dim, self.num_output), p.weight_filler)]
        if self.bias_term:
            specs.append(((self.num_output,), p.bias_filler))
        self.init_param_blobs(specs)

    def allow_force_backward(self, bottom_index):
        return False

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def _indices(self, bottom):
        x = bottom[0].data.reshape(-1)
        index = x.astype(np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.input_dim or np.any(index != x)):
            bad = x[(index < 0) | (index >= self.input_dim) | (index != x)][0]
            raise self.error("bottom", f"indices must be integers in [0, {self.input_dim})", float(bad),
                             cls=ShapeError)
        return index

    def forward(self, bottom, top):
        self.index = self._indices(bottom)
        y = top[0].data.reshape(-1, self.num_output)
        np.take(self.blobs[0].data, self.index, axis=0, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(-1, self.num_output)
        if param_wanted(self, 0):
            np.add.at(self.blobs[0].diff, self.index, dy)
        if self.bias_term and param_wanted(self, 1):
            self.blobs[1].diff[...] += dy.sum(axis=0)


@register
class Silence(Layer):
    """Consume bottoms so they are not net outputs; backward gives them zero gradient."""
    min_bottoms = 1
    exact_tops = 0
    layout = ANY

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff[...] = 0


@register
class Reduction(Layer):
    """Reduce every axis from `axis` on to one number: SUM, ASUM (sum |x|), SUMSQ (sum x^2) or
    MEAN, times `coeff`.  reduction_param { operation axis coeff }. The top has the bottom's
    first `axis` dimensions (a scalar for axis 0).
    """
    exact_bottoms = 1
    exact_tops = 1
    Op = caffe_pb2.ReductionParameter

    def setup(self, bottom, top):
        self.op = self.param.reduction_param.operation
        self.coeff = float(self.param.reduction_param.coeff)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        axis = canonical_axis(self, self.param.reduction_param.axis, len(shape), "reduction_param.axis") \
            if shape else 0
        self.dims = (count_from(shape, 0, axis), count_from(shape, axis))
        top[0].reshape(shape[:axis])

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.dims)
        y = top[0].data.reshape(-1)
        if self.op == self.Op.ASUM:
            np.abs(x).sum(axis=1, out=y)
        elif self.op == self.Op.SUMSQ:
            np.einsum("ij,ij->i", x, x, out=y)
        else:
            x.sum(axis=1, out=y)
        factor = self.coeff / self.dims[1] if self.op == self.Op.MEAN and self.dims[1] else self.coeff
        if factor != 1:
            y *= np.float32(factor)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(-1, 1)
        dx = bottom[0].diff.reshape(self.dims)
        x = bottom[0].data.reshape(self.dims)
        if self.op == self.Op.ASUM:
            np.sign(x, out=dx)
            dx *= dy
        elif self.op == self.Op.SUMSQ:
            np.multiply(x, dy, out=dx)
            dx *= np.float32(2)
        else:
            dx[...] = dy
        factor = self.coeff / self.dims[1] if self.op == self.Op.MEAN and self.dims[1] else self.coeff
        if factor != 1:
            dx *= np.float32(factor)


@register
class BatchReindex(Layer):
    """top[i] = bottom[0][indices[i]]: pick (and repeat or reorder) items of the batch.

    Bottoms: data (N x ...), indices (M values in [0, N)); top M x .... Backward sums the
    diffs of an item picked several times; no gradient to the indices.
    """
    exact_bottoms = 2
    exact_tops = 1

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def reshape(self, bottom, top):
        if bottom[1].num_axes != 1:
            raise self.error("bottom[1]", "the indices must be a 1-axis blob", bottom[1].shape, cls=ShapeError)
        if bottom[0].num_axes < 1:
            raise self.error("bottom[0]", "needs a batch axis", bottom[0].shape, cls=ShapeError)
        top[0].reshape(bottom[1].shape + bottom[0].shape[1:])

    def _indices(self, bottom):
        values = bottom[1].data
        n = bottom[0].shape[0]
        bad = (values < 0) | (values >= n)
        if np.any(bad):
            raise self.error("bottom[1]", f"indices must lie in [0, {n}) (the batch of bottom[0])",
                             float(values[bad][0]), cls=ShapeError)
        return values.astype(np.int64)      # Caffe truncates

    def forward(self, bottom, top):
        self.index = self._indices(bottom)
        np.take(bottom[0].data, self.index, axis=0, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            diff = bottom[0].diff
            diff[...] = 0
            np.add.at(diff, self.index, top[0].diff)
        if propagate_down[1]:
            bottom[1].diff[...] = 0


@register
class Filter(Layer):
    """Keep the items whose selector is non-zero: bottoms b_1 .. b_K and a selector (N, or
    N x 1 x ...); tops t_1 .. t_K hold the selected items of each b_k, in order.

    Until the first forward (when the selector is not known yet) the tops keep all N items,
    as in Caffe. Backward gives unselected items zero gradient; none to the selector.
    """
    min_bottoms = 2
    min_tops = 1

    def setup(self, bottom, top):
        if len(top) != len(bottom) - 1:
            raise self.error("top", f"needs one top per filtered bottom ({len(bottom) - 1})", len(top))
        self.first = True

    def allow_force_backward(self, bottom_index):
        return bottom_index != self.selector_index

    @property
    def selector_index(self):
        return len(self.param.bottom) - 1

    def reshape(self, bottom, top):
        selector = bottom[-1]
        if selector.num_axes < 1 or any(d != 1 for d in selector.shape[1:]):
            raise self.error(f"bottom[{len(bottom) - 1}]", "the selector must be N or N x 1 x ... (one "
                             "value per item)", selector.shape, cls=ShapeError)
        n = selector.shape[0]
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes < 1 or b.shape[0] != n:
                raise self.error(f"bottom[{i}]", f"needs the selector's {n} items on axis 0", b.shape,
                                 cls=ShapeError)
        self.selected = np.flatnonzero(selector.data.reshape(n))
        kept = n if self.first else self.selected.size
        self.first = False
        for t, b in zip(top, bottom):
            t.reshape((kept,) + b.shape[1:])

    def forward(self, bottom, top):
        for t, b in zip(top, bottom):
            np.take(b.data, self.selected, axis=0, out=t.data)

    def backward(self, top, propagate_down, bottom):
        for i, (t, b) in enumerate(zip(top, bottom)):
            if propagate_down[i]:
                diff = b.diff
                diff[...] = 0
                diff[self.selected] = t.diff
        if propagate_down[-1]:
            bottom[-1].diff[...] = 0


@register
class Parameter(Layer):
    """A learned blob as a layer's output: top = blobs[0], of parameter_param.shape (zeros
    until trained or loaded, as in Caffe). Backward accumulates the top's diff into the
    blob's."""
    exact_bottoms = 0
    exact_tops = 1

    def setup(self, bottom, top):
        shape = tuple(self.param.parameter_param.shape.dim)
        self.init_param_blobs([(shape, constant_filler(0.0))])
        top[0].reshape(self.blobs[0].shape)

    def reshape(self, bottom, top):
        top[0].reshape(self.blobs[0].shape)

    def forward(self, bottom, top):
        top[0].share_data(self.blobs[0])

    def backward(self, top, propagate_down, bottom):
        if param_wanted(self, 0):
            self.blobs[0].diff[...] += top[0].diff
