"""The scaling model of synchronous data-parallel training: one iteration, simulated.

What an iteration of N ranks costs beyond one rank's compute:
    stragglers   synchronous SGD waits for the slowest rank. Each rank's compute time per
                 iteration is a draw from one distribution (mean mu, spread sigma, normal or
                 log-normal, fitted to measured per-rank times); the job computes for the
                 expected maximum of N draws: mu + sigma E[max of N standard normals] for a
                 normal (E grows as sqrt(2 ln N)), the same integral over exp() for a
                 log-normal, whose longer tail costs more at large N. Every layer of the
                 slowest rank is stretched by that factor (its slowness is its whole
                 iteration's, not one layer's).
    messages     each bucket (caffepy) or layer (Intel Caffe) of gradients is one allreduce
                 of S bytes, with a latency a per step, a bandwidth B per link and a CPU cost
                 per byte c (alpha-beta-gamma):
                     ring                 2(N-1) a + 2(N-1)/N S max(1/B, c_sent)
                     halving-doubling     2 log2(N) a + the same bytes (Rabenseifner: reduce-
                                          scatter by recursive halving, allgather by doubling)
                     tree                 2 log2(N) (a + S/B) + log2(N) S c_add (binomial reduce,
                                          then broadcast: for small S)
                     hierarchical         L ranks per host: the host's L slices reduced through
                                          shared memory ((L-1)/L S adds and as many copies per
                                          rank), then one of the above between the H = N/L hosts
                                          for each slice, L at once sharing the host's link
                 A pipelined ring runs at the slower of its link and its CPU (c_sent: CPU
                 seconds per byte sent: the sums, the copies, the network stack).
    overlap      a bucket leaves when backward has passed its lowest layer; the link serves one
                 bucket at a time, the most urgent (lowest layer) first; the next forward waits
                 at a layer for that layer's buckets only (caffepy's `thread` progress and
                 Intel Caffe's FW_OVERLAP_OPT alike). While both run they slow each other:
                 by measured factors (`contention`: each one's time beside the other over its
                 time alone) or, unmeasured, by CPU accounting: the link takes c_sent B CPU
                 seconds per second from compute, times `stolen` (1 when every core computes;
                 1/cores when the communication gets one core's slice of a many-core node).
                 Pieces within a ring step are pipelined (caffepy keeps 2 in flight): their
                 latencies are not counted, only the step's.
    modes        none (compute only), blocking (every bucket after backward, compute idle),
                 thread (the overlap above).
The iteration time is the period of the simulated loop once it repeats (the fourth
iteration of a run that starts idle). Nothing in here is fitted to iteration times: the
inputs come from measurements (benchmarks/bench_scaling_model.py) or stated published
figures (YOU_ET_AL, with the processors' own speed spread and the nets' layer tables for
the published point and the projection).
"""
import math

import numpy as np


# -- stragglers: the slowest of N ranks ------------------------------------------------------
def _max_density_grid(n, points=40001):
    """z and the density of the maximum of n standard normals at z (n phi(z) Phi(z)^(n-1))."""
    z = np.linspace(-12.0, 12.0, points)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    with np.errstate(divide="ignore"):
        log_cdf = np.log(cdf)
    density = n * pdf * np.exp((n - 1) * np.where(cdf > 0, log_cdf, -np.inf))
    return z, density


def expected_max_standard_normal(n):
    """E[max of n independent standard normals] (0 for n = 1; about sqrt(2 ln n) for large n)."""
    if n == 1:
        return 0.0
    z, density = _max_density_grid(n)
    return float(np.trapezoid(z * density, z) if hasattr(np, "trapezoid") else np.trapz(z * density, z))


def expected_max(n, mean, sigma, shape="normal"):
    """E[max of n independent draws] of a normal or log-normal of this mean and standard
    deviation (the log-normal's parameters follow from them: s^2 = ln(1 + (sigma/mean)^2))."""
    if n == 1 or sigma == 0:
        return mean
    if shape == "normal":
        return mean + sigma * expected_max_standard_normal(n)
    assert shape == "lognormal", shape
    s = math.sqrt(math.log1p((sigma / mean) ** 2))
    m = math.log(mean) - s * s / 2
    z, density = _max_density_grid(n)
    f = np.exp(m + s * z) * density
    return float(np.trapezoid(f, z) if hasattr(np, "trapezoid") else np.trapz(f, z))


def _ks_normal(x):
    """Kolmogorov-Smirnov distance of the sample x from the standard normal."""
    x = np.sort(np.asarray(x, float))
    k = len(x)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return float(max(np.max(np.arange(1, k + 1) / k - cdf), np.max(cdf - np.arange(k) / k)))


def fit_stragglers(rows):
    """The spread of rank times within an iteration, from rows[iteration][rank] of seconds.

    Iterations differ as a whole (the machine's load moves every rank at once): that costs
    no waiting, so the spread is measured around each iteration's own mean, pooled over
    iterations (with the N/(N-1) of a sample variance). Both shapes are fitted: normal on
    the times, log-normal on their logarithms; `shape` is the one whose standardised
    residuals are nearer a standard normal (Kolmogorov-Smirnov distance). Also returns the
    measured mean excess of the slowest rank over the iteration's mean, the figure
    expected_max must predict."""
    t = np.asarray(rows, float)
    iters, n = t.shape
    if n < 2:
        raise ValueError("stragglers need at least 2 ranks")
    out = {"ranks": n, "iterations": iters, "mean": float(t.mean())}
    for shape, x in (("normal", t), ("lognormal", np.log(t))):
        resid = x - x.mean(axis=1, keepdims=True)
        sd = math.sqrt(float((resid ** 2).sum()) / (iters * (n - 1)))
        # residuals about a mean of n have variance sd^2 (n-1)/n
        z = resid.ravel() / (sd * math.sqrt((n - 1) / n)) if sd > 0 else resid.ravel()
        out[shape] = {"sd": sd, "ks": _ks_normal(z) if n > 2 else None}
    out["cv"] = out["normal"]["sd"] / out["mean"]
    out["cv_log"] = out["lognormal"]["sd"]          # sd of ln t: the log-normal's s
    ks_n, ks_l = out["normal"]["ks"], out["lognormal"]["ks"]
    out["shape"] = "lognormal" if ks_n is not None and ks_l < ks_n else "normal"
    out["excess"] = float((t.max(axis=1) - t.mean(axis=1)).mean())
    return out


def straggler_factor(n, cv, shape="normal"):
    """Expected slowest of n ranks over one rank's mean, for a spread cv = sigma / mean."""
    return expected_max(n, 1.0, cv, shape)


# -- collectives: alpha-beta-gamma ---------------------------------------------------------
def ring_seconds(nbytes, ranks, latency, bandwidth, cpu_per_byte=0.0):
    """Seconds one ring allreduce of `nbytes` takes: 2(N-1) steps of one latency and a
    segment, the segments at the slower of the link and the CPU's rate."""
    if ranks == 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * latency + ring_bytes_sent(nbytes, ranks) * max(1.0 / bandwidth, cpu_per_byte)


def ring_bytes_sent(nbytes, ranks):
    return 2 * (ranks - 1) / ranks * nbytes


ALGORITHMS = ("ring", "halving-doubling", "tree")


def allreduce_cost(nbytes, ranks, latency, bandwidth, cpu_per_byte, algorithm="ring", per_host=1,
                   memory=(0.0, 0.0)):
    """(seconds, CPU seconds) of one allreduce of `nbytes` over `ranks` ranks, `per_host` of
    them on each host (> 1: hierarchical), by the module docstring's formulas.

    cpu_per_byte: CPU seconds per byte a rank sends between hosts; memory: (seconds per
    byte added, per byte copied) in memory, for the shared-memory stage."""
    if ranks == 1:
        return 0.0, 0.0
    if per_host > 1:
        hosts = ranks // per_host
        share = (per_host - 1) / per_host * nbytes
        intra = share * (memory[0] + memory[1])
        # the host's per_host slices cross at once, sharing its link
        seconds, cpu = allreduce_cost(nbytes / per_host, hosts, latency, bandwidth / per_host, cpu_per_byte,
                                      algorithm)
        return intra + seconds, intra + cpu
    sent = ring_bytes_sent(nbytes, ranks)
    logn = math.ceil(math.log2(ranks))
    if algorithm == "ring":
        return ring_seconds(nbytes, ranks, latency, bandwidth, cpu_per_byte), sent * cpu_per_byte
    if algorithm == "halving-doubling":
        return 2 * logn * latency + sent * max(1.0 / bandwidth, cpu_per_byte), sent * cpu_per_byte
    if algorithm == "tree":
        moved = 2 * logn * nbytes
        return 2 * logn * (latency + nbytes / bandwidth) + logn * nbytes * memory[0], moved * cpu_per_byte
    raise ValueError(f"unknown algorithm {algorithm!r}")


# -- one iteration -------------------------------------------------------------------------
def iteration_time(forward, backward, rest, buckets, ranks, latency, bandwidth, cpu_per_byte,
                   stolen=1.0, mode="thread", iterations=4, algorithm="ring", per_host=1,
                   memory=(0.0, 0.0), contention=None):
    """Seconds per iteration in steady state (see the module's docstring), no stragglers
    (stretch the compute with straggler_factor first).

    contention: (compute, link), measured slowdowns of compute while the link works and of
    the link while compute runs (each's time together over its time alone), in place of the
    CPU accounting of `cpu_per_byte` x `stolen` (which only slows compute)."""
    if mode == "none" or ranks == 1:
        return sum(forward) + sum(backward) + rest
    costs = [allreduce_cost(nbytes, ranks, latency, bandwidth, cpu_per_byte, algorithm, per_host, memory)
             for nbytes, _ in buckets]
    link_time = [s for s, _ in costs]
    # CPU seconds the transfer takes per second of it
    busy_cpu = [c / s if s > 0 else 0.0 for s, c in costs]
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

    def urgent():
        return min(queued, key=lambda j: (buckets[j][1], j))

    def advance(k, seconds, speed):
        """The link works on bucket k for `seconds` at `speed` (link seconds per second)."""
        nonlocal t
        remaining[k] -= seconds * speed
        t += seconds
        if remaining[k] <= 1e-12:
            remaining[k] = 0.0
            queued.remove(k)

    def compute(work):
        """Run `work` seconds of compute beside the link, each slowing the other."""
        nonlocal t
        while work > 1e-12:
            if not queued:
                t += work
                return
            k = urgent()
            if contention is None:
                rate, speed = max(0.05, 1.0 - stolen * busy_cpu[k]), 1.0
            else:
                rate, speed = 1.0 / contention[0], 1.0 / contention[1]
            step = min(remaining[k] / speed, work / rate)
            advance(k, step, speed)
            work -= step * rate

    def wait_for(ks):
        """Compute waits: the link runs alone, at full speed."""
        while any(remaining[k] > 0 for k in ks):
            k = urgent()
            advance(k, remaining[k], 1.0)

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


def stretched(forward, backward, rest, factor):
    """The slowest rank's layer times: every one stretched by `factor`."""
    return [x * factor for x in forward], [x * factor for x in backward], rest * factor


def predict(forward, backward, rest, buckets, ranks, cv, shape="normal", mode="thread", **link):
    """The job's iteration: the slowest of `ranks` (spread cv, `shape`) through the link."""
    f, b, r = stretched(forward, backward, rest, straggler_factor(ranks, cv, shape))
    return iteration_time(f, b, r, buckets, ranks, mode=mode, **link)


def efficiency(t_compute, t_iter):
    value = t_compute / t_iter
    if not 0 < value <= 1.0 + 1e-9:
        raise ValueError(f"efficiency {value:.3f} is not a fraction: the inputs contradict each other")
    return value


# -- the nets of the published point and the projection --------------------------------------
def resnet50_layers():
    """ResNet-50 (MSRA's, stride in branch2a) at 224 x 224, layer by layer in forward order:
    [(name, learned floats, forward FLOPs per image, messages)]: one message per learned
    blob as Intel Caffe reduces them (a convolution's weights; a Scale's scale and bias; the
    fc's weights and bias); BatchNorm's statistics are not reduced."""
    layers = []

    def conv(name, cin, cout, k, size):
        layers.append((name, cin * cout * k * k, 2 * cin * cout * k * k * size * size, 1))
        layers.append((name + "_scale", 2 * cout, 0, 2))

    conv("conv1", 3, 64, 7, 112)
    cin, size = 64, 56
    for stage, (blocks, width) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            out = size // stride
            name = f"res{stage + 2}{'abcdef'[b]}"
            if b == 0:
                conv(name + "_branch1", cin, 4 * width, 1, out)
            conv(name + "_branch2a", cin, width, 1, out)
            conv(name + "_branch2b", width, width, 3, out)
            conv(name + "_branch2c", width, 4 * width, 1, out)
            cin, size = 4 * width, out
    layers.append(("fc1000", 2048 * 1000 + 1000, 2 * 2048 * 1000, 2))
    return layers


def alexnet_layers():
    """AlexNet (BVLC's, grouped conv2/4/5) at 227 x 227, as resnet50_layers."""
    spec = (("conv1", 3, 96, 11, 55, 1), ("conv2", 96, 256, 5, 27, 2), ("conv3", 256, 384, 3, 13, 1),
            ("conv4", 384, 384, 3, 13, 2), ("conv5", 384, 256, 3, 13, 2))
    layers = [(n, cin * cout * k * k // g + cout, 2 * cin * cout * k * k * s * s // g, 2)
              for n, cin, cout, k, s, g in spec]
    for name, fin, fout in (("fc6", 9216, 4096), ("fc7", 4096, 4096), ("fc8", 4096, 1000)):
        layers.append((name, fin * fout + fout, 2 * fin * fout, 2))
    return layers


def net_inputs(layers, t_compute, per_message=True, bucket_bytes=4 << 20):
    """The model's layer times and buckets for a net of `layers` whose iteration computes for
    t_compute seconds: each layer's share is its FLOPs' (backward twice its forward: the
    gradients of its input and of its weights; the first layer only the weights'), and its
    gradients become one bucket per message (Intel Caffe) or caffepy's buckets of
    `bucket_bytes` in backward order."""
    fwd = [f for _, _, f, _ in layers]
    bwd = [f if i == 0 else 2 * f for i, f in enumerate(fwd)]
    scale = t_compute / (sum(fwd) + sum(bwd))
    buckets = []
    if per_message:
        for i, (_, floats, _, messages) in enumerate(layers):
            buckets += [(4 * floats / messages, i)] * messages
    else:
        current, lowest = 0, None
        for i in range(len(layers) - 1, -1, -1):
            size = 4 * layers[i][1]
            if size >= bucket_bytes:
                buckets.append((size, i))
                continue
            current, lowest = current + size, i
            if current >= bucket_bytes:
                buckets.append((current, lowest))
                current = 0
        if current:
            buckets.append((current, lowest))
    return [x * scale for x in fwd], [x * scale for x in bwd], buckets


# -- the published point: You et al., ResNet-50 on 1024 Skylake CPUs ---------------------------
# Every input with its source. "derived" figures follow from published ones by the arithmetic
# shown; "assumed" ones could not be checked here and their sensitivity is printed.
YOU_ET_AL = {
    "ranks": (1024, "You et al. (arXiv 1709.05011; ICPP 2018): 1024 CPUs, Intel Xeon Platinum 8160 (the "
                    "ICPP abstract's processor); the 73% and ~750x are the issue's reading of the paper, "
                    "not checked here"),
    "per_host": (2, "one rank per socket: TACC Stampede2's SKX nodes are 2-socket 8160 nodes "
                    "(assumed from the system's description; Intel's multinode recipes run one "
                    "rank per socket)"),
    "batch": (32, "derived: global batch 32K (the paper's LARS batch) / 1024 CPUs"),
    "images_per_s": (53.4, "derived: 90 epochs x 1,281,167 images in 48 min on 1024 CPUs (an arXiv "
                           "version's title: 'ImageNet Training by CPU: AlexNet in 11 Minutes and "
                           "ResNet-50 in 48 Minutes') is 40,036 images/s; at ~750x one CPU, one CPU "
                           "trains 53.4 images/s"),
    "bandwidth": (12.5e9, "Intel Omni-Path 100 Gb/s: 12.5 GB/s each way (product sheet)"),
    "latency": (1.5e-6, "assumed: about 1 us MPI latency on Omni-Path plus a fat tree's 5 switch "
                        "hops (the 48-port OPA ASIC's 5-hop configurations, Intel's switch sheet) "
                        "at ~0.1 us each"),
    "algorithm": ("halving-doubling", "assumed: Intel MLSL runs on Intel MPI, whose allreduce for "
                                      "large messages on many nodes is Rabenseifner's (reduce-scatter "
                                      "by recursive halving, allgather by doubling); ring shown beside"),
    "messages": (161, "Intel Caffe (multi_sync.hpp) starts one MLSL allreduce per learned blob "
                      "when its layer's backward ends and waits for it before the layer's next "
                      "forward (FW_OVERLAP_OPT): 53 convolutions, 53 Scales x 2, fc x 2"),
    "floats": (25557032, "ResNet-50's learned parameters (resnet50_layers(); models/zoo/README.md)"),
    "processor_range": (0.20, "Marathe et al., 'An empirical survey of performance and energy efficiency "
                              "variation on Intel processors' (E2SC'17, LLNL): performance varies by 20% "
                              "across the processors of a production cluster (Broadwell; taken as fastest "
                              "to slowest). A rank's speed is its processor's: a spread that persists, beside "
                              "the per-iteration one measured here"),
    "processor_population": (2386, "assumed: the number of processors behind that range, taken as the "
                                   "2,386 of the same group's Sandy Bridge survey (not checked for the "
                                   "Broadwell one): sigma = range / (2 E[max of that many normals])"),
    "cores": (24, "Xeon Platinum 8160: 24 cores a socket (Intel's product sheet)"),
    "mlsl_servers": (2, "Intel Caffe's scripts/set_env.sh: MLSL_NUM_SERVERS=2 a rank on Xeon, pinned to cores "
                        "of their own, and OMP_NUM_THREADS = cores per rank - servers: a multinode rank "
                        "computes on 22 of the 24 cores the one-CPU baseline uses (compute assumed to "
                        "scale with cores); the servers' communication takes nothing from compute"),
}


# The straggler spread and memory costs the reproduction takes when they are not measured in
# the same run (--reproduce, the unit test): `python benchmarks/bench_scaling_model.py` on
# 2026-11-29 08:59-09:08 UTC (2 cores shared with other jobs, load average 11-18). The shape:
# Kolmogorov-Smirnov 0.0663 log-normal against 0.0665 normal, a tie in all but name.
MEASURED_HERE = {"when": "2026-11-29 08:59 UTC", "cv": 0.0119, "shape": "lognormal",
                 "memory": (0.425e-9, 0.423e-9), "where": "local mpiexec, 2 ranks"}


def processor_spread(spread_range=YOU_ET_AL["processor_range"][0],
                     population=YOU_ET_AL["processor_population"][0]):
    """sigma / mean of processor speeds whose range over `population` processors is
    `spread_range`; it adds to the per-iteration spread in quadrature (independent)."""
    return spread_range / (2 * expected_max_standard_normal(population))


def published_point(cv, shape, memory, overrides=None):
    """Efficiency of You et al.'s ResNet-50 at 1024 CPUs by the model: a dict of the figures.

    cv, shape: the straggler spread (measured, bench_scaling_model.py); memory: (s/byte
    added, s/byte copied) measured on this machine; overrides: {input: value} for the
    sensitivity rows."""
    p = {k: v for k, (v, _) in YOU_ET_AL.items()}
    p.update(overrides or {})
    t_compute = p["batch"] / p["images_per_s"]
    t_rank = t_compute * p["cores"] / (p["cores"] - p["mlsl_servers"])
    fwd, bwd, buckets = net_inputs(resnet50_layers(), t_rank)
    add, copy = memory
    # per byte sent between hosts: the receiver adds half of what arrives (reduce-scatter)
    # and copies every byte once out of the fabric's buffers
    cpu_per_byte = 0.5 * add + copy
    link = dict(latency=p["latency"], bandwidth=p["bandwidth"], cpu_per_byte=cpu_per_byte,
                stolen=0.0 if p["mlsl_servers"] else 1.0 / p["cores"], algorithm=p["algorithm"],
                per_host=p["per_host"], memory=memory)
    n = p["ranks"]
    processor_cv = processor_spread(p["processor_range"], p["processor_population"])
    cv = math.hypot(cv, processor_cv)
    factor = straggler_factor(n, cv, shape)
    t_comm = sum(allreduce_cost(s, n, p["latency"], p["bandwidth"], cpu_per_byte, p["algorithm"],
                                p["per_host"], memory)[0] for s, _ in buckets)
    t_iter = predict(fwd, bwd, 0.0, buckets, n, cv, shape, **link)
    no_stragglers = iteration_time(fwd, bwd, 0.0, buckets, n, **link)
    return {"t_compute": t_compute, "t_rank": t_rank, "processor_cv": processor_cv, "cv": cv,
            "straggler_factor": factor, "t_comm": t_comm, "t_iter": t_iter,
            "efficiency": efficiency(t_compute, t_iter),
            "efficiency_without_stragglers": efficiency(t_compute, no_stragglers),
            "published": 0.73}
