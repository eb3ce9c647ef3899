"""Small nets trained here on the bundled digits (examples/digits: 1,501 training and 296
held-out 8x8 digits, upscaled to 16x16 with INTER_LINEAR, mean subtracted and scaled by 1/256,
as the digits demo's LMDBs and transform_param give them), the nets the low-precision
benchmarks score against float32 (bench_bf16.py, bench_int8.py --parts accuracy) and their tests:

    lenet    the digits demo's LeNet (examples/digits/lenet_train_test.prototxt, its solver)
    cifar    Caffe's cifar10_quick shape (conv 32 5x5 - pool - conv 32 - pool - conv 64 - pool -
             ip 64 - ip 10), on 16x16 inputs
    resnet   a small ResNet: conv 16 3x3, three basic blocks (16, 32 /2, 64 /2; BatchNorm,
             Scale, ReLU, projection shortcuts), global average pooling, ip 10

    weights = train("resnet", digits(), "f32", seed=1)      # the trained NetParameter
    top1 = predict("resnet", weights, digits(), "bf16")      # held-out predictions

Training feeds Input layers batch by batch (64 digits, reshuffled every epoch by a seeded
generator) and steps the solver; the same batches reach every precision. `calibrate` runs
`caffepy calibrate` (caffepy/calibrate.py) on a trained net over an LMDB of a sample of the
training digits followed by the held-out ones.
"""
import os
import tempfile

import cv2
import numpy as np
from google.protobuf import text_format

import caffepy
from caffepy import calibrate as calibrator
from caffepy import precision, upgrade
from caffepy.data.datum import array_to_datum
from caffepy.data.db import open_writer
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
SEEDS = (1701, 1, 2)        # the benches' default: single runs differ by the seed more than by the precision


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


CALIBRATION_BATCH = 74          # 4 batches: the 296 held-out digits


def calibrate(name, weights, data, seed=1701, sampling_iterations=4, accuracy_loss=0.005,
              **options):
    """`caffepy calibrate` (caffepy.calibrate.calibrate) on net `name` with `weights`: the
    scales measured on `sampling_iterations` batches of training digits drawn by `seed`, the
    float32 and int8 nets scored on the held-out digits. `options`: calibrate's
    weights_channel, first_conv, fc_int8. Returns calibrate's (float32 accuracy, int8
    accuracy, top-1 agreement, quantized layer names) and the written int8 NetParameter."""
    x_train, y_train, x_test, y_test = data
    batch = CALIBRATION_BATCH
    held_out = len(y_test) // batch
    assert held_out * batch == len(y_test), "the batch must divide the held-out digits"
    pick = np.random.default_rng(seed).choice(len(y_train), sampling_iterations * batch, replace=False)
    with tempfile.TemporaryDirectory(prefix="calibrate-") as work:
        source = os.path.join(work, "digits_lmdb")
        with open_writer(source) as db:
            rows = zip(np.concatenate([x_train[pick], x_test]), np.concatenate([y_train[pick], y_test]))
            for i, (x, y) in enumerate(rows):
                db.put(f"{i:08d}", array_to_datum(x, int(y)).SerializeToString())
        param = NETS[name](batch)
        data_layer = param.layer[0]
        data_layer.type = "Data"
        data_layer.ClearField("input_param")
        data_layer.data_param.source, data_layer.data_param.batch_size = source, batch
        data_layer.data_param.backend = caffe_pb2.DataParameter.LMDB
        if not any(lp.type == "Accuracy" for lp in param.layer):      # the demo's LeNet has one
            param.layer.add(name="accuracy", type="Accuracy", bottom=["ip2", "label"], top=["accuracy"])
        model, weights_file = os.path.join(work, "float.prototxt"), os.path.join(work, "float.caffemodel")
        output = os.path.join(work, "int8.prototxt")
        with open(model, "w") as f:
            f.write(text_format.MessageToString(param))
        with open(weights_file, "wb") as f:
            f.write(weights.SerializeToString())
        result = calibrator.calibrate(model, weights_file, output, sampling_iterations, held_out,
                                      accuracy_loss, **options)
        return result, upgrade.read_net(output)
