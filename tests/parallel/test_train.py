"""Real ranks under mpiexec: N ranks with local batch B/N train exactly like
1 rank with batch B (data parallel and hybrid, SGD with momentum, LARS with
warm-up), signals, resume, and the data each rank reads."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpi_helpers import MPIEXEC, REPO, make_lmdb, max_rel_diff, solver_text, train, weights, write_job

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")

BATCH = 12
ITERS = 6


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train_lmdb")


_SINGLE = {}      # the 1-rank reference runs, shared by the tests that compare with them


def single_run(tmp_path, db, extra="", **net_kw):
    key = (extra, tuple(sorted(net_kw.items())))
    if key not in _SINGLE:
        job = write_job(tmp_path, "single", db, BATCH, ITERS, extra, **net_kw)
        out = train(job)
        assert out.returncode == 0, out.stderr[-3000:]
        _SINGLE[key] = (weights(job / f"snap_iter_{ITERS}.caffemodel"), out)
    return _SINGLE[key]


def run_pair(tmp_path, db, ranks, extra="", **net_kw):
    w1, out1 = single_run(tmp_path, db, extra, **net_kw)
    multi = write_job(tmp_path, f"ranks{ranks}", db, BATCH // ranks, ITERS, extra, **net_kw)
    outn = train(multi, ranks)
    assert outn.returncode == 0, outn.stderr[-3000:]
    wn = weights(multi / f"snap_iter_{ITERS}.caffemodel")
    return w1, wn, out1, outn


@pytest.mark.parametrize("ranks", [2, 4])
def test_data_parallel_matches_one_rank(tmp_path, db, ranks):
    w1, wn, _, outn = run_pair(tmp_path, db, ranks)
    assert max_rel_diff(w1, wn) < 1e-5
    assert f"local batch {BATCH // ranks}, global batch {BATCH}" in outn.stderr
    assert f"progress: thread, algorithm: shm ({ranks} ranks per host, 1 host)" in outn.stderr
    if ranks == 2:
        # the weights really moved: the comparison is not between two initial states
        init = weights_at_start(tmp_path, db)
        assert max_rel_diff(w1, init) > 1e-3


def test_fused_batchnorm_scale_matches_one_rank(tmp_path, db):
    """The Scale's parameters are read by the fused BatchNorm before the Scale's own place in
    the forward: their deferred update must be applied there (Net.forward_from_to)."""
    w1, wn, out1, outn = run_pair(tmp_path, db, 2, bn=True)
    assert "BatchNorm+Scale(+ReLU): fused 1 BatchNorm + Scale pair" in out1.stderr
    assert max_rel_diff(w1, wn) < 1e-5
    init = weights_at_start(tmp_path, db, bn=True)
    assert max_rel_diff({"s": w1["scale1.0"]}, {"s": init["scale1.0"]}) > 1e-3


@pytest.mark.parametrize("ranks,env,described", [
    (2, {"CAFFEPY_MPI_ALLREDUCE": "mpi"}, "progress: thread, algorithm: mpi"),
    (2, {"CAFFEPY_MPI_PROGRESS": "blocking"}, "progress: blocking, algorithm: shm (2 ranks"),
    (4, {"CAFFEPY_MPI_RANKS_PER_NODE": "2"}, "algorithm: shm (2 ranks per host, 2 hosts)"),
])
def test_allreduce_algorithms_match_one_rank(tmp_path, db, ranks, env, described):
    w1, _ = single_run(tmp_path, db)
    multi = write_job(tmp_path, "multi", db, BATCH // ranks, ITERS)
    out = train(multi, ranks, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert described in out.stderr
    assert max_rel_diff(w1, weights(multi / f"snap_iter_{ITERS}.caffemodel")) < 1e-5


def weights_at_start(tmp_path, db, **net_kw):
    job = write_job(tmp_path, "zero", db, BATCH, 0, **net_kw)
    out = train(job)
    assert out.returncode == 0, out.stderr[-2000:]
    return weights(job / "snap_iter_0.caffemodel")


def test_iter_size_matches_one_rank(tmp_path, db):
    """With iter_size 2 only the second backward pass of an iteration is reduced."""
    single = write_job(tmp_path, "single", db, BATCH // 2, ITERS, "iter_size: 2\n")
    multi = write_job(tmp_path, "multi", db, BATCH // 4, ITERS, "iter_size: 2\n")
    assert train(single).returncode == 0
    out = train(multi, 2)
    assert out.returncode == 0, out.stderr[-2000:]
    assert max_rel_diff(weights(single / f"snap_iter_{ITERS}.caffemodel"),
                        weights(multi / f"snap_iter_{ITERS}.caffemodel")) < 1e-5


@pytest.mark.parametrize("ranks", [2, 4])
def test_lars_warmup_matches_one_rank(tmp_path, db, ranks):
    extra = "local_lr_auto: true\nlocal_gw_ratio: 0.01\nwarmup_iter: 4\nwarmup_start_lr: 0.01\n"
    w1, wn, _, _ = run_pair(tmp_path, db, ranks, extra)
    assert max_rel_diff(w1, wn) < 1e-5


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_hybrid_matches_one_rank(tmp_path, db, ranks):
    """fc1 (8 outputs) and fc2 (4) split over the ranks, unevenly for 3."""
    w1, wn, out1, outn = run_pair(tmp_path, db, ranks, fc="InnerProduct", hybrid=True)
    assert "hybrid (data + model parallel) over" in outn.stderr
    assert "Layer fc1: model parallel" in outn.stderr
    assert max_rel_diff(w1, wn) < 1e-5


def test_hybrid_lars_warmup_matches_one_rank(tmp_path, db):
    extra = "local_lr_auto: true\nlocal_gw_ratio: 0.01\nwarmup_iter: 4\nwarmup_start_lr: 0.01\n"
    w1, wn, _, _ = run_pair(tmp_path, db, 2, extra, fc="InnerProduct", hybrid=True)
    assert max_rel_diff(w1, wn) < 1e-5


def test_hybrid_snapshot_holds_full_weights_and_history(tmp_path, db):
    """A 2-rank hybrid snapshot resumes on 1 rank exactly like a 1-rank snapshot does."""
    kw = dict(fc="InnerProduct", hybrid=True)
    single = write_job(tmp_path, "single", db, BATCH, 3, **kw)
    multi = write_job(tmp_path, "multi", db, BATCH // 2, 3, **kw)
    assert train(single).returncode == 0
    out = train(multi, 2)
    assert out.returncode == 0, out.stderr[-2000:]
    assert max_rel_diff(weights(single / "snap_iter_3.caffemodel"),
                        weights(multi / "snap_iter_3.caffemodel")) < 1e-5
    results = []
    for job in (single, multi):
        cont = write_job(tmp_path, f"cont_{job.name}", db, BATCH, ITERS, **kw)
        res = train(cont, args=["--snapshot", str(job / "snap_iter_3.solverstate")])
        assert res.returncode == 0, res.stderr[-2000:]
        results.append(weights(cont / f"snap_iter_{ITERS}.caffemodel"))
    assert max_rel_diff(*results) < 1e-5


@pytest.mark.parametrize("hybrid", [False, True])
def test_ranks_share_the_test_phase_like_one_rank(tmp_path, db, hybrid):
    """Each of 2 ranks runs 2 of the 4 test batches of 6 (shared DB: the ranks' records
    interleave), the sums are added over the ranks: the scores of one rank testing 2 batches
    of 12. Rank 0 alone would have read only even records."""
    kw = dict(fc="InnerProduct", hybrid=hybrid)
    single = write_job(tmp_path, "single", db, BATCH, ITERS, "test_iter: 2\ntest_interval: 3\n", **kw)
    multi = write_job(tmp_path, "multi", db, BATCH // 2, ITERS, "test_iter: 4\ntest_interval: 3\n", **kw)
    out1, outn = train(single), train(multi, 2)
    assert out1.returncode == 0, out1.stderr[-2000:]
    assert outn.returncode == 0, outn.stderr[-2000:]
    pattern = r"Test net output #0: loss = (\S+)"
    t1 = [float(v) for v in re.findall(pattern, out1.stderr)]
    tn = [float(v) for v in re.findall(pattern, outn.stderr)]
    assert len(t1) == 3 and len(tn) == 3          # iterations 0, 3 and 6
    assert t1 == pytest.approx(tn, rel=1e-4)
    assert len(set(t1)) == 3


def test_resume_from_snapshot_continues(tmp_path, db):
    """A 2-rank run resumed from a snapshot ends where a 1-rank run resumed from it does."""
    first = write_job(tmp_path, "first", db, BATCH, 3)
    assert train(first).returncode == 0
    state = first / "snap_iter_3.solverstate"
    single = write_job(tmp_path, "single", db, BATCH, ITERS)
    multi = write_job(tmp_path, "multi", db, BATCH // 2, ITERS)
    out1 = train(single, args=["--snapshot", str(state)])
    outn = train(multi, 2, args=["--snapshot", str(state)])
    assert out1.returncode == 0, out1.stderr[-2000:]
    assert outn.returncode == 0, outn.stderr[-2000:]
    assert "Iteration 3 (" in outn.stderr and "Iteration 0 (" not in outn.stderr
    w1 = weights(single / f"snap_iter_{ITERS}.caffemodel")
    wn = weights(multi / f"snap_iter_{ITERS}.caffemodel")
    assert max_rel_diff(w1, wn) < 1e-5
    assert max_rel_diff(w1, weights(first / "snap_iter_3.caffemodel")) > 1e-3


def test_ranks_with_different_nets_are_refused(tmp_path, db):
    a = write_job(tmp_path, "a", db, 4)
    b = write_job(tmp_path, "b", db, 5)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [MPIEXEC]
    for job in (a, a, b):
        cmd += ["-n", "1", sys.executable, "-m", "caffepy.cli", "train", "--solver",
                str(job / "solver.prototxt"), ":"]
    out = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "[rank 0] the solver definition (SolverParameter) differs between ranks: ranks [2] " \
           "do not match rank 0" in text, text[-3000:]


def _start_long_run(tmp_path, db, name, extra_args=()):
    job = write_job(tmp_path, name, db, BATCH // 2, 100000, "snapshot: 0\n")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "caffepy.cli", "train",
           "--solver", str(job / "solver.prototxt"), *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=job, start_new_session=True)
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if "Iteration 20 (" in line:
            return job, proc, lines
    proc.kill()
    raise AssertionError("training did not start: " + "".join(lines[-30:]))


def test_sigint_snapshots_on_rank_0_and_stops_every_rank(tmp_path, db):
    job, proc, lines = _start_long_run(tmp_path, db, "sigint", ["--sigint_effect", "snapshot"])
    try:
        os.kill(proc.pid, signal.SIGINT)            # to the launcher, which forwards it
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    snaps = sorted(job.glob("snap_iter_*.caffemodel"))
    assert len(snaps) == 1 and (job / snaps[0].name.replace("caffemodel", "solverstate")).exists()
    assert "Optimization stopped early." in err


def test_killed_rank_ends_training(tmp_path, db):
    job, proc, lines = _start_long_run(tmp_path, db, "kill")
    try:
        pids = re.search(r"MPI ranks: 0=pid (\d+)@(\S+), 1=pid (\d+)@", "".join(lines))
        os.kill(int(pids.group(3)), signal.SIGKILL)
        start = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    # the rank's parent (the process the launcher watches) names it; rank 0 saves the last
    # finished iteration (tests/parallel/test_failsafe.py) and ends the job naming it too
    assert (f"[rank 1] caffepy rank 1 (pid {pids.group(3)}@{pids.group(2)}) was killed by SIGKILL (by "
            f"hand, by the out-of-memory killer or by the batch system)") in err, err[-3000:]
    assert f"[rank 0] lost: rank 1 (pid {pids.group(3)}@{pids.group(2)}: its process ended" in err
    assert "Emergency snapshot written" in err


def test_stopped_rank_ends_training(tmp_path, db):
    """SIGSTOP one rank: --stall_timeout ends the job, naming it and where rank 0 waited."""
    job, proc, lines = _start_long_run(tmp_path, db, "stall", ["--stall_timeout", "5"])
    try:
        pids = re.search(r"MPI ranks: 0=pid (\d+)@\S+, 1=pid (\d+)@", "".join(lines))
        os.kill(int(pids.group(2)), signal.SIGSTOP)
        start = time.monotonic()
        out, err = proc.communicate(timeout=35)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert re.search(rf"\[rank 0\] stall: rank 1 \(pid {pids.group(2)}@\S+: nothing heard from it for \d+ s: "
                     rf"stopped, hung or unreachable; last at .*\) did not arrive within --stall_timeout 5 s; "
                     rf"rank 0 waited in the [a-z ]+ of iteration \d+; aborting all 2 ranks", err), err[-3000:]
    assert 3 <= took < 35        # from its last sign of life, up to a heartbeat before the signal


def test_one_signal_acts_once_on_every_rank(tmp_path, db):
    """SIGUSR1 to the launcher (SIGHUP's effect under MPI; MPICH's mpiexec dies of SIGHUP):
    one snapshot, and training goes on."""
    job, proc, lines = _start_long_run(tmp_path, db, "usr1")
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        snap = int(_read_until(proc.stderr, r"Snapshotting to binary proto file \S+_iter_(\d+)\.caffemodel"))
        _read_until(proc.stderr, rf"Iteration {snap + 3} \(")     # training went on
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    snaps = sorted(int(re.search(r"_iter_(\d+)", p.name).group(1)) for p in job.glob("snap_iter_*.caffemodel"))
    # the signal's snapshot, then snapshot_after_train's
    assert len(snaps) == 2 and snaps[0] == snap and snaps[0] + 3 <= snaps[1], snaps


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


def test_attach_refuses_a_solver_built_without_the_world(tmp_path, db):
    """A Solver built in the single-process context would read every record on every rank and
    pick no model-parallel layer: joining it to the world is an error, not a silent mistake."""
    job = write_job(tmp_path, "context", db, BATCH // 2)
    script = tmp_path / "attach.py"
    script.write_text(f"""
from caffepy.parallel import mpi
from caffepy.solvers import Solver
mpi.init_world()
mpi.attach(Solver({str(job / "solver.prototxt")!r}))
""")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=60, env=env, cwd=job)
    assert out.returncode != 0
    assert "uncaught the Solver was built for another run context, got <RunContext rank 0 of 1>. " \
           "Build it with Solver(..., context=caffepy.parallel.world)" in out.stderr, out.stderr[-3000:]


def _bn_job(tmp_path, name, db, batch):
    d = tmp_path / name
    d.mkdir()
    (d / "net.prototxt").write_text(f"""name: "bn"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{db}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "bn" type: "BatchNorm" bottom: "data" top: "bn"
  batch_norm_param {{ moving_average_fraction: 0.9 }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "bn" top: "fc"
  inner_product_param {{ num_output: 4 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }}
""")
    (d / "solver.prototxt").write_text(solver_text(d / "net.prototxt", d / "snap", ITERS))
    return d


def test_batchnorm_statistics_are_the_mean_over_ranks(tmp_path, db):
    """Each rank accumulates BatchNorm's statistics from its local batches; the snapshot holds
    their mean over the ranks: for the mean exactly one rank's with the global batch, for the
    variance the mean of the ranks' local variances (the rule the README states)."""
    import numpy as np

    from mpi_helpers import RECORDS
    ranks, local = 2, BATCH // 2
    single, multi = _bn_job(tmp_path, "single", db, BATCH), _bn_job(tmp_path, "multi", db, local)
    out1, outn = train(single), train(multi, ranks)
    assert out1.returncode == 0, out1.stderr[-2000:]
    assert outn.returncode == 0, outn.stderr[-2000:]
    w1 = weights(single / f"snap_iter_{ITERS}.caffemodel")
    wn = weights(multi / f"snap_iter_{ITERS}.caffemodel")
    assert max_rel_diff({"m": w1["bn.0"]}, {"m": wn["bn.0"]}) < 1e-5
    assert float(wn["bn.2"].ravel()[0]) == pytest.approx(float(w1["bn.2"].ravel()[0]))
    # the records rank r reads in iteration k: positions (k * local + j) * ranks + r
    from caffepy.data.datum import datum_to_array, parse_datum
    from caffepy.data.db import open_reader
    reader = open_reader(db)
    records = np.stack([datum_to_array(parse_datum(reader.get(i)[1])) for i in range(RECORDS)]).astype(np.float64)
    m = local * 16
    expected = np.zeros(2)
    for r in range(ranks):
        for k in range(ITERS):
            x = records[[(k * local + j) * ranks + r for j in range(local)]]
            expected += 0.9 ** (ITERS - 1 - k) * x.var(axis=(0, 2, 3)) * m / (m - 1) / ranks
    assert wn["bn.1"].ravel() == pytest.approx(expected, rel=1e-4)
    assert not np.allclose(w1["bn.1"].ravel(), expected, rtol=1e-3)    # not the global variance


# A layer that makes one rank a straggler: param_str names the rank (hydra's PMI_RANK)
SLOW_LAYER = '''
import os
import time

import caffepy


class Slow(caffepy.Layer):
    def forward(self, bottom, top):
        if os.environ.get("PMI_RANK") == self.param_str:
            time.sleep(0.15)
'''

RANK_LINE = re.compile(r"\] Iteration (\d+), (\d+) ranks: ([\d.]+) images/s, slowest rank (\d+) \(([\d.e-]+) s/iter "
                       r"working; fastest rank (\d+) ([\d.e-]+)\), waiting ([\d.]+)% of the time for "
                       r"communication, ([\d.]+)% for other ranks")


@pytest.mark.parametrize("ranks,slow", [(2, None), (3, 2)])
def test_display_reports_the_ranks_and_names_a_straggler(tmp_path, db, ranks, slow):
    job = write_job(tmp_path, "job", db, BATCH // ranks, 8)
    (job / "solver.prototxt").write_text((job / "solver.prototxt").read_text().replace("display: 1", "display: 2"))
    if slow is not None:
        (job / "slow.py").write_text(SLOW_LAYER)
        with open(job / "net.prototxt", "a") as f:
            f.write(f'layer {{ name: "slow" type: "Python" bottom: "label" '
                    f'python_param {{ module: "slow" layer: "Slow" param_str: "{slow}" }} }}\n')
    out = train(job, ranks)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [m.groups() for m in RANK_LINE.finditer(out.stderr)]
    # one after each display but the first (nothing to report yet); the solver's line before it
    assert [int(g[0]) for g in lines] == [2, 4, 6], out.stderr[-3000:]
    solver_rates = [float(r) for r in re.findall(r"\] Iteration [246] \(([\d.e+-]+) iter/s", out.stderr)]
    for (_, n, images, slowest, working, fastest, fastest_working, communication, others), rate in zip(
            lines, solver_rates):
        assert int(n) == ranks
        # the same span as the solver's line, timed on rank 0 a few calls later
        assert 0.5 < float(images) / (rate * BATCH) < 2
        assert float(working) >= float(fastest_working) >= 0
        assert 0 <= float(communication) <= 100 and 0 <= float(others) <= 100
        if slow is not None:
            assert int(slowest) == slow and int(fastest) != slow
            assert float(working) >= 0.15 > float(fastest_working)
            # the others waited for it most of each iteration
            assert float(others) > 100 * (ranks - 1) / ranks * 0.5


def _groups_job(tmp_path, name, db, batch, groups):
    """Conv (4 x 4 pixels; no bias: its gradient through a BatchNorm is rounding noise) ->
    BatchNorm with batch statistics, Scale, ReLU (a fused unit on the fast path) -> classifier;
    `groups`: the net's bn_stats_batch_size line."""
    d = tmp_path / name
    d.mkdir()
    (d / "net.prototxt").write_text(f"""name: "groups" {groups}
layer {{ name: "data" type: "Data" top: "data" top: "label"
  data_param {{ source: "{db}" batch_size: {batch} backend: LMDB }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 bias_term: false
    weight_filler {{ type: "gaussian" std: 0.3 }} }} }}
layer {{ name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" batch_norm_param {{ moving_average_fraction: 0.9 }} }}
layer {{ name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param {{ bias_term: true }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "fc2" type: "InnerProduct" bottom: "conv1" top: "fc2"
  inner_product_param {{ num_output: 4 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }}
""")
    (d / "solver.prototxt").write_text(solver_text(d / "net.prototxt", d / "snap", ITERS))
    return d


def _ranks_in_order(db, path, ranks, local):
    """`db` rewritten so that one rank reading it in order gets, in each batch of ranks * local
    records, rank 0's local batch of the shared-DB interleave, then rank 1's, ...: record
    (k * local + j) * ranks + r of `db` goes to position k * ranks * local + r * local + j."""
    from caffepy.data.db import open_reader, open_writer
    reader = open_reader(db)
    n = len(reader)
    order = [(k * local + j) * ranks + r for k in range(n // (ranks * local))
             for r in range(ranks) for j in range(local)]
    with open_writer(str(path)) as w:
        for pos, i in enumerate(order):
            w.put(f"{pos:08d}", reader.get(i)[1])
    return str(path)


def test_statistics_groups_on_ranks_match_one_rank_with_the_ranks_batches(tmp_path, db):
    """bn_stats_batch_size 3 on 2 ranks of local batch 6 trains as 1 rank of batch 12 whose
    batches are the ranks' local batches one after the other (the groups lie within each
    rank's batch, so both runs normalize the same groups of images). The running statistics
    differ by design: each rank takes one update per group of its own batch (2 per iteration,
    4 on one rank), and the snapshot holds their mean over the ranks."""
    ranks, local, group = 2, BATCH // 2, 3
    ordered = _ranks_in_order(db, tmp_path / "ordered_lmdb", ranks, local)
    single = _groups_job(tmp_path, "single", ordered, BATCH, f"bn_stats_batch_size: {group}")
    multi = _groups_job(tmp_path, "multi", db, local, f"bn_stats_batch_size: {group}")
    whole = _groups_job(tmp_path, "whole", ordered, BATCH, "")
    outs = [train(single), train(multi, ranks), train(whole)]
    for out in outs:
        assert out.returncode == 0, out.stderr[-3000:]
    assert "fused 1 BatchNorm + Scale pair(s), 1 with the ReLU" in outs[1].stderr
    w1, wn, w0 = (weights(job / f"snap_iter_{ITERS}.caffemodel") for job in (single, multi, whole))
    learned = [k for k in w1 if not k.startswith("bn1.")]
    assert max_rel_diff({k: w1[k] for k in learned}, {k: wn[k] for k in learned}) < 1e-5
    # the groups changed the training: whole-batch statistics give other weights
    assert max_rel_diff({k: w1[k] for k in learned}, {k: w0[k] for k in learned}) > 1e-3
    updates = lambda n: sum(0.9 ** i for i in range(n))       # noqa: E731
    assert float(w1["bn1.2"].ravel()[0]) == pytest.approx(updates(ITERS * BATCH // group), rel=1e-5)
    assert float(wn["bn1.2"].ravel()[0]) == pytest.approx(updates(ITERS * local // group), rel=1e-5)
