"""SSD's data layer: images/s of AnnotatedData on SSD300's transforms, and the share of a training
iteration that waits for it.

Intel Caffe's SSD300 recipe (models/intel_optimized_models/ssd/VGGNet/VOC0712/SSD_300x300):
TRAIN distort_param, expand_param (prob 0.5, up to 4x), the six batch samplers (IoU-constrained
crops, 50 trials each), resize_param WARP 300x300 drawing among 5 interpolations, mirror,
emit_constraint CENTER, mean; TEST resize WARP 300x300. Records: the generated shapes set
(caffepy.data.shapes) at --size, JPEG-encoded by convert_annoset, batch 32 (the recipe's), read
by the layer's prefetch with 1 and 2 decode threads (CAFFEPY_DATA_THREADS), forward as fast as it
goes. Then the wait share: `caffepy time`'s "Data wait" of a net training on the layer (the tiny
SSD of examples/shapes, whose compute is small, so the data path shows if it is the bottleneck).

    .venv/bin/python benchmarks/bench_annotated.py [--images 128] [--size 300] [--batches 6] [--rounds 3]

Each figure is the best of --rounds rounds (on a shared machine the best is the least disturbed).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from caffepy import log  # noqa: E402
from caffepy.data.shapes import write_lmdbs, write_shapes  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402
from timing import data_layer_rate  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEAN = "mean_value: 104 mean_value: 117 mean_value: 123"
SAMPLER = ("batch_sampler {{ sampler {{ min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 max_aspect_ratio: 2.0 }} "
           "sample_constraint {{ {} }} max_sample: 1 max_trials: 50 }}")
SAMPLERS = "batch_sampler { max_sample: 1 max_trials: 1 } " + " ".join(
    SAMPLER.format(c) for c in ("min_jaccard_overlap: 0.1", "min_jaccard_overlap: 0.3", "min_jaccard_overlap: 0.5",
                                "min_jaccard_overlap: 0.7", "min_jaccard_overlap: 0.9", "max_jaccard_overlap: 1.0"))
TRAIN = (f"mirror: true {MEAN} resize_param {{ prob: 1 resize_mode: WARP height: 300 width: 300 interp_mode: LINEAR "
         f"interp_mode: AREA interp_mode: NEAREST interp_mode: CUBIC interp_mode: LANCZOS4 }} "
         f"emit_constraint {{ emit_type: CENTER }} distort_param {{ brightness_prob: 0.5 brightness_delta: 32 "
         f"contrast_prob: 0.5 contrast_lower: 0.5 contrast_upper: 1.5 hue_prob: 0.5 hue_delta: 18 "
         f"saturation_prob: 0.5 saturation_lower: 0.5 saturation_upper: 1.5 random_order_prob: 0.0 }} "
         f"expand_param {{ prob: 0.5 max_expand_ratio: 4.0 }}")
TEST = f"{MEAN} resize_param {{ prob: 1 resize_mode: WARP height: 300 width: 300 interp_mode: LINEAR }}"
RECIPES = {"SSD300 TRAIN": (caffe_pb2.TRAIN, TRAIN, SAMPLERS), "SSD300 TEST": (caffe_pb2.TEST, TEST, "")}


def throughput(db, phase, transform, samplers, threads, batch, batches):
    text = (f'layer {{ name: "data" type: "AnnotatedData" top: "data" top: "label" '
            f'transform_param {{ {transform} }} data_param {{ source: "{db}" batch_size: {batch} }} '
            f'annotated_data_param {{ {samplers} }} }}')
    return data_layer_rate(text, phase, threads, batch, batches)


def wait_share(data_root, iterations=30):
    """`caffepy time` of the tiny SSD on 64x64 images: (ms of data wait per iteration, % of forward)."""
    net = open(os.path.join(REPO, "examples", "shapes", "tiny_ssd_train.prototxt")).read()
    path = os.path.join(data_root, "tiny_train.prototxt")
    with open(path, "w") as f:
        f.write(net.replace("examples/shapes/data", data_root))
    out = subprocess.run([sys.executable, "-m", "caffepy.cli", "time", "-model", path, "-iterations", str(iterations)],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    m = re.search(r"Data wait \(data\): (\S+) ms per iteration, (\S+)% of the forward pass", out.stderr)
    fb = re.search(r"Average Forward-Backward: (\S+) ms", out.stderr)
    return float(m.group(1)), float(m.group(2)), float(fb.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=128, help="distinct images in the database")
    ap.add_argument("--size", type=int, default=300, help="their side in pixels")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=6, help="batches timed per figure")
    ap.add_argument("--threads", default="1,2", help="decode thread counts to time")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per figure (the best is printed)")
    args = ap.parse_args()
    log.set_quiet(True)
    work = tempfile.mkdtemp(prefix="caffepy_bench_annotated_")
    saved = os.environ.get("CAFFEPY_DATA_THREADS")
    try:
        root = os.path.join(work, "shapes")
        write_shapes(root, args.images, 0, size=args.size, seed=0)
        db = write_lmdbs(root, ("trainval",))["trainval"]
        threads = [int(n) for n in args.threads.split(",")]
        print(f"{args.images} JPEG records {args.size}x{args.size}, batch {args.batch}, {os.cpu_count()} cores, "
              f"best of {args.rounds} rounds")
        for name, (phase, transform, samplers) in RECIPES.items():
            rates = {n: [] for n in threads}
            for _ in range(args.rounds):
                for n in threads:
                    rates[n].append(throughput(db, phase, transform, samplers, n, args.batch, args.batches))
            shown = ", ".join(f"{n} thread{'s' if n > 1 else ''} {max(rates[n]):6.0f} images/s" for n in threads)
            print(f"{name:13s} {shown}", flush=True)
        small = os.path.join(work, "small")
        write_shapes(small, 96, 0, size=64, seed=0)
        write_lmdbs(small, ("trainval",))
        best = min((wait_share(small) for _ in range(args.rounds)), key=lambda w: w[1])
        print(f"tiny SSD training (batch 8 of 64x64, its SSD augmentations): data wait {best[0]:.2f} ms per "
              f"iteration, {best[1]:.1f}% of the forward pass; forward-backward {best[2]:.0f} ms")
    finally:
        if saved is None:
            os.environ.pop("CAFFEPY_DATA_THREADS", None)
        else:
            os.environ["CAFFEPY_DATA_THREADS"] = saved
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
