"""Prefetcher: order, waiting time, errors handed to the consumer, clean exit."""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from caffepy.data.prefetch import Prefetcher
from caffepy.errors import DataError
from paths import REPO, TESTS


class SlowFiller:
    def __init__(self, delay=0.0, fail_at=None, error=None):
        self.delay, self.fail_at, self.error, self.count = delay, fail_at, error, 0

    def allocate(self):
        return {"data": np.zeros(1), "label": np.zeros(1)}

    def fill(self, buf):
        time.sleep(self.delay)
        if self.count == self.fail_at:
            raise self.error
        buf["data"][0] = self.count
        self.count += 1

    def close(self):
        pass


def test_batches_arrive_in_order_and_buffers_are_recycled():
    p = Prefetcher(SlowFiller(), depth=2)
    got = []
    for _ in range(7):
        buf = p.next()
        got.append(int(buf["data"][0]))
        p.release(buf)
    p.close()
    assert got == list(range(7))


def test_wait_seconds_counts_the_time_spent_waiting():
    p = Prefetcher(SlowFiller(delay=0.05), depth=1)
    for _ in range(4):
        p.release(p.next())
    assert p.wait_seconds >= 0.1
    p.close()
    fast = Prefetcher(SlowFiller(), depth=4)
    time.sleep(0.1)
    fast.release(fast.next())
    assert fast.wait_seconds < 0.05
    fast.close()


def test_errors_reach_the_consumer_after_the_good_batches():
    p = Prefetcher(SlowFiller(fail_at=2, error=DataError("db: key 'k': broken")), depth=4)
    p.release(p.next())
    p.release(p.next())
    with pytest.raises(DataError, match="db: key 'k': broken"):
        p.next()
    p.close()
    p = Prefetcher(SlowFiller(fail_at=0, error=ZeroDivisionError("bug")), depth=1)
    with pytest.raises(ZeroDivisionError):       # a bug keeps its type and traceback
        p.next()
    p.close()


def test_process_with_running_prefetchers_exits_promptly(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from google.protobuf import text_format
        from caffepy import log
        from caffepy.net import Net
        from caffepy.proto import caffe_pb2
        sys.path.insert(0, {TESTS!r})
        from data_helpers import make_db, data_net_text
        log.set_quiet(True)
        db = make_db({str(tmp_path / 'db')!r}, 50, shape=(3, 64, 64))
        p = caffe_pb2.NetParameter()
        text_format.Parse(data_net_text(db, 8), p)
        net = Net(p, phase=caffe_pb2.TRAIN)
        net.forward()
        print("ok")
    """)
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
    assert time.perf_counter() - start < 30
