"""Timing helpers shared by the benchmarks."""
import time


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


class Timer:
    """Wall and CPU milliseconds of the runs it has seen, summed up by `summary` (min: the best
    run; median: on a busy machine, how often a parallel region waits for a descheduled
    thread)."""

    def __init__(self, summary=min):
        self.walls, self.cpus, self.summary = [], [], summary

    def run(self, fn):
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        self.walls.append(1e3 * (time.perf_counter() - wall))
        self.cpus.append(1e3 * (time.process_time() - cpu))

    @property
    def wall(self):
        return self.summary(self.walls)

    @property
    def cpu(self):
        return self.summary(self.cpus)


def best_ms(fn, reps, setup=None, summary=min):
    """Wall ms of fn() over `reps` runs after one warm-up, summed up by `summary`; setup() runs
    untimed before each."""
    return alternate([fn], reps, [setup], summary)[0]


def alternate(fns, reps, setups=None, summary=min):
    """Wall ms of each fn over `reps` runs, the fns run in turn (one warm-up round first) so
    that all see one machine; setups[i]() runs untimed before each run of fns[i]."""
    setups = setups or [None] * len(fns)
    timers = [Timer(summary) for _ in fns]
    for i in range(reps + 1):
        for fn, setup, timer in zip(fns, setups, timers):
            if setup is not None:
                setup()
            if i:
                timer.run(fn)
            else:
                fn()
    return [t.wall for t in timers]


def data_layer_rate(layer_text, phase, threads, batch, batches):
    """Images/s of one data layer (prototxt text) running its prefetch with `threads` decode
    threads, forward as fast as it goes, after one untimed batch (thread start-up)."""
    import os
    from google.protobuf import text_format
    from caffepy import rng
    from caffepy.net import Net
    from caffepy.proto import caffe_pb2
    os.environ["CAFFEPY_DATA_THREADS"] = str(threads)
    rng.seed(1)
    net = Net(text_format.Parse(layer_text, caffe_pb2.NetParameter()), phase=phase)
    try:
        net.forward()
        start = time.perf_counter()
        for _ in range(batches):
            net.forward()
        return batches * batch / (time.perf_counter() - start)
    finally:
        net.layers[0].close()
