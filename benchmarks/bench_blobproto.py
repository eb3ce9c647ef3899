"""Seconds to move N floats between NumPy and a BlobProto, each way, by the
path caffepy uses and by the obvious one.

    .venv/bin/python benchmarks/bench_blobproto.py [--count 60000000] [--naive-count 2000000]

The naive paths (repeated-field extend; element iteration) are timed on a
smaller count and scaled, since at 60M floats they take tens of seconds.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from caffepy.blobproto import array_to_blobproto, blobproto_to_array  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=60_000_000)
    parser.add_argument("--naive-count", type=int, default=2_000_000)
    args = parser.parse_args()
    n, m = args.count, args.naive_count
    arr = np.random.default_rng(0).random(n, dtype=np.float32)
    arr.view(np.uint8)[:] += 0  # touch every page before timing

    t_write, bp = timed(lambda: array_to_blobproto(arr))
    t_read, back = timed(lambda: blobproto_to_array(bp))
    assert np.array_equal(back, arr)
    t_serialize, wire = timed(bp.SerializeToString)
    t_frombuffer, _ = timed(lambda: np.frombuffer(wire, dtype="<f4", count=n, offset=len(wire) - 4 * n).copy())

    small = arr[:m]

    def naive_write():
        out = caffe_pb2.BlobProto()
        out.shape.dim.append(m)
        out.data.extend(small)
        return out

    t_naive_write, small_bp = timed(naive_write)
    t_naive_read, _ = timed(lambda: np.fromiter(small_bp.data, dtype=np.float32, count=m))
    scale = n / m

    print(f"{n:,} float32 values ({4 * n / 2**20:.0f} MiB)")
    print(f"  write, packed wire bytes + MergeFromString  {t_write:8.3f} s   (used)")
    print(f"  write, data.extend(ndarray)                 {t_naive_write * scale:8.3f} s   (scaled from {m:,})")
    print(f"  read,  np.array(bp.data)                    {t_read:8.3f} s   (used)")
    print(f"  read,  SerializeToString + np.frombuffer    {t_serialize + t_frombuffer:8.3f} s")
    print(f"  read,  np.fromiter(bp.data)                 {t_naive_read * scale:8.3f} s   (scaled from {m:,})")


if __name__ == "__main__":
    main()
