"""No work lost: the emergency snapshot of a data-parallel job that lost a rank, and the
`--restart N` supervisor.

In data parallel every rank holds the whole model and update-rule history. A rank
finishes iteration k once the gradients of k, summed over every rank (the lost one's
included), have updated every parameter; any rank that finished k holds the very state
a snapshot after k would write. When the stall watchdog (watchdog.py) finds a rank lost
(its process gone, silent, or not moving for --stall_timeout), the rank whose watchdog
found it (rank 0, or rank 1 when rank 0 is the one lost) writes that state as a normal
snapshot, `<prefix>_iter_<k+1>`, before the job is aborted with the line naming the lost
rank. No collective runs: the others may be stuck in one with the lost rank.

What the survivor holds when the loss is found may be partway through iteration k: with
the `thread` progress mode the gradients of k arrive bucket by bucket while the next
forward updates each parameter when it needs it (the most urgent bucket first). The
Keeper (a solver hook) makes any moment recoverable:
  - when the update of iteration k starts (the learning rate known, the data layers'
    read positions and the random generator as they stand after the backward of k), it
    records those small figures: the run state of "k finished";
  - a parameter updated while some gradient of k is still travelling has its data and
    history from before the update kept: the fused update writes them out as it reads
    them (caffepy.kernels.solver.step's keep_*), with streaming stores. These copies are
    not rare: across two emulated hosts AlexNet's fc6 (302 MB with its history) was
    updated before fc7's and fc8's gradients had arrived in one iteration of two or
    three; a separate copy cost 44 ms against the fused pass's 23 (one thread).
The emergency snapshot is then "k finished" when every parameter has had its update of
k, else "k-1 finished" (the copies of those updated, the others as they are): never a
mix. It holds the writer's own generator and read positions for every rank (the lost
rank's are gone): resumed on another number of ranks, as is usual after a loss, the
record stream goes on exactly (as any resume across rank counts does); on the same
number, every rank reads on where it was and draws from the writer's generator.
BatchNorm running statistics are the writer's own, not averaged over the ranks. The
hybrid (model-parallel) strategy holds no whole copy of the split layers on any rank:
no emergency snapshot there.

The files are written as every snapshot is (temporary names, renamed when whole); when
the second cannot be written the first is removed: a pair or nothing.

The supervisor (`caffepy train --restart N [--launcher 'mpiexec -n 4 ...']`, outside of
any MPI launcher) runs the training command under the launcher and, when it fails,
runs it again from the newest snapshot of the solver's prefix, up to N times, with a
log line each time; the same launcher command, so the same number of ranks. Under
mpiexec a rank cannot relaunch its own job: there `--restart` is refused.
"""
import os
import re
import shlex
import subprocess
import sys
import types

import numpy as np

from .. import log, rng
from ..errors import CaffepyError, ParallelError, UsageError
from ..solvers import snapshot
from ..solvers.solver import Hooks

# Seconds the writer waits for the update rule to let go of the parameters (it holds them a
# few milliseconds; longer means the main thread is stuck inside an update)
LOCK_WAIT = 30.0

_keeper = None


def keep(solver, strategy):
    """Join the Keeper to `solver` (data parallel only) and let the watchdog call it."""
    global _keeper
    from . import watchdog
    from .strategies import DataParallel
    if type(strategy) is not DataParallel:
        _keeper = None
        watchdog.before_abort = _not_possible(strategy.name)
        return None
    _keeper = Keeper(solver, strategy)
    solver.hooks.append(_keeper)
    watchdog.before_abort = lambda lost: _keeper.emergency(lost)
    return _keeper


def _not_possible(name):
    def say(lost):
        log.error(f"no emergency snapshot: with the {name} strategy no rank holds the whole model "
                  f"(the lost rank's share of the split layers is gone)")
    return say


class Keeper(Hooks):
    """Keeps what the emergency snapshot needs: see the module's docstring."""

    def __init__(self, solver, strategy):
        self.solver = solver
        self.strategy = strategy
        self.count = len(solver.net.learnable_params)
        self.iteration = None         # the iteration whose update is the latest to have started
        self.updated = set()          # parameters it has updated
        self.saved = {}               # parameter -> (data, [history]) before that update
        self.records = {}             # iteration -> its run state once finished
        self._buffers = {}            # parameter -> reused copies
        self.written = None

    def _gradients_final(self):
        reducer = getattr(self.strategy, "reducer", None)
        if reducer is None or reducer.progress != "thread":
            return True               # the other modes wait for every gradient before updating
        buckets = getattr(reducer, "buckets", None)
        if buckets is None:
            return False              # a reducer that does not say: keep a copy
        return all(bucket.done.is_set() for bucket in buckets)

    def before_apply(self, solver, indices, iteration):
        if iteration != self.iteration:
            # the update of `iteration` starts: its figures are final from here on
            self.records = {k: v for k, v in self.records.items() if k >= iteration - 1}
            self.records[iteration] = types.SimpleNamespace(
                iter=iteration + 1, current_step=solver.current_step,
                minimum_loss=solver.plateau.minimum_loss, iter_last_event=solver.plateau.iter_last_event,
                run=solver.run_state(), generator=rng.get_state())
            self.iteration, self.updated, self.saved = iteration, set(), {}
        indices = range(self.count) if indices is None else indices
        keep = None
        if not self._gradients_final():
            # the update leaves the values from before it here, in its own pass
            keep = {i: self._buffers_of(i) for i in indices}
            self.saved.update(keep)
        self.updated.update(indices)
        return keep

    def _buffers_of(self, i):
        """Parameter i's reused arrays for its data and history from before an update."""
        data = self.solver.net.learnable_params[i].data
        history = self.solver.rule.state(i)
        buffers = self._buffers.get(i)
        if buffers is None or buffers[0].shape != data.shape:
            buffers = self._buffers[i] = (np.empty_like(data), [np.empty_like(h) for h in history])
        return buffers

    def consistent_state(self):
        """(record, {param: data}, [[history] per param]) of the last iteration this rank
        finished, or None when none finished since the start. Call holding update_lock."""
        if self.iteration is None:
            return None
        params = self.solver.net.learnable_params
        if len(self.updated) == self.count:
            record = self.records[self.iteration]
            return record, {i: b.data for i, b in enumerate(params)}, \
                [self.solver.rule.state(i) for i in range(self.count)]
        if set(self.saved) != self.updated:
            return None               # cannot happen: updated unsaved means all gradients were final
        record = self.records.get(self.iteration - 1)
        if record is None:
            return None               # the first update since the start was cut short
        data, states = {}, []
        for i, blob in enumerate(params):
            if i in self.saved:
                data[i], history = self.saved[i]
            else:
                data[i], history = blob.data, self.solver.rule.state(i)
            states.append(list(history))
        return record, data, states

    def emergency(self, lost):
        """Write the last finished iteration as a snapshot (from the watchdog's thread, the
        main thread possibly stuck anywhere). Returns the paths, or None; never raises."""
        solver = self.solver
        try:
            if not solver.update_lock.acquire(timeout=LOCK_WAIT):
                log.error(f"no emergency snapshot: the update rule held the parameters for more than "
                          f"{LOCK_WAIT:g} s")
                return None
            try:
                state = self.consistent_state()
                who = ", ".join(f"rank {r}" for r in lost)
                if state is None:
                    log.info(f"Emergency snapshot: no iteration finished since the start ({who} lost); "
                             f"nothing to save", everyone=True)
                    return None
                record, data, states = state
                self.written = write_emergency(solver, record, data, states, who)
                return self.written
            finally:
                solver.update_lock.release()
        except Exception as e:            # the abort line must still come
            log.error(f"no emergency snapshot: {type(e).__name__}: {e}")
            return None


def write_emergency(solver, record, data, states, who):
    """Write the snapshot of `record`'s iteration from `data` / `states`; a pair or nothing."""
    param = type(solver.param)()
    param.CopyFrom(solver.param)
    param.snapshot_diff = False       # the diffs hold a partial iteration's gradients
    it = record.iter
    hdf5 = snapshot.is_hdf5(param)
    model = snapshot.filename(param.snapshot_prefix, it, ".caffemodel.h5" if hdf5 else ".caffemodel")
    state_path = snapshot.filename(param.snapshot_prefix, it, ".solverstate.h5" if hdf5 else ".solverstate")
    if os.path.exists(model) and os.path.exists(state_path):
        log.info(f"Emergency snapshot: iteration {it} was snapshotted already: {state_path} ({who} lost)", everyone=True)
        return model, state_path
    arrays = {blob: (data[i], None) for i, blob in enumerate(solver.net.learnable_params)}
    plateau = types.SimpleNamespace(minimum_loss=record.minimum_loss, iter_last_event=record.iter_last_event)
    log.info(f"Emergency snapshot of iteration {it}, the last one every rank finished ({who} lost)", everyone=True)
    try:
        paths = snapshot.write(param, it, solver.net, states, record.current_step, plateau, arrays,
                               run_state={"ranks": [record.run] * solver.context.size},
                               generator=record.generator)
    except (CaffepyError, OSError) as e:
        for path in (model, state_path):
            try:
                os.unlink(path)
            except OSError:
                pass
        reason = str(e) if isinstance(e, CaffepyError) else f"{e.filename or model}: {e.strerror}"
        log.error(f"Emergency snapshot of iteration {it} failed: {reason}; nothing was written")
        return None
    log.info(f"Emergency snapshot written: {paths[0]}, {paths[1]}", everyone=True)
    return paths


# -- the supervisor ---------------------------------------------------------------
_RESTART_FLAGS = ("restart", "launcher")


def newest_snapshot(prefix):
    """(iteration, .solverstate path) of the newest snapshot of `prefix`, or None."""
    directory, stem = os.path.split(prefix)
    pattern = re.compile(re.escape(stem) + r"_iter_(\d+)\.solverstate(\.h5)?$")
    found = []
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return None
    for name in names:
        m = pattern.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return max(found) if found else None


def command_without(argv, names):
    """`argv` (click's spellings) without the options `names` and their values."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        m = re.match(r"^--([A-Za-z_]+)(=.*)?$", arg)
        if m and m.group(1) in names:
            skip = m.group(2) is None
            continue
        out.append(arg)
    return out


def supervise_restarts(restarts, launcher, solver_file, argv):
    """Run `caffepy train <argv>` under `launcher` and relaunch it from the newest snapshot
    when it fails, up to `restarts` times. Returns the exit code of the last run."""
    from .. import upgrade
    from . import mpi
    if mpi.launched():
        raise UsageError("--restart relaunches the job, which a rank cannot do: run `caffepy train "
                         "--restart N --launcher 'mpiexec -n R ...' ...` outside of mpiexec")
    param = upgrade.read_solver(solver_file)
    snapshot.default_prefix(param, solver_file)
    words = shlex.split(launcher or "")
    if not words and not param.snapshot and not param.snapshot_after_train:
        raise UsageError(f"--restart: nothing to restart from: {solver_file} writes no snapshots "
                         f"(snapshot: 0, snapshot_after_train: false) and a single process writes no "
                         f"emergency snapshot. Set snapshot: N in the solver")
    base = [sys.executable, "-m", "caffepy.cli", "train"] + command_without(argv, _RESTART_FLAGS)
    command = words + base
    attempt = 0
    while True:
        code = subprocess.call(command)
        if code == 0:
            return 0
        newest = newest_snapshot(param.snapshot_prefix)
        if attempt == restarts:
            log.error(f"--restart: the job failed (exit code {code}) after {restarts} restart"
                      f"{'s' if restarts != 1 else ''}; giving up")
            return code
        if newest is None:
            raise ParallelError(f"--restart: the job failed (exit code {code}) and left no snapshot to "
                                f"restart from ({param.snapshot_prefix}_iter_*.solverstate)")
        attempt += 1
        it, path = newest
        log.info(f"Restart {attempt} of {restarts}: the job ended with exit code {code}; relaunching "
                 f"it from {path} (iteration {it})")
        command = words + command_without(base, ("snapshot", "weights")) + ["--snapshot", path]
