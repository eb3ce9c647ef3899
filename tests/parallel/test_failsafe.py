"""No work lost: a rank killed mid-run leaves an emergency snapshot of the last iteration every
rank finished, equal to the snapshot an uninterrupted run writes there, and resumable on fewer
ranks; the --restart supervisor; a full disk and nothing to restart from, one line each."""
import os
import re
import signal
import subprocess
import sys
import time

import errno
import threading
import types

import numpy as np
import pytest

from mpi_helpers import MPIEXEC, REPO, make_lmdb, max_rel_diff, train, weights, write_job

needs_mpiexec = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")

LOCAL_BATCH = 4
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train_lmdb")


def _cli(*args):
    return [sys.executable, "-m", "caffepy.cli", *args]


def _read_until(proc, pattern, seen, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r}: " + "".join(seen[-30:]))


def _kill_rank_midway(job, ranks, victim, at_iteration, command=None):
    """Start `caffepy train` on `ranks` ranks (or `command`), SIGKILL rank `victim` once
    iteration `at_iteration` is displayed; returns (exit code, everything it printed, its pid)."""
    command = command or [MPIEXEC, "-n", str(ranks)] + _cli("train")
    proc = subprocess.Popen(command + ["--solver", str(job / "solver.prototxt"), "--stall_timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=job,
                            start_new_session=True)
    seen = []
    try:
        pids = _read_until(proc, r"MPI ranks: (.*)", seen).group(1)
        pid = int(re.search(rf"\b{victim}=pid (\d+)@", pids).group(1))
        _read_until(proc, rf"Iteration {at_iteration} \(", seen)
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, "".join(seen) + err + out, pid


_KILLED = {}


@pytest.fixture
def killed(tmp_path_factory, db):
    """Rank 1 of 3 killed mid-run; the same 3 ranks run uninterrupted to the emergency
    snapshot's iteration k; the emergency snapshot resumed on 2 ranks for 4 iterations."""
    if not _KILLED:
        root = tmp_path_factory.mktemp("killed")
        job = write_job(root, "killed", db, LOCAL_BATCH, 100000, "snapshot: 0\n")
        code, text, pid = _kill_rank_midway(job, 3, 1, 12)
        m = re.search(r"Emergency snapshot of iteration (\d+), the last one every rank finished "
                      r"\(rank 1 lost\)", text)
        assert m, text[-3000:]
        k = int(m.group(1))
        ref = write_job(root, "ref", db, LOCAL_BATCH, k)
        out = train(ref, 3)
        assert out.returncode == 0, out.stderr[-3000:]
        cont = write_job(root, "from_emergency", db, LOCAL_BATCH, k + 4)
        resumed = train(cont, 2, args=["--snapshot", str(job / f"snap_iter_{k}.solverstate")])
        _KILLED.update(root=root, job=job, code=code, text=text, pid=pid, k=k, ref=ref, cont=cont,
                       resumed=resumed)
    return types.SimpleNamespace(**_KILLED)


@needs_mpiexec
def test_killed_rank_leaves_the_snapshot_an_uninterrupted_run_writes(killed):
    from caffepy.solvers import snapshot as snap
    job, k = killed.job, killed.k
    assert killed.code != 0
    assert re.search(rf"\[rank 0\] lost: rank 1 \(pid {killed.pid}@\S+: its process ended \(killed or "
                     rf"crashed\)\); ranks? [0-9, -]+ (waited in|at) .*; aborting all 3 ranks", killed.text), \
        killed.text[-3000:]
    assert (f"Emergency snapshot written: {job}/snap_iter_{k}.caffemodel, {job}/snap_iter_{k}.solverstate"
            in killed.text)
    assert k >= 12
    emergency = weights(job / f"snap_iter_{k}.caffemodel")
    assert max_rel_diff(weights(killed.ref / f"snap_iter_{k}.caffemodel"), emergency) < 1e-5
    ours = snap.read_solver_state(job / f"snap_iter_{k}.solverstate")
    theirs = snap.read_solver_state(killed.ref / f"snap_iter_{k}.solverstate")
    assert ours.iter == theirs.iter == k and ours.current_step == theirs.current_step
    from caffepy.blobproto import blobproto_to_array
    for a, b in zip(ours.history, theirs.history, strict=True):
        np.testing.assert_allclose(blobproto_to_array(a), blobproto_to_array(b), rtol=1e-5, atol=1e-7)
    # the writer's read positions stand for every rank's (they read in step)
    run = snap.saved_run_state(ours, "emergency")["ranks"]
    assert len(run) == 3 and run[0] == snap.saved_run_state(theirs, "ref")["ranks"][0]
    # it loads, and the 2 ranks left go on with the record stream
    out = killed.resumed
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Iteration {k} (" in out.stderr and "Iteration 0 (" not in out.stderr
    assert "continues the record stream where the snapshot's 3 ranks had read it together" in out.stderr


@needs_mpiexec
@pytest.mark.slow
def test_the_emergency_snapshot_resumed_on_fewer_ranks_continues_the_loss_curve(killed, db):
    """Same weights as the uninterrupted run that went from 3 ranks to 2 at that iteration."""
    k = killed.k
    cont = write_job(killed.root, "from_ref", db, LOCAL_BATCH, k + 4)
    out = train(cont, 2, args=["--snapshot", str(killed.ref / f"snap_iter_{k}.solverstate")])
    assert out.returncode == 0, out.stderr[-3000:]
    final = weights(killed.cont / f"snap_iter_{k + 4}.caffemodel")
    assert max_rel_diff(weights(cont / f"snap_iter_{k + 4}.caffemodel"), final) < 1e-5
    assert max_rel_diff(final, weights(killed.job / f"snap_iter_{k}.caffemodel")) > 1e-4   # it trained on


@needs_mpiexec
@pytest.mark.slow
def test_restart_relaunches_from_the_emergency_snapshot(tmp_path, db):
    job = write_job(tmp_path, "restart", db, LOCAL_BATCH, 40, "snapshot: 0\n")
    code, text, pid = _kill_rank_midway(
        job, 2, 1, 10, command=_cli("train", "--restart", "2", "--launcher", f"{MPIEXEC} -n 2"))
    # the supervisor's restart, then the relaunched job to its end
    m = re.search(r"Restart 1 of 2: the job ended with exit code \d+; relaunching it from "
                  r"(\S+_iter_(\d+)\.solverstate) \(iteration (\d+)\)", text)
    assert m, text[-3000:]
    assert code == 0, text[-3000:]
    assert f"Resuming from {m.group(1)}" in text
    assert (job / "snap_iter_40.caffemodel").exists()


def test_restart_with_nothing_to_restart_from(tmp_path, db):
    job = write_job(tmp_path, "nothing", db, LOCAL_BATCH, 4, "snapshot: 0\nsnapshot_after_train: false\n")
    out = subprocess.run(_cli("train", f"-solver={job}/solver.prototxt", "-restart=2"), capture_output=True,
                         text=True, env=ENV, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"caffepy: error: --restart: nothing to restart from: {job}/solver.prototxt writes no snapshots "
        f"(snapshot: 0, snapshot_after_train: false) and a single process writes no emergency snapshot. "
        f"Set snapshot: N in the solver")
    # a job that fails before its first snapshot
    job = write_job(tmp_path, "fails", db, LOCAL_BATCH, 4)
    out = subprocess.run(_cli("train", "--solver", f"{job}/solver.prototxt", "-restart", "2", "--launcher",
                              "false"), capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"caffepy: error: --restart: the job failed (exit code 1) and left no snapshot to restart from "
        f"({job}/snap_iter_*.solverstate)")


# -- the Keeper alone, in one process: a partial iteration, a full disk ---------------
class _Reducer:
    """The strategy's reducer as the Keeper sees it: whether every gradient has arrived."""

    def __init__(self):
        self.progress = "thread"
        self.arrived = threading.Event()
        self.buckets = [types.SimpleNamespace(done=self.arrived)]


def _kept_solver(tmp_path, db, iterations):
    from caffepy.parallel.failsafe import Keeper
    from caffepy.solvers import Solver
    job = write_job(tmp_path, "kept", db, LOCAL_BATCH, 100, "snapshot: 0\n")
    solver = Solver(str(job / "solver.prototxt"))
    strategy = types.SimpleNamespace(reducer=_Reducer())
    strategy.reducer.arrived.set()
    keeper = Keeper(solver, strategy)
    solver.hooks.append(keeper)
    solver.step(iterations)
    return job, solver, keeper, strategy.reducer


def _state(solver):
    return ([b.data.copy() for b in solver.net.learnable_params],
            [[h.copy() for h in solver.rule.state(i)] for i in range(len(solver.net.learnable_params))])


def _half_an_update(solver, reducer):
    """Iteration solver.iter's forward, backward and the update of its first two parameters,
    while the rest of its gradients are still travelling."""
    solver.net.clear_param_diffs()
    solver.net.forward_from_to()
    solver.net.backward_from_to()
    rate = solver.learning_rate()
    reducer.arrived.clear()
    solver._update(rate, solver.iter, [0, 1])
    return rate


@pytest.mark.parametrize("fused", [True, False], ids=["fused update", "NumPy update"])
def test_a_partial_iteration_gives_the_one_before(tmp_path, db, fused):
    """Parameters updated while gradients still travel are kept as they were (the fused
    update writes the copies in its own pass; the NumPy one copies first): the snapshot is
    of the last whole iteration; once every parameter has its update, of that one."""
    from caffepy.solvers import snapshot as snap
    job, solver, keeper, reducer = _kept_solver(tmp_path, db, 3)
    solver.use_kernels = fused
    data3, history3 = _state(solver)
    normal = solver.snapshot()                     # what an uninterrupted run writes after iteration 2
    rate = _half_an_update(solver, reducer)
    assert not np.array_equal(solver.net.learnable_params[0].data, data3[0])
    record, data, states = keeper.consistent_state()
    assert record.iter == 3
    for i in range(len(data3)):
        np.testing.assert_array_equal(data[i], data3[i])
        for h, h3 in zip(states[i], history3[i]):
            np.testing.assert_array_equal(h, h3)
    for path in normal:
        os.rename(path, path + ".normal")
    written = keeper.emergency([1])
    assert written == normal
    assert open(normal[0], "rb").read() == open(normal[0] + ".normal", "rb").read()
    kept, ref = snap.read_solver_state(normal[1]), snap.read_solver_state(normal[1] + ".normal")
    assert list(kept.history) == list(ref.history) and kept.iter == ref.iter == 3
    assert snap.saved_run_state(kept, "kept") == snap.saved_run_state(ref, "ref")
    # the rest of the gradients arrive, every parameter is updated: iteration 3 is finished
    reducer.arrived.set()
    solver._update(rate, solver.iter, list(range(2, len(data3))))
    record, data, states = keeper.consistent_state()
    assert record.iter == 4
    assert all(data[i] is b.data for i, b in enumerate(solver.net.learnable_params))


def test_a_full_disk_leaves_no_half_snapshot(tmp_path, db, monkeypatch, capsys):
    """ENOSPC on the second file: one line, and neither file (nor a temporary) is left."""
    from caffepy import prototxt
    job, solver, keeper, reducer = _kept_solver(tmp_path, db, 2)
    _half_an_update(solver, reducer)
    replace = os.replace

    def full(src, dst):
        if str(dst).endswith(".solverstate"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        replace(src, dst)
    monkeypatch.setattr(prototxt.os, "replace", full)
    assert keeper.emergency([2]) is None
    assert sorted(p.name for p in job.iterdir()) == ["net.prototxt", "solver.prototxt"]
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("E")]
    assert len(errors) == 1
    assert errors[0].endswith(f"Emergency snapshot of iteration 2 failed: {job}/snap_iter_2.solverstate: cannot "
                              f"write: No space left on device; nothing was written")


@pytest.mark.parametrize("address,loop", [
    ("0100007F:1F90", True),                               # 127.0.0.1:8080
    ("0101007F:0050", True),                               # 127.0.1.1
    ("02004D0A:B3C5", False),                              # 10.77.0.2
    ("00000000000000000000000001000000:0050", True),       # ::1
    ("0000000000000000FFFF00000100007F:0050", True),       # ::ffff:127.0.0.1
    ("0000000000000000FFFF000002004D0A:0050", False),      # ::ffff:10.77.0.2
    ("B80D0120000000000000000001000000:0050", False),      # 2001:db8::1
])
def test_held_connections_leave_the_launchers_local_ones(address, loop):
    """A dead rank's parent holds its connections to other hosts, never the launcher's on 127.x / ::1."""
    from caffepy.parallel import mpi
    assert mpi._loopback(address) == loop
