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
timings are the net alone. Timing follows `caffe time`: one warm-up pass, then per-layer
forward and backward over --iters iterations.
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
    from caffepy import prototxt
    from caffepy.proto import caffe_pb2

    src = prototxt.read_net(MODEL)
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
    """FLOPs of one forward-backward of a caffepy Net: 2 * MACs of every Convolution and
    InnerProduct forward, again for the weight gradient, and again for the bottom gradient where
    the bottom needs one (not conv1's: its bottom is the data)."""
    total = 0
    for i, layer in enumerate(net.layers):
        if layer.type not in ("Convolution", "InnerProduct"):
            continue
        top = net.top_vecs[i][0]
        if layer.type == "Convolution":
            oh, ow = (layer.oh, layer.ow) if hasattr(layer, "oh") else top.shape[2:4]
            fwd = 2 * top.shape[0] * oh * ow * layer.blobs[0].count
        else:
            fwd = 2 * top.shape[0] * layer.blobs[0].count
        total += fwd * (2 + (1 if net.bottom_need_backward[i][0] else 0))
    return total


def worker_caffepy(batch, iters, blocked):
    sys.path.insert(0, REPO)
    from caffepy import log
    from caffepy.net import TRAIN, Net

    log.set_quiet(True)
    base_rss = _rss_mb()
    net = Net(caffepy_net_param(batch, blocked), TRAIN)
    n = len(net.layers)
    net.forward_from_to()
    net.backward_from_to()
    fwd = [0.0] * n
    bwd = [0.0] * n
    clock = time.perf_counter
    start = clock()
    for _ in range(iters):
        for i in range(n):
            t = clock()
            net.forward_from_to(i, i)
            fwd[i] += clock() - t
        for i in reversed(range(n)):
            t = clock()
            net.backward_from_to(i, i)
            bwd[i] += clock() - t
    total = clock() - start
    return {"forward_ms": sum(fwd) * 1e3 / iters, "backward_ms": sum(bwd) * 1e3 / iters,
            "fb_ms": total * 1e3 / iters, "flops": training_flops(net),
            "layers": [(layer.name, layer.type, fwd[i] * 1e3 / iters, bwd[i] * 1e3 / iters)
                       for i, layer in enumerate(net.layers)],
            "rss_mb": _rss_mb(), "base_rss_mb": base_rss}


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


def worker_torch(batch, iters, threads, channels_last):
    import torch

    torch.set_num_threads(threads)
    base_rss = _rss_mb()
    model = torch_alexnet().train()
    x = torch.full((batch, 3, 227, 227), 0.01)
    y = torch.zeros(batch, dtype=torch.long)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    model.zero_grad(set_to_none=False)
    step()
    f = b = 0.0
    for _ in range(iters):
        tf, tb = step()
        f += tf
        b += tb
    return {"forward_ms": f * 1e3 / iters, "backward_ms": b * 1e3 / iters,
            "fb_ms": (f + b) * 1e3 / iters, "rss_mb": _rss_mb(), "base_rss_mb": base_rss}


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
    if args.worker == "sgemm":
        out = worker_sgemm(args.threads)
    elif args.worker in ("intel", "plain"):
        out = worker_caffepy(args.batch, args.iters, args.worker == "intel")
    elif args.worker in ("torch", "torch_cl"):
        out = worker_torch(args.batch, args.iters, args.threads, args.worker == "torch_cl")
    else:
        raise SystemExit(f"unknown worker {args.worker}")
    print("RESULT " + json.dumps(out))


# ---------------------------------------------------------------------------------------------
# driver

def spawn(kind, batch, iters, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--batch", str(batch),
           "--iters", str(iters), "--threads", str(threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
    return None


def have_torch():
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


def report(batch, iters, threads, peak):
    print(f"\n=== AlexNet training, batch {batch}, {threads} thread(s), {iters} timed iterations ===")
    intel = spawn("intel", batch, iters, threads)
    plain = spawn("plain", batch, iters, threads)
    results = [("caffepy intel_alexnet (blocked)", intel), ("caffepy AlexNet (NCHW)", plain)]
    torch_best = None
    if have_torch():
        for kind, label in (("torch", "PyTorch (NCHW)"), ("torch_cl", "PyTorch (channels_last)")):
            r = spawn(kind, batch, iters, threads)
            results.append((label, r))
            if r and (torch_best is None or r["fb_ms"] < torch_best[1]["fb_ms"]):
                torch_best = (label, r)
    else:
        print("PyTorch not installed (pip install torch==2.13.0): its rows are skipped")

    flops = (intel or plain or {}).get("flops")
    print(f"{'':34s} {'forward ms':>11s} {'backward ms':>12s} {'fwd+bwd ms':>11s} {'img/s':>8s} "
          f"{'GFLOP/s':>8s} {'% peak':>7s} {'peak RSS MB':>12s}")
    for label, r in results:
        if r is None:
            print(f"{label:34s} failed (see the messages above)")
            continue
        gf = flops / (r["fb_ms"] / 1e3) / 1e9 if flops else float("nan")
        print(f"{label:34s} {r['forward_ms']:11.1f} {r['backward_ms']:12.1f} {r['fb_ms']:11.1f} "
              f"{batch / (r['fb_ms'] / 1e3):8.1f} {gf:8.1f} {100 * gf / peak:6.1f}% "
              f"{r['rss_mb']:8.0f} ({r['rss_mb'] - r['base_rss_mb']:.0f} above imports)")
    if intel:
        print(f"\ntraining FLOPs per iteration: {flops / 1e9:.1f} GFLOP; sgemm peak {peak:.1f} GFLOP/s")
        if torch_best:
            print(f"caffepy intel / {torch_best[0]}: {torch_best[1]['fb_ms'] / intel['fb_ms']:.2f}x "
                  f"throughput (goal >= 1.5x); memory {intel['rss_mb'] / torch_best[1]['rss_mb']:.2f}x "
                  f"of PyTorch's peak RSS (goal <= 1.0x)")
        if plain:
            print(f"caffepy intel / caffepy NCHW: {plain['fb_ms'] / intel['fb_ms']:.2f}x throughput")
        print(f"caffepy intel: {100 * flops / (intel['fb_ms'] / 1e3) / 1e9 / peak:.1f}% of the sgemm "
              f"peak over the whole iteration (goal >= 50%)")
        print("\nper layer (caffepy intel_alexnet), ms per iteration:")
        print(f"  {'layer':14s} {'type':14s} {'forward':>9s} {'backward':>9s}")
        for name, type_, f, b in intel["layers"]:
            print(f"  {name:14s} {type_:14s} {f:9.2f} {b:9.2f}")
    return intel, plain, torch_best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="also run batch 256")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per measurement")
    ap.add_argument("--threads", type=int,
                    default=int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return run_worker(args)
    peak = spawn("sgemm", 0, 0, args.threads)["gflops"]
    load = os.getloadavg()[0]
    print(f"sgemm peak (numpy float32 4096^3, {args.threads} thread(s)): {peak:.1f} GFLOP/s; "
          f"load average at start {load:.1f} on {os.cpu_count()} CPU(s)")
    for batch in [args.batch] + ([256] if args.full and args.batch != 256 else []):
        report(batch, args.iters, args.threads, peak)


if __name__ == "__main__":
    main()
