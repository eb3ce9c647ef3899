"""Training: the solver loop, update rules keyed by solver type, learning-rate policies.

    solver.py     Caffe's Solver (Step / Solve / Test / Snapshot / Restore) and pycaffe's classes
    updates.py    SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam
    lr_policy.py  fixed, step, exp, inv, multistep, poly, sigmoid, Intel's warm-up
"""
from .solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver,  # noqa: F401
                     SGDSolver, Solver, get_solver)
