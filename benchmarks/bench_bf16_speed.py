"""bf16's speed against float32 (caffepy/precision.py: bf16 on the AMX-BF16 or AVX512_BF16
kernels), per net: the TEST forward at each batch (on AMX-BF16 its convolutions run channels-last,
caffepy/layers/bf16.py), and a training iteration (TRAIN-phase forward + backward from the
output, force_backward) at --train_batch (0: none). Both precisions' nets are built in
one process and timed alternating, best of --repeats each, and the ratio f32 ms / bf16 ms is
printed (the machine's other load then hits both alike). Weights are random (the deploy
fillers); BatchNorm statistics mean 0, variance 1.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_bf16_speed.py \\
        [--batches 1 16] [--train_batch 16] [--repeats 5] [alexnet googlenet resnet50]
CAFFEPY_BF16=avx512_bf16 times the AVX512_BF16 kernels where AMX is there.
"""
import argparse
import functools
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from caffepy import log, precision, upgrade  # noqa: E402
from caffepy.net import TEST, TRAIN, Net  # noqa: E402
from timing import alternate  # noqa: E402

NETS = {"alexnet": os.path.join(os.path.dirname(REPO), "shared", "reference-models", "bvlc",
                                "bvlc_alexnet__deploy.prototxt"),
        "googlenet": os.path.join(REPO, "models", "zoo", "googlenet_deploy.prototxt"),
        "resnet50": os.path.join(REPO, "models", "zoo", "resnet50_deploy.prototxt")}


def build(path, batch, phase, name):
    param = upgrade.read_net(path)
    param.force_backward = phase == TRAIN
    param.layer[0].input_param.shape[0].dim[0] = batch
    precision.set_precision(name)
    try:
        net = Net(param, phase)
    finally:
        precision.set_precision("f32")
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[1].data[...] = 1
            layer.blobs[2].data[...] = 1
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
    return net


def step(net, train):
    net.forward_from_to()
    if train:
        net.blobs[net.outputs[0]].diff[...] = 1e-3
        net.backward_from_to()


def compare(path, batch, train, repeats):
    """{precision: best ms} of one forward (or training iteration), alternating (timing.py's
    alternate: a warm-up round first, for the algorithm choices and buffers)."""
    nets = {name: build(path, batch, TRAIN if train else TEST, name) for name in ("f32", "bf16")}
    walls = alternate([functools.partial(step, net, train) for net in nets.values()], repeats)
    return dict(zip(nets, walls))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--train_batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("nets", nargs="*", help=f"of {', '.join(NETS)} (default: all)")
    args = ap.parse_args(argv)
    unknown = set(args.nets) - set(NETS)
    if unknown:
        ap.error(f"unknown net(s) {', '.join(sorted(unknown))}; known: {', '.join(NETS)}")
    log.set_quiet(True)
    path = precision.kernel()
    if path is None:
        sys.exit(f"bench_bf16_speed: no bf16 kernels run here: {precision.availability()}")
    print(f"bf16 on {path[1]} kernels; best of {args.repeats}, runs alternating")
    print(f"{'net':<10} {'pass':<16} {'f32 ms':>9} {'bf16 ms':>9} {'bf16 speed-up':>14}")
    for name in args.nets or list(NETS):
        runs = [(f"forward b{b}", b, False) for b in args.batches]
        if args.train_batch:
            runs.append((f"train b{args.train_batch}", args.train_batch, True))
        for label, batch, train in runs:
            ms = compare(NETS[name], batch, train, args.repeats)
            print(f"{name:<10} {label:<16} {ms['f32']:>9.1f} {ms['bf16']:>9.1f} "
                  f"{ms['f32'] / ms['bf16']:>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
