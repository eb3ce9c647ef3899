"""How the ranks share the work of one training iteration.

Data parallel (the default): every rank holds all the weights and runs its own
local batch; gradients are averaged with an allreduce overlapped with backward
(allreduce.py), so every rank applies the same update.

Hybrid (Intel's AlexNet layout): the InnerProduct layers the prototxt marks
model-parallel are the factory's model-parallel variant under a distributed
context (model_parallel.py: each rank keeps a slice of the outputs); the
strategy finds them in the train net, has them keep their rows once rank 0's
weights are everywhere, and keeps the solver state, snapshots and the test
nets' full copies of their weights consistent. Everything around them stays
data parallel.
"""
import numpy as np

from .. import log
from ..layer import MODEL_PARALLEL
from . import watchdog
from .allreduce import GradientReducer
from .model_parallel import model_parallel_names


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


def _global_batch(net):
    for bottom, top in zip(net.bottom_vecs, net.top_vecs):
        if not bottom and top and top[0].num_axes:
            return top[0].shape[0]
    return None


class DataParallel:
    """Synchronous SGD: same weights everywhere, gradients averaged over ranks."""

    name = "data parallel"

    def __init__(self, solver, world):
        self.world = world
        self.comm = world.comm
        # the reducer's own communicator: its thread never meets the main thread's collectives
        self.grad_comm = world.comm.Dup()
        self.reducer = None
        self.split = set()           # learnable-param indices split across ranks
        self._passes = 0
        self._last_layer = None
        self._seen = np.zeros(len(self._ACTIONS), np.int64)    # signal requests received here
        self._acted = np.zeros(len(self._ACTIONS), np.int64)   # requests acted on (agreed)

    # -- hooks ----------------------------------------------------------
    def on_start(self, solver):
        self._solver = solver
        with watchdog.waiting(f"the weight broadcast before iteration {solver.iter}"):
            self.broadcast_weights(solver)
        self.setup_split(solver)
        self._local_action = solver.action_fn
        self._agreed = "none"
        solver.action_fn = self._action
        net = solver.net
        if self.reducer is None:
            self.set_progress(None, solver)
        batch = _global_batch(net)
        if batch is not None:
            log.info(f"{self.name} over {self.world.size} ranks: local batch {batch}, "
                     f"global batch {self.world.size * batch}")
        log.info(f"Allreduce: {self.reducer.nbytes / 1e6:.1f} MB of gradients in "
                 f"{len(self.reducer.buckets)} buckets, progress: {self.reducer.progress}, "
                 f"algorithm: {self.reducer.describe()}")

    def set_progress(self, progress, solver, algorithm=None):
        """(Re)build the gradient reducer with a progress mode (allreduce.PROGRESS_MODES) and
        an algorithm (allreduce.ALGORITHMS); None = the defaults. Benchmarks switch between
        them with it; every rank must call it at the same point."""
        net = solver.net
        ready = _ready_layers(net)
        params = [(blob, ready[i]) for i, blob in enumerate(net.learnable_params)
                  if i not in self.split and net.params_lr[i] != 0]
        if self.reducer is not None:
            self.reducer.close()
        self.reducer = GradientReducer(self.grad_comm, params, progress=progress, algorithm=algorithm)

    def on_layer_done(self, solver, layer_index):
        # with iter_size > 1 only the last backward pass of the iteration is reduced
        if self._last_layer is None or layer_index > self._last_layer:
            self._passes += 1
        self._last_layer = layer_index
        watchdog.at(f"backward of iteration {solver.iter}")
        if self._passes >= max(1, getattr(solver.param, "iter_size", 1)):
            self.reducer.layer_done(layer_index)

    def before_update(self, solver):
        with watchdog.waiting(f"the gradient allreduce of iteration {solver.iter}"):
            self.reducer.finish()
        self._passes = 0
        self._last_layer = None
        with watchdog.waiting(f"the signal agreement of iteration {solver.iter}"):
            self._agree_on_action()
        watchdog.at(f"the update of iteration {solver.iter}")

    # Signals (SIGINT / SIGHUP forwarded by the launcher) reach the ranks at
    # different moments; every rank must snapshot or stop after the same
    # iteration, so the ranks agree on the strongest request once per iteration.
    # One signal reaches every rank, maybe in different iterations: the ranks
    # compare how many requests of each kind they have seen so far (MAX), and a
    # request acts once, when the first rank reports it.
    _ACTIONS = ("none", "snapshot", "stop", "snapshot_stop")

    def _agree_on_action(self):
        if self._local_action is not None:
            while True:
                request = self._local_action()
                if request == "none":
                    break
                self._seen[self._ACTIONS.index(request)] += 1
        agreed = self._seen.copy()
        from mpi4py import MPI
        self.comm.Allreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)
        new = [k for k in range(1, len(self._ACTIONS)) if agreed[k] > self._acted[k]]
        self._acted = np.maximum(self._acted, agreed)
        self._agreed = self._ACTIONS[max(new)] if new else "none"

    def _action(self):
        # read by the solver right after the update (and by rank 0's test loop,
        # which gets "none": the request waits for the next agreement)
        agreed, self._agreed = self._agreed, "none"
        watchdog.at(f"forward of iteration {self._solver.iter}")
        return agreed

    def reduce_loss(self, solver, loss):
        buf = np.array([loss], np.float64)
        with watchdog.waiting(f"the loss average of iteration {solver.iter}"):
            self.comm.Allreduce(_in_place(), buf)
        return float(buf[0]) / self.world.size

    def sumsq(self, solver, param_index, array):
        flat = array.reshape(-1)
        local = float(np.dot(flat, flat))         # as the solver's own sumsq
        if param_index not in self.split:
            return local
        buf = np.array([local], np.float64)
        with watchdog.waiting(f"the gradient norm sum of iteration {solver.iter}"):
            self.comm.Allreduce(_in_place(), buf)
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


class Hybrid(DataParallel):
    """Data-parallel everywhere except the model-parallel InnerProduct layers."""

    name = "hybrid (data + model parallel)"

    def __init__(self, solver, world, layer_indices):
        super().__init__(solver, world)
        self.layers = [solver.net.layers[li] for li in layer_indices]
        self.split_rows = {}         # learnable-param index -> its model-parallel layer
        self._split_done = False
        self._after_update = False

    def setup_split(self, solver):
        if self._split_done:
            return
        self._split_done = True
        index = {id(b): i for i, b in enumerate(solver.net.learnable_params)}
        for layer in self.layers:
            layer.keep_own_rows()              # rank 0's full weights are everywhere by now
            for blob in layer.blobs:
                if id(blob) in index:
                    self.split.add(index[id(blob)])
                    self.split_rows[index[id(blob)]] = layer
            log.info(f"Layer {layer.name}: model parallel, {layer.m} of {layer.num_output} "
                     f"outputs on this rank")
        self._slice_solver_state(solver)
        self._unshare_test_weights(solver)
        self._wrap_snapshot(solver)
        self._refresh_test_weights(solver)

    def before_update(self, solver):
        super().before_update(solver)
        scale = np.float32(1.0 / self.world.size)
        for layer in self.layers:
            for blob in layer.blobs:
                blob.diff[...] *= scale
        self._after_update = True

    def _action(self):
        agreed = super()._action()
        if self._after_update:            # every rank is here, right after the update
            self._after_update = False
            self._refresh_test_weights(self._solver)
        return agreed

    # -- solver state of split params -------------------------------------
    def _history_lists(self, solver):
        """The update rule's per-parameter array lists (history, scratch), aligned by index."""
        n = len(solver.net.learnable_params)
        for name, value in vars(solver.rule).items():
            if (isinstance(value, list) and value and len(value) % n == 0
                    and all(isinstance(a, np.ndarray) for a in value)):
                yield name, value, n

    def _slice_solver_state(self, solver):
        self._solver = solver
        for _, arrays, n in self._history_lists(solver):
            for j, array in enumerate(arrays):
                layer = self.split_rows.get(j % n)
                if layer is not None and array.shape[0] == layer.num_output:
                    arrays[j] = np.ascontiguousarray(array[layer.rows])

    # -- full weights where a whole model is needed (snapshots, tests on rank 0)
    def _gather(self, layer, array):
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

    def _wrap_snapshot(self, solver):
        from ..blob import Blob
        original = solver.snapshot

        def snapshot():
            # every rank reaches a snapshot at the same iteration (periodic, or the
            # agreed signal action); only rank 0 writes
            saved_blobs = []
            for layer in self.layers:
                full = [self._gather(layer, blob.data) for blob in layer.blobs]
                saved_blobs.append((layer, layer.blobs))
                if self.world.rank == 0:
                    layer.blobs = [Blob(name=b.name) for b in layer.blobs]
                    for blob, array in zip(layer.blobs, full):
                        blob.set_data(array)
            saved_lists = []
            for _, arrays, n in self._history_lists(solver):
                saved_lists.append((arrays, list(arrays)))
                for j, array in enumerate(arrays):
                    layer = self.split_rows.get(j % n)
                    if layer is not None:
                        full = self._gather(layer, array)
                        if full is not None:
                            arrays[j] = full
            try:
                return original()
            finally:
                for layer, blobs in saved_blobs:
                    layer.blobs = blobs
                for arrays, kept in saved_lists:
                    arrays[:] = kept

        solver.snapshot = snapshot

    def _unshare_test_weights(self, solver):
        """Test nets (run on rank 0 alone) keep full copies of the split layers' weights."""
        from ..blob import Blob
        self._test_copies = []
        names = {layer.name: layer for layer in self.layers}
        for net in getattr(solver, "test_nets", []) or []:
            for layer in net.layers:
                split = names.get(layer.name)
                if split is None or not layer.blobs:
                    continue
                fresh = []
                for blob in layer.blobs:
                    copy = Blob(name=blob.name)
                    copy.set_data(np.zeros((split.num_output,) + tuple(blob.shape[1:]), np.float32))
                    fresh.append(copy)
                layer.blobs = fresh
                self._test_copies.append((split, layer))

    def _refresh_test_weights(self, solver):
        p = solver.param
        if not self._test_copies or not p.test_interval or solver.iter % p.test_interval:
            return
        if solver.iter == 0 and not p.test_initialization:
            return
        for split, layer in self._test_copies:
            for source, target in zip(split.blobs, layer.blobs):
                full = self._gather(split, source.data)
                if full is not None:
                    target.data[...] = full
