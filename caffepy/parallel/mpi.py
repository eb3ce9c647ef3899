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
same way from an atexit handler.

A rank killed outright (kill -9, the out-of-memory killer): under a PMI launcher
(MPICH hydra, Intel MPI, Slurm's PMI) `supervise()` forks before MPI starts, and
the parent, the process the launcher watches, prints `[rank N] ... was killed by
SIGKILL` when its child, the rank itself, dies of a signal; while a survivor
writes the emergency snapshot (failsafe.py) it waits, then the launcher ends
the job. Ranks the launcher stops with SIGTERM print one line saying so.
A rank that stops making progress (SIGSTOP, a hung file system, a lost host) is
found by the stall watchdog (watchdog.py, `--stall_timeout`).

A launcher whose environment announces N > 1 processes while MPI starts this one
alone means mpi4py was built for another MPI than the launcher's: init_world()
refuses to train (every process would train alone and write the same snapshots).
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
# PMI(2), Open MPI, PMIx-based launchers, and a Slurm step (srun sets it in every
# task, whatever MPI plugin; sbatch's script, one process, has SLURM_NTASKS only).
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS",
              "MPI_LOCALNRANKS")
_RANK_ONLY_VARS = ("PMIX_RANK",)
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")

_state = {"started": False, "finished": False}


def launcher_variable():
    """(variable, size): the launcher's announcement of the world size; (None, 0) if
    none, (variable, -1) if a launcher is present but does not say (PMIx alone)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var)
        if value:
            try:
                return var, int(value)
            except ValueError:
                continue
    for var in _RANK_ONLY_VARS:
        if os.environ.get(var):
            return var, -1
    return None, 0


def launcher_size():
    """World size announced by an MPI launcher, 0 if none, -1 if a launcher is
    present but does not say (PMIx without a size variable)."""
    return launcher_variable()[1]


def launcher_rank():
    """This process's rank as the launcher announced it (before MPI starts), or None."""
    for var in _RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


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


# UCX's TCP transport (MPICH's ch4:ucx netmod across hosts) reads at most one receive
# segment per socket each time MPI is entered. With its 64 KB default, a receiver that
# enters MPI every few ms (the comm thread sleeping between tests while backward computes)
# drained a 500 Mbit/s link at half its speed: the ring allreduce of AlexNet's 244 MB took
# 7.5-8.4 s beside backward against 4.1-4.6 s alone; with 1 MB segments 4.1-4.3 s, as alone.
TRANSPORT_DEFAULTS = {"UCX_TCP_RX_SEG_SIZE": "1M"}


def transport_defaults(environ=os.environ):
    """Set TRANSPORT_DEFAULTS where the user has not (before MPI_Init: UCX reads them there)."""
    for var, value in TRANSPORT_DEFAULTS.items():
        environ.setdefault(var, value)


def init_world(stall_timeout=0):
    """Start MPI when launched with several ranks and fill `world`; idempotent.

    stall_timeout > 0 starts the stall watchdog (watchdog.py) with that many seconds.
    Returns `world` (rank 0 of 1 when not launched)."""
    if _state["started"] or not launched():
        return world
    if "mpi4py.MPI" not in sys.modules:
        # UCX reads them when MPI starts: a caller that imported mpi4py.MPI first (it starts
        # MPI) runs with what the environment held then
        transport_defaults()
    from . import ring
    ring.rx_segment_bytes = ring.parse_bytes(os.environ.get("UCX_TCP_RX_SEG_SIZE"), 64 << 10)
    import mpi4py
    # the comm thread of allreduce.py and the watchdog call MPI while the main thread also may
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI
    base = MPI.COMM_WORLD
    _state["started"] = True
    if base.Get_size() == 1:
        _refuse_foreign_launcher()
        return world
    world.comm = base.Dup()
    world.rank = world.comm.Get_rank()
    world.size = world.comm.Get_size()
    world.thread_level = MPI.Query_thread()
    log.set_rank(world.rank, world.size)
    world.peers = world.comm.allgather((socket.gethostname(), os.getpid()))
    # the launcher reports a killed process by pid: this line maps pids to ranks
    log.info("MPI ranks: " + ", ".join(f"{r}=pid {pid}@{host}" for r, (host, pid) in enumerate(world.peers)))
    if world.thread_level < MPI.THREAD_MULTIPLE:
        log.warning(f"MPI granted thread level {_THREAD_LEVELS.get(world.thread_level, world.thread_level)}"
                    f", not MPI_THREAD_MULTIPLE: gradients are reduced without a thread (blocking)")
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    _watch_sigterm()
    # registered after mpi4py's own finalizer, so it runs first (atexit is LIFO)
    atexit.register(_abort_unless_finished)
    from . import watchdog
    watchdog.start(world.comm, stall_timeout, world.peers, abort)
    return world


_THREAD_LEVELS = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED", 2: "MPI_THREAD_SERIALIZED",
                  3: "MPI_THREAD_MULTIPLE"}


def _refuse_foreign_launcher():
    """The launcher announced N > 1 processes but MPI started this one alone."""
    var, size = launcher_variable()
    if size <= 1:
        return
    from mpi4py import MPI
    library = MPI.Get_library_version().splitlines()[0].strip()
    raise ParallelError(
        f"{var}={os.environ[var]}: the launcher started {size} processes but MPI sees this one alone: "
        f"mpi4py uses {library}, not the launcher's MPI, so every process would train alone and "
        f"write the same snapshots. Launch with the mpiexec of the MPI mpi4py was built for "
        f"({os.path.join(os.path.dirname(sys.executable), 'mpiexec')}), or rebuild mpi4py against the "
        f"cluster's MPI (pip install --no-binary=mpi4py --force-reinstall mpi4py, with its mpicc on PATH)")


def finish():
    """Mark this rank's work as done: leaving now is a normal exit, not a failure."""
    _state["finished"] = True
    from . import watchdog
    watchdog.stop()


# -- a parent that reports its rank's death -------------------------------------
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGALRM", "SIGCONT",
              "SIGTSTP")


def supervise(linger=0.0):
    """Fork: the child returns and becomes the rank; the parent, the process the launcher
    started and watches, passes signals on to it and exits as it does, and when the child
    dies of a signal (kill -9, the out-of-memory killer) prints the line naming the rank
    while the launcher still forwards output.

    Only under PMI launchers (PMI_RANK set: MPICH hydra, Intel MPI, Slurm's PMI), whose
    MPI start-up a forked child inherits; CAFFEPY_MPI_SUPERVISE=0 turns it off. Call
    before MPI starts and before any thread exists.

    linger > 0: after its rank was killed, the parent waits up to that many seconds before
    dying of the same signal. Launchers (MPICH hydra) SIGKILL every other rank as soon as
    one is killed or exits non-zero, so the survivors could save nothing; meanwhile the
    watchdog of a rank on this host finds the process gone, or, for a rank alone on its
    host, the ranks elsewhere find it silent within --stall_timeout (its connections held
    open, `_HeldConnections`); that rank writes the emergency snapshot and aborts the job
    (failsafe.py), which ends this process too."""
    if (not launched() or os.environ.get("PMI_RANK") is None
            or os.environ.get("CAFFEPY_MPI_SUPERVISE", "1") == "0"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        # launchers signal the process group: in a group of its own the rank gets each
        # signal once, from the parent
        os.setpgid(0, 0)
        _die_with_parent(parent)
        return
    for name in _FORWARDED:
        signum = getattr(signal, name)
        signal.signal(signum, lambda signum, frame: _pass_on(child, signum))
    held = _HeldConnections(child) if linger > 0 else None
    status = _wait(child, held)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        rank = launcher_rank()
        how = ("was killed by SIGKILL (by hand, by the out-of-memory killer or by the batch system)"
               if signum == signal.SIGKILL else f"died of {signal.Signals(signum).name}")
        local = _local_peers()
        waited = linger > 0 and (local or (held is not None and held.count() > 0))
        if not waited:
            then = "the MPI launcher ends the other ranks"
        elif local:
            then = "the other ranks save the last iteration every rank finished, then end"
        else:
            then = ("the other ranks find it silent within --stall_timeout, save the last iteration every "
                    "rank finished, then end")
        sys.stderr.write(f"[rank {rank}] caffepy rank {rank} (pid {child}@{socket.gethostname()}) {how}; "
                         f"{then}\n")
        sys.stderr.flush()
        if waited:
            for name in _FORWARDED:
                signal.signal(getattr(signal, name), signal.SIG_DFL)
            time.sleep(linger)
        # die of the same signal: launchers end the job when a rank is killed, while they
        # wait for the others when one merely exits non-zero
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.WEXITSTATUS(status))


def _wait(child, held):
    """The child's wait status; meanwhile its new TCP connections are held (`held`), and
    signals are passed on."""
    try:
        pidfd = os.pidfd_open(child)
    except (AttributeError, OSError):
        pidfd = None
    if held is not None and pidfd is not None:
        import select
        while not select.select([pidfd], [], [], _HeldConnections.SCAN_EVERY)[0]:
            held.grab(pidfd)
    if pidfd is not None:
        os.close(pidfd)
    return os.waitpid(child, 0)[1]


class _HeldConnections:
    """The rank's TCP connections, duplicated into its parent (pidfd_getfd) as they appear.

    Why: when a rank dies, the kernel closes its sockets and its peers see the connections
    reset; MPICH's UCX transport then crashes the peer (SIGSEGV, seen on the test bed),
    so a rank killed alone on its host took the others down before any could write the
    emergency snapshot. With the parent holding the same connections open, the dead rank
    looks to its peers like a frozen host: silent, which the stall watchdog finds. Only
    established TCP sockets are taken (not the launcher's local ones), each once; the
    copies go when the parent exits."""
    SCAN_EVERY = 0.5       # seconds; MPI connects to its peers at start and at first use

    def __init__(self, child):
        self.child = child
        self.fds = {}       # socket inode -> our copy
        self.broken = False

    def count(self):
        return len(self.fds)

    def _established(self):
        inodes = set()
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{self.child}/net/{table}") as f:
                    next(f, None)
                    for line in f:
                        cols = line.split()
                        if len(cols) > 9 and cols[3] == "01" and not _loopback(cols[2]):   # established
                            inodes.add(int(cols[9]))
            except OSError:
                pass
        return inodes

    def grab(self, pidfd):
        if self.broken:
            return
        established = self._established() - set(self.fds)
        if not established:
            return
        try:
            fds = os.listdir(f"/proc/{self.child}/fd")
        except OSError:
            return
        for name in fds:
            try:
                target = os.readlink(f"/proc/{self.child}/fd/{name}")
            except OSError:
                continue
            inode = int(target[8:-1]) if target.startswith("socket:[") else None
            if inode not in established:
                continue
            copy = _pidfd_getfd(pidfd, int(name))
            if copy is None:
                self.broken = True        # not permitted here (ptrace rules): give up quietly
                return
            if os.fstat(copy).st_ino == inode:
                self.fds[inode] = copy
            else:                         # the number was reused meanwhile
                os.close(copy)


def _loopback(address):
    """Whether a /proc/net/tcp{,6} address ("0100007F:1F90": hex, the IPv4 bytes reversed) is
    127.x or ::1 (the launcher's own connections on this host)."""
    ip = address.split(":")[0]
    if len(ip) == 8:
        return ip[6:] == "7F"
    return ip == "00000000000000000000000001000000" or (ip[:24] == "0000000000000000FFFF0000" and ip[30:] == "7F")


def _pidfd_getfd(pidfd, fd):
    """A copy of another process's descriptor (Linux 5.6+), or None."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    copy = libc.syscall(438, pidfd, fd, 0)      # SYS_pidfd_getfd on x86-64 and arm64
    return copy if copy >= 0 else None


def _local_peers():
    """Whether the launcher started other ranks on this host (who find a killed rank at once)."""
    for var in _LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value) > 1
    return False


def _pass_on(child, signum):
    try:
        os.kill(child, signum)
        if signum == signal.SIGTERM:
            os.kill(child, signal.SIGCONT)    # a stopped rank would keep SIGTERM pending forever
    except ProcessLookupError:
        pass


def _die_with_parent(parent):
    """The rank must not outlive the process the launcher kills (PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:            # the parent died before prctl took effect
        os._exit(1)


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
    from . import watchdog
    from .strategies import make_strategy
    with watchdog.waiting("the definition check at start-up"):
        check_same_everywhere("the solver definition (SolverParameter)", digest(solver.param))
        check_same_everywhere("the train net definition (NetParameter)", digest(solver.net.param))
    strategy = make_strategy(solver, world)
    solver.hooks.append(strategy)
    return strategy
