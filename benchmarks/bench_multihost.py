"""Training across emulated hosts: how much of the gradient allreduce hides, and the scaling
model checked against it (`make bench-multihost`).

K emulated hosts (tests/multihost/testbed.py: network namespaces, links shaped with tc
tbf), one rank each, one thread each (OMP_NUM_THREADS=1), MPI over TCP. AlexNet
(models/mpi_intel_alexnet/train_val_shared_db.prototxt, data parallel) with DummyData at
a local batch chosen so that one iteration takes about --target seconds.

First the command users run (--view cli): `mpiexec ... caffepy train --solver s.prototxt`
(display every --display iterations), once with CAFFEPY_MPI_PROGRESS=none (no
communication) and once as is (the default progress), rounds interleaved, each
iteration's time read from the display lines; and one MPI Allreduce of the gradients'
bytes between the hosts. hidden = 1 - (t_default - t_none) / t_allreduce. With
--per-host 1,2 also 2 ranks per host (each at half the local batch): the default
(shared memory within a host, then a ring of one rank per host) against the flat ring
over every rank; with --wire also the bfloat16 wire (CAFFEPY_MPI_WIRE_TYPE=bfloat16).

Then the harness (--view harness: solver.step in-process, one process per rank through
every mode), which also feeds the scaling model. Prints:

  link        latency and bandwidth from each rank to the next (ring.Link, as the reducer
              measures it), and the ring's CPU cost per byte sent
  t_allreduce one MPI Allreduce of all the gradients over the link, and its CPU seconds
              (process time of the rank: MPICH polls while it waits); the same bytes over
              caffepy's ring, and its CPU seconds
  t_1rank     one iteration without communication (progress `none`, the ranks side by
              side: the same cores and memory busy as in the real runs)
  t_Nranks    one iteration per mode (`blocking`, `thread` = the default, `thread:mpi` =
              MPI Allreduce in the thread, as before the ring), its CPU seconds, and
              hidden = 1 - (t_Nranks - t_1rank) / t_allreduce
  model       scaling_model.py's iteration time from the measured layer times, link and
              CPU cost, beside the measured one (it must be within 15%)
and with --hybrid the hybrid layout (fc6..fc8 model parallel): its iteration with and
without communication, and the bytes its activation exchanges move.

Iterations are clocked inside one step(n) per mode (after --warmup untimed ones), modes
interleaved over --rounds; figures are medians; an iteration ends when the slowest
rank's does. A figure that contradicts itself (a negative cost, more than 100% hidden)
is flagged as noise, never printed as a result. `blocking` hides nothing by
construction: its figure is the run's error bar.

    python benchmarks/bench_multihost.py [--hosts 2] [--rate 500mbit] [--batch N | --target 5]
    python benchmarks/bench_multihost.py --view cli --batch 256 --display 20 --iters 2  # the CLI alone
    python benchmarks/bench_multihost.py --view cli --batch 256 --per-host 1,2 --wire   # layouts, wire
    python benchmarks/bench_multihost.py --validate --save m.json   # 2 then 4 hosts, the projection
    python benchmarks/bench_multihost.py --load m.json   # the report again from saved measurements
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
MODES = ("none", "blocking", "thread", "thread:mpi")
TOLERANCE = 0.15          # the model's predictions must be within 15% of the measurements


# -- worker side (one process per rank, inside the emulated hosts) ----------------
def _time(fn):
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def calibrate(args):
    """One rank alone: seconds per iteration at --batch (after one warm-up)."""
    from bench_mpi import NET, build_solver, timed_steps

    from caffepy import log
    from caffepy.context import SINGLE
    log.set_quiet(True)
    solver = build_solver(args.batch, NET, SINGLE)
    times = timed_steps(solver, 1 + args.iters, skip=1)[0]
    print("RESULT " + json.dumps({"iter": statistics.median(times), "all": times}), flush=True)


def layer_times(net, reps=2):
    """Seconds of each layer's forward and backward (the fastest of `reps`)."""
    n = len(net.layers)
    fwd, bwd = [float("inf")] * n, [float("inf")] * n
    for _ in range(reps):
        for li in range(n):
            t = time.perf_counter()
            net.forward_from_to(li, li)
            fwd[li] = min(fwd[li], time.perf_counter() - t)
        for li in range(n - 1, -1, -1):
            t = time.perf_counter()
            net.backward_from_to(li, li)
            bwd[li] = min(bwd[li], time.perf_counter() - t)
    return fwd, bwd


def worker(args):
    from bench_mpi import HYBRID_NET, NET, build_solver, timed_steps

    from caffepy import log
    log.set_quiet(True)
    from caffepy.parallel import mpi, world
    # MPI started the way `caffepy train` starts it (mpi.TRANSPORT_DEFAULTS): importing
    # mpi4py.MPI first started it with UCX's own 64 KB receive segments, so until now this
    # harness timed another transport than the command it stands for
    mpi.init_world(stall_timeout=0)
    from mpi4py import MPI

    from caffepy.parallel.ring import Link, Ring
    comm = world.comm
    result = {"hosts": comm.allgather(os.uname().nodename), "cores": os.cpu_count()}
    link = Link.measure(comm, probe_bytes=32 << 20)
    result["latency"], result["bandwidth"] = link.latency, link.bandwidth

    solver = build_solver(args.batch, HYBRID_NET if args.hybrid else NET, world)
    strategy = mpi.attach(solver)
    timed_steps(solver, 1)                          # on_start: broadcast, buckets
    reducer = strategy.reducer
    result["buckets"] = [(4 * b.count, b.ready_layer) for b in reducer.buckets]
    nbytes = reducer.nbytes
    result["bytes"] = nbytes

    def slowest(x):
        return comm.allreduce(x, op=MPI.MAX)

    if not args.hybrid:
        # the compute, ranks side by side: each layer's time, for the model
        fwd, bwd = layer_times(solver.net)
        result["forward"] = [slowest(x) for x in fwd]
        result["backward"] = [slowest(x) for x in bwd]
        # one MPI Allreduce of all the gradients (the figure the overlap must hide), then the
        # same bytes over the ring (its CPU per byte sent goes into the model)
        grads = np.ones(nbytes // 4, np.float32)
        ring = Ring(comm.Dup(), link.piece_bytes() // 4, link.poll_cap())
        for name, fn in (("allreduce", lambda: comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)),
                         ("ring", lambda: ring.allreduce(grads, None))):
            runs = []
            for _ in range(2):
                comm.Barrier()
                wall, cpu = _time(fn)
                runs.append((slowest(wall), slowest(cpu)))
            result[name], result[name + "_cpu"] = min(runs)
        ring.comm.Free()
        grads = None                                # 244 MB back before training resumes
        result["ring_bytes_sent"] = 2 * (world.size - 1) / world.size * nbytes

    modes = args.modes.split(",")
    found = {m: {"iter": [], "cpu": [], "wait": []} for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            progress, _, algorithm = mode.partition(":")
            strategy.set_progress(progress, solver, algorithm or None)
            found[mode]["algorithm"] = strategy.reducer.describe()
            times, waits, cpus = timed_steps(solver, args.warmup + args.iters, strategy.reducer,
                                             skip=args.warmup)
            for t, w, c in zip(times, waits, cpus):
                found[mode]["iter"].append(slowest(t))
                found[mode]["cpu"].append(slowest(c))      # CPU: the busier rank
                found[mode]["wait"].append(slowest(w))
    result["modes"] = {m: {"iter": statistics.median(r["iter"]), "cpu": statistics.median(r["cpu"]),
                           "wait": statistics.median(r["wait"]), "all": r["iter"],
                           "algorithm": r["algorithm"]} for m, r in found.items()}
    if args.hybrid:
        from caffepy.layer import MODEL_PARALLEL
        layers = [layer for layer in solver.net.layers if layer.variant == MODEL_PARALLEL]
        # per iteration: forward allgathers N*b*K inputs and alltoalls the outputs, backward
        # alltoalls the output gradients and reduce-scatters the input gradients
        per_rank = 0
        for layer in layers:
            outer = layer.outer
            per_rank += 4 * outer * (2 * (world.size - 1) * layer.K + 2 * (world.size - 1) * layer.m)
        result["mp_layers"] = [layer.name for layer in layers]
        result["activation_bytes"] = per_rank
        # wall time inside the exchanges per iteration (every iteration run, warm-ups too),
        # the slowest rank's
        ran = 1 + args.rounds * len(modes) * (args.warmup + args.iters)
        result["exchange_seconds"] = slowest(sum(layer.exchange_seconds for layer in layers) / ran)
    strategy.close()
    if world.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    mpi.finish()


# -- the command users run ------------------------------------------------------------
# `mpiexec ... caffepy train --solver s.prototxt` across the emulated hosts, timed from its
# own display lines: the figure a user sees. `none` gives the compute-only iteration
# (CAFFEPY_MPI_PROGRESS=none), the default (no variable) the real run; one MPI Allreduce of
# the gradients' bytes between the hosts is what the overlap must hide.
_ITERATION = re.compile(r"\] Iteration (\d+) \([\d.e+-]+ iter/s, ([\d.e+-]+)s/(\d+) iters\)")
_WAITS = re.compile(r"\] Iteration \d+, \d+ ranks: .* waiting ([\d.]+)% of the time for communication, "
                    r"([\d.]+)% for other ranks")
_GRADIENTS = re.compile(r"Allreduce: ([\d.]+) MB of gradients in \d+ buckets, progress: (\w+), "
                        r"algorithm: (.*)$", re.M)


def write_cli_job(directory, batch, iters, display):
    """AlexNet with DummyData at local batch `batch` (as the harness's) and a solver running
    `iters` iterations with a display line every `display`; returns the solver's path."""
    from bench_mpi import NET, SOLVER, dummy_net
    from google.protobuf import text_format

    from caffepy.proto import caffe_pb2
    os.makedirs(directory, exist_ok=True)
    net = os.path.join(directory, "net.prototxt")
    with open(net, "w") as f:
        f.write(text_format.MessageToString(dummy_net(batch, NET)))
    solver = caffe_pb2.SolverParameter(net=net, max_iter=iters, display=display,
                                       solver_mode=caffe_pb2.SolverParameter.CPU, **SOLVER)
    path = os.path.join(directory, "solver.prototxt")
    with open(path, "w") as f:
        f.write(text_format.MessageToString(solver))
    return path


def _caffepy():
    installed = os.path.join(os.path.dirname(sys.executable), "caffepy")
    return [installed] if os.path.exists(installed) else [sys.executable, "-m", "caffepy.cli"]


def cli_max_iter(skip, timed, display):
    """The solver's max_iter for `timed` display lines after iteration `skip`: they come at
    iterations 0, display, 2 display, ... up to max_iter - 1."""
    return skip + timed * display + 1


def cli_iterations(log, skip):
    """Seconds per iteration from a train log's display lines, those up to iteration `skip`
    left out (start-up, the first buckets, the link measurement)."""
    return [float(seconds) / int(n) for it, seconds, n in _ITERATION.findall(log) if int(it) > skip]


def allreduce_worker(args):
    """One MPI Allreduce of --floats floats between the ranks, timed --iters times; prints
    the fastest (the slowest rank's time of each)."""
    from caffepy.parallel import mpi
    mpi.transport_defaults()                  # as `caffepy train` starts MPI
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    grads = np.ones(args.floats, np.float32)
    times = []
    for _ in range(args.iters):
        comm.Barrier()
        t = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
        times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"allreduce": min(times), "all": times}), flush=True)


def cli_modes(per_host, wire=False):
    """[(name, environment)] of the CLI runs: the compute-only baseline, the default, with
    several ranks per host the flat ring over every rank (no shared-memory stage), and with
    `wire` the default with bfloat16 gradients on the wire."""
    modes = [("none", {"CAFFEPY_MPI_PROGRESS": "none"}), ("default", {})]
    if per_host > 1:
        modes.append(("flat ring", {"CAFFEPY_MPI_ALLREDUCE": "ring"}))
    if wire:
        modes.append(("bfloat16", {"CAFFEPY_MPI_WIRE_TYPE": "bfloat16"}))
    return modes


def measure_cli(args, hosts, batch, me, per_host=1):
    """Run `caffepy train` per mode, modes interleaved over --rounds; returns the figures.
    With several ranks per host each rank's local batch is batch / per_host: a host does
    the same work in every layout."""
    import tempfile

    from tests.multihost.testbed import TestBed
    for var in ("CAFFEPY_MPI_PROGRESS", "CAFFEPY_MPI_ALLREDUCE", "CAFFEPY_MPI_WIRE_TYPE"):
        os.environ.pop(var, None)                       # the defaults are what users run
    skip = max(args.warmup, 2)
    iters = cli_max_iter(skip, max(args.iters, 3), args.display)
    env = dict(PYTHONPATH=REPO, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    modes = cli_modes(per_host, args.wire and per_host == 1)
    batch = max(1, batch // per_host)
    found = {name: {"iter": [], "rounds": [], "waits": [], "algorithm": None} for name, _ in modes}
    nbytes = None
    with tempfile.TemporaryDirectory(prefix="bench_multihost_cli_") as tmp, TestBed(hosts, rate=args.rate) as bed:
        solver = write_cli_job(tmp, batch, iters, args.display)
        for _ in range(args.rounds):
            for name, extra in modes:
                out = bed.run(_caffepy() + ["train", "--solver", solver], per_host, env=dict(env, **extra),
                              cwd=tmp)
                log = out.stdout + out.stderr
                times = cli_iterations(log, skip)
                if out.returncode != 0 or not times:
                    sys.stderr.write(log[-5000:])
                    raise SystemExit(f"bench_multihost: `caffepy train` ({name}) failed (exit {out.returncode})")
                f = found[name]
                f["iter"] += times
                f["rounds"].append(statistics.median(times))
                f["waits"] += [(float(a), float(b)) for a, b in _WAITS.findall(log)[skip // args.display:]]
                m = _GRADIENTS.search(log)
                nbytes, f["algorithm"] = float(m.group(1)) * 1e6, f"progress {m.group(2)}, {m.group(3)}"
        # between the hosts: one rank per host, as a leader-only exchange would
        cmd = [sys.executable, me, "--allreduce-worker", "--floats", str(int(nbytes // 4)), "--iters", "3"]
        allreduce = _result(bed.run(cmd, env=env), "the allreduce")["allreduce"]
    return {"hosts": hosts, "per_host": per_host, "batch": batch, "display": args.display,
            "modes": found, "allreduce": allreduce, "bytes": nbytes}


def report_cli(args, c, others):
    """Print the CLI view; returns the default's hidden share (None: noise)."""
    modes = c["modes"]
    t1 = statistics.median(modes["none"]["iter"])
    spread = max(max(m["iter"]) - min(m["iter"]) for m in modes.values())
    ranks = c["hosts"] * c["per_host"]
    print(f"\n`mpiexec ... caffepy train` on {c['hosts']} emulated hosts, {c['per_host']} rank(s) x 1 thread "
          f"each, local batch {c['batch']}, display {c['display']}, links shaped to {args.rate}"
          + ("" if others is None else f"; other processes kept {others:.2f} of {os.cpu_count()} cores "
             f"busy during it"))
    print(f"t_allreduce  {c['allreduce']:6.2f} s  one MPI Allreduce of the {c['bytes'] / 1e6:.1f} MB of "
          f"gradients between the hosts (one rank each)")
    print(f"t_1rank      {t1:6.2f} s  CAFFEPY_MPI_PROGRESS=none (no communication, ranks side by side); "
          f"median of {len(modes['none']['iter'])} iterations")
    shown = None
    for name, m in modes.items():
        if name == "none":
            continue
        tn = statistics.median(m["iter"])
        hidden, text = verdict(tn - t1, c["allreduce"], spread)
        shown = hidden if name == "default" else shown
        wait = (f"; the ranks waited {statistics.median(w[0] for w in m['waits']):.1f}% of it for "
                f"communication, {statistics.median(w[1] for w in m['waits']):.1f}% for each other"
                if m["waits"] else "")
        print(f"t_{ranks}ranks {name:9s} {tn:6.2f} s  {m['algorithm']}; median of {len(m['iter'])} "
              f"iterations; cost {tn - t1:+.2f} s  {text}{wait}")
        if len(m.get("rounds", ())) > 1:
            # each round's run beside the baseline run just before it: on a shared machine the
            # load drifts between rounds more than within one
            ratio = statistics.median(a / b for a, b in zip(m["rounds"], modes["none"]["rounds"]))
            _, text = verdict((ratio - 1) * t1, c["allreduce"], spread)
            print(f"  {'':9s} {ratio:6.3f} x  the baseline, median of the rounds' ratios: {text}")
    print(f"  (iteration spread up to {spread:.2f} s; hidden = 1 - (t_{ranks}ranks - t_1rank) / t_allreduce; "
          f"target for the default >= 90%)")
    return shown


# -- driver ---------------------------------------------------------------------------
def _result(out, what):
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
    raise SystemExit(f"bench_multihost: {what} failed (exit {out.returncode})")


def _env():
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def verdict(cost, t_allreduce, spread):
    """The hidden fraction, or why the measurement cannot give one."""
    hidden = 1 - cost / t_allreduce
    if cost < 0:
        return None, (f"noise: negative cost ({cost:+.2f} s; iteration spread {spread:.2f} s), "
                      f"not a result")
    if hidden > 1:
        return None, f"noise: {hidden:.0%} hidden is more than all of it, not a result"
    return hidden, f"{hidden:6.1%} hidden"


def model_inputs(r):
    """The scaling model's measured inputs from a worker's result, and how the layer times
    were made to agree with the compute-only iteration (a note to print, or "").

    The layers are timed one by one, the iteration as a whole: on a loaded machine the two
    can disagree. When the layers sum to more than the iteration (a negative rest, which
    cannot be), they keep their proportions, scaled to the iteration, with no rest, and the
    note says by how much. The compute-only iteration is thus an input of the model, not a
    prediction: only the communicating modes are predictions."""
    t_none = r["modes"]["none"]["iter"]
    forward, backward = r["forward"], r["backward"]
    total = sum(forward) + sum(backward)
    rest, note = t_none - total, ""
    if rest < 0:
        scale = t_none / total
        forward, backward = [x * scale for x in forward], [x * scale for x in backward]
        note = (f"; the layers timed one by one summed to {total:.2f} s, more than the compute-only "
                f"iteration: scaled by {scale:.2f}, no rest")
        rest = 0.0
    cpu_per_byte = r["ring_cpu"] / r["ring_bytes_sent"]
    # the bandwidth the ring gets out of the link (its measured allreduce of all the
    # gradients, less its latencies): below the raw link's when the machine is busy
    steps = 2 * (len(r["hosts"]) - 1)
    moving = r["ring"] - steps * r["latency"]
    if moving <= 0:
        raise SystemExit(f"bench_multihost: the ring's {r['ring']:.3f} s for {r['bytes'] / 1e6:.0f} MB is "
                         f"less than its {steps} latencies of {r['latency'] * 1e6:.0f} us: the measurements "
                         f"contradict each other")
    bandwidth = r["ring_bytes_sent"] / moving
    # every emulated host runs on this machine's cores: with more ranks than cores, the
    # communication CPU of all ranks comes out of the compute of all, ranks/cores times the
    # share a rank alone on its core would lose (CPU accounting, not a fitted factor)
    ranks = len(r["hosts"])
    stolen = max(1.0, ranks / r.get("cores", os.cpu_count()))
    return dict(forward=forward, backward=backward, rest=rest,
                buckets=[tuple(b) for b in r["buckets"]], ranks=ranks, latency=r["latency"],
                bandwidth=bandwidth, cpu_per_byte=cpu_per_byte, stolen=stolen), note


def run_hosts(args, hosts, batch, me):
    from tests.multihost.testbed import TestBed
    cmd = [sys.executable, me, "--worker", "--batch", str(batch), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--modes", args.modes]
    with TestBed(hosts, rate=args.rate) as bed:
        r = _result(bed.run(cmd, env=_env()), f"the {hosts}-host run")
    hybrid = None
    if args.hybrid and hosts == 2:
        with TestBed(hosts, rate=args.rate) as bed:
            hybrid = _result(bed.run(cmd[:-2] + ["--modes", "none,thread", "--hybrid"], env=_env()),
                             "the hybrid run")
    return r, hybrid


def report(args, r, batch, hybrid, others):
    """Print one run's figures; returns [(mode, predicted, measured)] of the model check."""
    import scaling_model
    hosts = len(r["hosts"])
    modes = r["modes"]
    t1, c1 = modes["none"]["iter"], modes["none"]["cpu"]
    t_ar = r["allreduce"]
    spread = max(max(m["all"]) - min(m["all"]) for m in modes.values())
    print(f"\nAlexNet (DummyData), data parallel, {hosts} emulated hosts ({', '.join(r['hosts'])}), "
          f"1 rank x 1 thread each, local batch {batch}, links shaped to {args.rate}"
          + ("" if others is None else f"; other processes kept {others:.2f} of {os.cpu_count()} cores "
             f"busy during it"))
    print(f"link to the next rank: latency {r['latency'] * 1e6:.0f} us, bandwidth "
          f"{r['bandwidth'] * 8 / 1e6:.0f} Mbit/s ({r['bandwidth'] / 1e6:.1f} MB/s)")
    print(f"gradients: {r['bytes'] / 1e6:.1f} MB in {len(r['buckets'])} buckets")
    print(f"t_allreduce  {t_ar:6.2f} s  one MPI Allreduce of all of them over the links; CPU "
          f"{r['allreduce_cpu']:.2f} s ({r['allreduce_cpu'] / t_ar:.0%} of a core while it waits)")
    print(f"  the ring   {r['ring']:6.2f} s  the same bytes over caffepy's ring; CPU {r['ring_cpu']:.2f} s "
          f"({r['ring_cpu'] / r['ring']:.0%} of a core; {r['ring_cpu'] / r['ring_bytes_sent'] * 1e9:.2f} "
          f"ns per byte sent)")
    print(f"t_1rank      {t1:6.2f} s  no communication (progress none, ranks side by side); CPU {c1:.2f} s")
    print(f"t_{hosts}ranks by mode (median of {args.rounds * args.iters}; iteration spread up to {spread:.2f} s):")
    for mode, m in modes.items():
        if mode == "none":
            continue
        cost = m["iter"] - t1
        _, text = verdict(cost, t_ar, spread)
        print(f"  {mode:10s} {m['iter']:6.2f} s  cost {cost:+.2f} s  {text}; CPU {m['cpu']:.2f} s "
              f"({m['cpu'] - c1:+.2f} s for communication), waiting {m['wait']:.2f} s  [{m['algorithm']}]")
    print("hidden = 1 - (t_Nranks - t_1rank) / t_allreduce; target for `thread` (the default): >= 70%")
    if "blocking" in modes:
        shown, _ = verdict(modes["blocking"]["iter"] - t1, t_ar, spread)
        if shown is not None:
            print(f"blocking overlaps nothing by construction: its {shown:.0%} is this run's error bar "
                  f"on the others (its ring moves the bytes with less waiting than one MPI call)")
    inputs, note = model_inputs(r)
    checks = []
    print(f"model (scaling_model.py; inputs measured in this run: layer times summing to "
          f"{sum(inputs['forward']):.2f} s forward + {sum(inputs['backward']):.2f} s backward, the rest "
          f"{inputs['rest']:.2f} s{note}, the latency above, the ring's {inputs['bandwidth'] * 8 / 1e6:.0f} Mbit/s, "
          f"{inputs['cpu_per_byte'] * 1e9:.2f} ns of CPU per byte sent, taken from compute "
          f"{inputs['stolen']:.1f} times ({hosts} ranks on {r.get('cores', os.cpu_count())} cores)):")
    for mode in ("blocking", "thread"):         # `none` is an input (above), not a prediction
        if mode not in modes:
            continue
        predicted = scaling_model.iteration_time(**inputs, mode=mode)
        measured = modes[mode]["iter"]
        error = predicted / measured - 1
        checks.append((mode, predicted, measured))
        flag = "" if abs(error) <= TOLERANCE else f"  OUTSIDE {TOLERANCE:.0%}"
        print(f"  {mode:10s} predicted {predicted:6.2f} s, measured {measured:6.2f} s ({error:+.1%}){flag}")
    if hybrid is not None:
        h = hybrid["modes"]
        print(f"hybrid (train_val.prototxt: {', '.join(hybrid['mp_layers'])} model parallel), local batch "
              f"{batch}: none {h['none']['iter']:.2f} s, thread {h['thread']['iter']:.2f} s "
              f"({h['thread']['iter'] - t1:+.2f} s against the data-parallel t_1rank); "
              f"{hybrid['bytes'] / 1e6:.1f} MB of gradients allreduced (overlapped as above)")
    if hybrid is not None and "exchange_seconds" in hybrid:
        share = hybrid["exchange_seconds"] / hybrid["modes"]["thread"]["iter"]
        print(f"  activation exchanges: {hybrid['activation_bytes'] / 1e6:.1f} MB per rank per iteration "
              f"({hybrid['activation_bytes'] / r['bandwidth']:.2f} s at the link's rate); measured "
              f"{hybrid['exchange_seconds']:.2f} s per iteration inside them, {share:.1%} of the "
              f"iteration. They do not overlap (each layer needs its exchange's result); both they "
              f"and the compute grow with the local batch, so the share stays near this at any "
              f"batch on this link and shrinks with the link's bandwidth")
    if others is not None and others > 0.1:
        print(f"the machine was shared: other processes used {others:.2f} cores on average during this "
              f"run, CPU the ranks did not get, so these times are not comparable with a quiet run "
              f"(compare CPU seconds, or rerun)")
    return checks, inputs


# -- the projection -----------------------------------------------------------------------
def project(inputs, validated):
    """Scaling to many nodes needs what two to four emulated hosts cannot show: the slowest of
    N ranks, per-message latency at large N, ranks per node. bench_scaling_model.py has that
    model, checks it at 2, 4 and 8 hosts and 2 ranks per host, reproduces You et al.'s
    1024-CPU point and only then projects (make bench-multihost runs it next)."""
    print(f"\nProjection: see benchmarks/bench_scaling_model.py (stragglers, topology, the published "
          f"1024-CPU point); this run's check {'passed' if validated else 'FAILED'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=2, help="emulated hosts (one rank each)")
    ap.add_argument("--rate", default="500mbit", help="each host's link, as tc says it")
    ap.add_argument("--batch", type=int, default=0, help="local batch per rank (0: from --target)")
    ap.add_argument("--target", type=float, default=5.0, help="seconds per iteration to aim the batch at")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per mode and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations after each mode switch")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the modes")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--hybrid", action="store_true", help="also the hybrid layout (2 hosts)")
    ap.add_argument("--validate", action="store_true",
                    help="2 hosts, then 4 at the same local batch, then the projection")
    ap.add_argument("--save", help="write the raw measurements to this JSON file")
    ap.add_argument("--load", help="no run: report (model check, projection) from a --save file")
    ap.add_argument("--display", type=int, default=1, help="the CLI run's display interval")
    ap.add_argument("--per-host", default="1",
                    help="ranks per emulated host in the CLI view, comma-separated layouts (> 1: also the "
                         "flat ring; the local batch divided by it)")
    ap.add_argument("--wire", action="store_true",
                    help="CLI view with 1 rank per host: also CAFFEPY_MPI_WIRE_TYPE=bfloat16")
    ap.add_argument("--view", default="cli,harness",
                    help="cli: time `mpiexec ... caffepy train`; harness: solver.step in-process (both: cli first)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--floats", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.allreduce_worker:
        return allreduce_worker(args)
    if args.calibrate:
        return calibrate(args)
    if "none" not in args.modes.split(","):
        ap.error("--modes: needs `none` (the compute-only baseline)")

    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        for key in ("rate", "rounds", "iters"):
            setattr(args, key, saved[key])
        runs, clis = saved["runs"], saved.get("cli") or []
        print(f"measurements of {saved['when']} (load average {saved['load']:.2f} before)")
        for cli in clis if isinstance(clis, list) else [clis]:
            report_cli(args, cli, cli.get("others"))
    else:
        runs, _ = measure(args)
    all_checks, inputs = [], None
    for run in runs:
        checks, found = report(args, run["result"], run["batch"], run["hybrid"], run.get("others"))
        inputs = inputs or found
        all_checks += [(len(run["result"]["hosts"]),) + c for c in checks]
        sys.stdout.flush()
    if len({hosts for hosts, *_ in all_checks}) > 1:
        worst = max(abs(p / m - 1) for _, _, p, m in all_checks)
        validated = worst <= TOLERANCE
        print(f"\nmodel check: worst error {worst:.1%} over {len(all_checks)} predictions at "
              f"{' and '.join(str(h) for h in sorted({h for h, *_ in all_checks}))} hosts "
              f"({'within' if validated else 'OUTSIDE'} {TOLERANCE:.0%})")
        project(inputs, validated)


def _machine_busy():
    """CPU seconds the whole machine has been busy (every core, every process) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu():
    t = os.times()
    return t.children_user + t.children_system


def choose_batch(me, target, tries=4):
    """The local batch whose iteration, timed at that batch (one rank alone, one thread),
    is nearest `target` seconds. Scaling from one small probe is not enough: a small
    batch's fixed costs (and its cache fit) make the per-image time differ."""
    batch, timed = 8, {}
    for _ in range(tries):
        out = subprocess.run([sys.executable, me, "--calibrate", "--batch", str(batch), "--iters", "2"],
                             capture_output=True, text=True, env=_env())
        timed[batch] = _result(out, "calibration")["iter"]
        print(f"calibration: batch {batch} takes {timed[batch]:.2f} s/iter alone", flush=True)
        if abs(timed[batch] / target - 1) <= 0.08:
            break
        batch = max(1, round(batch * target / timed[batch]))
        if batch in timed:
            break
    best = min(timed, key=lambda b: abs(timed[b] - target))
    print(f"calibration: local batch {best} ({timed[best]:.2f} s/iter, target {target:.1f} s)", flush=True)
    return best


def measure(args):
    from tests.multihost.testbed import unavailable
    reason = unavailable()
    if reason:
        raise SystemExit(f"bench_multihost: {reason}")
    me = os.path.abspath(__file__)
    load = os.getloadavg()[0]
    print(f"load average before: {load:.2f} on {os.cpu_count()} cores", flush=True)
    batch = args.batch or choose_batch(me, args.target)
    views = args.view.split(",")
    runs, clis = [], []

    def save():
        if args.save:
            with open(args.save, "w") as f:
                json.dump({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": load,
                           "rate": args.rate, "rounds": args.rounds, "iters": args.iters, "runs": runs,
                           "cli": clis}, f)
    for per_host in [int(p) for p in args.per_host.split(",")] if "cli" in views else ():
        busy, ours, wall = _machine_busy(), _children_cpu(), time.perf_counter()
        cli = measure_cli(args, args.hosts, batch, me, per_host)
        cli["others"] = max(0.0, ((_machine_busy() - busy) - (_children_cpu() - ours)) / (time.perf_counter() - wall))
        report_cli(args, cli, cli["others"])
        clis.append(cli)
        sys.stdout.flush()
        save()
    for hosts in ((2, 4) if args.validate else (args.hosts,)) if "harness" in views else ():
        busy, ours, wall = _machine_busy(), _children_cpu(), time.perf_counter()
        r, hybrid = run_hosts(args, hosts, batch, me)
        # cores kept busy by other processes during the run: the machine's busy time less
        # what this run's processes (launchers, ranks) used
        others = ((_machine_busy() - busy) - (_children_cpu() - ours)) / (time.perf_counter() - wall)
        runs.append({"result": r, "batch": batch, "hybrid": hybrid, "others": max(0.0, others)})
        save()
    return runs, clis


if __name__ == "__main__":
    main()
