"""No work lost: a rank killed mid-run leaves an emergency snapshot of the last iteration every
rank finished, equal to the snapshot an uninterrupted run writes there, and resumable on fewer
ranks; the --restart supervisor; a full disk and nothing to restart from, one line each."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mpi_helpers import MPIEXEC, REPO, make_lmdb, max_rel_diff, train, weights, write_job

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")

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


def _kill_rank_midway(job, ranks, victim, at_iteration, launcher=(), extra=()):
    """Start `caffepy train` on `ranks` ranks, SIGKILL rank `victim` once iteration
    `at_iteration` is displayed; returns (exit code, everything it printed)."""
    cmd = [*launcher] if launcher else [MPIEXEC, "-n", str(ranks)]
    proc = subprocess.Popen(cmd + _cli("train", "--solver", str(job / "solver.prototxt"), "--stall_timeout",
                                       "20", *extra),
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


def test_killed_rank_leaves_a_snapshot_that_resumes_on_fewer_ranks(tmp_path, db):
    job = write_job(tmp_path, "killed", db, LOCAL_BATCH, 100000, "snapshot: 0\n")
    code, text, pid = _kill_rank_midway(job, 3, 1, 12)
    assert code != 0
    assert re.search(rf"\[rank 0\] lost: rank 1 \(pid {pid}@\S+: its process ended \(killed or crashed\)\); "
                     rf"ranks? [0-9, -]+ (waited in|at) .*; aborting all 3 ranks", text), text[-3000:]
    k = int(re.search(r"Emergency snapshot of iteration (\d+), the last one every rank finished "
                      r"\(rank 1 lost\)", text).group(1))
    assert f"Emergency snapshot written: {job}/snap_iter_{k}.caffemodel, {job}/snap_iter_{k}.solverstate" in text
    assert k >= 12
    # the same 3 ranks, run uninterrupted to iteration k: the same snapshot
    ref = write_job(tmp_path, "ref", db, LOCAL_BATCH, k)
    out = train(ref, 3)
    assert out.returncode == 0, out.stderr[-3000:]
    emergency = weights(job / f"snap_iter_{k}.caffemodel")
    assert max_rel_diff(weights(ref / f"snap_iter_{k}.caffemodel"), emergency) < 1e-5
    # both resumed on the 2 ranks left: the same weights (momentum and data stream included)
    finals = []
    for name, state in (("from_emergency", job), ("from_ref", ref)):
        cont = write_job(tmp_path, name, db, LOCAL_BATCH, k + 4)
        out = train(cont, 2, args=["--snapshot", str(state / f"snap_iter_{k}.solverstate")])
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"Iteration {k} (" in out.stderr and "Iteration 0 (" not in out.stderr
        assert "continues the record stream where the snapshot's 3 ranks had read it together" in out.stderr
        finals.append(weights(cont / f"snap_iter_{k + 4}.caffemodel"))
    assert max_rel_diff(*finals) < 1e-5
    assert max_rel_diff(finals[0], emergency) > 1e-4          # training went on


def test_restart_relaunches_from_the_emergency_snapshot(tmp_path, db):
    job = write_job(tmp_path, "restart", db, LOCAL_BATCH, 40, "snapshot: 0\n")
    code, text, pid = _kill_rank_midway(
        job, 2, 1, 10, launcher=_cli("train", "--restart", "2", "--launcher", f"{MPIEXEC} -n 2"))
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
