"""bf16's accuracy against float32 (caffepy/precision.py; emulated: no CPU here runs bf16 fast,
so no speed is measured), on nets trained here on the bundled digits (examples/digits: 1,501
training and 296 held-out 8x8 digits, upscaled to 16x16 with INTER_LINEAR, mean subtracted and
scaled by 1/256, as the digits demo's LMDBs and transform_param give them):

    lenet    the digits demo's LeNet (examples/digits/lenet_train_test.prototxt, its solver)
    cifar    Caffe's cifar10_quick shape (conv 32 5x5 - pool - conv 32 - pool - conv 64 - pool -
             ip 64 - ip 10), on 16x16 inputs
    resnet   a small ResNet: conv 16 3x3, three basic blocks (16, 32 /2, 64 /2; BatchNorm,
             Scale, ReLU, projection shortcuts), global average pooling, ip 10

For each: float32 training, then the held-out digits scored by the float32 net and by the same
weights in bf16 (top-1 of each, the points bf16 loses, the share of digits where their top-1
agree); for the nets named by --train_bf16 (default resnet), the same training run in bf16
(master weights float32), scored in bf16, and its top-1 against the float32 run's; a last row
per net gives the means over the seeds (one training run differs from another by its seed far
more than by bf16: the ResNet's float32 top-1 went from 95.6 to 99.0 over the default seeds).

    CAFFEPY_BF16=emulate python benchmarks/bench_bf16.py [--nets lenet cifar resnet]
        [--iterations N] [--train_bf16 resnet] [--seeds 1701 1 2]

Training feeds Input layers batch by batch (64 digits, reshuffled every epoch by a seeded
generator) and steps the solver; the same batches reach both precisions.
"""
import argparse
import os
import sys
import time

import cv2
import numpy as np
from google.protobuf import text_format

import caffepy
from caffepy import precision, upgrade
from caffepy.net import TEST, Net
from caffepy.proto import caffe_pb2
from caffepy.solvers import Solver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(REPO, "examples", "digits")
BATCH = 64
SIDE = 16


def digits():
    """(x_train, y_train, x_test, y_test): float32 [N, 1, 16, 16] as the demo's net sees them."""
    def read(listing):
        with open(os.path.join(DIGITS, listing)) as f:
            rows = [line.rsplit(" ", 1) for line in f.read().splitlines()]
        images = [cv2.resize(cv2.imread(os.path.join(DIGITS, "images", p), cv2.IMREAD_GRAYSCALE),
                             (SIDE, SIDE), interpolation=cv2.INTER_LINEAR) for p, _ in rows]
        return np.stack(images).astype(np.float32)[:, None], np.array([int(y) for _, y in rows], np.float32)
    x_train, y_train = read("train.txt")
    x_test, y_test = read("test.txt")
    mean = x_train.mean(axis=0)
    return (x_train - mean) / 256, y_train, (x_test - mean) / 256, y_test


def _input(batch):
    return (f'layer {{ name: "digits" type: "Input" top: "data" top: "label" input_param {{ '
            f'shape {{ dim: {batch} dim: 1 dim: {SIDE} dim: {SIDE} }} shape {{ dim: {batch} }} }} }}\n')


def lenet(batch):
    """The demo's LeNet with its Data layers replaced by one Input layer."""
    net = upgrade.read_net(os.path.join(DIGITS, "lenet_train_test.prototxt"))
    kept = [lp for lp in net.layer if lp.type != "Data"]
    del net.layer[:]
    net.layer.add().CopyFrom(text_format.Parse(_input(batch), caffe_pb2.NetParameter()).layer[0])
    net.layer.extend(kept)
    return net


def _conv(name, bottom, n, k, stride=1, pad=0, bias=True, std=None):
    filler = f'type: "gaussian" std: {std}' if std else 'type: "msra"'
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" '
            f'convolution_param {{ num_output: {n} kernel_size: {k} stride: {stride} pad: {pad} '
            f'bias_term: {"true" if bias else "false"} weight_filler {{ {filler} }} }} }}\n')


def _tail(bottom, fc=None):
    text = ""
    if fc:
        text += (f'layer {{ name: "ip1" type: "InnerProduct" bottom: "{bottom}" top: "ip1" '
                 f'inner_product_param {{ num_output: {fc} weight_filler {{ type: "gaussian" std: 0.1 }} }} }}\n')
        bottom = "ip1"
    return text + (f'layer {{ name: "ip2" type: "InnerProduct" bottom: "{bottom}" top: "ip2" '
                   f'inner_product_param {{ num_output: 10 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}\n'
                   f'layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}\n')


def _pool(name, bottom, kind):
    return (f'layer {{ name: "{name}" type: "Pooling" bottom: "{bottom}" top: "{name}" '
            f'pooling_param {{ pool: {kind} kernel_size: 3 stride: 2 }} }}\n')


def _relu(name, blob):
    return f'layer {{ name: "{name}" type: "ReLU" bottom: "{blob}" top: "{blob}" }}\n'


def cifar(batch):
    text = (_input(batch) + _conv("conv1", "data", 32, 5, pad=2, std=0.05) + _pool("pool1", "conv1", "MAX")
            + _relu("relu1", "pool1") + _conv("conv2", "pool1", 32, 5, pad=2, std=0.05)
            + _relu("relu2", "conv2") + _pool("pool2", "conv2", "AVE")
            + _conv("conv3", "pool2", 64, 5, pad=2, std=0.05) + _relu("relu3", "conv3")
            + _pool("pool3", "conv3", "AVE") + _tail("pool3", fc=64))
    return text_format.Parse(text, caffe_pb2.NetParameter(name="cifar_style"))


def _bn(name, blob, relu=True):
    text = (f'layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{blob}" top: "{blob}" }}\n'
            f'layer {{ name: "{name}_scale" type: "Scale" bottom: "{blob}" top: "{blob}" '
            f'scale_param {{ bias_term: true }} }}\n')
    return text + (_relu(f"{name}_relu", blob) if relu else "")


def _block(name, bottom, n, stride):
    text = _conv(f"{name}_a", bottom, n, 3, stride, 1, bias=False) + _bn(f"{name}_a", f"{name}_a")
    text += _conv(f"{name}_b", f"{name}_a", n, 3, 1, 1, bias=False) + _bn(f"{name}_b", f"{name}_b", relu=False)
    shortcut = bottom
    if stride != 1:
        text += _conv(f"{name}_proj", bottom, n, 1, stride, bias=False) + _bn(f"{name}_proj", f"{name}_proj", False)
        shortcut = f"{name}_proj"
    text += (f'layer {{ name: "{name}" type: "Eltwise" bottom: "{shortcut}" bottom: "{name}_b" top: "{name}" }}\n'
             + _relu(f"{name}_relu", name))
    return text


def resnet(batch):
    text = _input(batch) + _conv("conv1", "data", 16, 3, pad=1, bias=False) + _bn("conv1", "conv1")
    text += _block("res1", "conv1", 16, 1) + _block("res2", "res1", 32, 2) + _block("res3", "res2", 64, 2)
    text += ('layer { name: "pool" type: "Pooling" bottom: "res3" top: "pool" '
             'pooling_param { pool: AVE global_pooling: true } }\n') + _tail("pool")
    return text_format.Parse(text, caffe_pb2.NetParameter(name="small_resnet"))


NETS = {"lenet": lenet, "cifar": cifar, "resnet": resnet}
# solver settings: the demo's for LeNet; cifar10_quick's momentum and decay, a larger rate for
# the short run; the ResNet's as ResNet's papers train (momentum 0.9, decay 1e-4), stepped down
SOLVERS = {
    "lenet": 'base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75',
    "cifar": 'base_lr: 0.01 momentum: 0.9 weight_decay: 0.004 lr_policy: "fixed"',
    "resnet": 'base_lr: 0.05 momentum: 0.9 weight_decay: 0.0001 lr_policy: "multistep" gamma: 0.1 '
              'stepvalue: 400 stepvalue: 550',
}
ITERATIONS = {"lenet": 600, "cifar": 600, "resnet": 600}
SEEDS = (1701, 1, 2)        # --seeds' default: single runs differ by the seed more than by bf16


def train(name, data, mode, iterations=None, seed=1701):
    """Train net `name` in precision `mode` (f32 or bf16); returns the trained NetParameter."""
    x_train, y_train = data[:2]
    iterations = iterations or ITERATIONS[name]
    precision.set_precision(mode)
    try:
        p = text_format.Parse(SOLVERS[name], caffe_pb2.SolverParameter())
        p.net_param.CopyFrom(NETS[name](BATCH))
        p.max_iter, p.display, p.random_seed, p.snapshot_after_train = iterations, 0, seed, False
        caffepy.set_random_seed(seed)
        solver = Solver(p)
    finally:
        precision.set_precision("f32")
    net = solver.net
    gen = np.random.default_rng(seed)
    order, at = gen.permutation(len(x_train)), 0
    for _ in range(iterations):
        if at + BATCH > len(order):
            order, at = gen.permutation(len(x_train)), 0
        pick = order[at:at + BATCH]
        at += BATCH
        net.blobs["data"].data[...] = x_train[pick]
        net.blobs["label"].data[...] = y_train[pick]
        solver.step(1)
    return net.to_proto()


def predict(name, weights, data, mode):
    """Top-1 of the held-out digits by net `name` with `weights`, run in precision `mode`."""
    x_test, y_test = data[2:]
    precision.set_precision(mode)
    try:
        net = Net(NETS[name](len(x_test)), TEST)
    finally:
        precision.set_precision("f32")
    net.copy_from_param(weights, "the trained weights")
    net.blobs["data"].data[...] = x_test
    net.blobs["label"].data[...] = y_test
    net.forward()
    return net.blobs["ip2"].data.argmax(axis=1)


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
    os.environ.setdefault("CAFFEPY_BF16", "emulate")
    caffepy.log.set_quiet(True)
    data = digits()
    print(f"bf16 emulated ({precision.availability()})")
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
