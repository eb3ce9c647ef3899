"""`caffepy collect` and `caffepy compare`: where two runs of one net part ways (Intel Caffe's
collect / compare actions, tools/caffe.cpp and compareToolUtilities.h).

Both build the net in the TRAIN phase and run one forward and one backward pass, what runs as
one (a layer, or a fused unit: Net.units) at a time, after seeding caffepy's random stream with
SEED: fillers (when no --weights are given), DummyData and Dropout then draw alike in every run,
and data layers read from the first record. Before the forward pass every diff holds
--buffer_filler (NaN by default, as Intel's), parameter gradients start at zero, and the blobs
of Input layers, and the diffs of the net's outputs that no loss weighs, get values from a
generator of their own (so a deploy net has inputs and gradients to compare too).

collect writes one record per layer and blob, each a .npy file (numpy.load reads it) named
`<layer index>_<what><k>.npy`, listed in `index.txt` (tab-separated: file, layer index, layer
name, type, what, blob name, shape):
    param k         parameter blob k, before the forward pass
    bottom k        bottom k's data as the layer gets it (the first layer of a fused unit)
    top k           top k's data after its forward
    top_diff k      top k's diff as its backward gets it (the last layer of a fused unit)
    bottom_diff k   bottom k's diff after its backward (bottoms that need one)
    param_diff k    parameter k's gradient after its backward
A blob a fused unit works on in place is recorded as the unit leaves it: under the last layer
that writes it (forward) or the first (backward).

compare runs again, gives each unit the bottoms, and before its backward the top diffs, that
collect recorded (as Intel's compare feeds each layer collect's bottom: each layer is judged on
its own inputs, so a difference does not spread downstream), and compares every record both runs
have. Two values differ when they are more than --epsilon apart and more than one float step
apart (Intel's floatDiff), or one is NaN and the other not. It logs each record's largest
difference, writes `report.txt` and, per differing record, `<record>.txt` (`index;collected;
now;difference` per differing value, flat index in N, C, H, W order) into --compare_output_dir,
and ends with the first layer that differs (exit status 1) or none (0). Intel's compare
exits 0 either way; a status a script can test is the point of the tool here.
"""
import os

import numpy as np

from . import log, rng
from .errors import CaffepyError, UsageError
from .net import TRAIN

SEED = 1701
INDEX = "index.txt"
_GENERATED_SEED = 7


def _what(kind, k):
    return f"{kind}[{k}]"


def _file(li, kind, k):
    return f"{li:04d}_{kind}{k}.npy"


def _build(model, weights, level, stages, engine):
    from .actions import net_with_engine
    rng.seed(SEED)
    return net_with_engine(model, engine, phase=TRAIN, weights=weights or None, level=level,
                           stages=list(stages))


def _one_iteration(net, visit, feed, buffer_filler):
    """Run one forward and backward pass of `net`, unit by unit, calling `visit(li, kind, k, blob
    name, array)` for every record (see the module docstring) and `feed(li, kind, k)` (an array
    or None) for the values to give a unit first."""
    layers = net.layers
    names = net._layer_names
    blobs = {id(b): b for vec in net.bottom_vecs + net.top_vecs for b in vec}
    blobs.update((id(b), b) for li in range(len(layers)) for b in net.layer_bottoms(li))
    for blob in blobs.values():
        blob.diff[...] = buffer_filler
    for layer in layers:
        for blob in layer.blobs:
            blob.diff[...] = 0
    generator = np.random.default_rng(_GENERATED_SEED)
    for name in net.inputs:
        data = net.blobs[name].data
        data[...] = generator.standard_normal(data.shape, np.float32)

    def fed(li, kind, k, array, blob_name):
        value = feed(li, kind, k)
        if value is not None:
            if value.shape != array.shape:
                raise CaffepyError(f"layer '{names[li]}' ({layers[li].type}): {_what(kind, k)} '{blob_name}': "
                                   f"collected with shape {value.shape}, is {array.shape} now; was the "
                                   f"collect run of another net or batch size?")
            array[...] = value

    units = net.units()
    for first, last in units:
        for li in range(first, last + 1):
            for k, blob in enumerate(layers[li].blobs):
                visit(li, "param", k, names[li], blob.data)
        bottoms = net.layer_bottoms(first)
        for k, blob in enumerate(bottoms):
            name = net.bottom_names[names[first]][k]
            fed(first, "bottom", k, blob.data, name)
            visit(first, "bottom", k, name, blob.data)
        net.forward_from_to(first, last)
        for li in range(first, last + 1):
            later = {id(b) for lj in range(li + 1, last + 1) for b in net.top_vecs[lj]}
            for k, blob in enumerate(net.top_vecs[li]):
                if id(blob) not in later:
                    visit(li, "top", k, net.top_names[names[li]][k], blob.data)

    for name in net.outputs:
        weight = net.blob_loss_weights.get(name, 0.0)
        diff = net.blobs[name].diff
        diff[...] = weight if weight else generator.standard_normal(diff.shape, np.float32)
    for first, last in reversed(units):
        for k, blob in enumerate(net.top_vecs[last]):
            name = net.top_names[names[last]][k]
            fed(last, "top_diff", k, blob.diff, name)
            visit(last, "top_diff", k, name, blob.diff)
        net.backward_from_to(last, first, every_layer=True)
        for li in range(first, last + 1):
            earlier = {id(b) for lj in range(first, li) for b in net.layer_bottoms(lj)}
            for k, blob in enumerate(net.layer_bottoms(li)):
                if net.bottom_need_backward[li][k] and id(blob) not in earlier:
                    visit(li, "bottom_diff", k, net.bottom_names[names[li]][k], blob.diff)
            for k, blob in enumerate(layers[li].blobs):
                visit(li, "param_diff", k, names[li], blob.diff)


def collect(model, collect_dir, weights=None, level=0, stages=(), engine="", buffer_filler=float("nan")):
    """Write the records of one iteration of `model` into `collect_dir`; returns how many."""
    net = _build(model, weights, level, stages, engine)
    os.makedirs(collect_dir, exist_ok=True)
    log.info(f"Collecting every layer's blobs of one iteration into {collect_dir}")
    lines = []

    def save(li, kind, k, blob_name, array):
        name = _file(li, kind, k)
        np.save(os.path.join(collect_dir, name), np.array(array, np.float32))
        shape = "x".join(str(d) for d in array.shape) or "scalar"
        lines.append(f"{name}\t{li}\t{net._layer_names[li]}\t{net.layers[li].type}\t{_what(kind, k)}\t"
                     f"{blob_name}\t{shape}\n")

    _one_iteration(net, save, lambda li, kind, k: None, buffer_filler)
    with open(os.path.join(collect_dir, INDEX), "w") as f:
        f.write(f"# caffepy collect of {model} (engine '{engine or net.param.engine or 'DEFAULT'}', "
                f"phase TRAIN, seed {SEED}): file, layer index, layer, type, what, blob, shape\n")
        f.writelines(lines)
    log.info(f"Collected {len(lines)} blobs of {len(net.layers)} layers; listed in "
             f"{os.path.join(collect_dir, INDEX)}")
    return len(lines)


def read_index(collect_dir):
    """{(layer index, kind, k): (file, layer name)} of a collect directory."""
    path = os.path.join(collect_dir, INDEX)
    if not os.path.isfile(path):
        raise UsageError(f"compare: --collect_dir: no {INDEX} in '{collect_dir}'; run caffepy collect "
                         f"with this --collect_dir first")
    records = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.startswith("#") or not line.strip():
                continue
            fields = line.rstrip("\n").split("\t")
            try:
                name, li, layer, what = fields[0], int(fields[1]), fields[2], fields[4]
                kind, k = what[:-1].split("[")
                records[(li, kind, int(k))] = (name, layer)
            except (IndexError, ValueError):
                raise CaffepyError(f"{path}:{number}: not a line of caffepy collect's index, got "
                                   f"'{line.strip()[:80]}'") from None
    return records


def differences(reference, now, epsilon):
    """Boolean array: where `now` differs from `reference` (see the module docstring)."""
    a, b = reference.astype(np.float32).ravel(), now.astype(np.float32).ravel()
    with np.errstate(invalid="ignore", over="ignore"):
        apart = np.abs(a - b)
        close = (apart <= epsilon) | (np.nextafter(a, b) == b) | (a == b)
    both_nan = np.isnan(a) & np.isnan(b)
    return ~(close | both_nan)


def compare(model, collect_dir, output_dir, weights=None, level=0, stages=(), engine="",
            buffer_filler=float("nan"), epsilon=1e-3, fast_compare_max=None):
    """Run `model` again against `collect_dir` (see the module docstring); returns the list of
    (layer, what, largest difference, values beyond epsilon) of the records that differ."""
    records = read_index(collect_dir)
    net = _build(model, weights, level, stages, engine)
    for (li, _, _), (_, layer) in records.items():
        if li >= len(net.layers) or net._layer_names[li] != layer:
            here = f"'{net._layer_names[li]}'" if li < len(net.layers) else "no layer"
            raise CaffepyError(f"compare: {collect_dir} holds another net: its layer {li} is '{layer}', "
                               f"{model} has {here} there")
    os.makedirs(output_dir, exist_ok=True)
    log.info(f"Comparing every layer's blobs of one iteration with {collect_dir} (epsilon {epsilon:g})")
    report, found, unmatched, seen = [], [], [], set()

    def load(li, kind, k):
        record = records.get((li, kind, k))
        return None if record is None else np.load(os.path.join(collect_dir, record[0]))

    def check(li, kind, k, blob_name, array):
        seen.add((li, kind, k))
        if kind in ("bottom", "top_diff"):
            return              # given from the collected values, if collect has them
        what = f"{_what(kind, k)} '{blob_name}'"
        where = f"{net._layer_names[li]} ({net.layers[li].type})"
        reference = load(li, kind, k)
        if reference is None:
            unmatched.append(what)
            return
        if reference.shape != array.shape:
            line = f"{where:<32} {what:<28}: shape {reference.shape} collected, {array.shape} now"
            found.append((li, what, float("inf"), array.size))
        else:
            beyond = differences(reference, array, epsilon)
            count = int(beyond.sum())
            with np.errstate(invalid="ignore"):
                gaps = np.abs(reference.astype(np.float64) - array.astype(np.float64)).ravel()
            largest = float(np.nanmax(gaps)) if gaps.size and not np.isnan(gaps).all() else 0.0
            if beyond.any() and np.isnan(gaps[beyond]).any():
                largest = float("nan")
            if count:
                line = f"{where:<32} {what:<28}: max diff {largest:.6g}, {count} of {array.size} beyond epsilon"
                found.append((li, what, largest, count))
                _write_values(output_dir, _file(li, kind, k)[:-4] + ".txt", reference, array, beyond,
                              fast_compare_max)
            else:
                line = f"{where:<32} {what:<28}: success (max diff {largest:.3g})"
        log.info(line)
        report.append(line + "\n")

    _one_iteration(net, check, load, buffer_filler)
    with open(os.path.join(output_dir, "report.txt"), "w") as f:
        f.writelines(report)
    missing = [key for key in records if key not in seen and key[1] not in ("bottom", "top_diff")]
    if unmatched or missing:
        log.info(f"{len(unmatched)} blob(s) of this run are not in {collect_dir}, and {len(missing)} of "
                 f"its are not seen here (a blob inside a fused unit of one run); the others were compared")
    if not found:
        log.info(f"No layer differs beyond epsilon {epsilon:g} ({len(report)} blobs compared)")
        return []
    li, what, largest, count = found[0]
    layers = len({entry[0] for entry in found})
    raise CompareError(f"compare: layer '{net._layer_names[li]}' ({net.layers[li].type}) is the first "
                       f"that differs beyond epsilon {epsilon:g}: {what}, max difference {largest:.6g} "
                       f"in {count} value(s); {layers} layer(s) differ in all (report in "
                       f"{os.path.join(output_dir, 'report.txt')})", found)


class CompareError(CaffepyError):
    """compare found a difference (exit status 1); `found` lists them."""

    def __init__(self, message, found):
        super().__init__(message)
        self.found = found


def _write_values(output_dir, name, reference, now, beyond, limit):
    index = np.flatnonzero(beyond)
    if limit is not None:
        index = index[:limit]
    a, b = reference.ravel(), now.ravel()
    with open(os.path.join(output_dir, name), "w") as f:
        f.write("index;collected;now;difference\n")
        f.writelines(f"{i};{a[i]:.9g};{b[i]:.9g};{abs(float(a[i]) - float(b[i])):.9g}\n" for i in index)
