"""Forward and backward time of the zoo nets (and BVLC AlexNet) at their published input size.

    .venv/bin/python models/zoo/time_zoo.py [--batch 1] [--repeats 2] [name-substring ...]

Prints, per net: parameters, best-of-repeats forward and backward milliseconds, and images/s for
forward + backward. Weights are random (the deploy fillers); BatchNorm statistics are set to
mean 0, variance 1, so the numbers are finite.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from caffepy import log, upgrade  # noqa: E402
from caffepy.net import TEST, Net  # noqa: E402

NETS = ["mobilenet_v1_deploy.prototxt", "googlenet_deploy.prototxt", "resnet50_deploy.prototxt",
        "resnext50_32x4d_deploy.prototxt", "vgg16_deploy.prototxt",
        os.path.join(os.path.dirname(REPO), "shared", "reference-models", "bvlc",
                     "bvlc_alexnet__deploy.prototxt")]


def time_net(path, batch, repeats):
    param = upgrade.read_net(path if os.path.isabs(path) else os.path.join(HERE, path))
    param.force_backward = True
    first = param.layer[0]
    if first.type == "Input":
        first.input_param.shape[0].dim[0] = batch
    net = Net(param, TEST)
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[1].data[...] = 1
            layer.blobs[2].data[...] = 1
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
    out = net.outputs[0]
    fwd, bwd = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        net.forward_from_to()
        t1 = time.perf_counter()
        net.blobs[out].diff[...] = 1e-3
        net.backward_from_to()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    params = sum(b.count for blobs in net.params.values() for b in blobs)
    return params, min(fwd), min(bwd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("names", nargs="*", help="only nets whose file name contains one of these")
    args = ap.parse_args(argv)
    log.set_quiet(True)
    print(f"{'net':<34} {'params':>12} {'forward ms':>11} {'backward ms':>12} {'img/s f+b':>10}")
    for path in NETS:
        name = os.path.basename(path)
        if args.names and not any(s in name for s in args.names):
            continue
        if not os.path.exists(path if os.path.isabs(path) else os.path.join(HERE, path)):
            print(f"{name:<34} (not on this machine)")
            continue
        params, f, b = time_net(path, args.batch, args.repeats)
        print(f"{name:<34} {params:>12,} {1e3 * f:>11.0f} {1e3 * b:>12.0f} {args.batch / (f + b):>10.2f}",
              flush=True)


if __name__ == "__main__":
    main()
