"""InnerProduct's products at small batch: skinny_gemm (cext/common_skinny.h) against the BLAS
path it replaced (caffepy.kernels.common.gemm, the batch as a transposed view), alternating in
one process, on the shapes of AlexNet's, VGG-16's, ResNet-50's and LeNet's classifiers.

    python benchmarks/bench_skinny.py [--batches 64,16,4] [--rounds 6]

Each row is one product as the layer runs it: forward y^T = W x^T, data gradient
dx^T = W^T dy^T; GFLOP/s of the best round of each, and their ratio (BLAS time / skinny time).
OMP_NUM_THREADS=1 gives the one-core figures.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from timing import alternate  # noqa: E402

# (layer, outputs, inputs)
LAYERS = [("AlexNet fc6", 4096, 9216), ("AlexNet fc7", 4096, 4096), ("AlexNet fc8", 1000, 4096),
          ("VGG-16 fc6", 4096, 25088), ("ResNet-50 fc1000", 1000, 2048), ("LeNet ip1", 500, 800)]


def compare(kernels, rows, batch, depth, trans, rounds, rng):
    """Best ms of skinny_gemm and of the BLAS path for [rows, depth] x [depth, batch]."""
    width = -(-batch // kernels.SKINNY_WIDTH) * kernels.SKINNY_WIDTH
    stored = rng.standard_normal((depth, rows) if trans else (rows, depth), dtype=np.float32)
    a = stored.T if trans else stored
    b = np.zeros((depth, width), np.float32)
    b[:, :batch] = rng.standard_normal((depth, batch), dtype=np.float32)
    c = np.empty((rows, width), np.float32)
    batch_major = np.ascontiguousarray(b[:, :batch].T)
    c_blas = np.empty((rows, batch), np.float32)
    skinny, blas = alternate([lambda: kernels.skinny_gemm(a, b, c),
                              lambda: kernels.gemm(a, batch_major.T, c_blas)], rounds)
    err = float(np.abs(c[:, :batch] - c_blas).max() / max(np.abs(c_blas).max(), 1e-30))
    return skinny, blas, err


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,16,4")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    from caffepy.kernels import common as kernels
    rng = np.random.default_rng(0)
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, "
          f"vector width {kernels.SKINNY_WIDTH} floats")
    print(f"{'layer':18s} {'batch':>5s} {'product':10s} {'skinny':>8s} {'BLAS':>8s} "
          f"{'ratio':>6s}  max rel diff")
    for batch in (int(v) for v in args.batches.split(",")):
        for name, outputs, inputs in LAYERS:
            for product, rows, depth, trans in (("forward", outputs, inputs, False),
                                                ("data grad", inputs, outputs, True)):
                skinny, blas, err = compare(kernels, rows, batch, depth, trans, args.rounds, rng)
                flop = 2.0 * rows * batch * depth / 1e6            # per ms: GFLOP/s
                print(f"{name:18s} {batch:5d} {product:10s} {flop / skinny:8.1f} {flop / blas:8.1f} "
                      f"{blas / skinny:6.2f}  {err:.1e}")


if __name__ == "__main__":
    main()
