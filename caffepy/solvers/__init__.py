"""Training: the solver loop, update rules keyed by solver type, learning-rate policies, snapshots.

    solver.py     Caffe's Solver (Step / Solve / Test), its Hooks (where code such as the MPI
                  strategies plugs into the loop) and pycaffe's classes
    nets.py       the nets a solver builds (InitTrainNet / InitTestNets) and their NetStates
    updates.py    the solver types (RULES) and update application: clipping, weight decay,
                  LARS, SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam; each rule's
                  history per parameter (rule.state(i), rule.set_state(i, arrays))
    lr_policy.py  fixed, step, exp, inv, multistep, poly, sigmoid, plateau, Intel's warm-up
    snapshot.py   the .caffemodel / .solverstate files (Snapshot / Restore)
"""
from .solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, Hooks, NesterovSolver,  # noqa: F401
                     RMSPropSolver, SGDSolver, Solver, get_solver)
