"""Data path benchmark: decode + transform throughput and the data-wait fraction.

AlexNet-shaped input: 256x256 colour JPEGs in an encoded LMDB, transform_param
crop_size 227, mirror, a 256x256 mean_file, batch 64, TRAIN phase, prefetch 4.

    .venv/bin/python benchmarks/bench_data.py                 # all figures
    .venv/bin/python benchmarks/bench_data.py --compute 1.5 --busy

Prints
  1. one-thread decode + transform cost per image (no prefetch): the raw work;
  2. throughput in images/s of the Data layer (forward as fast as it can go);
  3. the data-wait fraction when each batch is followed by a fixed compute time
     (`--compute` seconds, ~ one AlexNet iteration here); with `--busy` that time
     is spent in NumPy matrix products on every core instead of sleeping, so the
     decode threads compete for the CPU as they do in training.
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

from caffepy import log, rng  # noqa: E402
from caffepy.data import tools  # noqa: E402
from caffepy.data.datum import datum_to_array, encoded_datum, parse_datum  # noqa: E402
from caffepy.data.db import open_writer  # noqa: E402
from caffepy.data.transformer import DataTransformer  # noqa: E402
from caffepy.net import Net  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402


def make_images(n, size, seed=0):
    """Photo-like JPEGs (smooth colour fields plus texture) so they compress like photos."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        low = g.uniform(0, 255, (8, 8, 3)).astype(np.float32)
        img = cv2.resize(low, (size, size), interpolation=cv2.INTER_CUBIC)
        img += g.normal(0, 12, img.shape).astype(np.float32)
        ok, buf = cv2.imencode(".jpg", np.clip(img, 0, 255).astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(buf.tobytes())
    return out


def build_db(path, jpegs):
    with open_writer(path) as db:
        for i, buf in enumerate(jpegs):
            db.put(f"{i:08d}", encoded_datum(buf, i % 1000).SerializeToString())


def data_net(db, mean, batch, prefetch):
    text = f'''layer {{ name: "data" type: "Data" top: "data" top: "label"
      transform_param {{ crop_size: 227 mirror: true mean_file: "{mean}" }}
      data_param {{ source: "{db}" batch_size: {batch} backend: LMDB prefetch: {prefetch} }} }}'''
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return Net(p, phase=caffe_pb2.TRAIN)


def one_thread_cost(jpegs, mean_path, reps=200):
    tp = caffe_pb2.TransformationParameter(crop_size=227, mirror=True, mean_file=mean_path)
    t = DataTransformer(tp, caffe_pb2.TRAIN, np.random.default_rng(0))
    out = np.empty((3, 227, 227), np.float32)
    values = [encoded_datum(b).SerializeToString() for b in jpegs]
    draws = t.draw(reps)
    start = time.perf_counter()
    for i in range(reps):
        img = datum_to_array(parse_datum(values[i % len(values)]))
        t.transform(img, draws[i], out)
    decode_transform = (time.perf_counter() - start) / reps
    start = time.perf_counter()
    for i in range(reps):
        datum_to_array(parse_datum(values[i % len(values)]))
    decode = (time.perf_counter() - start) / reps
    return decode, decode_transform


def busy_for(seconds, a):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=512, help="distinct JPEGs in the database")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=20, help="batches timed for throughput")
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--compute", type=float, default=1.5, help="seconds of compute per batch")
    ap.add_argument("--compute-batches", type=int, default=8)
    ap.add_argument("--busy", action="store_true", help="burn the compute time on every core")
    ap.add_argument("--keep", help="build the database in this folder and keep it")
    args = ap.parse_args()
    log.set_quiet(True)
    rng.seed(1)
    work = args.keep or tempfile.mkdtemp(prefix="caffepy_bench_data_")
    db, mean = os.path.join(work, "jpeg_lmdb"), os.path.join(work, "mean.binaryproto")
    try:
        if not os.path.exists(db):
            print(f"building {args.images} 256x256 JPEGs into {db} ...", flush=True)
            jpegs = make_images(args.images, 256)
            build_db(db, jpegs)
            tools.compute_image_mean(db, mean)
        else:
            from caffepy.data.db import open_reader
            r = open_reader(db)
            jpegs = [parse_datum(r.get(i)[1]).data for i in range(min(len(r), 64))]
            r.close()
        kb = np.mean([len(j) for j in jpegs]) / 1024
        print(f"data: {args.images} JPEGs 256x256 (mean {kb:.0f} KiB), crop 227, mirror, mean_file, "
              f"batch {args.batch}, prefetch {args.prefetch}, decode threads "
              f"{os.environ.get('CAFFEPY_DATA_THREADS', 'default')}, {os.cpu_count()} cores")

        decode, cost = one_thread_cost(jpegs, mean)
        print(f"one thread, no prefetch: decode {decode * 1e3:.2f} ms + transform "
              f"{(cost - decode) * 1e3:.2f} ms = {cost * 1e3:.2f} ms/image ({1 / cost:.0f} images/s)")

        net = data_net(db, mean, args.batch, args.prefetch)
        layer = net.layers[0]
        net.forward()                                   # first batch: thread start-up
        start, wait0 = time.perf_counter(), layer.wait_seconds
        for _ in range(args.batches):
            net.forward()
        elapsed = time.perf_counter() - start
        rate = args.batches * args.batch / elapsed
        print(f"Data layer throughput: {rate:.0f} images/s ({elapsed / args.batches * 1e3:.0f} ms per batch "
              f"of {args.batch}, forward only)")
        layer.close()

        net = data_net(db, mean, args.batch, args.prefetch)
        layer = net.layers[0]
        a = np.ones((512, 512), np.float32)
        net.forward()
        time.sleep(min(args.compute, 1.0))              # let the queue fill as training would
        wait0 = layer.wait_seconds
        start = time.perf_counter()
        for _ in range(args.compute_batches):
            net.forward()
            if args.busy:
                busy_for(args.compute, a)
            else:
                time.sleep(args.compute)
        total = time.perf_counter() - start
        waited = layer.wait_seconds - wait0
        kind = "busy (NumPy sgemm on every core)" if args.busy else "sleeping"
        print(f"data-wait fraction: {waited / total * 100:.2f}% ({waited * 1e3:.1f} ms waited over "
              f"{args.compute_batches} iterations of {args.compute:.2f} s compute, {kind})")
        layer.close()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
