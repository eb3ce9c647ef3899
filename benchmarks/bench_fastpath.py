"""The fast path on whole modern nets (issue 12): training forward + backward per iteration of
caffepy's default (channels-last, algorithms chosen by measurement), caffepy with Caffe's
algorithms (CAFFEPY_ENGINE=CAFFE: plain NCHW, im2col + GEMM) and PyTorch, in one run.

    python benchmarks/bench_fastpath.py [--batch 16] [--iters 5] [resnet50 googlenet mobilenet]

Nets: models/zoo's deploy files in TRAIN phase (batch-statistics BatchNorm, every parameter
gradient; ResNet-50 is the architecture of Intel's benchmark prototxt), fed random data. PyTorch
(if installed) runs ResNet-50 built here layer for layer, default and channels_last memory
format (--torch-format), the faster counted. Each contender lives in its own process; the driver runs their
iterations in turn (A B C A B C ...) so load changes hit all alike, and prints medians. The
first caffepy iteration measures the convolution candidates (or reads the cache,
CAFFEPY_CACHE_DIR) and is not counted; the algorithm per convolution is listed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = {"resnet50": "resnet50_deploy.prototxt", "googlenet": "googlenet_deploy.prototxt",
       "mobilenet": "mobilenet_v1_deploy.prototxt"}


def caffepy_worker(net_name, batch):
    sys.path.insert(0, REPO)
    import numpy as np
    from caffepy import log, upgrade
    from caffepy.net import TRAIN, Net
    log.set_quiet(True)
    param = upgrade.read_net(os.path.join(REPO, "models", "zoo", ZOO[net_name]))
    param.force_backward = True
    param.layer[0].input_param.shape[0].dim[0] = batch
    for layer in param.layer:
        if layer.type == "BatchNorm":
            layer.batch_norm_param.use_global_stats = False
    net = Net(param, phase=TRAIN)
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
    out = net.outputs[0]
    grad = np.random.default_rng(1).standard_normal(net.blobs[out].shape).astype(np.float32) * 1e-3

    def step():
        net.clear_param_diffs()
        net.forward_from_to()
        net.blobs[out].diff[...] = grad
        net.backward_from_to()
    algorithms = {layer.name: f"{layer.algorithm} ({getattr(layer, 'tuning', 'rule')})"
                  for layer in net.layers if getattr(layer, "algorithm", None)}
    return step, algorithms


def torch_resnet50(torch, nn):
    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, cout, stride):
            super().__init__()
            self.a = nn.Sequential(nn.Conv2d(cin, mid, 1, stride, bias=False), nn.BatchNorm2d(mid), nn.ReLU(True),
                                   nn.Conv2d(mid, mid, 3, 1, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(True),
                                   nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.short = None if cin == cout and stride == 1 else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            s = x if self.short is None else self.short(x)
            return torch.relu(self.a(x) + s)
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
              nn.MaxPool2d(3, 2, ceil_mode=True)]
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, mid, mid * 4, stride if i == 0 else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000), nn.Softmax(dim=1)]
    return nn.Sequential(*layers)


def torch_worker(net_name, batch, channels_last):
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = torch_resnet50(torch, nn)
    model.train()
    x = torch.randn(batch, 3, 224, 224)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(batch, 1000) * 1e-3

    def step():
        model.zero_grad(set_to_none=False)
        model(x).backward(grad)
    return step, {}


def worker(spec):
    kind, net_name, batch = spec["kind"], spec["net"], spec["batch"]
    if kind == "torch":
        step, algorithms = torch_worker(net_name, batch, spec["channels_last"])
    else:
        step, algorithms = caffepy_worker(net_name, batch)
    step()                                   # warm-up (and the algorithm measurements)
    print(json.dumps({"ready": True, "algorithms": algorithms}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t = time.perf_counter()
        step()
        print(json.dumps({"ms": (time.perf_counter() - t) * 1e3}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-format", choices=("both", "default", "channels_last"), default="both",
                    help="PyTorch memory formats to run (one saves memory on a small machine)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("nets", nargs="*", default=["resnet50", "googlenet"])
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    print(f"load average before: {os.getloadavg()}", flush=True)
    for net_name in args.nets:
        contenders = [("caffepy fast path", {"kind": "caffepy"}, {}),
                      ("caffepy engine CAFFE", {"kind": "caffepy"}, {"CAFFEPY_ENGINE": "CAFFE"})]
        if net_name == "resnet50" and not args.no_torch:
            if args.torch_format in ("both", "default"):
                contenders.append(("PyTorch", {"kind": "torch", "channels_last": False}, {}))
            if args.torch_format in ("both", "channels_last"):
                contenders.append(("PyTorch channels_last", {"kind": "torch", "channels_last": True}, {}))
        procs = []
        for label, spec, env in contenders:
            spec = dict(spec, net=net_name, batch=args.batch)
            p = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ, **env))
            ready = json.loads(p.stdout.readline())
            procs.append((label, p, ready["algorithms"], []))
        for _ in range(args.iters):
            for label, p, _, times in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
                times.append(json.loads(p.stdout.readline())["ms"])
        for _, p, _, _ in procs:
            p.stdin.close()
            p.wait()
        print(f"\n{net_name} batch {args.batch}, training forward+backward, median of {args.iters} "
              f"(interleaved); load average {os.getloadavg()}")
        medians = {label: statistics.median(times) for label, _, _, times in procs}
        for label, _, _, times in procs:
            print(f"  {label:24s} {medians[label]:9.1f} ms   (runs: {', '.join(f'{t:.0f}' for t in times)})")
        fast = medians["caffepy fast path"]
        print(f"  fast path vs engine CAFFE: {medians['caffepy engine CAFFE'] / fast:.2f}x")
        torch_ms = [v for k, v in medians.items() if k.startswith("PyTorch")]
        if torch_ms:
            print(f"  fast path vs PyTorch (faster format): {min(torch_ms) / fast:.2f}x")
        print("  algorithms:", "; ".join(f"{k}: {v}" for k, v in procs[0][2].items()))


if __name__ == "__main__":
    main()
