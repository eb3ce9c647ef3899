"""The model-parallel InnerProduct: a variant of InnerProduct split across the ranks.

The factory (caffepy.layer.create_layer) picks it under a distributed run context for the
layers the prototxt marks, with Intel Caffe's fields:
    layer { type: "InnerProduct" ... multinode { model_parts: 0 } }   # 0 = all ranks
or for a range of layers at the net level:
    multinode { model_parallel { layer_from: "fc6" layer_to: "fc8" model_parts: 0 } }
Only splitting over all ranks is supported (model_parts 0 or N, num_nodes 0 or N);
`model_parallel_names` holds these rules and their errors.

Rank r keeps rows offsets[r] .. offsets[r] + counts[r] of the weights (and the same slice of
the bias; the first M % N ranks hold one more). Each layer
    forward:  allgathers the local bottoms into the global batch (N*b, K), computes its output
              slice (N*b, M/N), and alltoalls so each rank gets its own rows with every
              output (b, M);
    backward: alltoalls the top diff back to (N*b, M/N) slices, accumulates the weight
              gradient of its slice over the global batch, and reduce-scatters the partial
              bottom gradients (summed over ranks) back to each rank's (b, K).
It is built with the full weights, so loading -weights, restoring a snapshot and broadcasting
rank 0's weights see the whole matrix; `keep_own_rows` then drops the other ranks' rows (the
Hybrid strategy calls it once the weights agree everywhere), and the test nets' copies of the
layer use those rows (`share_rows`).
"""
import time

import numpy as np

from ..blas import gemm_into
from ..errors import ParallelError, ShapeError, layer_error
from ..layer import MODEL_PARALLEL, canonical_axis, count_from, register
from ..layers.common import InnerProduct, param_wanted
from ..proto import caffe_pb2


def _split_over_all(parts, nodes, size):
    return parts in (0, size) or (parts > size and nodes in (0, size))


def model_parallel_names(net, size, source=None):
    """Names of the layers of NetParameter `net` split across `size` ranks by its `multinode`
    settings, in net order; ParallelError for settings caffepy cannot honour."""
    chosen = []
    names = [lp.name for lp in net.layer]
    ranges = []
    where = f"{source}: " if source else ""
    for mp in net.multinode.model_parallel:
        if mp.layer_from not in names:
            raise ParallelError(f"{where}multinode.model_parallel.layer_from: no layer named "
                                f"'{mp.layer_from}'")
        last = mp.layer_to or mp.layer_from
        if last not in names:
            raise ParallelError(f"{where}multinode.model_parallel.layer_to: no layer named "
                                f"'{last}'")
        parts = mp.model_parts
        if parts == 1:
            continue
        if not _split_over_all(parts, mp.num_nodes, size):
            raise ParallelError(f"{where}multinode.model_parallel.model_parts: only splitting "
                                f"over all {size} ranks is supported (0 or {size}), got {parts}")
        ranges.append((names.index(mp.layer_from), names.index(last)))
    for li, lp in enumerate(net.layer):
        in_range = any(lo <= li <= hi for lo, hi in ranges)
        marked = lp.HasField("multinode") and lp.multinode.model_parts != 1
        if marked and not _split_over_all(lp.multinode.model_parts, lp.multinode.num_nodes, size):
            raise layer_error(lp, "multinode.model_parts", "only splitting over all "
                              f"{size} ranks is supported (0 or {size})", lp.multinode.model_parts,
                              cls=ParallelError, source=source)
        if not (marked or in_range):
            continue
        if lp.type != "InnerProduct":
            if marked:
                raise layer_error(lp, "multinode", "model parallelism is implemented for "
                                  "InnerProduct layers only", lp.type, cls=ParallelError,
                                  source=source)
            continue                # layers inside a model_parallel range stay data parallel
        ip = lp.inner_product_param
        if ip.transpose:
            raise layer_error(lp, "inner_product_param.transpose", "model-parallel InnerProduct "
                              "needs untransposed weights", True, cls=ParallelError, source=source)
        if ip.num_output < size:
            raise layer_error(lp, "inner_product_param.num_output", f"must be at least the "
                              f"number of ranks ({size}) to split it across them", ip.num_output,
                              cls=ParallelError, source=source)
        chosen.append(lp.name)
    return chosen


@register(variant=MODEL_PARALLEL)
class ModelParallelInnerProduct(InnerProduct):
    """InnerProduct with its outputs split across the ranks of `self.context` (see above)."""
    type = "InnerProduct"

    @classmethod
    def wanted(cls, request):
        context = request.context
        if not context.distributed:
            return False
        net = request.net
        if net is None:                 # a layer alone: its own multinode mark decides
            net = caffe_pb2.NetParameter(layer=[request.param])
        return request.param.name in model_parallel_names(net, context.size, request.source)

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.comm = self.context.comm
        self.rank, self.size = self.context.rank, self.context.size
        base, extra = divmod(self.num_output, self.size)
        self.counts = [base + (1 if r < extra else 0) for r in range(self.size)]
        self.offsets = [sum(self.counts[:r]) for r in range(self.size)]
        self.m = self.counts[self.rank]
        self.rows = slice(self.offsets[self.rank], self.offsets[self.rank] + self.m)
        self.split = self.m == self.num_output
        self.outer = None
        self.exchange_seconds = 0.0     # wall time in its MPI exchanges (the display line on ranks)

    def keep_own_rows(self):
        """Keep this rank's rows of the weights and bias only (once; every rank must hold the
        same full weights when it is called)."""
        if not self.split:
            for blob in self.blobs:
                blob.set_data(blob.data[self.rows].copy())
            self.split = True

    def share_rows(self, other):
        """Use the rows `other` keeps (the same layer in the train net, split already): a test
        net's layer sees the trained weights without gathering them."""
        assert other.split and (self.counts, self.offsets) == (other.counts, other.offsets)
        for mine, theirs in zip(self.blobs, other.blobs):
            mine.reshape(theirs.shape)
            mine.share_data(theirs)
        self.split = True

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        axis = canonical_axis(self, self.param.inner_product_param.axis, len(shape),
                              "inner_product_param.axis")
        outer, K = count_from(shape, 0, axis), count_from(shape, axis)
        if K != self.K:
            raise self.error("bottom", f"input size from axis {axis} must be {self.K} (the "
                             "weights' K)", K, cls=ShapeError)
        top[0].reshape(tuple(shape[:axis]) + (self.num_output,))
        if self.fused is not None:
            self.fused.reshape(self, bottom, top)
        if outer == self.outer:
            return
        self.outer = outer
        n = self.size * outer
        self.x_all = np.empty((n, K), np.float32)
        self.y_part = np.empty((n, self.m), np.float32)
        self.dy_all = np.empty((n, self.m), np.float32)
        self.exchange = np.empty(outer * self.num_output, np.float32)      # (outer, m_s) blocks by rank
        self.dx = np.empty((outer, K), np.float32)
        self.block_counts = [outer * m for m in self.counts]
        self.block_displs = [outer * o for o in self.offsets]

    def _blocks(self):
        return [self.exchange[d:d + c].reshape(self.outer, c // self.outer if self.outer else 0)
                for d, c in zip(self.block_displs, self.block_counts)]

    def _exchange(self, call, *args):
        """One MPI exchange, its wall time added to exchange_seconds."""
        started = time.perf_counter()
        call(*args)
        self.exchange_seconds += time.perf_counter() - started

    def forward(self, bottom, top):
        from mpi4py import MPI
        assert self.split, "keep_own_rows() comes before the first forward"
        x = np.ascontiguousarray(bottom[0].data.reshape(self.outer, self.K))
        self._exchange(self.comm.Allgather, x, self.x_all)
        gemm_into(self.x_all, self.blobs[0].data.T, self.y_part)
        if self.bias_term:
            self.y_part += self.blobs[1].data
        # rows of rank s (block s of y_part) go to rank s; from rank s come my rows of its outputs
        sends = [self.outer * self.m] * self.size
        sdispl = [s * self.outer * self.m for s in range(self.size)]
        self._exchange(self.comm.Alltoallv, [self.y_part, (sends, sdispl), MPI.FLOAT],
                       [self.exchange, (self.block_counts, self.block_displs), MPI.FLOAT])
        y = top[0].data.reshape(self.outer, self.num_output)
        for block, offset, count in zip(self._blocks(), self.offsets, self.counts):
            y[:, offset:offset + count] = block
        if self.fused is not None:
            self.fused.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        from mpi4py import MPI
        if self.fused is not None:
            top, propagate_down, bottom = self.fused.backward(top, propagate_down, bottom)
        dy = top[0].diff.reshape(self.outer, self.num_output)
        for block, offset, count in zip(self._blocks(), self.offsets, self.counts):
            block[...] = dy[:, offset:offset + count]
        recvs = [self.outer * self.m] * self.size
        rdispl = [s * self.outer * self.m for s in range(self.size)]
        self._exchange(self.comm.Alltoallv,
                       [self.exchange, (self.block_counts, self.block_displs), MPI.FLOAT],
                       [self.dy_all, (recvs, rdispl), MPI.FLOAT])
        if param_wanted(self, 0):
            gemm_into(self.dy_all.T, self.x_all, self.blobs[0].diff, 1.0)
        if self.bias_term and param_wanted(self, 1):
            self.blobs[1].diff[...] += self.dy_all.sum(axis=0)
        if propagate_down[0]:
            dx_all = np.empty((self.dy_all.shape[0], self.K), np.float32)
            gemm_into(self.dy_all, self.blobs[0].data, dx_all)
            self._exchange(self.comm.Reduce_scatter_block, dx_all, self.dx)
            bottom[0].diff.reshape(self.outer, self.K)[...] = self.dx
