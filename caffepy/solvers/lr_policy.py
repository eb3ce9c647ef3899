"""Learning-rate policies, keyed by SolverParameter.lr_policy as in Caffe.

    fixed      base_lr
    step       base_lr * gamma ^ floor(iter / stepsize)
    exp        base_lr * gamma ^ iter
    inv        base_lr * (1 + gamma * iter) ^ (-power)
    multistep  base_lr * gamma ^ current_step; current_step advances (by one per
               iteration at most, as in Caffe) once iter reaches stepvalue[current_step]
    poly       base_lr * (1 - iter / max_iter) ^ power
    sigmoid    base_lr / (1 + exp(-gamma * (iter - stepsize)))

Intel Caffe's linear warm-up takes precedence while iter < warmup_iter:
    (iter * base_lr + (warmup_iter - iter) * warmup_start_lr) / warmup_iter
i.e. it ramps towards base_lr (not the policy's rate), and the policy's own state
(multistep's current_step) does not move during warm-up — both as Intel Caffe does.

Fields read: lr_policy, base_lr, gamma, power, stepsize, stepvalue, max_iter,
warmup_iter, warmup_start_lr.
"""
import math

from ..errors import SolverError

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def check(param, source="<solver>"):
    """Refuse settings a policy cannot run with, naming the field."""
    policy = param.lr_policy
    if not param.HasField("lr_policy"):
        raise SolverError(f"{source}: lr_policy: missing; give one of {', '.join(POLICIES)}")
    if policy not in POLICIES:
        raise SolverError(f"{source}: lr_policy: unknown learning rate policy, got '{policy}'. "
                          f"Known policies: {', '.join(POLICIES)}")
    if policy in ("step",) and param.stepsize <= 0:
        raise SolverError(f"{source}: stepsize: the step policy needs stepsize > 0, got {param.stepsize}")
    if policy == "poly" and param.max_iter <= 0:
        raise SolverError(f"{source}: max_iter: the poly policy needs max_iter > 0, got {param.max_iter}")
    if policy == "multistep":
        values = list(param.stepvalue)
        if any(b <= a for a, b in zip(values, values[1:])):
            raise SolverError(f"{source}: stepvalue: must increase, got {values}")
    if param.warmup_iter < 0:
        raise SolverError(f"{source}: warmup_iter: must be >= 0, got {param.warmup_iter}")


def warmup_rate(param, it):
    """Intel Caffe's warm-up rate at iteration `it` (negative iterations read as 0)."""
    it = max(it, 0)
    w = param.warmup_iter
    return (it * param.base_lr + (w - it) * param.warmup_start_lr) / w


def in_warmup(param, it):
    return param.warmup_iter > 0 and it < param.warmup_iter


def learning_rate(param, it, current_step):
    """The rate for iteration `it`: returns (rate, current_step, multistep_advanced)."""
    if in_warmup(param, it):
        return warmup_rate(param, it), current_step, False
    policy = param.lr_policy
    base = param.base_lr
    advanced = False
    if policy == "fixed":
        rate = base
    elif policy == "step":
        current_step = it // param.stepsize
        rate = base * math.pow(param.gamma, current_step)
    elif policy == "exp":
        rate = base * math.pow(param.gamma, it)
    elif policy == "inv":
        rate = base * math.pow(1.0 + param.gamma * it, -param.power)
    elif policy == "multistep":
        if current_step < len(param.stepvalue) and it >= param.stepvalue[current_step]:
            current_step += 1
            advanced = True
        rate = base * math.pow(param.gamma, current_step)
    elif policy == "poly":
        rate = base * math.pow(1.0 - it / param.max_iter, param.power)
    elif policy == "sigmoid":
        rate = base * (1.0 / (1.0 + math.exp(-param.gamma * (it - param.stepsize))))
    else:
        raise SolverError(f"lr_policy: unknown learning rate policy, got '{policy}'")
    return rate, current_step, advanced
