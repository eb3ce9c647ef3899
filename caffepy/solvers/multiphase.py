"""Intel Caffe's multi-phase solver files (MultiPhaseSolverParameter; multiphase_train in its
training_utils.hpp): phases trained one after another on one net.

    params_pair { solver_params { net: "train_val.prototxt" base_lr: 0.1 max_iter: 1000 ... }
                  batch_size: 256 }
    params_pair { solver_params { base_lr: 0.01 max_iter: 500 ... } batch_size: 64 }

`caffepy train --solver` reads such a file where a SolverParameter does not parse (as Intel's
caffe does). The first pair must hold solver parameters, and their `net` names the net file of
every phase. A phase is a new solver from its pair's solver_params (a pair without them reuses
the previous phase's) on that net, with:
  - `batch_size`, when the pair gives one, set in the first Data layer of the net, and kept by
    the phases after it until one gives another;
  - the snapshot prefix <first phase's snapshot_prefix>_phase_<j> (j from 0);
  - the weights the phase before ended with (the first: --weights, if given); a phase starts
    at iteration 0 with its own lr schedule and a fresh history (momentum), as in Intel Caffe.
Each phase's snapshots, and the one after its last iteration, follow its own solver settings.
"""
from .. import log, prototxt, upgrade
from ..errors import PrototxtError
from ..proto import caffe_pb2


def read(path):
    """The MultiPhaseSolverParameter in solver file `path`, or None when it holds a plain
    SolverParameter (or is broken as one: reading it as a solver then says what is wrong)."""
    try:
        upgrade.read_solver(path)
        return None
    except PrototxtError:
        pass
    try:
        multi = prototxt.read_text(caffe_pb2.MultiPhaseSolverParameter(), path)
    except PrototxtError:
        if b"params_pair" in _bytes(path):
            raise                   # meant as multi-phase: its own error says where it breaks
        return None
    return multi if len(multi.params_pair) else None


def _bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def phases(multi, source):
    """The SolverParameter of each phase of `multi` (read from `source`), ready to build."""
    first = multi.params_pair[0]
    where = f"{source}: params_pair[0]"
    if not first.HasField("solver_params"):
        raise PrototxtError(f"{where}: solver_params: the first phase needs its solver parameters, got none")
    if not first.solver_params.net:
        raise PrototxtError(f"{where}.solver_params.net: a multi-phase solver trains the net file its "
                            f"first phase names in `net`, got none")
    net = upgrade.read_net(first.solver_params.net)
    prefix = first.solver_params.snapshot_prefix + "_phase_"
    out, solver = [], None
    for j, pair in enumerate(multi.params_pair):
        if pair.HasField("solver_params"):
            solver = upgrade.upgrade_solver(pair.solver_params, f"{source}: params_pair[{j}].solver_params")[0]
        else:
            solver = prototxt.copy_message(solver)
        if pair.HasField("batch_size"):
            _set_batch_size(net, pair.batch_size, f"{source}: params_pair[{j}].batch_size",
                            first.solver_params.net)
        solver.snapshot_prefix = prefix + str(j)
        solver.ClearField("net")
        solver.net_param.CopyFrom(net)
        out.append(solver)
    return out


def _set_batch_size(net, batch_size, where, net_file):
    if batch_size < 1:
        raise PrototxtError(f"{where}: must be at least 1, got {batch_size}")
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.batch_size = batch_size
            log.info(f"{where}: batch_size {batch_size} for Data layer '{layer.name}'")
            return
    raise PrototxtError(f"{where}: Intel Caffe gives it to the first Data layer, and {net_file} has "
                        f"none, got batch_size {batch_size}")
