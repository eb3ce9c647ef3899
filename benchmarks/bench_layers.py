"""Forward and backward milliseconds of single layers, every implementation of each, from one
declarative table; PyTorch beside them when torch is installed.

    .venv/bin/python benchmarks/bench_layers.py [--reps 5] [--only LRN,BatchNorm] [--median]

Each row of ROWS names a layer (type, prototxt params, bottom shapes, phase, in place or not);
the layers are built with the tests' builder (tests/layer_cases.py `setup_layer`), once per
variant the registry holds for the type (caffepy/layer.py): `plain` on NCHW blobs, and each
variant that takes another layout (`blocked`, `blocked_via_nchw`: the bottoms packed by
`layout=`) on those, asked for by name (`variant=`). A variant that does not build for the row
(model_parallel needs ranks, say) is listed with its one-line reason. `*` marks the variant the
factory picks for those bottoms. The variants of a row run in turn, rep by rep, so all see one
machine; the figure is the best of --reps runs (--median: their median) after one warm-up.
Backward fills every bottom diff but labels', and the parameter diffs.

The PyTorch columns run the same layer translated by benchmarks/torch_net.py (its types only;
an in-place row runs out of place there: torch refuses in-place ops on leaf tensors), with
autograd: backward is the time of torch.autograd.backward after an untimed forward.
Kernel-level timings (conv threading, blocked pooling / LRN kernels, the SGD step) are in
bench_kernels.py.
"""
import argparse
import os
import statistics
import sys
import typing

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, REPO)

import timing  # noqa: E402
from layer_cases import layer_param, setup_layer  # noqa: E402

from caffepy import log  # noqa: E402
from caffepy.context import SINGLE  # noqa: E402
from caffepy.layer import ANY, LAYERS, NCHW, OWN, PLAIN, Request, choose  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


class Row(typing.NamedTuple):
    type: str
    params: str = ""
    shapes: tuple = ()
    phase: int = TRAIN
    in_place: bool = False
    classes: int = 0            # > 0: the second bottom holds labels in [0, classes)
    note: str = ""


def conv(num_output, kernel, stride=1, pad=0, group=1, engine=""):
    return (f"convolution_param {{ num_output: {num_output} kernel_size: {kernel} stride: {stride} "
            f"pad: {pad} group: {group} weight_filler {{ type: 'xavier' }} "
            f"{f'engine: {engine}' if engine else ''} }}")


ALEXNET_CONV1 = (64, 96, 55, 55)      # AlexNet batch 64: conv1's output, 18.6 M floats
ROWS = [
    # convolutions: AlexNet's conv2 and conv3 at batch 16; ResNet-50's 1x1 and stride-2 3x3,
    # MobileNet's depthwise 3x3, at batch 8
    Row("Convolution", conv(256, 5, pad=2, group=2), [(16, 96, 27, 27)], note="AlexNet conv2"),
    Row("Convolution", conv(256, 5, pad=2, group=2, engine="CAFFE"), [(16, 96, 27, 27)],
        note="AlexNet conv2, Caffe's algorithm"),
    Row("Convolution", conv(384, 3, pad=1), [(16, 256, 13, 13)], note="AlexNet conv3"),
    Row("Convolution", conv(64, 1), [(8, 256, 56, 56)], note="ResNet-50 res2b_branch2a"),
    Row("Convolution", conv(128, 3, stride=2, pad=1), [(8, 128, 56, 56)], note="ResNet-50 stride 2"),
    Row("Convolution", conv(64, 3, pad=1, group=64), [(8, 64, 112, 112)], note="MobileNet depthwise"),
    # pooling and LRN: AlexNet batch 64; ResNet-50's global pooling at batch 32
    Row("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 }", [ALEXNET_CONV1]),
    Row("Pooling", "pooling_param { pool: AVE global_pooling: true }", [(32, 2048, 7, 7)]),
    Row("LRN", "lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }", [ALEXNET_CONV1]),
    # neurons on conv1's output
    Row("ReLU", "", [ALEXNET_CONV1]),
    Row("ReLU", "", [ALEXNET_CONV1], in_place=True),
    Row("ReLU", "relu_param { negative_slope: 0.1 }", [ALEXNET_CONV1], in_place=True),
    Row("PReLU", "", [ALEXNET_CONV1]),
    Row("ELU", "", [ALEXNET_CONV1], in_place=True),
    Row("Sigmoid", "", [ALEXNET_CONV1], in_place=True),
    Row("TanH", "", [ALEXNET_CONV1], in_place=True),
    Row("Swish", "", [ALEXNET_CONV1], in_place=True),
    Row("Dropout", "", [ALEXNET_CONV1], in_place=True),
    # common layers: AlexNet's fc6 / fc8 at batch 256; ResNet-50 and GoogLeNet shapes at batch 32
    Row("InnerProduct", "inner_product_param { num_output: 4096 weight_filler { type: 'gaussian' "
        "std: 0.01 } }", [(256, 9216)], note="AlexNet fc6"),
    Row("InnerProduct", "inner_product_param { num_output: 1000 weight_filler { type: 'gaussian' "
        "std: 0.01 } }", [(256, 4096)], note="AlexNet fc8"),
    Row("Softmax", "", [(256, 1000)]),
    Row("Eltwise", "", [(32, 256, 56, 56)] * 2),
    Row("Scale", "scale_param { bias_term: true }", [(32, 256, 56, 56)], in_place=True),
    Row("Concat", "", [(32, 64, 28, 28), (32, 128, 28, 28), (32, 32, 28, 28), (32, 32, 28, 28)],
        note="GoogLeNet inception_3a"),
    # normalization: ResNet-50 shapes at batch 32
    Row("BatchNorm", "", [(32, 64, 112, 112)]),
    Row("BatchNorm", "", [(32, 256, 56, 56)]),
    Row("BatchNorm", "", [(32, 2048, 7, 7)]),
    Row("BatchNorm", "", [(32, 256, 56, 56)], phase=TEST),
    Row("MVN", "", [(32, 64, 56, 56)]),
    # losses: classification at batch 256, segmentation (21 classes, 500 x 500)
    Row("SoftmaxWithLoss", "", [(256, 1000), (256,)], classes=1000),
    Row("SoftmaxWithLoss", "loss_param { ignore_label: 255 }", [(1, 21, 500, 500), (1, 1, 500, 500)],
        classes=21),
    Row("Accuracy", "accuracy_param { top_k: 5 }", [(256, 1000), (256,)], phase=TEST, classes=1000),
]


def bottoms_of(row):
    gen = np.random.default_rng(0)
    out = []
    for i, shape in enumerate(row.shapes):
        if row.classes and i == 1:
            out.append(gen.integers(0, row.classes, size=shape).astype(np.float32))
        else:
            out.append(gen.standard_normal(shape, dtype=np.float32))
    return out


def variants(row):
    """(variant name, layout for setup_layer) of each implementation of the row's type."""
    out = []
    for name, cls in LAYERS[row.type].items():
        layout = None if cls.layout in (NCHW, ANY, OWN) else cls.layout
        if layout is not None and len(row.shapes[0]) != 4:
            continue            # the other layouts are of N x C x H x W blobs
        out.append((name, layout))
    return out


class Built:
    """One variant of a row, built and run once, ready to time."""

    def __init__(self, row, name, layout, arrays):
        self.layer, self.bottom, top = setup_layer(row.type, row.params, arrays, row.phase,
                                                   layout=layout, context=SINGLE, variant=name)
        if row.in_place:
            top = self.bottom[:1]
        self.top = top
        self.layer.reshape(self.bottom, self.top)
        self.layer.forward(self.bottom, self.top)
        gen = np.random.default_rng(1)
        for t in self.top:
            t.diff[...] = 1.0 if self.layer.is_loss else gen.standard_normal(t.shape)
        self.down = [not (row.classes and i == 1) for i in range(len(self.bottom))]
        self.backward = self.layer.differentiable
        self.request = Request(layer_param(row.type, row.params, n_bottom=len(arrays)), row.phase,
                               None, tuple(self.bottom), SINGLE, None)
        self.default = choose(self.request).variant == name

    def forward(self):
        self.layer.reshape(self.bottom, self.top)
        self.layer.forward(self.bottom, self.top)

    def run_backward(self):
        self.layer.backward(self.top, self.down, self.bottom)


def torch_layer(row, arrays, threads):
    """(forward fn, backward setup, backward fn) of the row's layer in PyTorch, or None."""
    try:
        import torch

        import torch_net
    except ImportError:
        return None
    from caffepy.proto import caffe_pb2 as pb
    torch.set_num_threads(threads)
    net = pb.NetParameter(name=row.type)
    names = [f"b{i}" for i in range(len(arrays))]
    for name, a in zip(names, arrays):
        net.layer.add(name=name, type="Input", top=[name]).input_param.shape.add(dim=a.shape)
    lp = layer_param(row.type, row.params, name="layer", n_bottom=len(arrays))
    net.layer.add().CopyFrom(lp)
    net.state.phase = row.phase
    try:
        model = torch_net.TorchNet(torch_net.spec(net)).train(row.phase == TRAIN)
    except (ValueError, KeyError):
        return None                 # a type the translator lacks
    inputs = {n: torch.from_numpy(a).requires_grad_(not (row.classes and i == 1))
              for i, (n, a) in enumerate(zip(names, arrays))}

    def forward():
        return model(inputs)[1]["t0"]
    state = {}

    def setup():
        for x in inputs.values():
            x.grad = None
        state["out"] = forward()
        if "grad" not in state:
            state["grad"] = torch.ones_like(state["out"])
    differentiable = forward().requires_grad
    return forward, (setup if differentiable else None), (
        (lambda: torch.autograd.backward(state["out"], state["grad"])) if differentiable else None)


def label(row):
    """Type, the row's note or its params (without the `*_param` words), phase, shapes."""
    shape = "+".join("x".join(map(str, s)) for s in row.shapes[:2])
    shape += "+..." if len(row.shapes) > 2 else ""
    words = [w for w in row.params.replace("{", " ").replace("}", " ").split()
             if not w.endswith("_param")]
    about = f"({row.note})" if row.note else " ".join(words)
    return " ".join(filter(None, [row.type, about, "TEST" if row.phase == TEST else "",
                                  "in place" if row.in_place else "", shape]))


def bench_row(row, args, summary):
    arrays = bottoms_of(row)
    built, failed = [], []
    for name, layout in variants(row):
        cls = LAYERS[row.type][name]
        if layout is None and name != PLAIN and built and not cls.wanted(built[0][1].request):
            failed.append((name, "the factory picks it only in another run context (ranks)"))
            continue
        try:
            built.append((name, Built(row, name, layout, arrays)))
        except Exception as e:  # a variant this row cannot build: say why, time the others
            failed.append((name, str(e).splitlines()[0][:90]))
    fwd = timing.alternate([b.forward for _, b in built], args.reps, summary=summary)
    bwd = timing.alternate([b.run_backward for _, b in built if b.backward], args.reps,
                           summary=summary)
    ref = None if args.no_torch else torch_layer(row, arrays, args.threads)
    if ref is not None:
        tf = timing.best_ms(ref[0], args.reps, summary=summary)
        tb = timing.best_ms(ref[2], args.reps, ref[1], summary) if ref[2] else None
    bwd = iter(bwd)
    for i, (name, b) in enumerate(built):
        first = label(row) if i == 0 else ""
        back = f"{next(bwd):9.2f}" if b.backward else f"{'-':>9s}"
        torch_cols = ""
        if i == 0 and ref is not None:
            torch_cols = f"{tf:11.2f}" + (f"{tb:11.2f}" if tb is not None else f"{'-':>11s}")
        print(f"{first[:64]:64s} {name + (' *' if b.default else ''):20s}{fwd[i]:9.2f}{back}{torch_cols}",
              flush=True)
    for name, why in failed:
        print(f"{'':64s} {name:20s} not timed: {why}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated layer types")
    ap.add_argument("--median", action="store_true", help="the median of the runs, not the best")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="PyTorch's threads (caffepy's: OMP_NUM_THREADS)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    log.set_quiet(True)
    only = set(filter(None, args.only.split(",")))
    summary = statistics.median if args.median else min
    print(f"load average {os.getloadavg()[0]:.2f} on {len(os.sched_getaffinity(0))} CPUs, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}; "
          f"{'median' if args.median else 'best'} of {args.reps}; * the factory's choice")
    x = np.random.default_rng(0).standard_normal(ALEXNET_CONV1, dtype=np.float32)
    y = np.empty_like(x)
    floor = timing.best_ms(lambda: np.maximum(x, 0, out=y), args.reps, summary=summary)
    print(f"{'one NumPy pass, np.maximum(x, 0, out=y), 64x96x55x55':64s} {'':20s}{floor:9.2f}")
    print(f"{'layer':64s} {'variant':20s}{'fwd ms':>9s}{'bwd ms':>9s}{'torch fwd':>11s}{'torch bwd':>11s}")
    for row in ROWS:
        if not only or row.type in only:
            bench_row(row, args, summary)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
