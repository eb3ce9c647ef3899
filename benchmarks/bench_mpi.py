"""Multi-rank AlexNet benchmark (`make bench-mpi`).

On this machine, at one fixed global batch of AlexNet (DummyData, the TRAIN
net of models/mpi_intel_alexnet/train_val_shared_db.prototxt):
  1. 1 rank x 2 threads (OMP_NUM_THREADS=2), batch G;
  2. 2 ranks x 1 thread (mpiexec -n 2, OMP_NUM_THREADS=1), local batch G/2, once per
     gradient-allreduce progress mode: `none` (no communication: compute only),
     `blocking` (no overlap), `thread`, `test`, `wait` (overlapped, allreduce.py),
     and the hybrid layout (train_val.prototxt, fc6..fc8 model parallel);
  3. the allreduce bandwidth of AlexNet's gradients (all its ~61M parameters) and
     the latency of an 8-byte allreduce, 2 ranks.
From the measured figures: the fraction of the allreduce hidden behind backward
    hidden = 1 - (t_mode - t_none) / (t_blocking - t_none)
and, with a ring allreduce cost model over a network of stated bandwidth
    t_comm(N) = 2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency
    t_iter(N) = t_compute + max((1 - hidden) * t_comm(N), t_comm(N) - t_backward)
the projected time per iteration and scaling efficiency t_compute / t_iter(N)
for 1 to 64 nodes, each node running this machine's 1 x 2-thread iteration at
local batch G (weak scaling, Intel Caffe's convention: batch_size is per node).

    python benchmarks/bench_mpi.py [--batch 16] [--iters 2] [--rounds 2] [--warmup 1]

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
MODES = ("none", "blocking", "thread", "test", "wait")
NETWORKS_GBPS = (10, 100)
LATENCY_S = 5e-6           # per ring step, a typical TCP/RoCE small-message figure
NODES = (1, 2, 4, 8, 16, 32, 64)


# -- worker side (one process per rank) ------------------------------------------
def build_solver(batch, path=NET):
    sys.path.insert(0, REPO)
    from google.protobuf import text_format

    from caffepy import prototxt
    from caffepy.net import TRAIN
    from caffepy.proto import caffe_pb2
    from caffepy.solvers import Solver

    net = prototxt.filter_net(prototxt.read_net(path), prototxt.net_state(TRAIN, 0, []))
    data = net.layer[0]
    assert data.type == "Data"
    data.Clear()
    text_format.Parse(f"""name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param {{ shape {{ dim: {batch} dim: 3 dim: 227 dim: 227 }} shape {{ dim: {batch} }}
          data_filler {{ type: "gaussian" std: 1 }} data_filler {{ type: "constant" value: 0 }} }}""", data)
    sp = caffe_pb2.SolverParameter(base_lr=1e-4, momentum=0.9, weight_decay=5e-4, lr_policy="fixed",
                                   max_iter=10 ** 9, display=0, snapshot=0, random_seed=1,
                                   snapshot_after_train=False, solver_mode=caffe_pb2.SolverParameter.CPU)
    sp.net_param.CopyFrom(net)
    return Solver(sp, source="bench_mpi")


def timed_steps(solver, n, reducer=None):
    times, waits = [], []
    for _ in range(n):
        t = time.perf_counter()
        solver.step(1)
        times.append(time.perf_counter() - t)
        if reducer is not None:
            waits.append(reducer.wait_seconds)
    return times, waits


def worker(args):
    sys.path.insert(0, REPO)
    from caffepy import log
    log.set_quiet(True)
    from caffepy.parallel import mpi, world
    mpi.init_world()
    solver = build_solver(args.batch, HYBRID_NET if args.hybrid else NET)
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
        found = {m: {"iter": [], "wait": []} for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                strategy.set_progress(mode, solver)
                times, waits = timed_steps(solver, args.iters, strategy.reducer)
                for t, w in zip(times, waits):
                    # an iteration ends when the slowest rank's does
                    found[mode]["iter"].append(world.comm.allreduce(t, op=_max()))
                    found[mode]["wait"].append(w)
        result["modes"] = {m: {"iter": min(r["iter"]), "wait": min(r["wait"]), "all": r["iter"]}
                           for m, r in found.items()}
        result["buckets"] = len(strategy.reducer.buckets)
        result["bytes"] = strategy.reducer.nbytes
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
    from mpi4py import MPI
    mpi.init_world()
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


# -- driver ----------------------------------------------------------------------
def run(cmd, threads):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
    raise SystemExit(f"bench_mpi: a run failed: {' '.join(cmd)}")


def project(t_compute, t_backward, hidden, nbytes, gbps, nodes):
    bw = gbps * 1e9 / 8
    if nodes == 1:
        return t_compute
    t_comm = 2 * (nodes - 1) / nodes * nbytes / bw + 2 * (nodes - 1) * LATENCY_S
    exposed = max((1 - hidden) * t_comm, t_comm - t_backward)
    return t_compute + exposed


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
    args = ap.parse_args()
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
        print(f"  {mode:9s} {r['iter']:.3f} s/iter ({args.batch / r['iter']:.2f} img/s), "
              f"waiting for the allreduce before the update {r['wait'] * 1e3:.1f} ms")
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

    # Two measures of how much of the allreduce the overlap hides:
    #   by iteration time: 1 - (t_mode - t_none) / (t_blocking - t_none), the real cost, but
    #     only readable when that cost stands above the run-to-run noise;
    #   by waiting time: 1 - wait_mode / wait_blocking, the part of the allreduce the main
    #     thread no longer waits for before the update (ignores CPU the overlap steals).
    hidden, basis = {}, {}
    if "none" in modes and "blocking" in modes:
        t_none, t_block = modes["none"]["iter"], modes["blocking"]["iter"]
        comm_cost = t_block - t_none
        spread = max(max(r["all"]) - min(r["all"]) for r in modes.values())
        readable = comm_cost > 0.5 * spread and comm_cost > 0
        print(f"Communication cost without overlap (blocking - none): {comm_cost * 1e3:.1f} ms/iter; "
              f"iteration-time spread within a configuration up to {spread * 1e3:.0f} ms"
              + ("" if readable else " (the cost is below the noise: hidden fraction by waiting time)"))
        for mode in ("thread", "test", "wait"):
            if mode not in modes:
                continue
            by_wait = 1 - modes[mode]["wait"] / max(modes["blocking"]["wait"], 1e-9)
            by_iter = 1 - (modes[mode]["iter"] - t_none) / comm_cost if readable else None
            hidden[mode] = by_iter if readable else by_wait
            basis[mode] = "iteration time" if readable else "waiting time"
            shown = f"{by_iter * 100:5.1f}%" if readable else "  n/a "
            print(f"  hidden by {mode:6s}: {shown} of the iteration-time cost, "
                  f"{by_wait * 100:5.1f}% of the wait before the update")
    overlapped = {m: r for m, r in modes.items() if m in ("thread", "test", "wait")}
    if overlapped:
        best = min(overlapped, key=lambda m: overlapped[m]["iter"])
        ratio = one["iter"] / overlapped[best]["iter"]
        print(f"2 x 1-thread ranks ({best}) vs 1 x 2-thread rank throughput: {ratio * 100:.1f}% "
              f"(target >= 90%)")
        default = "thread"
        h = min(1.0, max(0.0, hidden.get(default, 0.0)))
        print(f"\nProjection (ring allreduce, {LATENCY_S * 1e6:.0f} us/step latency, hidden fraction "
              f"{h * 100:.0f}% ({default}, by {basis.get(default, '-')}) capped by backward "
              f"{one['backward']:.2f} s; each node = this machine, "
              f"local batch {args.batch}, {one['iter']:.2f} s/iter compute):")
        print("  nodes " + "".join(f"{f'{g} Gb/s s/iter':>17s}{'eff':>7s}" for g in NETWORKS_GBPS))
        for n in NODES:
            row = f"  {n:5d} "
            for g in NETWORKS_GBPS:
                t = project(one["iter"], one["backward"], h, two["bytes"], g, n)
                row += f"{t:17.3f}{one['iter'] / t * 100:6.1f}%"
            print(row)
        print("  (measured on this machine: comm on shared memory at "
              f"{rate / 1e9:.2f} GB/s, i.e. {rate * 8 / 1e9:.0f} Gb/s)")


if __name__ == "__main__":
    main()
