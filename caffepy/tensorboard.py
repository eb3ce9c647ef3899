"""Training curves for TensorBoard: `caffepy train --tensorboard DIR`, or from Python

    solver = caffe.get_solver("solver.prototxt")
    caffe.tensorboard.attach(solver, "runs/lenet", histogram_interval=100)
    solver.solve()

then `tensorboard --logdir runs`. The event files are written through tensorboardX (the
`tensorboard` extra: a writer alone, pure Python, no TensorFlow or PyTorch, so it installs on a
training node); reading them needs TensorBoard itself (`pip install tensorboard`), anywhere.

What is recorded, at the iteration of Caffe's log line that shows it (rank 0 writes):
    train/smoothed_loss         each display: "Iteration N (...), loss = X" (average_loss smoothing)
    train/<output>              each display: every "Train net output" (output/k for an output
                                of several values)
    train/learning_rate         each display: "Iteration N, lr = X"
    speed/seconds_per_iter      each display after the first: the time since the previous
    speed/items_per_second      display over its iterations; items of the global batch
    test/<output>               each test: every "Test net output" (test<i>/ for test net i > 0)
    test/total_loss             with test_compute_loss: the "Test loss" line
    <tag>                       each display: whatever any hook puts in the display's
                                `scalars` dict in its on_display, under the tag it chose (the
                                writer records in Hooks.record_display, after every on_display,
                                so the order hooks were attached in does not matter). Under
                                MPI the strategy's per-rank figures go there, under mpi/
    weights/<layer>/<k>         every `histogram_interval` iterations (0: never): each
    gradients/<layer>/<k>       parameter blob's values and its gradient before the update
"""
import collections

from .errors import CaffepyError
from .solvers.solver import Hooks


def _summary_writer(logdir):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise CaffepyError("--tensorboard: needs tensorboardX, which is not installed. Install it with: "
                           "pip install tensorboardX (or pip install 'caffepy[tensorboard]')") from None
    try:
        return SummaryWriter(logdir)
    except OSError as e:
        raise CaffepyError(f"--tensorboard: cannot write event files in {logdir}: {e.strerror or e}") from None


def _unique(pairs):
    """[(name, value)] with a repeated name made name/k (a test output of several values)."""
    counts = collections.Counter(name for name, _ in pairs)
    seen = collections.Counter()
    out = []
    for name, value in pairs:
        if counts[name] > 1:
            out.append((f"{name}/{seen[name]}", value))
            seen[name] += 1
        else:
            out.append((name, value))
    return out


class TensorBoardWriter(Hooks):
    """A solver hook writing the run's figures as TensorBoard events (see the module)."""

    def __init__(self, logdir, histogram_interval=0):
        if histogram_interval < 0:
            raise CaffepyError(f"--tensorboard_histograms: must be 0 (none) or a number of iterations, "
                               f"got {histogram_interval}")
        self.logdir = logdir
        self.histogram_interval = histogram_interval
        self.writer = _summary_writer(logdir)

    def record_display(self, solver, stats):
        it = stats["iteration"]
        scalars = {"train/smoothed_loss": stats["loss"], "train/learning_rate": stats["learning_rate"]}
        scalars.update((f"train/{name}", value) for name, value in stats["outputs"])
        for key in ("seconds_per_iter", "items_per_second"):
            if key in stats:
                scalars[f"speed/{key}"] = stats[key]
        scalars.update(stats["scalars"])
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, it)
        self.writer.flush()       # a run may end any moment (a signal, an error): lose nothing shown

    def on_test(self, solver, index, outputs, loss):
        prefix = "test" if index == 0 else f"test{index}"
        for name, value in _unique(outputs):
            self.writer.add_scalar(f"{prefix}/{name}", value, solver.iter)
        if loss is not None:
            self.writer.add_scalar(f"{prefix}/total_loss", loss, solver.iter)
        self.writer.flush()

    def gradients_wanted(self, solver):
        return bool(self.histogram_interval) and solver.iter % self.histogram_interval == 0

    def on_gradients(self, solver):
        seen = set()
        for layer, blobs in solver.net.params.items():
            for k, blob in enumerate(blobs):
                if id(blob) in seen:        # shared: recorded under its first layer
                    continue
                seen.add(id(blob))
                self.writer.add_histogram(f"weights/{layer}/{k}", blob.data, solver.iter)
                self.writer.add_histogram(f"gradients/{layer}/{k}", blob.diff, solver.iter)
        self.writer.flush()

    def close(self):
        self.writer.close()


def attach(solver, logdir, histogram_interval=0):
    """Record `solver`'s run in TensorBoard event files under `logdir` (rank 0 writes; other
    ranks get None). Returns the writer hook; `close()` it when done (its events are flushed
    at each display and test already)."""
    if solver.context.rank != 0:
        return None
    hook = TensorBoardWriter(logdir, histogram_interval)
    solver.hooks.append(hook)
    return hook
