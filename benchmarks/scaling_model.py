"""The scaling model of data-parallel training with caffepy's reducer: one iteration, simulated.

Inputs, every one measured (bench_multihost.py) or printed as an assumption:
    forward[l], backward[l]  seconds of each layer, ranks computing side by side, no communication
    rest                     the rest of an iteration (update, data, overheads): t_none - sums
    buckets                  [(bytes, layer)]: a bucket's gradients are final after the backward
                             of `layer`, and the next forward needs them before `layer`
    ranks N, latency a, bandwidth B   the link from a rank to the next (B: bytes/s one way)
    cpu_per_byte c           CPU seconds the communication thread spends per byte it sends
                             (copies into and out of the network stack, the sums, its polls)
    stolen                   the share of that CPU time taken from compute (1: every core
                             computes, as on the test bed; 1/cores when the thread gets a core's
                             slice of a many-core node)

A bucket of S bytes crosses the ring in 2(N-1) steps, each sending S/N bytes after one
latency: 2(N-1) (a + S/(N B)) seconds of the link. The link serves one bucket at a time,
the most urgent one first (the lowest layer, preemptively). While it sends, it uses
c B CPU seconds per second, and compute runs that much slower (times `stolen`).

Modes:
    none      compute only
    blocking  after backward the buckets cross one after the other; compute waits
    thread    a bucket leaves when backward passed its layer; the next forward waits
              at a layer for its buckets only (caffepy's default)
The iteration time is the period of the simulated loop once it repeats (the fourth
iteration of a run that starts idle). Nothing in here is fitted to iteration times.
"""


def ring_seconds(nbytes, ranks, latency, bandwidth):
    """Seconds of the link one ring allreduce of `nbytes` takes."""
    if ranks == 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * (latency + nbytes / ranks / bandwidth)


def ring_bytes_sent(nbytes, ranks):
    return 2 * (ranks - 1) / ranks * nbytes


def iteration_time(forward, backward, rest, buckets, ranks, latency, bandwidth, cpu_per_byte,
                   stolen=1.0, mode="thread", iterations=4):
    """Seconds per iteration in steady state (see the module's docstring)."""
    if mode == "none" or ranks == 1:
        return sum(forward) + sum(backward) + rest
    link_time = [ring_seconds(nbytes, ranks, latency, bandwidth) for nbytes, _ in buckets]
    # CPU seconds the transfer takes per second of link time
    busy_cpu = [cpu_per_byte * ring_bytes_sent(nbytes, ranks) / t if t > 0 else 0.0
                for (nbytes, _), t in zip(buckets, link_time)]
    if mode == "blocking":
        # compute is idle while the link works: nothing is taken from it
        return sum(forward) + sum(backward) + rest + sum(link_time)
    assert mode == "thread", mode
    layers = len(forward)
    by_layer = {}
    for k, (_, layer) in enumerate(buckets):
        by_layer.setdefault(layer, []).append(k)

    t = 0.0
    remaining = [0.0] * len(buckets)     # link seconds left; 0 = reduced
    queued = []                          # buckets issued, not finished
    starts = []

    def run_link(until):
        """Advance the link from t to `until` (compute blocked or not does not matter here);
        returns the CPU seconds it used."""
        nonlocal t
        used = 0.0
        while queued and t < until:
            k = min(queued, key=lambda j: (buckets[j][1], j))
            step = min(remaining[k], until - t)
            remaining[k] -= step
            used += step * busy_cpu[k]
            t += step
            if remaining[k] <= 1e-12:
                remaining[k] = 0.0
                queued.remove(k)
        t = max(t, until)
        return used

    def compute(work):
        """Run `work` seconds of compute, slowed by the link's CPU use while it sends."""
        nonlocal t
        while work > 1e-12:
            if not queued:
                t += work
                return
            k = min(queued, key=lambda j: (buckets[j][1], j))
            rate = max(0.05, 1.0 - stolen * busy_cpu[k])
            step = min(remaining[k], work / rate)
            run_link(t + step)
            work -= step * rate

    def wait_for(ks):
        while any(remaining[k] > 0 for k in ks):
            k = min(queued, key=lambda j: (buckets[j][1], j))
            run_link(t + remaining[k])

    for _ in range(iterations):
        starts.append(t)
        for layer in range(layers):
            wait_for(by_layer.get(layer, []))
            compute(forward[layer])
        for layer in range(layers - 1, -1, -1):
            compute(backward[layer])
            for k in by_layer.get(layer, []):
                remaining[k] = link_time[k]
                queued.append(k)
        compute(rest)
    starts.append(t)
    return starts[-1] - starts[-2]


def efficiency(t_compute, t_iter):
    value = t_compute / t_iter
    if not 0 < value <= 1.0 + 1e-9:
        raise ValueError(f"efficiency {value:.3f} is not a fraction: the inputs contradict each other")
    return value
