"""Timing helper shared by the layer benchmarks."""
import time


def best_ms(fn, reps):
    """Best wall-clock milliseconds of fn() over `reps` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3
