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
Only splitting over all ranks is supported (model_parts 0 or N, num_nodes 0 or N).
"""
import numpy as np

from .. import log
from ..errors import ParallelError, layer_error
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
        if ip.num_output % size:
            raise layer_error(layer, "inner_product_param.num_output", f"must be divisible by the "
                              f"{size} ranks to split it across them", ip.num_output,
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

    # -- hooks ----------------------------------------------------------
    def on_start(self, solver):
        self.broadcast_weights(solver)
        self.setup_split(solver)
        self._local_action = solver.action_fn
        self._agreed = "none"
        solver.action_fn = self._action
        net = solver.net
        ready = _ready_layers(net)
        params = [(blob, ready[i]) for i, blob in enumerate(net.learnable_params)
                  if i not in self.split and net.params_lr[i] != 0]
        if self.reducer is None:
            self.reducer = GradientReducer(self.grad_comm, params)
        batch = _global_batch(net)
        if batch is not None:
            log.info(f"{self.name} over {self.world.size} ranks: local batch {batch}, "
                     f"global batch {self.world.size * batch}")
        log.info(f"Allreduce: {self.reducer.nbytes / 1e6:.1f} MB of gradients in "
                 f"{len(self.reducer.buckets)} buckets, progress: {self.reducer.progress}")

    def on_layer_done(self, solver, layer_index):
        # with iter_size > 1 only the last backward pass of the iteration is reduced
        if self._last_layer is None or layer_index > self._last_layer:
            self._passes += 1
        self._last_layer = layer_index
        if self._passes >= max(1, getattr(solver.param, "iter_size", 1)):
            self.reducer.layer_done(layer_index)

    def before_update(self, solver):
        self.reducer.finish()
        self._passes = 0
        self._last_layer = None
        self._agree_on_action()

    # Signals (SIGINT / SIGHUP forwarded by the launcher) reach the ranks at
    # different moments; every rank must snapshot or stop after the same
    # iteration, so the ranks agree on the strongest request once per iteration.
    _ACTIONS = ("none", "snapshot", "stop", "snapshot_stop")

    def _agree_on_action(self):
        local = "none"
        if self._local_action is not None:
            requests = []
            while True:
                request = self._local_action()
                if request == "none":
                    break
                requests.append(request)
            if requests:
                local = max(requests, key=self._ACTIONS.index)
        code = np.array([self._ACTIONS.index(local)], np.int32)
        from mpi4py import MPI
        self.comm.Allreduce(MPI.IN_PLACE, code, op=MPI.MAX)
        self._agreed = self._ACTIONS[int(code[0])]

    def _action(self):
        # read by the solver right after the update (and by rank 0's test loop,
        # which gets "none": the request waits for the next agreement)
        agreed, self._agreed = self._agreed, "none"
        return agreed

    def reduce_loss(self, solver, loss):
        buf = np.array([loss], np.float64)
        self.comm.Allreduce(_in_place(), buf)
        return float(buf[0]) / self.world.size

    def sumsq(self, solver, param_index, array):
        local = float(np.dot(array.reshape(-1).astype(np.float64), array.reshape(-1)))
        if param_index not in self.split:
            return local
        buf = np.array([local], np.float64)
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
                    self.comm.Bcast(np.ascontiguousarray(blob.data), root=0)

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
            log.info(f"Layer {layer.name}: model parallel, {wrapper.m} of {wrapper.M} outputs "
                     f"per rank")

    def before_update(self, solver):
        super().before_update(solver)
        scale = np.float32(1.0 / self.world.size)
        for wrapper in self.wrappers:
            for blob in wrapper.layer.blobs:
                blob.diff[...] *= scale


class ModelParallelInnerProduct:
    """Takes over one InnerProduct layer: its weights become this rank's slice."""

    def __init__(self, layer, comm):
        self.layer = layer
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        ip = layer.param.inner_product_param
        self.M = ip.num_output
        self.m = self.M // self.size
        rows = slice(self.rank * self.m, (self.rank + 1) * self.m)
        self.rows = rows
        weight = layer.blobs[0]
        weight.set_data(weight.data[rows].copy())
        if ip.bias_term:
            bias = layer.blobs[1]
            bias.set_data(bias.data[rows].copy())
        self.bias = ip.bias_term
        self.axis = None
        layer.reshape = self.reshape
        layer.forward = self.forward
        layer.backward = self.backward

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        axis = self.layer.param.inner_product_param.axis % len(shape)
        self.axis = axis
        self.outer = int(np.prod(shape[:axis], dtype=np.int64))
        self.K = int(np.prod(shape[axis:], dtype=np.int64))
        if self.K != self.layer.blobs[0].shape[1]:
            raise self.layer.error("bottom", f"input size must stay {self.layer.blobs[0].shape[1]}",
                                   self.K)
        top[0].reshape(tuple(shape[:axis]) + (self.M,))
        n = self.size * self.outer
        self.x_all = np.empty((n, self.K), np.float32)
        self.y_part = np.empty((n, self.m), np.float32)
        self.y_recv = np.empty((self.size, self.outer, self.m), np.float32)

    def forward(self, bottom, top):
        x = np.ascontiguousarray(bottom[0].data.reshape(self.outer, self.K))
        self.comm.Allgather(x, self.x_all)
        np.matmul(self.x_all, self.layer.blobs[0].data.T, out=self.y_part)
        if self.bias:
            self.y_part += self.layer.blobs[1].data
        # block s of y_part (rank s's rows) goes to rank s
        self.comm.Alltoall(self.y_part, self.y_recv)
        top[0].data.reshape(self.outer, self.M)[...] = \
            self.y_recv.transpose(1, 0, 2).reshape(self.outer, self.M)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.outer, self.size, self.m).transpose(1, 0, 2)
        send = np.ascontiguousarray(dy)
        dy_all = np.empty((self.size * self.outer, self.m), np.float32)
        self.comm.Alltoall(send, dy_all)
        ppd = self.layer.param_propagate_down
        if ppd and ppd[0]:
            self.layer.blobs[0].diff[...] += dy_all.T @ self.x_all
        if self.bias and len(ppd) > 1 and ppd[1]:
            self.layer.blobs[1].diff[...] += dy_all.sum(axis=0, dtype=np.float64).astype(np.float32)
        if propagate_down[0]:
            dx_all = dy_all @ self.layer.blobs[0].data
            dx = np.empty((self.outer, self.K), np.float32)
            self.comm.Reduce_scatter_block(dx_all, dx)
            bottom[0].diff.reshape(self.outer, self.K)[...] = dx
