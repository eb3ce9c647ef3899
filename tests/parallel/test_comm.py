"""The communicator pieces under real ranks (mpiexec from the venv): launcher
detection, the gradient reducer in every progress mode, and failure handling."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from paths import REPO
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")


def mpirun(n, script, tmp_path, *args, timeout=120, env=None):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    full_env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(path), *args],
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def test_not_launched_without_launcher(monkeypatch):
    from caffepy.parallel import mpi, world
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert not mpi.launched()
    assert mpi.init_world() is world and world.size == 1 and world.comm is None
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert mpi.launched()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert not mpi.launched()


def test_world_under_mpiexec(tmp_path):
    out = mpirun(3, """
        import sys
        from caffepy.parallel import mpi, world
        assert mpi.launched()
        assert "mpi4py" not in sys.modules        # detection alone does not start MPI
        mpi.init_world()
        print(f"rank {world.rank} of {world.size}")
        mpi.finish()
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    # the launcher merges the ranks' stdout and may interleave a line with its newline
    assert sorted(re.findall(r"rank \d+ of \d+", out.stdout)) == [f"rank {r} of 3" for r in range(3)]


@pytest.mark.parametrize("user,early", [(None, False), ("256K", False), (None, True)])
def test_transport_defaults_set_before_mpi_unless_the_user_did(tmp_path, user, early):
    """The ring sizes its sleeps for the receive segment MPI started with: the default's, the
    user's, or UCX's own 64 KB when the caller started MPI first (importing mpi4py.MPI)."""
    out = mpirun(2, f"""
        import os
        {"from mpi4py import MPI" if early else ""}
        from caffepy.parallel import mpi, ring, world
        mpi.init_world()
        seen = world.comm.gather((os.environ.get("UCX_TCP_RX_SEG_SIZE"), ring.rx_segment_bytes))
        if world.rank == 0:             # one line: the launcher may interleave the ranks' lines
            print("seg", *[f"{{v}}={{b}}" for v, b in seen])
        mpi.finish()
    """, tmp_path, env={"UCX_TCP_RX_SEG_SIZE": user} if user else None)
    assert out.returncode == 0, out.stderr
    expect = {None: "1M=1048576", "256K": "256K=262144"}[user] if not early else "None=65536"
    assert re.findall(r"seg (\S+) (\S+)", out.stdout) == [(expect,) * 2]


REDUCER = """
    import sys
    import numpy as np
    from caffepy.blob import Blob
    from caffepy.parallel import mpi, world
    from caffepy.parallel.allreduce import GradientReducer
    mpi.init_world()
    progress, algorithm, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sizes = [5, 300000, 7, 1, 2000000, 64, 64, 3]      # mixes packed and in-place buckets
    ready = [7, 7, 5, 4, 3, 3, 1, 0]
    blobs = [Blob((n,), name=str(i)) for i, n in enumerate(sizes)]
    reducer = GradientReducer(world.comm, list(zip(blobs, ready)), bucket_bytes=4096,
                              progress=progress, algorithm=algorithm, chunk_bytes=chunk)
    for it in range(3):
        for i, b in enumerate(blobs):
            b.diff[...] = np.arange(b.count) * (world.rank + 1) + i + it
        for layer in range(7, -1, -1):
            reducer.layer_done(layer)
        reducer.finish()
        mean = (world.size + 1) / 2
        for i, b in enumerate(blobs):
            expect = (np.arange(b.count) * mean + i + it).astype(np.float32)
            np.testing.assert_allclose(b.diff, expect, rtol=1e-6)
    described = reducer.describe()
    reducer.close()
    # closing gives the blobs private diffs again, values kept
    np.testing.assert_allclose(blobs[1].diff, (np.arange(300000) * mean + 1 + 2).astype(np.float32),
                               rtol=1e-6)
    print(f"ok {world.rank} {len(reducer.buckets)} {described}")  # one write per line
    mpi.finish()
"""


@pytest.mark.parametrize("algorithm", ["shm", "ring", "mpi"])
@pytest.mark.parametrize("progress", ["thread", "test", "wait", "blocking"])
def test_reducer_averages(tmp_path, progress, algorithm):
    # a 64 KB MPI slice: the 8 MB parameter goes in many pieces
    out = mpirun(2, REDUCER, tmp_path, progress, algorithm, str(64 << 10))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ok") == 2
    if progress in ("test", "wait"):               # MPI's Iallreduce, whatever the algorithm
        expect = " mpi"
    elif algorithm == "shm":
        expect = "shm (2 ranks per host, 1 host)"
    else:
        expect = " ring (2 ranks" if algorithm == "ring" else " mpi"
    assert out.stdout.count(expect) == 2


def test_reducer_four_ranks(tmp_path):
    out = mpirun(4, REDUCER, tmp_path, "thread", "shm", str(4 << 20))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("shm (4 ranks per host, 1 host)") == 4


@pytest.mark.parametrize("ranks,per_host,expect", [
    (4, 2, "shm (2 ranks per host, 2 hosts)"),   # local sums, then an allreduce across hosts
    (6, 2, "shm (2 ranks per host, 3 hosts)"),
    (3, 2, " ring (3 ranks"),                    # hosts with different rank counts
    (2, 1, " ring (2 ranks"),                    # one rank per host: nothing to share
])
def test_reducer_over_emulated_hosts(tmp_path, ranks, per_host, expect):
    for progress in ("blocking", "thread"):
        out = mpirun(ranks, REDUCER, tmp_path, progress, "shm", str(64 << 10),
                     env={"CAFFEPY_MPI_RANKS_PER_NODE": str(per_host)})
        assert out.returncode == 0, out.stderr
        assert out.stdout.count(expect) == ranks, out.stdout


def test_shm_falls_back_when_dev_shm_is_small(tmp_path):
    """One host short of /dev/shm space: every rank agrees on the ring instead."""
    out = mpirun(2, """
        import numpy as np
        from caffepy.blob import Blob
        from caffepy.parallel import allreduce, mpi, world
        mpi.init_world()
        if world.rank == 1:
            allreduce._shm_free_bytes = lambda: 0
        blob = Blob((1000,))
        reducer = allreduce.GradientReducer(world.comm, [(blob, 0)], progress="blocking",
                                            algorithm="shm")
        blob.diff[...] = world.rank
        reducer.finish()
        assert np.all(blob.diff == 0.5)
        print(f"ok {reducer.describe()}")
        reducer.close()
        mpi.finish()
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(re.findall(r"ok ring \(2 ranks", out.stdout)) == 2
    assert "[rank 1] /dev/shm has 0 MB free, the shared-memory allreduce needs" in out.stderr


def test_shm_fence_sleeps_while_waiting(tmp_path):
    """A rank far ahead of the others waits for them without spinning on a core."""
    out = mpirun(2, """
        import time
        from caffepy.blob import Blob
        from caffepy.parallel import mpi, world
        from caffepy.parallel.allreduce import GradientReducer
        mpi.init_world()
        reducer = GradientReducer(world.comm, [(Blob((1000,)), 0)], progress="blocking",
                                  algorithm="shm")
        assert reducer.window is not None
        if world.rank == 1:
            time.sleep(2.0)
        cpu, wall = time.process_time(), time.perf_counter()
        reducer.finish()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if world.rank == 0:
            print(f"waited {wall:.2f} s using {cpu:.2f} s of CPU")
            assert wall > 1.5 and cpu < 0.25 * wall      # spinning would be about 1.0
        reducer.close()
        mpi.finish()
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "waited" in out.stdout


def test_strategy_waits_for_a_late_rank_without_spinning(tmp_path):
    """The main thread's small collectives (loss, signals, output sums, the rank report, an
    iteration's record settled) wait for a late rank on sleeps: MPICH's blocking calls would spin a core meanwhile,
    the core the late rank's backward or this rank's allreduce thread needs."""
    out = mpirun(2, """
        import time
        import numpy as np
        from google.protobuf import text_format
        from caffepy.parallel import mpi, world
        from caffepy.proto import caffe_pb2
        from caffepy.solvers import Solver
        from caffepy.solvers.solver import IterationRecord
        mpi.init_world()
        param = text_format.Parse('''
            base_lr: 0.01 lr_policy: "fixed" max_iter: 2 display: 1 solver_mode: CPU random_seed: 1
            net_param { name: "tiny"
              layer { name: "data" type: "DummyData" top: "data" top: "label"
                dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 }
                  data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 0 } } }
              layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
                inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
              layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" } }
        ''', caffe_pb2.SolverParameter())
        solver = Solver(param, source="tiny", context=world)
        strategy = mpi.attach(solver)
        solver.step(1)                         # the reducer, the first display's clock
        settle = lambda previous: strategy.settle_record(solver)     # nothing held before: waits for this one
        calls = {"loss": lambda: strategy.reduce_loss(solver, 1.0 + world.rank),
                 "signals": lambda: strategy.agree_action(solver, "none"),
                 "outputs": lambda: strategy.reduce_scores(solver, np.ones(3)),
                 "report": lambda: strategy.on_display(solver, {"iteration": 1, "scalars": {}}),
                 "record": lambda: settle(strategy.post_record(solver, IterationRecord(1, 1.0 + world.rank, False)))}
        for name, call in calls.items():
            if world.rank == 1:
                time.sleep(1.0)
            cpu, wall = time.thread_time(), time.perf_counter()
            result = call()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            if name == "loss":
                assert result == 1.5
            if name == "record":
                assert result.loss == 1.5 and result.request == "none"
            if name == "outputs":
                assert list(result) == [2, 2, 2]
            if world.rank == 0:
                print(f"{name}: waited {wall:.2f} s using {cpu:.2f} s of CPU")
                assert wall > 0.7 and cpu < 0.1 * wall, name     # spinning: 0.2 (loaded machine) to 1.0
        strategy.close()
        mpi.finish()
    """, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("waited") == 5, out.stdout


RING = """
    import numpy as np
    from caffepy.parallel import mpi, world
    from caffepy.parallel.ring import Ring
    mpi.init_world()
    ring = Ring(world.comm.Dup(), piece_floats=1000)        # many pieces, two in flight
    for n in (0, 1, 17, 5000, 123457):
        buf = (np.arange(n) % 97 * (world.rank + 1) + 0.1).astype(np.float32)
        ring.allreduce(buf, 1.0 / world.size, tag=n % 7)
        mean = (world.size + 1) / 2
        np.testing.assert_allclose(buf, (np.arange(n) % 97 * mean + 0.1).astype(np.float32), rtol=1e-6)
        copies = world.comm.allgather(buf.tobytes())
        assert all(c == copies[0] for c in copies)           # the same bits on every rank
    print(f"ok {world.rank}")
    mpi.finish()
"""


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ring_averages_to_the_same_bits_everywhere(tmp_path, ranks):
    out = mpirun(ranks, RING, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ok") == ranks


RING_BF16 = """
    import numpy as np
    from caffepy.parallel import mpi, world
    from caffepy.parallel.ring import Ring
    mpi.init_world()
    ring = Ring(world.comm.Dup(), piece_floats=1000, wire="bfloat16")
    for n in (0, 1, 17, 5000, 123457):
        x = np.random.RandomState(world.rank).randn(n).astype(np.float32) * 1e-3
        exact = sum(np.random.RandomState(r).randn(n).astype(np.float64) * 1e-3
                    for r in range(world.size)) / world.size
        buf = x.copy()
        ring.allreduce(buf, 1.0 / world.size, tag=n % 7)
        assert not np.any(buf.view(np.uint32) & 0xFFFF)     # bfloat16 values: what crossed the wire
        # each partial sum is rounded once on the wire (8 bits of mantissa), the sums are float32
        np.testing.assert_allclose(buf, exact, rtol=0, atol=world.size * 2 ** -8 * np.abs(x).max(initial=0) + 1e-12)
        copies = world.comm.allgather(buf.tobytes())
        assert all(c == copies[0] for c in copies)           # the same bits on every rank
    print(f"ok {world.rank}")
    mpi.finish()
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_ring_bfloat16_wire_sums_in_float32(tmp_path, ranks):
    out = mpirun(ranks, RING_BF16, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ok") == ranks


def test_bfloat16_rounds_to_nearest():
    """The wire's kernels (cext/parallel.pyx) against their NumPy references, and the
    references against rounding to 8 significant bits."""
    import numpy as np

    from caffepy.kernels import parallel as k
    from caffepy.kernels.reference import parallel as ref
    x = np.array([1.0, 1 + 2 ** -8, 1 + 2 ** -9, 1 + 3 * 2 ** -9, -(1 + 3 * 2 ** -9), 0.1, -7e-5,
                  0.0, -0.0, np.inf, np.finfo(np.float32).max], np.float32)
    bits = ref.to_bf16(x)
    back = ref.from_bf16(bits)
    # half way rounds away from zero (1 + 2^-8 -> 1 + 2^-7)
    m, e = np.frexp(x[:7].astype(np.float64))
    np.testing.assert_array_equal(back[:7], np.ldexp(np.sign(m) * np.floor(np.abs(m) * 256 + 0.5) / 256, e))
    # signed zeros kept; the largest float32 is past bfloat16's largest: inf
    assert back[7:].tolist() == [0.0, 0.0, np.inf, np.inf] and np.signbit(back[8])
    assert ref.add_bf16(np.ones(3, np.float32), bits[:3], 0.5, True).tolist() == [1.0, 1 + 2 ** -7, 1.0]

    r = np.random.RandomState(0)
    x = np.concatenate([x, (r.randn(1000) * 10.0 ** r.randint(-30, 30, 1000)).astype(np.float32)])
    got = np.empty(x.size, np.uint16)
    k.to_bf16(x, got)
    np.testing.assert_array_equal(got, ref.to_bf16(x))
    up = np.empty(x.size, np.float32)
    k.from_bf16(got, up)
    np.testing.assert_array_equal(up, ref.from_bf16(got))
    base = (r.randn(x.size) * 1e-3).astype(np.float32)
    for scale, rounded in ((1.0, False), (0.25, False), (1 / 3, True)):
        out = base.copy()
        k.add_bf16(out, got, scale, rounded)
        np.testing.assert_array_equal(out, ref.add_bf16(base, got, scale, rounded))


def test_ring_waits_without_spinning(tmp_path):
    """A rank far ahead of the other waits for it on sleeps, not on a core."""
    out = mpirun(2, """
        import time
        import numpy as np
        from caffepy.parallel import mpi, world
        from caffepy.parallel.ring import Ring
        mpi.init_world()
        ring = Ring(world.comm.Dup(), piece_floats=1 << 18)
        buf = np.ones(1 << 20, np.float32)
        ring.allreduce(buf, None)
        if world.rank == 1:
            time.sleep(2.0)
        cpu, wall = time.process_time(), time.perf_counter()
        ring.allreduce(buf, None)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        assert np.all(buf == 4)
        if world.rank == 0:
            print(f"waited {wall:.2f} s using {cpu:.2f} s of CPU")
            assert wall > 1.5 and cpu < 0.25 * wall      # MPI's blocking wait would be about 1.0
        mpi.finish()
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "waited" in out.stdout


def test_urgent_bucket_overtakes_and_late_ranks_do_not_hang(tmp_path):
    """The comm thread serves the bucket the next forward needs first (the lowest layer)
    between two pieces of a big one; a rank that queues it later than the other stalls
    the big one for a moment, never for good."""
    out = mpirun(2, """
        import time
        import numpy as np
        from caffepy.blob import Blob
        from caffepy.parallel import mpi, world
        from caffepy.parallel.allreduce import GradientReducer
        from caffepy.parallel.ring import Link
        mpi.init_world()
        Link.piece_bytes = lambda self: 64 << 10
        big, small = Blob((8 << 20,), name="big"), Blob((1000,), name="small")
        reducer = GradientReducer(world.comm, [(big, 5), (small, 0)], bucket_bytes=4096,
                                  progress="thread", algorithm="ring")
        for it in range(3):
            big.diff[...] = world.rank + it
            small.diff[...] = 10 * world.rank + it
            reducer.layer_done(5)                        # the big one starts
            if world.rank == 1 and it == 1:
                time.sleep(0.5)                          # queues the urgent one late
            reducer.issue_all()
            reducer.wait([small])
            overtook = not reducer.buckets[0].done.is_set()
            reducer.wait([big])
            assert np.all(small.diff == 5 + it) and np.all(big.diff == 0.5 + it)
            print(f"rank {world.rank} iteration {it} overtook {overtook}")
        reducer.close()
        mpi.finish()
    """, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("overtook") == 6
    assert "rank 0 iteration 0 overtook True" in out.stdout


def test_blob_place_diff_keeps_values():
    import numpy as np

    from caffepy.blob import Blob
    from caffepy.errors import ShapeError
    blob = Blob((2, 3))
    blob.diff[...] = np.arange(6).reshape(2, 3)
    home = np.full(6, -1, np.float32)
    blob.place_diff(home)
    np.testing.assert_array_equal(home, np.arange(6))
    blob.diff[1, 2] = 42                      # writes land in the placed buffer
    assert home[5] == 42
    blob.reshape(3, 2)                        # same count: still there
    assert np.shares_memory(blob.diff, home)
    with pytest.raises(ShapeError, match="cannot place a diff of 6 float32 values in 5"):
        blob.place_diff(np.zeros(5, np.float32))


FAILING = """
    import sys, time
    from caffepy.parallel import mpi, world
    from caffepy.errors import SolverError
    mpi.init_world()
    if world.rank == 1:
        time.sleep(0.5)
        if sys.argv[1] == "bug":
            {}["missing"]
        elif sys.argv[1] == "thread":
            import threading
            threading.Thread(target=lambda: 1 / 0).start()
            time.sleep(60)
        elif sys.argv[1] == "error":
            raise SolverError("solver.prototxt: base_lr: must be positive, got -1")
        else:
            print("caffepy: error: [rank 1] something", file=sys.stderr)
            sys.exit(1)
    world.comm.Barrier()           # rank 0 would wait here forever
    mpi.finish()
"""


@pytest.mark.parametrize("how,cause", [
    ("bug", "[rank 1] uncaught KeyError: 'missing'; aborting all 2 ranks"),
    ("thread", "[rank 1] uncaught ZeroDivisionError: division by zero; aborting all 2 ranks"),
    ("error", "[rank 1] uncaught solver.prototxt: base_lr: must be positive, got -1; aborting all 2 ranks"),
    ("exit", "[rank 1] exited before training finished; aborting all 2 ranks"),
])
def test_failing_rank_ends_every_rank(tmp_path, how, cause):
    start = time.monotonic()
    out = mpirun(2, FAILING, tmp_path, how, timeout=60)
    assert time.monotonic() - start < 30
    assert out.returncode != 0
    assert cause in out.stderr
    if how in ("bug", "thread"):
        assert "Traceback" in out.stderr          # a bug keeps its traceback
    else:
        assert "Traceback" not in out.stderr


def _spinning_job(tmp_path):
    script = tmp_path / "spin.py"
    script.write_text(textwrap.dedent("""
        import os, time
        from caffepy.parallel import mpi, world
        mpi.init_world()
        with open(os.path.join(os.path.dirname(__file__), f"pid{world.rank}"), "w") as f:
            f.write(str(os.getpid()))
        world.comm.Barrier()
        while True:                 # stands for training: collectives every step
            world.comm.Barrier()
            time.sleep(0.01)
    """))
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, str(script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "pid1").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    return proc


def test_killed_rank_ends_every_rank(tmp_path):
    proc = _spinning_job(tmp_path)
    try:
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        start = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < 30
        assert proc.returncode != 0
        pids = [(tmp_path / f"pid{rank}").read_text() for rank in (0, 1)]
        # hydra names a pid that ended badly: mostly the killed one, but it may name rank 0,
        # which it killed itself on the way out (seen once in CI on a loaded machine); rank
        # 0's start-up line maps either to its rank
        named = [rank for rank, pid in enumerate(pids) if f"PID {pid} RUNNING" in out + err]
        assert named, out + err
        assert f"0=pid {pids[0]}@" in err and f"1=pid {pids[1]}@" in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_names_the_cause(tmp_path):
    proc = _spinning_job(tmp_path)
    try:
        os.kill(int((tmp_path / "pid0").read_text()), signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "[rank 0] stopped by the MPI launcher (SIGTERM): another rank failed or the job " \
           "was cancelled" in err, err


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "PMI_SIZE"])
def test_foreign_launcher_is_refused(tmp_path, var):
    """A launcher says 4 processes, MPI (another MPI's launcher: no PMI for ours) says 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "SLURM_"))}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env[var] = "4"
    out = subprocess.run([sys.executable, "-m", "caffepy.cli", "train", "--solver", "none.prototxt"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"caffepy: error: {var}=4: the launcher started 4 processes but MPI sees this "
                           f"one alone: mpi4py uses MPICH"), line
    assert "Launch with the mpiexec of the MPI mpi4py was built for" in line
    assert "rebuild mpi4py against the cluster's MPI" in line
    assert "Traceback" not in out.stderr


def test_thread_level_below_multiple(tmp_path):
    """MPI grants less than MPI_THREAD_MULTIPLE: no communication thread by default (blocking),
    an explicit request for it refused, no stall watchdog; each said in one line."""
    out = mpirun(2, """
        import sys
        import mpi4py
        mpi4py.rc.thread_level = "funneled"
        from mpi4py import MPI                    # started before caffepy asks for more
        from caffepy.errors import ParallelError
        from caffepy.parallel import allreduce, mpi, watchdog, world
        mpi.init_world(stall_timeout=30)
        assert watchdog._current is None
        assert allreduce.GradientReducer(world.comm, []).progress == "blocking"
        try:
            allreduce.GradientReducer(world.comm, [], progress="thread")
        except ParallelError as e:
            sys.stdout.write(f"refused: {e}\\n")      # one write: the ranks' lines do not interleave
            sys.stdout.flush()
        mpi.finish()
    """, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("refused: CAFFEPY_MPI_PROGRESS: 'thread' needs MPI_THREAD_MULTIPLE, MPI "
                            "granted level 1. Use blocking, test or wait") == 2, out.stdout
    assert "MPI granted thread level MPI_THREAD_FUNNELED, not MPI_THREAD_MULTIPLE: gradients are " \
           "reduced without a thread (blocking)" in out.stderr
    assert "--stall_timeout: MPI granted thread level 1, not MPI_THREAD_MULTIPLE; stalled ranks are " \
           "not detected" in out.stderr


def test_unknown_algorithm_or_progress_is_refused(monkeypatch):
    from caffepy.errors import ParallelError
    from caffepy.parallel import allreduce
    monkeypatch.setenv("CAFFEPY_MPI_ALLREDUCE", "nccl")
    with pytest.raises(ParallelError, match="CAFFEPY_MPI_ALLREDUCE: unknown value, got 'nccl'. "
                                            "Use one of shm, ring, mpi"):
        allreduce.default_algorithm()
    monkeypatch.setenv("CAFFEPY_MPI_PROGRESS", "spin")
    with pytest.raises(ParallelError, match="CAFFEPY_MPI_PROGRESS: unknown value, got 'spin'"):
        allreduce.default_progress()
