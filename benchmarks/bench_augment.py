"""Intel Caffe's augmentations in the data path: images/s of the Data layer.

The ResNet-50 multinode recipes' transforms (Intel Caffe's models/intel_optimized_models/
multinode/default_resnet50_*): TRAIN crop 224, mirror, mean_value, random_aspect_ratio_param
(area 0.08..1, aspect change 0.75, cubic); TEST crop 224, random_resize_param 256..256 (cubic).
256x256 photo-like records, JPEG-encoded and raw, batch 64, read by the Data layer's prefetch
with 1 and 2 decode threads (CAFFEPY_DATA_THREADS), forward as fast as it goes; the
plain crop + mirror transform of the same records for comparison.

    .venv/bin/python benchmarks/bench_augment.py [--images 256] [--batches 12] [--rounds 3]

Prints one line per (records, transform): images/s for each thread count, and the one-thread
cost per image of decode and transform without prefetch; each figure the best of --rounds
rounds, interleaved (on a shared machine the best is the least disturbed). `--cv-threads N`
sets OpenCV's own thread pool (cv2.setNumThreads) first.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import cv2
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from google.protobuf import text_format  # noqa: E402

from bench_data import build_db, make_images  # noqa: E402
from caffepy import log  # noqa: E402
from caffepy.data.datum import array_to_datum, datum_to_array, decode_image, parse_datum  # noqa: E402
from caffepy.data.db import open_reader, open_writer  # noqa: E402
from caffepy.data.transformer import DataTransformer  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402
from timing import data_layer_rate  # noqa: E402

MEAN = "mean_value: 104 mean_value: 117 mean_value: 123"
TRANSFORMS = {
    "resnet50 TRAIN": (caffe_pb2.TRAIN, f"crop_size: 224 mirror: true {MEAN} random_aspect_ratio_param {{ "
                       f"min_area_ratio: 0.08 max_area_ratio: 1 aspect_ratio_change: 0.75 "
                       f"resize_param {{ interp_mode: CUBIC }} }}"),
    "resnet50 TEST": (caffe_pb2.TEST, f"crop_size: 224 {MEAN} random_resize_param {{ min_size: 256 max_size: 256 "
                      f"resize_param {{ interp_mode: CUBIC }} }}"),
    "plain crop+mirror": (caffe_pb2.TRAIN, f"crop_size: 224 mirror: true {MEAN}"),
}


def build_raw(path, jpegs):
    with open_writer(path) as db:
        for i, buf in enumerate(jpegs):
            db.put(f"{i:08d}", array_to_datum(decode_image(buf).transpose(2, 0, 1), i % 1000).SerializeToString())


def per_image(db, phase, transform, reps=100):
    """One thread, no prefetch: decode, and transform, in seconds per image."""
    tp = text_format.Parse(transform, caffe_pb2.TransformationParameter())
    t = DataTransformer(tp, phase, np.random.default_rng(0))
    r = open_reader(db)
    values = [r.get(i)[1] for i in range(min(len(r), 64))]
    r.close()
    out = np.empty(t.check(datum_to_array(parse_datum(values[0])).shape), np.float32)
    draws = t.draw(reps)
    decode = transform_s = 0.0
    for i in range(reps):
        start = time.perf_counter()
        image = datum_to_array(parse_datum(values[i % len(values)]))
        middle = time.perf_counter()
        t.transform(image, draws[i], out)
        decode, transform_s = decode + middle - start, transform_s + time.perf_counter() - middle
    return decode / reps, transform_s / reps


def throughput(db, phase, transform, threads, batch, batches):
    text = (f'layer {{ name: "data" type: "Data" top: "data" top: "label" transform_param {{ {transform} }} '
            f'data_param {{ source: "{db}" batch_size: {batch} backend: LMDB }} }}')
    return data_layer_rate(text, phase, threads, batch, batches)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=256, help="distinct 256x256 images in each database")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=12, help="batches timed per figure")
    ap.add_argument("--threads", default="1,2", help="decode thread counts to time")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per figure (the best is printed)")
    ap.add_argument("--cv-threads", type=int, help="OpenCV's own threads (default: OpenCV's choice)")
    args = ap.parse_args()
    log.set_quiet(True)
    if args.cv_threads is not None:
        cv2.setNumThreads(args.cv_threads)
    work = tempfile.mkdtemp(prefix="caffepy_bench_augment_")
    saved = os.environ.get("CAFFEPY_DATA_THREADS")
    try:
        jpegs = make_images(args.images, 256)
        dbs = {"jpeg": os.path.join(work, "jpeg_lmdb"), "raw": os.path.join(work, "raw_lmdb")}
        build_db(dbs["jpeg"], jpegs)
        build_raw(dbs["raw"], jpegs)
        threads = [int(n) for n in args.threads.split(",")]
        print(f"{args.images} records 256x256x3, batch {args.batch}, {os.cpu_count()} cores, OpenCV threads "
              f"{cv2.getNumThreads()}, best of {args.rounds} rounds")
        for kind, db in dbs.items():
            for name, (phase, transform) in TRANSFORMS.items():
                costs, rates = [], {n: [] for n in threads}
                for _ in range(args.rounds):
                    costs.append(per_image(db, phase, transform))
                    for n in threads:
                        rates[n].append(throughput(db, phase, transform, n, args.batch, args.batches))
                decode, work_s = min(c[0] for c in costs), min(c[1] for c in costs)
                shown = ", ".join(f"{n} thread{'s' if n > 1 else ''} {max(rates[n]):6.0f} images/s" for n in threads)
                print(f"{kind:4s} {name:18s} {shown}   (one thread: decode {decode * 1e3:.2f} ms + "
                      f"transform {work_s * 1e3:.2f} ms per image)", flush=True)
    finally:
        if saved is None:
            os.environ.pop("CAFFEPY_DATA_THREADS", None)
        else:
            os.environ["CAFFEPY_DATA_THREADS"] = saved
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
