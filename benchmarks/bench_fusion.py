"""The fused BatchNorm + Scale pairs (Net.fusions) against the same pairs run one layer at a
time, in one process, rounds interleaved: training forward and backward of every pair.

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
        raise SystemExit(f"bench_fusion: {args.net} has no fused pairs")
    net.forward_from_to()
    net.backward_from_to()
    found = {"fused": ([], []), "one by one": ([], [])}
    for r in range(args.rounds + 1):
        for name, pairs in (("fused", fused), ("one by one", {})):
            net.fusions = pairs
            forward = backward = 0.0
            for bn, scale in fused.items():
                t = time.perf_counter()
                net.forward_from_to(bn, scale)
                forward += time.perf_counter() - t
                t = time.perf_counter()
                net.backward_from_to(scale, bn)
                backward += time.perf_counter() - t
            if r:                                  # the first round warms up
                found[name][0].append(forward)
                found[name][1].append(backward)
    print(f"{args.net} b{args.batch}: {len(fused)} BatchNorm + Scale pairs, medians of {args.rounds} "
          f"interleaved rounds, per training iteration")
    for name, (forward, backward) in found.items():
        f, b = statistics.median(forward), statistics.median(backward)
        print(f"  {name:11s} forward {f * 1e3:6.0f} ms  backward {b * 1e3:6.0f} ms  total {(f + b) * 1e3:6.0f} ms")
    ratio = (statistics.median(found["one by one"][0]) + statistics.median(found["one by one"][1])) / \
        (statistics.median(found["fused"][0]) + statistics.median(found["fused"][1]))
    print(f"  fused is {ratio:.2f}x the layers one by one")


if __name__ == "__main__":
    main()
