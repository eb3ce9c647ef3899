"""Gradient averaging across ranks, overlapped with backward.

Parameters are grouped into buckets in backward order (the order their
gradients become final). A bucket is sent as soon as the backward pass has
passed the lowest layer that uses one of its parameters: small parameters are
packed into one contiguous buffer of about `bucket_bytes`, a parameter larger
than that is reduced in place in its own diff. `finish()` (before the update)
waits for every bucket and divides by the number of ranks.

How communication progresses while backward computes (`progress`):
    thread   a dedicated thread runs blocking Allreduce on the queued buckets,
             then averages and unpacks them (MPI_THREAD_MULTIPLE; MPI and the
             compute kernels release the GIL)
    test     non-blocking Iallreduce, poked with Testall after every layer
             (MPICH advances non-blocking collectives only inside MPI calls)
    wait     non-blocking Iallreduce, left alone until finish()
    blocking no overlap: one Allreduce per bucket in finish() (the reference)
    none     no communication at all (benchmarks only: the compute-only time)
The default comes from CAFFEPY_MPI_PROGRESS, else `thread` (see
benchmarks/bench_mpi.py for the measurements behind that choice).
Buffer-based (uppercase) MPI calls on float32 arrays only: nothing is pickled.
"""
import os
import queue
import threading
import time

import numpy as np

PROGRESS_MODES = ("thread", "test", "wait", "blocking", "none")
DEFAULT_BUCKET_BYTES = 4 << 20


def default_progress():
    mode = os.environ.get("CAFFEPY_MPI_PROGRESS", "thread")
    if mode not in PROGRESS_MODES:
        from ..errors import ParallelError
        raise ParallelError(f"CAFFEPY_MPI_PROGRESS: unknown mode, got '{mode}'. "
                            f"Use one of {', '.join(PROGRESS_MODES)}")
    return mode


class _Bucket:
    """Parameters reduced together; `ready_layer` = the lowest layer index using any."""

    def __init__(self):
        self.blobs = []
        self.ready_layer = None
        self.count = 0
        self.buffer = None        # packed float32 buffer (None: single blob, in place)
        self.request = None
        self.done = threading.Event()

    def add(self, blob, ready_layer):
        self.blobs.append(blob)
        self.count += blob.count
        self.ready_layer = ready_layer if self.ready_layer is None else min(self.ready_layer, ready_layer)

    def pack(self):
        if len(self.blobs) == 1:
            return self.blobs[0].diff.reshape(-1)
        if self.buffer is None or self.buffer.size != self.count:
            self.buffer = np.empty(self.count, np.float32)
        offset = 0
        for blob in self.blobs:
            n = blob.count
            self.buffer[offset:offset + n] = blob.diff.reshape(-1)
            offset += n
        return self.buffer

    def unpack(self, scale):
        if len(self.blobs) == 1:
            diff = self.blobs[0].diff
            diff *= scale
            return
        offset = 0
        for blob in self.blobs:
            n = blob.count
            np.multiply(self.buffer[offset:offset + n].reshape(blob.shape), scale, out=blob.diff)
            offset += n


class GradientReducer:
    """Average the diffs of `params` over `comm`.

    params: [(blob, ready_layer)] — ready_layer is the lowest layer index whose
    backward writes that blob's diff (its gradient is final once that layer ran).
    """

    def __init__(self, comm, params, bucket_bytes=DEFAULT_BUCKET_BYTES, progress=None):
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm
        self.size = comm.Get_size()
        self._scale = np.float32(1.0 / self.size)
        self.progress = progress or default_progress()
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"unknown progress mode {self.progress!r}")
        self.buckets = self._make_buckets(params, bucket_bytes)
        self.nbytes = 4 * sum(b.count for b in self.buckets)
        self._next = 0                  # first bucket not yet issued
        self._queue = None
        self._thread = None
        self._error = None
        # timing of the last iteration, for benchmarks and the log
        self.wait_seconds = 0.0
        self.comm_seconds = 0.0
        if self.progress == "thread":
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="caffepy-allreduce", daemon=True)
            self._thread.start()

    @staticmethod
    def _make_buckets(params, bucket_bytes):
        ordered = sorted(params, key=lambda p: -p[1])    # backward order (stable for ties)
        buckets, current = [], _Bucket()
        for blob, ready in ordered:
            size = 4 * blob.count
            if size >= bucket_bytes:
                if current.blobs:
                    buckets.append(current)
                    current = _Bucket()
                single = _Bucket()
                single.add(blob, ready)
                buckets.append(single)
                continue
            current.add(blob, ready)
            if 4 * current.count >= bucket_bytes:
                buckets.append(current)
                current = _Bucket()
        if current.blobs:
            buckets.append(current)
        return buckets

    # -- called from backward ---------------------------------------------
    def layer_done(self, layer_index):
        """Start every bucket whose gradients are final once `layer_index` ran."""
        if self.progress in ("blocking", "none"):
            return
        while self._next < len(self.buckets) and self.buckets[self._next].ready_layer >= layer_index:
            self._issue(self.buckets[self._next])
            self._next += 1
        if self.progress == "test":
            pending = [b.request for b in self.buckets[:self._next] if b.request is not None]
            if pending:
                self._MPI.Request.Testall(pending)

    def _issue(self, bucket):
        buf = bucket.pack()
        if self.progress == "thread":
            bucket.done.clear()
            self._queue.put((bucket, buf))
        else:
            bucket.request = self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            bucket, buf = item
            try:
                t = time.perf_counter()
                self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)
                # averaging and unpacking here too: the diffs of a sent bucket are
                # final, nothing else touches them before the update
                bucket.unpack(self._scale)
                self.comm_seconds += time.perf_counter() - t
            except BaseException as e:       # surfaced by finish() on the main thread
                self._error = e
            bucket.done.set()

    # -- called before the update -------------------------------------------
    def finish(self):
        """Issue what is left, wait for everything, leave the averaged gradients in the diffs."""
        t0 = time.perf_counter()
        scale = np.float32(1.0 / self.size)
        if self.progress == "none":
            self._next = 0
            self.wait_seconds = time.perf_counter() - t0
            return
        if self.progress == "blocking":
            for bucket in self.buckets:
                buf = bucket.pack()
                self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)
                bucket.unpack(scale)
            self.wait_seconds = self.comm_seconds = time.perf_counter() - t0
            return
        while self._next < len(self.buckets):
            self._issue(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            if self.progress == "thread":
                bucket.done.wait()          # reduced, averaged and unpacked by the thread
            else:
                bucket.request.Wait()
                bucket.request = None
                bucket.unpack(scale)
        self._next = 0
        self.wait_seconds = time.perf_counter() - t0
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def reset_timers(self):
        self.wait_seconds = self.comm_seconds = 0.0

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
