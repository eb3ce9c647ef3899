"""Training across emulated hosts (tests/multihost/testbed.py): ranks in separate network
namespaces with their own hostnames, MPI over TCP on a veth link. N ranks equal 1 rank
(data parallel, hybrid); a stopped rank ends the job with a line naming it (--stall_timeout);
a killed or frozen rank is named and leaves an emergency snapshot, written by a rank beside it
on its host at once, or by one elsewhere within --stall_timeout.

Run with `make test-multihost` (root and `ip netns` needed; skipped with the reason elsewhere)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpi_helpers import REPO, make_lmdb, max_rel_diff, train, weights, write_job
from multihost.testbed import TestBed, unavailable

pytestmark = pytest.mark.multihost

BATCH = 12
ITERS = 6


@pytest.fixture(scope="module")
def can_emulate():
    reason = unavailable()
    if reason:
        pytest.skip(f"no emulated hosts: {reason}")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train_lmdb")


def caffepy_train(job, *args):
    return [sys.executable, "-m", "caffepy.cli", "train", "--solver", str(job / "solver.prototxt"), *args]


ENV = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


def across_hosts(job, hosts=2, ranks_per_host=1, args=(), rate=None, timeout=240, env=None):
    with TestBed(hosts, rate=rate) as bed:
        return bed.run(caffepy_train(job, *args), ranks_per_host, env=dict(ENV, **(env or {})), timeout=timeout,
                       cwd=job)


@pytest.mark.parametrize("hosts,per_host,algorithm,env", [
    (2, 1, "algorithm: ring (2 ranks", None),                 # one rank per host: the ring over TCP
    (2, 2, "algorithm: shm (2 ranks per host, 2 hosts)", None),   # shared memory, then TCP across
    (2, 2, "algorithm: ring (4 ranks", {"CAFFEPY_MPI_ALLREDUCE": "ring"}),   # the flat ring over all 4
    (4, 1, "algorithm: ring (4 ranks", None),                 # 4 hosts on a bridge
])
def test_data_parallel_across_hosts_matches_one_rank(tmp_path, db, can_emulate, hosts, per_host,
                                                     algorithm, env):
    ranks = hosts * per_host
    single = write_job(tmp_path, "single", db, BATCH, ITERS)
    multi = write_job(tmp_path, "multi", db, BATCH // ranks, ITERS)
    assert train(single).returncode == 0
    out = across_hosts(multi, hosts, per_host, rate="1gbit", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"emu-host{hosts - 1}" in out.stderr          # the ranks saw distinct hosts
    assert algorithm in out.stderr
    assert max_rel_diff(weights(single / f"snap_iter_{ITERS}.caffemodel"),
                        weights(multi / f"snap_iter_{ITERS}.caffemodel")) < 1e-5


@pytest.mark.parametrize("hosts,per_host", [(2, 1), (2, 2)])
@pytest.mark.parametrize("layout", ["model", "hybrid"])
def test_model_and_hybrid_across_hosts_match_one_rank(tmp_path, db, can_emulate, layout, hosts, per_host):
    """model: both InnerProducts split across the ranks; hybrid: fc1 data parallel (its
    gradients over the ring, or shared memory then the ring with 2 ranks a host), fc2 split."""
    ranks = hosts * per_host
    kw = dict(fc="InnerProduct", hybrid=True)
    single = write_job(tmp_path, "single", db, BATCH, ITERS, **kw)
    multi = write_job(tmp_path, "multi", db, BATCH // ranks, ITERS, **kw)
    if layout == "hybrid":
        net = multi / "net.prototxt"
        net.write_text(net.read_text().replace("multinode { model_parts: 0 }", "", 1))
    assert train(single).returncode == 0
    out = across_hosts(multi, hosts, per_host, rate="1gbit")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"hybrid (data + model parallel) over {ranks} ranks" in out.stderr
    if layout == "hybrid":
        assert ("algorithm: ring (2 ranks" if per_host == 1 else
                "algorithm: shm (2 ranks per host, 2 hosts)") in out.stderr
    assert max_rel_diff(weights(single / f"snap_iter_{ITERS}.caffemodel"),
                        weights(multi / f"snap_iter_{ITERS}.caffemodel")) < 1e-5


def test_three_hosts_on_a_bridge(tmp_path, db, can_emulate):
    single = write_job(tmp_path, "single", db, BATCH, 3)
    multi = write_job(tmp_path, "multi", db, BATCH // 3, 3)
    assert train(single).returncode == 0
    out = across_hosts(multi, hosts=3)
    assert out.returncode == 0, out.stderr[-3000:]
    assert max_rel_diff(weights(single / "snap_iter_3.caffemodel"),
                        weights(multi / "snap_iter_3.caffemodel")) < 1e-5


def test_eight_hosts_tiny_net(tmp_path, db, can_emulate):
    """8 emulated hosts on a bridge, one rank each (local batch 3): 8 ranks = 1 rank."""
    single = write_job(tmp_path, "single", db, 24, 3)
    multi = write_job(tmp_path, "multi", db, 3, 3)
    assert train(single).returncode == 0
    out = across_hosts(multi, hosts=8, timeout=480)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "emu-host7" in out.stderr and "algorithm: ring (8 ranks" in out.stderr
    assert max_rel_diff(weights(single / "snap_iter_3.caffemodel"),
                        weights(multi / "snap_iter_3.caffemodel")) < 1e-5


def _long_run(bed, tmp_path, db, name, args=()):
    """A 2-host run going on until stopped; returns (job, launcher, lines so far, pids by rank)."""
    job = write_job(tmp_path, name, db, BATCH // 2, 100000, "snapshot: 0\n")
    proc = bed.popen(caffepy_train(job, *args), env=ENV, cwd=job, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Iteration 20 (" in line:
            pids = re.search(r"MPI ranks: 0=pid (\d+)@emu-host0, 1=pid (\d+)@emu-host1", "".join(lines))
            return job, proc, lines, [int(p) for p in pids.groups()]
        if not line and proc.poll() is not None:
            break
    raise AssertionError("training did not start: " + "".join(lines[-30:]))


def _read_until(stream, pattern, timeout=60):
    """Read lines until one matches `pattern`; its first group (or the line)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m.group(1) if m.groups() else line
    raise AssertionError(f"no line matching {pattern!r}: " + "".join(seen[-20:]))


@pytest.mark.parametrize("victim", [1, 0])
def test_stopped_rank_ends_the_job(tmp_path, db, can_emulate, victim):
    """SIGSTOP a rank on one host: the job ends within stall_timeout + 30 s, naming it."""
    timeout = 8
    with TestBed(2) as bed:
        job, proc, lines, pids = _long_run(bed, tmp_path, db, "stall", ["--stall_timeout", str(timeout)])
        os.kill(pids[victim], signal.SIGSTOP)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=timeout + 30)
        took = time.monotonic() - start
    assert proc.returncode != 0
    other = 1 - victim
    assert re.search(rf"\[rank {other}\] stall: rank {victim} \(pid {pids[victim]}@emu-host{victim}: nothing "
                     rf"heard from it for \d+ s: stopped, hung or unreachable.*\) did not arrive within "
                     rf"--stall_timeout {timeout} s; .*rank {other} waited in the \w[\w ]* of iteration \d+; "
                     rf"aborting all 2 ranks", out), out[-3000:]
    # counted from its last sign of life, which may come up to a heartbeat before the signal
    assert timeout - 2 <= took < timeout + 30
    # a frozen host loses no work either: the rank that found it saves the last finished iteration
    _emergency_iteration(out, other, victim)


def test_killed_rank_is_named(tmp_path, db, can_emulate):
    """Without the stall watchdog (--stall_timeout 0) nothing waits: the launcher ends the job."""
    with TestBed(2) as bed:
        job, proc, lines, pids = _long_run(bed, tmp_path, db, "kill", ["--stall_timeout", "0"])
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - start < 30
    assert proc.returncode != 0
    assert (f"[rank 1] caffepy rank 1 (pid {pids[1]}@emu-host1) was killed by SIGKILL (by hand, by the "
            f"out-of-memory killer or by the batch system); the MPI launcher ends the other ranks") in out, \
        out[-3000:]


def _emergency_iteration(out, writer, lost):
    m = re.search(rf"\[rank {writer}\] Emergency snapshot of iteration (\d+), the last one every rank finished "
                  rf"\(rank {lost} lost\)", out)
    assert m, out[-3000:]
    return int(m.group(1))


def _resumes(tmp_path, db, job, k, ranks, batch):
    cont = write_job(tmp_path, "resumed", db, batch, k + 2)
    resumed = train(cont, ranks, args=["--snapshot", str(job / f"snap_iter_{k}.solverstate")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Iteration {k} (" in resumed.stderr and (cont / f"snap_iter_{k + 2}.caffemodel").exists()


def test_killed_rank_alone_on_its_host_leaves_an_emergency_snapshot(tmp_path, db, can_emulate):
    """2 hosts x 1 rank, rank 1 killed: its parent holds its connections open, so rank 0 finds it
    silent (rather than crashing in the transport on a reset connection), saves the last iteration
    every rank finished within --stall_timeout, and ends the job; the snapshot resumes on 1 rank."""
    timeout = 8
    with TestBed(2) as bed:
        job, proc, lines, pids = _long_run(bed, tmp_path, db, "lone", ["--stall_timeout", str(timeout)])
        time.sleep(2)              # past the parent's first look at the connections
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=timeout + 60)
        took = time.monotonic() - start
    assert proc.returncode != 0
    assert (f"[rank 1] caffepy rank 1 (pid {pids[1]}@emu-host1) was killed by SIGKILL (by hand, by the "
            f"out-of-memory killer or by the batch system); the other ranks find it silent within "
            f"--stall_timeout, save the last iteration every rank finished, then end") in out, out[-3000:]
    k = _emergency_iteration(out, 0, 1)
    assert re.search(rf"\[rank 0\] stall: rank 1 \(pid {pids[1]}@emu-host1: nothing heard from it", out), out[-3000:]
    assert timeout - 2 <= took < timeout + 30
    _resumes(tmp_path, db, job, k, 1, BATCH // 2)


def test_killed_rank_beside_another_leaves_an_emergency_snapshot(tmp_path, db, can_emulate):
    """2 hosts x 2 ranks, rank 3 killed: rank 2, on its host, saves the last iteration every rank
    finished and ends the job naming it; the snapshot resumes on the 3 ranks left."""
    job = write_job(tmp_path, "emergency", db, BATCH // 4, 100000, "snapshot: 0\n")
    with TestBed(2) as bed:
        proc = bed.popen(caffepy_train(job, "--stall_timeout", "30"), ranks_per_host=2, env=ENV, cwd=job,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ranks = _read_until(proc.stdout, r"MPI ranks: (.*)")
        victim = int(re.search(r"3=pid (\d+)@emu-host1", ranks).group(1))
        _read_until(proc.stdout, r"Iteration 20 \(")
        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    k = _emergency_iteration(out, 2, 3)
    assert re.search(rf"\[rank 2\] lost: rank 3 \(pid {victim}@emu-host1: its process ended \(killed or "
                     rf"crashed\)\)", out), out[-3000:]
    _resumes(tmp_path, db, job, k, 3, BATCH // 4)


def test_sigusr1_to_the_launcher_snapshots_and_continues(tmp_path, db, can_emulate):
    """MPICH's mpiexec dies of SIGHUP but passes SIGUSR1 on: caffepy gives it SIGHUP's effect
    (--sighup_effect snapshot: save, carry on), on every rank after the same iteration."""
    with TestBed(2) as bed:
        job, proc, lines, pids = _long_run(bed, tmp_path, db, "usr1")
        os.kill(proc.pid, signal.SIGUSR1)
        snap = int(_read_until(proc.stdout, r"Snapshotting to binary proto file \S+_iter_(\d+)\.caffemodel"))
        _read_until(proc.stdout, rf"Iteration {snap + 3} \(")    # training went on
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGINT)             # --sigint_effect stop
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    # the signal's snapshot, then training went on; the last one is snapshot_after_train's
    snaps = sorted(int(re.search(r"_iter_(\d+)", p.name).group(1)) for p in job.glob("snap_iter_*.caffemodel"))
    assert len(snaps) == 2 and snaps[0] == snap and snaps[0] + 3 <= snaps[1], snaps
    assert (job / f"snap_iter_{snaps[0]}.solverstate").exists()
    assert "Optimization stopped early." in out


def test_testbed_removes_what_it_made(can_emulate):
    from multihost import testbed
    dead = subprocess.Popen(["true"])                   # a pid nobody uses any more
    dead.wait()
    stale = f"{testbed.PREFIX}{dead.pid}x1-h0"          # as a testbed killed with -9 leaves it
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with TestBed(3, rate="100mbit") as bed:
            made = list(bed.namespaces)
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert all(name in listed for name in made) and len(made) == 4      # 3 hosts + bridge
            assert stale not in listed
            assert "tbf" in subprocess.run(["ip", "netns", "exec", made[0], "tc", "qdisc", "show"],
                                           capture_output=True, text=True).stdout
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(name in listed for name in made)
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
