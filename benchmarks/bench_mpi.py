"""Multi-rank AlexNet benchmark (`make bench-mpi`).

On this machine, at one fixed global batch of AlexNet (DummyData, the TRAIN
net of models/mpi_intel_alexnet/train_val_shared_db.prototxt):
  1. 1 rank x 2 threads (OMP_NUM_THREADS=2), batch G;
  2. 2 ranks x 1 thread (mpiexec -n 2, OMP_NUM_THREADS=1), local batch G/2, once per
     gradient-reduction progress mode: `none` (no communication: compute only),
     `blocking` (no overlap), `thread`, `test`, `wait` (overlapped, allreduce.py), with
     the default algorithm and, as `mode:mpi`, with MPI Allreduce; wall time and CPU
     time (the process's, all threads) per iteration; then the reduction alone, and
     the hybrid layout (train_val.prototxt, fc6..fc8 model parallel);
  3. the MPI allreduce bandwidth of AlexNet's gradients (all its ~61M parameters) and
     the latency of an 8-byte allreduce, 2 ranks.
From the measured figures: the communication cost per iteration, t_blocking - t_none
(ms) and cpu_mode - cpu_none (CPU work per rank), and the fraction of it hidden behind
backward
    hidden = 1 - (t_mode - t_none) / (t_blocking - t_none)
(a figure outside 0..100% contradicts itself: it is printed as noise, not as a result).
No projection to more nodes: these ranks talk through shared memory, whose cost says
nothing about a network; `make bench-multihost` (bench_multihost.py --validate) measures
across emulated hosts, checks the scaling model against them and only then projects.

    python benchmarks/bench_mpi.py [--batch 16] [--iters 2] [--rounds 2] [--warmup 1]
    python benchmarks/bench_mpi.py --options [--iters 5] [--rounds 2]

`--options` times only one reduction of AlexNet's gradients on 2 ranks, once per
option: MPI calls (in/out of place, reduce-scatter + allgather, Iallreduce, slices),
MPICH control variables, and caffepy's reducer with each algorithm.

Figures are the fastest iteration of each configuration (configurations are
interleaved over rounds), so that other jobs on a shared machine disturb them least.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NET = os.path.join(REPO, "models", "mpi_intel_alexnet", "train_val_shared_db.prototxt")
HYBRID_NET = os.path.join(REPO, "models", "mpi_intel_alexnet", "train_val.prototxt")
MODES = ("none", "blocking", "thread", "test", "wait", "blocking:mpi", "thread:mpi")


# -- worker side (one process per rank) ------------------------------------------
def dummy_net(batch, path):
    """The TRAIN net of `path` with its Data layer replaced by DummyData of local batch `batch`
    (a NetParameter)."""
    sys.path.insert(0, REPO)
    from google.protobuf import text_format

    from caffepy import upgrade
    from caffepy.net import TRAIN, filter_net, net_state

    net = filter_net(upgrade.read_net(path), net_state(TRAIN, 0, []))
    data = net.layer[0]
    assert data.type == "Data"
    data.Clear()
    text_format.Parse(f"""name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param {{ shape {{ dim: {batch} dim: 3 dim: 227 dim: 227 }} shape {{ dim: {batch} }}
          data_filler {{ type: "gaussian" std: 1 }} data_filler {{ type: "constant" value: 0 }} }}""", data)
    return net


SOLVER = dict(base_lr=1e-4, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", snapshot=0, random_seed=1,
              snapshot_after_train=False)


def build_solver(batch, path, context):
    from caffepy.proto import caffe_pb2
    from caffepy.solvers import Solver

    sp = caffe_pb2.SolverParameter(max_iter=10 ** 9, display=0, solver_mode=caffe_pb2.SolverParameter.CPU,
                                   **SOLVER)
    sp.net_param.CopyFrom(dummy_net(batch, path))
    return Solver(sp, source="bench_mpi", context=context)


def timed_steps(solver, n, reducer=None, skip=0):
    """Wall time, wait for the reduction and CPU time (all threads of this process) of each
    of n iterations run in one step(n), the first `skip` left out. Iterations are clocked
    after each update (a hook: every rank, every iteration), not per step(1): a step ends by
    applying the updates the reducer still completes, which in a longer run overlap the next
    forward."""
    from caffepy.solvers.solver import Hooks

    marks = []

    class Clock(Hooks):
        def agree_action(self, solver, request):
            marks.append((time.perf_counter(), time.process_time(),
                          reducer.wait_seconds if reducer is not None else 0.0))
            return request

    clock = Clock()
    marks.append((time.perf_counter(), time.process_time(),
                  reducer.wait_seconds if reducer is not None else 0.0))
    solver.hooks.append(clock)
    try:
        solver.step(n)
    finally:
        solver.hooks.remove(clock)
    steps = list(zip(marks[:-1], marks[1:]))[skip:]
    times = [b[0] - a[0] for a, b in steps]
    cpus = [b[1] - a[1] for a, b in steps]
    waits = [b[2] - a[2] for a, b in steps]
    return times, waits, cpus


def worker(args):
    sys.path.insert(0, REPO)
    from caffepy import log
    log.set_quiet(True)
    from caffepy.parallel import mpi, world
    mpi.init_world()
    solver = build_solver(args.batch, HYBRID_NET if args.hybrid else NET, world)
    result = {"ranks": world.size, "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
              "batch": args.batch, "params": sum(b.count for b in solver.net.learnable_params)}
    # The machine may be shared: configurations are interleaved over rounds and the
    # fastest iteration of each is kept (the least disturbed one).
    if world.size == 1:
        timed_steps(solver, args.warmup)
        times, fwd, bwd = [], [], []
        net = solver.net
        for _ in range(args.rounds):
            times += timed_steps(solver, args.iters)[0]
            t = time.perf_counter()
            net.forward_from_to()
            t1 = time.perf_counter()
            net.backward_from_to()
            fwd.append(t1 - t)
            bwd.append(time.perf_counter() - t1)
        result.update(iter=min(times), forward=min(fwd), backward=min(bwd), all=times)
    else:
        strategy = mpi.attach(solver)
        timed_steps(solver, args.warmup)          # on_start: broadcast, buckets
        modes = args.modes.split(",")
        found = {m: {"iter": [], "wait": [], "cpu": []} for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                progress, _, algorithm = mode.partition(":")
                strategy.set_progress(progress, solver, algorithm or None)
                found[mode]["algorithm"] = strategy.reducer.describe()
                times, waits, cpus = timed_steps(solver, args.iters, strategy.reducer)
                for t, w, c in zip(times, waits, cpus):
                    # an iteration ends when the slowest rank's does; CPU: the busier rank
                    found[mode]["iter"].append(world.comm.allreduce(t, op=_max()))
                    found[mode]["cpu"].append(world.comm.allreduce(c, op=_max()))
                    found[mode]["wait"].append(w)
        result["modes"] = {m: {"iter": min(r["iter"]), "wait": min(r["wait"]), "cpu": min(r["cpu"]),
                               "all": r["iter"], "algorithm": r["algorithm"]}
                           for m, r in found.items()}
        result["buckets"] = len(strategy.reducer.buckets)
        result["bytes"] = strategy.reducer.nbytes
        # the reduction alone (no backward around it), on AlexNet's buckets
        result["isolated"] = {}
        for algorithm in ("shm", "mpi"):
            strategy.set_progress("blocking", solver, algorithm)
            strategy.reducer.finish()
            walls, cpus = [], []
            for _ in range(5):
                world.comm.Barrier()
                t, c = time.perf_counter(), time.process_time()
                strategy.reducer.finish()
                walls.append(world.comm.allreduce(time.perf_counter() - t, op=_max()))
                cpus.append(world.comm.allreduce(time.process_time() - c, op=_max()))
            result["isolated"][algorithm] = {"wall": min(walls), "cpu": min(cpus),
                                             "algorithm": strategy.reducer.describe()}
        strategy.close()
    if world.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    mpi.finish()


def _max():
    from mpi4py import MPI
    return MPI.MAX


def bandwidth(args):
    sys.path.insert(0, REPO)
    from caffepy.parallel import mpi, world
    mpi.init_world()                 # before mpi4py.MPI: it starts MPI with the train command's transport
    from mpi4py import MPI
    comm = world.comm
    buf = np.ones(args.count, np.float32)
    comm.Allreduce(MPI.IN_PLACE, buf)
    times = []
    for _ in range(5):
        comm.Barrier()
        t = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        times.append(time.perf_counter() - t)
    small = np.ones(2, np.float32)
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(1000):
        comm.Allreduce(MPI.IN_PLACE, small)
    latency = (time.perf_counter() - t) / 1000
    if world.rank == 0:
        print("RESULT " + json.dumps({"seconds": min(times), "bytes": 4 * args.count,
                                      "latency": latency}), flush=True)
    mpi.finish()


def run(cmd, threads, extra_env=None):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    env.update(extra_env or {})
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
    raise SystemExit(f"bench_mpi: a run failed: {' '.join(cmd)}")


# -- the allreduce options table (--options) ---------------------------------------
# AlexNet's learnable parameters in backward order of their layers (conv1 .. fc8)
ALEXNET_SIZES = [34848, 96, 307200, 256, 884736, 384, 663552, 384, 442368, 256,
                 37748736, 4096, 16777216, 4096, 4096000, 1000]
OPTIONS = [   # (label, variant, MPICH control variables)
    ("Allreduce in place (MPICH defaults)", "inplace", {}),
    ("Allreduce out of place", "outofplace", {}),
    ("Reduce_scatter_block + Allgather", "rs_ag", {}),
    ("Iallreduce + Wait", "iallreduce", {}),
    ("Allreduce in 1 MB slices", "slices1", {}),
    ("Allreduce in 4 MB slices", "slices4", {}),
    ("Allreduce in 16 MB slices", "slices16", {}),
    ("ALLREDUCE_INTRA_ALGORITHM=recursive_doubling", "inplace",
     {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "recursive_doubling"}),
    ("ALLREDUCE_INTRA_ALGORITHM=reduce_scatter_allgather", "inplace",
     {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "reduce_scatter_allgather"}),
    ("ALLREDUCE_INTRA_ALGORITHM=k_reduce_scatter_allgather", "inplace",
     {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "k_reduce_scatter_allgather"}),
    ("ALLREDUCE_INTRA_ALGORITHM=ring", "inplace", {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}),
    ("ALLREDUCE_INTRA_ALGORITHM=tree", "inplace", {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "tree"}),
    ("ALLREDUCE_INTRA_ALGORITHM=smp", "inplace", {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "smp"}),
    ("DEVICE_COLLECTIVES=none", "inplace", {"MPIR_CVAR_DEVICE_COLLECTIVES": "none"}),
    ("ALLREDUCE_POSIX_INTRA_ALGORITHM=release_gather", "inplace",
     {"MPIR_CVAR_ALLREDUCE_POSIX_INTRA_ALGORITHM": "release_gather"}),
    ("CH4_CMA_ENABLE=0 (no single-copy CMA)", "inplace", {"MPIR_CVAR_CH4_CMA_ENABLE": "0"}),
    ("CH4_IPC_CMA_P2P_THRESHOLD=1 MB", "inplace", {"MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD": "1048576"}),
    ("GradientReducer, AlexNet buckets, algorithm mpi", "reducer:mpi", {}),
    ("GradientReducer, AlexNet buckets, algorithm shm", "reducer:shm", {}),
]


def option_worker(args):
    """One option of the table: wall and CPU seconds of one reduction of AlexNet's gradients."""
    sys.path.insert(0, REPO)
    from caffepy.parallel import mpi, world
    mpi.init_world()                 # before mpi4py.MPI: it starts MPI with the train command's transport
    from mpi4py import MPI
    comm, variant = world.comm, args.option
    n = sum(ALEXNET_SIZES)
    buf = np.random.default_rng(world.rank).random(n, dtype=np.float32)
    out = np.empty_like(buf)
    if variant.startswith("reducer:"):
        from caffepy.blob import Blob
        from caffepy.parallel.allreduce import GradientReducer
        blobs = [Blob((k,)) for k in ALEXNET_SIZES]
        for b in blobs:
            b.diff[...] = 1
        reducer = GradientReducer(comm, [(b, i // 2) for i, b in enumerate(blobs)],
                                  progress="blocking", algorithm=variant[8:])

    def once():
        if variant == "inplace":
            comm.Allreduce(MPI.IN_PLACE, buf)
        elif variant == "outofplace":
            comm.Allreduce(buf, out)
        elif variant == "rs_ag":
            m = n // world.size * world.size
            comm.Reduce_scatter_block(MPI.IN_PLACE, buf[:m])
            comm.Allgather(MPI.IN_PLACE, buf[:m])
        elif variant == "iallreduce":
            comm.Iallreduce(MPI.IN_PLACE, buf).Wait()
        elif variant.startswith("slices"):
            step = (int(variant[6:]) << 20) // 4
            for s in range(0, n, step):
                comm.Allreduce(MPI.IN_PLACE, buf[s:s + step])
        else:
            reducer.finish()

    once()
    walls, cpus = [], []
    for _ in range(args.iters):
        comm.Barrier()
        t, c = time.perf_counter(), time.process_time()
        once()
        walls.append(comm.allreduce(time.perf_counter() - t, op=_max()))
        cpus.append(comm.allreduce(time.process_time() - c, op=_max()))
    if world.rank == 0:
        print("RESULT " + json.dumps({"wall": min(walls), "cpu": min(cpus), "bytes": 4 * n}), flush=True)
    mpi.finish()


def options_table(args):
    py = sys.executable
    mpiexec = os.path.join(os.path.dirname(py), "mpiexec")
    me = os.path.abspath(__file__)
    print(f"One reduction of AlexNet's {4 * sum(ALEXNET_SIZES) / 1e6:.1f} MB of gradients on 2 ranks "
          f"(1 thread each); fastest of {args.rounds} x {args.iters}, options interleaved; "
          f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    found = {label: [] for label, _, _ in OPTIONS}
    for _ in range(args.rounds):
        for label, variant, cvars in OPTIONS:
            try:
                r = run([mpiexec, "-n", "2", py, me, "--option", variant, "--iters", str(args.iters)],
                        1, cvars)
            except SystemExit:
                continue                  # an option this MPICH build refuses: left out
            found[label].append(r)
    print(f"  {'option':55s} {'wall ms':>8s} {'CPU ms/rank':>12s}")
    for label, _, _ in OPTIONS:
        if not found[label]:
            print(f"  {label:55s} {'failed':>8s}")
            continue
        wall = min(r["wall"] for r in found[label])
        cpu = min(r["cpu"] for r in found[label])
        print(f"  {label:55s} {wall * 1e3:8.1f} {cpu * 1e3:12.1f}")


# -- driver ----------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="global batch (even)")
    ap.add_argument("--iters", type=int, default=2, help="timed iterations per configuration and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the configurations")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hybrid", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--options", action="store_true",
                    help="only the table of allreduce options (MPI calls, MPICH variables, algorithms)")
    ap.add_argument("--option", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.option:
        return option_worker(args)
    if args.options:
        if "--iters" not in sys.argv:
            args.iters = 5
        return options_table(args)
    if args.worker:
        return worker(args)
    if args.bandwidth:
        return bandwidth(args)

    py = sys.executable
    mpiexec = os.path.join(os.path.dirname(py), "mpiexec")
    me = os.path.abspath(__file__)
    common = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    print(f"AlexNet, DummyData, global batch {args.batch}; fastest of {args.rounds} x {args.iters} "
          f"iterations per configuration; load average before: "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    one = run([py, me, "--worker", "--batch", str(args.batch)] + common, 2)
    print(f"1 rank x 2 threads, batch {args.batch}: {one['iter']:.3f} s/iter "
          f"({args.batch / one['iter']:.2f} img/s); forward {one['forward']:.3f} s, "
          f"backward {one['backward']:.3f} s", flush=True)
    two = run([mpiexec, "-n", "2", py, me, "--worker", "--batch", str(args.batch // 2),
               "--modes", args.modes] + common, 1)
    modes = two["modes"]
    print(f"2 ranks x 1 thread, local batch {args.batch // 2}, {two['bytes'] / 1e6:.1f} MB of gradients "
          f"in {two['buckets']} buckets:")
    for mode, r in modes.items():
        print(f"  {mode:13s} {r['iter']:.3f} s/iter ({args.batch / r['iter']:.2f} img/s), CPU "
              f"{r['cpu']:.3f} s/iter per rank, waiting before the update {r['wait'] * 1e3:6.1f} ms"
              f"  [{r['algorithm']}]")
    hyb = run([mpiexec, "-n", "2", py, me, "--worker", "--hybrid", "--batch", str(args.batch // 2),
               "--modes", "thread"] + common, 1)
    print(f"2 ranks x 1 thread, hybrid (train_val.prototxt: fc6..fc8 model parallel), local batch "
          f"{args.batch // 2}: {hyb['modes']['thread']['iter']:.3f} s/iter "
          f"({args.batch / hyb['modes']['thread']['iter']:.2f} img/s), {hyb['bytes'] / 1e6:.1f} MB "
          f"allreduced, waiting {hyb['modes']['thread']['wait'] * 1e3:.1f} ms", flush=True)
    bw = run([mpiexec, "-n", "2", py, me, "--bandwidth", "--count", str(two["bytes"] // 4)], 1)
    rate = bw["bytes"] / bw["seconds"]
    print(f"Allreduce of {bw['bytes'] / 1e6:.1f} MB on 2 ranks: {bw['seconds'] * 1e3:.1f} ms = "
          f"{rate / 1e9:.2f} GB/s algorithm bandwidth ({rate / 1e9:.2f} GB/s bus bandwidth at N=2); "
          f"8-byte allreduce latency {bw['latency'] * 1e6:.1f} us")

    for algorithm, r in two["isolated"].items():
        print(f"The reduction alone (finish() of a blocking reducer, AlexNet's buckets), {algorithm}: "
              f"{r['wall'] * 1e3:.1f} ms, CPU {r['cpu'] * 1e3:.1f} ms per rank  [{r['algorithm']}]")

    # How much of the communication the overlap hides, by iteration time:
    #   hidden = 1 - (t_mode - t_none) / (t_blocking - t_none), the real cost, readable only
    #     when that cost stands above the run-to-run noise;
    # by waiting time: 1 - wait_mode / wait_blocking, the part of the reduction the main thread
    #   no longer waits for before the update (ignores the CPU the overlap takes from compute);
    # and the CPU work per iteration each configuration adds to the compute-only run (per rank).
    if "none" in modes:
        t_none, c_none = modes["none"]["iter"], modes["none"]["cpu"]
        spread = max(max(r["all"]) - min(r["all"]) for r in modes.values())
        print(f"Communication cost per iteration against `none` (iteration-time spread within a "
              f"configuration up to {spread * 1e3:.0f} ms):")
        for suffix in ("", ":mpi"):
            block = modes.get("blocking" + suffix)
            if block is None:
                continue
            comm_cost = block["iter"] - t_none
            readable = comm_cost > 0.5 * spread and comm_cost > 0
            name = block["algorithm"].split(" ")[0]
            print(f"  {name}: blocking {comm_cost * 1e3:6.1f} ms/iter, CPU work "
                  f"{(block['cpu'] - c_none) * 1e3:6.1f} ms/iter per rank"
                  + ("" if readable else "  (below the noise: hidden fraction by waiting time)"))
            for mode in ("thread", "test", "wait"):
                r = modes.get(mode + suffix)
                if r is None:
                    continue
                by_wait = 1 - r["wait"] / max(block["wait"], 1e-9)
                by_iter = 1 - (r["iter"] - t_none) / comm_cost if readable else None
                if by_iter is not None and not 0 <= by_iter <= 1:
                    # a negative cost or more than all of it hidden: the run's noise, not a result
                    by_iter, shown = None, "  noise"
                else:
                    shown = f"{by_iter * 100:6.1f}%" if by_iter is not None else "   n/a "
                print(f"    {mode:6s} {(r['iter'] - t_none) * 1e3:6.1f} ms/iter, CPU work "
                      f"{(r['cpu'] - c_none) * 1e3:6.1f} ms/iter per rank; hidden {shown} by "
                      f"iteration time, {by_wait * 100:5.1f}% of the wait before the update")
    overlapped = {m: r for m, r in modes.items() if m.split(":")[0] in ("thread", "test", "wait")}
    if overlapped:
        best = min(overlapped, key=lambda m: overlapped[m]["iter"])
        ratio = one["iter"] / overlapped[best]["iter"]
        print(f"2 x 1-thread ranks ({best}) vs 1 x 2-thread rank throughput: {ratio * 100:.1f}% "
              f"(target >= 90%)")
    print("No projection from these figures (shared memory, one host): `make bench-multihost` "
          "checks the scaling model across emulated hosts, then projects")

if __name__ == "__main__":
    main()
