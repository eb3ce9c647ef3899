"""Neuron layers: one bottom, one top of the same shape, elementwise (PReLU: per channel).

ReLU, PReLU, ELU, Sigmoid, TanH, AbsVal, Power, Exp, Log, BNLL, Threshold, Dropout, Clip, Swish.

Every neuron layer runs in place (bottom and top the same Blob, as Caffe's prototxts do for
ReLU and Dropout). Backward reads the top where Caffe does (Sigmoid, TanH, Exp, ELU, ReLU: the
sign of y is the sign of x); layers whose backward needs x itself (`keeps_input`) copy it aside
before an in-place forward overwrites it.
"""
import numpy as np

from .. import rng
from ..blob import CHANNELS_LAST
from ..kernels import neuron as kernels
from ..layer import ANY, Layer, register
from ..proto import caffe_pb2
from .common import constant_filler, param_wanted


class Neuron(Layer):
    """Base: shape the top like the bottom; keep x aside for in-place layers that need it."""
    exact_bottoms = 1
    exact_tops = 1
    layout = ANY
    keeps_input = False
    _saved = None     # the input of an in-place forward, for `keeps_input` layers
    reshape_from_shapes = True

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        # the arrays in memory order (raw_data): elementwise work is the same in any layout
        x = bottom[0].raw_data.reshape(-1)
        if top[0] is bottom[0] and self.keeps_input:
            if self._saved is None or self._saved.size < x.size:
                self._saved = np.empty(x.size, np.float32)
            np.copyto(self._saved[: x.size], x)
        self.compute(x, top[0].raw_data.reshape(-1))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].raw_data.reshape(-1)
        x = self._saved[: y.size] if top[0] is bottom[0] and self.keeps_input \
            else bottom[0].raw_data.reshape(-1)
        self.gradient(x, y, top[0].raw_diff.reshape(-1), bottom[0].raw_diff.reshape(-1))

    def compute(self, x, y):
        """y = f(x) on flat arrays (y may be x)."""
        raise NotImplementedError

    def gradient(self, x, y, dy, dx):
        """dx = f'(x) * dy on flat arrays (dx may be dy; x may be y when `keeps_input` is off)."""
        raise NotImplementedError


@register
class ReLU(Neuron):
    """y = max(x, 0) + negative_slope * min(x, 0).  relu_param { negative_slope }"""

    def setup(self, bottom, top):
        if self.param.relu_param.fuse:
            # Intel's compiler marks a ReLU it fused into the layer before (its forward then
            # passes its input on); run as a ReLU it would change nothing at slope 0 but apply a
            # leaky slope twice, and without the fused layer it would not be Intel's identity
            raise self.error("relu_param.fuse", "is Intel Caffe's internal mark of a ReLU its "
                             "compiler fused into the layer before; caffepy does not run it", True,
                             hint="Remove it, and give the layer before relu: true or keep this ReLU")
        self.slope = float(self.param.relu_param.negative_slope)
        # in place with a negative slope, the sign of y no longer tells the sign of x
        self.keeps_input = self.slope < 0

    def compute(self, x, y):
        kernels.relu_forward(x, y, self.slope)

    def gradient(self, x, y, dy, dx):
        kernels.relu_backward(x, dy, dx, self.slope)


@register
class PReLU(Layer):
    """y = max(x, 0) + a_c * min(x, 0) with a learned slope a per channel (axis 1) or shared.

    prelu_param { filler (default constant 0.25), channel_shared }. blobs[0]: slopes, shape
    [channels] or [] when shared.
    """
    exact_bottoms = 1
    exact_tops = 1

    def setup(self, bottom, top):
        p = self.param.prelu_param
        if bottom[0].num_axes < 2:
            raise self.error("bottom", "needs at least 2 axes (channels on axis 1)", bottom[0].shape)
        self.shared = bool(p.channel_shared)
        channels = bottom[0].shape[1]
        filler = p.filler if p.HasField("filler") else constant_filler(0.25)
        self.init_param_blobs([((), filler) if self.shared else ((channels,), filler)])
        self._buffer = np.zeros(0, np.float32)
        self._saved = None        # x of an in-place forward (a view of _buffer)

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error("bottom", "needs at least 2 axes (channels on axis 1)", bottom[0].shape)
        if not self.shared and bottom[0].shape[1] != self.blobs[0].count:
            raise self.error("bottom", f"channels must match the {self.blobs[0].count} slopes",
                             bottom[0].shape[1])
        top[0].reshape(bottom[0].shape)

    def _slopes(self, channels):
        a = self.blobs[0].data.reshape(-1)
        return np.full(channels, a[0], np.float32) if self.shared else a

    def _view(self, a):
        return a.reshape(a.shape[0], a.shape[1], -1)

    def forward(self, bottom, top):
        x = self._view(bottom[0].data)
        if top[0] is bottom[0]:
            if self._buffer.size < x.size:
                self._buffer = np.empty(x.size, np.float32)
            self._saved = self._buffer[: x.size].reshape(x.shape)
            np.copyto(self._saved, x)
        kernels.prelu_forward(x, self._view(top[0].data), self._slopes(x.shape[1]))

    def backward(self, top, propagate_down, bottom):
        x = self._saved if top[0] is bottom[0] else self._view(bottom[0].data)
        want_slope = param_wanted(self, 0)
        sums = np.zeros(x.shape[1], np.float64) if want_slope else None
        dx = self._view(bottom[0].diff) if propagate_down[0] else None
        kernels.prelu_backward(x, self._view(top[0].diff), dx, self._slopes(x.shape[1]), sums)
        if want_slope:
            self.blobs[0].diff.reshape(-1)[...] += sums.sum() if self.shared else sums


@register
class ELU(Neuron):
    """y = x if x > 0 else alpha * (exp(x) - 1).  elu_param { alpha }"""

    def setup(self, bottom, top):
        self.alpha = float(self.param.elu_param.alpha)
        self.keeps_input = self.alpha < 0

    def compute(self, x, y):
        kernels.elu_forward(x, y, self.alpha)

    def gradient(self, x, y, dy, dx):
        kernels.elu_backward(x, y, dy, dx, self.alpha)


@register
class Sigmoid(Neuron):
    """y = 1 / (1 + exp(-x)); dy/dx = y (1 - y). The kernel's exp is clamped to finite values,
    so no |x| overflows."""

    def compute(self, x, y):
        kernels.sigmoid_forward(x, y)

    def gradient(self, x, y, dy, dx):
        kernels.sigmoid_backward(y, dy, dx)


@register
class TanH(Neuron):
    """y = tanh(x); dy/dx = 1 - y^2."""

    def compute(self, x, y):
        kernels.tanh_forward(x, y)

    def gradient(self, x, y, dy, dx):
        kernels.tanh_backward(y, dy, dx)


@register
class AbsVal(Neuron):
    """y = |x|; dy/dx = sign(x)."""
    keeps_input = True

    def compute(self, x, y):
        np.abs(x, out=y)

    def gradient(self, x, y, dy, dx):
        kernels.absval_backward(x, dy, dx)


@register
class Power(Neuron):
    """y = (shift + scale * x) ^ power.  power_param { power, scale, shift }"""
    keeps_input = True

    def setup(self, bottom, top):
        p = self.param.power_param
        self.power, self.scale, self.shift = float(p.power), float(p.scale), float(p.shift)

    def compute(self, x, y):
        if self.scale == 0 or self.power == 0:
            # a constant: Caffe fills (shift)^power, 1 when power is 0
            y[...] = 1.0 if self.power == 0 else self.shift ** self.power
            return
        np.multiply(x, np.float32(self.scale), out=y)
        if self.shift:
            y += np.float32(self.shift)
        if self.power != 1:
            # negative bases with fractional powers give NaN, as in Caffe, without a warning
            with np.errstate(invalid="ignore", divide="ignore"):
                np.power(y, np.float32(self.power), out=y)

    def gradient(self, x, y, dy, dx):
        diff_scale = self.power * self.scale
        if diff_scale == 0:
            dx[...] = 0
        elif self.power == 1:
            np.multiply(dy, np.float32(diff_scale), out=dx)
        else:
            # d/dx = power * scale * (shift + scale x)^(power - 1), from x so that zero bases
            # (y = 0) need no division
            base = x * np.float32(self.scale)
            if self.shift:
                base += np.float32(self.shift)
            if self.power != 2:
                with np.errstate(invalid="ignore", divide="ignore"):
                    np.power(base, np.float32(self.power - 1), out=base)
            base *= np.float32(diff_scale)
            np.multiply(dy, base, out=dx)


@register
class Exp(Neuron):
    """y = base ^ (shift + scale * x), base -1 meaning e.  exp_param { base, scale, shift }

    The kernel's exp saturates at ~2e38 where expf would give inf.
    """

    def setup(self, bottom, top):
        p = self.param.exp_param
        base = float(p.base)
        if base != -1 and base <= 0:
            raise self.error("exp_param.base", "must be positive, or -1 for e", base)
        log_base = 1.0 if base == -1 else np.log(base)
        self.inner_scale = log_base * float(p.scale)
        self.outer_scale = 1.0 if p.shift == 0 else np.exp(log_base * float(p.shift))

    def compute(self, x, y):
        np.multiply(x, np.float32(self.inner_scale), out=y)
        kernels.exp_forward(y, y)
        if self.outer_scale != 1:
            y *= np.float32(self.outer_scale)

    def gradient(self, x, y, dy, dx):
        np.multiply(dy, y, out=dx)
        dx *= np.float32(self.inner_scale)


@register
class Log(Neuron):
    """y = log_base(shift + scale * x), base -1 meaning e.  log_param { base, scale, shift }"""
    keeps_input = True

    def setup(self, bottom, top):
        p = self.param.log_param
        base = float(p.base)
        if base != -1 and base <= 0:
            raise self.error("log_param.base", "must be positive, or -1 for e", base)
        self.base_scale = 1.0 if base == -1 else 1.0 / np.log(base)
        self.scale, self.shift = float(p.scale), float(p.shift)

    def _inner(self, x, out):
        np.multiply(x, np.float32(self.scale), out=out)
        if self.shift:
            out += np.float32(self.shift)
        return out

    def compute(self, x, y):
        # log of 0 is -inf and of a negative NaN, as in Caffe, without a warning
        with np.errstate(invalid="ignore", divide="ignore"):
            np.log(self._inner(x, y), out=y)
        if self.base_scale != 1:
            y *= np.float32(self.base_scale)

    def gradient(self, x, y, dy, dx):
        inner = self._inner(x, np.empty_like(x))
        with np.errstate(invalid="ignore", divide="ignore"):
            np.divide(dy, inner, out=dx)
        dx *= np.float32(self.scale * self.base_scale)


@register
class BNLL(Neuron):
    """y = log(1 + exp(x)), the binomial normal log likelihood, overflow-free for large x.

    dy/dx = sigmoid(x) = 1 - exp(-y), so backward needs only the top.
    """

    def compute(self, x, y):
        np.logaddexp(np.float32(0), x, out=y)

    def gradient(self, x, y, dy, dx):
        sig = np.negative(y)
        np.expm1(sig, out=sig)
        np.multiply(dy, sig, out=dx)
        np.negative(dx, out=dx)


@register
class Threshold(Neuron):
    """y = 1 if x > threshold else 0.  threshold_param { threshold }. No gradient (as Caffe)."""
    differentiable = False

    def setup(self, bottom, top):
        self.threshold = np.float32(self.param.threshold_param.threshold)

    def compute(self, x, y):
        np.greater(x, self.threshold, out=y, casting="unsafe")

    def allow_force_backward(self, bottom_index):
        return False

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise self.error("propagate_down", "Threshold has no gradient", list(propagate_down),
                             hint="add propagate_down: false to this layer")


@register
class Dropout(Neuron):
    """TRAIN: y = x * mask / (1 - ratio), mask ~ Bernoulli(1 - ratio); TEST: y = x.

    dropout_param { dropout_ratio }. The mask comes from caffepy.rng, drawn in Caffe's (N, C, H,
    W) order whatever the blob's layout, so a seeded run drops the same values on the fast path
    and with engine CAFFE (and `caffepy compare` can set one against the other).
    """

    def setup(self, bottom, top):
        self.ratio = float(self.param.dropout_param.dropout_ratio)
        if not 0 <= self.ratio < 1:
            raise self.error("dropout_param.dropout_ratio", "must be in [0, 1)", self.ratio)
        self.scale = 1.0 / (1.0 - self.ratio)
        self.train = self.phase == caffe_pb2.TRAIN
        self._mask = np.zeros(0, np.float32)

    def forward(self, bottom, top):
        if self.train:
            x = bottom[0]
            if self._mask.size < x.count:
                self._mask = np.empty(x.count, np.float32)
            mask = self._mask[: x.count]
            if x.layout == CHANNELS_LAST:
                n, c, h, w = x.shape
                mask.reshape(n, h, w, c)[...] = rng.generator().random((n, c, h, w), np.float32).transpose(0, 2, 3, 1)
            else:
                rng.generator().random(out=mask, dtype=np.float32)
        super().forward(bottom, top)

    def compute(self, x, y):
        if not self.train:
            if not np.may_share_memory(x, y):
                np.copyto(y, x)
            return
        kernels.dropout_forward(x, self._mask[: x.size], y, self.ratio, self.scale)

    def gradient(self, x, y, dy, dx):
        if self.train:
            np.multiply(dy, self._mask[: dy.size], out=dx)
        elif not np.may_share_memory(dx, dy):
            np.copyto(dx, dy)


@register
class Clip(Neuron):
    """y = min(max(x, min), max); gradient 1 inside [min, max], 0 outside.  clip_param { min max }"""
    keeps_input = True

    def setup(self, bottom, top):
        p = self.param.clip_param
        self.lo, self.hi = np.float32(p.min), np.float32(p.max)
        if self.lo > self.hi:
            raise self.error("clip_param", "min must not exceed max", f"min {p.min}, max {p.max}")

    def compute(self, x, y):
        np.clip(x, self.lo, self.hi, out=y)

    def gradient(self, x, y, dy, dx):
        kernels.clip_backward(x, dy, dx, self.lo, self.hi)


@register
class Swish(Neuron):
    """y = x * sigmoid(beta * x).  swish_param { beta }

    dy/dx = beta y + s (1 - beta y) with s = sigmoid(beta x), kept from forward.
    """

    def setup(self, bottom, top):
        self.beta = float(self.param.swish_param.beta)
        self._sig = np.zeros(0, np.float32)

    def compute(self, x, y):
        if self._sig.size < x.size:
            self._sig = np.empty(x.size, np.float32)
        kernels.swish_forward(x, self._sig[: x.size], y, self.beta)

    def gradient(self, x, y, dy, dx):
        kernels.swish_backward(y, self._sig[: y.size], dy, dx, self.beta)
