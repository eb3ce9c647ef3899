"""Caffe's snapshot files: Solver::Snapshot / Restore and SGDSolver's solver state, in
either of Caffe's snapshot formats.

A snapshot is two files, written atomically by rank 0.  BINARYPROTO (the default):

    <snapshot_prefix>_iter_<N>.caffemodel     the train net's weights (a NetParameter)
    <snapshot_prefix>_iter_<N>.solverstate    a SolverState: iter, learned_net (the
                                              .caffemodel's path), current_step, the
                                              update rule's history blobs, and Intel
                                              Caffe's plateau fields

HDF5 (needs h5py):

    <snapshot_prefix>_iter_<N>.caffemodel.h5  data/<layer>/<i> (Net::ToHDF5, net_hdf5.py)
    <snapshot_prefix>_iter_<N>.solverstate.h5 iter, current_step (1-element int32),
                                              learned_net (a NUL-terminated string),
                                              history/<i> (float32, the blob's shape);
                                              Intel Caffe's iter_last_event (int32) and
                                              minimum_loss (float32), which BVLC ignores

The history blobs are the update rule's per-parameter arrays (`rule.state(i)`)
in Caffe's order: the first array of every parameter, then (AdaDelta, Adam)
the second array of every parameter.

The .solverstate also carries two extensions as JSON, in fields Caffe's reader
skips as unknown (Caffe's SolverState numbers its fields 1-4, Intel Caffe's
5-6; Caffe reads our files unchanged):

    RNG_STATE_FIELD   rank 0's random generator state
    RUN_STATE_FIELD   {"ranks": [{"rng": ..., "layers": {name: read position}}, ...]}:
                      every rank's generator and the read positions of its train
                      net's data layers (Layer.read_state), so a resumed run
                      draws the same numbers and reads the very next batch an
                      uninterrupted one would

A .solverstate.h5 carries the same two as string datasets (EXTENSION_DATASETS),
which Caffe's reader never opens.  Both are bounded in size and nesting and checked
before anything is restored.  restore() reads either format, by extension as Caffe
does (.h5: HDF5).  Snapshot files are written under temporary names
(prototxt.atomic_path); `remove_stale` removes the ones a killed run left for this
snapshot prefix.
"""
import json
import os
import re

import numpy as np

from .. import log, net_hdf5, rng
from ..blobproto import array_to_blobproto, blobproto_to_array
from ..errors import SolverError
from ..proto import caffe_pb2
from ..prototxt import PROTO_LIMIT, atomic_path, read_binary, remove_stale_temporaries, write_binary

# Field numbers of caffepy's extensions inside SolverState (JSON), unknown to Caffe
RNG_STATE_FIELD = 1001
RUN_STATE_FIELD = 1002
# Their datasets in a .solverstate.h5
EXTENSION_DATASETS = {RNG_STATE_FIELD: "caffepy_rng_state", RUN_STATE_FIELD: "caffepy_run_state"}

# Bounds on the extensions, far above what caffepy writes (a generator state is about
# 150 bytes, a data layer's position 300, the nesting 7 deep)
RNG_STATE_BYTES = 1 << 16
RUN_STATE_BYTES = 1 << 26
JSON_DEPTH = 16


def is_hdf5(param):
    return param.snapshot_format == caffe_pb2.SolverParameter.HDF5


# -- before training ------------------------------------------------------------
def check_format(param, source):
    """HDF5 snapshots need h5py: find out before training, not at the first snapshot."""
    if is_hdf5(param):
        net_hdf5.require_h5py(f"{source}: snapshot_format: HDF5")


def default_prefix(param, source):
    """Caffe's UpgradeSnapshotPrefixProperty, on `param` in place: no prefix -> the solver
    file's path without its extension; a directory -> that directory / the solver file's stem."""
    if source == "<solver>" or not os.path.exists(source):
        return
    stem = os.path.splitext(source)[0]
    if not param.HasField("snapshot_prefix"):
        param.snapshot_prefix = stem
        log.info(f"snapshot_prefix was not specified and is set to {param.snapshot_prefix}")
    elif os.path.isdir(param.snapshot_prefix):
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, os.path.basename(stem))
        log.info(f"snapshot_prefix is a directory and is replaced to {param.snapshot_prefix}")


def check_writable(param, source):
    """Caffe's CheckSnapshotWritePermissions: find out now, not after hours of training."""
    if not (param.snapshot or param.snapshot_after_train):
        return
    directory = os.path.dirname(param.snapshot_prefix) or "."
    if not os.path.isdir(directory):
        raise SolverError(f"{source}: snapshot_prefix: the directory '{directory}' does not exist, "
                          f"got '{param.snapshot_prefix}'. Create it or change snapshot_prefix")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SolverError(f"{source}: snapshot_prefix: cannot write to '{directory}', got "
                          f"'{param.snapshot_prefix}'. Make sure the directory is writable")


def remove_stale(param):
    """Remove the temporary snapshot files of this prefix that killed runs left (mid-write)."""
    if not param.snapshot_prefix:
        return
    directory, stem = os.path.split(param.snapshot_prefix)
    names = re.escape(stem) + r"_iter_\d+\.(caffemodel|solverstate)(\.h5)?"
    removed = remove_stale_temporaries(directory or ".", names)
    if removed:
        log.info(f"Removed {len(removed)} temporary snapshot files left by a killed run "
                 f"({sum(size for _, size in removed) / 1e6:.1f} MB): {', '.join(p for p, _ in removed[:3])}"
                 f"{', ...' if len(removed) > 3 else ''}")


# -- the files ------------------------------------------------------------------
def filename(prefix, it, extension):
    return f"{prefix}_iter_{it}{extension}"


def read_solver_state(path):
    """A binary SolverState (.solverstate)."""
    return read_binary(caffe_pb2.SolverState(), path)


def write_solver_state(state, path, limit=PROTO_LIMIT):
    """Write a SolverState atomically (refused over protobuf's 2 GiB limit)."""
    write_binary(state, path, limit)


def saved_order(states):
    """The history arrays of `states` (one list per parameter) in the .solverstate's order."""
    return [arrays[k] for k in range(len(states[0]) if states else 0) for arrays in states]


def write(param, it, net, states, current_step, plateau, arrays=None, run_state=None, generator=None):
    """Solver::Snapshot: the weights, then the solver state, in param.snapshot_format;
    returns their paths.

    `states[i]`: the history arrays of learnable parameter i (the rule's `state(i)`);
    `arrays`: {parameter Blob: (data, diff)} written instead of the net's own (the whole
    arrays of parameters split across ranks; Net.to_proto); `run_state`: what goes into
    RUN_STATE_FIELD; `generator`: the random generator state for RNG_STATE_FIELD (None: the
    generator's state now)."""
    if generator is None:
        generator = rng.get_state()
    if is_hdf5(param):
        return _write_hdf5(param, it, net, states, current_step, plateau, arrays, run_state, generator)
    model = filename(param.snapshot_prefix, it, ".caffemodel")
    log.info(f"Snapshotting to binary proto file {model}")
    write_binary(net.to_proto(write_diff=param.snapshot_diff, arrays=arrays), model)
    state = caffe_pb2.SolverState(iter=it, learned_net=model, current_step=current_step,
                                  minimum_loss=plateau.minimum_loss, iter_last_event=plateau.iter_last_event)
    for h in saved_order(states):
        state.history.append(array_to_blobproto(h))
    state.MergeFromString(_extension_bytes(RNG_STATE_FIELD, json.dumps(generator).encode()))
    if run_state is not None:
        state.MergeFromString(_extension_bytes(RUN_STATE_FIELD, json.dumps(run_state).encode()))
    path = filename(param.snapshot_prefix, it, ".solverstate")
    log.info(f"Snapshotting solver state to binary proto file {path}")
    write_solver_state(state, path)
    return model, path


def _write_hdf5(param, it, net, states, current_step, plateau, arrays, run_state, generator):
    """Solver::SnapshotToHDF5 and SGDSolver::SnapshotSolverStateToHDF5."""
    model = filename(param.snapshot_prefix, it, ".caffemodel.h5")
    log.info(f"Snapshotting to HDF5 file {model}")
    net_hdf5.save(net, model, write_diff=param.snapshot_diff, arrays=arrays)
    path = filename(param.snapshot_prefix, it, ".solverstate.h5")
    log.info(f"Snapshotting solver state to HDF5 file {path}")
    h5py = net_hdf5.require_h5py(f"{path}: snapshot_format: HDF5")
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        net_hdf5.save_int(f, "iter", it)
        net_hdf5.save_string(f, "learned_net", model)
        net_hdf5.save_int(f, "current_step", current_step)
        net_hdf5.save_int(f, "iter_last_event", plateau.iter_last_event)
        net_hdf5.save_float(f, "minimum_loss", plateau.minimum_loss)
        group = f.create_group("history")
        for i, h in enumerate(saved_order(states)):
            group.create_dataset(str(i), data=np.asarray(h, np.float32))
        net_hdf5.save_string(f, EXTENSION_DATASETS[RNG_STATE_FIELD], json.dumps(generator))
        if run_state is not None:
            net_hdf5.save_string(f, EXTENSION_DATASETS[RUN_STATE_FIELD], json.dumps(run_state))
    return model, path


def _read_hdf5_state(state_file):
    """A .solverstate.h5 as a SolverState (its scalars, and the extensions in their fields,
    so they are checked as a .solverstate's are) and its history arrays."""
    h5py = net_hdf5.require_h5py(f"{state_file}: HDF5 solver state")
    with net_hdf5.open_file(state_file, "HDF5 solver state") as f:
        if "iter" not in f and "data" in f:
            raise SolverError(f"{state_file}: holds weights (a .caffemodel.h5), not a solver state; "
                              f"resume from a .solverstate.h5, or start from these weights with "
                              f"--weights {state_file}")
        state = caffe_pb2.SolverState(iter=net_hdf5.load_scalar(f, "iter", state_file),
                                      current_step=net_hdf5.load_scalar(f, "current_step", state_file))
        if "learned_net" in f:
            state.learned_net = net_hdf5.load_string(f, "learned_net", state_file)
        if "iter_last_event" in f:
            state.iter_last_event = net_hdf5.load_scalar(f, "iter_last_event", state_file)
        if "minimum_loss" in f:
            state.minimum_loss = net_hdf5.load_scalar(f, "minimum_loss", state_file, kind="f")
        group = f.get("history")
        if not isinstance(group, h5py.Group):
            raise SolverError(f"{state_file}: no 'history' group; not a Caffe HDF5 solver state")
        arrays = []
        for i in range(len(group)):
            if str(i) not in group:
                raise SolverError(f"{state_file}: history: datasets should be named 0..{len(group) - 1}, "
                                  f"got {sorted(group)}")
            arrays.append(net_hdf5.read_array(group[str(i)], state_file, f"history/{i}"))
        for field, name in EXTENSION_DATASETS.items():
            if name in f:
                text = net_hdf5.load_string(f, name, state_file)
                state.MergeFromString(_extension_bytes(field, text.encode()))
    return state, arrays


def restore(state_file, net, rule):
    """Solver::Restore: the weights the solver state names into `net`, its history blobs
    into the update rule's arrays (`rule.state(i)`, in place), and (when saved by caffepy)
    the random generator state.  A name ending in .h5 is read as HDF5, as Caffe does.
    Returns a SolverState, for its iter, current_step and plateau fields (and
    `saved_run_state`). Both extensions are checked before anything is restored."""
    state_file = os.fspath(state_file)
    if state_file.endswith(".h5"):
        state, arrays = _read_hdf5_state(state_file)
    else:
        state = read_solver_state(state_file)
        arrays = None
    for field in ("iter", "current_step", "iter_last_event"):
        if getattr(state, field) < 0:
            raise SolverError(f"{state_file}: {field}: must be >= 0, got {getattr(state, field)}")
    data = state.SerializeToString()
    generator = find_extension(data, RNG_STATE_FIELD)
    if generator is not None:
        generator = _rng_state(_json(generator, state_file, "random generator state", RNG_STATE_BYTES),
                               state_file, "random generator state")
    saved_run_state(state, state_file, data)
    if state.HasField("learned_net") and state.learned_net:
        net.copy_from(_resolve_learned_net(state.learned_net, state_file))
    history = saved_order([rule.state(i) for i in range(len(net.learnable_params))])
    count = len(state.history) if arrays is None else len(arrays)
    if count != len(history):
        raise SolverError(f"{state_file}: history: incorrect number of history blobs for a "
                          f"{rule.type} solver over this net (expected {len(history)}), "
                          f"got {count}. Was it written by another solver type or net?")
    if arrays is None:      # BlobProtos, converted one at a time
        arrays = (blobproto_to_array(bp, source=state_file, where=f"history[{i}]")
                  for i, bp in enumerate(state.history))
    log.info("SGDSolver: restoring history")
    for i, (array, h) in enumerate(zip(arrays, history)):
        if array.shape != h.shape:
            if array.size != h.size:
                raise SolverError(f"{state_file}: history[{i}]: shape should be {h.shape}, "
                                  f"got {array.shape}")
            array = array.reshape(h.shape)
        h[...] = array
    if generator is not None:
        rng.set_state(generator)
    return state


def saved_run_state(state, state_file, data=None):
    """The RUN_STATE_FIELD object of a SolverState (`data`: the state serialized, if at
    hand), or None (Caffe's files, older caffepy's), its shape checked: {"ranks": [{"rng":
    generator state, "layers": {layer name: {...}}}, ...]} (each layer checks its own
    object: Layer.set_read_state)."""
    payload = find_extension(state.SerializeToString() if data is None else data, RUN_STATE_FIELD)
    if payload is None:
        return None
    value = _json(payload, state_file, "run state", RUN_STATE_BYTES)
    where = f"{state_file}: run state"
    ranks = value.get("ranks") if isinstance(value, dict) else None
    if not isinstance(ranks, list) or not ranks or set(value) != {"ranks"}:
        raise SolverError(f"{where}: expected {{\"ranks\": [one object per rank]}}, got {_short(value)}")
    for r, entry in enumerate(ranks):
        layers = entry.get("layers") if isinstance(entry, dict) else None
        if not isinstance(layers, dict) or set(entry) != {"rng", "layers"} \
                or not all(isinstance(v, dict) for v in layers.values()):
            raise SolverError(f"{where}: ranks[{r}]: expected {{\"rng\": ..., \"layers\": {{name: {{...}}}}}}, "
                              f"got {_short(entry)}")
        _rng_state(entry["rng"], state_file, f"run state: ranks[{r}].rng")
    return value


def _short(value):
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _rng_state(value, state_file, what):
    problem = rng.state_problem(value, rng.get_state())
    if problem:
        raise SolverError(f"{state_file}: {what}: not a state of caffepy's generator ({problem})")
    return value


def _json(payload, state_file, what, limit):
    """An extension's JSON, refused in one line when too large, too deeply nested or not JSON."""
    if len(payload) > limit:
        raise SolverError(f"{state_file}: {what}: larger than caffepy writes ({limit} bytes at most), "
                          f"got {len(payload)} bytes")
    depth = json_depth(payload)
    if depth > JSON_DEPTH:
        raise SolverError(f"{state_file}: {what}: nested deeper than caffepy writes ({JSON_DEPTH} levels "
                          f"at most), got {depth} levels")
    try:
        return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SolverError(f"{state_file}: {what}: not JSON, got {str(e)[:80]}") from None


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(payload):
    """The deepest nesting of [ and { in a JSON text (outside its strings)."""
    skeleton = np.frombuffer(_JSON_STRING.sub(b"", payload), np.uint8)
    steps = np.isin(skeleton, (ord("["), ord("{"))).astype(np.int64) - np.isin(skeleton, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def _resolve_learned_net(learned_net, state_file):
    """learned_net as written (relative to the current directory), else next to the .solverstate."""
    if os.path.exists(learned_net):
        return learned_net
    here = os.path.dirname(os.path.abspath(state_file))
    for candidate in (os.path.join(here, learned_net), os.path.join(here, os.path.basename(learned_net))):
        if os.path.exists(candidate):
            return candidate
    raise SolverError(f"{state_file}: learned_net: cannot find the weights it names, got "
                      f"'{learned_net}' (looked in the current directory and next to the .solverstate)")


# -- the extension field inside SolverState ---------------------------------
def _varint(value):
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _extension_bytes(field, payload):
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _read_varint(data, pos):
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def find_extension(data, field):
    """The payload of the last length-delimited top-level field `field` in `data`, or None."""
    pos, found = 0, None
    try:
        while pos < len(data):
            key, pos = _read_varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _read_varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                size, pos = _read_varint(data, pos)
                if number == field:
                    found = bytes(data[pos:pos + size])
                pos += size
            else:
                return found
    except IndexError:
        return found
    return found
