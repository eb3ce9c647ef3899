"""Starting MPI, and making sure a failure on one rank ends every rank.

`launched()` reads the launcher's environment only, so a single-process run
never pays for MPI start-up. `init_world()` starts MPI and fills
`caffepy.parallel.world` (the train command calls it before building the
Solver, which takes the world as its run context and hands it to its nets:
data layers pick their records by rank). `attach(solver)` checks that every
rank runs the same net and solver and adds the training strategy (data
parallel, or hybrid when the net marks model-parallel layers) to its hooks.

Failure: an uncaught exception on any rank (in any thread) prints one line
`[rank N] <cause>` and calls MPI Abort, which ends every rank; a rank that
exits early with an error (the CLI's one-line error path) aborts the job the
same way from an atexit handler. A rank killed outright is handled by the
launcher: MPICH's hydra sends SIGTERM to the remaining ranks, and a watcher
thread here turns it into one line naming the rank that died (found among the
ranks of this host) before exiting.
"""
import atexit
import hashlib
import os
import signal
import socket
import sys
import threading
import time
import traceback

from .. import log
from ..errors import CaffepyError, ParallelError
from . import world

# The size variable each launcher exports: MPICH/Intel MPI hydra and Slurm's
# PMI(2), Open MPI, and PMIx-based launchers.
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
_RANK_ONLY_VARS = ("PMIX_RANK",)

_state = {"started": False, "finished": False}


def launcher_size():
    """World size announced by an MPI launcher, 0 if none, -1 if a launcher is
    present but does not say (PMIx without a size variable)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var)
        if value:
            try:
                return int(value)
            except ValueError:
                continue
    if any(os.environ.get(var) for var in _RANK_ONLY_VARS):
        return -1
    return 0


def launched():
    """True when an MPI launcher started this process as one of several ranks."""
    size = launcher_size()
    return size > 1 or size == -1


# Ranks sharing this host, as each launcher exports it (MPICH hydra, Open MPI, Slurm).
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def share_cores():
    """Give each rank on this host its share of the cores (unless OMP_NUM_THREADS is set).

    Must run before the first compiled kernel loads OpenMP: N ranks each starting a
    team as wide as the machine oversubscribe the cores, and spinning OpenMP threads
    then run many times slower.
    """
    if not launched() or os.environ.get("OMP_NUM_THREADS"):
        return
    for var in _LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            cores = len(os.sched_getaffinity(0))
            os.environ["OMP_NUM_THREADS"] = str(max(1, cores // int(value)))
            return


def init_world():
    """Start MPI when launched with several ranks and fill `world`; idempotent.

    Returns `world` (rank 0 of 1 when not launched)."""
    if _state["started"] or not launched():
        return world
    import mpi4py
    # the comm thread of allreduce.py calls MPI while the main thread also may
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI
    base = MPI.COMM_WORLD
    _state["started"] = True
    if base.Get_size() == 1:
        return world
    world.comm = base.Dup()
    world.rank = world.comm.Get_rank()
    world.size = world.comm.Get_size()
    world.thread_level = MPI.Query_thread()
    log.set_rank(world.rank, world.size)
    world.peers = world.comm.allgather((socket.gethostname(), os.getpid()))
    # the launcher reports a killed process by pid: this line maps pids to ranks
    log.info("MPI ranks: " + ", ".join(f"{r}=pid {pid}@{host}" for r, (host, pid) in enumerate(world.peers)))
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    _watch_sigterm()
    # registered after mpi4py's own finalizer, so it runs first (atexit is LIFO)
    atexit.register(_abort_unless_finished)
    return world


def finish():
    """Mark this rank's work as done: leaving now is a normal exit, not a failure."""
    _state["finished"] = True


def abort(message, code=1):
    """Print `[rank N] message` and end every rank of the job."""
    sys.stderr.write(f"[rank {world.rank}] {message}\n")
    sys.stderr.flush()
    if world.comm is not None:
        from mpi4py import MPI
        # Abort tears the launcher's output forwarding down at once: give it a moment to
        # pass this line on, or the job can end without saying why
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _describe(exc_type, exc):
    if isinstance(exc, CaffepyError):
        return str(exc)
    text = str(exc)
    return f"{exc_type.__name__}: {text}" if text else exc_type.__name__


def _excepthook(exc_type, exc, tb):
    if not issubclass(exc_type, (CaffepyError, KeyboardInterrupt)):
        traceback.print_exception(exc_type, exc, tb)   # a bug: keep its traceback
    code = getattr(exc, "exit_code", 1)
    abort(f"uncaught {_describe(exc_type, exc)}; aborting all {world.size} ranks", code)


def _thread_excepthook(args):
    # an uncaught error in any thread (prefetch, allreduce) would leave this rank
    # waiting for it forever, and every other rank waiting for this one
    if args.exc_type is SystemExit:
        return
    _excepthook(args.exc_type, args.exc_value, args.exc_traceback)


def _abort_unless_finished():
    if world.comm is None or _state["finished"]:
        return
    # the CLI already printed the cause on this rank's stderr
    abort(f"exited before training finished; aborting all {world.size} ranks")


def _watch_sigterm():
    # The main thread may sit inside an MPI call for long, so a Python handler
    # alone would not run. Python's C-level handler also writes the signal
    # number to the wakeup fd from whichever thread the signal lands on; a
    # watcher thread reads it there.
    if threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: _terminated())
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch_wakeup_fd, args=(read_fd,), name="caffepy-sigterm",
                     daemon=True).start()


def _watch_wakeup_fd(fd):
    while True:
        data = os.read(fd, 64)
        if not data:
            return
        if signal.SIGTERM in data:
            _terminated()


def _dead_peers():
    host = socket.gethostname()
    dead = []
    for rank, (peer_host, pid) in enumerate(getattr(world, "peers", [])):
        if peer_host != host or rank == world.rank:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            dead.append(f"rank {rank} (pid {pid})")
    return dead


_terminating = threading.Lock()


def _terminated():
    if not _terminating.acquire(blocking=False):
        return
    dead = _dead_peers()
    cause = (f"{', '.join(dead)} ended (killed or crashed)" if dead
             else "another rank failed or the job was cancelled")
    sys.stderr.write(f"[rank {world.rank}] stopped by the MPI launcher (SIGTERM): {cause}\n")
    sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)


def digest(message):
    """A stable hash of a protobuf message."""
    return hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()


def check_same_everywhere(what, value):
    """Every rank must hold the same `value` (a short string); a mismatch names the ranks."""
    values = world.comm.allgather(value)
    if all(v == values[0] for v in values):
        return
    groups = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    reference = values[0]
    differ = [r for r, v in enumerate(values) if v != reference]
    raise ParallelError(f"{what} differs between ranks: ranks {differ} do not match rank 0 "
                        f"({len(groups)} distinct versions). Start every rank with the same files")


def attach(solver):
    """Join `solver` (built with `context=world`) to the world: check the definitions match,
    add the strategy to its hooks.

    Weights are broadcast from rank 0 when training starts (after -weights or
    -snapshot are loaded), through the strategy's `on_start`."""
    init_world()
    if world.size == 1:
        return None
    if solver.context is not world:
        raise ParallelError("the Solver was built for another run context, got "
                            f"{solver.context!r}. Build it with Solver(..., context="
                            "caffepy.parallel.world) after mpi.init_world()")
    from .strategies import make_strategy
    check_same_everywhere("the solver definition (SolverParameter)", digest(solver.param))
    check_same_everywhere("the train net definition (NetParameter)", digest(solver.net.param))
    strategy = make_strategy(solver, world)
    solver.hooks.append(strategy)
    return strategy
