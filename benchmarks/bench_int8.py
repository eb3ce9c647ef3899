"""int8 against float32: the forward of Intel Caffe's int8 nets (quantization_param) through
net.forward, beside the same net with quantization_param removed (caffepy's float32 fast path,
BatchNorm/Scale/ReLU run as layers and fused by its own rules). Random weights; BatchNorm
statistics set to mean 0, variance 1 so the folded weights stay in range.

    CAFFEPY_INTEL_CAFFE=/work/intel-caffe python benchmarks/bench_int8.py [--batch 1 16]
        [--nets resnet50_int8_full_perf mobilenet_v1_int8_perf ...] [--reps 5]

Prints per net and batch the best (and median) wall ms of each and the ratio f32 / int8.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from timing import alternate, median  # noqa: E402

import caffepy  # noqa: E402
from caffepy import quantization, upgrade  # noqa: E402
from caffepy.net import Net  # noqa: E402

TREE = os.environ.get("CAFFEPY_INTEL_CAFFE", "/work/intel-caffe")
INT8 = os.path.join(TREE, "models", "intel_optimized_models", "int8")
DEFAULT = ["resnet50_int8_full_perf", "mobilenet_v1_int8_perf", "inceptionv3_int8"]


def _param(name, batch, quantized):
    with open(os.path.join(INT8, name + ".prototxt")) as f:
        p = upgrade.parse_net_text(f.read(), name)
    for lp in p.layer:
        if lp.type == "DummyData":
            for shape in lp.dummy_data_param.shape:
                shape.dim[0] = batch
            for filler in lp.dummy_data_param.data_filler:
                filler.type, filler.std = "gaussian", 50.0
            if not len(lp.dummy_data_param.data_filler):
                lp.dummy_data_param.data_filler.add(type="gaussian", std=50.0)
        if not quantized:
            lp.ClearField("quantization_param")
    return p


def _net(name, batch, quantized):
    net = Net(_param(name, batch, quantized), caffepy.TEST)
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[0].data[...] = 0
            layer.blobs[1].data[...] = 1
            layer.blobs[2].data[...] = 1
    return net


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=DEFAULT)
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"int8 kernels: {quantization.isa()}; threads: {os.environ.get('OMP_NUM_THREADS', 'all')}")
    print(f"{'net':28s} {'batch':>5s} {'f32 ms':>14s} {'int8 ms':>14s} {'f32/int8':>8s}")
    for name in args.nets:
        for batch in args.batch:
            f32, int8 = _net(name, batch, False), _net(name, batch, True)
            timers = alternate([f32.forward, int8.forward], args.reps, summary=lambda v: v)
            best = [min(t) for t in timers]
            med = [median(t) for t in timers]
            print(f"{name:28s} {batch:5d} {best[0]:7.1f} ({med[0]:5.0f}) {best[1]:7.1f} "
                  f"({med[1]:5.0f}) {best[0] / best[1]:8.2f}", flush=True)


if __name__ == "__main__":
    main()
