"""AlexNet training speed and memory: caffepy's Intel path vs plain caffepy vs PyTorch (issue #6).

    python benchmarks/bench_alexnet.py            # batch 64            (make bench)
    python benchmarks/bench_alexnet.py --full     # batch 64 and 256    (make bench-full)

In one run, with the same thread count for all (--threads, default: all cores):
  1. caffepy, models/intel_alexnet (blocked layout): forward, backward, forward-backward ms,
     img/s and a per-layer table;
  2. caffepy on the plain NCHW AlexNet (the same prototxt without IntelPack / IntelUnpack);
  3. PyTorch CPU on the same AlexNet (groups, LRN, dropout), default and channels_last, the
     faster one counted;
  4. caffepy / PyTorch throughput, and caffepy's GFLOP/s over the whole iteration as a share of
     this machine's sgemm peak (numpy float32 matmul, measured here);
  5. peak RSS of batch-64 training for each (every measurement runs in its own subprocess).
The data layer is swapped for DummyData (constant data, as Intel Caffe's benchmark nets), so the
timings are the net alone. Timing follows `caffe time` (per-layer forward, then per-layer
backward) after one warm-up pass. Every contender lives in its own process (own peak RSS, own
OpenMP runtime), and the driver runs their iterations in turn (A B C D A B C D ...), so a
change in machine load hits all of them alike; the figures are medians over --iters.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "models", "intel_alexnet", "train_val.prototxt")


# ---------------------------------------------------------------------------------------------
# workers (each in its own process)

def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def caffepy_net_param(batch, blocked):
    """models/intel_alexnet's TRAIN net with DummyData in, optionally without Pack / Unpack."""
    sys.path.insert(0, REPO)
    from caffepy import upgrade
    from caffepy.proto import caffe_pb2

    src = upgrade.read_net(MODEL)
    out = caffe_pb2.NetParameter()
    out.name = src.name
    renamed = {}
    for lp in src.layer:
        if lp.type == "Data":
            if any(rule.phase == caffe_pb2.TEST for rule in lp.include):
                continue
            d = out.layer.add()
            d.name, d.type = "data", "DummyData"
            d.top.extend(["data", "label"])
            d.dummy_data_param.data_filler.add(type="constant", value=0.01)
            d.dummy_data_param.data_filler.add(type="constant", value=0)
            d.dummy_data_param.shape.add(dim=[batch, 3, 227, 227])
            d.dummy_data_param.shape.add(dim=[batch])
            continue
        if any(rule.phase == caffe_pb2.TEST for rule in lp.include):
            continue          # accuracy
        if not blocked and lp.type in ("IntelPack", "IntelUnpack"):
            renamed[lp.top[0]] = lp.bottom[0]
            continue
        new = out.layer.add()
        new.CopyFrom(lp)
        for i, name in enumerate(new.bottom):
            new.bottom[i] = renamed.get(name, name)
    return out


def training_flops(net):
    """(nominal, executed) FLOPs of one forward-backward of a caffepy Net.

    nominal: 2 * MACs of every Convolution and InnerProduct forward as a direct convolution,
    again for the weight gradient, and again for the bottom gradient where the bottom needs one
    (not conv1's: its bottom is the data). executed: the same, except that a Winograd layer
    counts the multiply-adds its a*a GEMMs over tiles really do (tile transforms not counted)."""
    nominal = executed = 0
    for i, layer in enumerate(net.layers):
        if layer.type not in ("Convolution", "InnerProduct"):
            continue
        top = net.top_vecs[i][0]
        passes = 2 + (1 if net.bottom_need_backward[i][0] else 0)
        if layer.type == "Convolution":
            oh, ow = (layer.oh, layer.ow) if hasattr(layer, "oh") else top.shape[2:4]
            fwd = 2 * top.shape[0] * oh * ow * layer.blobs[0].count
        else:
            fwd = 2 * top.shape[0] * layer.blobs[0].count
        nominal += fwd * passes
        if getattr(layer, "winograd", False):
            m, r = layer.tile, layer.kh
            tiles = top.shape[0] * -(-oh // m) * -(-ow // m)
            fwd = 2 * (m + r - 1) ** 2 * tiles * layer.blobs[0].count // (r * r)
        executed += fwd * passes
    return nominal, executed


class CaffepyContender:
    def __init__(self, batch, blocked):
        sys.path.insert(0, REPO)
        from caffepy import log
        from caffepy.net import TRAIN, Net

        log.set_quiet(True)
        self.base_rss = _rss_mb()
        self.net = Net(caffepy_net_param(batch, blocked), TRAIN)
        self.net.forward_from_to()
        self.net.backward_from_to()

    def step(self):
        """One forward-backward as `caffe time` runs it: {forward_ms, backward_ms, layers}."""
        net, clock = self.net, time.perf_counter
        n = len(net.layers)
        fwd, bwd = [0.0] * n, [0.0] * n
        for i in range(n):
            t = clock()
            net.forward_from_to(i, i)
            fwd[i] = clock() - t
        for i in reversed(range(n)):
            t = clock()
            net.backward_from_to(i, i)
            bwd[i] = clock() - t
        return {"forward_ms": sum(fwd) * 1e3, "backward_ms": sum(bwd) * 1e3,
                "layers": [(layer.name, layer.type, fwd[i] * 1e3, bwd[i] * 1e3)
                           for i, layer in enumerate(net.layers)]}

    def summary(self):
        nominal, executed = training_flops(self.net)
        return {"flops": nominal, "executed_flops": executed}


def torch_alexnet():
    import torch.nn as nn

    def conv(c_in, c_out, k, stride=1, pad=0, groups=1):
        return nn.Conv2d(c_in, c_out, k, stride=stride, padding=pad, groups=groups)

    lrn = dict(size=5, alpha=1e-4, beta=0.75, k=1.0)
    return nn.Sequential(
        conv(3, 96, 11, 4), nn.ReLU(inplace=True), nn.LocalResponseNorm(**lrn),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        conv(96, 256, 5, pad=2, groups=2), nn.ReLU(inplace=True), nn.LocalResponseNorm(**lrn),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        conv(256, 384, 3, pad=1), nn.ReLU(inplace=True),
        conv(384, 384, 3, pad=1, groups=2), nn.ReLU(inplace=True),
        conv(384, 256, 3, pad=1, groups=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, ceil_mode=True), nn.Flatten(),
        nn.Linear(9216, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 1000))


class TorchContender:
    def __init__(self, batch, threads, channels_last):
        import torch

        torch.set_num_threads(threads)
        self.base_rss = _rss_mb()
        self.model = torch_alexnet().train()
        self.x = torch.full((batch, 3, 227, 227), 0.01)
        self.y = torch.zeros(batch, dtype=torch.long)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
            self.x = self.x.contiguous(memory_format=torch.channels_last)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.model.zero_grad(set_to_none=False)
        self.step()

    def step(self):
        t0 = time.perf_counter()
        loss = self.loss_fn(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        return {"forward_ms": (t1 - t0) * 1e3, "backward_ms": (time.perf_counter() - t1) * 1e3}

    def summary(self):
        return {}


def worker_sgemm(threads):
    import numpy as np
    n = 4096
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return {"gflops": 2 * n ** 3 / best / 1e9}


def run_worker(args):
    """Build, warm up, say READY; then one timed iteration per `step` line on stdin."""
    if args.worker == "sgemm":
        print("RESULT " + json.dumps(worker_sgemm(args.threads)), flush=True)
        return
    if args.worker in ("intel", "plain"):
        contender = CaffepyContender(args.batch, args.worker == "intel")
    elif args.worker in ("torch", "torch_cl"):
        contender = TorchContender(args.batch, args.threads, args.worker == "torch_cl")
    else:
        raise SystemExit(f"unknown worker {args.worker}")
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        print("RESULT " + json.dumps(contender.step()), flush=True)
    out = dict(contender.summary(), rss_mb=_rss_mb(), base_rss_mb=contender.base_rss)
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------
# driver

def _env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                MKL_NUM_THREADS=str(threads))


def _cmd(kind, batch, threads):
    return [sys.executable, os.path.abspath(__file__), "--worker", kind, "--batch", str(batch),
            "--threads", str(threads)]


def _read_result(proc, kind):
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
        if line.startswith("READY"):
            return "READY"
    err = proc.stderr.read() if proc.stderr else ""
    sys.stderr.write(f"{kind} worker ended early:\n{err[-3000:]}\n")
    return None


def sgemm_peak(threads):
    proc = subprocess.run(_cmd("sgemm", 0, threads), env=_env(threads), capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["gflops"]
    raise SystemExit(proc.stderr[-3000:])


def run_interleaved(kinds, batch, iters, threads):
    """Start each contender (one at a time), then step them in turn; medians per contender."""
    procs = {}
    for kind in kinds:
        p = subprocess.Popen(_cmd(kind, batch, threads), env=_env(threads), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        if _read_result(p, kind) == "READY":
            procs[kind] = p
        else:
            p.kill()
    steps = {kind: [] for kind in procs}
    for _ in range(iters):
        for kind, p in list(procs.items()):
            p.stdin.write("step\n")
            p.stdin.flush()
            r = _read_result(p, kind)
            if r is None:
                del procs[kind]
                continue
            steps[kind].append(r)
    results = {}
    for kind, p in procs.items():
        p.stdin.write("quit\n")
        p.stdin.flush()
        final = _read_result(p, kind)
        p.wait()
        runs = steps[kind]
        if final is None or not runs:
            continue
        fb = sorted(r["forward_ms"] + r["backward_ms"] for r in runs)
        out = dict(final, forward_ms=_median([r["forward_ms"] for r in runs]),
                   backward_ms=_median([r["backward_ms"] for r in runs]), fb_ms=_median(fb),
                   fb_min_ms=fb[0])
        if "layers" in runs[0]:
            out["layers"] = [(name, type_, _median([r["layers"][i][2] for r in runs]),
                              _median([r["layers"][i][3] for r in runs]))
                             for i, (name, type_, _, _) in enumerate(runs[0]["layers"])]
        results[kind] = out
    return results


def _median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def have_torch():
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


LABELS = [("intel", "caffepy intel_alexnet (blocked)"), ("plain", "caffepy AlexNet (NCHW)"),
          ("torch", "PyTorch (NCHW)"), ("torch_cl", "PyTorch (channels_last)")]


def report(batch, iters, threads):
    print(f"\n=== AlexNet training, batch {batch}, {threads} thread(s), median of {iters} "
          f"interleaved iterations ===")
    kinds = ["intel", "plain"] + (["torch", "torch_cl"] if have_torch() else [])
    if not have_torch():
        print("PyTorch not installed (pip install torch==2.13.0): its rows are skipped")
    got = run_interleaved(kinds, batch, iters, threads)
    intel, plain = got.get("intel"), got.get("plain")
    torch_best = None
    for kind, label in LABELS[2:]:
        r = got.get(kind)
        if r and (torch_best is None or r["fb_ms"] < torch_best[1]["fb_ms"]):
            torch_best = (label, r)
    flops = (intel or plain or {}).get("flops")
    print(f"{'':34s} {'forward ms':>11s} {'backward ms':>12s} {'fwd+bwd ms':>11s} {'(best)':>8s} "
          f"{'img/s':>7s} {'GFLOP/s':>8s} {'peak RSS MB':>12s}")
    for kind, label in LABELS:
        if kind not in kinds:
            continue
        r = got.get(kind)
        if r is None:
            print(f"{label:34s} failed (see the messages above)")
            continue
        gf = flops / (r["fb_ms"] / 1e3) / 1e9 if flops else float("nan")
        print(f"{label:34s} {r['forward_ms']:11.1f} {r['backward_ms']:12.1f} {r['fb_ms']:11.1f} "
              f"{r['fb_min_ms']:8.1f} {batch / (r['fb_ms'] / 1e3):7.1f} {gf:8.1f} "
              f"{r['rss_mb']:8.0f} ({r['rss_mb'] - r['base_rss_mb']:.0f} above imports)")
    if intel:
        plain_layers = {name: (f, b) for name, _, f, b in (plain or {}).get("layers", [])}
        print("\nper layer, ms per iteration (medians): caffepy intel_alexnet | plain NCHW caffepy")
        print(f"  {'layer':10s} {'type':16s} {'forward':>9s} {'backward':>9s} | {'forward':>9s} {'backward':>9s}")
        for name, type_, f, b in intel["layers"]:
            pf, pb = plain_layers.get(name, (float("nan"), float("nan")))
            print(f"  {name:10s} {type_:16s} {f:9.1f} {b:9.1f} | {pf:9.1f} {pb:9.1f}")
    return intel, plain, torch_best


def summarize(batch, intel, plain, torch_best, peak):
    print(f"\n--- batch {batch} ---")
    if not intel:
        print("caffepy intel_alexnet failed")
        return
    flops = intel["flops"]
    gf = flops / (intel["fb_ms"] / 1e3) / 1e9
    print(f"training FLOPs per iteration: {flops / 1e9:.1f} GFLOP")
    if torch_best:
        print(f"caffepy intel / {torch_best[0]}: {torch_best[1]['fb_ms'] / intel['fb_ms']:.2f}x "
              f"throughput (goal >= 1.5x); peak RSS {intel['rss_mb']:.0f} MB vs "
              f"{torch_best[1]['rss_mb']:.0f} MB = {intel['rss_mb'] / torch_best[1]['rss_mb']:.2f}x "
              f"(goal <= 1.0x)")
    if plain:
        print(f"caffepy intel / caffepy NCHW: {plain['fb_ms'] / intel['fb_ms']:.2f}x throughput")
    print(f"caffepy intel: {gf:.1f} GFLOP/s = {100 * gf / peak:.1f}% of the sgemm peak over the whole "
          f"iteration (goal >= 50%), counting every convolution as direct")
    executed = intel.get("executed_flops", flops)
    if executed != flops:
        ge = executed / (intel["fb_ms"] / 1e3) / 1e9
        print(f"  its Winograd layers multiply less: {executed / 1e9:.1f} GFLOP executed per "
              f"iteration, {ge:.1f} GFLOP/s = {100 * ge / peak:.1f}% of the peak in executed work")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="also run batch 256")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per contender")
    ap.add_argument("--threads", type=int,
                    default=int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args)
    # the peak is the best sgemm seen before and after the runs: a busy machine lowers it
    peak = sgemm_peak(args.threads)
    load = os.getloadavg()[0]
    print(f"sgemm (numpy float32 4096^3, {args.threads} thread(s)) at start: {peak:.1f} GFLOP/s; "
          f"load average {load:.1f} on {os.cpu_count()} CPU(s)")
    runs = []
    for batch in [args.batch] + ([256] if args.full and args.batch != 256 else []):
        runs.append((batch, report(batch, args.iters, args.threads)))
    end = sgemm_peak(args.threads)
    peak = max(peak, end)
    print(f"\nsgemm at the end: {end:.1f} GFLOP/s; peak used below: {peak:.1f} GFLOP/s; "
          f"load average {os.getloadavg()[0]:.1f}")
    for batch, (intel, plain, torch_best) in runs:
        summarize(batch, intel, plain, torch_best, peak)


if __name__ == "__main__":
    main()
