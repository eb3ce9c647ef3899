"""Milliseconds of the normalization and loss layers (layer level, through Layer.forward and
Layer.backward), next to torch's CPU functions on the same shapes when torch is installed.

    .venv/bin/python benchmarks/bench_norm_loss.py [--reps 5] [--threads 2] [--only BatchNorm,MVN]

Rows: BatchNorm in TRAIN (batch statistics, moving averages) and TEST (global statistics) on
ResNet-50 shapes at batch 32; MVN; SoftmaxWithLoss for classification (256 x 1000) and
segmentation (21 classes, 500 x 500); Accuracy top-5. Times are the best of --reps runs after
one warm-up; the load average is printed because the figures mean little on a busy machine.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from google.protobuf import text_format  # noqa: E402

from caffepy.blob import Blob  # noqa: E402
from timing import best_ms  # noqa: E402
from caffepy.layer import create_layer  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402

# (type, params, phase, bottom shapes, classes for the label bottom or None)
ROWS = [
    ("BatchNorm", "", caffe_pb2.TRAIN, [(32, 64, 112, 112)], None),
    ("BatchNorm", "", caffe_pb2.TRAIN, [(32, 256, 56, 56)], None),
    ("BatchNorm", "", caffe_pb2.TRAIN, [(32, 2048, 7, 7)], None),
    ("BatchNorm", "", caffe_pb2.TEST, [(32, 256, 56, 56)], None),
    ("MVN", "", caffe_pb2.TRAIN, [(32, 64, 56, 56)], None),
    ("SoftmaxWithLoss", "", caffe_pb2.TRAIN, [(256, 1000), (256,)], 1000),
    ("SoftmaxWithLoss", "loss_param { ignore_label: 255 }", caffe_pb2.TRAIN,
     [(1, 21, 500, 500), (1, 1, 500, 500)], 21),
    ("Accuracy", "accuracy_param { top_k: 5 }", caffe_pb2.TEST, [(256, 1000), (256,)], 1000),
]


def build(type_, params, phase, shapes, classes):
    gen = np.random.default_rng(0)
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(params, lp)
    lp.name, lp.type = type_.lower(), type_
    bottom = []
    for i, shape in enumerate(shapes):
        b = Blob(name=f"b{i}")
        if i == 1:
            b.set_data(gen.integers(0, classes, size=shape).astype(np.float32))
        else:
            b.set_data(gen.standard_normal(shape, dtype=np.float32))
        bottom.append(b)
    top = [Blob(name="t0")]
    layer = create_layer(lp, phase)
    layer.layer_setup(bottom, top)
    return layer, bottom, top


def torch_row(torch, type_, phase, shapes, bottom):
    x = torch.from_numpy(bottom[0].data.copy()).requires_grad_(type_ != "Accuracy")
    if type_ == "BatchNorm":
        if phase == caffe_pb2.TRAIN:
            fwd = lambda: torch.nn.functional.batch_norm(x, None, None, training=True)  # noqa: E731
        else:
            c = shapes[0][1]
            mean, var = torch.zeros(c), torch.ones(c)
            fwd = lambda: torch.nn.functional.batch_norm(x, mean, var, training=False)  # noqa: E731
    elif type_ == "SoftmaxWithLoss":
        lab = torch.from_numpy(bottom[1].data.reshape(shapes[0][0], *shapes[0][2:]).astype(np.int64))
        fwd = lambda: torch.nn.functional.cross_entropy(x, lab, ignore_index=255)  # noqa: E731
    else:
        return None, None
    out = fwd()
    grad = torch.ones_like(out)
    f = best_ms(fwd, ARGS.reps)
    fb = best_ms(lambda: fwd().backward(grad), ARGS.reps)
    return f, fb - f


def main():
    torch = None
    try:
        import torch
        torch.set_num_threads(ARGS.threads)
    except ImportError:
        pass
    only = set(ARGS.only.split(",")) if ARGS.only else None
    print(f"load average {os.getloadavg()[0]:.2f}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")
    print(f"{'layer':<42}{'fwd ms':>9}{'bwd ms':>9}{'torch fwd':>11}{'torch bwd':>11}")
    for type_, params, phase, shapes, classes in ROWS:
        if only and type_ not in only:
            continue
        layer, bottom, top = build(type_, params, phase, shapes, classes)
        for t in top:
            t.diff[...] = 1.0
        prop = [True] + [False] * (len(bottom) - 1)
        f = best_ms(lambda: layer.forward(bottom, top), ARGS.reps)
        b = best_ms(lambda: layer.backward(top, prop, bottom), ARGS.reps) if layer.differentiable else 0.0
        tf = tb = None
        if torch is not None:
            tf, tb = torch_row(torch, type_, phase, shapes, bottom)
        name = f"{type_}{' TEST' if phase == caffe_pb2.TEST else ''} {'x'.join(map(str, shapes[0]))}"
        cols = f"{f:9.1f}{b:9.1f}"
        cols += f"{tf:11.1f}{tb:11.1f}" if tf is not None else f"{'-':>11}{'-':>11}"
        print(f"{name:<42}{cols}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--only", default="", help="comma-separated layer types")
    ARGS = parser.parse_args()
    main()
