"""Deployment speed: the TEST net's forward pass in caffepy, ONNX Runtime and OpenVINO (issue 38).

    make bench-inference                                 # GoogLeNet, AlexNet, ResNet-50 at b1, b16
    python benchmarks/bench_inference.py --nets resnet50 --batches 1 --runs 20
    python benchmarks/bench_inference.py --nets all     # + MobileNet v1, VGG-16

Where the CPU has bf16 kernels, caffepy's bf16 (`-precision bf16`, the same weights) is a
contender too, and where OpenVINO's default precision is not f32, OpenVINO at its default.

Per net and batch: the deploy net (benchmarks/nets.py test_net: Input data of the batch, the
net's TEST phase) with random weights and plausible BatchNorm statistics, exported to ONNX by
caffepy's exporter (caffepy/onnx_export.py); ONNX Runtime and, when it imports, OpenVINO (f32:
INFERENCE_PRECISION_HINT f32, PERFORMANCE_HINT LATENCY) run that file. The outputs are checked
against caffepy's (max |difference| over max |value|). Then `--runs` rounds after `--warmup`
untimed ones, each round two forwards of each contender in turn (the order rotating), all in this
process, the first untimed so that the one timed runs as back-to-back requests do (the previous
contender's threads, which spin on after a forward, quiet): a figure is the median of its timed
forwards, a ratio the contender's median over caffepy's
(above 1: caffepy is faster). caffepy runs `net.forward()` on the net `caffepy test` builds
(keep_blobs=False, which Classifier and Detector take too: the blobs between input and output
share memory, as the other runtimes' tensors do); "caffepy, blobs kept" on the net a pycaffe
user builds by default, every blob readable after the forward. Its first
forward (building the net included) reads the algorithm choices of the autotune cache as it
stands: CAFFEPY_CACHE_DIR=$(mktemp -d) times a first run on this machine, measuring included.

ONNX Runtime and OpenVINO are test-time references, never caffepy dependencies: ONNX Runtime
comes with the test extra; OpenVINO goes outside the venv, in .benchdeps/openvino (`make
bench-inference` installs it there with pip install --target), which this script appends to its
path, after the venv's packages, so that the venv's NumPy stays the one imported.
Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (`env -u ...`, as the Makefile target does)
unless that is what you mean to measure: they pick OpenBLAS's kernel for every contender that
uses it.
"""
import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
OPENVINO_DIR = os.path.join(REPO, ".benchdeps", "openvino")
if os.path.isdir(OPENVINO_DIR):
    sys.path.append(OPENVINO_DIR)

import numpy as np  # noqa: E402

import nets  # noqa: E402

DEFAULT_NETS = ("googlenet", "alexnet", "resnet50")
ALL_NETS = DEFAULT_NETS + ("mobilenet", "vgg16")


def randomize(net, seed=0):
    """msra weights, N(0, 0.1) biases, BatchNorm statistics a trained net could hold (var > 0, a
    moving-average factor that is not 1), so the activations stay in range through a deep net."""
    from caffepy import fillers
    from caffepy.proto import caffe_pb2
    rng = np.random.default_rng(seed)
    for layer in net.layers:
        for i, blob in enumerate(layer.blobs):
            if layer.type == "BatchNorm":
                blob.data[...] = [rng.normal(0, 0.5, blob.shape), rng.uniform(0.5, 2, blob.shape),
                                  [0.7]][i]
            elif blob.num_axes > 1:
                blob.data[...] = fillers.fill(caffe_pb2.FillerParameter(type="msra"), blob.shape)
            else:
                blob.data[...] = rng.normal(0, 0.1, blob.shape)


class Caffepy:
    """caffepy's net as `caffepy test` builds it: its blobs between input and output share
    memory (keep_blobs=False, caffepy/net_memory.py)."""
    name = "caffepy"
    keep_blobs = False

    def __init__(self, param, batch, seed, weights_from=None):
        from caffepy.net import TEST, Net
        t = time.perf_counter()
        self.net = self._build(Net, param, TEST)
        if weights_from is None:
            randomize(self.net, seed)
        else:           # the same weights (randomize's msra draws are not seeded)
            for name, blobs in weights_from.params.items():
                for mine, theirs in zip(self.net.params[name], blobs):
                    mine.data[...] = theirs.data
        x = np.random.default_rng(seed + 1).standard_normal(self.net.blobs["data"].shape,
                                                              dtype=np.float32)
        self.x = x
        self.net.blobs["data"].data[...] = x
        self.net.forward()
        self.first_ms = 1e3 * (time.perf_counter() - t)
        self.output = self.net.outputs[0]

    def _build(self, Net, param, phase):
        return Net(param, phase=phase, keep_blobs=self.keep_blobs)

    def forward(self):
        return self.net.forward()[self.output]


class CaffepyBF16(Caffepy):
    """The same net built under -precision bf16 (where the CPU has bf16 kernels), given the f32
    net's weights (weights_from)."""
    name = "caffepy bf16"

    def _build(self, Net, param, phase):
        from caffepy import precision
        precision.set_precision("bf16")
        try:
            return Net(param, phase=phase, keep_blobs=self.keep_blobs)
        finally:
            precision.set_precision("f32")


class CaffepyKept(Caffepy):
    """The same net as a pycaffe user builds it by default, every blob its own memory (values
    readable after the forward), given the first one's weights."""
    name = "caffepy, blobs kept"
    keep_blobs = True


class OnnxRuntime:
    name = "ONNX Runtime"

    def __init__(self, path, x, threads):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.version = ort.__version__
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.feed = {self.session.get_inputs()[0].name: x}

    def forward(self):
        return self.session.run(None, self.feed)[0]


class OpenVINO:
    """OpenVINO on the CPU, at `precision` (None: its default, the INFERENCE_PRECISION_HINT it
    picks for this CPU, read back from the compiled model)."""

    def __init__(self, path, x, threads, precision="f32"):
        import openvino as ov
        core = ov.Core()
        self.version = ov.__version__
        self.default_precision = str(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
        if precision is not None:
            config["INFERENCE_PRECISION_HINT"] = precision
        model = core.compile_model(path, "CPU", config)
        self.precision = model.get_property("INFERENCE_PRECISION_HINT").to_string()   # "f32"
        self.name = f"OpenVINO {precision or 'default'}"
        self.request = model.create_infer_request()
        self.x = x

    def forward(self):
        return self.request.infer([self.x])[0]


def openvino_available():
    try:
        import openvino  # noqa: F401
        return True
    except ImportError:
        return False


def agreement(want, got):
    """max |got - want| / max |want|."""
    got = np.asarray(got).reshape(want.shape)
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)


def run_case(name, batch, args, threads):
    from caffepy import onnx_export
    param = nets.test_net(name, batch)
    from caffepy import precision
    mine = Caffepy(param, batch, args.seed)
    want = mine.forward().copy()
    contenders = [mine, CaffepyKept(param, batch, args.seed, weights_from=mine.net)]
    if precision.kernel() is not None:
        contenders.append(CaffepyBF16(param, batch, args.seed, weights_from=mine.net))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}_b{batch}.onnx")
        onnx_export.export(mine.net, path)
        contenders.append(OnnxRuntime(path, mine.x, threads))
        if args.openvino and openvino_available():
            contenders.append(OpenVINO(path, mine.x, threads))
            default = contenders[-1].default_precision      # bf16 on AVX512_BF16 / AMX CPUs
            if "f32" not in default and "float32" not in default:
                contenders.append(OpenVINO(path, mine.x, threads, precision=None))
    errors = {c.name: agreement(want, c.forward()) for c in contenders[1:]}
    for c in contenders:
        for _ in range(args.warmup):
            c.forward()
    times = {c.name: [] for c in contenders}
    for r in range(args.runs):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            # untimed first: the previous contender's pool threads spin on after its forward
            # (ONNX Runtime's, OpenMP's) and would be timed against this one's
            c.forward()
            t = time.perf_counter()
            c.forward()
            times[c.name].append(1e3 * (time.perf_counter() - t))
    return {"medians": {n: statistics.median(v) for n, v in times.items()}, "errors": errors,
            "first_ms": mine.first_ms,
            "versions": {c.name: getattr(c, "version", None) for c in contenders[1:]},
            "default_precision": next((c.default_precision for c in contenders
                                       if isinstance(c, OpenVINO)), None)}


def machine():
    from caffepy import device
    return device.summary_line()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", default=",".join(DEFAULT_NETS),
                    help=f"comma-separated, or 'all' ({', '.join(ALL_NETS)})")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-openvino", dest="openvino", action="store_false")
    args = ap.parse_args()
    names = ALL_NETS if args.nets == "all" else tuple(args.nets.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    from caffepy import log
    log.set_quiet(True)
    threads = len(os.sched_getaffinity(0))
    python = sys.executable
    if python.startswith(os.getcwd()):
        python = os.path.relpath(python)
    command = " ".join([python] + sys.argv)
    load_start = os.getloadavg()
    print(f"machine: {machine()}")
    print(f"load average at the start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}",
          flush=True)
    rows = []
    for name in names:
        for batch in batches:
            print(f"  {name} b{batch} ...", flush=True)
            rows.append((name, batch, run_case(name, batch, args, threads)))
    load_end = os.getloadavg()
    contenders = list(rows[0][2]["medians"])
    versions = rows[0][2]["versions"]
    print()
    head = ["net", "caffepy"] + [f"{c} {versions.get(c) or ''}".strip() for c in contenders[1:]] \
        + [f"{c} / caffepy" for c in contenders[1:]] + ["max rel. diff", "caffepy first forward"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, batch, res in rows:
        m = res["medians"]
        cells = [f"{nets.NETS[name][0].split(',')[0]} b{batch}", f"{m['caffepy']:.1f} ms"]
        cells += [f"{m[c]:.1f}" for c in contenders[1:]]
        cells += [f"{m[c] / m['caffepy']:.2f}x" for c in contenders[1:]]
        cells.append(", ".join(f"{e:.0e}" for e in res["errors"].values()))
        cells.append(f"{res['first_ms']:.0f} ms")
        print("| " + " | ".join(cells) + " |")
    print(f"\nmedian of {args.runs} forwards each after {args.warmup} warm-up, contenders "
          f"interleaved in one process, {threads} threads; a ratio above 1: caffepy faster")
    precision = rows[0][2]["default_precision"]
    if precision:
        print(f"OpenVINO's default inference precision on this CPU: {precision}")
    elif args.openvino:
        print(f"OpenVINO: not importable (make bench-inference installs it in {OPENVINO_DIR})")
    print(f"load average at the end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    print(f"command: {command}")
    blas = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    if blas:
        print(f"note: set in the environment: {blas}")


if __name__ == "__main__":
    main()
