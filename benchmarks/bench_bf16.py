"""bf16's accuracy against float32 (caffepy/precision.py), on the nets trained here on the bundled
digits (benchmarks/digits_nets.py: LeNet, a CIFAR-style net, a small ResNet): on the bf16
kernels where the CPU has AMX-BF16 or AVX512_BF16, else emulated (the same products; speed is
bench_bf16_speed.py's).

For each: float32 training, then the held-out digits scored by the float32 net and by the same
weights in bf16 (top-1 of each, the points bf16 loses, the share of digits where their top-1
agree); for the nets named by --train_bf16 (default resnet), the same training run in bf16
(master weights float32), scored in bf16, and its top-1 against the float32 run's; a last row
per net gives the means over the seeds (one training run differs from another by its seed far
more than by bf16: the ResNet's float32 top-1 went from 95.6 to 99.0 over the default seeds).

    python benchmarks/bench_bf16.py [--nets lenet cifar resnet]
        [--iterations N] [--train_bf16 resnet] [--seeds 1701 1 2]
"""
import argparse
import os
import sys
import time

import numpy as np

import caffepy
from caffepy import precision

sys.path.insert(0, os.path.dirname(__file__))
from digits_nets import NETS, SEEDS, digits, predict, train  # noqa: E402


def inference(name, weights, data):
    """(f32 top-1 %, bf16 top-1 %, agreement %) of one trained net on the held-out digits."""
    y = data[3]
    f32, bf16 = predict(name, weights, data, "f32"), predict(name, weights, data, "bf16")
    return 100 * np.mean(f32 == y), 100 * np.mean(bf16 == y), 100 * np.mean(f32 == bf16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS))
    ap.add_argument("--train_bf16", nargs="*", default=["resnet"], choices=list(NETS))
    ap.add_argument("--iterations", type=int, help="training iterations (default: per net)")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    args = ap.parse_args()
    if precision.kernel() is None:          # no kernels here: the emulation's same products
        os.environ.setdefault("CAFFEPY_BF16", "emulate")
    caffepy.log.set_quiet(True)
    data = digits()
    print(f"bf16: {precision.availability()}")
    print(f"held-out digits: {len(data[3])}; one digit = {100 / len(data[3]):.2f} points")
    print(f"{'net':7s} {'seed':>5s} {'f32 top-1':>9s} {'bf16 inf':>9s} {'lost':>6s} {'agree':>7s} "
          f"{'bf16-trained':>12s} {'diff':>6s} {'f32 s':>6s} {'bf16 s':>6s}", flush=True)
    for name in args.nets:
        rows = []
        for seed in args.seeds:
            t = time.perf_counter()
            weights = train(name, data, "f32", args.iterations, seed)
            t32 = time.perf_counter() - t
            top32, top16, agree = inference(name, weights, data)
            top_t16 = t16 = None
            if name in args.train_bf16:
                t = time.perf_counter()
                trained16 = train(name, data, "bf16", args.iterations, seed)
                t16 = time.perf_counter() - t
                top_t16 = 100 * np.mean(predict(name, trained16, data, "bf16") == data[3])
            rows.append((top32, top16, agree, top_t16))
            print(_row(name, seed, top32, top16, agree, top_t16, t32, t16), flush=True)
        if len(rows) > 1:
            means = [None if None in column else sum(column) / len(column) for column in zip(*rows)]
            print(_row(name, "mean", *means), flush=True)


def _row(name, seed, top32, top16, agree, top_t16, t32=None, t16=None):
    row = f"{name:7s} {seed:>5} {top32:9.2f} {top16:9.2f} {top32 - top16:6.2f} {agree:7.2f}"
    row += f" {top_t16:12.2f} {top32 - top_t16:6.2f}" if top_t16 is not None else f" {'':12s} {'':6s}"
    if t32 is not None:
        row += f" {t32:6.1f}" + (f" {t16:6.1f}" if t16 is not None else "")
    return row

if __name__ == "__main__":
    sys.exit(main())
