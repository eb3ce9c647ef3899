"""int8 against float32, in two parts (--parts; both by default).

speed: the forward of Intel Caffe's int8 nets (quantization_param) through net.forward, beside
the same net with quantization_param removed (caffepy's float32 fast path, BatchNorm/Scale/ReLU
run as layers and fused by its own rules), and of GoogLeNet (BVLC's deploy net, which Intel
ships no int8 prototxt of), calibrated here by calibrate's own steps (calibrated()). Random
weights; BatchNorm statistics set to mean 0, variance 1 so the folded weights stay in range;
the data an Input filled once with N(0, 50) values; the nets built as `caffepy test` builds
them (keep_blobs=False: the blobs between input and output share memory). The int8 net runs
twice: with CAFFEPY_INT8_FALLBACK=0 (every quantized layer on 8-bit integers: the default on
the VNNI and AMX paths) and with CAFFEPY_INT8_FALLBACK=1 (each quantized convolution int8 or float32,
whichever its first forward measured faster here, or the autotune cache's choice: the default
on the AVX2 path; caffepy/quantization.py). Beside them OpenVINO at its default
precision on the float32 net's ONNX (--no-openvino leaves it out; `make bench-inference`
installs it). Prints per net and batch the best (and median) wall ms of each, run in turn
(each timed run after an untimed one of its own), the ratios f32 / int8, how many quantized
layers run float32, and OpenVINO's time, the precision it picked, OpenVINO / int8 and how far
its output is from caffepy's float32 (max |difference| / max |value|). Where the int8 path is AVX2
(int16 pairs), the opt-in AVX2 byte path runs beside them (CAFFEPY_INT8_ISA=avx2bytes, every
quantized layer int8; its weights at half the scale, so not Intel's integers) with f32 / it.

accuracy: `caffepy calibrate` (caffepy/calibrate.py) on the nets trained here on the bundled
digits (benchmarks/digits_nets.py: LeNet, a CIFAR-style net, a small ResNet): per net and seed,
float32 training, then calibrate twice, with Intel's defaults (the first convolution and the
InnerProducts stay float32) and with every Convolution and InnerProduct (--first_conv
--fc_int8); the scales from 296 training digits the seed draws, the float32 and int8 nets scored
on the 296 held-out digits, --accuracy_loss 0.005 (the goal: half a point). Prints float32's and
int8's top-1, the points int8 loses, the share of digits where their top-1 agree, and how many
of the net's Convolution and InnerProduct layers run int8 (after calibrate's fallback).

    CAFFEPY_INTEL_CAFFE=/work/intel-caffe python benchmarks/bench_int8.py [--parts speed accuracy]
        [--nets resnet50_int8_full_perf mobilenet_v1_int8_perf googlenet ...] [--batch 1 16]
        [--reps 5] [--no-openvino]
        [--digits_nets lenet cifar resnet] [--seeds 1701 1 2] [--weights_channel single] [--verbose]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import bench_inference  # noqa: E402  (OpenVINO on its path, as make bench-inference runs it)
import digits_nets  # noqa: E402
import nets  # noqa: E402
from timing import alternate, median  # noqa: E402

import caffepy  # noqa: E402
from caffepy import quantization, upgrade  # noqa: E402
from caffepy.errors import CaffepyError  # noqa: E402
from caffepy.net import Net  # noqa: E402

TREE = os.environ.get("CAFFEPY_INTEL_CAFFE", "/work/intel-caffe")
INT8 = os.path.join(TREE, "models", "intel_optimized_models", "int8")
# nets Intel ships no int8 prototxt of: benchmarks/nets.py's deploy net, calibrated here; a
# _full_conv name quantizes the first convolution too (calibrate's first_conv, Intel's -1st, as
# Intel's own *_int8_full_conv prototxts have it)
CALIBRATED = ("googlenet", "googlenet_full_conv")
DEFAULT = ["resnet50_int8_full_perf", "mobilenet_v1_int8_perf", "inceptionv3_int8", "googlenet"]
_calibrated = {}


def _input(p, batch):
    """p with its data layer (Intel's DummyData, or an Input) as an Input of `batch` images,
    which _net fills once with N(0, 50) values: a DummyData drawing them would draw again on
    every forward (Caffe's refill rule), timed as part of both nets' forward (GoogLeNet b16:
    40 ms of a 370 ms int8 forward)."""
    for lp in p.layer:
        if lp.type == "DummyData":
            shape = list(lp.dummy_data_param.shape[0].dim)
            lp.type = "Input"
            lp.ClearField("dummy_data_param")
            lp.input_param.shape.add(dim=shape)
        if lp.type == "Input":
            lp.input_param.shape[0].dim[0] = batch
    return p


def _fill(net, seed=0):
    for name in net.inputs:
        blob = net.blobs[name]
        blob.data[...] = np.random.default_rng(seed).normal(0, 50, blob.shape)


def calibrated(name, batch=16):
    """(float32 NetParameter, its int8 NetParameter, the weights as a NetParameter) of a
    CALIBRATED net: the weights its fillers draw (seeded), the scales by calibrate's own steps
    (caffepy/calibrate.py: measure, quantize_param) over one batch of the N(0, 50) input the
    speed part times (another draw), with calibrate's defaults (the first convolution, but for
    a _full_conv name, and the InnerProduct stay float32, weights_channel single) and
    unify_concat_scales (Intel's -f: the inception modules' concats then pass bytes)."""
    if name not in _calibrated:
        from caffepy import calibrate, rng
        rng.seed(1701)
        full = name.endswith("_full_conv")
        param = _input(nets.test_net(name[:-len("_full_conv")] if full else name, batch), batch)
        net = calibrate._unfolded(param, None, name)
        _fill(net, seed=1)
        stats = calibrate.measure(net, calibrate._candidates(net, full, False), 1)
        _calibrated[name] = (param, calibrate.quantize_param(param, net, stats, "single",
                                                             unify_concat_scales=True),
                             net.to_proto())
    return _calibrated[name]


def _param(name, batch, quantized):
    if name in CALIBRATED:
        p = type(calibrated(name)[0])()
        p.CopyFrom(calibrated(name)[1 if quantized else 0])
        return _input(p, batch)
    with open(os.path.join(INT8, name + ".prototxt")) as f:
        p = upgrade.parse_net_text(f.read(), name)
    _input(p, batch)
    if not quantized:
        for lp in p.layer:
            lp.ClearField("quantization_param")
    return p


def _net(name, batch, quantized, fallback=True, isa=None):
    """The net, built with CAFFEPY_INT8_FALLBACK=1 (each quantized convolution int8 or float32,
    as measured) or, `fallback` False, 0 (every quantized layer int8); on int8 path `isa`
    (CAFFEPY_INT8_ISA) where given."""
    settings = {"CAFFEPY_INT8_FALLBACK": "1" if fallback else "0"}
    if isa is not None:
        settings["CAFFEPY_INT8_ISA"] = isa
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        # as `caffepy test` and `caffepy time --precision` build it: its blobs share memory
        net = Net(_param(name, batch, quantized), caffepy.TEST, keep_blobs=False)
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    if name in CALIBRATED:
        net.copy_from_param(calibrated(name)[2])
    _fill(net)
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[0].data[...] = 0
            layer.blobs[1].data[...] = 1
            layer.blobs[2].data[...] = 1
    return net


def _openvino(net, threads):
    """OpenVINO at its default precision on the ONNX of float32 `net` (caffepy's exporter), or
    the reason it cannot run."""
    import tempfile
    from caffepy import onnx_export
    if not bench_inference.openvino_available():
        return (f"not importable (make bench-inference installs it in "
                f"{bench_inference.OPENVINO_DIR})")
    x = net.blobs[net.inputs[0]].data.copy()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "net.onnx")
        try:
            onnx_export.export(net, path)
        except CaffepyError as e:
            return f"no ONNX: {e}"
        return bench_inference.OpenVINO(path, x, threads, precision=None)


def speed(args):
    # OpenVINO gets caffepy's threads
    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or len(os.sched_getaffinity(0))
    load = os.getloadavg()
    print(f"int8 kernels: {quantization.isa()}; threads: {os.environ.get('OMP_NUM_THREADS', 'all')}; "
          f"load average at the start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    default = "int8 only" if quantization.isa() in quantization.BYTE_PATHS else "int8"
    print(f"int8 only: CAFFEPY_INT8_FALLBACK=0; int8: =1, each quantized convolution int8 or "
          f"float32, the faster here (measured on the first forward, or the autotune cache's); "
          f"the default on this path: {default}; OV: OpenVINO "
          "at its default precision (INFERENCE_PRECISION_HINT left alone: the one it picked is "
          "named) on the float32 net's ONNX; OV/int8 above 1: caffepy's int8 faster")
    # on the AVX2 path, the opt-in AVX2 byte path beside it (its weights at half the scale:
    # caffepy/quantization.py), every quantized layer int8
    half = quantization.isa() == "avx2" and "avx2bytes" in quantization.kernels().available_isas()
    if half:
        print("avx2bytes: CAFFEPY_INT8_ISA=avx2bytes CAFFEPY_INT8_FALLBACK=0, the opt-in AVX2 "
              "byte path (weights quantized at half the scale: not Intel's integers)")
    head = (f"{'net':24s} {'batch':>5s} {'f32 ms':>14s} {'int8 only ms':>14s} {'int8 ms':>14s} "
            f"{'f32/only':>8s} {'f32/int8':>8s} {'float32':>9s}")
    head += f" {'avx2bytes ms':>14s} {'f32/bytes':>9s}" if half else ""
    print(head + (f" {'OV ms':>14s} {'OV prec.':>8s} {'OV/int8':>7s} {'OV diff':>7s}"
                  if args.openvino else ""))
    for name in args.nets:
        for batch in args.batch:
            nets = [_net(name, batch, False), _net(name, batch, True, fallback=False),
                    _net(name, batch, True)]
            if half:
                nets.append(_net(name, batch, True, fallback=False, isa="avx2bytes"))
            runs = [n.forward for n in nets]
            ov = _openvino(nets[0], threads) if args.openvino else None
            if isinstance(ov, bench_inference.OpenVINO):
                want = nets[0].forward()[nets[0].outputs[0]].copy()
                diff = bench_inference.agreement(want, ov.forward())
                runs.append(ov.forward)
            # each run after an untimed one of its own: the previous contender's threads
            # (OpenMP's, OpenVINO's) spin on after a forward
            timers = alternate(runs, args.reps, setups=runs, summary=lambda v: v)
            best = [min(t) for t in timers]
            med = [median(t) for t in timers]
            quantized = [la for la in nets[2].layers if getattr(la, "int8", None) is not None]
            fell = sum(la.int8.path == quantization.FLOAT32 for la in quantized)
            line = (f"{name:24s} {batch:5d} " + " ".join(f"{b:7.1f} ({m:5.0f})" for b, m in zip(best[:3], med))
                    + f" {best[0] / best[1]:8.2f} {best[0] / best[2]:8.2f} {fell:3d} of {len(quantized):2d}")
            if half:
                line += f" {best[3]:7.1f} ({med[3]:5.0f}) {best[0] / best[3]:9.2f}"
            o = len(nets)       # OpenVINO's run, after caffepy's
            if isinstance(ov, bench_inference.OpenVINO):
                line += (f" {best[o]:7.1f} ({med[o]:5.0f}) {ov.precision:>8s} "
                         f"{best[o] / best[2]:7.2f} {diff:7.0e}")
            elif ov is not None:
                line += f" OpenVINO: {ov}"
            print(line, flush=True)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


# calibrate's options per row: Intel's defaults, then every Convolution and InnerProduct
CALIBRATIONS = {"default": {}, "all": {"first_conv": True, "fc_int8": True}}


def accuracy(args):
    data = digits_nets.digits()
    print(f"held-out digits: {len(data[3])}; one digit = {100 / len(data[3]):.2f} points; "
          f"int8 kernels: {quantization.isa()}; weights_channel {args.weights_channel}")
    print(f"{'net':7s} {'seed':>5s} {'layers':8s} {'f32 top-1':>9s} {'int8':>7s} {'lost':>6s} "
          f"{'agree':>7s} {'int8 layers':>11s}", flush=True)
    for name in args.digits_nets:
        for seed in args.seeds:
            weights = digits_nets.train(name, data, "f32", seed=seed)
            total = sum(lp.type in ("Convolution", "InnerProduct") for lp in weights.layer)
            for label, options in CALIBRATIONS.items():
                (base, acc, agree, names), _ = digits_nets.calibrate(
                    name, weights, data, seed, weights_channel=args.weights_channel, **options)
                print(f"{name:7s} {seed:5d} {label:8s} {100 * base[0]:9.2f} {100 * acc[0]:7.2f} "
                      f"{100 * (base[0] - acc[0]):6.2f} {100 * agree:7.2f} {len(names):>6d} of {total}",
                      flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["speed", "accuracy"], choices=["speed", "accuracy"])
    ap.add_argument("--verbose", action="store_true", help="caffepy's log (each layer's algorithm)")
    ap.add_argument("--nets", nargs="+", default=DEFAULT,
                    help=f"Intel's int8 nets, or {', '.join(CALIBRATED)} (speed)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-openvino", dest="openvino", action="store_false",
                    help="leave out OpenVINO's default beside int8 (speed)")
    ap.add_argument("--digits_nets", nargs="+", default=list(digits_nets.NETS),
                    choices=list(digits_nets.NETS), help="nets trained on the digits (accuracy)")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(digits_nets.SEEDS))
    ap.add_argument("--weights_channel", default="single", choices=["single", "multiple"])
    args = ap.parse_args()
    caffepy.log.set_quiet(not args.verbose)
    for part in args.parts:
        {"speed": speed, "accuracy": accuracy}[part](args)


if __name__ == "__main__":
    main()
