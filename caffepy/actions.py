"""What `caffepy train`, `test` and `time` do (caffe.cpp's train(), test(), time()), and
`extract_features` (Caffe's tools/extract_features).

The CLI (cli.py) parses the flags; these functions raise CaffepyError for user
mistakes and log Caffe's messages, so Caffe's log tools read the output.
"""
import os
import signal
import time as _time

import numpy as np

from . import device, log, net_rules
from .context import SINGLE
from .engine import set_net_engine
from .errors import SolverError, UsageError
from .log import fmt


class SignalHandler:
    """Caffe's SignalHandler: SIGINT / SIGHUP set a flag that the solver reads between
    iterations as a requested action (stop, snapshot or none).

    SIGINT's `snapshot` saves and then stops (Ctrl-C ends the run, nothing is lost);
    SIGHUP's `snapshot` saves and carries on, as in Caffe.

    Under MPI, SIGUSR1 has SIGHUP's effect: MPICH's mpiexec dies of a SIGHUP (and its
    proxies kill every rank) but passes SIGUSR1 on to the ranks, as Open MPI's mpirun does.
    """

    def __init__(self, sigint_effect="stop", sighup_effect="snapshot", mpi=False):
        for name, effect in (("sigint_effect", sigint_effect), ("sighup_effect", sighup_effect)):
            if effect not in ("stop", "snapshot", "none"):
                raise UsageError(f"--{name}: must be stop, snapshot or none, got '{effect}'")
        self.effects = {signal.SIGINT: "snapshot_stop" if sigint_effect == "snapshot" else sigint_effect,
                        signal.SIGHUP: sighup_effect}
        if mpi:
            self.effects[signal.SIGUSR1] = sighup_effect
        self.mpi = mpi
        self.pending = []
        self._previous = {}

    def _handle(self, signum, frame):
        self.pending.append(signum)

    def action(self):
        while self.pending:
            effect = self.effects[self.pending.pop(0)]
            if effect != "none":
                return effect
        return "none"

    def __enter__(self):
        for signum in self.effects:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:      # not the main thread (embedded use): no handlers
                pass
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            # A rank whose run has ended ignores these signals: the launcher passes a
            # signal on to each rank at its own moment, and the ranks agree to act on it
            # as soon as one has it, so a rank may stop before its own copy arrives.
            # Dying of that late copy (SIGUSR1's default) would fail a finished job
            signal.signal(signum, signal.SIG_IGN if self.mpi else previous)
        self._previous.clear()
        return False


def train(solver, weights=None, snapshot=None, level=0, stages=(), sigint_effect="stop",
          sighup_effect="snapshot", stall_timeout=None, engine="", tensorboard=None, histogram_interval=0):
    """Train or fine-tune: build the solver, load -weights or restore -snapshot, solve; for an
    Intel multi-phase solver file (caffepy/solvers/multiphase.py), each phase in turn.

    stall_timeout: seconds without progress on some rank before a multi-rank job is ended
    (None: the default, 0: never). engine: the -engine flag, which overwrites the solver's.
    tensorboard: a directory for TensorBoard event files (caffepy/tensorboard.py; a phase of a
    multi-phase run in its own phase_<j> under it), with weight and gradient histograms every
    histogram_interval iterations (0: none). Returns the solver (of the last phase)."""
    from . import upgrade
    from .solvers import Solver, multiphase

    if weights and snapshot:
        raise UsageError("give --snapshot or --weights, not both: --snapshot resumes a run, "
                         "--weights starts a new one from trained weights")
    if snapshot:
        _check_snapshot(snapshot)
    multi = multiphase.read(solver)
    if multi is not None and snapshot:
        raise UsageError(f"--snapshot: {solver} is a multi-phase solver (params_pair), whose runs "
                         f"cannot be resumed; give the phases still to run a solver file of their own "
                         f"and start it with --weights from the snapshot's .caffemodel")
    mpi = _mpi_if_launched()
    context = SINGLE
    if mpi is not None:
        from .parallel import watchdog
        if stall_timeout is None:
            stall_timeout = watchdog.DEFAULT_TIMEOUT
        # from here on this process is the rank (its parent reports its death, and waits while
        # the others write the emergency snapshot)
        mpi.supervise(linger=stall_timeout + 60 if stall_timeout > 0 else 0)
        # the run context, before the Solver builds its nets: data layers pick their records by rank
        context = mpi.init_world(stall_timeout)
    params = multiphase.phases(multi, solver) if multi is not None else [upgrade.read_solver(solver)]
    for param in params:
        set_net_engine(param, engine)
    if snapshot or weights:
        del params[0].weights[:]
    if weights:
        params[0].weights.append(weights)
    log.info("Use CPU.")
    if multi is not None:
        log.info(f"Running multiphase solver: {len(params)} phases.")
    handler = SignalHandler(sigint_effect, sighup_effect, mpi=mpi is not None)
    previous = None
    for j, param in enumerate(params):
        if multi is not None:
            log.info(f"Phase {j}: snapshot_prefix {param.snapshot_prefix}")
        # the test phases read their nets' outputs alone: their blobs share memory
        the_solver = Solver(param, source=solver, level=level, stages=stages, context=context,
                            keep_test_blobs=False)
        _check_has_loss(the_solver.net)
        if previous is not None:
            the_solver.net.copy_from_param(previous.net.to_proto(), f"the weights phase {j - 1} ended with")
        # ---- multi-rank call site: the MPI strategy joins the solver through its hooks ----
        if mpi is not None:
            strategy = mpi.attach(the_solver)
            if strategy is not None and stall_timeout > 0:
                from .parallel import failsafe
                failsafe.keep(the_solver, strategy)
        # -------------------------------------------------------------------------------------
        # after the strategy: it adds its figures to a display's before the writer records them
        writer = None
        if tensorboard:
            from . import tensorboard as board
            logdir = os.path.join(tensorboard, f"phase_{j}") if multi is not None else tensorboard
            writer = board.attach(the_solver, logdir, histogram_interval)
        the_solver.action_fn = handler.action
        try:
            with handler:
                if snapshot:
                    log.info(f"Resuming from {snapshot}")
                    the_solver.restore(snapshot)
                log.info("Starting Optimization")
                the_solver.solve()
        finally:
            if writer is not None:
                writer.close()
        previous = the_solver
        if the_solver.requested_early_exit:
            break
    log.info("Optimization Done.")      # caffe.cpp's own line, after the solver's
    if mpi is not None:
        mpi.finish()
    return the_solver


def _check_has_loss(net):
    """Refuse a train net without a loss (a deploy net given to train). Caffe trains it:
    every layer "does not need backward computation", the weights change by weight decay
    alone, each display prints every value of the net's outputs, and snapshots overwrite
    the previous ones; that is never what the person who typed `train` wanted."""
    if not any(net.blob_loss_weights.values()):
        raise SolverError(f"{net.source}: the train net has no loss layer (no top with a loss weight), so "
                          f"training could not change its weights but by weight decay. Is it a deploy "
                          f"net? Give the solver the train/val net, with a loss layer such as "
                          f"SoftmaxWithLoss")


def _check_snapshot(path):
    """Refuse weights given as a state to resume from: a NetParameter starts with its
    name (field 1) or a layer (field 100), a SolverState with its iteration (field 1,
    a number)."""
    head = b""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        pass        # reading it later says what is wrong
    if str(path).endswith((".caffemodel", ".caffemodel.h5")) or head[:1] == b"\x0a" or head == b"\xa2\x06":
        raise UsageError(f"--snapshot: {path} holds weights (a .caffemodel), not a solver state; "
                         f"resume from a .solverstate (.solverstate.h5), or start from these weights with --weights {path}")


def _mpi_if_launched():
    try:
        from .parallel import mpi
    except ImportError:
        return None
    return mpi if mpi.launched() else None


def net_with_engine(model, engine="", **kwargs):
    """Net(model, **kwargs), with the -engine flag as the net's engine when it names one
    (Intel's Net constructor: the flag overwrites the file's)."""
    from . import upgrade
    from .net import Net

    param = upgrade.read_net(model)
    set_net_engine(param, engine)
    return Net(param, source=model, **kwargs)


def time_precisions(model, weights=None, iterations=10, level=0, stages=(), engine=""):
    """`caffepy time --precision all`: the TEST net's forward in each precision side by side,
    runs alternating (best of `iterations` each): f32 (quantization_param removed), int8 (the
    prototxt's quantization_param: caffepy calibrate writes it), and bf16 where its kernels run
    (precision.kernel(); else a line says why not). Returns {name: ms}."""
    from . import precision, quantization, upgrade
    from .net import TEST, Net

    def build(quantized, bf16=False):
        param = upgrade.read_net(model)
        set_net_engine(param, engine)
        if not quantized:
            for lp in param.layer:
                lp.ClearField("quantization_param")
        was = precision.current()
        precision.set_precision(precision.BF16 if bf16 else precision.F32)
        try:
            return Net(param, source=model, phase=TEST, weights=weights or None, level=level,
                       stages=list(stages), keep_blobs=False)
        finally:
            precision.set_precision(was)

    has_int8 = any(lp.HasField("quantization_param") for lp in upgrade.read_net(model).layer)
    bf16 = precision.kernel()
    nets = {"f32": build(False)}
    if has_int8:
        nets["int8"] = build(True)
    if bf16:
        nets["bf16"] = build(False, bf16=True)
    best = {name: float("inf") for name in nets}
    for name, net in nets.items():
        net.forward_from_to()                   # warm-up: algorithm choice, quantized weights
    for _ in range(iterations):
        for name, net in nets.items():
            t = _time.perf_counter()
            net.forward_from_to()
            best[name] = min(best[name], _time.perf_counter() - t)
    ms = {name: v * 1e3 for name, v in best.items()}
    log.info(f"Forward by precision (TEST net, best of {iterations}, runs alternating):")
    log.info(f"    f32: {fmt(ms['f32'])} ms")
    if has_int8:
        log.info(f"   int8: {fmt(ms['int8'])} ms ({ms['f32'] / ms['int8']:.2f}x f32; "
                 f"{quantization.isa()} kernels)")
    else:
        log.info("   int8: the net has no quantization_param (caffepy calibrate writes one)")
    if bf16:
        log.info(f"   bf16: {fmt(ms['bf16'])} ms ({ms['f32'] / ms['bf16']:.2f}x f32; {bf16[1]} "
                 f"kernels)")
    else:
        log.info(f"   bf16: not run: {precision.availability()}")
    return ms


def test(model, weights=None, iterations=50, level=0, stages=(), engine="", sampling=False, detection=False,
         ap_version="11point"):
    """Score a model: run the TEST phase `iterations` times, log each batch and the averages.
    `sampling` (Intel's): build the net and load the weights, nothing more. `detection` (SSD's):
    the outputs are DetectionEvaluate's rows; log and return each output's mAP."""
    from .net import TEST

    if not weights:
        raise UsageError("test: --weights: needed to score a model, got none. "
                         "Give --weights model.caffemodel")
    # the outputs alone are read: the blobs between share memory (caffepy/net_memory.py)
    net = net_with_engine(model, engine, phase=TEST, weights=weights, level=level, stages=list(stages),
                          keep_blobs=False)
    if sampling:
        return []
    log.info(f"Running for {iterations} iterations.")
    if detection:
        return _test_detection(net, iterations, ap_version)
    # float sums, as caffe.cpp's test(): its averages print as Caffe's do
    f32 = np.float32
    names, scores = [], None
    total_loss = f32(0)
    for i in range(iterations):
        total_loss += f32(net.forward_from_to())
        values = []
        for name in net.outputs:
            for value in net.blobs[name].data.reshape(-1):
                if i == 0:
                    names.append(name)
                values.append(value)
                log.info(f"Batch {i}, {name} = {fmt(float(value))}")
        values = np.array(values, np.float32)
        scores = values if scores is None else scores + values
    log.info(f"Loss: {fmt(total_loss / f32(iterations))}")
    results = []
    for name, total in zip(names, scores if scores is not None else []):
        mean = total / f32(iterations)
        weight = net.blob_loss_weights.get(name, 0.0)
        extra = f" (* {fmt(weight)} = {fmt(f32(weight) * mean)} loss)" if weight else ""
        log.info(f"{name} = {fmt(mean)}{extra}")
        results.append((name, float(mean)))
    return results


def _test_detection(net, iterations, ap_version):
    """SSD's test_detection: every output of every batch holds DetectionEvaluate's rows."""
    from .bbox import MeanAP
    found = [MeanAP() for _ in net.outputs]
    for _ in range(iterations):
        net.forward_from_to()
        for acc, name in zip(found, net.outputs):
            if net.blobs[name].shape[-1:] != (5,):
                raise UsageError(f"test: --detection: output '{name}' is not DetectionEvaluate's "
                                 f"[1, 1, rows, 5], got shape {net.blobs[name].shape}")
            acc.add(net.blobs[name].data)
    results = []
    for i, (name, acc) in enumerate(zip(net.outputs, found)):
        m_ap, _, missing = acc.result(ap_version)
        for label in missing:
            log.warning(f"Missing true_pos for label: {label}")
        log.info(f"    Test net output #{i}: {name} = {fmt(m_ap)}")
        results.append((name, m_ap))
    return results


def time(model, weights=None, iterations=50, phase="TRAIN", level=0, stages=(), forward_only=False,
         engine=""):
    """Benchmark as Caffe's `time`: one warm-up pass, then per-layer forward and backward times.
    Every layer's backward runs, in either phase and on a deploy net too (parameter gradients
    included), since Caffe's tool calls each layer's Backward whether or not a loss needs it.
    `forward_only` (Intel's flag) times the forward pass alone and prints no backward lines."""
    from .net import TEST, TRAIN

    if str(phase).upper() not in ("TRAIN", "TEST"):
        raise UsageError(f"time: --phase: must be TRAIN or TEST, got '{phase}'")
    phase_value = TRAIN if str(phase).upper() == "TRAIN" else TEST
    log.info(device.engine_line())
    device.warn_forced_blas_kernel()
    # a TEST net timed forward only is a deployment's: its blobs share memory, as `test`'s do
    net = net_with_engine(model, engine, phase=phase_value, weights=weights or None, level=level,
                          stages=list(stages), keep_blobs=not (forward_only and phase_value == TEST))
    log.info("Performing Forward")
    initial_loss = net.forward_from_to()
    log.info(f"Initial loss: {fmt(initial_loss)}")
    if not forward_only:
        log.info("Performing Backward")
        net.backward_from_to()
    layers = net.layers
    n = len(layers)
    forward_s = [0.0] * n
    backward_s = [0.0] * n
    forward_total = backward_total = 0.0
    waits = [(layer, float(getattr(layer, "wait_seconds", 0.0))) for layer in layers
             if hasattr(layer, "wait_seconds")]
    log.info("*** Benchmark begins ***")
    log.info(f"Testing for {iterations} iterations.")
    clock = _time.perf_counter
    total_start = clock()
    # a fused unit (Net.fusions: BatchNorm + Scale (+ ReLU), Eltwise + ReLU (+ Split)) runs and is
    # timed as one, under its first layer
    units = net.units()
    fused = [(layers[first].name, layers[last].name) for first, last in units if last != first]
    if fused:
        log.info(f"{len(fused)} fused unit(s), each timed under its first layer's name "
                 f"(e.g. {fused[0][0]} .. {fused[0][1]})")
    for j in range(iterations):
        iter_start = clock()
        for first, last in units:
            t = clock()
            net.forward_from_to(first, last)
            forward_s[first] += clock() - t
        forward_total += clock() - iter_start
        if forward_only:
            log.info(f"Iteration: {j + 1} forward time: {fmt((clock() - iter_start) * 1e3)} ms.")
            continue
        back_start = clock()
        for first, last in reversed(units):
            t = clock()
            net.backward_from_to(last, first, every_layer=True)
            backward_s[first] += clock() - t
        backward_total += clock() - back_start
        log.info(f"Iteration: {j + 1} forward-backward time: {fmt((clock() - iter_start) * 1e3)} ms.")
    total = clock() - total_start
    log.info("Average time per layer: ")
    for i, layer in enumerate(layers):
        log.info(f"{layer.name:>10}\tforward: {fmt(forward_s[i] * 1e3 / iterations)} ms.")
        if not forward_only:
            log.info(f"{layer.name:>10}\tbackward: {fmt(backward_s[i] * 1e3 / iterations)} ms.")
    log.info(f"Average Forward pass: {fmt(forward_total * 1e3 / iterations)} ms.")
    if not forward_only:
        log.info(f"Average Backward pass: {fmt(backward_total * 1e3 / iterations)} ms.")
        log.info(f"Average Forward-Backward: {fmt(total * 1e3 / iterations)} ms.")
    log.info(f"Total Time: {fmt(total * 1e3)} ms.")
    # how each layer with a choice of algorithms computes (caffepy/autotune.py): beyond Caffe
    algorithms = [(layer.name, layer.algorithm, getattr(layer, "tuning", "rule"))
                  for layer in layers if getattr(layer, "algorithm", None)]
    if algorithms:
        log.info("Algorithm per layer:")
        for name, algorithm, tuning in algorithms:
            log.info(f"{name:>10}\t{algorithm} ({tuning})")
    for layer, before in waits:
        waited = float(getattr(layer, "wait_seconds", 0.0)) - before
        share = waited / forward_total if forward_total > 0 else 0.0
        log.info(f"Data wait ({layer.name}): {fmt(waited * 1e3 / iterations)} ms per iteration, "
                 f"{share * 100:.1f}% of the forward pass")
    log.info("*** Benchmark ends ***")
    return {"forward_ms": forward_total * 1e3 / iterations,
            "backward_ms": None if forward_only else backward_total * 1e3 / iterations,
            "total_ms": total * 1e3,
            "layers": [(layer.name, forward_s[i] * 1e3 / iterations,
                        None if forward_only else backward_s[i] * 1e3 / iterations)
                       for i, layer in enumerate(layers)],
            "algorithms": [(name, algorithm) for name, algorithm, _ in algorithms]}


__all__ = ["train", "test", "time", "extract_features", "SignalHandler"]


_FEATURES_COMMIT = 1000          # items per transaction and per progress line, as Caffe's tool


def extract_features(weights, model, blob_names, dataset_names, num_mini_batches, db_type="lmdb"):
    """Caffe's extract_features: run the TEST net `num_mini_batches` times and write each item's
    values of each blob in `blob_names` (comma-separated) as a Datum of float_data into a new
    database of `dataset_names` (one per blob), keyed by the item's index in ten digits.
    Returns the number of items written to each."""
    from contextlib import ExitStack

    from .data.db import BACKENDS, open_writer
    from .net import TEST, Net

    blobs, datasets = blob_names.split(","), dataset_names.split(",")
    if len(blobs) != len(datasets):
        raise UsageError(f"extract_features: the number of blob names ({len(blobs)}: {blob_names}) and "
                         f"dataset names ({len(datasets)}: {dataset_names}) must be equal")
    if num_mini_batches < 0:
        raise UsageError(f"extract_features: num_mini_batches: must be 0 or more, got {num_mini_batches}")
    if db_type.lower() not in BACKENDS:
        raise UsageError(f"extract_features: db_type: '{db_type}' is not a database type; use lmdb "
                         f"or leveldb")
    net = Net(model, phase=TEST, weights=weights)
    skipped = net.unwritten_blobs()
    unwritten = [name for name in blobs if name in skipped]
    if unwritten:
        # a fused unit computes past them: the net whose layers write every blob
        log.info(f"extract_features: {', '.join(unwritten)} not written by the fused TEST net; "
                 f"running its layers as CAFFEPY_FOLD=0 does")
        with net_rules.unfolded():
            net = Net(model, phase=TEST, weights=weights)
    for name in blobs:
        if name not in net.blobs:
            raise UsageError(f"{model}: unknown feature blob name '{name}' in the network")
        if net.blobs[name].num_axes > 4:
            raise UsageError(f"{model}: blob '{name}' has {net.blobs[name].num_axes} axes; a Datum "
                             f"holds at most 4 (num, channels, height, width)")
    written = [0] * len(blobs)
    with ExitStack() as stack:
        dbs = []
        for path in datasets:
            log.info(f"Opening dataset {path}")
            dbs.append(stack.enter_context(open_writer(path, db_type, _FEATURES_COMMIT)))
        log.info("Extracting Features")
        batches = stack.enter_context(log.progress(range(num_mini_batches), "extract_features"))
        for _ in batches:
            net.forward_from_to()
            for i, (name, db) in enumerate(zip(blobs, dbs)):
                for value in _feature_datums(net.blobs[name].data):
                    db.put(f"{written[i]:010d}", value)
                    written[i] += 1
                    if written[i] % _FEATURES_COMMIT == 0:
                        log.info(f"Extracted features of {written[i]} query images for feature blob {name}")
        for name, count in zip(blobs, written):
            if count % _FEATURES_COMMIT:
                log.info(f"Extracted features of {count} query images for feature blob {name}")
    log.info("Successfully extracted the features!")
    return written


def _feature_datums(values):
    """The serialized Datum of each item of a blob's values, as Caffe's tool writes them:
    channels, height and width from the legacy 4-axis shape (1 past the blob's axes), then
    every value as an unpacked float_data entry (field 6, fixed32), built by NumPy rather than
    one protobuf call a float (fc7's 4096 floats an item, thousands of items)."""
    from .data.datum import datum_header
    shape = tuple(values.shape) + (1,) * (4 - values.ndim)
    items = values.reshape(shape[0] if values.ndim else 1, -1)
    header = datum_header(shape[1], shape[2], shape[3])
    wire = np.empty(items.shape, np.dtype([("tag", "u1"), ("value", "<f4")]))
    wire["tag"] = 6 << 3 | 5
    wire["value"] = items
    for row in wire:
        yield header + row.tobytes()
