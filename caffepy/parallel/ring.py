"""A ring allreduce over MPI point-to-point messages, for ranks joined by a network.

Rank r sends to r+1 and receives from r-1 only. A buffer of n floats is cut into N
segments; N-1 reduce-scatter steps pass partial sums around the ring (each rank adds
what arrives into its copy), after which rank r holds the sum of segment (r+1) mod N,
which it scales; N-1 allgather steps then pass the finished segments on. Each rank
sends 2 (N-1)/N n floats, the least any allreduce can, every message is between the
same two neighbours (one TCP connection each way), and every rank ends with the same
bits (each segment is summed once, by its owner, then copied).

Segments go in pieces of `piece` floats (sized for the link, see `Link`), at most
`depth` of them in flight, so the link stays busy while the sums of the pieces that
arrived run in NumPy, and a more urgent bucket can go between two pieces (`Transfer`
advances one bucket piece by piece).

Waiting costs no core: MPICH's blocking calls poll the network in a loop (a 244 MB
allreduce over 500 Mbit/s burned 3.1-3.3 s of CPU in 4.3 s), which on a node whose
cores all compute takes a core from the work communication should hide behind. Here
the waiting thread tests its requests and sleeps between tests, the sleeps growing
to `poll_cap` (MPICH's TCP transport moves data only inside MPI calls, and the
kernel's buffers carry it between them). Each call reads at most one UCX receive
segment per socket, so mpi.py raises UCX_TCP_RX_SEG_SIZE to 1 MB (with UCX's 64 KB
a thread that tests every few ms drained the link at half its speed), and the cap
is half the time the link takes to bring one segment.
"""
import time
from collections import deque

import numpy as np

ALIGN = 16                       # floats: pieces start on 64-byte cache lines
_SUM_CHUNK = 1 << 16             # floats added and scaled at a time (256 KB, in L2)
WIRE_TYPES = ("float32", "bfloat16")


def _add_scaled(out, piece, scale):
    """out += piece, then out *= scale (None: no scaling), in cache-sized chunks."""
    for start in range(0, out.size, _SUM_CHUNK):
        o = out[start:start + _SUM_CHUNK]
        np.add(o, piece[start:start + _SUM_CHUNK], out=o)
        if scale is not None:
            o *= scale


class Poller:
    """Sleeps between tests of pending requests: from cap / 8 (at least 20 us) after each
    progress, doubling up to `cap`. A message that just finished was one of a few in
    flight: the next one is rarely due within microseconds, and every wake-up takes a
    compute thread's core for a while."""

    FIRST = 20e-6

    def __init__(self, cap):
        self.cap = cap
        self.first = max(self.FIRST, cap / 8)
        self.sleep = self.first

    def progressed(self):
        self.sleep = self.first

    def idle(self):
        time.sleep(self.sleep)
        self.sleep = min(2 * self.sleep, self.cap)


class Ring:
    """The ring of `comm` (a communicator of its own: nothing else may use its tags)."""

    def __init__(self, comm, piece_floats, poll_cap=1e-3, depth=2, wire="float32"):
        from mpi4py import MPI
        if wire not in WIRE_TYPES:
            raise ValueError(f"unknown wire type {wire!r}")
        # bfloat16: every message carries the top 16 bits of each float (half the bytes);
        # sums stay float32 (each rank adds what arrives to its float32 copy)
        self.compress = wire == "bfloat16"
        if self.compress:
            from ..kernels import parallel as kernels
            self.kernels = kernels
        self.MPI = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.left = (self.rank - 1) % self.size
        self.right = (self.rank + 1) % self.size
        self.piece = max(ALIGN, piece_floats // ALIGN * ALIGN)
        self.poll_cap = poll_cap
        self.depth = depth
        self._spare = []            # receive buffers of finished transfers, reused

    def segments(self, n):
        """[(lo, hi)] of the N segments of an n-float buffer."""
        bounds = [min(n, (n * s // self.size + ALIGN - 1) // ALIGN * ALIGN) for s in range(self.size)]
        bounds.append(n)
        return list(zip(bounds[:-1], bounds[1:]))

    def transfer(self, buf, scale, tag):
        return Transfer(self, buf, scale, tag)

    def allreduce(self, buf, scale, tag=0):
        """Sum `buf` (float32, contiguous) over the ring in place, times `scale`; blocking
        (sleeping between tests)."""
        t = self.transfer(buf, scale, tag)
        poller = Poller(self.poll_cap)
        while not t.done:
            t.post()
            if t.test():
                poller.progressed()
            elif not t.done:
                poller.idle()
        t.release()

    def buffer(self):
        return self._spare.pop() if self._spare else np.empty(self.piece, np.float32)

    def give_back(self, buffer):
        if len(self._spare) < 4 * self.depth:
            self._spare.append(buffer)


class Transfer:
    """One buffer's ring allreduce, advanced by post() and test() (never blocking).

    The operations, in order: step s of the 2(N-1) steps sends piece p of one segment
    to the right and receives piece p of another from the left. Reduce-scatter steps
    receive into a scratch buffer and add it in (the last one also scales); allgather
    steps receive in place. Operation k sends what operation k - pieces received, so it
    is posted only once that one finished.

    With a bfloat16 wire each message is the bfloat16 rounding of the float32 piece,
    packed when posted; what arrives is added in float32; the owner of a finished
    segment rounds it to bfloat16 values in place, so that every rank ends with the
    same bits.
    """

    def __init__(self, ring, buf, scale, tag):
        self.ring, self.buf, self.tag = ring, buf, tag
        self.scale = None if scale is None or scale == 1 else np.float32(scale)
        n, size = buf.size, ring.size
        self.ops = []
        if size > 1 and n > 0:
            segments = ring.segments(n)
            longest = max(hi - lo for lo, hi in segments)
            self.pieces = max(1, -(-longest // ring.piece))
            r = ring.rank
            for step in range(2 * (size - 1)):
                if step < size - 1:        # reduce-scatter
                    send, recv = (r - step) % size, (r - step - 1) % size
                    kind = "add_scale" if step == size - 2 else "add"
                else:                      # allgather
                    g = step - (size - 1)
                    send, recv = (r + 1 - g) % size, (r - g) % size
                    kind = "copy"
                for p in range(self.pieces):
                    self.ops.append((self._piece(segments[send], p), self._piece(segments[recv], p), kind))
        elif self.scale is not None:
            buf *= self.scale
        self.posted = 0                  # operations posted so far
        self.finished = 0                # operations finished (in order)
        self.inflight = deque()          # (requests, scratch) of posted, unfinished operations

    def _piece(self, segment, p):
        lo, hi = segment
        a = min(hi, lo + p * self.ring.piece)
        return a, min(hi, a + self.ring.piece)

    @property
    def done(self):
        return self.finished == len(self.ops)

    @property
    def bytes_sent(self):
        return (2 if self.ring.compress else 4) * sum(hi - lo for (lo, hi), _, _ in self.ops)

    def post(self):
        """Post the operations that may start now; returns how many."""
        ring, MPI = self.ring, self.ring.MPI
        started = 0
        while (self.posted < len(self.ops) and len(self.inflight) < ring.depth
               and self.posted - self.pieces < self.finished):
            (slo, shi), (rlo, rhi), kind = self.ops[self.posted]
            scratch = packed = None
            if ring.compress:
                scratch, packed = ring.buffer(), ring.buffer()
                target = [scratch.view(np.uint16)[:rhi - rlo], MPI.UINT16_T]
                source = packed.view(np.uint16)[:shi - slo]
                ring.kernels.to_bf16(self.buf[slo:shi], source)
                source = [source, MPI.UINT16_T]
            else:
                if kind == "copy":
                    target = self.buf[rlo:rhi]
                else:
                    scratch = ring.buffer()
                    target = scratch[:rhi - rlo]
                target, source = [target, MPI.FLOAT], [self.buf[slo:shi], MPI.FLOAT]
            requests = [ring.comm.Irecv(target, ring.left, self.tag),
                        ring.comm.Isend(source, ring.right, self.tag)]
            self.inflight.append((requests, scratch, packed))
            self.posted += 1
            started += 1
        return started

    def test(self):
        """Finish the operations whose messages are through (in order); True if any did."""
        MPI = self.ring.MPI
        progressed = False
        while self.inflight and MPI.Request.Testall(self.inflight[0][0]):
            _, scratch, packed = self.inflight.popleft()
            _, (rlo, rhi), kind = self.ops[self.finished]
            scale = self.scale if kind == "add_scale" else None
            if self.ring.compress:
                arrived = scratch.view(np.uint16)[:rhi - rlo]
                if kind == "copy":
                    self.ring.kernels.from_bf16(arrived, self.buf[rlo:rhi])
                else:
                    self.ring.kernels.add_bf16(self.buf[rlo:rhi], arrived, 1.0 if scale is None else scale,
                                               kind == "add_scale")
                self.ring.give_back(packed)
            elif kind != "copy":
                _add_scaled(self.buf[rlo:rhi], scratch[:rhi - rlo], scale)
            if scratch is not None:
                self.ring.give_back(scratch)
            self.finished += 1
            progressed = True
        return progressed

    def release(self):
        """Give the scratch buffers of unfinished operations back (after a failure)."""
        while self.inflight:
            _, scratch, packed = self.inflight.popleft()
            for buffer in (scratch, packed):
                if buffer is not None:
                    self.ring.give_back(buffer)


# Bytes one MPI call reads from a socket: UCX's TCP receive segment as MPI started with it
# (mpi.init_world sets it; UCX's own default until then)
rx_segment_bytes = 64 << 10


def parse_bytes(text, default):
    """'1M', '64K', '65536' -> bytes, as UCX spells sizes; `default` when it cannot tell."""
    text = (text or "").strip().upper().rstrip("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text[-1:] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        return default


class Link:
    """Latency and bandwidth from each rank to the next on the ring, measured once.

    latency: half the round trip of an 8-byte message around one hop (the slowest
    hop's); bandwidth: bytes per second of a large ring shift (every rank sending to
    the next at once, as the allreduce does; the slowest rank's). Collective."""

    def __init__(self, latency, bandwidth):
        self.latency, self.bandwidth = latency, bandwidth

    @classmethod
    def measure(cls, comm, probe_bytes=8 << 20):
        from mpi4py import MPI
        rank, size = comm.Get_rank(), comm.Get_size()
        right, left = (rank + 1) % size, (rank - 1) % size
        small = np.zeros(2, np.float32)
        other = np.zeros(2, np.float32)
        rounds = 20
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(rounds):
            comm.Sendrecv(small, right, 1, other, left, 1)
            comm.Sendrecv(small, left, 2, other, right, 2)
        latency = (time.perf_counter() - t) / rounds / 2
        latency = comm.allreduce(latency, op=MPI.MAX)
        send = np.zeros(probe_bytes // 4, np.float32)
        recv = np.empty_like(send)
        comm.Sendrecv(send[:ALIGN], right, 3, recv[:ALIGN], left, 3)      # connections up
        best = float("inf")
        for _ in range(2):
            comm.Barrier()
            t = time.perf_counter()
            comm.Sendrecv(send, right, 4, recv, left, 4)
            best = min(best, time.perf_counter() - t)
        seconds = comm.allreduce(max(best - latency, 1e-9), op=MPI.MAX)
        return cls(latency, probe_bytes / seconds)

    def piece_bytes(self):
        """Pieces of about 40 ms on the link (1-16 MB): per-message latency stays a few percent
        and an urgent bucket waits at most a piece or two."""
        return int(min(16 << 20, max(1 << 20, 0.04 * self.bandwidth)))

    def poll_cap(self):
        """Longest sleep between tests: half the time the link takes to fill the receive
        segment one test drains (rx_segment_bytes: UCX_TCP_RX_SEG_SIZE, 1 MB from mpi.py;
        20 us - 10 ms).
        Each wake-up preempts a compute thread: with a 64 KB cap AlexNet's ring woke its
        thread about 1,700 times an iteration on 2 emulated hosts."""
        return min(10e-3, max(20e-6, 0.5 * rx_segment_bytes / self.bandwidth))

    def __repr__(self):
        return f"latency {self.latency * 1e6:.0f} us, bandwidth {self.bandwidth / 1e6:.1f} MB/s"
