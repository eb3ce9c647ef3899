"""Winograd passes: the pass size scratch_shapes chooses against one pass over each thread's share
of the images, on layers of GoogLeNet, ResNet-50 and AlexNet, forward and backward (data and
weight gradients).

    .venv/bin/python benchmarks/bench_winograd.py [--rounds 7]

Both run on the same arrays and buffers in one process, in interleaved rounds (the minimum is
printed): on this kind of machine the same kernel can run 1.3-2x apart between two processes,
so only a comparison within one process means anything.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffepy.kernels import nhwc, winograd  # noqa: E402
from caffepy.layers.intel import block_width  # noqa: E402

ONE_PASS = 1 << 40          # a budget no share exceeds: the whole share in one pass

# name: (N, C, O, H, m, r, group, blocked)
LAYERS = {
    "GoogLeNet conv2/3x3": (16, 64, 192, 56, 4, 3, 1, False),
    "GoogLeNet inception_3a/3x3": (16, 96, 128, 28, 4, 3, 1, False),
    "ResNet-50 res2 3x3": (16, 64, 64, 56, 4, 3, 1, False),
    "ResNet-50 res4 3x3": (16, 256, 256, 14, 3, 3, 1, False),
    "ResNet-50 res5 3x3": (16, 512, 512, 7, 2, 3, 1, False),
    "AlexNet conv2 (blocked)": (64, 96, 256, 27, 3, 5, 2, True),
    "AlexNet conv3 (blocked)": (64, 256, 384, 13, 4, 3, 1, True),
}


def bench(name, spec, rounds, rng):
    N, C, O, H, m, r, group, blocked = spec
    threads, v = nhwc.max_threads(), block_width()
    pad = r // 2
    at, g, bt = winograd.matrices(m, r)
    a = m + r - 1
    w = rng.standard_normal((O, C // group, r, r), dtype=np.float32)
    u = np.empty((a * a, O, C // group), np.float32)          # the backward's layout
    winograd.weight_transform(w, g, u)
    ut = np.empty((a * a, C, O // group), np.float32)          # the forward's
    winograd.weight_transform(w, g, ut, group)
    bias = np.zeros(-(-O // v) * v, np.float32)
    if blocked:
        x = rng.standard_normal((N, -(-C // v), H, H, v), dtype=np.float32)
        y = np.empty((N, -(-O // v), H, H, v), np.float32)
        forward, backward = winograd.conv_forward, winograd.conv_backward
        width = C                       # the blocked kernels take the channel count here
    else:
        x = rng.standard_normal((N, H, H, C), dtype=np.float32)
        y = np.empty((N, H, H, O), np.float32)
        forward, backward = winograd.conv_forward_nhwc, winograd.conv_backward_nhwc
        width = v
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx = np.empty_like(x)
    du = np.empty((threads,) + u.shape, np.float32)
    shapes = {label: winograd.scratch_shapes(threads, N, C, O, H, H, v, m, r, pad, pad, group, budget)
              for label, budget in (("rule", winograd.PASS_BYTES), ("one pass", ONE_PASS))}
    size = max(winograd.scratch_floats(s) for pair in shapes.values() for s in pair)
    vmem, mmem = np.empty(size, np.float32), np.empty(size, np.float32)
    runs = {}
    for label, (vs, ms) in shapes.items():
        # the layers' buffers: tile positions spaced off page multiples (winograd_buffers)
        vb, mb = winograd.scratch_view(vmem, vs), winograd.scratch_view(mmem, ms)

        def fwd(vb=vb, mb=mb):
            forward(x, ut, bias, y, vb, mb, at, bt, width, O, m, r, pad, pad, group)

        def bwd(vb=vb, mb=mb):
            backward(x, u, dy, dx, du, vb, mb, at, bt, width, O, m, r, pad, pad, group, True, True)
        runs[label] = (vs[2], fwd, bwd, [], [])
    for rnd in range(rounds + 1):       # the first round warms up
        for tiles, fwd, bwd, f, b in runs.values():
            for fn, out in ((fwd, f), (bwd, b)):
                start = time.perf_counter()
                fn()
                if rnd:
                    out.append(time.perf_counter() - start)
    cells = [f"{label} ({tiles} tiles) {min(f) * 1e3:6.1f} / {min(b) * 1e3:6.1f}"
             for label, (tiles, _, _, f, b) in runs.items()]
    print(f"{name:28s} F({m},{r})  " + "   ".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"{nhwc.max_threads()} threads; ms forward / backward, minimum of {args.rounds} "
          "interleaved rounds; a thread's share of the images is its task")
    rng = np.random.default_rng(0)
    for name, spec in LAYERS.items():
        bench(name, spec, args.rounds, rng)


if __name__ == "__main__":
    main()
