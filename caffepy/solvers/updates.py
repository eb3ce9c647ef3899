"""Update rules keyed by SolverParameter.type, with Caffe's exact formulas.

Each rule turns a parameter's gradient g (already normalized by iter_size and
regularized) into the step that is subtracted from the weights, in place in g:

    SGD       h = momentum * h + lr * g                     step = h
    Nesterov  h' = momentum * h + lr * g                    step = (1 + momentum) * h' - momentum * h
    AdaGrad   h += g^2                                      step = lr * g / (sqrt(h) + delta)
    RMSProp   h = rms_decay * h + (1 - rms_decay) * g^2     step = lr * g / (sqrt(h) + delta)
    AdaDelta  h = momentum * h + (1 - momentum) * g^2
              u = g * sqrt((h2 + delta) / (h + delta))
              h2 = momentum * h2 + (1 - momentum) * u^2     step = lr * u
    Adam      m = beta1 * m + (1 - beta1) * g,  v = beta2 * v + (1 - beta2) * g^2
              step = lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + delta),  t = iter + 1
              (beta1 = momentum, beta2 = momentum2)

`lr` is the parameter's local rate (rate * lr_mult, or LARS's rate). History
blobs are laid out as Caffe saves them in the .solverstate: one per parameter,
then (AdaDelta, Adam) a second one per parameter.
"""
import numpy as np

from ..errors import SolverError

RULES = {}


def rule(cls):
    RULES[cls.type] = cls
    return cls


# The deprecated `solver_type` enum, in its numbering.
ENUM_NAMES = ["SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"]


class UpdateRule:
    type = None
    histories = 1     # history blobs per parameter

    def __init__(self, param, shapes):
        self.param = param
        n = len(shapes)
        self.history = [np.zeros(shapes[i % n], np.float32) for i in range(self.histories * n)]
        self._temp = [np.empty(s, np.float32) for s in shapes]

    @classmethod
    def check(cls, param, source):
        pass

    def compute(self, i, g, lr, it, momentum):
        """Turn gradient `g` of parameter `i` into its step, in place."""
        raise NotImplementedError

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum):
        """The compiled one-pass version (caffepy.kernels.solver): normalize by `norm`,
        add weight decay, compute the step and subtract it from `w` (flat arrays)."""
        h = self.history[i].reshape(-1)
        k.step(self.type, w, g, h, h, norm, decay, l1, lr, momentum, 0.0, self.param.delta)


@rule
class SGD(UpdateRule):
    type = "SGD"

    def compute(self, i, g, lr, it, momentum):
        h = self.history[i]
        h *= momentum
        np.multiply(g, lr, out=self._temp[i])
        h += self._temp[i]
        g[...] = h


@rule
class Nesterov(UpdateRule):
    type = "Nesterov"

    def compute(self, i, g, lr, it, momentum):
        h, prev = self.history[i], self._temp[i]
        prev[...] = h
        h *= momentum
        g *= lr
        h += g
        # step = (1 + momentum) * h - momentum * h_prev
        np.multiply(h, 1.0 + momentum, out=g)
        prev *= momentum
        g -= prev


@rule
class AdaGrad(UpdateRule):
    type = "AdaGrad"

    @classmethod
    def check(cls, param, source):
        if param.momentum != 0:
            raise SolverError(f"{source}: momentum: cannot be used with AdaGrad, got {param.momentum:g}")

    def compute(self, i, g, lr, it, momentum):
        h, t = self.history[i], self._temp[i]
        np.multiply(g, g, out=t)
        h += t
        np.sqrt(h, out=t)
        t += self.param.delta
        np.divide(g, t, out=g)
        g *= lr


@rule
class RMSProp(UpdateRule):
    type = "RMSProp"

    @classmethod
    def check(cls, param, source):
        if param.momentum != 0:
            raise SolverError(f"{source}: momentum: cannot be used with RMSProp, got {param.momentum:g}")
        if not 0 <= param.rms_decay < 1:
            raise SolverError(f"{source}: rms_decay: must be in [0, 1), got {param.rms_decay:g}")

    def compute(self, i, g, lr, it, momentum):
        h, t = self.history[i], self._temp[i]
        decay = self.param.rms_decay
        np.multiply(g, g, out=t)
        t *= 1.0 - decay
        h *= decay
        h += t
        np.sqrt(h, out=t)
        t += self.param.delta
        np.divide(g, t, out=g)
        g *= lr

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum):
        h = self.history[i].reshape(-1)
        k.step(self.type, w, g, h, h, norm, decay, l1, lr, self.param.rms_decay, 0.0, self.param.delta)


@rule
class AdaDelta(UpdateRule):
    type = "AdaDelta"
    histories = 2

    def __init__(self, param, shapes):
        super().__init__(param, shapes)
        self._temp2 = [np.empty(s, np.float32) for s in shapes]

    def compute(self, i, g, lr, it, momentum):
        n = len(self._temp)
        h, h2 = self.history[i], self.history[n + i]
        t, u = self._temp[i], self._temp2[i]
        delta = self.param.delta
        np.multiply(g, g, out=t)
        t *= 1.0 - momentum
        h *= momentum
        h += t
        np.add(h2, delta, out=u)
        np.add(h, delta, out=t)
        np.divide(u, t, out=u)
        np.sqrt(u, out=u)
        g *= u
        np.multiply(g, g, out=t)
        t *= 1.0 - momentum
        h2 *= momentum
        h2 += t
        g *= lr

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum):
        n = len(self._temp)
        k.step(self.type, w, g, self.history[i].reshape(-1), self.history[n + i].reshape(-1), norm,
               decay, l1, lr, momentum, 0.0, self.param.delta)


@rule
class Adam(UpdateRule):
    type = "Adam"
    histories = 2

    def correction(self, it):
        """Caffe's bias correction sqrt(1 - beta2^t) / (1 - beta1^t), t = iter + 1."""
        t = it + 1
        return np.sqrt(1.0 - self.param.momentum2 ** t) / (1.0 - self.param.momentum ** t)

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum):
        n = len(self._temp)
        k.step(self.type, w, g, self.history[i].reshape(-1), self.history[n + i].reshape(-1), norm,
               decay, l1, lr * self.correction(it), self.param.momentum, self.param.momentum2,
               self.param.delta)

    def compute(self, i, g, lr, it, momentum):
        n = len(self._temp)
        m, v, t = self.history[i], self.history[n + i], self._temp[i]
        beta1, beta2 = self.param.momentum, self.param.momentum2
        correction = self.correction(it)
        m *= beta1
        np.multiply(g, 1.0 - beta1, out=t)
        m += t
        np.multiply(g, g, out=t)
        t *= 1.0 - beta2
        v *= beta2
        v += t
        np.sqrt(v, out=t)
        t += self.param.delta
        np.divide(m, t, out=g)
        g *= lr * correction


def solver_type(param):
    """The update rule's name: `type`, or the deprecated `solver_type` enum if only it is set."""
    if param.HasField("type") or not param.HasField("solver_type"):
        return param.type
    return ENUM_NAMES[param.solver_type]


def rule_class(param, source="<solver>"):
    """The update rule the solver names, after checking its settings."""
    name = solver_type(param)
    cls = RULES.get(name)
    if cls is None:
        raise SolverError(f"{source}: type: unknown solver type, got '{name}'. "
                          f"Known types: {', '.join(RULES)}")
    cls.check(param, source)
    return cls


def make_rule(param, shapes, source="<solver>"):
    return rule_class(param, source)(param, shapes)
