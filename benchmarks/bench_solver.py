"""Time one solver update (ApplyUpdate) over AlexNet's 61M parameters, per solver type,
with the compiled fused kernel (cext/solver.pyx) and with NumPy only.

    .venv/bin/python benchmarks/bench_solver.py [--repeat 5]

The update is memory bound: the figure to compare is GB/s against a plain copy.

Then SGD's update keeping every parameter's data and history from before it (what
parallel/failsafe.py's Keeper needs for a parameter updated while other gradients still
travel): copied first, then updated (np.copyto, as the Keeper did), against the fused
update writing the copies in its own pass (step's keep_*), alternating, median of the rounds.
"""
import argparse
import time

import numpy as np

from caffepy.blob import Blob
from caffepy.proto import caffe_pb2
from caffepy.solvers import updates

ALEXNET = [(96, 3, 11, 11), (96,), (256, 48, 5, 5), (256,), (384, 256, 3, 3), (384,),
           (384, 192, 3, 3), (384,), (256, 192, 3, 3), (256,), (4096, 9216), (4096,),
           (4096, 4096), (4096,), (1000, 4096), (1000,)]


class _Params:
    """Just what ApplyUpdate reads from a Net."""

    def __init__(self, shapes):
        gen = np.random.default_rng(0)
        self.learnable_params = []
        for i, shape in enumerate(shapes):
            b = Blob(shape, name=f"p{i}")
            b.data[...] = gen.standard_normal(shape, np.float32) * 0.01
            b.diff[...] = gen.standard_normal(shape, np.float32) * 0.001
            self.learnable_params.append(b)
        self.params_lr = [1.0 if len(s) > 1 else 2.0 for s in shapes]
        self.params_weight_decay = [1.0 if len(s) > 1 else 0.0 for s in shapes]


def make(type_, params, use_kernels):
    """One solver update over `params`, as a function of no arguments."""
    p = caffe_pb2.SolverParameter(type=type_, base_lr=0.01, lr_policy="fixed", weight_decay=0.0005,
                                  momentum=0.9 if type_ not in ("AdaGrad", "RMSProp") else 0.0)
    rule = updates.make_rule(p, [b.shape for b in params.learnable_params])
    fused = updates.kernels() if use_kernels else None

    def sumsq(index, array):
        flat = array.reshape(-1)
        return float(np.dot(flat, flat))

    return lambda: updates.apply_update(p, params, rule, p.base_lr, 0, sumsq, fused)


def keeping(params, repeat):
    """ms of SGD's update with the values before it kept: (copies first, fused keep)."""
    p = caffe_pb2.SolverParameter(type="SGD", base_lr=0.01, lr_policy="fixed", weight_decay=0.0005,
                                  momentum=0.9)
    blobs = params.learnable_params
    rule = updates.make_rule(p, [b.shape for b in blobs])
    fused = updates.kernels()
    keep = {i: (np.zeros_like(b.data), [np.zeros_like(h) for h in rule.state(i)])
            for i, b in enumerate(blobs)}

    def sumsq(index, array):
        return 0.0

    def copies_first():
        for i, b in enumerate(blobs):
            np.copyto(keep[i][0], b.data)
            for out, h in zip(keep[i][1], rule.state(i)):
                np.copyto(out, h)
        updates.apply_update(p, params, rule, p.base_lr, 0, sumsq, fused)

    def fused_keep():
        updates.apply_update(p, params, rule, p.base_lr, 0, sumsq, fused, keep=keep)

    def plain():
        updates.apply_update(p, params, rule, p.base_lr, 0, sumsq, fused)

    times = {"update alone": [], "copies, then update": [], "fused keep": []}
    runs = dict(zip(times, (plain, copies_first, fused_keep)))
    for run in runs.values():
        run()
    for _ in range(repeat):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {name: 1e3 * float(np.median(ts)) for name, ts in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    params = _Params(ALEXNET)
    count = sum(b.count for b in params.learnable_params)
    a = np.ones(count, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(args.repeat):
        np.copyto(b, a)
    copy_gbs = 2 * a.nbytes * args.repeat / (time.perf_counter() - t) / 1e9
    print(f"AlexNet parameters: {count / 1e6:.1f}M; memory copy bandwidth {copy_gbs:.1f} GB/s")
    print(f"{'solver':10} {'path':8} {'ms/update':>10} {'GB/s (6 arrays)':>16}")
    modes = [True, False] if updates.kernels() is not None else [False]
    for type_ in ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"):
        for use in modes:
            update = make(type_, params, use)
            update()
            t = time.perf_counter()
            for _ in range(args.repeat):
                update()
            dt = (time.perf_counter() - t) / args.repeat
            # the fused SGD pass reads data, diff, history and writes all three
            moved = 6 * 4 * count / dt / 1e9
            print(f"{type_:10} {'fused' if use else 'numpy':8} {dt * 1e3:10.1f} {moved:16.1f}")
    if updates.kernels() is not None:
        ms = keeping(params, args.repeat)
        base = ms["update alone"]
        print("SGD keeping the values before the update (the emergency snapshot's copies):")
        for name, t in ms.items():
            extra = "" if name == "update alone" else f"  (+{t - base:.1f} ms for the copies)"
            print(f"  {name:20} {t:8.1f} ms{extra}")
        print(f"  copies' cost, separate / fused: "
              f"{(ms['copies, then update'] - base) / max(ms['fused keep'] - base, 1e-3):.2f}x")


if __name__ == "__main__":
    main()
