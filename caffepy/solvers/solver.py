"""The training loop: Caffe's Solver::Step / Solve / Test, and pycaffe's solver classes.

One iteration (Step): clear parameter diffs; test if it is time; run
forward/backward `iter_size` times (parameter diffs accumulate); smooth and
display the loss; then ApplyUpdate: the learning rate (lr_policy.py), then
clipping, normalizing, regularizing and the update rule (updates.py); then the
signal handler's request (snapshot, stop), agreed across ranks. Under MPI the
loss, its lines and the request are settled one iteration late (IterationRecord,
Hooks.lags_records), so that no rank waits for the others at each iteration's end.

Beside it: nets.py builds the train and test nets (InitTrainNet, InitTestNets),
snapshot.py writes and reads the .caffemodel / .solverstate pair.

A solver runs in a run context (caffepy.context: rank, size, agree): it seeds
its random generator with random_seed + rank, builds its train net in that
context and its test nets in the one `test_context` says. Code that takes part
in the loop without being the loop (the MPI strategies of caffepy.parallel,
profilers) plugs in through `Hooks`, the one list of the points it may use;
nothing outside the solver replaces its methods or reads its rule's attributes.

The numbers it logs are Caffe's: losses, their running average and test scores are
accumulated in float (Caffe's Dtype), so an accuracy averaged over 100 batches prints
0.990001 where Caffe does (on N ranks each rank's float sums are added over the ranks); the display timer counts whole milliseconds, as Caffe's CPU
Timer does.
"""
import math
import os
import threading
import time

import numpy as np

from .. import bbox, log, rng, upgrade
from ..context import SINGLE
from ..errors import CaffepyError, SolverError
from ..log import fmt
from ..proto import caffe_pb2
from . import lr_policy, nets, snapshot, updates

ACTIONS = ("none", "snapshot", "stop", "snapshot_stop")
"""Caffe's SolverAction: what a signal asks for (SignalHandler in actions.py), weakest first."""

F32 = np.float32


def _seconds_since(start):
    """Caffe's CPU Timer::Seconds(): the whole milliseconds elapsed / 1000, as a float."""
    return F32(int((time.perf_counter() - start) * 1000) / 1000.0)


class IterationRecord:
    """What one training iteration leaves for the log and the signal handling: its `loss`,
    at a display iteration the train net's `outputs` (float32) and the display timer's
    `lapse` over `timed` iterations, this rank's signal `request` (one of ACTIONS), and
    once updated the learning `rate`. Settled, `loss` and `outputs` are the means over
    the ranks and `request` the agreed action."""

    def __init__(self, iteration, loss, display):
        self.iteration = iteration
        self.loss = loss
        self.display = display
        self.outputs = None
        self.lapse, self.timed = None, 0
        self.request = "none"
        self.rate = None
        self.shown = None            # the display's figures (Hooks.on_display's stats)


class Hooks:
    """The solver's hook protocol (BVLC's Solver::Callback, Intel Caffe's on_backward_finished).

    `solver.hooks` is a list; at each point below the solver calls the method of every hook
    that has it, in list order. Subclass Hooks for no-op defaults, or define only some.
    Methods marked "every rank" are called by every rank at the same point of the same
    iteration, so a hook may communicate (MPI collectives) in them.
    """

    def on_start(self, solver):
        """Every rank, once, at the first step: the nets are built and their weights loaded
        (-weights) or restored (-snapshot); nothing has run yet."""

    def on_layer_done(self, solver, layer_index):
        """Every rank: the backward of train-net layer `layer_index` (one with parameters) is
        done. Called in each of the iter_size passes; the gradients are final in the last."""

    def before_update(self, solver):
        """Every rank: forward and backward are done; lr, clipping, regularization and the
        update rule come next. The parameter diffs are what the update will use, except
        those `pending_gradients` names."""

    def pending_gradients(self, solver):
        """Every rank, after before_update: indices of the learnable parameters whose
        gradients are still being completed in the background (reduced across ranks), the
        same on every rank. The solver updates the others now and each of these when it is
        needed: right before the next forward reaches the first layer that uses it (or before
        a test, a snapshot, the end of `step`), after `await_gradients`. A solver that must
        see every gradient at once (clip_gradients) awaits them all first."""
        return ()

    def await_gradients(self, solver, indices):
        """Every rank: return once the gradients of learnable parameters `indices` (some of
        what pending_gradients named) are final in their diffs."""

    def reduce_loss(self, solver, loss):
        """Every rank: the iteration's loss, as displayed and checked for NaN. Chained: each
        hook gets the previous hook's result."""
        return loss

    def reduce_scores(self, solver, values):
        """Every rank: `values`, a float64 array of this rank's sums of net outputs (test
        scores over its test batches, the train net's outputs at a display), summed over
        the ranks. Chained."""
        return values

    def sumsq(self, solver, index, array):
        """Every rank: the squared L2 norm of learnable parameter `index`'s data or diff `array`
        (clip_gradients, LARS), or None to leave it to the next hook (in the end, the local
        sum). The first number returned is used."""
        return None

    lags_records = False
    """True: the hook settles each iteration's IterationRecord across ranks in the background
    (post_record, settle_record) instead of reduce_loss, reduce_scores and agree_action, so
    no rank waits for the others at every iteration's end (on a busy link a small collective
    waits behind the gradients' bytes). The loss and output lines of an iteration, its display
    hooks and its agreed request (a snapshot or a stop) then come one iteration late. One hook
    at most; not used with lr_policy plateau, whose rate reads the iteration's loss."""

    def post_record(self, solver, record):
        """Every rank, after each iteration's backward, with lags_records: start settling
        `record` (this rank's values) and return the previous iteration's record settled, or
        None."""

    def settle_record(self, solver):
        """Every rank, with lags_records (before a test phase, at the end of `step`): the record
        post_record still holds, settled (waiting for it), or None."""

    def agree_action(self, solver, request):
        """Every rank, after each update (and in the test loop when every rank tests): the
        signal handler's request on this rank, one of ACTIONS. Returns the action to take;
        chained. Agreeing makes every rank snapshot or stop after the same iteration."""
        return request

    def before_test(self, solver):
        """Every rank, when the test phase is due (every parameter updated), before the test
        nets run: make their weights and statistics what the test should see."""

    def on_display(self, solver, stats):
        """Every rank, at each display iteration, once its update's learning rate is known:
        `stats` holds what the display lines show, `iteration`, `loss` (the smoothed loss),
        `outputs` [(name, value)] (the train net's outputs, their mean over the ranks; an
        output of several values gives `name/k` for each), `learning_rate`, and when
        iterations were timed since the previous display `seconds_per_iter` and
        `items_per_second` (items of the global batch, iter_size passes included). Its
        `scalars` {tag: value} is where a hook adds figures of its own, whatever its place in
        the list: record_display sees them all. A hook may log lines of its own here too
        (rank 0 writes them) about the iterations since the last display. Under MPI the strategy's per-rank figures
        belong there, under `mpi/` (e.g. `mpi/slowest_rank`, `mpi/slowest_rank_seconds_per_iter`,
        `mpi/communication_wait_fraction`)."""

    def record_display(self, solver, stats):
        """Every rank, after every hook's on_display for the iteration: `stats` is complete,
        `scalars` holding what any hook added. For hooks that record the figures (the
        TensorBoard writer), so that the order hooks were attached in does not matter."""

    def on_test(self, solver, index, outputs, loss):
        """Every rank, after test net `index` is scored: `outputs` [(name, mean)] as the
        "Test net output" lines print them; `loss` the "Test loss" line's value, or None."""

    def gradients_wanted(self, solver):
        """Every rank, before each update: whether on_gradients should see this iteration's
        gradients (the solver then waits for any still being reduced)."""
        return False

    def on_gradients(self, solver):
        """When a hook wanted them: the parameter diffs hold this iteration's final gradients
        (summed over the iter_size passes, averaged over the ranks), before clipping,
        regularization and the update rule."""

    def before_apply(self, solver, indices, iteration):
        """Every rank, holding `solver.update_lock`, right before the update rule of iteration
        `iteration` changes learnable parameters `indices` (None: all of them) and their
        history; the iteration's learning rate (and current_step) are known. Called once per
        parameter and iteration, in one or several groups (Hooks.pending_gradients). May
        return {index: (data, [history])}: arrays into which the update leaves those
        parameters' values from before it (updates.apply_update's `keep`)."""

    def gather(self, solver, index, array):
        """Every rank, for a snapshot: the whole of `array` (learnable parameter `index`'s data,
        diff or one of its update-rule history arrays) on rank 0, which writes the files;
        other ranks' results are not used. Chained; the solver asks for every parameter's
        arrays in the same order on every rank."""
        return array


class Solver:
    """A solver over a SolverParameter (or a solver prototxt path).

    pycaffe: `.net`, `.test_nets`, `.iter`, `.step(n)`, `.solve()`, `.snapshot()`,
    `.restore(path)`.  `level` / `stages` are the command line's --level / --stage
    (applied to the train net's state, as `caffe train` does). `context` is the run
    context (caffepy.context; caffepy.parallel.world on a multi-rank run); `hooks`
    holds the Hooks that join the loop; `action_fn` returns the signal handler's request.
    """

    forced_type = None
    # False: NumPy only (the reference the compiled kernels are tested against)
    use_kernels = True

    def __init__(self, param, source=None, level=None, stages=(), context=SINGLE,
                 keep_test_blobs=True):
        if isinstance(param, (str, os.PathLike)):
            source = os.fspath(param)
            param = upgrade.read_solver(source)
        else:
            param = upgrade.upgrade_solver(param, source or "<solver>")[0]     # a copy
        if self.forced_type:
            param.type = self.forced_type
        self.param = param
        self.source = source or "<solver>"
        self.hooks = []
        self.iter = 0
        self.current_step = 0
        self.plateau = lr_policy.Plateau()
        self.action_fn = None
        self.requested_early_exit = False
        self.smoothed_loss = 0.0
        self.losses = []
        self.last_snapshot = None
        self.rate = None             # the learning rate of the last update
        self.test_scores = []
        self._started = False
        self._snapshot_iter = None
        self.context = context
        self.is_root = context.rank == 0
        # The test phase, shared: every rank builds its test nets in the run's context (a
        # data layer reads its interleaved share of the records, model-parallel layers
        # stay split) and runs its share of the test_iter batches; the scores are summed
        # over the ranks (Hooks.reduce_scores).
        self.test_context = context
        self._deferred = {}         # layer index -> [learnable-param index]: updates not applied yet
        self._deferred_step = None  # (rate, iteration) of those updates
        # held while the update rule changes parameters: another thread that takes it sees
        # each parameter either before or after its update (caffepy.parallel.failsafe)
        self.update_lock = threading.Lock()
        self._check()
        snapshot.default_prefix(param, self.source)
        if self.is_root:
            snapshot.check_writable(param, self.source)
            snapshot.remove_stale(param)
        log.info(f"Initializing solver from parameters: {self.source}")
        if param.solver_mode == caffe_pb2.SolverParameter.GPU:
            log.info("solver_mode: GPU requested; caffepy runs on the CPU")
        if param.debug_info:
            log.warning(f"{self.source}: debug_info: per-layer debug output is not implemented; ignored")
        if param.random_seed >= 0:
            rng.seed(param.random_seed + context.rank)
        self.net = nets.init_train_net(param, self.source, level, stages, context=context)
        self.test_nets = nets.init_test_nets(param, self.source, self.net, context=self.test_context,
                                             keep_blobs=keep_test_blobs)
        first_use = {}
        for li, layer in enumerate(self.net.layers):
            for blob in layer.blobs:
                first_use.setdefault(id(blob), li)
        self._first_use = [first_use[id(b)] for b in self.net.learnable_params]
        shapes = [b.shape for b in self.net.learnable_params]
        self.rule = updates.make_rule(param, shapes, self.source)
        self.type = self.rule.type
        if param.local_lr_auto and self.type != "SGD":
            log.warning(f"{self.source}: local_lr_auto (LARS) applies to the SGD solver only, as in "
                        f"Intel Caffe; ignored for {self.type}")
        log.info("Solver scaffolding done.")

    # -- construction ----------------------------------------------------
    def _check(self):
        p, src = self.param, self.source
        snapshot.check_format(p, src)
        if p.regularization_type not in ("L1", "L2"):
            raise SolverError(f"{src}: regularization_type: must be L1 or L2, got '{p.regularization_type}'")
        if p.iter_size < 1:
            raise SolverError(f"{src}: iter_size: must be >= 1, got {p.iter_size}")
        if p.average_loss < 1:
            raise SolverError(f"{src}: average_loss: must be >= 1, got {p.average_loss}")
        if p.display < 0 or p.snapshot < 0 or p.test_interval < 0:
            field = "display" if p.display < 0 else "snapshot" if p.snapshot < 0 else "test_interval"
            raise SolverError(f"{src}: {field}: must be >= 0, got {getattr(p, field)}")
        lr_policy.check(p, src)
        updates.rule_class(p, src)      # an unknown type or bad setting fails before the nets are built
        for i, n in enumerate(p.test_iter):
            if n < 0:
                raise SolverError(f"{src}: test_iter[{i}]: must be >= 0, got {n}")
        if p.eval_type not in ("classification", "detection"):
            raise SolverError(f"{src}: eval_type: must be classification or detection, got '{p.eval_type}'")
        if p.eval_type == "detection" and p.ap_version not in bbox.AP_VERSIONS:
            raise SolverError(f"{src}: ap_version: must be one of {', '.join(bbox.AP_VERSIONS)}, "
                              f"got '{p.ap_version}'")

    def share_weights(self, net):
        """pycaffe's Solver.share_weights: `net` sees the train net's weights (by layer name)."""
        nets.share_trained_layers(self.net, net)

    # -- hooks ----------------------------------------------------------------
    def _hooks(self, name):
        return [getattr(h, name) for h in self.hooks if hasattr(h, name)]

    def sumsq(self, index, array):
        """Squared L2 norm of a parameter's data or diff (a hook may sum it over ranks)."""
        for fn in self._hooks("sumsq"):
            value = fn(self, index, array)
            if value is not None:
                return float(value)
        flat = array.reshape(-1)
        return float(np.dot(flat, flat))

    def _gather(self, index, array):
        for fn in self._hooks("gather"):
            array = fn(self, index, array)
        return array

    def _start(self):
        if not self._started:
            self._started = True
            for fn in self._hooks("on_start"):
                fn(self)

    def get_requested_action(self):
        """Caffe's GetRequestedAction: the signal handler's request (`action_fn`, one of
        ACTIONS), as the hooks agree on it across ranks."""
        request = "none" if self.action_fn is None else self.action_fn()
        for fn in self._hooks("agree_action"):
            request = fn(self, request)
        return request

    # -- the loop -------------------------------------------------------------
    def solve(self, resume_file=None):
        """Caffe's Solver::Solve: train to max_iter, snapshot, final display and test."""
        p = self.param
        log.info(f"Solving {self.net.name}")
        log.info(f"Learning Rate Policy: {p.lr_policy}")
        self.requested_early_exit = False
        if resume_file:
            log.info(f"Restoring previous solver status from {resume_file}")
            self.restore(resume_file)
        start_iter = self.iter
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self.requested_early_exit:
            log.info("Optimization stopped early.")
            return
        if p.display and self.iter % p.display == 0:
            loss = self._reduce_loss(self.net.forward_from_to())
            self._update_smoothed_loss(loss, self.iter - start_iter)
            log.info(f"Iteration {self.iter}, loss = {fmt(self.smoothed_loss)}")
        if p.test_interval and (self.iter - p.test_offset) % p.test_interval == 0:
            self._test_phase()
        log.info("Optimization Done.")

    def step(self, iters):
        """Run `iters` iterations (Caffe's Solver::Step)."""
        p = self.param
        start_iter = self.iter
        stop_iter = self.iter + iters
        self.losses = []
        self.smoothed_loss = 0.0
        self._start()
        self._step_start = start_iter
        timer = time.perf_counter()
        iterations_last = self.iter
        layer_done = self._hooks("on_layer_done")
        on_layer_done = (lambda li: [fn(self, li) for fn in layer_done]) if layer_done else None
        lag = self._lagging_hook()
        while self.iter < stop_iter:
            # Intel's test_offset shifts the test iterations (test_interval counts from it)
            if (p.test_interval and (self.iter - p.test_offset) % p.test_interval == 0
                    and (self.iter > 0 or p.test_initialization)):
                if lag is not None and self._settle(lag):
                    break
                self._test_phase()
                if self.requested_early_exit:
                    break
            self._clear_diffs()
            display = bool(p.display) and self.iter % p.display == 0
            loss = F32(0)
            error = None
            for _ in range(p.iter_size):
                pass_loss = self.net.forward_from_to(before_layer=self._before_layer if self._deferred else None)
                if error is None and not math.isfinite(pass_loss):
                    error = self._nonfinite_error(pass_loss)     # names the layer while its top is there
                # backward and the loss reduction still run: other ranks wait for them
                self.net.backward_from_to(on_layer_done=on_layer_done)
                loss += F32(pass_loss)
            loss /= F32(p.iter_size)
            record = IterationRecord(self.iter, float(loss), display)
            if display:
                self._check_weights_finite()
                record.outputs = self._outputs(self.net)
                record.lapse, record.timed = _seconds_since(timer), self.iter - iterations_last
                timer = time.perf_counter()
                iterations_last = self.iter
            if lag is not None:
                record.request = "none" if self.action_fn is None else self.action_fn()
                settled = lag.post_record(self, record)
            else:
                record.loss = self._reduce_loss(record.loss)
                if display:
                    record.outputs = self._reduce_scores(record.outputs) / F32(self.context.size)
                settled = record
            if error is not None:
                raise error
            if settled is not None:
                self._report(settled)
            for fn in self._hooks("before_update"):
                fn(self)
            self.apply_update()
            record.rate = self.rate
            if settled is not None and settled.display:
                self._display_hooks(settled)
            self.iter += 1
            if lag is None:
                request = self.get_requested_action()
            else:
                request = "none" if settled is None else settled.request
            if self._act(request):
                break
        if lag is not None:
            self._settle(lag)                # the last iteration's lines and request
        self.finish_updates()

    def _lagging_hook(self):
        """The hook that settles each iteration's record across ranks in the background
        (Hooks.lags_records), or None. Not when the learning rate reads the smoothed loss
        (plateau): the update of iteration i needs the loss of iteration i."""
        lagging = [h for h in self.hooks if getattr(h, "lags_records", False)]
        if not lagging or self.param.lr_policy == "plateau":
            return None
        assert len(lagging) == 1, "one hook at most settles the iteration records"
        return lagging[0]

    def _settle(self, lag):
        """The record the lagging hook still holds: its lines, its display hooks and its
        agreed request. Returns True when that request stops the run."""
        record = lag.settle_record(self)
        if record is None:
            return False
        self._report(record)
        if record.display:
            self._display_hooks(record)
        return self._act(record.request, periodic=False)

    def _act(self, request, periodic=True):
        """Snapshot when due (`periodic`) or asked; True when the request stops the run."""
        p = self.param
        if (periodic and p.snapshot and self.iter % p.snapshot == 0) or request in ("snapshot", "snapshot_stop"):
            self.snapshot()
        if request in ("stop", "snapshot_stop"):
            self.requested_early_exit = True
            return True
        return False

    def _report(self, record):
        """A settled record: the loss checked and smoothed, and at a display iteration
        Caffe's lines (the loss line, then each train net output)."""
        if not math.isfinite(record.loss):
            late = record.iteration if record.iteration != self.iter else None
            raise self._nonfinite_error(record.loss, late)
        self._update_smoothed_loss(record.loss, record.iteration - self._step_start)
        if not record.display:
            return
        p = self.param
        per_s = F32(record.timed) / (record.lapse or F32(1))
        log.info(f"Iteration {record.iteration} ({fmt(per_s)} iter/s, {fmt(record.lapse)}s/{p.display} iters), "
                 f"loss = {fmt(self.smoothed_loss)}")
        record.shown = dict(iteration=record.iteration, loss=self.smoothed_loss,
                            outputs=self._display_outputs(record.outputs), scalars={})
        if record.timed and record.lapse:
            record.shown["seconds_per_iter"] = float(record.lapse) / record.timed
            record.shown["items_per_second"] = self._items_per_iter() * record.timed / float(record.lapse)

    def _display_hooks(self, record):
        shown = record.shown
        shown["learning_rate"] = record.rate
        for fn in self._hooks("on_display"):
            fn(self, shown)
        for fn in self._hooks("record_display"):
            fn(self, shown)

    def _reduce_loss(self, loss):
        for fn in self._hooks("reduce_loss"):
            loss = float(fn(self, loss))
        return loss

    def _update_smoothed_loss(self, loss, position):
        """Caffe's UpdateSmoothedLoss; `position`: the iteration's place in this step."""
        n = self.param.average_loss
        if len(self.losses) < n:
            self.losses.append(loss)
            size = len(self.losses)
            smoothed = (F32(self.smoothed_loss) * F32(size - 1) + F32(loss)) / F32(size)
        else:
            idx = position % n
            smoothed = F32(self.smoothed_loss) + (F32(loss) - F32(self.losses[idx])) / F32(n)
            self.losses[idx] = loss
        self.smoothed_loss = float(smoothed)

    def _display_outputs(self, values):
        """Log the train net's outputs of a display iteration's last pass, `values` (on N
        ranks their mean over the ranks: the global batch's figures, as the loss line's).
        Returns [(name, value)]."""
        net = self.net
        index = 0
        shown = []
        for name in net.outputs:
            weight = net.blob_loss_weights.get(name, 0.0)
            count = net.blobs[name].count
            for k in range(count):
                value = values[index]
                extra = f" (* {fmt(weight)} = {fmt(F32(weight) * value)} loss)" if weight else ""
                log.info(f"    Train net output #{index}: {name} = {fmt(float(value))}{extra}")
                shown.append((name if count == 1 else f"{name}/{k}", float(value)))
                index += 1
        return shown

    def _items_per_iter(self):
        """Items one iteration trains on over every rank: the train net's batch x iter_size x ranks."""
        return (nets.local_batch(self.net) or 0) * self.param.iter_size * self.context.size

    @staticmethod
    def _outputs(net):
        return (np.concatenate([net.blobs[name].data.reshape(-1) for name in net.outputs]).astype(F32)
                if net.outputs else np.zeros(0, F32))

    def _reduce_scores(self, values):
        """Sums over the ranks (float32, as each rank's sums: one rank's figures are Caffe's)."""
        for fn in self._hooks("reduce_scores"):
            values = np.asarray(fn(self, values), np.float64).astype(F32)
        return values

    def _check_weights_finite(self):
        """At display iterations: a loss layer may clamp non-finite scores to a finite loss,
        so look at the weights themselves (one pass over them)."""
        for layer in self.net.layers:
            for k, blob in enumerate(layer.blobs):
                total = float(np.add.reduce(blob.data.reshape(-1), dtype=np.float64))
                if not math.isfinite(total):
                    raise SolverError(f"{self.net.source}: layer '{layer.name}' ({layer.type}): blobs[{k}]: "
                                      f"weights went non-finite by iteration {self.iter}, got a sum of "
                                      f"{fmt(total)}. Training stopped; {self._kept()}. Lower base_lr or "
                                      f"set clip_gradients")

    def _kept(self):
        return (f"the last snapshot, {self.last_snapshot[1]}, was kept" if self.last_snapshot
                else "no snapshot was written")

    def _nonfinite_error(self, loss, iteration=None):
        """A SolverError naming the iteration and the first layer whose top went non-finite
        (`iteration`: an earlier one, settled across ranks late: its tops are gone)."""
        net = self.net
        culprit = None
        for layer, tops in zip(net.layers, net.top_vecs) if iteration is None else ():
            for blob in tops:
                if not np.isfinite(blob.data).all():
                    culprit = (layer, blob)
                    break
            if culprit:
                break
        hint = f"Training stopped; {self._kept()}. Lower base_lr or set clip_gradients"
        iteration = self.iter if iteration is None else iteration
        if culprit:
            layer, blob = culprit
            return SolverError(f"{net.source}: layer '{layer.name}' ({layer.type}): top '{blob.name}': "
                               f"went non-finite at iteration {iteration}, got loss = {fmt(loss)}. {hint}")
        return SolverError(f"{self.source}: iteration {iteration}: loss is not finite, got {fmt(loss)}. {hint}")

    # -- the update -----------------------------------------------------------
    def learning_rate(self):
        self.plateau.smoothed_loss = self.smoothed_loss
        rate, self.current_step, status = lr_policy.learning_rate(self.param, self.iter, self.current_step,
                                                                  self.plateau)
        for line in status:
            log.info(line)
        return rate

    def apply_update(self):
        """Caffe's SGDSolver::ApplyUpdate: this iteration's rate, then updates.apply_update
        for the parameters whose gradients are final; those the hooks still complete
        (Hooks.pending_gradients) are updated when they are needed (_before_layer)."""
        p = self.param
        rate = self.rate = self.learning_rate()
        if p.display and self.iter % p.display == 0:
            log.info(f"Iteration {self.iter}, lr = {fmt(rate)}")
        pending = set()
        for fn in self._hooks("pending_gradients"):
            pending.update(fn(self))
        wanted = any(fn(self) for fn in self._hooks("gradients_wanted"))
        if pending and (p.disabled_update or p.clip_gradients >= 0 or wanted):
            self._await(sorted(pending))        # the clipping norm (or a hook) needs every gradient
            pending = set()
        if wanted:
            for fn in self._hooks("on_gradients"):
                fn(self)
        if p.disabled_update:
            return
        now = None
        if pending:
            now = [i for i in range(len(self.net.learnable_params)) if i not in pending]
            for i in sorted(pending):
                self._deferred.setdefault(self._first_use[i], []).append(i)
            self._deferred_step = (rate, self.iter)
        self._update(rate, self.iter, now)

    def _update(self, rate, it, indices=None):
        with self.update_lock:
            keep = {}
            for fn in self._hooks("before_apply"):
                keep.update(fn(self, indices, it) or {})
            updates.apply_update(self.param, self.net, self.rule, rate, it, self.sumsq,
                                 updates.kernels() if self.use_kernels else None, indices,
                                 keep or None)

    def _await(self, indices):
        for fn in self._hooks("await_gradients"):
            fn(self, indices)

    def _before_layer(self, layer_index):
        """The forward is about to run layer `layer_index`: apply the deferred updates of the
        parameters it is the first to use, then clear their diffs for this backward."""
        indices = self._deferred.pop(layer_index, None)
        if indices:
            self._await(indices)
            self._update(*self._deferred_step, indices)
            for i in indices:
                self.net.learnable_params[i].diff[...] = 0

    def finish_updates(self):
        """Apply every deferred update (before a test, a snapshot, the end of `step`): the
        weights are then those of Caffe's loop."""
        if not self._deferred:
            return
        indices = sorted(i for group in self._deferred.values() for i in group)
        self._deferred = {}
        self._await(indices)
        self._update(*self._deferred_step, indices)

    def _clear_diffs(self):
        """Clear the parameter diffs for this iteration's backward (those with a deferred update
        are cleared once it is applied)."""
        if not self._deferred:
            self.net.clear_param_diffs()
            return
        waiting = {i for group in self._deferred.values() for i in group}
        for i, blob in enumerate(self.net.learnable_params):
            if i not in waiting:
                blob.diff[...] = 0

    # -- testing --------------------------------------------------------------
    def _test_phase(self):
        """Every rank: the updates done, the hooks ready the test nets, every rank tests."""
        self.finish_updates()
        for fn in self._hooks("before_test"):
            fn(self)
        self.test_all()

    def test_all(self):
        self.test_scores = []
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            self.test(i)

    def test(self, index=0):
        """Caffe's Solver::Test: average each output of test net `index` over test_iter batches.

        On N ranks rank r runs batches r, r+N, ... of the test_iter (its test net's data
        layer reads its interleaved share of the records: together the ranks read the
        records one process reads when N divides test_iter), and the sums are added over
        the ranks. Every rank runs ceil(test_iter / N) forwards, so that layers that
        communicate (model parallel) meet; a forward past test_iter is not counted."""
        p = self.param
        log.info(f"Iteration {self.iter}, Testing net (#{index})")
        net = self.test_nets[index]
        n = p.test_iter[index]
        rank, ranks = self.test_context.rank, self.test_context.size
        detection = p.eval_type == "detection"
        scores = np.zeros(len(self._outputs(net)), F32)
        found = [bbox.MeanAP() for _ in net.outputs] if detection else None
        loss = F32(0)
        for batch in range(rank, rank + ranks * -(-n // ranks), ranks):
            # a signal's request is agreed on by every rank, as during training
            request = self.get_requested_action()
            while request != "none":
                if request in ("snapshot", "snapshot_stop"):
                    self.snapshot()
                if request in ("stop", "snapshot_stop"):
                    self.requested_early_exit = True
                request = self.get_requested_action()
            if self.requested_early_exit:
                break
            batch_loss = net.forward_from_to()
            if batch < n:
                if p.test_compute_loss:
                    loss += F32(batch_loss)
                if detection:
                    for acc, name in zip(found, net.outputs):
                        acc.add(net.blobs[name].data)
                else:
                    scores += self._outputs(net)
        if self.requested_early_exit:
            log.info("Test interrupted.")
            return
        if detection:
            self._test_detection(index, net, found, loss, n)
            return
        totals = self._reduce_scores(np.concatenate([scores, np.array([loss], F32)]))
        scores, loss = totals[:-1], totals[-1]
        if p.test_compute_loss and n:
            log.info(f"Test loss: {fmt(loss / F32(n))}")
        results = []
        index_out = 0
        for name in net.outputs:
            weight = net.blob_loss_weights.get(name, 0.0)
            for _ in range(net.blobs[name].count):
                mean = scores[index_out] / F32(n) if n else F32(0)
                extra = f" (* {fmt(weight)} = {fmt(F32(weight) * mean)} loss)" if weight else ""
                log.info(f"    Test net output #{index_out}: {name} = {fmt(mean)}{extra}")
                results.append((name, float(mean)))
                index_out += 1
        while len(self.test_scores) <= index:
            self.test_scores.append([])
        self.test_scores[index] = results
        for fn in self._hooks("on_test"):
            fn(self, index, results, float(loss / F32(n)) if p.test_compute_loss and n else None)

    def _test_detection(self, index, net, found, loss, n):
        """Caffe's TestDetection: each output's DetectionEvaluate rows, gathered from every rank,
        scored as mAP with the solver's ap_version."""
        p = self.param
        totals = self._reduce_scores(np.array([loss], F32))
        if p.test_compute_loss and n:
            log.info(f"Test loss: {fmt(totals[0] / F32(n))}")
        gathered = self.test_context.gather(found)
        results = None
        if gathered is not None and self.test_context.rank == 0:
            for other in gathered[1:]:
                for acc, more in zip(found, other):
                    acc.merge(more)
            results = []
            for i, (name, acc) in enumerate(zip(net.outputs, found)):
                m_ap, aps, missing = acc.result(p.ap_version)
                for label in missing:
                    log.warning(f"Missing true_pos for label: {label}")
                if p.show_per_class_result:
                    for label, ap in aps.items():
                        log.info(f"class{label}: {fmt(ap)}")
                log.info(f"    Test net output #{i}: {name} = {fmt(m_ap)}")
                results.append((name, m_ap))
        results = self.test_context.agree(results)
        while len(self.test_scores) <= index:
            self.test_scores.append([])
        self.test_scores[index] = results

    # -- snapshots ------------------------------------------------------------
    def snapshot(self):
        """Write <prefix>_iter_<N>.caffemodel and .solverstate; returns their paths (None on
        the ranks that do not write). Every rank calls it at the same iteration: the hooks
        gather the parameters split across ranks whole onto rank 0, which writes."""
        if self._snapshot_iter == self.iter:
            return self.last_snapshot
        self.finish_updates()
        write_diff = self.param.snapshot_diff
        arrays, states = {}, []
        for i, blob in enumerate(self.net.learnable_params):
            arrays[blob] = (self._gather(i, blob.data), self._gather(i, blob.diff) if write_diff else None)
            states.append([self._gather(i, h) for h in self.rule.state(i)])
        ranks = self.context.gather(self.run_state())
        if self.is_root:
            self.last_snapshot = snapshot.write(self.param, self.iter, self.net, states, self.current_step,
                                                self.plateau, arrays, run_state={"ranks": ranks})
        self._snapshot_iter = self.iter
        return self.last_snapshot

    def run_state(self):
        """This rank's part of a snapshot's run state: its random generator and where the
        train net's data layers stand (the test nets start over on resume, as in Caffe)."""
        layers = {}
        for layer in self.net.layers:
            state = layer.read_state()
            if state is not None:
                layers[layer.name] = state
        return {"rng": rng.get_state(), "layers": layers}

    def restore(self, state_file):
        """Resume from a .solverstate: weights from the caffemodel it names, history, iter,
        current_step and (when saved by caffepy) the random generator state of this rank and
        the read positions of the train net's data layers."""
        state_file = os.fspath(state_file)
        state = snapshot.restore(state_file, self.net, self.rule)
        self._restore_run(snapshot.saved_run_state(state, state_file), state_file)
        self.iter = state.iter
        self.current_step = state.current_step
        self.plateau.minimum_loss = state.minimum_loss
        self.plateau.iter_last_event = state.iter_last_event

    def _restore_run(self, run, state_file):
        readers = [layer for layer in self.net.layers if layer.read_state() is not None]
        if run is None:
            if readers:
                log.info(f"{state_file} has no data read positions (written by Caffe or an older caffepy): "
                         f"data layers {', '.join(r.name for r in readers)} start from their first record, "
                         f"as in Caffe")
            return
        ranks = run["ranks"]
        same = len(ranks) == self.context.size
        index = self.context.rank if same else 0
        mine = ranks[index]
        if same:
            rng.set_state(mine["rng"])
        else:           # each rank keeps rank 0's generator (RNG_STATE_FIELD), as before
            log.info(f"{state_file} was written by {len(ranks)} ranks, this run has {self.context.size}: "
                     f"the random draws will not be those of an uninterrupted run")
        for layer in readers:
            saved = mine["layers"].get(layer.name)
            if saved is None:
                log.info(f"{state_file}: no read position for data layer '{layer.name}': it starts from "
                         f"its first record")
                continue
            try:
                layer.set_read_state(saved, len(ranks))
            except CaffepyError as e:
                raise SolverError(f"{state_file}: run state: ranks[{index}]: layer "
                                  f"'{layer.name}': {e}") from None


# -- pycaffe's solver classes ------------------------------------------------
# one per solver type in updates.RULES: caffe.SGDSolver, caffe.NesterovSolver, ...
TYPED = {name: type(f"{name}Solver", (Solver,), {"forced_type": name,
                                                 "__doc__": f"A {name} solver (pycaffe's caffe.{name}Solver)."})
         for name in updates.RULES}
SGDSolver = TYPED["SGD"]
NesterovSolver = TYPED["Nesterov"]
AdaGradSolver = TYPED["AdaGrad"]
RMSPropSolver = TYPED["RMSProp"]
AdaDeltaSolver = TYPED["AdaDelta"]
AdamSolver = TYPED["Adam"]


def get_solver(path):
    """pycaffe's caffe.get_solver: an instance of the class for the type named in the file
    (an SGDSolver for `type: "SGD"`, ...)."""
    return TYPED.get(upgrade.read_solver(path).type, Solver)(path)


__all__ = ["ACTIONS", "Hooks", "Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
           "AdamSolver", "get_solver"]
