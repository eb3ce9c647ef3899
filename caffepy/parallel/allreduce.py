"""Gradient averaging across ranks, overlapped with backward (and with the next forward).

Parameters are grouped into buckets in backward order (the order their
gradients become final). A bucket is reduced as soon as the backward pass has
passed the lowest layer that uses one of its parameters. With the `thread`
progress mode the update does not wait for it: the solver updates each
parameter just before the next forward reaches a layer that uses it
(Hooks.pending_gradients / await_gradients), so a bucket's reduction has the rest
of backward and the next forward up to its layer to travel. `finish()` waits for
every bucket instead (the other modes, clip_gradients, snapshots, tests).

How a bucket is reduced (`algorithm`, CAFFEPY_MPI_ALLREDUCE, default `shm`):
    shm  ranks on one host keep their parameter diffs in one MPI-3 shared-memory
         window, laid out bucket by bucket, so backward writes gradients where
         every local rank can read them. Local rank r of L sums slice r of the
         bucket over the L windows (scaled by 1/N) into its own window, ranks
         with the same local rank on other hosts reduce that slice over the
         ring (ring.py), and each rank copies the other slices from their
         owners. No packing, no kernel-mediated copies: on 2 ranks about 40% of
         the CPU time of MPICH's Allreduce of the same bytes
         (benchmarks/bench_mpi.py --options). Ranks wait for each other on flags
         in the window, sleeping when the wait is long, instead of spinning on a
         core backward needs. Used with the `thread` and `blocking` progress
         modes, when every host runs the same number (> 1) of ranks; otherwise
         the diffs stay private and the `ring` algorithm runs.
    ring the ring allreduce of ring.py over the ranks: pieces sized for the link
         (measured when the reducer is built), the sums done by NumPy, waiting
         by tests and sleeps instead of MPI's busy polling. With the `thread`
         mode the most urgent bucket goes first (the one the next forward needs
         earliest), between two pieces of a less urgent one.
    mpi  MPI Allreduce on the diff in place (one parameter per bucket when it is
         larger than `bucket_bytes`), or on a packed buffer of small ones, in
         slices of `chunk_bytes` (MPICH reduces 244 MB in 1 MB slices with about
         half the CPU time it takes as one message: the copies stay in cache).
         MPICH polls the network while it waits: a core per rank.

How communication progresses while backward computes (`progress`):
    thread   a dedicated thread reduces the queued buckets (MPI_THREAD_MULTIPLE;
             MPI, NumPy and the compute kernels release the GIL)
    test     non-blocking Iallreduce, poked with Testall after every layer
             (MPICH advances non-blocking collectives only inside MPI calls)
    wait     non-blocking Iallreduce, left alone until finish()
    blocking no overlap: every bucket reduced in finish() (the reference)
    none     no communication at all (benchmarks only: the compute-only time)
The default comes from CAFFEPY_MPI_PROGRESS, else `thread` (see
benchmarks/bench_multihost.py and bench_mpi.py for the measurements behind these
choices). Buffer-based (uppercase) MPI calls on float32 arrays only: nothing is
pickled.

What travels between hosts (`wire`, CAFFEPY_MPI_WIRE_TYPE, opt-in): `float32` (the
default), or `bfloat16`: the ring's messages carry each float's top 16 bits, rounded
(half the bytes), and every sum is still done in float32 (ring.py). Needs the ring
(or shm's ring between hosts); MPI's own Allreduce has no bfloat16 sum.
"""
import os
import queue
import threading
import time

import numpy as np

from .ring import WIRE_TYPES, Link, Poller, Ring

PROGRESS_MODES = ("thread", "test", "wait", "blocking", "none")
ALGORITHMS = ("shm", "ring", "mpi")
DEFAULT_BUCKET_BYTES = 4 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
_SHM_PROGRESS = ("thread", "blocking")
_ALIGN = 16                  # floats: slices and buckets start on 64-byte cache lines
_HEADER = 64                 # bytes before each rank's gradients: its fence counter
_SUM_CHUNK = 1 << 16         # floats summed at a time (256 KB: scaled while in L2)


def _choice(var, default, allowed):
    value = os.environ.get(var, default)
    if value not in allowed:
        from ..errors import ParallelError
        raise ParallelError(f"{var}: unknown value, got '{value}'. Use one of {', '.join(allowed)}")
    return value


def default_progress():
    return _choice("CAFFEPY_MPI_PROGRESS", "thread", PROGRESS_MODES)


def default_algorithm():
    return _choice("CAFFEPY_MPI_ALLREDUCE", "shm", ALGORITHMS)


def default_wire():
    return _choice("CAFFEPY_MPI_WIRE_TYPE", "float32", WIRE_TYPES)


class _Bucket:
    """Parameters reduced together; `ready_layer` = the lowest layer index using any."""

    def __init__(self):
        self.index = 0            # position in backward order; the ring's message tag
        self.blobs = []
        self.ready_layer = None
        self.count = 0
        self.buffer = None        # packed float32 buffer (None: single blob, in place)
        self.requests = []
        self.offset = 0           # first float of the bucket in a rank's shared window
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
        """Diffs from the packed buffer, times `scale` (None: as they are); a single blob was
        reduced in place already."""
        if len(self.blobs) == 1:
            return
        offset = 0
        for blob in self.blobs:
            n = blob.count
            part = self.buffer[offset:offset + n].reshape(blob.shape)
            if scale is None:
                np.copyto(blob.diff, part)
            else:
                np.multiply(part, scale, out=blob.diff)
            offset += n


class NodeWindow:
    """The diffs of every rank on this host in one MPI-3 shared-memory window.

    Each rank's segment: a 64-byte header (its fence counter), then the diffs
    of all buckets in bucket order, each bucket starting on a cache line. The
    blobs' diffs are placed there (Blob.place_diff), so backward writes its
    gradients straight into memory the other local ranks read.
    """

    def __init__(self, comm, buckets, node, cross, scale):
        from mpi4py import MPI
        self._MPI = MPI
        self.node, self.cross = node, cross
        self.ring = None          # set by the reducer: the cross-host ring
        self.local_size, self.local_rank = node.Get_size(), node.Get_rank()
        self.scale = scale
        self.total = self.layout(buckets)
        self.win = MPI.Win.Allocate_shared(_HEADER + 4 * self.total, 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)          # Win.Sync needs a passive epoch
        self.flags, self.views = [], []
        for rank in range(self.local_size):
            mem, _ = self.win.Shared_query(rank)
            self.flags.append(np.frombuffer(mem, np.int64, 1, 0))
            self.views.append(np.frombuffer(mem, np.float32, self.total, _HEADER))
        self.own = self.views[self.local_rank]
        self.flags[self.local_rank][0] = 0
        self._generation = 0
        self.node.Barrier()              # every counter zeroed before anyone fences
        for bucket in buckets:
            self.place(bucket)

    @classmethod
    def create(cls, comm, buckets, scale):
        """A NodeWindow when several ranks share a host and every host has as many;
        None otherwise (decided collectively: every rank gets the same answer)."""
        from mpi4py import MPI
        per_node = int(os.environ.get("CAFFEPY_MPI_RANKS_PER_NODE", "0") or 0)
        if per_node > 0:            # tests: emulate hosts of `per_node` ranks on one machine
            node = comm.Split(comm.Get_rank() // per_node, comm.Get_rank())
        else:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, comm.Get_rank())
        local = node.Get_size()
        lo, hi = comm.allreduce(local, op=MPI.MIN), comm.allreduce(local, op=MPI.MAX)
        if hi == 1 or lo != hi:
            node.Free()
            return None
        need = local * (_HEADER + 4 * cls.layout(buckets))
        free = _shm_free_bytes()
        if comm.allreduce(int(free >= need), op=MPI.MIN) == 0:
            if free < need:
                from .. import log
                log.warning(f"/dev/shm has {free / 1e6:.0f} MB free, the shared-memory allreduce "
                            f"needs {need / 1e6:.0f} MB on this host: using the ring allreduce instead")
            node.Free()
            return None
        cross = comm.Split(node.Get_rank(), comm.Get_rank())
        if cross.Get_size() == 1:
            cross.Free()
            cross = None
        return cls(comm, buckets, node, cross, scale)

    @staticmethod
    def layout(buckets):
        """Set each bucket's offset in a rank's segment; returns the floats a segment holds."""
        offset = 0
        for bucket in buckets:
            bucket.offset = offset
            offset += -(-bucket.count // _ALIGN) * _ALIGN
        return offset

    def place(self, bucket):
        offset = bucket.offset
        for blob in bucket.blobs:
            blob.place_diff(self.own[offset:offset + blob.count])
            offset += blob.count

    def check_placed(self, bucket):
        # a blob whose diff was reallocated (reshaped up and down) is put back in place
        address = self.own.ctypes.data + 4 * bucket.offset
        for blob in bucket.blobs:
            if blob.diff.ctypes.data != address:
                if sum(b.count for b in bucket.blobs) != bucket.count:
                    from ..errors import ParallelError
                    raise ParallelError(f"parameter blob '{blob.name}' changed size during "
                                        f"training, got {blob.shape}")
                self.place(bucket)
                return
            address += 4 * blob.count

    def _slice(self, bucket, rank):
        n = bucket.count
        lo = n * rank // self.local_size // _ALIGN * _ALIGN
        hi = n if rank == self.local_size - 1 else n * (rank + 1) // self.local_size // _ALIGN * _ALIGN
        return bucket.offset + lo, bucket.offset + hi

    def fence(self):
        """Wait until every local rank has reached its matching fence; their window writes
        before it are then visible here."""
        self._generation += 1
        generation = self._generation
        self.win.Sync()
        self.flags[self.local_rank][0] = generation
        self.win.Sync()
        t0 = time.perf_counter()
        # spin for a short wait, then sleep: a rank still in backward may be far behind,
        # and spinning would take the core from its compute (or from our own main thread).
        # Sleeps grow with the wait so far (at most 1/20 of it, 2 ms): a long wait costs
        # under 1% of a core and arrives at most 5% late
        while any(flag[0] < generation for flag in self.flags):
            waited = time.perf_counter() - t0
            if waited > 100e-6:
                time.sleep(min(max(20e-6, waited / 20), 2e-3))
        self.win.Sync()

    def reduce(self, bucket):
        """Average the bucket over every rank; leaves the result in this rank's diffs."""
        self.check_placed(bucket)
        self.fence()                                  # every local rank's gradients written
        lo, hi = self._slice(bucket, self.local_rank)
        others = [v for r, v in enumerate(self.views) if r != self.local_rank]
        scale = self.scale if self.cross is None else None
        for start in range(lo, hi, _SUM_CHUNK):
            end = min(start + _SUM_CHUNK, hi)
            out = self.own[start:end]
            for view in others:
                np.add(out, view[start:end], out=out)
            if scale is not None:
                out *= scale                          # still in cache
        if self.cross is not None:
            self.ring.allreduce(self.own[lo:hi], self.scale, tag=bucket.index)
        self.fence()                                  # every slice summed
        for rank, view in enumerate(self.views):
            if rank != self.local_rank:
                a, b = self._slice(bucket, rank)
                np.copyto(self.own[a:b], view[a:b])
        # every copy done before any rank changes its diffs (the update writes its step
        # there, then they are cleared)
        self.fence()

    def close(self, buckets):
        """Give the blobs private diffs again (with their values) and free the window."""
        for bucket in buckets:
            for blob in bucket.blobs:
                blob.place_diff(np.empty(blob.count, np.float32))
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()
        if self.cross is not None:
            self.cross.Free()


def _shm_free_bytes():
    """Free bytes where MPICH maps shared windows (a container's /dev/shm is often 64 MB)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 1 << 62               # no /dev/shm: MPICH maps elsewhere, nothing to check
    return st.f_bavail * st.f_frsize


def _chunked_allreduce(comm, buf, scale, MPI, chunk=DEFAULT_CHUNK_BYTES // 4):
    for start in range(0, buf.size, chunk):
        part = buf[start:start + chunk]
        comm.Allreduce(MPI.IN_PLACE, part, op=MPI.SUM)
        if scale is not None:
            part *= scale                             # still in cache



class GradientReducer:
    """Average the diffs of `params` over `comm`.

    params: [(blob, ready_layer)] — ready_layer is the lowest layer index whose
    backward writes that blob's diff (its gradient is final once that layer ran).
    link: a ring.Link measured before (None: measured here when the ring needs it).
    Collective: every rank builds its reducer (and closes it) at the same point.
    """

    def __init__(self, comm, params, bucket_bytes=None, progress=None, algorithm=None,
                 chunk_bytes=DEFAULT_CHUNK_BYTES, link=None, wire=None):
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm
        self.size = comm.Get_size()
        self._scale = np.float32(1.0 / self.size)
        self.progress = progress or default_progress()
        if self.progress not in PROGRESS_MODES:
            raise ValueError(f"unknown progress mode {self.progress!r}")
        if self.progress == "thread" and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            # the thread would call MPI beside the main thread: only MPI_THREAD_MULTIPLE allows it
            if progress or "CAFFEPY_MPI_PROGRESS" in os.environ:
                from ..errors import ParallelError
                raise ParallelError(f"CAFFEPY_MPI_PROGRESS: 'thread' needs MPI_THREAD_MULTIPLE, MPI granted "
                                    f"level {MPI.Query_thread()}. Use blocking, test or wait")
            self.progress = "blocking"
        requested = algorithm or default_algorithm()
        if requested not in ALGORITHMS:
            raise ValueError(f"unknown allreduce algorithm {requested!r}")
        if self.progress in ("test", "wait"):
            requested = "mpi"            # they are MPI's non-blocking Iallreduce
        self.wire = wire or default_wire()
        if self.wire not in WIRE_TYPES:
            raise ValueError(f"unknown wire type {self.wire!r}")
        if self.wire != "float32" and requested == "mpi" and self.progress != "none":
            from ..errors import ParallelError
            raise ParallelError(f"CAFFEPY_MPI_WIRE_TYPE: {self.wire} needs the ring or shm allreduce, got "
                                f"algorithm mpi (progress {self.progress}). MPI's Allreduce has no "
                                f"{self.wire} sum: unset CAFFEPY_MPI_WIRE_TYPE or use "
                                f"CAFFEPY_MPI_ALLREDUCE=ring with progress thread or blocking")
        self._chunk = max(_ALIGN, chunk_bytes // 4)
        self.link = link
        ring_comm = comm
        self.window = None
        if requested == "shm" and self.progress in _SHM_PROGRESS:
            # the window's layout needs the buckets: sized for a host-local reduction first
            self.buckets = self._make_buckets(params, bucket_bytes or DEFAULT_BUCKET_BYTES)
            self.window = NodeWindow.create(comm, self.buckets, self._scale)
            if self.window is None:
                requested = "ring"
            else:
                ring_comm = self.window.cross
        self.algorithm = "shm" if self.window is not None else requested
        self.ring = None
        if ring_comm is not None and self.algorithm in ("shm", "ring") and self.progress != "none":
            if self.link is None:
                self.link = Link.measure(ring_comm)
            self.ring = Ring(ring_comm, self.link.piece_bytes() // 4, self.link.poll_cap(), wire=self.wire)
            if self.window is not None:
                self.window.ring = self.ring
        if self.window is None:
            if bucket_bytes is None:
                # buckets sized for the link: a ring step of a bucket is about one piece
                bucket_bytes = DEFAULT_BUCKET_BYTES
                if self.ring is not None:
                    bucket_bytes = max(bucket_bytes, self.size * 4 * self.ring.piece)
            self.buckets = self._make_buckets(params, bucket_bytes)
        self.nbytes = 4 * sum(b.count for b in self.buckets)
        self._bucket_of = {id(blob): bucket for bucket in self.buckets for blob in bucket.blobs}
        self._next = 0                  # first bucket not yet issued
        self._queue = None
        self._thread = None
        self._error = None
        # seconds the main thread waited for reductions, and the communication took (in
        # the thread: with its sleeps), since the reducer was built or reset_timers()
        self.wait_seconds = 0.0
        self.comm_seconds = 0.0
        if self.progress == "thread":
            self._queue = queue.SimpleQueue()
            run = self._run_ring if self.window is None and self.ring is not None else self._run
            self._thread = threading.Thread(target=run, name="caffepy-allreduce", daemon=True)
            self._thread.start()

    def describe(self):
        wire = f", {self.wire} on the wire" if self.ring is not None and self.ring.compress else ""
        if self.window is not None:
            w = self.window
            hosts = 1 if w.cross is None else w.cross.Get_size()
            return f"shm ({w.local_size} ranks per host, {hosts} host{'s' if hosts > 1 else ''}{wire})"
        if self.algorithm == "ring" and self.ring is not None:
            return f"ring ({self.size} ranks, {4 * self.ring.piece / 1e6:.1f} MB pieces{wire})"
        return self.algorithm

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
        for index, bucket in enumerate(buckets):
            bucket.index = index
        return buckets

    # -- one bucket, blocking ------------------------------------------------
    def _reduce(self, bucket):
        if self.window is not None:
            self.window.reduce(bucket)
            return
        single = len(bucket.blobs) == 1
        if self.ring is not None:
            self.ring.allreduce(bucket.pack(), self._scale, tag=bucket.index)
            bucket.unpack(None)
            return
        _chunked_allreduce(self.comm, bucket.pack(), self._scale if single else None, self._MPI,
                           self._chunk)
        bucket.unpack(self._scale)

    # -- called from backward ---------------------------------------------
    def layer_done(self, layer_index):
        """Start every bucket whose gradients are final once `layer_index` ran."""
        if self.progress in ("blocking", "none"):
            return
        while self._next < len(self.buckets) and self.buckets[self._next].ready_layer >= layer_index:
            self._issue(self.buckets[self._next])
            self._next += 1
        if self.progress == "test":
            pending = [r for b in self.buckets[:self._next] for r in b.requests]
            if pending:
                self._MPI.Request.Testall(pending)

    def _issue(self, bucket):
        if self.progress == "thread":
            bucket.done.clear()
            self._queue.put(bucket)
            return
        # one request per bucket: with a hundred 64 KB slices in flight the wait-mode
        # test hung now and then (MPICH 5.0.2)
        bucket.requests = [self.comm.Iallreduce(self._MPI.IN_PLACE, bucket.pack(), op=self._MPI.SUM)]

    def _run(self):
        """The thread, buckets one after another (shm, mpi: the ranks must take them in the
        same order)."""
        while True:
            bucket = self._queue.get()
            if bucket is None:
                return
            try:
                t = time.perf_counter()
                if self._error is None:      # after a failure the ranks no longer pair up: skip
                    # averaging and unpacking here too: the diffs of a sent bucket are
                    # final, nothing else touches them before the update
                    self._reduce(bucket)
                self.comm_seconds += time.perf_counter() - t
            except BaseException as e:       # surfaced on the main thread by wait()
                self._error = e
            bucket.done.set()

    def _run_ring(self):
        """The thread, ring algorithm: every queued bucket is under way, the most urgent one
        (the lowest layer, which the next forward needs first) posting new pieces. The
        priorities are the same on every rank, so whatever the ranks have queued, the most
        urgent bucket queued everywhere moves: no rank waits for a message another never
        posts."""
        active = []                          # [(bucket, transfer)], most urgent first
        poller = Poller(self.ring.poll_cap)
        while True:
            try:
                item = self._queue.get(block=not active)
                while True:
                    if item is None:
                        return
                    t = time.perf_counter()
                    active.append((item, self.ring.transfer(item.pack(), self._scale, item.index)))
                    self.comm_seconds += time.perf_counter() - t
                    item = self._queue.get(block=False)
            except queue.Empty:
                pass
            active.sort(key=lambda a: (a[0].ready_layer, a[0].index))
            t = time.perf_counter()
            try:
                progressed = self._error is None and active[0][1].post() > 0
                for bucket, transfer in active:
                    if self._error is None:
                        progressed = transfer.test() or progressed
                    if transfer.done or self._error is not None:
                        if self._error is None:
                            bucket.unpack(None)
                        transfer.release()
                        bucket.done.set()
            except BaseException as e:       # surfaced on the main thread by wait()
                self._error = e
                for bucket, transfer in active:
                    transfer.release()
                    bucket.done.set()
                active = []
                continue
            active = [a for a in active if not a[0].done.is_set()]
            self.comm_seconds += time.perf_counter() - t
            if progressed:
                poller.progressed()
            elif active:
                poller.idle()

    # -- called after backward ---------------------------------------------
    def issue_all(self):
        """Backward is over: start every bucket not started yet (non-blocking, `thread` mode)."""
        if self.progress != "thread":
            return
        while self._next < len(self.buckets):
            self._issue(self.buckets[self._next])
            self._next += 1
        self._next = 0                  # the next backward starts from the first bucket again

    def blobs(self):
        return [blob for bucket in self.buckets for blob in bucket.blobs]

    def wait(self, blobs):
        """`thread` mode: return once the buckets holding `blobs` are reduced (averaged and
        back in the diffs)."""
        t0 = time.perf_counter()
        for bucket in {id(self._bucket_of[id(b)]): self._bucket_of[id(b)] for b in blobs}.values():
            bucket.done.wait()
        self.wait_seconds += time.perf_counter() - t0
        self._raise()

    def _raise(self):
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finish(self):
        """Issue what is left, wait for everything, leave the averaged gradients in the diffs."""
        t0 = time.perf_counter()
        if self.progress == "none":
            self._next = 0
            return
        if self.progress == "blocking":
            for bucket in self.buckets:
                self._reduce(bucket)
            elapsed = time.perf_counter() - t0
            self.wait_seconds += elapsed
            self.comm_seconds += elapsed
            return
        if self.progress == "thread":
            self.issue_all()
            self.wait(self.blobs())
            return
        while self._next < len(self.buckets):
            self._issue(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            self._MPI.Request.Waitall(bucket.requests)
            bucket.requests = []
            if len(bucket.blobs) == 1:
                bucket.blobs[0].diff[...] *= self._scale
            bucket.unpack(self._scale)
        self._next = 0
        self.wait_seconds += time.perf_counter() - t0

    def reset_timers(self):
        self.wait_seconds = self.comm_seconds = 0.0

    def close(self):
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.window is not None:
            self.window.close(self.buckets)
            self.window = None
