"""The cost of Intel Caffe's BatchNorm statistics groups (NetParameter.bn_stats_batch_size):
the same training net with whole-batch statistics and with groups, in one process, rounds
interleaved: a whole training iteration, and the BatchNorm units (BatchNorm, or the fused
BatchNorm + Scale (+ ReLU)) alone, forward and backward.

    python benchmarks/bench_bn_groups.py [--net resnet50] [--batch 16] [--group 8] [--rounds 5]
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


def _bn_units(net):
    """(first, last) of each unit that starts with a BatchNorm."""
    return [(first, last) for first, last in net.units() if net.layers[first].type == "BatchNorm"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--net", default="resnet50")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from caffepy import log
    from caffepy.net import TRAIN, Net
    log.set_quiet(True)
    runs = {}
    for name, group in (("whole batch", None), (f"groups of {args.group}", args.group)):
        param = nets.train_net(args.net, args.batch)
        if group is not None:
            param.bn_stats_batch_size = group
        net = Net(param, TRAIN)
        data = net.blobs["data"]
        data.data[...] = np.random.default_rng(0).standard_normal(data.shape, dtype=np.float32)
        runs[name] = (net, [], [])
    for r in range(args.rounds + 1):
        for name, (net, iterations, units) in runs.items():
            t = time.perf_counter()
            net.forward_backward()
            iteration = time.perf_counter() - t
            t = time.perf_counter()
            for first, last in _bn_units(net):
                net.forward_from_to(first, last)
                net.backward_from_to(last, first)
            if r:                                  # the first round warms up
                iterations.append(iteration)
                units.append(time.perf_counter() - t)
    count = len(_bn_units(next(iter(runs.values()))[0]))
    print(f"{args.net} b{args.batch}: {count} BatchNorm units; medians (min) of {args.rounds} "
          f"interleaved rounds, ms")
    base = None
    for name, (_, iterations, units) in runs.items():
        it, un = statistics.median(iterations), statistics.median(units)
        base = base or (it, un)
        print(f"  {name:16s} iteration {it * 1e3:7.0f} ({min(iterations) * 1e3:5.0f})   "
              f"BatchNorm units {un * 1e3:6.1f} ({min(units) * 1e3:6.1f})   "
              f"x{it / base[0]:.3f} / x{un / base[1]:.3f}")


if __name__ == "__main__":
    main()
