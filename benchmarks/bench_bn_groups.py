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
        runs[name] = (net, [], [])         # the net, its iterations, its units' best times
    nets_ = [net for net, _, _ in runs.values()]
    for r in range(args.rounds + 1):
        for name, (net, iterations, _) in runs.items():
            t = time.perf_counter()
            net.forward_backward()
            if r:                                  # the first round warms up
                iterations.append(time.perf_counter() - t)
    # the BatchNorm units unit by unit, the two nets in turn, the best of `rounds` each: a
    # sum of minima that a busy machine disturbs less than whole iterations
    for unit in _bn_units(nets_[0]):
        best = [float("inf")] * len(nets_)
        for r in range(args.rounds + 1):
            for i, net in enumerate(nets_):
                t = time.perf_counter()
                net.forward_from_to(*unit)
                net.backward_from_to(unit[1], unit[0])
                if r:
                    best[i] = min(best[i], time.perf_counter() - t)
        for (_, _, units), b in zip(runs.values(), best):
            units.append(b)
    count = len(_bn_units(nets_[0]))
    print(f"{args.net} b{args.batch}: {count} BatchNorm units; {args.rounds} interleaved rounds: "
          f"iteration median (min), BatchNorm units the sum of each unit's best, ms")
    base = None
    for name, (_, iterations, units) in runs.items():
        it, un = statistics.median(iterations), sum(units)
        base = base or (it, un)
        print(f"  {name:16s} iteration {it * 1e3:7.0f} ({min(iterations) * 1e3:5.0f})   "
              f"BatchNorm units {un * 1e3:6.1f}   x{it / base[0]:.3f} / x{un / base[1]:.3f}")


if __name__ == "__main__":
    main()
