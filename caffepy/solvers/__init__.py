"""Training: the solver loop, update rules keyed by solver type, learning-rate policies, snapshots.

    solver.py     Caffe's Solver (Step / Solve / Test) and pycaffe's classes
    nets.py       the nets a solver builds (InitTrainNet / InitTestNets) and their NetStates
    updates.py    the solver types (RULES) and update application: clipping, weight decay,
                  LARS, SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam
    lr_policy.py  fixed, step, exp, inv, multistep, poly, sigmoid, plateau, Intel's warm-up
    snapshot.py   the .caffemodel / .solverstate files (Snapshot / Restore)
"""
from .solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, RMSPropSolver,  # noqa: F401
                     SGDSolver, Solver, get_solver)
