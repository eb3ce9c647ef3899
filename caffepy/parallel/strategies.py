"""How the ranks share the work of one training iteration.

Data parallel (the default): every rank holds all the weights and runs its own
local batch; gradients are averaged with an allreduce overlapped with backward
(allreduce.py), so every rank applies the same update.

Hybrid (Intel's AlexNet layout): the InnerProduct layers the prototxt marks
model-parallel are the factory's model-parallel variant under a distributed
context (model_parallel.py: each rank keeps a slice of the outputs); the
strategy finds them in the train net, has them keep their rows once rank 0's
weights are everywhere (and the update rule's history of them, through
`rule.set_state`), lets the test nets' model-parallel layers use the same rows,
and gathers them whole for snapshots. Everything around them stays data parallel.

With the `thread` progress mode the gradients of a bucket are still travelling
when the update comes: the strategy names them (pending_gradients) and the
solver updates each parameter when the next forward needs it (await_gradients),
so communication overlaps the rest of backward and the next forward.

BatchNorm's running statistics (mean, variance, the moving-average factor) come
from each rank's own batches, so they differ between ranks; before every test
phase and snapshot they are replaced by their average over the ranks. Their
update is linear (s = maf * s + batch statistic), so the average is the same
whenever it is taken: the statistic of the mean of the ranks' batch statistics,
i.e. for the mean exactly the global batch's (equal local batches), for the
variance the mean of the ranks' variances (each around its own batch mean;
Caffe has no rule across processes).

The loss and output means, the agreement on signals and the display's per-rank
figures travel in one small collective per iteration, posted after backward and
waited for after the next one (Hooks.lags_records): by then it has long arrived,
so no rank waits at an iteration's end. Waiting for it at once cost AlexNet 0.5-0.7
s an iteration across two emulated hosts, where a small message queues behind
the gradients' bytes on the link (40-150 ms each, four at a display iteration).
The price: an iteration's lines and a signal's snapshot or stop come one
iteration late.

At each display rank 0 logs a line about the ranks since the last display
(`rank_report`): the job's images/s, the slowest rank and how long it worked per
iteration, and the share of the time the ranks waited for communication (the
gradients, and a hybrid's activation exchanges) and for each other (the small
collectives where a fast rank waits for the slowest). A straggler is the rank
that works longest, since every other rank waits for it.

Both are solver Hooks (caffepy.solvers.solver.Hooks): they join the loop only
at the points the solver publishes.
"""
import contextlib
import time

import numpy as np

from .. import log
from ..blob import Blob
from ..layer import MODEL_PARALLEL
from ..log import fmt
from ..solvers.nets import local_batch
from ..solvers.solver import ACTIONS, Hooks
from . import watchdog
from .allreduce import GradientReducer
from .model_parallel import model_parallel_names
from .ring import Poller

# Longest sleep between tests of a small collective the main thread waits in (see _collective)
_COLLECTIVE_POLL_CAP = 1e-3


def make_strategy(solver, world):
    model_parallel_layers(solver.net, world.size)         # every multinode setting is valid
    mp_layers = [li for li, layer in enumerate(solver.net.layers) if layer.variant == MODEL_PARALLEL]
    if mp_layers:
        return Hybrid(solver, world, mp_layers)
    return DataParallel(solver, world)


# -- which layers are model parallel ------------------------------------------
def model_parallel_layers(net, size):
    """Indices of the net's layers split across `size` ranks (prototxt `multinode` settings)."""
    names = set(model_parallel_names(net.param, size, net.source))
    return [li for li, layer in enumerate(net.layers) if layer.name in names]


# -- the strategies -----------------------------------------------------------
def _ready_layers(net):
    """For each learnable param blob: the lowest layer index whose backward writes its diff."""
    lowest = {}
    for li, layer in enumerate(net.layers):
        for blob in layer.blobs:
            lowest.setdefault(id(blob), li)
    return [lowest[id(blob)] for blob in net.learnable_params]


def _running_statistics(net):
    """Learnable-param indices of the blobs a layer's forward changes: BatchNorm's statistics."""
    index = {id(b): i for i, b in enumerate(net.learnable_params)}
    return sorted({index[id(b)] for layer in net.layers if layer.type == "BatchNorm"
                   for b in layer.blobs if id(b) in index})


class DataParallel(Hooks):
    """Synchronous SGD: same weights everywhere, gradients averaged over ranks."""

    name = "data parallel"
    lags_records = True

    def __init__(self, solver, world):
        self.world = world
        self.comm = world.comm
        # the reducer's own communicator: its thread never meets the main thread's collectives
        self.grad_comm = world.comm.Dup()
        self.reducer = None
        self.link = None             # the ring's link, measured once
        self.split = set()           # learnable-param indices split across ranks
        self.statistics = _running_statistics(solver.net)
        self._reduced = []           # learnable-param indices the reducer averages
        self._pending = ()
        self._passes = 0
        self._last_layer = None
        self._seen = np.zeros(len(ACTIONS), np.int64)    # signal requests received here
        self._acted = np.zeros(len(ACTIONS), np.int64)   # requests acted on (agreed)
        # seconds the main thread waited: for the gradients, and for the other ranks in the
        # small collectives (loss, outputs, signals, statistics, norms)
        self.gradient_wait = 0.0
        self.rank_wait = 0.0
        self._shown = None           # the clock at the last display (_clock)
        self._posted = None          # (record, request, rows) of the record being settled
        self._report_due = None      # (timings, iterations) a settled display record brought

    @contextlib.contextmanager
    def _waiting(self, place, counter="rank_wait"):
        """The main thread waits for the others at `place` (the watchdog knows); the time is
        added to `counter`."""
        start = time.perf_counter()
        try:
            with watchdog.waiting(place):
                yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

    def _collective(self, place, start):
        """Run the non-blocking collective that `start()` posts (or returns, posted earlier) and
        wait for it at `place`, sleeping between tests (20 us, doubling up to 1 ms). MPICH's
        blocking calls poll the network in a loop: the rank that reached the loss average first
        spun a core until the others arrived, a core taken from the late rank's backward (ranks
        sharing a machine) or from its own allreduce thread, whose ring also ran slower beside
        the spinning call (4.6 s against 4.2 s for AlexNet's gradients across two emulated
        hosts)."""
        with self._waiting(place):
            request = start()
            poller = Poller(_COLLECTIVE_POLL_CAP)
            while not request.Test():
                poller.idle()

    def communication_wait(self):
        """Seconds the main thread waited for communication so far."""
        return self.gradient_wait

    def _clock(self, solver):
        return time.perf_counter(), solver.iter, self.communication_wait(), self.rank_wait

    # -- hooks ----------------------------------------------------------
    def on_start(self, solver):
        with watchdog.waiting(f"the weight broadcast before iteration {solver.iter}"):
            self.broadcast_weights(solver)
        self.setup_split(solver)
        net = solver.net
        if self.reducer is None:
            self.set_progress(None, solver)
        batch = local_batch(net)
        if batch is not None:
            log.info(f"{self.name} over {self.world.size} ranks: local batch {batch}, "
                     f"global batch {self.world.size * batch}")
        if self.reducer.link is not None:
            log.info(f"Link to the next rank: {self.reducer.link}")
        log.info(f"Allreduce: {self.reducer.nbytes / 1e6:.1f} MB of gradients in "
                 f"{len(self.reducer.buckets)} buckets, progress: {self.reducer.progress}, "
                 f"algorithm: {self.reducer.describe()}")
        self._shown = self._clock(solver)

    def set_progress(self, progress, solver, algorithm=None):
        """(Re)build the gradient reducer with a progress mode (allreduce.PROGRESS_MODES) and
        an algorithm (allreduce.ALGORITHMS); None = the defaults. Benchmarks switch between
        them with it; every rank must call it at the same point."""
        net = solver.net
        ready = _ready_layers(net)
        self._reduced = [i for i in range(len(net.learnable_params))
                         if i not in self.split and net.params_lr[i] != 0]
        params = [(net.learnable_params[i], ready[i]) for i in self._reduced]
        if self.reducer is not None:
            self.reducer.close()
        self.reducer = GradientReducer(self.grad_comm, params, progress=progress, algorithm=algorithm,
                                       link=self.link)
        self.link = self.reducer.link

    def on_layer_done(self, solver, layer_index):
        # with iter_size > 1 only the last backward pass of the iteration is reduced
        if self._last_layer is None or layer_index > self._last_layer:
            self._passes += 1
        self._last_layer = layer_index
        watchdog.at(f"backward of iteration {solver.iter}")
        if self._passes >= max(1, getattr(solver.param, "iter_size", 1)):
            self.reducer.layer_done(layer_index)

    def before_update(self, solver):
        if self.reducer.progress == "thread":
            self.reducer.issue_all()          # the solver awaits each bucket when it needs it
            self._pending = self._reduced
        else:
            with self._waiting(f"the gradient allreduce of iteration {solver.iter}", "gradient_wait"):
                self.reducer.finish()
            self._pending = ()
        self._passes = 0
        self._last_layer = None
        if self.reducer.progress == "thread":     # the forward's first await marks its place
            watchdog.at(f"the update of iteration {solver.iter}")
        else:                                     # nothing marks the place between the two
            watchdog.at(f"the update of iteration {solver.iter} or the forward of iteration "
                        f"{solver.iter + 1}")

    def pending_gradients(self, solver):
        pending, self._pending = self._pending, ()
        return pending

    def await_gradients(self, solver, indices):
        blobs = [solver.net.learnable_params[i] for i in indices]
        with self._waiting(f"the gradient allreduce of iteration {solver.iter}", "gradient_wait"):
            self.reducer.wait(blobs)
        watchdog.at(f"forward of iteration {solver.iter}")

    def reduce_scores(self, solver, values):
        buf = np.ascontiguousarray(values, np.float64)
        self._collective(f"the output sums of iteration {solver.iter}",
                         lambda: self.comm.Iallreduce(_in_place(), buf))
        return buf

    def _since_display(self, solver):
        """This rank's (seconds, communication wait, rank wait) since the last display, and
        the iterations they span; the clock restarts."""
        now = self._clock(solver)
        last, self._shown = self._shown, now
        return np.array([now[0] - last[0], now[2] - last[2], now[3] - last[3]], np.float64), now[1] - last[1]

    def on_display(self, solver, stats):
        if self._report_due is not None:          # gathered with the iteration's record
            (every, iterations), self._report_due = self._report_due, None
        else:
            mine, iterations = self._since_display(solver)
            every = np.empty((self.world.size, 3), np.float64)
            if iterations > 0:
                self._collective(f"the rank timings of iteration {solver.iter}",
                                 lambda: self.comm.Iallgather(mine, every))
        if iterations <= 0:            # the first display: nothing to report yet
            return
        batch = local_batch(solver.net)
        images = None if batch is None else batch * solver.param.iter_size * self.world.size
        log.info(rank_report(stats["iteration"], every, iterations, images))
        stats["scalars"].update(rank_scalars(every, iterations))

    def before_test(self, solver):
        self.average_statistics(solver)

    def gather(self, solver, index, array):
        if index in self.statistics and array is solver.net.learnable_params[index].data:
            self.average_statistics(solver, [index])
        return array

    def average_statistics(self, solver, indices=None):
        """BatchNorm's running statistics: every rank's replaced by their average over ranks."""
        scale = np.float32(1.0 / self.world.size)
        for i in self.statistics if indices is None else indices:
            data = solver.net.learnable_params[i].data
            self._collective(f"the BatchNorm statistics average of iteration {solver.iter}",
                             lambda: self.comm.Iallreduce(_in_place(), data))
            data *= scale

    def agree_action(self, solver, request):
        # Signals (SIGINT / SIGHUP forwarded by the launcher) reach the ranks at different
        # moments, maybe in different iterations: the ranks compare how many requests of each
        # kind they have received so far (MAX), and a request acts once, when the first rank
        # reports it (taking the strongest request of any rank acted twice on one signal)
        self._count(request)
        agreed = self._seen.copy()
        from mpi4py import MPI
        self._collective(f"the signal agreement of iteration {solver.iter}",
                         lambda: self.comm.Iallreduce(MPI.IN_PLACE, agreed, op=MPI.MAX))
        watchdog.at(f"forward of iteration {solver.iter}")
        return self._act_on(agreed)

    def _count(self, request):
        """This rank's signal request (one of ACTIONS) counted among those it has received."""
        if request != "none":
            self._seen[ACTIONS.index(request)] += 1

    def _act_on(self, agreed):
        """The action the ranks' request counts `agreed` (their maximum) ask for: a request
        acts once, when the first rank reports it."""
        new = [k for k in range(1, len(ACTIONS)) if agreed[k] > self._acted[k]]
        self._acted = np.maximum(self._acted, agreed)
        return ACTIONS[max(new)] if new else "none"

    def post_record(self, solver, record):
        # one row per rank: loss, request counts, the display's timings and iterations, outputs
        self._count(record.request)
        timings, iterations = self._since_display(solver) if record.display else (np.zeros(3), 0)
        outputs = np.zeros(0) if record.outputs is None else record.outputs
        mine = np.concatenate([[record.loss], self._seen, timings, [iterations], outputs]).astype(np.float64)
        rows = np.empty((self.world.size, mine.size), np.float64)
        request = self.comm.Iallgather(mine, rows)
        previous, self._posted = self._posted, (record, request, rows)
        return None if previous is None else self._settled(previous)

    def settle_record(self, solver):
        previous, self._posted = self._posted, None
        return None if previous is None else self._settled(previous)

    def _settled(self, posted):
        record, request, rows = posted
        self._collective(f"the loss average of iteration {record.iteration}", lambda: request)
        actions = len(ACTIONS)
        record.loss = float(rows[:, 0].sum()) / self.world.size
        record.request = self._act_on(rows[:, 1:1 + actions].max(axis=0).astype(np.int64))
        if record.display:
            start = 1 + actions
            self._report_due = (rows[:, start:start + 3], int(rows[0, start + 3]))
            # as reduce_scores: float64 sums, then float32 / the rank count
            sums = rows[:, start + 4:].sum(axis=0)
            record.outputs = sums.astype(np.float32) / np.float32(self.world.size)
        return record

    def reduce_loss(self, solver, loss):
        buf = np.array([loss], np.float64)
        self._collective(f"the loss average of iteration {solver.iter}",
                         lambda: self.comm.Iallreduce(_in_place(), buf))
        return float(buf[0]) / self.world.size

    def sumsq(self, solver, param_index, array):
        flat = array.reshape(-1)
        local = float(np.dot(flat, flat))         # as the solver's own sumsq
        if param_index not in self.split:
            return local
        buf = np.array([local], np.float64)
        self._collective(f"the gradient norm sum of iteration {solver.iter}",
                         lambda: self.comm.Iallreduce(_in_place(), buf))
        return float(buf[0])

    # -- pieces ---------------------------------------------------------
    def broadcast_weights(self, solver):
        """Rank 0's weights (after init, -weights or -snapshot) to every rank."""
        seen = set()
        nets = [solver.net] + list(getattr(solver, "test_nets", []) or [])
        for net in nets:
            for layer in net.layers:
                for blob in layer.blobs:
                    if id(blob) in seen:
                        continue
                    seen.add(id(blob))
                    self.comm.Bcast(blob.data, root=0)       # contiguous: a view of its buffer

    def setup_split(self, solver):
        pass

    def close(self):
        if self.reducer is not None:
            self.reducer.close()


def _in_place():
    from mpi4py import MPI
    return MPI.IN_PLACE


def _rank_figures(timings, iterations):
    """(wall seconds per rank, working seconds an iteration per rank, seconds waiting for
    communication per rank, seconds waiting for the other ranks per rank) of rank_report's
    timings. With the small collectives settled late, a fast rank waits for a slow one in
    the gradient exchange: the part of that wait the slowest rank's longer work explains
    counts as waiting for the other ranks."""
    timings = np.asarray(timings, np.float64)
    wall = np.maximum(timings[:, 0], 1e-9)
    waits = timings[:, 1] + timings[:, 2]
    working = (wall - waits) / iterations
    behind = (working.max() - working) * iterations
    others = np.maximum(timings[:, 2], np.minimum(waits, behind))
    return wall, working, waits - others, others


def rank_scalars(timings, iterations):
    """rank_report's figures as display scalars (TensorBoard's mpi/ tags)."""
    timings = np.asarray(timings, np.float64)
    wall, working, communication, others = _rank_figures(timings, iterations)
    slowest = int(np.argmax(working))
    return {"mpi/slowest_rank": slowest,
            "mpi/slowest_rank_seconds_per_iter": float(working[slowest]),
            "mpi/fastest_rank_seconds_per_iter": float(working.min()),
            "mpi/communication_wait_fraction": float(np.mean(communication / wall)),
            "mpi/rank_wait_fraction": float(np.mean(others / wall))}


def rank_report(iteration, timings, iterations, images=None):
    """The display line about the ranks. timings: one row per rank of the seconds since the
    last display (wall, waiting for communication, waiting for the other ranks) over
    `iterations` iterations; images: the job's images per iteration (None: unknown)."""
    timings = np.asarray(timings, np.float64)
    wall, working, communication, others = _rank_figures(timings, iterations)
    slowest, fastest = int(np.argmax(working)), int(np.argmin(working))
    rate = (f"{images * iterations / wall[0]:.1f} images/s" if images
            else f"{fmt(iterations / wall[0])} iter/s")
    communication = 100 * float(np.mean(communication / wall))
    others = 100 * float(np.mean(others / wall))
    return (f"Iteration {iteration}, {len(timings)} ranks: {rate}, slowest rank {slowest} "
            f"({working[slowest]:.3g} s/iter working; fastest rank {fastest} {working[fastest]:.3g}), "
            f"waiting {communication:.1f}% of the time for communication, {others:.1f}% for other ranks")


class Hybrid(DataParallel):
    """Data-parallel everywhere except the model-parallel InnerProduct layers."""

    name = "hybrid (data + model parallel)"

    def __init__(self, solver, world, layer_indices):
        super().__init__(solver, world)
        self.layers = [solver.net.layers[li] for li in layer_indices]
        self.split_rows = {}         # learnable-param index -> its model-parallel layer
        self._test_copies = []       # (train layer, plain test layer): whole weights, refreshed
        self._split_done = False

    def setup_split(self, solver):
        if self._split_done:
            return
        self._split_done = True
        self._copy_whole_test_weights(solver)
        index = {id(b): i for i, b in enumerate(solver.net.learnable_params)}
        for layer in self.layers:
            layer.keep_own_rows()              # rank 0's full weights are everywhere by now
            for blob in layer.blobs:
                i = index.get(id(blob))
                if i is None:
                    continue
                self.split.add(i)
                self.split_rows[i] = layer
                solver.rule.set_state(i, [h[layer.rows].copy() for h in solver.rule.state(i)])
            log.info(f"Layer {layer.name}: model parallel, {layer.m} of {layer.num_output} "
                     f"outputs on this rank")
        self._share_test_rows(solver)

    def communication_wait(self):
        # the split layers' exchanges: each layer needs its exchange's result to go on
        return super().communication_wait() + sum(layer.exchange_seconds for layer in self.layers)

    def before_update(self, solver):
        super().before_update(solver)
        scale = np.float32(1.0 / self.world.size)
        for layer in self.layers:
            for blob in layer.blobs:
                blob.diff[...] *= scale

    # -- whole weights where a whole model is needed (snapshots, plain test layers)
    def gather(self, solver, index, array):
        layer = self.split_rows.get(index)
        if layer is None:
            return super().gather(solver, index, array)
        return self._gather_rows(layer, array)

    def before_test(self, solver):
        super().before_test(solver)
        for split, layer in self._test_copies:
            for source, target in zip(split.blobs, layer.blobs):
                self._allgather_rows(split, source.data, target.data)

    def _allgather_rows(self, layer, array, out):
        """Every rank gets the full (num_output, ...) array in `out` from every rank's rows."""
        from mpi4py import MPI
        rest = int(np.prod(array.shape[1:], dtype=np.int64))
        self.comm.Allgatherv(np.ascontiguousarray(array, np.float32),
                             [out, [m * rest for m in layer.counts], [o * rest for o in layer.offsets],
                              MPI.FLOAT])

    def _gather_rows(self, layer, array):
        """Rank 0 gets the full (num_output, ...) array from every rank's row slice; others None."""
        from mpi4py import MPI
        rest = int(np.prod(array.shape[1:], dtype=np.int64))
        counts = [m * rest for m in layer.counts]
        displs = [o * rest for o in layer.offsets]
        full = (np.empty((layer.num_output,) + array.shape[1:], np.float32)
                if self.world.rank == 0 else None)
        self.comm.Gatherv(np.ascontiguousarray(array, np.float32),
                          [full, counts, displs, MPI.FLOAT] if full is not None else None, root=0)
        return full

    def _copy_whole_test_weights(self, solver):
        """The test nets share the train net's weights, whose split layers are about to keep
        their own rows only. A plain test layer (a test net without the `multinode` marks)
        gets its own whole copy, which before_test refreshes."""
        names = {layer.name: layer for layer in self.layers}
        for net in solver.test_nets:
            for layer in net.layers:
                split = names.get(layer.name)
                if split is None or not layer.blobs or layer.variant == MODEL_PARALLEL:
                    continue
                for blob in layer.blobs:
                    own = Blob(name=blob.name)
                    own.set_data(blob.data)
                    blob.share_data(own)
                self._test_copies.append((split, layer))

    def _share_test_rows(self, solver):
        """A test layer that is model parallel too uses the train layer's rows (no gathering
        before a test); one only the test net has keeps its own (rank 0's weights)."""
        names = {layer.name: layer for layer in self.layers}
        for net in solver.test_nets:
            for layer in net.layers:
                if layer.variant != MODEL_PARALLEL:
                    continue
                split = names.get(layer.name)
                if split is not None:
                    layer.share_rows(split)
                elif not layer.split:
                    layer.keep_own_rows()
