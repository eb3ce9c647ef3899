"""Learning-rate policies, keyed by SolverParameter.lr_policy as in Caffe.

    fixed      base_lr
    step       base_lr * gamma ^ floor(iter / stepsize)
    exp        base_lr * gamma ^ iter
    inv        base_lr * (1 + gamma * iter) ^ (-power)
    multistep  base_lr * gamma ^ current_step; current_step advances (by one per
               iteration at most, as in Caffe) once iter reaches stepvalue[current_step]
    poly       base_lr * (1 - iter / max_iter) ^ power
    sigmoid    base_lr / (1 + exp(-gamma * (iter - stepsize)))
    plateau    (Intel) base_lr * gamma ^ current_step; current_step advances when the
               smoothed loss has not reached a new minimum for plateau_winsize[current_step]
               iterations since the last event (a new minimum or a step)
    multifixed (Intel) stagelr[i] for the first stage i with iter <= stageiter[i]; the last
               stage's rate after stageiter runs out (base_lr is not used)

Intel Caffe's linear warm-up takes precedence while iter < warmup_iter:
    (iter * base_lr + (warmup_iter - iter) * warmup_start_lr) / warmup_iter
i.e. it ramps towards base_lr (not the policy's rate), and the policy's own state
(multistep's current_step) does not move during warm-up — both as Intel Caffe does.

Fields read: lr_policy, base_lr, gamma, power, stepsize, stepvalue, max_iter,
plateau_winsize, stagelr, stageiter, warmup_iter, warmup_start_lr.

The arithmetic is Caffe's, in its types (Dtype = float): C++ promotes pow(float, int)
to double (step, exp, multistep, plateau: the power in double, the product rounded to
float), while pow(float, float) and exp(float) are the C library's float functions
(inv, poly, sigmoid).  Those two are called in the C library itself: NumPy's float32
exp/pow round differently in the last place, and rounding the double result differs
in about one case in 1,500.  The rate is a float, as Caffe's; tests/test_caffe_binary.py
checks each policy against the real caffe binary bit for bit.
"""
import ctypes
import ctypes.util
import math

import numpy as np

from ..errors import SolverError

F32 = np.float32


def _libm():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        expf, powf = lib.expf, lib.powf
    except (OSError, AttributeError):
        return None, None
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    powf.restype, powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return expf, powf


_EXPF, _POWF = _libm()


def expf(x):
    """C's expf (float in, float out); without a C library, exp rounded to float."""
    return F32(_EXPF(x)) if _EXPF else F32(math.exp(float(x)))


def powf(x, y):
    """C's powf; without a C library, pow rounded to float."""
    return F32(_POWF(x, y)) if _POWF else F32(math.pow(float(x), float(y)))


def _times_pow(base, gamma, n):
    """base * pow(gamma, n) for an integer n: C++ computes it in double, stores a float."""
    return F32(float(F32(base)) * math.pow(float(F32(gamma)), n))


POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid", "plateau", "multifixed")


class Plateau:
    """The plateau policy's state, saved in the .solverstate (minimum_loss, iter_last_event)."""

    def __init__(self):
        self.minimum_loss = float(np.finfo(np.float32).max)
        self.iter_last_event = 0
        self.smoothed_loss = float("inf")


def check(param, source="<solver>"):
    """Refuse settings a policy cannot run with, naming the field."""
    policy = param.lr_policy
    if not param.HasField("lr_policy"):
        raise SolverError(f"{source}: lr_policy: missing; give one of {', '.join(POLICIES)}")
    if policy not in POLICIES:
        raise SolverError(f"{source}: lr_policy: unknown learning rate policy, got '{policy}'. "
                          f"Known policies: {', '.join(POLICIES)}")
    for field in ("base_lr", "warmup_start_lr"):
        value = getattr(param, field)
        if not (math.isfinite(value) and value >= 0):
            raise SolverError(f"{source}: {field}: must be a finite number >= 0, got {value:g}")
    if not math.isfinite(param.power):
        raise SolverError(f"{source}: power: must be a finite number, got {param.power:g}")
    # Caffe's CHECKs in SGDSolver::GetLearningRate
    if policy in ("step", "exp", "inv", "multistep", "sigmoid", "plateau") and not (
            math.isfinite(param.gamma) and param.gamma >= 0):
        raise SolverError(f"{source}: gamma: the {policy} policy needs a finite gamma >= 0, got {param.gamma:g}")
    if policy in ("step", "sigmoid") and param.stepsize <= 0:
        raise SolverError(f"{source}: stepsize: the {policy} policy needs stepsize > 0, got {param.stepsize}")
    if policy == "poly" and param.max_iter <= 0:
        raise SolverError(f"{source}: max_iter: the poly policy needs max_iter > 0, got {param.max_iter}")
    if policy == "multistep":
        values = list(param.stepvalue)
        if any(b <= a for a, b in zip(values, values[1:])):
            raise SolverError(f"{source}: stepvalue: must increase, got {values}")
    if policy == "multifixed":
        if not len(param.stagelr) or len(param.stagelr) != len(param.stageiter):
            raise SolverError(f"{source}: stagelr: the multifixed policy needs one stagelr per stageiter, "
                              f"got {len(param.stagelr)} stagelr and {len(param.stageiter)} stageiter")
    if param.warmup_iter < 0:
        raise SolverError(f"{source}: warmup_iter: must be >= 0, got {param.warmup_iter}")


def warmup_rate(param, it):
    """Intel Caffe's warm-up rate at iteration `it` (negative iterations read as 0), in float."""
    it = max(it, 0)
    w = param.warmup_iter
    return float((F32(it) * F32(param.base_lr) + F32(w - it) * F32(param.warmup_start_lr)) / F32(w))


def in_warmup(param, it):
    return param.warmup_iter > 0 and it < param.warmup_iter


def learning_rate(param, it, current_step, plateau=None):
    """The rate for iteration `it` (a float32 value, as a Python float): returns (rate,
    current_step, status lines to log)."""
    if in_warmup(param, it):
        return warmup_rate(param, it), current_step, []
    policy = param.lr_policy
    base = F32(param.base_lr)
    status = []
    if policy == "fixed":
        rate = base
    elif policy == "step":
        current_step = it // param.stepsize
        rate = _times_pow(base, param.gamma, current_step)
    elif policy == "exp":
        rate = _times_pow(base, param.gamma, it)
    elif policy == "inv":
        rate = base * powf(F32(1) + F32(param.gamma) * F32(it), -F32(param.power))
    elif policy == "multistep":
        if current_step < len(param.stepvalue) and it >= param.stepvalue[current_step]:
            current_step += 1
            status.append(f"MultiStep Status: Iteration {it}, step = {current_step}")
        rate = _times_pow(base, param.gamma, current_step)
    elif policy == "poly":
        rate = base * powf(F32(1) - F32(it) / F32(param.max_iter), F32(param.power))
    elif policy == "plateau":
        state = plateau if plateau is not None else Plateau()
        if state.smoothed_loss < state.minimum_loss:
            state.minimum_loss = state.smoothed_loss
            state.iter_last_event = it
        if current_step < len(param.plateau_winsize):
            if it >= state.iter_last_event + param.plateau_winsize[current_step]:
                current_step += 1
                state.iter_last_event = it
                status.append(f"Plateau Status: Iteration {it}, step = {current_step}")
        if param.display and it % param.display == 0 and state.iter_last_event > it - param.display:
            status.append(f"Plateau Status: Iteration {it}, current minimum_loss = {state.minimum_loss:.6g}")
        rate = _times_pow(base, param.gamma, current_step)
    elif policy == "multifixed":
        stage = next((i for i, end in enumerate(param.stageiter) if it <= end), len(param.stageiter) - 1)
        rate = param.stagelr[stage]
    elif policy == "sigmoid":
        rate = base * (F32(1) / (F32(1) + expf(-F32(param.gamma) * (F32(it) - F32(param.stepsize)))))
    else:
        raise SolverError(f"lr_policy: unknown learning rate policy, got '{policy}'")
    return float(F32(rate)), current_step, status
