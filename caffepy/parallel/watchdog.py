"""No silent hang: end the job when a rank stops making progress (`--stall_timeout`).

Each rank's main thread marks where it is (`at(place)`) and where it waits for the
other ranks (`with waiting(place):`), a few Python assignments each. A watchdog
thread per rank sends that state to rank 0 every `interval` seconds over its own
communicator; rank 0 answers every rank with a summary. The threads sleep between
rounds (a condition wait, no polling loop on a core).

A rank stalls when, for `timeout` seconds, nothing was heard from it (stopped,
hung in the kernel, host unreachable), or it was heard but neither moved to a new
place nor used CPU in its main thread outside a wait (stuck reading a file, say).
A rank that waits for the others is not stalled by waiting. Rank 0 then prints one
line naming the stalled rank(s) and where the others were waiting, and aborts
every rank; when rank 0 itself goes silent, rank 1 does (rank r > 1 a little later,
in case rank 1 went too). A rank whose process has ended (killed, crashed) is lost at
once, at the next round, for the lowest live rank of its host, which ends the job.

Before aborting, the rank that found the loss calls `before_abort(lost ranks)` when
set: the emergency snapshot of failsafe.py, written from this thread.

Needs MPI_THREAD_MULTIPLE: the thread calls MPI while the main thread may sit in a
collective. `start` says so and returns None when MPI granted less.
"""
import contextlib
import socket
import threading
import time

from .. import log

DEFAULT_TIMEOUT = 300.0
_STATE, _SUMMARY = 1, 2          # message tags on the watchdog's communicator

_current = None
before_abort = None          # before_abort(lost ranks), on the rank that found them
_GONE = "its process ended (killed or crashed)"


def at(place):
    """This rank works at `place` ("forward/backward of iteration 12")."""
    dog = _current
    if dog is not None:
        dog.mark(place, False)


@contextlib.contextmanager
def waiting(place):
    """This rank waits for the others at `place` ("gradient allreduce of iteration 12")."""
    dog = _current
    if dog is None:
        yield
        return
    before = dog.place
    dog.mark(place, True)
    try:
        yield
    finally:
        dog.mark(before, False)


def start(comm, timeout, peers, abort):
    """Start this rank's watchdog (collective: every rank calls it). None when disabled
    (timeout <= 0) or impossible (MPI granted less than MPI_THREAD_MULTIPLE)."""
    global _current
    if timeout <= 0 or comm.Get_size() == 1:
        return None
    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        log.warning(f"--stall_timeout: MPI granted thread level {MPI.Query_thread()}, not "
                    f"MPI_THREAD_MULTIPLE; stalled ranks are not detected")
        return None
    _current = Watchdog(comm.Dup(), timeout, peers, abort)
    _current.thread.start()
    return _current


def stop():
    global _current
    dog, _current = _current, None
    if dog is not None:
        dog.close()


def _ranks(ranks):
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)


class Watchdog:
    def __init__(self, comm, timeout, peers, abort):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self.interval = min(max(self.timeout / 10, 0.2), 5.0)
        self.peers = peers            # [(host, pid)] by rank
        self.abort = abort            # abort(line): print it and end every rank
        self.place, self.waits, self.moves = "start-up", False, 0
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self.thread = threading.Thread(target=self._run, name="caffepy-watchdog", daemon=True)

    def mark(self, place, waits):
        self.place, self.waits = place, waits
        self.moves += 1

    def _gone(self, rank):
        """Whether `rank`, on this host, has no live process any more."""
        host, pid = self.peers[rank] if rank < len(self.peers) else (None, None)
        if host != socket.gethostname():
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except (OSError, IndexError):
            return True

    def _local_losses(self):
        """The ranks of this host whose process ended, when this rank is the one to act on
        them (one writer): the lowest rank of the host still alive."""
        host = socket.gethostname()
        mine = [r for r, (h, _) in enumerate(self.peers) if h == host]
        gone = [r for r in mine if r != self.rank and self._gone(r)]
        live = [r for r in mine if r not in gone]
        return gone if gone and min(live) == self.rank else []

    def _abort(self, lost, line):
        if before_abort is not None:
            before_abort(lost)
        self.abort(line)

    def _cpu(self):
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._main))
        except (OSError, AttributeError):
            return 0.0

    def close(self):
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * self.interval + 1)

    # -- the thread ------------------------------------------------------------
    def _run(self):
        self._receives = []
        try:
            if self.rank == 0:
                self._root()
            else:
                self._member()
        except Exception as e:        # a broken watchdog must not end training
            if not self._stop.is_set():
                log.warning(f"stall watchdog stopped: {type(e).__name__}: {e}")
        finally:
            # no receive may stay posted when MPI finalizes
            for request in self._receives:
                try:
                    request.Cancel()
                    request.Wait()
                except Exception:
                    pass

    def _state(self):
        return (self.place, self.waits, self.moves, self._cpu())

    def _member(self):
        comm = self.comm
        sends = []
        summary = {}
        heard = time.monotonic()
        inbox = comm.irecv(source=0, tag=_SUMMARY)
        self._receives = [inbox]
        patience = self.timeout + min(self.rank - 1, 3) * 2 * self.interval
        while not self._stop.wait(self.interval):
            sends = [r for r in sends if not r.Test()]
            if len(sends) < 64:                   # rank 0 stopped: do not pile up messages
                sends.append(comm.isend(self._state(), dest=0, tag=_STATE))
            while True:
                done, message = inbox.test()
                if not done:
                    break
                summary, heard = message, time.monotonic()
                inbox = self._receives[0] = comm.irecv(source=0, tag=_SUMMARY)
            silent = time.monotonic() - heard
            gone = self._local_losses()
            if silent > patience or gone:
                lost = gone or [0]
                # the others as rank 0 last saw them
                others = "; ".join(f"{_ranks(rs)} {'waited in' if waits else 'at'} {place}"
                                   for (place, waits), ranks in summary.items()
                                   for rs in [[r for r in ranks if r not in lost and r != self.rank]] if rs)
                why = {r: _GONE for r in gone} or {0: f"nothing heard from it for {silent:.0f} s: stopped, hung "
                                                      f"or unreachable"}
                self._abort(lost, self._line(lost, why, f"{others}; " if others else "", self.place, self.waits))
                return

    def _root(self):
        comm, size = self.comm, self.size
        now = time.monotonic()
        heard = [now] * size              # last message from each rank
        moved = [now] * size              # last progress of each rank
        state = [("start-up", False, 0, 0.0)] * size
        inboxes = {r: comm.irecv(source=r, tag=_STATE) for r in range(1, size)}
        self._receives = inboxes.values()
        sends = []
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            fresh = {0: self._state()}
            for r, box in inboxes.items():
                while True:
                    done, message = box.test()
                    if not done:
                        break
                    fresh[r] = message
                    heard[r] = now
                    box = inboxes[r] = comm.irecv(source=r, tag=_STATE)
            heard[0] = now
            for r, new in fresh.items():
                place, waits, moves, cpu = new
                old = state[r]
                # progress: a new place, or CPU used by the main thread while not waiting
                # (a rank spinning inside an MPI wait burns CPU without progress)
                if moves != old[2] or (not waits and not old[1] and cpu - old[3] > 0.01 * self.interval):
                    moved[r] = now
                state[r] = new
            stalled = {r: _GONE for r in self._local_losses()}
            for r in range(size):
                if r in stalled:
                    continue
                if now - heard[r] > self.timeout:
                    stalled[r] = (f"nothing heard from it for {now - heard[r]:.0f} s: stopped, hung or "
                                  f"unreachable; last at {state[r][0]}")
                elif now - moved[r] > self.timeout and not state[r][1]:
                    stalled[r] = f"no progress for {now - moved[r]:.0f} s at {state[r][0]}"
            if not stalled and all(now - m > self.timeout for m in moved):
                stalled = {r: f"waiting in {state[r][0]}" for r in range(size)}   # a mismatch
            groups = {}
            for r in range(size):
                if r not in stalled:
                    groups.setdefault((state[r][0], state[r][1]), []).append(r)
            if stalled:
                others = "; ".join(f"{_ranks(ranks)} {'waited in' if waits else 'at'} {place}"
                                   for (place, waits), ranks in groups.items())
                self._abort(sorted(stalled), self._line(sorted(stalled), stalled, f"{others}; " if others else "",
                                                        None, None))
                return
            sends = [q for q in sends if not q.Test()]
            if len(sends) < 64 * size:
                summary = {key: ranks for key, ranks in groups.items()}
                sends += [comm.isend(summary, dest=r, tag=_SUMMARY) for r in range(1, size)]

    def _line(self, culprits, why, others, own_place, own_waits):
        who = []
        for r in culprits:
            host, pid = self.peers[r] if r < len(self.peers) else ("?", "?")
            who.append(f"rank {r} (pid {pid}@{host}: {why[r]})")
        mine = ""
        if own_place is not None:
            mine = f"rank {self.rank} {'waited in' if own_waits else 'at'} {own_place}; "
        if all(why[r] == _GONE for r in culprits):
            return f"lost: {', '.join(who)}; {others}{mine}aborting all {self.size} ranks"
        return (f"stall: {', '.join(who)} did not arrive within --stall_timeout {self.timeout:g} s; "
                f"{others}{mine}aborting all {self.size} ranks")
