"""Caffe's update application and update rules (sgd_solver.cpp and its siblings).

apply_update is SGDSolver::ApplyUpdate once the rate is known: clip the
gradients to clip_gradients (their global L2 norm), then per parameter
normalize by 1/iter_size, regularize (L2 or L1, weight_decay * decay_mult), take
the local rate (rate * lr_mult, or Intel Caffe's LARS for SGD with
local_lr_auto), let the rule turn the gradient into a step, and `data -= step`.
With the compiled kernels (caffepy.kernels.solver) normalizing, regularizing,
the rule and the subtraction are one fused pass over each parameter.

Each rule turns a parameter's gradient g (already normalized and regularized)
into the step that is subtracted from the weights, in place in g:

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

`lr` is the parameter's local rate (rate * lr_mult, or LARS's rate). A rule's
history is kept per parameter: `rule.state(i)` is the list of parameter i's
history arrays (h; AdaDelta h, h2; Adam m, v), updated in place, and
`rule.set_state(i, arrays)` replaces them (the hybrid MPI strategy keeps a
rank's rows of a model-parallel layer's). snapshot.py saves and restores them
through the same two calls.

RULES is the one table of solver types: a `type` string -> its rule class,
whose `enum` is the value of the deprecated `solver_type` enum that names it.
The solver_type upgrade (upgrade.py) and pycaffe's typed solver classes
(solver.py) are read from it.
"""
import math

import numpy as np

from .. import log
from ..errors import SolverError
from ..proto import caffe_pb2
from . import lr_policy

RULES = {}


def rule(cls):
    RULES[cls.type] = cls
    return cls


def type_of_enum(value):
    """The `type` string named by a value of the deprecated solver_type enum."""
    return next(cls.type for cls in RULES.values() if cls.enum == value)


class UpdateRule:
    type = None       # SolverParameter.type
    enum = None       # its value of the deprecated SolverParameter.solver_type
    histories = 1     # history arrays per parameter
    scratches = 1     # scratch arrays per parameter (shaped like it, never saved)

    def __init__(self, param, shapes):
        self.param = param
        self._state = [[np.zeros(s, np.float32) for _ in range(self.histories)] for s in shapes]
        self._temp = [self._scratch(s) for s in shapes]

    def _scratch(self, shape):
        return [np.empty(shape, np.float32) for _ in range(self.scratches)]

    def state(self, i):
        """The history arrays of learnable parameter i (`histories` of them), updated in place."""
        return self._state[i]

    def set_state(self, i, arrays):
        """Replace parameter i's history arrays. They may be shaped differently from before
        (a rank's rows of a model-parallel parameter): the rule's scratch follows them, and
        the parameter's data and diff must have that shape when the rule next runs."""
        arrays = [np.ascontiguousarray(a, np.float32) for a in arrays]
        assert len(arrays) == self.histories, (self.type, len(arrays))
        self._state[i] = arrays
        self._temp[i] = self._scratch(arrays[0].shape)

    @classmethod
    def check(cls, param, source):
        pass

    def compute(self, i, g, lr, it, momentum):
        """Turn gradient `g` of parameter `i` into its step, in place."""
        raise NotImplementedError

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum, keep=None):
        """The compiled one-pass version (caffepy.kernels.solver): normalize by `norm`,
        add weight decay, compute the step and subtract it from `w` (flat arrays); with
        `keep` (data, [history]) the values before the update are left there (_keeping)."""
        h = self._state[i][0].reshape(-1)
        k.step(self.type, w, g, h, h, norm, decay, l1, lr, momentum, 0.0, self.param.delta,
               **_keeping(keep))


@rule
class SGD(UpdateRule):
    type = "SGD"
    enum = caffe_pb2.SolverParameter.SGD

    def compute(self, i, g, lr, it, momentum):
        (h,), (t,) = self._state[i], self._temp[i]
        h *= momentum
        np.multiply(g, lr, out=t)
        h += t
        g[...] = h


@rule
class Nesterov(UpdateRule):
    type = "Nesterov"
    enum = caffe_pb2.SolverParameter.NESTEROV

    def compute(self, i, g, lr, it, momentum):
        (h,), (prev,) = self._state[i], self._temp[i]
        prev[...] = h
        h *= momentum
        g *= lr
        h += g
        # step = (1 + momentum) * h - momentum * h_prev
        np.multiply(h, 1.0 + momentum, out=g)
        prev *= momentum
        g -= prev


def _refuse_momentum(cls, param, source):
    if param.momentum != 0:
        raise SolverError(f"{source}: momentum: cannot be used with {cls.type}, got {param.momentum:g}")


def _divide_by_root(g, h, t, delta, lr):
    """g = lr * g / (sqrt(h) + delta), with `t` as scratch."""
    np.sqrt(h, out=t)
    t += delta
    np.divide(g, t, out=g)
    g *= lr


@rule
class AdaGrad(UpdateRule):
    type = "AdaGrad"
    enum = caffe_pb2.SolverParameter.ADAGRAD

    @classmethod
    def check(cls, param, source):
        _refuse_momentum(cls, param, source)

    def compute(self, i, g, lr, it, momentum):
        (h,), (t,) = self._state[i], self._temp[i]
        np.multiply(g, g, out=t)
        h += t
        _divide_by_root(g, h, t, self.param.delta, lr)


@rule
class RMSProp(UpdateRule):
    type = "RMSProp"
    enum = caffe_pb2.SolverParameter.RMSPROP

    @classmethod
    def check(cls, param, source):
        _refuse_momentum(cls, param, source)
        if not 0 <= param.rms_decay < 1:
            raise SolverError(f"{source}: rms_decay: must be in [0, 1), got {param.rms_decay:g}")

    def compute(self, i, g, lr, it, momentum):
        (h,), (t,) = self._state[i], self._temp[i]
        decay = self.param.rms_decay
        np.multiply(g, g, out=t)
        t *= 1.0 - decay
        h *= decay
        h += t
        _divide_by_root(g, h, t, self.param.delta, lr)

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum, keep=None):
        h = self._state[i][0].reshape(-1)
        k.step(self.type, w, g, h, h, norm, decay, l1, lr, self.param.rms_decay, 0.0, self.param.delta,
               **_keeping(keep))


@rule
class AdaDelta(UpdateRule):
    type = "AdaDelta"
    enum = caffe_pb2.SolverParameter.ADADELTA
    histories = 2
    scratches = 2

    def compute(self, i, g, lr, it, momentum):
        (h, h2), (t, u) = self._state[i], self._temp[i]
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

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum, keep=None):
        h, h2 = self._state[i]
        k.step(self.type, w, g, h.reshape(-1), h2.reshape(-1), norm, decay, l1, lr, momentum, 0.0,
               self.param.delta, **_keeping(keep))


@rule
class Adam(UpdateRule):
    type = "Adam"
    enum = caffe_pb2.SolverParameter.ADAM
    histories = 2

    @classmethod
    def check(cls, param, source):
        # beta1 = 1 divides the bias correction by 1 - 1^t = 0
        for field in ("momentum", "momentum2"):
            if getattr(param, field) >= 1:
                raise SolverError(f"{source}: {field}: Adam needs it below 1, got {getattr(param, field):g}")

    def correction(self, it):
        """Caffe's bias correction sqrt(1 - beta2^t) / (1 - beta1^t), t = iter + 1."""
        t = it + 1
        return np.sqrt(1.0 - self.param.momentum2 ** t) / (1.0 - self.param.momentum ** t)

    def fused(self, k, i, w, g, norm, decay, l1, lr, it, momentum, keep=None):
        m, v = self._state[i]
        k.step(self.type, w, g, m.reshape(-1), v.reshape(-1), norm, decay, l1, lr * self.correction(it),
               self.param.momentum, self.param.momentum2, self.param.delta, **_keeping(keep))

    def compute(self, i, g, lr, it, momentum):
        (m, v), (t,) = self._state[i], self._temp[i]
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


def rule_class(param, source="<solver>"):
    """The update rule the solver names, after checking its settings."""
    name = param.type
    cls = RULES.get(name)
    if cls is None:
        raise SolverError(f"{source}: type: unknown solver type, got '{name}'. "
                          f"Known types: {', '.join(RULES)}")
    check_values(param, source)
    cls.check(param, source)
    return cls


def check_values(param, source="<solver>"):
    """Refuse, before anything runs, the values whose first update would make the weights
    non-finite or move them the wrong way: negative or non-finite momentum, momentum2,
    delta, weight_decay, local_gw_ratio; a NaN clip_gradients (negative: no clipping)."""
    for field in ("momentum", "momentum2", "delta", "weight_decay", "local_gw_ratio"):
        value = getattr(param, field)
        if not (math.isfinite(value) and value >= 0):
            raise SolverError(f"{source}: {field}: must be a finite number >= 0, got {value:g}")
    if math.isnan(param.clip_gradients):
        raise SolverError(f"{source}: clip_gradients: must be a number (negative for no clipping), got nan")


def make_rule(param, shapes, source="<solver>"):
    return rule_class(param, source)(param, shapes)


# -- update application (SGDSolver::ApplyUpdate) ------------------------------------
def kernels():
    """The compiled fused updates (cext/solver.pyx), or None when not built."""
    try:
        from ..kernels import solver
    except ImportError:
        return None
    return solver


def _keeping(keep):
    """The fused step's keyword arguments that leave a parameter's values from before its
    update in `keep` ((data, [history]) as apply_update takes it; None: nothing kept)."""
    if keep is None:
        return {}
    data, history = keep
    args = {"keep_w": data.reshape(-1), "keep_h": history[0].reshape(-1)}
    if len(history) > 1:
        args["keep_h2"] = history[1].reshape(-1)
    return args


def apply_update(param, net, update_rule, rate, it, sumsq, fused=None, indices=None, keep=None):
    """SGDSolver::ApplyUpdate after the rate (with Intel Caffe's warm-up and LARS): update
    every learnable parameter of `net` (or those in `indices`) with `update_rule` at `rate`.
    `sumsq(index, array)` is the squared L2 norm of a parameter's data or diff (the
    solver's, which a multi-rank hook may sum over ranks); `fused` the compiled kernels, or
    None for NumPy. Updating the parameters in several calls gives what one call gives,
    except with clip_gradients (the norm of every gradient): then `indices` must be None.
    `keep` {index: (data, [history])}: arrays shaped as those parameters' data and history,
    which receive their values from before the update (the fused kernel writes them in its
    own pass over the arrays)."""
    assert indices is None or param.clip_gradients < 0, "clipping needs every gradient at once"
    clip_gradients(param.clip_gradients, net.learnable_params, sumsq)
    momentum = param.momentum
    lars = update_rule.type == "SGD" and param.local_lr_auto
    if update_rule.type == "SGD" and lr_policy.in_warmup(param, it):
        # Intel Caffe's momentum correction while the rate ramps up; a zero previous
        # rate (warmup_start_lr 0 at the first step) would divide by zero: no correction
        prev = lr_policy.warmup_rate(param, it - 1)
        if prev > 0:
            momentum *= rate / prev
    decay = param.weight_decay
    l1 = param.regularization_type == "L1"
    norm = 1.0 / param.iter_size
    for i in range(len(net.learnable_params)) if indices is None else indices:
        blob = net.learnable_params[i]
        lr_mult = net.params_lr[i]
        kept = None if keep is None else keep.get(i)
        if kept is not None and (lr_mult == 0 or fused is None):
            data, history = kept
            np.copyto(data, blob.data)
            for out, h in zip(history, update_rule.state(i)):
                np.copyto(out, h)
            kept = None
        if lr_mult == 0:
            # no step to take (Intel Caffe skips these; Caffe's step would be 0)
            continue
        g = blob.diff
        local_decay = decay * net.params_weight_decay[i]
        if fused is not None:
            w1, g1 = blob.data.reshape(-1), g.reshape(-1)
            if lars:
                fused.regularize(w1, g1, norm, local_decay, l1)
                local = lars_rate(param, sumsq(i, blob.data), sumsq(i, blob.diff), lr_mult)
                update_rule.fused(fused, i, w1, g1, 1.0, 0.0, False, rate * local, it, momentum, kept)
            else:
                update_rule.fused(fused, i, w1, g1, norm, local_decay, l1, rate * lr_mult, it, momentum,
                                  kept)
            continue
        if param.iter_size > 1:
            g *= norm
        if local_decay:
            g += local_decay * (np.sign(blob.data) if l1 else blob.data)
        local = lr_mult
        if lars:
            local = lars_rate(param, sumsq(i, blob.data), sumsq(i, blob.diff), lr_mult)
        update_rule.compute(i, g, rate * local, it, momentum)
        blob.data[...] -= g


def lars_rate(param, w_sumsq, g_sumsq, lr_mult):
    """Intel Caffe's GetLocalRate: gw_ratio * |w| / (|g| + weight_decay * |w|), replacing
    lr_mult when lr_mult > 0; 1 when either norm is 0. |g| is the normalized, regularized
    gradient (the order of Intel Caffe's unfused path)."""
    w_norm, g_norm = math.sqrt(w_sumsq), math.sqrt(g_sumsq)
    rate = 1.0
    if w_norm > 0 and g_norm > 0:
        rate = param.local_gw_ratio * w_norm / (g_norm + param.weight_decay * w_norm)
    return rate if lr_mult > 0 else lr_mult


def clip_gradients(clip, blobs, sumsq):
    """SGDSolver::ClipGradients: scale every diff down when their global L2 norm exceeds `clip`."""
    if clip < 0:
        return
    l2 = math.sqrt(sum(sumsq(i, b.diff) for i, b in enumerate(blobs)))
    if l2 > clip:
        scale = clip / l2
        log.info(f"Gradient clipping: scaling down gradients (L2 norm {log.fmt(l2)} > {log.fmt(clip)}) "
                 f"by scale factor {log.fmt(scale)}")
        for b in blobs:
            b.diff[...] *= scale
