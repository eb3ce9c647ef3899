"""caffepy's matrix products (caffepy.kernels.common.gemm: cext/gemm_panels.h where blas.pxd routes
a shape there) against the same products by OpenBLAS on the same threads (gemm with panels off),
alternating in one process, on the products of ResNet-50 at batch 16 and a square. (NumPy's own
matmul is no fair peer in one process: its OpenBLAS threads spin on after each call and take a
core from the next contender.)

    python benchmarks/bench_gemm.py [--rounds 7]
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_gemm.py     # one core
    python benchmarks/bench_gemm.py --b1 [--rounds 15]
    python benchmarks/bench_gemm.py --nhwc [--rounds 15]

Each row: GFLOP/s of the best round of each, their ratio (BLAS time / caffepy time), which
kernel caffepy runs for the shape, and the largest difference relative to the largest value.

--b1: a TEST net's products at batch 1 (ResNet-50's convolutions and Winograd positions,
GoogLeNet's widest), B the weights: packed once (common.gemm_packed, what a TEST net's im2col
and 1 x 1 GEMMs run) against gemm, which packs B on every call (its panels or the BLAS, as
routed). The weights come cold, as in a net's forward (ResNet-50's 100 MB outgrow the caches):
each call reads the next of copies filling 80 MB. GFLOP/s of the median round (the machine is
shared), the ratio (gemm time / packed time), and what gemm runs. The products alone: a layer
that packs redoes it when blob.Seen finds its weights may have changed, a check that reads no
float while nothing outside the blob holds them (blob.Writes).

--nhwc: the --b1 products as a TEST net runs them, through caffepy.kernels.nhwc (a 1 x 1
convolution over M pixels of K channels on weights packed once: conv_forward's `packed`). That
module is built for AVX-512 too and caffepy.isa loads that build where the CPU has it, so this
times the panels at the width the nets run, which the other modes (caffepy.kernels.common,
built for AVX2 only) do not. Against OpenBLAS on the same threads (common.gemm, panels off),
weights cold for both: GFLOP/s of the median round, the ratio (BLAS time / nhwc time).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from timing import alternate, median  # noqa: E402

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
B1 = [("res2 1x1 64->256", 3136, 256, 64, True), ("res2 1x1 256->64", 3136, 64, 256, True),
      ("res3 1x1 128->512", 784, 512, 128, True), ("res3 1x1 512->128", 784, 128, 512, True),
      ("res3a 1x1 256->512 /2", 784, 512, 256, True),
      ("res4 1x1 256->1024", 196, 1024, 256, True), ("res4 1x1 1024->256", 196, 256, 1024, True),
      ("res4a 1x1 512->1024 /2", 196, 1024, 512, True),
      ("res5 1x1 512->2048", 49, 2048, 512, True), ("res5 1x1 2048->512", 49, 512, 2048, True),
      ("res5a 1x1 1024->2048 /2", 49, 2048, 1024, True),
      ("res5 3x3 im2col 512->512", 49, 512, 4608, False),
      ("res2 3x3 F(4,3) position", 196, 64, 64, False),
      ("res3 3x3 F(4,3) position", 49, 128, 128, False),
      ("res4 3x3 F(3,3) position", 25, 256, 256, False),
      ("inception_5b 1x1 832->384", 49, 384, 832, True),
      ("inception_4e 3x3 im2col 160->320", 196, 320, 1440, False)]


def batch1(rounds):
    from caffepy.kernels import common as kernels
    rng = np.random.default_rng(0)
    print(f"team limit now {kernels.team_limit()} threads, vector width {kernels.SKINNY_WIDTH} "
          f"floats; weights cold (80 MB of copies)")
    print(f"{'product':34s} {'M':>6s} {'N':>5s} {'K':>5s} {'packed':>8s} {'gemm':>8s} "
          f"{'ratio':>6s}  gemm runs")
    for what, m, n, k, trans in B1:
        a = rng.standard_normal((m, k), dtype=np.float32)
        copies = 2 + int(80e6 // (4 * n * k))
        stored = [rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32)
                  for _ in range(copies)]
        bs = [s.T if trans else s for s in stored]
        packed = [kernels.pack_panels(b) for b in bs]
        ours, theirs = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
        turn = [0, 0]

        def run_packed():
            turn[0] += 1
            kernels.gemm_packed(a, packed[turn[0] % copies], ours)

        def run_gemm():
            turn[1] += 1
            kernels.gemm(a, bs[turn[1] % copies], theirs)

        t_packed, t_gemm = alternate([run_packed, run_gemm], max(rounds, 2 * copies),
                                     summary=median)
        flop = 2.0 * m * n * k / 1e6
        kernel = "panels" if kernels.panels_wanted(m, n, k) else "BLAS"
        print(f"{what:34s} {m:6d} {n:5d} {k:5d} {flop / t_packed:8.1f} {flop / t_gemm:8.1f} "
              f"{t_gemm / t_packed:6.2f}  {kernel}")


def nets_build(rounds):
    from caffepy import isa
    from caffepy.kernels import common, nhwc
    rng = np.random.default_rng(0)
    print(f"nhwc's build: {isa.NAMES[isa.selected()[0]]}, team limit now {common.team_limit()} "
          f"threads; weights cold (80 MB of copies)")
    print(f"{'product':34s} {'M':>6s} {'N':>5s} {'K':>5s} {'nhwc':>8s} {'BLAS':>8s} "
          f"{'ratio':>6s}  max rel diff")
    empty, col = np.zeros(0, np.float32), np.zeros((nhwc.max_threads(), 0), np.float32)
    for what, m, n, k, _ in B1:
        x = rng.standard_normal((1, 1, m, k), dtype=np.float32)
        copies = 2 + int(80e6 // (4 * n * k))
        wts = [rng.standard_normal((1, n, k), dtype=np.float32) for _ in range(copies)]
        packed = []
        for wt in wts:
            packed.append(np.empty(nhwc.packed_floats(1, n, k), np.float32))
            nhwc.pack_weights(wt, True, packed[-1])
        ours, theirs = np.empty((1, 1, m, n), np.float32), np.empty((m, n), np.float32)
        turn = [0, 0]

        def run_nhwc():
            turn[0] += 1
            i = turn[0] % copies
            nhwc.conv_forward(x, wts[i], empty, ours, col, n, 1, 1, 0, 0, 1, 1, 1, 1, 1, m, True,
                              None, False, None, packed[i])

        def run_blas():
            turn[1] += 1
            common.gemm(x[0, 0], wts[turn[1] % copies][0].T, theirs, panels=False)

        t_ours, t_blas = alternate([run_nhwc, run_blas], max(rounds, 2 * copies), summary=median)
        turn[0] = turn[1] = 0
        run_nhwc()
        run_blas()
        err = float(np.abs(ours[0, 0] - theirs).max() / np.abs(theirs).max())
        flop = 2.0 * m * n * k / 1e6
        print(f"{what:34s} {m:6d} {n:5d} {k:5d} {flop / t_ours:8.1f} {flop / t_blas:8.1f} "
              f"{t_blas / t_ours:6.2f}  {err:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--b1", action="store_true", help="a TEST net's products at batch 1: "
                    "weights packed once against packed on every call")
    ap.add_argument("--nhwc", action="store_true", help="a TEST net's products through the "
                    "nhwc module (its AVX-512 build where the CPU has it) against the BLAS")
    args = ap.parse_args()
    if args.nhwc:
        nets_build(args.rounds)
        return
    if args.b1:
        batch1(args.rounds)
        return
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
