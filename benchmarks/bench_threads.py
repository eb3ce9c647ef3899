"""Threads that never hurt (issue 12): caffepy's default threads against one thread, on an idle
machine and beside a busy process, and against BVLC Caffe's `caffe time` when CAFFE_BIN is set.

    python benchmarks/bench_threads.py                          # make bench-threads
    CAFFE_BIN=~/caffe/build/tools/caffe python benchmarks/bench_threads.py
    python benchmarks/bench_threads.py --cases lenet,cifar10_quick_b1 --rounds 12 --spinning

Cases (benchmarks/prototxt/: BVLC's example nets, Data swapped for constant DummyData):
  lenet             LeNet (examples/mnist), batch 64, training forward + backward
  cifar10_quick     cifar10_quick, batch 100, training forward + backward
  cifar10_full      cifar10_full, batch 100, training forward + backward
  cifar10_quick_b1  cifar10_quick, batch 1, forward only (a deploy net at batch 1)
  digits            the demo's LeNet (examples/digits, 16x16 digits), batch 64, training
                    forward + backward: what examples/digits/run.sh trains
  alexnet_b4        AlexNet (models/intel_alexnet without IntelPack / IntelUnpack), batch 4,
                    training forward + backward
Contenders, each in its own process: caffepy with default settings (OMP_NUM_THREADS and the
OpenMP / OpenBLAS variables removed from its environment), caffepy with OMP_NUM_THREADS=1, and
with --control a second caffepy with OMP_NUM_THREADS=1 (the same
contender twice: how far apart noise alone puts two figures), with --spinning caffepy whose
threads spin between regions as long as OpenMP's and OpenBLAS's defaults (GOMP_SPINCOUNT=300000,
ten times caffepy's, and OPENBLAS_THREAD_TIMEOUT=28: what caffepy.threads shortens). With
CAFFE_BIN, for the LeNet and CIFAR-10 cases, `caffe time -model <net> -iterations K` with its
default settings and with OPENBLAS_NUM_THREADS=1 (its "Average Forward-Backward", or "Average
Forward pass" for the forward-only case).

Each case runs twice: idle (whatever else the machine runs), then beside one busy process that
this benchmark starts (`python -c 'while True: pass'`) and stops. In each, the contenders take
turns (--rounds rounds of about --chunk seconds each), so a change of load hits them alike; the
figures are the medians of the per-iteration times, and the ratios are taken between contenders
of the same run. The goal: default threads never more than 10% slower than one thread (ratio
<= 1.10), idle or busy; LeNet and CIFAR-10 at >= 1.5x Caffe's default.
"""
import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NETS = os.path.join(HERE, "prototxt")

# name: (description, prototxt (in NETS unless absolute) or None for AlexNet's builder, batch override for a deploy copy, backward?)
CASES = {
    "lenet": ("LeNet b64 training", "lenet_train.prototxt", None, True),
    "cifar10_quick": ("cifar10_quick b100 training", "cifar10_quick_train.prototxt", None, True),
    "cifar10_full": ("cifar10_full b100 training", "cifar10_full_train.prototxt", None, True),
    "cifar10_quick_b1": ("cifar10_quick b1 forward", "cifar10_quick_train.prototxt", 1, False),
    "digits": ("digits LeNet b64 training", os.path.join(REPO, "examples", "digits",
                                                         "lenet_train_test.prototxt"), None, True),
    "alexnet_b4": ("AlexNet b4 training", None, 4, True),
}
CAFFE_CASES = ("lenet", "cifar10_quick", "cifar10_full", "cifar10_quick_b1", "digits")
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DYNAMIC",
               "OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "GOTO_NUM_THREADS",
               "MKL_NUM_THREADS")


def net_param(case):
    """The NetParameter a case runs (a batch-1 case: the net's DummyData at batch 1)."""
    sys.path.insert(0, REPO)
    from caffepy import upgrade

    _, path, batch, _ = CASES[case]
    if path is None:
        sys.path.insert(0, HERE)
        import nets
        return nets.train_net("alexnet", batch)
    param = upgrade.read_net(os.path.join(NETS, path))
    if case == "digits":
        _digits_dummy_data(param)
    if batch is not None:
        for lp in param.layer:
            for shape in lp.dummy_data_param.shape:
                shape.dim[0] = batch
    return param


def _digits_dummy_data(param):
    """The demo's TRAIN net with its Data layer swapped for constant DummyData of its shapes
    (64 grayscale 16x16 digits, run.sh's convert_imageset size); the TEST-phase layers go."""
    from caffepy.proto import caffe_pb2

    keep = [lp for lp in param.layer if not any(r.phase == caffe_pb2.TEST for r in lp.include)]
    del param.layer[:]
    param.layer.extend(keep)
    for lp in param.layer:
        if lp.type == "Data":
            batch = lp.data_param.batch_size
            lp.type = "DummyData"
            lp.ClearField("include")
            lp.ClearField("transform_param")
            lp.ClearField("data_param")
            d = lp.dummy_data_param
            d.data_filler.add(type="constant", value=0.5)
            d.data_filler.add(type="constant", value=3.0)
            d.shape.add(dim=[batch, 1, 16, 16])
            d.shape.add(dim=[batch])


# ---------------------------------------------------------------------------------------------
# the caffepy worker: build the net, warm up, then time one chunk of iterations per request

def run_worker(case):
    sys.path.insert(0, REPO)
    from caffepy import log
    from caffepy.net import TRAIN, Net

    log.set_quiet(True)
    net = Net(net_param(case), TRAIN)
    backward = CASES[case][3]

    def once():
        t = time.perf_counter()
        net.forward_from_to()
        if backward:
            net.backward_from_to()
        return time.perf_counter() - t

    for _ in range(2):
        once()
    print(f"READY {once()}", flush=True)
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        times = [once() for _ in range(int(line.split()[1]))]
        print("TIMES " + " ".join(f"{t:.6f}" for t in times), flush=True)


# ---------------------------------------------------------------------------------------------
# driver

def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(extra)
    return env


CAFFEPY = [("default", "caffepy default", {}),
           ("one", "caffepy 1 thread", {"OMP_NUM_THREADS": "1"})]
CONTROL = ("control", "caffepy 1 thread again", {"OMP_NUM_THREADS": "1"})
SPINNING = ("spinning", "caffepy spinning", {"GOMP_SPINCOUNT": "300000",
                                               "OPENBLAS_THREAD_TIMEOUT": "28"})
CAFFE = [("caffe", "Caffe default", {}), ("caffe_one", "Caffe 1 thread",
                                          {"OPENBLAS_NUM_THREADS": "1"})]


class Worker:
    def __init__(self, case, env):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", case],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            raise SystemExit(f"the {case} worker did not start")
        self.warm = float(line.split()[1])

    def run(self, n):
        self.proc.stdin.write(f"run {n}\n")
        line = self.proc.stdout.readline()
        return [float(t) for t in line.split()[1:]]

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


class CaffeRunner:
    """`caffe time` of a case's net, one process per chunk."""

    def __init__(self, caffe, case, env, workdir):
        import tempfile
        from google.protobuf import text_format

        self.caffe, self.env, self.backward = caffe, env, CASES[case][3]
        fd, self.model = tempfile.mkstemp(suffix=".prototxt", dir=workdir)
        with os.fdopen(fd, "w") as f:
            f.write(text_format.MessageToString(net_param(case)))

    def run(self, n):
        out = subprocess.run([self.caffe, "time", "-model", self.model, "-iterations", str(n)],
                             env=self.env, capture_output=True, text=True)
        key = "Average Forward-Backward" if self.backward else "Average Forward pass"
        found = re.search(key + r": ([0-9.]+) ms", out.stderr + out.stdout)
        if not found:
            raise SystemExit(f"{self.caffe} time failed:\n{out.stderr[-2000:]}")
        return [float(found.group(1)) / 1e3] * n


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def measure(runners, rounds, chunk, warm):
    """Rounds of about `chunk` seconds per contender, in turn; per-iteration times by contender."""
    times = {name: [] for name in runners}
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            times[name] += runners[name].run(max(1, int(chunk / max(warm, 1e-4))))
    return {name: median(t) * 1e3 for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--chunk", type=float, default=0.25, help="seconds per contender per round")
    ap.add_argument("--spinning", action="store_true", help="add caffepy with spinning threads")
    ap.add_argument("--control", action="store_true",
                    help="add a second 1-thread caffepy: its ratio to the first is the noise")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args.worker)
    caffe = os.environ.get("CAFFE_BIN")
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"--cases: unknown case '{c}'; known: {', '.join(CASES)}")
    contenders = CAFFEPY + ([CONTROL] if args.control else []) + ([SPINNING] if args.spinning else [])
    print(f"{os.cpu_count()} CPU(s), {len(os.sched_getaffinity(0))} for this process; medians of "
          f"{args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f} at start")
    if not caffe:
        print("CAFFE_BIN unset: no Caffe rows (CAFFE_BIN=/path/to/caffe adds them)")
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case in cases:
            workers = {name: Worker(case, clean_env(**extra)) for name, _, extra in contenders}
            runners = dict(workers)
            if caffe and case in CAFFE_CASES:
                for name, _, extra in CAFFE:
                    runners[name] = CaffeRunner(caffe, case, clean_env(**extra), workdir)
            warm = workers["one"].warm
            try:
                for condition in ("idle", "busy"):
                    busy = None
                    if condition == "busy":
                        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        time.sleep(0.5)
                    try:
                        load = os.getloadavg()[0]
                        got = measure(runners, args.rounds, args.chunk, warm)
                    finally:
                        if busy is not None:
                            busy.kill()
                            busy.wait()
                    rows.append((case, condition, load, got))
                    print_row(case, condition, load, got, contenders)
            finally:
                for w in workers.values():
                    w.close()
    summary(rows)


def print_row(case, condition, load, got, contenders):
    cols = "  ".join(f"{label} {got[name]:8.2f} ms" for name, label, _ in contenders)
    line = (f"{CASES[case][0]:28s} {condition:4s} (load {load:4.1f})  {cols}  "
            f"default/1 thread {got['default'] / got['one']:.2f}")
    if "control" in got:
        line += f" (control {got['control'] / got['one']:.2f})"
    if "caffe" in got:
        line += (f"  | Caffe default {got['caffe']:8.2f} ms, 1 thread {got['caffe_one']:8.2f} ms;"
                 f" Caffe default / caffepy default {got['caffe'] / got['default']:.2f}x")
    print(line, flush=True)


def summary(rows):
    worst = max(rows, key=lambda r: r[3]["default"] / r[3]["one"])
    ratio = worst[3]["default"] / worst[3]["one"]
    print(f"\nworst default / 1 thread: {ratio:.2f} ({CASES[worst[0]][0]}, {worst[1]}); goal <= 1.10")
    if "control" in worst[3]:
        noise = max(max(r[3]["control"], r[3]["one"]) / min(r[3]["control"], r[3]["one"]) for r in rows)
        print(f"noise: two identical 1-thread contenders differed by up to {noise:.2f}x")
    versus = [(r, r[3]["caffe"] / r[3]["default"]) for r in rows if "caffe" in r[3]]
    if versus:
        (case, condition, _, _), least = min(versus, key=lambda v: v[1])
        print(f"least Caffe default / caffepy default: {least:.2f}x ({CASES[case][0]}, {condition}); "
              f"goal >= 1.5x")


if __name__ == "__main__":
    main()
