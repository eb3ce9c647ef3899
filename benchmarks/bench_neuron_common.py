"""Milliseconds of the neuron and common layers (Layer.forward / Layer.backward), next to one
NumPy pass over the same data (the floor for elementwise work) and torch's CPU functions when
torch is installed.

    .venv/bin/python benchmarks/bench_neuron_common.py [--reps 5] [--only ReLU,Dropout]

Elementwise rows run on AlexNet's conv1 output, 64 x 96 x 55 x 55 (18.6 M floats). Times are
the best of --reps runs after one warm-up; the load average is printed because the figures
mean little on a busy machine.
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

CONV1 = (64, 96, 55, 55)
# (type, params, phase, bottom shapes, in place)
ROWS = [
    ("ReLU", "", caffe_pb2.TRAIN, [CONV1], False),
    ("ReLU", "", caffe_pb2.TRAIN, [CONV1], True),
    ("ReLU", "relu_param { negative_slope: 0.1 }", caffe_pb2.TRAIN, [CONV1], True),
    ("PReLU", "", caffe_pb2.TRAIN, [CONV1], False),
    ("ELU", "", caffe_pb2.TRAIN, [CONV1], True),
    ("Sigmoid", "", caffe_pb2.TRAIN, [CONV1], True),
    ("TanH", "", caffe_pb2.TRAIN, [CONV1], True),
    ("Swish", "", caffe_pb2.TRAIN, [CONV1], True),
    ("Dropout", "", caffe_pb2.TRAIN, [CONV1], True),
    ("InnerProduct", "inner_product_param { num_output: 4096 weight_filler { type: 'gaussian' std: 0.01 } }",
     caffe_pb2.TRAIN, [(256, 9216)], False),
    ("InnerProduct", "inner_product_param { num_output: 1000 weight_filler { type: 'gaussian' std: 0.01 } }",
     caffe_pb2.TRAIN, [(256, 4096)], False),
    ("Softmax", "", caffe_pb2.TRAIN, [(256, 1000)], False),
    ("Eltwise", "", caffe_pb2.TRAIN, [(32, 256, 56, 56)] * 2, False),
    ("Scale", "scale_param { bias_term: true }", caffe_pb2.TRAIN, [(32, 256, 56, 56)], True),
    ("Concat", "", caffe_pb2.TRAIN, [(32, 64, 28, 28), (32, 128, 28, 28), (32, 32, 28, 28),
                                     (32, 32, 28, 28)], False),
]


def build(type_, params, phase, shapes, in_place):
    gen = np.random.default_rng(0)
    lp = caffe_pb2.LayerParameter()
    text_format.Parse(params, lp)
    lp.name, lp.type = type_.lower(), type_
    bottom = []
    for i, shape in enumerate(shapes):
        b = Blob(name=f"b{i}")
        b.set_data(gen.standard_normal(shape, dtype=np.float32))
        bottom.append(b)
    top = [bottom[0]] if in_place else [Blob(name="t0")]
    layer = create_layer(lp, phase)
    layer.layer_setup(bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = gen.standard_normal(top[0].shape, dtype=np.float32)
    return layer, bottom, top


def torch_row(type_, params, shapes, layer):
    """(forward ms, backward ms) of the matching torch op, or None."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    gen = np.random.default_rng(0)
    xs = [torch.from_numpy(gen.standard_normal(s, dtype=np.float32)).requires_grad_() for s in shapes]
    ops = {
        "ReLU": lambda x: torch.nn.functional.leaky_relu(x, 0.1) if "slope" in params else torch.relu(x),
        "ELU": torch.nn.functional.elu, "Sigmoid": torch.sigmoid, "TanH": torch.tanh,
        "Swish": torch.nn.functional.silu, "Softmax": lambda x: torch.softmax(x, 1),
        "Dropout": lambda x: torch.nn.functional.dropout(x, 0.5, True),
    }
    wrt = xs[:1]
    if type_ == "InnerProduct":
        w, b = (torch.from_numpy(p.data.copy()).requires_grad_() for p in layer.blobs)
        ops[type_] = lambda x: torch.nn.functional.linear(x, w, b)
        wrt = [xs[0], w, b]          # as the layer: input and parameter gradients
    if type_ not in ops:
        return None
    fn = ops[type_]
    out = fn(xs[0])
    grad = torch.ones_like(out)
    fwd = best_ms(lambda: fn(xs[0]), 3)
    bwd = best_ms(lambda: torch.autograd.grad(fn(xs[0]), wrt, grad), 3) - fwd
    return fwd, bwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated layer types")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; best of {args.reps}")
    x = np.random.default_rng(0).standard_normal(CONV1, dtype=np.float32)
    y = np.empty_like(x)
    print(f"{'one NumPy pass (np.maximum(x, 0, out=y)) on ' + 'x'.join(map(str, CONV1)):64s}"
          f"{best_ms(lambda: np.maximum(x, 0, out=y), args.reps):9.1f} ms")
    print(f"{'layer':64s}{'forward':>9s}{'backward':>11s}{'torch fwd':>11s}{'torch bwd':>11s}")
    for type_, params, phase, shapes, in_place in ROWS:
        if only and type_ not in only:
            continue
        layer, bottom, top = build(type_, params, phase, shapes, in_place)
        down = [True] * len(bottom)
        fwd = best_ms(lambda: layer.forward(bottom, top), args.reps)
        bwd = best_ms(lambda: layer.backward(top, down, bottom), args.reps)
        ref = torch_row(type_, params, shapes, layer)
        ref_text = f"{ref[0]:11.1f}{ref[1]:11.1f}" if ref else f"{'-':>11s}{'-':>11s}"
        label = f"{type_} {params[:28]}{' (in place)' if in_place else ''} " \
                f"{'+'.join('x'.join(map(str, s)) for s in shapes[:2])}"
        print(f"{label[:63]:64s}{fwd:9.1f}{bwd:11.1f}{ref_text}")


if __name__ == "__main__":
    main()
