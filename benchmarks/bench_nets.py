"""Training speed net by net: caffepy against BVLC Caffe and PyTorch, in one run (issue 12).

    make bench                 # python benchmarks/bench_nets.py: every net, 3 rounds
    make bench-quick           # --quick: LeNet, cifar10_quick and AlexNet, 2 rounds
    make bench-full            # --full: larger batches (AlexNet 256, ResNet-50 32), 5 rounds
    python benchmarks/bench_nets.py --nets resnet50,lenet --rounds 5 --layers resnet50
    CAFFE_BIN=/path/to/build/tools/caffe make bench      # adds BVLC Caffe's `caffe time`

Per net (benchmarks/nets.py: the same TRAIN net for every framework, Input data in), one training
forward + backward per iteration, for:
  - caffepy, the net as written (its default path), and the same net asking for Caffe's own
    algorithms (nets.force_caffe); that row is left out when caffepy builds the very same
    implementations for both (each worker reports its layers' classes and algorithms);
    AlexNet also as models/intel_alexnet (IntelPack / IntelUnpack: the blocked layout);
  - PyTorch on the net translated from the prototxt (benchmarks/torch_net.py), in NCHW and in
    channels_last for the first round, then only the faster of the two;
  - BVLC Caffe, when CAFFE_BIN names its `caffe` binary: `caffe time -model <net>
    -iterations <k>` once per round, its "Average Forward-Backward" the sample (its data: the
    zeros of an Input blob; its build's BLAS threads follow OPENBLAS_NUM_THREADS).
Every contender runs in its own process (own peak RSS, own OpenMP / BLAS threads, --threads of
them, default all cores), and the driver runs one round of each in turn, starting with a
different one each round, so a change in machine load hits all alike: a sample is the mean of
k iterations (k grows for the small nets) after one untimed one (as every `caffe time` run
warms up with one), a figure the median over --rounds rounds, `±` half
the range of the rounds as a share of the median, and a ratio the median of the per-round
ratios with their range. caffepy is timed as `caffe time` times (layer by layer), PyTorch as
loss.backward() after the forward; none clears gradients between iterations (neither does
`caffe time`). Efficiency: direct-convolution FLOPs of the iteration (nets.training_flops; the
PyTorch translation counts its own, and the table says so if they differ) over the time, and
caffepy's executed FLOPs where Winograd multiplies less, against this machine's sgemm peak
(NumPy float32 2048^3 with the same threads, best of the start and end of the run). Peak RSS
is each process's own (the kernel's maxrss at its exit).

Then the threading check: caffepy with its default threads against one thread, with no other
load from this run and beside one busy process (benchmarks/bench_threads.py when it exists,
else the minimal check here: LeNet training and cifar10_quick batch-1 forward).
"""
import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import nets  # noqa: E402

# group: (caffepy nets (the first is the row that carries Caffe and PyTorch), the net Caffe and
#         PyTorch run, batch, full batch, iterations per round)
GROUPS = {
    "alexnet": (["alexnet_intel", "alexnet"], "alexnet", 64, 256, 1),
    "resnet50": (["resnet50"], "resnet50", 16, 32, 1),
    "googlenet": (["googlenet"], "googlenet", 16, 32, 1),
    "vgg16": (["vgg16"], "vgg16", 4, 16, 1),
    "mobilenet": (["mobilenet"], "mobilenet", 16, 32, 1),
    "lenet": (["lenet"], "lenet", 64, 64, 10),
    "cifar10_quick": (["cifar10_quick"], "cifar10_quick", 100, 100, 4),
}
QUICK = ["lenet", "cifar10_quick", "alexnet"]
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# ---------------------------------------------------------------------------------------------
# workers (each in its own process): build, warm up, say READY <info>; then one sample per
# `step` line on stdin; `quit` -> RESULT <final info>

def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class CaffepyWorker:
    def __init__(self, args):
        import numpy as np

        from caffepy import log
        from caffepy.net import TRAIN, Net

        log.set_quiet(True)
        self.base_rss = _rss_mb()
        param = nets.train_net(args.net, args.batch)
        if args.force_caffe:
            param = nets.force_caffe(param)
        self.net = Net(param, TRAIN)
        data = self.net.blobs["data"]
        data.data[...] = np.random.default_rng(0).standard_normal(data.shape, dtype=np.float32)
        self.net.blobs["label"].data[...] = 0
        self.forward_only = args.forward_only
        self.step(args.iters)

    def info(self):
        direct, executed = nets.training_flops(self.net)
        algorithms = [(type(layer).__name__, layer.variant, bool(getattr(layer, "winograd", False)),
                       str(getattr(layer, "algorithm", ""))) for layer in self.net.layers]
        return {"flops": direct, "executed_flops": executed, "algorithms": algorithms}

    def step(self, iters):
        """Mean ms per iteration over `iters`, timed layer by layer as `caffe time` does (a
        fused pair as one)."""
        net, clock = self.net, time.perf_counter
        n = len(net.layers)
        fwd, bwd = [0.0] * n, [0.0] * n
        units = net.units()           # a fused pair is timed as one, under its first layer
        for _ in range(iters):
            for first, last in units:
                t = clock()
                net.forward_from_to(first, last)
                fwd[first] += clock() - t
            if self.forward_only:
                continue
            for first, last in reversed(units):
                t = clock()
                net.backward_from_to(last, first)
                bwd[first] += clock() - t
        ms = 1e3 / iters
        return {"ms": (sum(fwd) + sum(bwd)) * ms, "forward_ms": sum(fwd) * ms,
                "layers": [(layer.name, layer.type, fwd[i] * ms, bwd[i] * ms)
                           for i, layer in enumerate(net.layers)]}


class TorchWorker:
    def __init__(self, args):
        import torch

        import torch_net

        torch.set_num_threads(args.threads)
        self.base_rss = _rss_mb()
        with open(args.spec) as f:
            spec = json.load(f)
        self.model = torch_net.TorchNet(spec).train()
        gen = torch.Generator().manual_seed(0)
        self.inputs = {"data": torch.randn(spec["inputs"]["data"], generator=gen),
                       "label": torch.zeros(spec["inputs"]["label"])}
        if args.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
            self.inputs["data"] = self.inputs["data"].contiguous(memory_format=torch.channels_last)
        self.torch = torch
        self.step(args.iters)

    def info(self):
        return {"flops": self.model.flops, "version": self.torch.__version__}

    def step(self, iters):
        clock = time.perf_counter
        fwd = total = 0.0
        for _ in range(iters):
            t0 = clock()
            loss, _ = self.model(self.inputs)
            t1 = clock()
            loss.backward()
            fwd += t1 - t0
            total += clock() - t0
        return {"ms": total * 1e3 / iters, "forward_ms": fwd * 1e3 / iters}


def worker_sgemm():
    import numpy as np
    n = 2048
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return {"gflops": 2 * n ** 3 / best / 1e9}


def run_worker(args):
    if args.worker == "sgemm":
        print("RESULT " + json.dumps(worker_sgemm()), flush=True)
        return
    worker = (CaffepyWorker if args.worker == "caffepy" else TorchWorker)(args)
    print("READY " + json.dumps(worker.info()), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "step":
            break
        # one untimed iteration first, as each `caffe time` run begins with one ("Performing
        # Forward / Backward"): a worker's first iteration after idling while the others ran
        # pays for the caches and memory they took, which Caffe's samples never include
        worker.step(1)
        print("RESULT " + json.dumps(worker.step(int(words[1]))), flush=True)
    print("RESULT " + json.dumps({"base_rss_mb": worker.base_rss}), flush=True)


# ---------------------------------------------------------------------------------------------
# contenders, as the driver sees them

def thread_env(threads):
    """The environment of a contender: `threads` threads for every runtime, or None for the
    defaults (the variables removed)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if threads:
        env.update({k: str(threads) for k in THREAD_VARS})
    return env


def _wait(proc):
    """Reap `proc`; its peak RSS in MB (the kernel's maxrss of that process alone)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024.0


class Worker:
    """A Python worker process: started and built by start(), one sample per step()."""
    framework = None

    def __init__(self, key, label, argv, env, iters):
        self.key, self.label, self.argv, self.env, self.iters = key, label, argv, env, iters
        self.samples, self.info, self.rss_mb, self.base_rss_mb, self.proc = {}, None, None, None, None

    def start(self):
        cmd = [sys.executable, os.path.abspath(__file__), "--iters", str(self.iters), *self.argv]
        self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        kind, payload = self._read()
        if kind != "READY":
            self.stop()
            return False
        self.info = payload
        return True

    def _read(self):
        for line in self.proc.stdout:
            word, _, rest = line.partition(" ")
            if word in ("READY", "RESULT"):
                return word, json.loads(rest)
        err = self.proc.stderr.read()
        print(f"  {self.label}: the worker ended early:\n{err[-3000:]}", file=sys.stderr, flush=True)
        return None, None

    def step(self, round_):
        self.proc.stdin.write(f"step {self.iters}\n")
        self.proc.stdin.flush()
        kind, result = self._read()
        if kind != "RESULT":
            self.stop()
            return False
        self.samples[round_] = result
        return True

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None and self.proc.returncode is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                kind, final = self._read()
                if kind == "RESULT":
                    self.base_rss_mb = final["base_rss_mb"]
            except (BrokenPipeError, OSError):
                pass
        self.proc.stdin.close()
        self.rss_mb = _wait(self.proc)
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.proc = None


class CaffeContender:
    """BVLC Caffe: one `caffe time` process per round (the tool runs its iterations and exits)."""
    framework = "caffe"

    def __init__(self, binary, prototxt, env, iters):
        self.key, self.label = "caffe", "BVLC Caffe"
        self.binary, self.prototxt, self.env, self.iters = binary, prototxt, env, iters
        self.samples, self.info, self.rss_mb, self.base_rss_mb = {}, {}, 0.0, None

    def start(self):
        return True

    def step(self, round_):
        proc = subprocess.Popen([self.binary, "time", "-model", self.prototxt, "-iterations",
                                 str(self.iters)], env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        err = proc.stderr.read()
        proc.stderr.close()
        self.rss_mb = max(self.rss_mb, _wait(proc))
        ms = _caffe_average(err)
        if proc.returncode or ms is None:
            print(f"  BVLC Caffe failed (exit {proc.returncode}):\n{err[-3000:]}", file=sys.stderr,
                  flush=True)
            return False
        self.samples[round_] = {"ms": ms}
        return True

    def stop(self):
        pass


def _caffe_average(log_text):
    for line in log_text.splitlines():
        if "Average Forward-Backward:" in line:
            return float(line.rsplit(":", 1)[1].split()[0])
    return None


def run_rounds(contenders, rounds, on_round=None):
    """Each live contender one step per round, the starting one rotating; returns the live ones."""
    live = list(contenders)
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for c in order:
            if not c.step(r):
                live.remove(c)
        if on_round:
            live = on_round(r, live)
    return live


# ---------------------------------------------------------------------------------------------
# figures

def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def summary(samples):
    """(median, ± half range as a share of the median) of a {round: ms} dict."""
    values = list(samples.values())
    m = median(values)
    return m, (max(values) - min(values)) / 2 / m if m else 0.0


def ratio(slow, fast):
    """Median and range of slow / fast over the rounds both ran."""
    rounds = sorted(set(slow) & set(fast))
    values = [slow[r] / fast[r] for r in rounds]
    return (median(values), min(values), max(values)) if values else None


def _ms(samples):
    return {r: s["ms"] for r, s in samples.items()}


# ---------------------------------------------------------------------------------------------
# one group of nets

class GroupResult:
    def __init__(self, name, batch):
        self.name, self.batch = name, batch
        self.caffepy = []             # [(net name, label, Worker)]
        self.torch = self.caffe = None
        self.torch_format = None
        self.notes = []


def bench_group(name, batch, args, workdir):
    caffepy_nets, ref_net, _, _, iters = GROUPS[name]
    result = GroupResult(name, batch)
    env = thread_env(args.threads)
    contenders = []
    print(f"\n== {name}, batch {batch}: building (load average {os.getloadavg()[0]:.1f}) ==",
          flush=True)
    for net in caffepy_nets:
        title = nets.NETS[net][0]
        default = Worker(f"caffepy:{net}", f"caffepy {title}",
                         ["--worker", "caffepy", "--net", net, "--batch", str(batch)], env, iters)
        if not default.start():
            result.notes.append(f"caffepy on {title} failed to build (see above)")
            continue
        contenders.append(default)
        result.caffepy.append((net, f"{title} b{batch}", default))
        forced = Worker(f"caffepy:{net}:caffe", f"caffepy {title}, Caffe's algorithms",
                        ["--worker", "caffepy", "--net", net, "--batch", str(batch), "--force-caffe"],
                        env, iters)
        if forced.start():
            if forced.info["algorithms"] == default.info["algorithms"]:
                forced.stop()
                result.notes.append(f"{title}: asking for Caffe's algorithms builds the same "
                                    f"layers as the default; one row")
            else:
                contenders.append(forced)
                result.caffepy.append((net, f"{title} b{batch}, Caffe's algorithms", forced))
    ref = nets.train_net(ref_net, batch)
    if args.torch:
        import torch_net
        spec_path = os.path.join(workdir, f"{name}.json")
        with open(spec_path, "w") as f:
            json.dump(torch_net.spec(ref), f)
        torch_workers = []
        for fmt in ("NCHW", "channels_last"):
            argv = ["--worker", "torch", "--spec", spec_path, "--threads", str(args.threads)]
            w = Worker(f"torch:{fmt}", f"PyTorch ({fmt})",
                       argv + (["--channels-last"] if fmt == "channels_last" else []), env, iters)
            if w.start():
                torch_workers.append(w)
                contenders.append(w)
    if args.caffe_bin:
        path = os.path.join(workdir, f"{name}.prototxt")
        with open(path, "w") as f:
            f.write(nets.to_text(ref))
        result.caffe = CaffeContender(args.caffe_bin, path, env, iters)
        contenders.append(result.caffe)

    def keep_faster_torch(r, live):
        # after the first round only the faster memory format stays
        both = [w for w in live if w.key.startswith("torch:")]
        if r == 0 and len(both) == 2:
            slower = max(both, key=lambda w: w.samples[0]["ms"])
            slower.stop()
            live = [c for c in live if c is not slower]
            torch_workers.remove(slower)
        return live

    print(f"   {len(contenders)} contenders, {args.rounds} rounds of {iters} iteration(s)", flush=True)
    live = run_rounds(contenders, args.rounds, keep_faster_torch if args.torch else None)
    for c in contenders:
        c.stop()
    if args.torch and torch_workers and torch_workers[0] in live:
        result.torch = torch_workers[0]
        result.torch_format = result.torch.key.split(":")[1]
    if result.caffe is not None and result.caffe not in live:
        result.caffe = None
    result.caffepy = [(n, label, w) for n, label, w in result.caffepy if w in live]
    print_group(result)
    return result


def print_group(res):
    for _, label, w in res.caffepy:
        m, spread = summary(_ms(w.samples))
        print(f"   caffepy {label}: {m:.1f} ms ±{100 * spread:.0f}%", flush=True)
    for w in (res.torch, res.caffe):
        if w is not None:
            m, spread = summary(_ms(w.samples))
            print(f"   {w.label}: {m:.1f} ms ±{100 * spread:.0f}%", flush=True)


# ---------------------------------------------------------------------------------------------
# the threading check

def threads_check(args):
    own = os.path.join(HERE, "bench_threads.py")
    if os.path.exists(own):
        print("\n== threading check: benchmarks/bench_threads.py ==", flush=True)
        subprocess.run([sys.executable, own], check=False)
        return None
    print("\n== threading check (the minimal one of bench_nets.py): caffepy default threads vs "
          "one thread ==", flush=True)
    rows = []
    checks = [("LeNet b64 training", "lenet", 64, False, 10),
              ("cifar10_quick b1 forward", "cifar10_quick", 1, True, 50)]
    for busy in (False, True):
        spinner = None
        if busy:
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for title, net, batch, forward_only, iters in checks:
                argv = ["--worker", "caffepy", "--net", net, "--batch", str(batch)]
                argv += ["--forward-only"] if forward_only else []
                default = Worker("default", "default threads", argv, thread_env(None), iters)
                one = Worker("one", "one thread", argv, thread_env(1), iters)
                workers = [w for w in (default, one) if w.start()]
                run_rounds(workers, args.rounds)
                for w in workers:
                    w.stop()
                if len(default.samples) and len(one.samples):
                    rows.append((title, busy, summary(_ms(default.samples)), summary(_ms(one.samples)),
                                 ratio(_ms(default.samples), _ms(one.samples))))
                    print(f"   {title}{', 1 busy process' if busy else ''}: default "
                          f"{rows[-1][2][0]:.2f} ms, one thread {rows[-1][3][0]:.2f} ms", flush=True)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    return rows


# ---------------------------------------------------------------------------------------------
# machine facts and the tables

def sgemm_peak(threads):
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "sgemm"],
                          env=thread_env(threads), capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["gflops"]
    raise SystemExit(proc.stderr[-3000:])


def machine_facts():
    from caffepy import device, isa as kernel_isa
    isa, _ = device.vector_isa()
    march = ""
    if shutil.which("gcc"):
        out = subprocess.run(["gcc", "-march=native", "-Q", "--help=target"], capture_output=True,
                             text=True).stdout
        march = next((line.split()[-1] for line in out.splitlines()
                      if line.strip().startswith("-march=")), "")
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 2 ** 20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return (f"{device.cpu_model()}, {isa}{f' (GCC calls it {march})' if march else ''}, "
            f"kernels {kernel_isa.describe()}, "
            f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs{mem}; {platform.python_implementation()} "
            f"{platform.python_version()}; caffepy {commit or '?'}")


def _cell(w):
    if w is None:
        return "-"
    m, spread = summary(_ms(w.samples))
    return f"{m:.0f} ms ±{100 * spread:.0f}%" if m >= 10 else f"{m:.2f} ms ±{100 * spread:.0f}%"


def _ratio_cell(other, mine):
    if other is None:
        return "-"
    r = ratio(_ms(other.samples), _ms(mine.samples))
    return f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})" if r else "-"


def print_tables(results, peak, facts, args, load_start, threads_rows):
    torch_version = next((r.torch.info.get("version") for r in results if r.torch), None)
    print("\n" + "=" * 100)
    print(f"machine: {facts}")
    print(f"sgemm peak {peak:.1f} GFLOP/s (NumPy float32 2048^3, {args.threads} threads); load "
          f"average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
          f"{args.threads} threads for every framework; {args.rounds} rounds")
    print(f"PyTorch {torch_version or 'not run'}; BVLC Caffe: {args.caffe_bin or 'not run (set CAFFE_BIN)'}")
    print("\ntraining forward + backward per iteration (median of the rounds, ± half their range); "
          "caffepy vs X = X's time / caffepy's (median of the per-round ratios, their range)\n")
    print("| net | caffepy | BVLC Caffe | PyTorch | caffepy vs Caffe | caffepy vs PyTorch |")
    print("|---|---|---|---|---|---|")
    for res in results:
        for i, (_, label, w) in enumerate(res.caffepy):
            torch_cell = _cell(res.torch) + (f" ({res.torch_format})" if res.torch else "")
            print(f"| {label} | {_cell(w)} | {_cell(res.caffe) if i == 0 else ''} | "
                  f"{torch_cell if i == 0 else ''} | {_ratio_cell(res.caffe, w)} | "
                  f"{_ratio_cell(res.torch, w)} |")
    print("\nwhole-iteration efficiency (GFLOP/s, % of the sgemm peak) and peak RSS\n")
    print("| net | GFLOP per iteration | caffepy, direct | caffepy, executed | BVLC Caffe | PyTorch "
          "| peak RSS MB caffepy / Caffe / PyTorch |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        for i, (_, label, w) in enumerate(res.caffepy):
            flops, executed = w.info["flops"], w.info["executed_flops"]

            def eff(c, work):
                if c is None:
                    return "-"
                gf = work / (summary(_ms(c.samples))[0] / 1e3) / 1e9
                return f"{gf:.1f} ({100 * gf / peak:.0f}%)"
            rss = " / ".join("-" if c is None else f"{c.rss_mb:.0f}"
                             for c in (w, res.caffe if i == 0 else None, res.torch if i == 0 else None))
            print(f"| {label} | {flops / 1e9:.2f} | {eff(w, flops)} | "
                  f"{eff(w, executed) if executed != flops else 'same'} | "
                  f"{eff(res.caffe, flops) if i == 0 else ''} | {eff(res.torch, flops) if i == 0 else ''} "
                  f"| {rss} |")
            if i == 0 and res.torch and res.torch.info["flops"] != flops:
                res.notes.append(f"the PyTorch translation counts {res.torch.info['flops'] / 1e9:.3f} "
                                 f"GFLOP per iteration, caffepy {flops / 1e9:.3f}: not the same net")
    notes = [f"{res.name}: {note}" for res in results for note in res.notes]
    if notes:
        print("\nnotes:\n" + "\n".join(f"  - {n}" for n in notes))
    if threads_rows:
        print("\nthreading: caffepy default threads vs OMP_NUM_THREADS=1 (goal: default never "
              "slower by more than 10%)\n")
        print("| check | default threads | one thread | default / one |")
        print("|---|---|---|---|")
        for title, busy, d, o, r in threads_rows:
            print(f"| {title}{', beside 1 busy process' if busy else ''} | {d[0]:.2f} ms "
                  f"±{100 * d[1]:.0f}% | {o[0]:.2f} ms ±{100 * o[1]:.0f}% | "
                  f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f}) |")


def print_layers(res):
    """Per layer medians (ms per iteration) of the group's caffepy contenders, side by side."""
    columns = [(label, w) for _, label, w in res.caffepy]
    print(f"\nper layer, {res.name} b{res.batch}, ms per iteration (medians), forward / backward:")
    print("  " + " | ".join(label for label, _ in columns))
    tables = []
    for _, w in columns:
        rounds = list(w.samples.values())
        tables.append({name: (type_, median([r["layers"][i][2] for r in rounds]),
                              median([r["layers"][i][3] for r in rounds]))
                       for i, (name, type_, _, _) in enumerate(rounds[0]["layers"])})
    for name, (type_, _, _) in tables[0].items():
        cells = [f"{t[name][1]:8.2f} {t[name][2]:8.2f}" if name in t else f"{'':17s}" for t in tables]
        print(f"  {name[:24]:24s} {type_[:16]:16s} " + " | ".join(cells))


def have_torch():
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}; 2 rounds")
    ap.add_argument("--full", action="store_true", help="larger batches, 5 rounds")
    ap.add_argument("--nets", default="", help=f"comma-separated subset of {', '.join(GROUPS)}")
    ap.add_argument("--batch", type=int, help="one batch size for every net")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --quick 2, --full 5)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--layers", default="", help="comma-separated groups to print per layer")
    ap.add_argument("--no-threads-check", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--caffe-bin", default=os.environ.get("CAFFE_BIN", ""),
                    help="BVLC Caffe's `caffe` binary (default: $CAFFE_BIN)")
    # worker arguments
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--net", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--force-caffe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--forward-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--channels-last", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5 if args.full else 3
    names = [n for n in args.nets.split(",") if n] or (QUICK if args.quick else list(GROUPS))
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        ap.error(f"unknown net(s) {', '.join(unknown)}; known: {', '.join(GROUPS)}")
    if args.caffe_bin and not os.access(args.caffe_bin, os.X_OK):
        ap.error(f"--caffe-bin / CAFFE_BIN: no executable at {args.caffe_bin}")
    args.torch = not args.no_torch and have_torch()
    load_start = os.getloadavg()[0]
    facts = machine_facts()
    peak = sgemm_peak(args.threads)
    print(f"machine: {facts}\nsgemm at the start: {peak:.1f} GFLOP/s; load average {load_start:.1f}",
          flush=True)
    if not args.torch:
        print("PyTorch is not installed (make bench installs torch==2.13.0): its columns stay empty")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_nets.") as workdir:
        for name in names:
            batch = args.batch or GROUPS[name][3 if args.full else 2]
            results.append(bench_group(name, batch, args, workdir))
    threads_rows = None if args.no_threads_check else threads_check(args)
    end = sgemm_peak(args.threads)
    print(f"\nsgemm at the end: {end:.1f} GFLOP/s", flush=True)
    print_tables(results, max(peak, end), facts, args, load_start, threads_rows)
    for res in results:
        if res.name in args.layers.split(",") and res.caffepy:
            print_layers(res)


if __name__ == "__main__":
    main()
