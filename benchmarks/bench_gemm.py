"""caffepy's matrix products (caffepy.kernels.common.gemm: cext/gemm_panels.h where blas.pxd routes
a shape there) against the same products by OpenBLAS on the same threads (gemm with panels off),
alternating in one process, on the products of ResNet-50 at batch 16 and a square. (NumPy's own
matmul is no fair peer in one process: its OpenBLAS threads spin on after each call and take a
core from the next contender.)

    python benchmarks/bench_gemm.py [--rounds 7]
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_gemm.py     # one core

Each row: GFLOP/s of the best round of each, their ratio (BLAS time / caffepy time), which
kernel caffepy runs for the shape, and the largest difference relative to the largest value.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from timing import alternate  # noqa: E402

P56, P28, P14, P7 = 16 * 56 * 56, 16 * 28 * 28, 16 * 14 * 14, 16 * 7 * 7
# (what, M, N, K, B stored transposed): row-major C [M, N] = A [M, K] op(B)
SHAPES = [("square", 2048, 2048, 2048, False)]
for stage, rows, wide, thin in (("res2", P56, 256, 64), ("res3", P28, 512, 128),
                                ("res4", P14, 1024, 256), ("res5", P7, 2048, 512)):
    SHAPES += [(f"{stage} 1x1 {thin}->{wide} forward", rows, wide, thin, True),
               (f"{stage} 1x1 {wide}->{thin} forward", rows, thin, wide, True),
               (f"{stage} 1x1 {thin}->{wide} data grad", rows, thin, wide, False),
               (f"{stage} 1x1 {wide}->{thin} data grad", rows, wide, thin, False)]
SHAPES += [("res2 1x1 64->64 forward", P56, 64, 64, True),
           ("res2 3x3 F(4,3) position", 1568, 64, 64, False),
           ("res3 3x3 F(4,3) position", 392, 128, 128, False),
           ("res4 3x3 F(5,3) position", 144, 256, 256, False),
           ("res5 3x3 F(4,3) position", 64, 512, 512, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from caffepy.kernels import common as kernels
    rng = np.random.default_rng(0)
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, "
          f"vector width {kernels.SKINNY_WIDTH} floats")
    print(f"{'product':34s} {'M':>6s} {'N':>5s} {'K':>5s} {'caffepy':>8s} {'BLAS':>8s} "
          f"{'ratio':>6s}  kernel  max rel diff")
    for what, m, n, k, trans in SHAPES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        stored = rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32)
        b = stored.T if trans else stored
        ours, theirs = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
        t_ours, t_blas = alternate([lambda: kernels.gemm(a, b, ours),
                                  lambda: kernels.gemm(a, b, theirs, panels=False)], args.rounds)
        err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        flop = 2.0 * m * n * k / 1e6            # per ms: GFLOP/s
        kernel = "panels" if kernels.panels_wanted(m, n, k) else "BLAS"
        print(f"{what:34s} {m:6d} {n:5d} {k:5d} {flop / t_ours:8.1f} {flop / t_blas:8.1f} "
              f"{t_blas / t_ours:6.2f}  {kernel:6s}  {err:.1e}")


if __name__ == "__main__":
    main()
