"""The fused units (Net.fusions: BatchNorm + Scale (+ ReLU), Eltwise SUM + ReLU (+ Split))
against the same layers with only their first two fused (the pairs) and one layer at a time, in
one process, rounds interleaved: training forward and backward of every unit.

    python benchmarks/bench_fusion.py [--net resnet50] [--batch 16] [--rounds 5]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import nets  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--net", default="resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from caffepy import log
    from caffepy.net import TRAIN, Net
    log.set_quiet(True)
    net = Net(nets.train_net(args.net, args.batch), TRAIN)
    data = net.blobs["data"]
    data.data[...] = np.random.default_rng(0).standard_normal(data.shape, dtype=np.float32)
    fused = dict(net.fusions)
    if not fused:
        raise SystemExit(f"bench_fusion: {args.net} has no fused units")
    variants = {"pairs only": {bn: bn + 1 for bn in fused}, "fused": fused, "one by one": {}}
    net.forward_from_to()
    net.backward_from_to()
    found = {name: ([], []) for name in variants}
    for r in range(args.rounds + 1):
        for name, units in variants.items():
            net.fusions = units
            forward = backward = 0.0
            for bn, last in fused.items():
                t = time.perf_counter()
                net.forward_from_to(bn, last)
                forward += time.perf_counter() - t
                t = time.perf_counter()
                net.backward_from_to(last, bn)
                backward += time.perf_counter() - t
            if r:                                  # the first round warms up
                found[name][0].append(forward)
                found[name][1].append(backward)
    kinds = [net.layers[first].type for first in fused]
    threes = sum(last - first == 2 for first, last in fused.items())
    print(f"{args.net} b{args.batch}: {kinds.count('BatchNorm')} BatchNorm + Scale units, "
          f"{kinds.count('Eltwise')} Eltwise + ReLU units, {threes} of them with a third layer; "
          f"medians of {args.rounds} interleaved rounds, per training iteration")
    total = {}
    for name, (forward, backward) in found.items():
        f, b = statistics.median(forward), statistics.median(backward)
        total[name] = f + b
        print(f"  {name:11s} forward {f * 1e3:6.0f} ms  backward {b * 1e3:6.0f} ms  total {(f + b) * 1e3:6.0f} ms")
    print(f"  fused is {total['one by one'] / total['fused']:.2f}x the layers one by one, "
          f"{total['pairs only'] / total['fused']:.2f}x the pairs alone")


if __name__ == "__main__":
    main()
