"""Per-layer algorithm choice by measurement, kept per machine and shape on disk.

Which convolution algorithm is fastest depends on the shape and the machine more than any rule
says (the lesson of the HKBU study of deep-learning frameworks): a layer with several
algorithms for one shape (the channels-last Convolution: GEMM with or without im2col, Winograd
tiles, depthwise) times each on its first reshape for that shape, keeps the fastest, and the
choice is stored so the next run reads it instead of measuring.

    choice = autotune.choose(layer, key, {"gemm": run_gemm, "winograd F(4,3)": run_f43}, "gemm")

Each candidate is a function running the layer's forward (and backward, in training) with that
algorithm; `default` is the rule's choice, used when measuring is off. A trial of a backward
keeps the layer's parameter diffs (`keeping_diffs`) and gives a gradient to the bottoms the Net
wants one for (`trial_propagate_down`): a first layer's data wants none, which can change the
fastest algorithm. A key names a range of batch sizes (batch_class); at a range not yet
measured, the candidates that lost clearly at the nearest range measured are not run
(`kin`, KIN_WITHIN), so a new batch size measures the few that may win.

Switches (environment):
    CAFFEPY_AUTOTUNE=0      no measuring, no cache: the rules decide (tests, reproducible CI)
    CAFFEPY_CACHE_DIR=dir   where the cache lives (default $XDG_CACHE_HOME/caffepy, else
                            ~/.cache/caffepy): autotune.json

The cache holds one section per machine (CPU model, the kernels' ISA path, threads, the BLAS, kernel
version), an
entry per key: the choice and the milliseconds measured. It is read once per process; writes
re-read it under an exclusive lock (ranks of one node may measure at once), merge, and replace
the file atomically. A file that does not parse is set aside (warned once) and rebuilt. A
measurement taken while other processes held cores (the thread rule then gave the candidates
fewer threads than the section's count: `free_threads() < threads`) is kept for this process
only: stored under the full thread count it once chose im2col over Winograd for ResNet-50's
res4 and res5 3x3 layers at b1 for good (forcing Winograd: 33.5 -> 30.9 ms a forward). In a
multi-rank run every rank takes rank 0's choice (`context.agree`), so the replicas run the same
arithmetic.
"""
import json
import os
import tempfile
import time

from . import device, log

VERSION = 19                 # bump when a kernel change makes old measurements meaningless
_FILE = "autotune.json"
_cache = None                # {machine: {key: entry}} as read from disk, this process
_path_read = None


def enabled():
    value = os.environ.get("CAFFEPY_AUTOTUNE", "1").strip().lower()
    return value not in ("0", "off", "no", "false")


def cache_path():
    root = os.environ.get("CAFFEPY_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "caffepy")
    return os.path.join(root, _FILE)


def machine_key(threads):
    from . import isa as isa_path
    isa = isa_path.NAMES[isa_path.selected()[0]]      # the kernels' path: what was measured
    return f"{device.cpu_model()} | {isa} | {threads} threads | {device.blas_name()} | v{VERSION}"


def _read(path):
    """The cache at `path` ({} when missing); a damaged file is renamed aside and reads as {}."""
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError("not a mapping of machines to entries")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        aside = f"{path}.bad"
        try:
            os.replace(path, aside)
        except OSError:
            aside = None
        log.warning(f"{path}: unreadable autotune cache ({e}); measuring again"
                    + (f" (the file is kept as {aside})" if aside else ""))
        return {}


def _loaded():
    global _cache, _path_read
    path = cache_path()
    if _cache is None or _path_read != path:
        _cache, _path_read = _read(path), path
    return _cache


def lookup(machine, key):
    entry = _loaded().get(machine, {}).get(key)
    return entry if isinstance(entry, dict) else None


def store(machine, key, entry):
    """Merge one entry into the file under a lock, written atomically (temp file + rename)."""
    path = cache_path()
    _loaded().setdefault(machine, {})[key] = entry
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".lock", "a") as lock:
            try:
                import fcntl
                fcntl.flock(lock, fcntl.LOCK_EX)
            except (ImportError, OSError):
                pass             # no locking here: the rename still keeps the file whole
            current = _read(path)
            current.setdefault(machine, {})[key] = entry
            fd, tmp = tempfile.mkstemp(prefix=".autotune-", dir=os.path.dirname(path))
            with os.fdopen(fd, "w") as f:
                json.dump(current, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError as e:
        log.warning(f"{path}: cannot write the autotune cache ({e}); the choice holds for this run")


# After each counted round, a candidate slower than the leader by more than this factor is out:
# the first counted round's margin is the wider (one busy moment). The warm-up round before
# them counts for nothing: a candidate's first run pays one-time work (a GEMM packs its weights,
# scratch is touched for the first time), and when the warm-up's times counted and pruned at
# 2x, a packed GEMM lost to the direct kernel on its packing alone and the choice was stored:
# MobileNet b16's fc7 ran direct at 1.35 ms against the GEMM's 0.22, conv2_1/sep 6.1 against
# 3.8. Clear losers run twice (warm-up and one round).
PRUNE = (2.0, 1.25)


def measure(candidates, rounds=3, keep=None):
    """{name: fastest seconds} of each candidate function over `rounds` counted rounds after a
    warm-up round of each (not counted). The rounds interleave the candidates, so a moment when
    the machine is busy slows one round of each rather than every run of one; after each
    counted round the candidates more than PRUNE times slower than the leader drop out (their
    time so far stays in the answer), but `keep`, measured every round."""
    for run in candidates.values():
        run()
    best = dict.fromkeys(candidates, float("inf"))
    alive = list(candidates)
    for r in range(rounds):
        for name in alive:
            start = time.perf_counter()
            candidates[name]()
            best[name] = min(best[name], time.perf_counter() - start)
        lead = min(best[name] for name in alive)
        alive = [name for name in alive if name == keep or best[name] <= PRUNE[min(r, 1)] * lead]
        if len(alive) == 1:
            break
    return best


def free_threads():
    """The threads a kernel's parallel region may have now (the thread rule: the cores other
    processes leave free)."""
    from .kernels import common
    return common.team_limit()


# A candidate more than this many times slower than the fastest at the nearest batch range
# measured (choose's `kin`) is not measured at a new one: ranks move with the batch, but not
# that far (ResNet-50's first forward at a new range measured 1.1 s, mostly Winograd tiles
# that lose everywhere)
KIN_WITHIN = 1.5


def _kin_measured(machine, kin, candidates):
    """The ms of the first of `kin` whose entry measured every candidate, else None."""
    for key in kin:
        entry = lookup(machine, key)
        if entry is not None and set(candidates) <= set(entry.get("ms", {})):
            return entry["ms"]
    return None


def choose(layer, key, candidates, default, threads, margin=1.0, kin=()):
    """The name of the fastest candidate for `key` on this machine (see the module docstring);
    sets `layer.tuning` to how it was decided, for the log and `caffepy time`. A candidate's
    one-time work (an int8 layer's quantized weights, a GEMM's packed weights) falls in
    measure's uncounted warm-up. With a `margin` above 1 another candidate is chosen over
    `default` only when measured that many times faster, and `default` is measured every round
    (one slow run cannot drop it). `kin`: the keys of the same choice at other batch ranges,
    nearest first (kin_keys): where one was measured, the candidates it found KIN_WITHIN times
    slower than its fastest are left out (named in the entry's "skipped")."""
    if len(candidates) == 1 or not enabled():
        layer.tuning = "rule" if len(candidates) > 1 else "only"
        return default if default in candidates else next(iter(candidates))
    machine = machine_key(threads)
    entry = lookup(machine, key)
    # an entry measured before a candidate existed (a new algorithm) is measured again
    if entry is not None and entry.get("choice") in candidates \
            and set(candidates) <= set(entry.get("ms", {})) | set(entry.get("skipped", ())):
        choice, layer.tuning = entry["choice"], "cached"
    else:
        keep = default if margin != 1.0 else None
        trials, skipped, near = candidates, [], _kin_measured(machine, kin, candidates)
        if near is not None:
            lead = min(near[name] for name in candidates)
            skipped = sorted(name for name in candidates if name != keep
                             and near[name] > KIN_WITHIN * lead)
            trials = {name: run for name, run in candidates.items() if name not in skipped}
        ms = {name: round(t * 1e3, 3) for name, t in measure(trials, keep=keep).items()}
        choice = min(ms, key=lambda name: ms[name] * (1.0 if name == default else margin))
        layer.tuning = "measured " + ", ".join(f"{name} {t:g} ms" for name, t in ms.items())
        if skipped:
            layer.tuning += f" (not {', '.join(skipped)}: slow at another batch range)"
        entry = {"choice": choice, "ms": ms, **({"skipped": skipped} if skipped else {})}
        if free_threads() < threads:       # the machine busy: this process's choice alone
            _loaded().setdefault(machine, {})[key] = entry
            layer.tuning += " (other processes busy: not stored)"
        else:
            store(machine, key, entry)
    agreed = layer.context.agree(choice)
    if agreed != choice:
        choice, layer.tuning = agreed, "rank 0's choice"
    return choice


def batch_class(n):
    """The batch sizes that share a convolution's measurements, as its keys name them: 1 alone,
    then each power-of-two range ("2-3", "4-7", "16-31", ...). An algorithm's rank moves with
    the batch mostly between one image (nothing to share out across images) and several, and a
    first forward at a batch size of a range already measured then measures nothing (ResNet-50
    b16's first forward spent 2 s measuring)."""
    if n <= 1:
        return "1"
    low = 1 << (n.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def kin_keys(n, key_at):
    """The keys of one choice at the batch ranges other than n's, nearest first (choose's
    `kin`), `key_at(range)` making the key for a range (batch_class's names): the ranges of
    several images only, for several images (one image ranks the algorithms apart)."""
    if n <= 1:
        return []
    here = n.bit_length() - 1
    near = sorted((e for e in range(1, 16) if e != here), key=lambda e: (abs(e - here), -e))
    return [key_at(f"{1 << e}-{(2 << e) - 1}") for e in near[:6]]


def describe(names, tunings):
    """(algorithm, tuning): how the log and `caffepy time` name a layer's algorithms, from
    `names` ({pass: algorithm name}, in pass order) and `tunings` ({pass: how it was chosen},
    for the passes chosen): one name, or one word, when the passes agree, else pass by pass."""
    tuned = [p for p in names if p in tunings]
    algos, hows = {names[p] for p in tuned}, set(tunings.values())
    algorithm = algos.pop() if len(algos) == 1 else ", ".join(f"{p} {names[p]}" for p in tuned)
    tuning = hows.pop() if len(hows) == 1 else "; ".join(f"{p} {tunings[p]}" for p in tuned)
    return algorithm, tuning


def trial_propagate_down(layer, bottom):
    """The bottoms a trial's backward gives a gradient: those the Net expects to want one."""
    need = getattr(layer, "bottom_need_backward", None)
    return list(need) if need is not None and len(need) == len(bottom) else [True] * len(bottom)


def keeping_diffs(layer, run):
    """`run` for timing, the layer's parameter diffs put back as they were after it (Caffe's
    layers add to them)."""
    def trial():
        saved = [b.diff.copy() for b in layer.blobs]
        run()
        for b, kept in zip(layer.blobs, saved):
            b.diff[...] = kept
    return trial
