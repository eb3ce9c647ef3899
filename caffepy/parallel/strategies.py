"""How the ranks share the work of one training iteration.

Data parallel (the default): every rank holds all the weights and runs its own
local batch; gradients are averaged with an allreduce overlapped with backward
(allreduce.py), so every rank applies the same update.

Hybrid (Intel's AlexNet layout): InnerProduct layers marked model-parallel
keep only rank r's slice of the outputs (rows r*M/N .. (r+1)*M/N of the
weights, the same slice of the bias). Each such layer
    forward:  allgather the local bottoms into the global batch (N*b, K),
              compute its output slice (N*b, M/N), and alltoall so each rank
              gets its own rows with every output (b, M);
    backward: alltoall the top diff back to (N*b, M/N) slices, accumulate the
              weight gradient of its slice over the global batch, and
              reduce-scatter the partial bottom gradients (summed over ranks)
              back to each rank's (b, K).
Everything around these layers stays data parallel. A layer is model-parallel
when its prototxt says so, with Intel Caffe's fields:
    layer { type: "InnerProduct" ... multinode { model_parts: 0 } }   # 0 = all ranks
or for a range of layers at the net level:
    multinode { model_parallel { layer_from: "fc6" layer_to: "fc8" model_parts: 0 } }
Only splitting over all ranks is supported (model_parts 0 or N, num_nodes 0 or N);
when N does not divide num_output the first num_output % N ranks hold one more.
"""
import numpy as np

from .. import log
from ..errors import ParallelError, layer_error
from ..layers.common import gemm_into
from . import watchdog
from .allreduce import GradientReducer


def make_strategy(solver, world):
    mp_layers = model_parallel_layers(solver.net, world.size)
    if mp_layers:
        return Hybrid(solver, world, mp_layers)
    return DataParallel(solver, world)


# -- which layers are model parallel ------------------------------------------
def _split_over_all(parts, nodes, size):
    return parts in (0, size) or (parts > size and nodes in (0, size))


def model_parallel_layers(net, size):
    """Indices of the net's layers split across ranks (prototxt `multinode` settings)."""
    chosen = []
    names = [layer.name for layer in net.layers]
    ranges = []
    for mp in net.param.multinode.model_parallel:
        if mp.layer_from not in names:
            raise ParallelError(f"{net.source}: multinode.model_parallel.layer_from: no layer named "
                                f"'{mp.layer_from}'")
        last = mp.layer_to or mp.layer_from
        if last not in names:
            raise ParallelError(f"{net.source}: multinode.model_parallel.layer_to: no layer named "
                                f"'{last}'")
        parts = mp.model_parts
        nodes = mp.num_nodes
        if parts == 1:
            continue
        if not _split_over_all(parts, nodes, size):
            raise ParallelError(f"{net.source}: multinode.model_parallel.model_parts: only splitting "
                                f"over all {size} ranks is supported (0 or {size}), got {parts}")
        ranges.append((names.index(mp.layer_from), names.index(last)))
    for li, layer in enumerate(net.layers):
        in_range = any(lo <= li <= hi for lo, hi in ranges)
        lp = layer.param
        marked = lp.HasField("multinode") and lp.multinode.model_parts != 1
        if marked and not _split_over_all(lp.multinode.model_parts, lp.multinode.num_nodes, size):
            raise layer_error(layer, "multinode.model_parts", "only splitting over all "
                              f"{size} ranks is supported (0 or {size})", lp.multinode.model_parts,
                              cls=ParallelError)
        if not (marked or in_range):
            continue
        if layer.type != "InnerProduct":
            if marked:
                raise layer_error(layer, "multinode", "model parallelism is implemented for "
                                  "InnerProduct layers only", layer.type, cls=ParallelError)
            continue                # layers inside a model_parallel range stay data parallel
        ip = lp.inner_product_param
        if ip.transpose:
            raise layer_error(layer, "inner_product_param.transpose", "model-parallel InnerProduct "
                              "needs untransposed weights", True, cls=ParallelError)
        if ip.num_output < size:
            raise layer_error(layer, "inner_product_param.num_output", f"must be at least the "
                              f"number of ranks ({size}) to split it across them", ip.num_output,
                              cls=ParallelError)
        chosen.append(li)
    return chosen


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
    """Data-parallel everywhere except model-parallel InnerProduct layers."""

    name = "hybrid (data + model parallel)"

    def __init__(self, solver, world, layer_indices):
        super().__init__(solver, world)
        self.layer_indices = layer_indices
        self.wrappers = []
        self.split_rows = {}         # learnable-param index -> its wrapper
        self._after_update = False

    def setup_split(self, solver):
        if self.wrappers:
            return
        net = solver.net
        index = {id(b): i for i, b in enumerate(net.learnable_params)}
        for li in self.layer_indices:
            layer = net.layers[li]
            wrapper = ModelParallelInnerProduct(layer, self.comm)
            self.wrappers.append(wrapper)
            for blob in layer.blobs:
                if id(blob) in index:
                    self.split.add(index[id(blob)])
                    self.split_rows[index[id(blob)]] = wrapper
            log.info(f"Layer {layer.name}: model parallel, {wrapper.m} of {wrapper.M} outputs "
                     f"on this rank")
        self._slice_solver_state(solver)
        self._unshare_test_weights(solver)
        self._wrap_snapshot(solver)
        self._refresh_test_weights(solver)

    def before_update(self, solver):
        super().before_update(solver)
        scale = np.float32(1.0 / self.world.size)
        for wrapper in self.wrappers:
            for blob in wrapper.layer.blobs:
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
                wrapper = self.split_rows.get(j % n)
                if wrapper is not None and array.shape[0] == wrapper.M:
                    arrays[j] = np.ascontiguousarray(array[wrapper.rows])

    # -- full weights where a whole model is needed (snapshots, tests on rank 0)
    def _gather(self, wrapper, array):
        """Rank 0 gets the full (M, ...) array from every rank's row slice; others None."""
        from mpi4py import MPI
        rest = int(np.prod(array.shape[1:], dtype=np.int64))
        counts = [m * rest for m in wrapper.counts]
        displs = [o * rest for o in wrapper.offsets]
        full = (np.empty((wrapper.M,) + array.shape[1:], np.float32)
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
            for wrapper in self.wrappers:
                layer = wrapper.layer
                full = [self._gather(wrapper, blob.data) for blob in layer.blobs]
                saved_blobs.append((layer, layer.blobs))
                if self.world.rank == 0:
                    layer.blobs = [Blob(name=b.name) for b in layer.blobs]
                    for blob, array in zip(layer.blobs, full):
                        blob.set_data(array)
            saved_lists = []
            for _, arrays, n in self._history_lists(solver):
                saved_lists.append((arrays, list(arrays)))
                for j, array in enumerate(arrays):
                    wrapper = self.split_rows.get(j % n)
                    if wrapper is not None:
                        full = self._gather(wrapper, array)
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
        names = {w.layer.name: w for w in self.wrappers}
        for net in getattr(solver, "test_nets", []) or []:
            for layer in net.layers:
                wrapper = names.get(layer.name)
                if wrapper is None or not layer.blobs:
                    continue
                fresh = []
                for blob in layer.blobs:
                    copy = Blob(name=blob.name)
                    copy.set_data(np.zeros((wrapper.M,) + tuple(blob.shape[1:]), np.float32))
                    fresh.append(copy)
                layer.blobs = fresh
                self._test_copies.append((wrapper, layer))

    def _refresh_test_weights(self, solver):
        p = solver.param
        if not self._test_copies or not p.test_interval or solver.iter % p.test_interval:
            return
        if solver.iter == 0 and not p.test_initialization:
            return
        for wrapper, layer in self._test_copies:
            for source, target in zip(wrapper.layer.blobs, layer.blobs):
                full = self._gather(wrapper, source.data)
                if full is not None:
                    target.data[...] = full


class ModelParallelInnerProduct:
    """Takes over one InnerProduct layer: its weights become this rank's row slice
    (rank r holds outputs offsets[r] .. offsets[r] + counts[r]; the first M % N
    ranks hold one more)."""

    def __init__(self, layer, comm):
        self.layer = layer
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        ip = layer.param.inner_product_param
        self.M = ip.num_output
        base, extra = divmod(self.M, self.size)
        self.counts = [base + (1 if r < extra else 0) for r in range(self.size)]
        self.offsets = [sum(self.counts[:r]) for r in range(self.size)]
        self.m = self.counts[self.rank]
        self.rows = slice(self.offsets[self.rank], self.offsets[self.rank] + self.m)
        for blob in layer.blobs:
            blob.set_data(blob.data[self.rows].copy())
        self.bias = ip.bias_term
        self.outer = None
        layer.reshape = self.reshape
        layer.forward = self.forward
        layer.backward = self.backward

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        axis = self.layer.param.inner_product_param.axis % len(shape)
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        K = int(np.prod(shape[axis:], dtype=np.int64))
        if K != self.layer.blobs[0].shape[1]:
            raise self.layer.error("bottom", f"input size from axis {axis} must be "
                                   f"{self.layer.blobs[0].shape[1]} (the weights' K)", K)
        top[0].reshape(tuple(shape[:axis]) + (self.M,))
        if outer == self.outer and K == getattr(self, "K", None):
            return
        self.outer, self.K = outer, K
        n = self.size * outer
        self.x_all = np.empty((n, K), np.float32)
        self.y_part = np.empty((n, self.m), np.float32)
        self.dy_all = np.empty((n, self.m), np.float32)
        self.exchange = np.empty(outer * self.M, np.float32)      # (outer, m_s) blocks by rank
        self.dx = np.empty((outer, K), np.float32)
        self.block_counts = [outer * m for m in self.counts]
        self.block_displs = [outer * o for o in self.offsets]

    def _blocks(self):
        return [self.exchange[d:d + c].reshape(self.outer, c // self.outer if self.outer else 0)
                for d, c in zip(self.block_displs, self.block_counts)]

    def forward(self, bottom, top):
        from mpi4py import MPI
        x = np.ascontiguousarray(bottom[0].data.reshape(self.outer, self.K))
        self.comm.Allgather(x, self.x_all)
        gemm_into(self.x_all, self.layer.blobs[0].data.T, self.y_part)
        if self.bias:
            self.y_part += self.layer.blobs[1].data
        # rows of rank s (block s of y_part) go to rank s; from rank s come my rows of its outputs
        sends = [self.outer * self.m] * self.size
        sdispl = [s * self.outer * self.m for s in range(self.size)]
        self.comm.Alltoallv([self.y_part, (sends, sdispl), MPI.FLOAT],
                            [self.exchange, (self.block_counts, self.block_displs), MPI.FLOAT])
        y = top[0].data.reshape(self.outer, self.M)
        for block, offset, count in zip(self._blocks(), self.offsets, self.counts):
            y[:, offset:offset + count] = block

    def backward(self, top, propagate_down, bottom):
        from mpi4py import MPI
        dy = top[0].diff.reshape(self.outer, self.M)
        for block, offset, count in zip(self._blocks(), self.offsets, self.counts):
            block[...] = dy[:, offset:offset + count]
        recvs = [self.outer * self.m] * self.size
        rdispl = [s * self.outer * self.m for s in range(self.size)]
        self.comm.Alltoallv([self.exchange, (self.block_counts, self.block_displs), MPI.FLOAT],
                            [self.dy_all, (recvs, rdispl), MPI.FLOAT])
        ppd = self.layer.param_propagate_down
        if ppd and ppd[0]:
            gemm_into(self.dy_all.T, self.x_all, self.layer.blobs[0].diff, 1.0)
        if self.bias and len(ppd) > 1 and ppd[1]:
            self.layer.blobs[1].diff[...] += self.dy_all.sum(axis=0)
        if propagate_down[0]:
            dx_all = np.empty((self.dy_all.shape[0], self.K), np.float32)
            gemm_into(self.dy_all, self.layer.blobs[0].data, dx_all)
            self.comm.Reduce_scatter_block(dx_all, self.dx)
            bottom[0].diff.reshape(self.outer, self.K)[...] = self.dx
