"""The training loop: Caffe's Solver::Step / Solve / Test, snapshots and restore.

One iteration (Step): clear parameter diffs; test if it is time; run
forward/backward `iter_size` times (parameter diffs accumulate); smooth and
display the loss; then ApplyUpdate: learning rate, gradient clipping, and per
parameter normalize (1/iter_size), regularize (L2 / L1 weight decay), local
rate (lr_mult, or LARS), the update rule, and `data -= step`.

Multi-rank hooks: `solver.hooks` holds objects that may define
    on_start(solver)                  nets built, weights loaded/restored, before iteration one
    on_layer_done(solver, layer)      a layer's backward is done; called in every one of the
                                      iter_size passes (its gradients are final in the last one)
    before_update(solver)             all forward/backward done, before lr/regularization/update
    reduce_loss(solver, loss) -> loss the iteration's loss, for display and the NaN check
    sumsq(solver, param_index, array) -> float   squared L2 norm (clip_gradients, LARS)
Only rank 0 logs, tests and writes snapshots; every rank runs the update.

Snapshots are Caffe's: <prefix>_iter_<N>.caffemodel and .solverstate (BINARYPROTO),
written atomically.  The .solverstate also carries the random generator state
(an extra field Caffe ignores when it reads the file), so a resumed run draws
the same numbers an uninterrupted one would.
"""
import json
import math
import os
import time

import numpy as np

from .. import log, rng
from ..blobproto import array_to_blobproto, blobproto_to_array
from ..errors import ShapeError, SolverError
from ..proto import caffe_pb2
from . import lr_policy
from .updates import make_rule, rule_class

# Field number of caffepy's extension inside SolverState: the random generator
# state as JSON.  Unknown to Caffe, whose reader skips it.
RNG_STATE_FIELD = 1001

ACTIONS = ("none", "stop", "snapshot")


def fmt(x):
    """A number as C++'s ostream prints it by default (6 significant digits)."""
    return f"{x:.6g}"


def _rank():
    from ..parallel import world
    return world.rank


def _kernels():
    """The compiled fused updates (cext/solver.pyx), or None when not built."""
    try:
        from ..kernels import solver
    except ImportError:
        return None
    return solver


class Solver:
    """A solver over a SolverParameter (or a solver prototxt path).

    pycaffe: `.net`, `.test_nets`, `.iter`, `.step(n)`, `.solve()`, `.snapshot()`,
    `.restore(path)`.  `level` / `stages` are the command line's --level / --stage
    (applied to the train net's state, as `caffe train` does).
    """

    forced_type = None
    # False: NumPy only (the reference the compiled kernels are tested against)
    use_kernels = True

    def __init__(self, param, source=None, level=None, stages=()):
        from .. import prototxt
        if isinstance(param, (str, os.PathLike)):
            source = os.fspath(param)
            param = prototxt.read_solver(source)
        else:
            copy = caffe_pb2.SolverParameter()
            copy.CopyFrom(param)
            param = prototxt.upgrade_solver(copy, source or "<solver>")[0]
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
        self.test_scores = []
        self._started = False
        self._snapshot_iter = None
        self.is_root = _rank() == 0
        self._check()
        self._default_snapshot_prefix()
        self._check_snapshot_writable()
        log.info(f"Initializing solver from parameters: {self.source}")
        if param.solver_mode == caffe_pb2.SolverParameter.GPU:
            log.info("solver_mode: GPU requested; caffepy runs on the CPU")
        if param.debug_info:
            log.warning(f"{self.source}: debug_info: per-layer debug output is not implemented; ignored")
        if param.random_seed >= 0:
            rng.seed(param.random_seed + _rank())
        self._init_nets(level, stages)
        shapes = [b.shape for b in self.net.learnable_params]
        self.rule = make_rule(param, shapes, self.source)
        self.type = self.rule.type
        if param.local_lr_auto and self.type != "SGD":
            log.warning(f"{self.source}: local_lr_auto (LARS) applies to the SGD solver only, as in "
                        f"Intel Caffe; ignored for {self.type}")
        log.info("Solver scaffolding done.")

    # -- construction ----------------------------------------------------
    def _check(self):
        p, src = self.param, self.source
        if p.snapshot_format == caffe_pb2.SolverParameter.HDF5:
            raise SolverError(f"{src}: snapshot_format: HDF5 snapshots are not supported, got HDF5. "
                              f"Use snapshot_format: BINARYPROTO (the default)")
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
        rule_class(p, src)      # an unknown type or bad setting fails before the nets are built
        for i, n in enumerate(p.test_iter):
            if n < 0:
                raise SolverError(f"{src}: test_iter[{i}]: must be >= 0, got {n}")

    def _default_snapshot_prefix(self):
        """Caffe's UpgradeSnapshotPrefixProperty: no prefix -> the solver file's path without
        its extension; a directory -> that directory / the solver file's stem."""
        p = self.param
        if self.source == "<solver>" or not os.path.exists(self.source):
            return
        stem = os.path.splitext(self.source)[0]
        if not p.HasField("snapshot_prefix"):
            p.snapshot_prefix = stem
            log.info(f"snapshot_prefix was not specified and is set to {p.snapshot_prefix}")
        elif os.path.isdir(p.snapshot_prefix):
            p.snapshot_prefix = os.path.join(p.snapshot_prefix, os.path.basename(stem))
            log.info(f"snapshot_prefix is a directory and is replaced to {p.snapshot_prefix}")

    def _check_snapshot_writable(self):
        """Caffe's CheckSnapshotWritePermissions: find out now, not after hours of training."""
        p = self.param
        if not self.is_root or not (p.snapshot or p.snapshot_after_train):
            return
        directory = os.path.dirname(p.snapshot_prefix) or "."
        if not os.path.isdir(directory):
            raise SolverError(f"{self.source}: snapshot_prefix: the directory '{directory}' does not exist, "
                              f"got '{p.snapshot_prefix}'. Create it or change snapshot_prefix")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise SolverError(f"{self.source}: snapshot_prefix: cannot write to '{directory}', got "
                              f"'{p.snapshot_prefix}'. Make sure the directory is writable")

    def _init_nets(self, level, stages):
        from .. import prototxt
        p, src = self.param, self.source
        train = prototxt.solver_train_net_param(p, src, level=level, stages=stages)
        log.info(f"Creating training net from {train.origin}" if "file" in train.origin
                 else f"Creating training net specified in {train.origin}.")
        self.net = self._build_net(train)
        self.test_nets = []
        for i, test in enumerate(prototxt.solver_test_net_params(p, src)):
            log.info(f"Creating test net (#{i}) specified by {test.origin}")
            net = self._build_net(test)
            self._share_trained_layers(net)
            self.test_nets.append(net)
        for entry in p.weights:
            for path in entry.split(","):
                if path:
                    log.info(f"Finetuning from {path}")
                    self.net.copy_from(path)

    def _build_net(self, solver_net):
        from ..net import Net
        s = solver_net.state
        origin = solver_net.origin
        where = origin.split(": ", 1)[1] if "file: " in origin else f"{self.source}: {origin}"
        return Net(solver_net.param, phase=s.phase, level=s.level, stages=list(s.stage), source=where)

    def _share_trained_layers(self, test_net):
        """Caffe's ShareTrainedLayersWith: a test layer named like a train layer sees its weights."""
        train_layers = self.net.layer_dict
        for name, layer in test_net.layer_dict.items():
            source = train_layers.get(name)
            if source is None or not layer.blobs:
                continue
            if len(source.blobs) != len(layer.blobs):
                raise ShapeError(f"{test_net.source}: layer '{name}' ({layer.type}): blobs: the test net has "
                                 f"{len(layer.blobs)} parameter blobs, the train net {len(source.blobs)}")
            for i, (mine, theirs) in enumerate(zip(layer.blobs, source.blobs)):
                if mine.shape != theirs.shape:
                    raise ShapeError(f"{test_net.source}: layer '{name}' ({layer.type}): blobs[{i}]: cannot "
                                     f"share the train net's weights of shape {theirs.shape}, got {mine.shape}")
                mine.share_data(theirs)

    def share_weights(self, net):
        """pycaffe's Solver.share_weights: `net` sees the train net's weights (by layer name)."""
        self._share_trained_layers(net)

    # -- hooks ----------------------------------------------------------------
    def _hooks(self, name):
        return [getattr(h, name) for h in self.hooks if hasattr(h, name)]

    def sumsq(self, index, array):
        """Squared L2 norm of a parameter's data or diff (a hook may sum it over ranks)."""
        for fn in self._hooks("sumsq"):
            return float(fn(self, index, array))
        flat = array.reshape(-1)
        return float(np.dot(flat, flat))

    def _start(self):
        if not self._started:
            self._started = True
            for fn in self._hooks("on_start"):
                fn(self)

    def get_requested_action(self):
        if self.action_fn is None:
            return "none"
        return self.action_fn()

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
            self._update_smoothed_loss(loss, start_iter)
            log.info(f"Iteration {self.iter}, loss = {fmt(self.smoothed_loss)}")
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info("Optimization Done.")

    def step(self, iters):
        """Run `iters` iterations (Caffe's Solver::Step)."""
        p = self.param
        start_iter = self.iter
        stop_iter = self.iter + iters
        self.losses = []
        self.smoothed_loss = 0.0
        self._start()
        timer = time.perf_counter()
        iterations_last = self.iter
        layer_done = self._hooks("on_layer_done")
        on_layer_done = (lambda li: [fn(self, li) for fn in layer_done]) if layer_done else None
        while self.iter < stop_iter:
            self.net.clear_param_diffs()
            if (p.test_interval and self.iter % p.test_interval == 0
                    and (self.iter > 0 or p.test_initialization)):
                if self.is_root:
                    self.test_all()
                if self.requested_early_exit:
                    break
            display = p.display and self.iter % p.display == 0
            loss = 0.0
            error = None
            for _ in range(p.iter_size):
                pass_loss = self.net.forward_from_to()
                if error is None and not math.isfinite(pass_loss):
                    error = self._nonfinite_error(pass_loss)     # names the layer while its top is there
                # backward and the loss reduction still run: other ranks wait for them
                self.net.backward_from_to(on_layer_done=on_layer_done)
                loss += pass_loss
            loss /= p.iter_size
            loss = self._reduce_loss(loss)
            if error is not None:
                raise error
            if not math.isfinite(loss):
                raise self._nonfinite_error(loss)
            self._update_smoothed_loss(loss, start_iter)
            if display:
                self._check_weights_finite()
                lapse = time.perf_counter() - timer
                per_s = (self.iter - iterations_last) / (lapse or 1.0)
                log.info(f"Iteration {self.iter} ({fmt(per_s)} iter/s, {fmt(lapse)}s/{p.display} iters), "
                         f"loss = {fmt(self.smoothed_loss)}")
                timer = time.perf_counter()
                iterations_last = self.iter
                self._display_outputs()
            for fn in self._hooks("before_update"):
                fn(self)
            self.apply_update()
            self.iter += 1
            request = self.get_requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0) or request in ("snapshot", "snapshot_stop"):
                self.snapshot()
            if request in ("stop", "snapshot_stop"):
                self.requested_early_exit = True
                break

    def _reduce_loss(self, loss):
        for fn in self._hooks("reduce_loss"):
            loss = float(fn(self, loss))
        return loss

    def _update_smoothed_loss(self, loss, start_iter):
        n = self.param.average_loss
        if len(self.losses) < n:
            self.losses.append(loss)
            size = len(self.losses)
            self.smoothed_loss = (self.smoothed_loss * (size - 1) + loss) / size
        else:
            idx = (self.iter - start_iter) % n
            self.smoothed_loss += (loss - self.losses[idx]) / n
            self.losses[idx] = loss

    def _display_outputs(self):
        net = self.net
        index = 0
        for name in net.outputs:
            weight = net.blob_loss_weights.get(name, 0.0)
            for value in net.blobs[name].data.reshape(-1):
                extra = f" (* {fmt(weight)} = {fmt(weight * float(value))} loss)" if weight else ""
                log.info(f"    Train net output #{index}: {name} = {fmt(float(value))}{extra}")
                index += 1

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

    def _nonfinite_error(self, loss):
        """A SolverError naming the iteration and the first layer whose top went non-finite."""
        net = self.net
        culprit = None
        for layer, tops in zip(net.layers, net.top_vecs):
            for blob in tops:
                if not np.isfinite(blob.data).all():
                    culprit = (layer, blob)
                    break
            if culprit:
                break
        hint = f"Training stopped; {self._kept()}. Lower base_lr or set clip_gradients"
        if culprit:
            layer, blob = culprit
            return SolverError(f"{net.source}: layer '{layer.name}' ({layer.type}): top '{blob.name}': "
                               f"went non-finite at iteration {self.iter}, got loss = {fmt(loss)}. {hint}")
        return SolverError(f"{self.source}: iteration {self.iter}: loss is not finite, got {fmt(loss)}. {hint}")

    # -- the update -----------------------------------------------------------
    def learning_rate(self):
        self.plateau.smoothed_loss = self.smoothed_loss
        rate, self.current_step, status = lr_policy.learning_rate(self.param, self.iter, self.current_step,
                                                                  self.plateau)
        for line in status:
            log.info(line)
        return rate

    def apply_update(self):
        """Caffe's SGDSolver::ApplyUpdate (with Intel Caffe's warm-up and LARS)."""
        p = self.param
        rate = self.learning_rate()
        if p.display and self.iter % p.display == 0:
            log.info(f"Iteration {self.iter}, lr = {fmt(rate)}")
        if p.disabled_update:
            return
        self.clip_gradients()
        momentum = p.momentum
        is_sgd = self.type == "SGD"
        if is_sgd and lr_policy.in_warmup(p, self.iter):
            # Intel Caffe's momentum correction while the rate ramps up; a zero previous
            # rate (warmup_start_lr 0 at the first step) would divide by zero: no correction
            prev = lr_policy.warmup_rate(p, self.iter - 1)
            if prev > 0:
                momentum *= rate / prev
        net = self.net
        decay = p.weight_decay
        l1 = p.regularization_type == "L1"
        norm = 1.0 / p.iter_size
        fused = _kernels() if self.use_kernels else None
        for i, blob in enumerate(net.learnable_params):
            lr_mult = net.params_lr[i]
            if lr_mult == 0:
                # no step to take (Intel Caffe skips these; Caffe's step would be 0)
                continue
            g = blob.diff
            local_decay = decay * net.params_weight_decay[i]
            if fused is not None:
                w1, g1 = blob.data.reshape(-1), g.reshape(-1)
                if is_sgd and p.local_lr_auto:
                    fused.regularize(w1, g1, norm, local_decay, l1)
                    local = self._lars_rate(i, blob, lr_mult)
                    self.rule.fused(fused, i, w1, g1, 1.0, 0.0, False, rate * local, self.iter, momentum)
                else:
                    self.rule.fused(fused, i, w1, g1, norm, local_decay, l1, rate * lr_mult, self.iter,
                                    momentum)
                continue
            if p.iter_size > 1:
                g *= norm
            if local_decay:
                g += local_decay * (np.sign(blob.data) if l1 else blob.data)
            local = lr_mult
            if is_sgd and p.local_lr_auto:
                local = self._lars_rate(i, blob, lr_mult)
            self.rule.compute(i, g, rate * local, self.iter, momentum)
            blob.data[...] -= g

    def _lars_rate(self, i, blob, lr_mult):
        """Intel Caffe's GetLocalRate: gw_ratio * |w| / (|g| + weight_decay * |w|), replacing
        lr_mult when lr_mult > 0; 1 when either norm is 0. |g| is the normalized, regularized
        gradient (the order of Intel Caffe's unfused path)."""
        p = self.param
        w_norm = math.sqrt(self.sumsq(i, blob.data))
        g_norm = math.sqrt(self.sumsq(i, blob.diff))
        rate = 1.0
        if w_norm > 0 and g_norm > 0:
            rate = p.local_gw_ratio * w_norm / (g_norm + p.weight_decay * w_norm)
        return rate if lr_mult > 0 else lr_mult

    def clip_gradients(self):
        clip = self.param.clip_gradients
        if clip < 0:
            return
        params = self.net.learnable_params
        total = sum(self.sumsq(i, b.diff) for i, b in enumerate(params))
        l2 = math.sqrt(total)
        if l2 > clip:
            scale = clip / l2
            log.info(f"Gradient clipping: scaling down gradients (L2 norm {fmt(l2)} > {fmt(clip)}) "
                     f"by scale factor {fmt(scale)}")
            for b in params:
                b.diff[...] *= scale

    # -- testing --------------------------------------------------------------
    def test_all(self):
        self.test_scores = []
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            self.test(i)

    def test(self, index=0):
        """Caffe's Solver::Test: average each output of test net `index` over test_iter batches."""
        p = self.param
        log.info(f"Iteration {self.iter}, Testing net (#{index})")
        net = self.test_nets[index]
        n = p.test_iter[index]
        scores = None
        loss = 0.0
        for _ in range(n):
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
            if p.test_compute_loss:
                loss += batch_loss
            values = np.concatenate([net.blobs[name].data.reshape(-1).astype(np.float64)
                                     for name in net.outputs]) if net.outputs else np.zeros(0)
            scores = values if scores is None else scores + values
        if self.requested_early_exit:
            log.info("Test interrupted.")
            return
        if p.test_compute_loss and n:
            log.info(f"Test loss: {fmt(loss / n)}")
        results = []
        index_out = 0
        for name in net.outputs:
            weight = net.blob_loss_weights.get(name, 0.0)
            for _ in range(net.blobs[name].count):
                mean = float(scores[index_out]) / n if n else 0.0
                extra = f" (* {fmt(weight)} = {fmt(weight * mean)} loss)" if weight else ""
                log.info(f"    Test net output #{index_out}: {name} = {fmt(mean)}{extra}")
                results.append((name, mean))
                index_out += 1
        while len(self.test_scores) <= index:
            self.test_scores.append([])
        self.test_scores[index] = results

    # -- snapshots ------------------------------------------------------------
    def snapshot_filename(self, extension):
        return f"{self.param.snapshot_prefix}_iter_{self.iter}{extension}"

    def snapshot(self):
        """Write <prefix>_iter_<N>.caffemodel and .solverstate (rank 0 only); returns their paths."""
        if not self.is_root:
            return None
        if self._snapshot_iter == self.iter and self.last_snapshot:
            return self.last_snapshot
        from .. import prototxt
        model = self.snapshot_filename(".caffemodel")
        log.info(f"Snapshotting to binary proto file {model}")
        prototxt.write_binary(self.net.to_proto(write_diff=self.param.snapshot_diff), model)
        state = caffe_pb2.SolverState(iter=self.iter, learned_net=model, current_step=self.current_step,
                                      minimum_loss=self.plateau.minimum_loss,
                                      iter_last_event=self.plateau.iter_last_event)
        for h in self.rule.history:
            state.history.append(array_to_blobproto(h))
        state.MergeFromString(_extension_bytes(RNG_STATE_FIELD, json.dumps(rng.get_state()).encode()))
        path = self.snapshot_filename(".solverstate")
        log.info(f"Snapshotting solver state to binary proto file {path}")
        prototxt.write_binary(state, path)
        self.last_snapshot = (model, path)
        self._snapshot_iter = self.iter
        return self.last_snapshot

    def restore(self, state_file):
        """Resume from a .solverstate: weights from the caffemodel it names, history, iter,
        current_step and (when saved by caffepy) the random generator state."""
        from .. import prototxt
        state_file = os.fspath(state_file)
        if state_file.endswith(".h5"):
            raise SolverError(f"{state_file}: HDF5 solver states are not supported; resume from a "
                              f".solverstate written with snapshot_format: BINARYPROTO")
        state = prototxt.read_binary(caffe_pb2.SolverState(), state_file)
        self.iter = state.iter
        if state.HasField("learned_net") and state.learned_net:
            self.net.copy_from(self._resolve_learned_net(state.learned_net, state_file))
        self.current_step = state.current_step
        self.plateau.minimum_loss = state.minimum_loss
        self.plateau.iter_last_event = state.iter_last_event
        history = self.rule.history
        if len(state.history) != len(history):
            raise SolverError(f"{state_file}: history: incorrect number of history blobs for a "
                              f"{self.type} solver over this net (expected {len(history)}), "
                              f"got {len(state.history)}. Was it written by another solver type or net?")
        log.info("SGDSolver: restoring history")
        for i, (bp, h) in enumerate(zip(state.history, history)):
            array = blobproto_to_array(bp, source=state_file, where=f"history[{i}]")
            if array.shape != h.shape:
                if array.size != h.size:
                    raise SolverError(f"{state_file}: history[{i}]: shape should be {h.shape}, "
                                      f"got {array.shape}")
                array = array.reshape(h.shape)
            h[...] = array
        saved = _find_extension(state.SerializeToString(), RNG_STATE_FIELD)
        if saved is not None:
            try:
                rng.set_state(json.loads(saved.decode()))
            except (ValueError, TypeError, KeyError):
                log.warning(f"{state_file}: unreadable random generator state; continuing without it")

    @staticmethod
    def _resolve_learned_net(learned_net, state_file):
        if os.path.exists(learned_net):
            return learned_net
        here = os.path.dirname(os.path.abspath(state_file))
        for candidate in (os.path.join(here, learned_net), os.path.join(here, os.path.basename(learned_net))):
            if os.path.exists(candidate):
                return candidate
        raise SolverError(f"{state_file}: learned_net: cannot find the weights it names, got "
                          f"'{learned_net}' (looked in the current directory and next to the .solverstate)")


# -- the extension field inside SolverState ---------------------------------
def _varint(value):
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _extension_bytes(field, payload):
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _read_varint(data, pos):
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def _find_extension(data, field):
    """The payload of the last length-delimited top-level field `field` in `data`, or None."""
    pos, found = 0, None
    try:
        while pos < len(data):
            key, pos = _read_varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _read_varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                size, pos = _read_varint(data, pos)
                if number == field:
                    found = bytes(data[pos:pos + size])
                pos += size
            else:
                return found
    except IndexError:
        return found
    return found


# -- pycaffe's solver classes ------------------------------------------------
def _typed(name):
    return type(f"{name}Solver", (Solver,), {"forced_type": name,
                                               "__doc__": f"A {name} solver (pycaffe's caffe.{name}Solver)."})


SGDSolver = _typed("SGD")
NesterovSolver = _typed("Nesterov")
AdaGradSolver = _typed("AdaGrad")
RMSPropSolver = _typed("RMSProp")
AdaDeltaSolver = _typed("AdaDelta")
AdamSolver = _typed("Adam")


_TYPED = {cls.forced_type: cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,
                                           AdaDeltaSolver, AdamSolver)}


def get_solver(path):
    """pycaffe's caffe.get_solver: an instance of the class for the type named in the file
    (an SGDSolver for `type: "SGD"`, ...)."""
    from .. import prototxt
    return _TYPED.get(prototxt.read_solver(path).type, Solver)(path)


__all__ = ["Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
           "AdamSolver", "get_solver"]
