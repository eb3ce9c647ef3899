"""Batches read ahead in background threads, so loading hides behind compute.

    RecordOrder   which record the i-th read of this rank gets (epochs, shuffle, ranks)
    BatchFiller   reads a batch of records and decodes + transforms them into a buffer,
                  split over a few worker threads (OpenCV decode and NumPy ufuncs
                  release the GIL, so the workers run in parallel with the training loop)
    Prefetcher    one daemon thread filling `depth` recycled buffers ahead of the
                  consumer; `next()` hands over a full one and adds the time it had to
                  wait to `wait_seconds`; an error in the thread is raised by `next()`;
                  `restart(reposition)` drops what was read ahead and starts over from
                  where `reposition` puts the filler

Each buffer BatchFiller fills carries its `position`: the reads done and the
transformer's generator state once that batch is read, i.e. where the source
stands for a consumer that has taken this batch and no other (the prefetcher
itself is always further on).

Every prefetcher is stopped at interpreter exit (a stop event, then a short join).
"""
import atexit
import os
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_live = weakref.WeakSet()


def default_threads():
    """Decode threads per data layer: CAFFEPY_DATA_THREADS, else up to 2."""
    value = os.environ.get("CAFFEPY_DATA_THREADS")
    if value:
        return max(1, int(value))
    return max(1, min(2, os.cpu_count() or 1))


class RecordOrder:
    """The record index of each read, for one rank of `ranks`.

    Reads of all ranks together walk one global stream: rank r's i-th read is
    global position t = skip + i * ranks + r, i.e. the ranks interleave record by
    record. Position t is record t mod size of epoch t // size; with `shuffle`
    each epoch walks its own permutation, drawn from (seed, epoch), so every rank
    sharing `seed` agrees on it. The union of the ranks' k-th batches (local
    batch b) is then exactly the k-th batch of size b * ranks of a single rank.
    """

    def __init__(self, size, rank=0, ranks=1, shuffle=False, seed=0, skip=0):
        assert size > 0 and 0 <= rank < ranks
        self.size, self.rank, self.ranks = size, rank, ranks
        self.shuffle, self.seed, self.skip = shuffle, int(seed), int(skip)
        self._epoch, self._perm = None, None

    def permutation(self, epoch):
        if self._epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            self._epoch = epoch
        return self._perm

    def position(self, i):
        """The global stream position of this rank's i-th read (the ranks' reads together
        count 0, 1, 2, ...)."""
        return self.skip + i * self.ranks + self.rank

    def index(self, i):
        """Record index of this rank's i-th read."""
        epoch, pos = divmod(self.position(i), self.size)
        return int(self.permutation(epoch)[pos]) if self.shuffle else pos


class BatchFiller:
    """Fills {'data': (b, C, H, W), 'label': (b,)} buffers from a record source.

    `source` has get(index) -> (key, raw) (cheap, sequential: runs on the prefetch
    thread) and decode(key, raw) -> (C x H x W array, label) (the heavy part: runs on
    the worker threads). `transformer` is a DataTransformer.
    """

    def __init__(self, source, transformer, order, batch_size, shape, threads=None):
        self.source, self.transformer, self.order = source, transformer, order
        self.batch_size, self.shape = batch_size, tuple(shape)
        self.reads = 0
        self.threads = min(threads or default_threads(), batch_size)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="caffepy-decode") \
            if self.threads > 1 else None

    def allocate(self):
        return {"data": np.zeros((self.batch_size,) + self.shape, np.float32),
                "label": np.zeros(self.batch_size, np.float32)}

    def position(self):
        """(reads done, the transformer's generator state): where the next batch starts."""
        return self.reads, self.transformer.gen.bit_generator.state

    def fill(self, buf):
        b = self.batch_size
        items = []
        for _ in range(b):
            items.append(self.source.get(self.order.index(self.reads)))
            self.reads += 1
        draws = self.transformer.draw(b)
        buf["position"] = self.position()

        def work(lo, hi):
            for j in range(lo, hi):
                key, raw = items[j]
                image, label = self.source.decode(key, raw)
                self.transformer.transform(image, draws[j], buf["data"][j], self.source.where(key))
                buf["label"][j] = label

        if self._pool is None:
            work(0, b)
        else:
            bounds = np.linspace(0, b, self.threads + 1).astype(int)
            futures = [self._pool.submit(work, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
            for f in futures:
                f.result()
        return buf

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class _Failure:
    def __init__(self, error):
        self.error = error


class Prefetcher:
    """Runs `filler.fill` on a daemon thread, `depth` batches ahead of `next()`.

    Closing it stops the thread and closes the filler and `also_close` (the layer's source).
    `close()` waits for the thread; `request_close()` only asks, and the thread closes them
    itself as it ends: that is what a layer's finalizer calls, since the garbage collector
    runs it in whatever thread it interrupts, perhaps one that holds a lock closing would take
    (the thread's own ThreadPoolExecutor.submit, a database registry), so it must not wait or
    close anything there."""

    def __init__(self, filler, depth=4, name="data", also_close=()):
        self.filler = filler
        self._also_close = list(also_close)
        self._closing = threading.Event()
        self._released = threading.Lock()       # taken, never waited for, by whoever closes
        self.depth = max(1, int(depth))
        self.wait_seconds = 0.0
        self.batches = 0
        self._free, self._full = queue.Queue(), queue.Queue()
        for _ in range(self.depth):
            self._free.put(filler.allocate())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"caffepy-prefetch-{name}", daemon=True)
        self._thread.start()
        _live.add(self)

    def _run(self):
        try:
            while not self._stop.is_set():
                try:
                    buf = self._free.get(timeout=0.1)
                except queue.Empty:
                    continue
                self.filler.fill(buf)
                self._full.put(buf)
        except BaseException as e:   # handed to the consumer, which raises it
            self._full.put(_Failure(e))
        finally:
            if self._closing.is_set():      # request_close() set it before stopping the thread
                self._release()

    def next(self):
        """The next full batch (give it back with `release`)."""
        start = time.perf_counter()
        while True:
            try:
                item = self._full.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._full.empty():
                    raise RuntimeError("the prefetch thread stopped")   # after close()
        self.wait_seconds += time.perf_counter() - start
        if isinstance(item, _Failure):
            self._full.put(item)      # every later call fails the same way
            raise item.error
        self.batches += 1
        return item

    def release(self, buf):
        self._free.put(buf)

    def restart(self, reposition):
        """Stop the thread (once its current batch is done), drop the batches read ahead,
        call `reposition()` (which moves the filler) and start reading again. Every buffer
        handed out must have been released."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        while not self._full.empty():
            item = self._full.get()
            if not isinstance(item, _Failure):
                self._free.put(item)
        reposition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self._thread.name, daemon=True)
        self._thread.start()

    def request_close(self):
        """Ask the thread to stop and to close what it reads from as it ends; never blocks."""
        self._closing.set()
        self._stop.set()

    def close(self):
        """Stop the thread (a short join) and close the filler and the sources."""
        self.request_close()
        if self._thread is threading.current_thread():
            return                          # its own ending closes them
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self._release()

    def _release(self):
        if not self._released.acquire(blocking=False):      # closed once, by whoever comes first
            return
        self.filler.close()
        for source in self._also_close:
            source.close()


@atexit.register
def _close_all():
    for p in list(_live):
        p.close()
