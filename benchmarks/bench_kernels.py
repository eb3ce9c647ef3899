"""Milliseconds of the kernels of AlexNet's layers (batch 64), with the threading choice.

    .venv/bin/python benchmarks/bench_kernels.py [--batch 64] [--reps 3] [--layers conv1,norm1]
                                                 [--threading both|images|blas] [--median]

Prints one table:
  - conv1..conv5 forward and backward (weight + bias diffs, and the bottom diff except for
    conv1, whose bottom is the data, as in training) under both ways of threading the image
    loop ('images': OpenMP over images, one BLAS thread each; 'blas': images in turn, BLAS
    threads each GEMM; the two alternate run by run so both see the same machine), with the
    GFLOP/s of the default way next to the sgemm peak of the same run (NumPy float32 matmul
    4096^3);
  - pool1/pool2/pool5 (MAX 3x3 stride 2) and norm1/norm2 (LRN 5, 1e-4, 0.75) forward/backward,
    LRN against torch's local_response_norm when torch is installed (benchmarks only);
  - for the same pooling and LRN shapes, a 'blocked' row: the kernels of caffepy.kernels.intel
    on the blocked layout [N, C/V, H, W, V] (V = --width), run alternately with the NCHW
    kernel above it, with the ratio blocked / NCHW of forward + backward (<= 1: not slower);
  - loss: the SoftmaxWithLoss kernels on fc8's output (batch x 1000) forward/backward;
  - update: one fused SGD step (caffepy.kernels.solver) over all of AlexNet's parameters, and
    over its conv weights alone (34,848 to 884,736 values each), timed alternately.
Times are the best (--median: the median) of --reps runs after one warm-up. The load average
and the CPU time of the process (all threads, spinning included) are printed too: on a busy
machine the wall time overstates the kernels' cost, and CPU time / threads is the better guide.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffepy import geometry  # noqa: E402
from caffepy.kernels import intel, loss, normalization, solver, vision  # noqa: E402

# name: (C, H, W, O, kernel, pad, stride, group), bottom shape per image; bvlc_alexnet
CONVS = {
    "conv1": (3, 227, 227, 96, 11, 0, 4, 1),
    "conv2": (96, 27, 27, 256, 5, 2, 1, 2),
    "conv3": (256, 13, 13, 384, 3, 1, 1, 1),
    "conv4": (384, 13, 13, 384, 3, 1, 1, 2),
    "conv5": (384, 13, 13, 256, 3, 1, 1, 2),
}
# name: (C, H, W)
POOLS = {"pool1": (96, 55, 55), "pool2": (256, 27, 27), "pool5": (256, 13, 13)}
NORMS = {"norm1": (96, 55, 55), "norm2": (256, 27, 27)}
CLASSES = 1000
# bvlc_alexnet's learnable parameters: (weight, bias) per conv and fc layer
PARAMS = [(96, 3, 11, 11), (96,), (256, 48, 5, 5), (256,), (384, 256, 3, 3), (384,),
          (384, 192, 3, 3), (384,), (256, 192, 3, 3), (256,), (4096, 9216), (4096,),
          (4096, 4096), (4096,), (1000, 4096), (1000,)]
LRN = dict(size=5, alpha=1e-4, beta=0.75, k=1.0)


# How a row's runs are summed up: the best (default), or the median (--median), which on a busy
# machine shows how often a parallel region waits for a descheduled thread
SUMMARY = min


class Timer:
    """Wall and CPU milliseconds of the runs it has seen, summed up by SUMMARY."""

    def __init__(self):
        self.walls, self.cpus = [], []

    def run(self, fn):
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        self.walls.append(1e3 * (time.perf_counter() - wall))
        self.cpus.append(1e3 * (time.process_time() - cpu))

    @property
    def wall(self):
        return SUMMARY(self.walls)

    @property
    def cpu(self):
        return SUMMARY(self.cpus)


def best_ms(fn, reps, setup=None):
    """Wall ms of fn() over reps runs (after a warm-up), best or median (SUMMARY); setup() runs
    untimed before each."""
    timer = Timer()
    for i in range(reps + 1):
        if setup is not None:
            setup()
        if i:
            timer.run(fn)
        else:
            fn()
    return timer.wall


def sgemm_peak(reps):
    a = np.random.default_rng(0).random((4096, 4096), dtype=np.float32)
    b = a.copy()
    timer = Timer()
    a @ b
    for _ in range(reps):
        timer.run(lambda: a @ b)
    return 2 * 4096 ** 3 / min(timer.walls) / 1e6


def rand(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


def bench_conv(name, N, reps, rng, modes):
    C, H, W, O, k, pad, stride, group = CONVS[name]
    oh, ow = geometry.conv_output_shape(H, W, k, k, pad, pad, stride, stride)
    bottom, weight, bias = rand(rng, N, C, H, W), rand(rng, O, C // group, k, k), rand(rng, O)
    top, top_diff = np.empty((N, O, oh, ow), np.float32), rand(rng, N, O, oh, ow)
    weight_diff, bias_diff = np.zeros_like(weight), np.zeros_like(bias)
    bottom_diff = None if name == "conv1" else np.empty_like(bottom)
    conv_args = (pad, pad, stride, stride, 1, 1, group)
    flops = 2.0 * N * O * oh * ow * (C // group) * k * k
    default = vision.get_conv_threading()
    col = np.empty(vision.conv_workspace_size(C, k, k, oh, ow, weight.size), np.float32)
    timers = {mode: (Timer(), Timer()) for mode in modes}
    for i in range(reps + 1):
        for mode, (fwd, bwd) in timers.items():
            vision.set_conv_threading(mode)
            run_fwd = fwd.run if i else (lambda fn: fn())
            run_bwd = bwd.run if i else (lambda fn: fn())
            run_fwd(lambda: vision.conv_forward(bottom, weight, bias, top, col, *conv_args))
            run_bwd(lambda: vision.conv_backward(top_diff, bottom, weight, weight_diff,
                                                 bias_diff, bottom_diff, col, *conv_args))
    vision.set_conv_threading(default)
    return {"flops": flops, "bwd_flops": flops * (1 if bottom_diff is None else 2), **timers}


def alternate(fns, reps):
    """Wall ms of each fn (SUMMARY), the fns run in turn (one warm-up round) so all see one
    machine."""
    timers = [Timer() for _ in fns]
    for i in range(reps + 1):
        for fn, timer in zip(fns, timers):
            if i:
                timer.run(fn)
            else:
                fn()
    return [t.wall for t in timers]


def blocked_shape(N, C, H, W, width):
    return (N, -(-C // width), H, W, width)


def bench_pool(name, N, reps, rng, width):
    """(NCHW fwd, bwd), (blocked fwd, bwd) of MAX 3x3 stride 2, timed alternately."""
    C, H, W = POOLS[name]
    oh, ow = geometry.pool_output_shape(H, W, 3, 3, 2, 2, 0, 0)
    bottom, top_diff = rand(rng, N, C, H, W), rand(rng, N, C, oh, ow)
    top, mask = np.empty((N, C, oh, ow), np.float32), np.empty((N, C, oh, ow), np.int32)
    bottom_diff = np.empty_like(bottom)
    xb = rand(rng, *blocked_shape(N, C, H, W, width))
    dyb = rand(rng, *blocked_shape(N, C, oh, ow, width))
    yb, dxb = np.empty_like(dyb), np.empty_like(xb)
    maskb = np.empty(dyb.shape, np.int32)
    times = alternate([
        lambda: vision.max_pool_forward(bottom, top, mask, 3, 3, 2, 2, 0, 0),
        lambda: vision.max_pool_backward(top_diff, mask, bottom_diff),
        lambda: intel.pool_max_forward(xb, yb, maskb, 3, 3, 2, 2, 0, 0),
        lambda: intel.pool_max_backward(dyb, maskb, dxb)], reps)
    return times[:2], times[2:]


def bench_lrn(name, N, reps, rng):
    C, H, W = NORMS[name]
    bottom, top_diff = rand(rng, N, C, H, W), rand(rng, N, C, H, W)
    top, scale, bottom_diff = (np.empty_like(bottom) for _ in range(3))
    p = LRN
    fwd = best_ms(lambda: normalization.lrn_across_forward(bottom, top, scale, p["size"],
                                                           p["alpha"], p["beta"], p["k"]), reps)
    bwd = best_ms(lambda: normalization.lrn_across_backward(bottom, scale, top_diff, bottom_diff,
                                                            p["size"], p["alpha"], p["beta"]), reps)
    return fwd, bwd, bench_lrn_torch(bottom, top_diff, reps)


def bench_lrn_blocked(name, N, reps, rng, width):
    """(NCHW fwd, bwd), (blocked fwd, bwd) of the LRN, timed alternately."""
    C, H, W = NORMS[name]
    p = LRN
    bottom, top_diff = rand(rng, N, C, H, W), rand(rng, N, C, H, W)
    top, scale, bottom_diff = (np.empty_like(bottom) for _ in range(3))
    xb = np.zeros(blocked_shape(N, C, H, W, width), np.float32)
    intel.pack(bottom, xb)
    dyb = np.zeros_like(xb)
    intel.pack(top_diff, dyb)
    yb, dxb = np.empty_like(xb), np.empty_like(xb)
    blocked = lrn_blocked_calls(xb, yb, dyb, dxb, C)
    times = alternate([
        lambda: normalization.lrn_across_forward(bottom, top, scale, p["size"], p["alpha"],
                                                 p["beta"], p["k"]),
        lambda: normalization.lrn_across_backward(bottom, scale, top_diff, bottom_diff, p["size"],
                                                  p["alpha"], p["beta"]),
        *blocked], reps)
    return times[:2], times[2:]


def lrn_blocked_calls(x, y, dy, dx, C):
    """Forward and backward calls of the blocked LRN kernels, as BlockedLRN makes them."""
    p = LRN
    args = (C, p["size"], p["alpha"], p["beta"], p["k"])
    return (lambda: intel.lrn_forward(x, y, *args),
            lambda: intel.lrn_backward(x, dy, dx, *args))


def blocked_row(plain, blocked, width):
    ratio = sum(blocked) / sum(plain)
    return (f"{'blocked':7} {blocked[0]:9.1f} {blocked[1]:9.1f}   same on [N, C/{width}, H, W, "
            f"{width}]: fwd+bwd {ratio:.2f}x the NCHW time")


def bench_loss(N, reps, rng):
    """(fwd, bwd) of the SoftmaxWithLoss kernels on N x CLASSES scores, timed alternately."""
    x = rand(rng, N, CLASSES, 1)
    labels = rng.integers(0, CLASSES, (N, 1)).astype(np.int32)
    prob, diff = np.empty_like(x), np.empty_like(x)
    return alternate([lambda: loss.softmax_loss_forward(x, labels, prob),
                      lambda: loss.softmax_loss_backward(prob, labels, 1.0 / N, diff)], reps)


def bench_update(reps, rng):
    """(all parameters, conv weights) ms of one SGD step per parameter, timed alternately."""
    params = [[rand(rng, int(np.prod(shape))) * 0.01 for _ in range(3)] for shape in PARAMS]
    convs = [p for p, shape in zip(params, PARAMS) if len(shape) == 4]

    def update(subset):
        for w, g, h in subset:
            solver.step("SGD", w, g, h, h, 1.0, 0.0005, False, 0.01, 0.9)
    return alternate([lambda: update(params), lambda: update(convs)], reps)


def bench_lrn_torch(bottom, top_diff, reps):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    p = LRN
    x = torch.from_numpy(bottom)
    dy = torch.from_numpy(top_diff)

    def forward():
        return torch.nn.functional.local_response_norm(x, p["size"], p["alpha"], p["beta"],
                                                       p["k"])
    with torch.no_grad():
        fwd = best_ms(forward, reps)
    state = {}

    def setup():
        x.requires_grad_(True)
        x.grad = None
        state["y"] = forward()
    bwd = best_ms(lambda: state["y"].backward(dy), reps, setup)
    x.requires_grad_(False)
    return fwd, bwd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", default="", help="comma-separated subset of conv1-conv5, "
                        "pool1, pool2, pool5, norm1, norm2, loss, update; e.g. conv2,norm1")
    parser.add_argument("--threading", choices=("both", "images", "blas"), default="both",
                        help="conv threadings to time; the first column uses the chosen one")
    parser.add_argument("--median", action="store_true",
                        help="the median of the --reps runs instead of the best")
    parser.add_argument("--width", type=int, default=8,
                        help="block width V of the blocked pooling / LRN rows")
    args = parser.parse_args()
    global SUMMARY
    SUMMARY = statistics.median if args.median else min
    wanted = set(filter(None, args.layers.split(",")))
    rng = np.random.default_rng(0)
    N, reps = args.batch, args.reps

    print(f"batch {N}, {os.cpu_count()} cpus, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, "
          f"load average {os.getloadavg()[0]:.2f}, {'median' if args.median else 'best'} of {reps}")
    # the peak (for the conv rows) is sampled before every conv layer and after the last layer,
    # and the best kept, so a burst of load from elsewhere during one sample does not inflate
    # the percentages
    conv_names = [name for name in CONVS if not wanted or name in wanted]
    peak = sgemm_peak(reps) if conv_names else 0.0
    default = vision.get_conv_threading()
    modes = ("images", "blas") if args.threading == "both" else (args.threading,)
    if default not in modes:
        default = modes[0]
    print(f"conv threading in the first columns: '{default}'\n")
    print(f"{'layer':7} {'fwd ms':>9} {'bwd ms':>9}   {'notes'}")
    conv_rows = []
    for name in conv_names:
        peak = max(peak, sgemm_peak(1))
        row = bench_conv(name, N, reps, rng, modes)
        fwd, bwd = row[default]
        other = "blas" if default == "images" else "images"
        versus = (f"; '{other}' threading: {row[other][0].wall:.1f} / {row[other][1].wall:.1f} ms"
                  if other in row else "")
        gf_f = row["flops"] / fwd.wall / 1e6
        gf_b = row["bwd_flops"] / bwd.wall / 1e6
        conv_rows.append((name, gf_f, gf_b))
        print(f"{name:7} {fwd.wall:9.1f} {bwd.wall:9.1f}   {gf_f:5.1f} / {gf_b:5.1f} GFLOP/s "
              f"fwd/bwd; cpu {fwd.cpu:.0f} / {bwd.cpu:.0f} ms{versus}", flush=True)
    for name in POOLS:
        if wanted and name not in wanted:
            continue
        (fwd, bwd), blocked = bench_pool(name, N, reps, rng, args.width)
        print(f"{name:7} {fwd:9.1f} {bwd:9.1f}   MAX 3x3 stride 2 on "
              f"{N}x{'x'.join(map(str, POOLS[name]))}", flush=True)
        print(blocked_row((fwd, bwd), blocked, args.width), flush=True)
    for name in NORMS:
        if wanted and name not in wanted:
            continue
        fwd, bwd, torch_ms = bench_lrn(name, N, reps, rng)
        vs = ("torch not installed" if torch_ms is None else
              f"torch local_response_norm {torch_ms[0]:.1f} / {torch_ms[1]:.1f} ms "
              f"({torch_ms[0] / fwd:.1f}x / {torch_ms[1] / bwd:.1f}x slower)")
        print(f"{name:7} {fwd:9.1f} {bwd:9.1f}   LRN 5 on {N}x{'x'.join(map(str, NORMS[name]))}; "
              f"{vs}", flush=True)
        plain, blocked = bench_lrn_blocked(name, N, reps, rng, args.width)
        print(f"{'':7} {plain[0]:9.1f} {plain[1]:9.1f}   NCHW again, alternated with the row "
              f"below", flush=True)
        print(blocked_row(plain, blocked, args.width), flush=True)
    if not wanted or "loss" in wanted:
        fwd, bwd = bench_loss(N, reps, rng)
        print(f"{'loss':7} {fwd:9.2f} {bwd:9.2f}   SoftmaxWithLoss on {N}x{CLASSES}", flush=True)
    if not wanted or "update" in wanted:
        every, conv_weights = bench_update(reps, rng)
        print(f"{'update':7} {every:9.2f} {conv_weights:9.2f}   SGD step: all {len(PARAMS)} parameters "
              f"(61M values) / the conv weights alone (the 'bwd' column)", flush=True)
    print(f"\nload average now {os.getloadavg()[0]:.2f}")
    if not conv_names:
        return
    peak = max(peak, sgemm_peak(reps))
    print(f"sgemm peak (numpy float32 matmul 4096^3, best sample): {peak:.1f} GFLOP/s")
    for name, gf_f, gf_b in conv_rows:
        print(f"  {name}: {100 * gf_f / peak:3.0f}% of peak forward, {100 * gf_b / peak:3.0f}% "
              f"backward")


if __name__ == "__main__":
    main()
