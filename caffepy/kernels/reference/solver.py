"""NumPy references of the solver kernels (cext/solver.pyx, caffepy.kernels.solver): one
parameter's update in float64, from the formulas of caffepy/solvers/updates.py, with the
kernel's arguments (RMSProp's rms_decay and Adam's beta1 come as `momentum`; Adam's lr already
carries its bias correction).

Each returns new arrays; the kernel updates w, g (the step), h and h2 in place.
"""
import numpy as np


def regularize(w, g, norm, decay, l1):
    """norm * g + decay * (sign(w) if l1 else w)."""
    w, g = w.astype(np.float64), g.astype(np.float64)
    return norm * g + decay * (np.sign(w) if l1 else w)


def step(rule, w, g, h, h2, norm, decay, l1, lr, momentum, beta2=0.0, delta=0.0):
    """(w, step, h, h2) after one update by `rule` (h2 unchanged for one-history rules)."""
    w, h, h2 = (a.astype(np.float64) for a in (w, h, h2))
    g = regularize(w, g, norm, decay, l1)
    if rule == "SGD":
        h = momentum * h + lr * g
        s = h
    elif rule == "Nesterov":
        prev, h = h, momentum * h + lr * g
        s = (1 + momentum) * h - momentum * prev
    elif rule == "AdaGrad":
        h = h + g * g
        s = lr * g / (np.sqrt(h) + delta)
    elif rule == "RMSProp":
        h = momentum * h + (1 - momentum) * g * g
        s = lr * g / (np.sqrt(h) + delta)
    elif rule == "AdaDelta":
        h = momentum * h + (1 - momentum) * g * g
        u = g * np.sqrt((h2 + delta) / (h + delta))
        h2 = momentum * h2 + (1 - momentum) * u * u
        s = lr * u
    elif rule == "Adam":
        h = momentum * h + (1 - momentum) * g
        h2 = beta2 * h2 + (1 - beta2) * g * g
        s = lr * h / (np.sqrt(h2) + delta)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    return w - s, s, h, h2
