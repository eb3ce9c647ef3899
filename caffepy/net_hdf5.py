"""Net weights in Caffe's HDF5 layout (Net::ToHDF5 / CopyTrainedLayersFromHDF5), through h5py.

    /data/<layer name>/<i>   float32 dataset of the layer's i-th parameter blob, the blob's shape
    /diff/<layer name>/<i>   its gradient (only when written with write_diff)

Every layer gets a group, Split layers and layers without parameters included (empty), as
Caffe writes them. A parameter shared by `param { name }` is written once, under the layer
that owns it; the layers that borrow it have no dataset for it, and loading skips them.
Datasets of any float or integer type load (HDF5 converts them to float, as Caffe's
H5LTread_dataset_float does).

Also the small HDF5 pieces Caffe's other HDF5 files use (util/hdf5.cpp): one-element int
and float datasets and NUL-terminated strings (the .solverstate.h5's iter, learned_net).
"""
import os

import numpy as np

from . import log
from .errors import CaffepyError, ShapeError, quote
from .prototxt import atomic_path

# The 8 bytes every HDF5 file starts with (its superblock signature)
SIGNATURE = b"\x89HDF\r\n\x1a\n"


def require_h5py(what):
    try:
        import h5py
    except ImportError:
        raise CaffepyError(f"{what}: needs h5py, which is not installed. Install it with: "
                           f"pip install h5py (or pip install 'caffepy[hdf5]')") from None
    return h5py


def is_hdf5(path):
    """Whether `path` is an HDF5 file (Caffe's H5Fis_hdf5), by its signature."""
    try:
        with open(path, "rb") as f:
            return f.read(len(SIGNATURE)) == SIGNATURE
    except OSError:
        return False


def open_file(path, what):
    """h5py.File(path, "r"), with Caffe-shaped errors for a missing or non-HDF5 file."""
    path = os.fspath(path)
    h5py = require_h5py(f"{path}: {what}")
    if not os.path.isfile(path):
        raise CaffepyError(f"{path}: no such file")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise CaffepyError(f"{path}: not an HDF5 file ({e})") from None


# -- Caffe's util/hdf5.cpp ---------------------------------------------------------
def save_int(group, name, value):
    """hdf5_save_int: a 1-element int32 dataset."""
    group.create_dataset(name, data=np.array([value], np.int32))


def save_float(group, name, value):
    """Intel Caffe's hdf5_save_float: a 1-element float32 dataset."""
    group.create_dataset(name, data=np.array([value], np.float32))


def save_string(group, name, text):
    """hdf5_save_string (H5LTmake_dataset_string): a scalar fixed-length ASCII string,
    NUL-terminated, its size the text's length + 1."""
    import h5py
    raw = text.encode()
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(len(raw) + 1)
    tid.set_strpad(h5py.h5t.STR_NULLTERM)
    dataset = h5py.h5d.create(group.id, name.encode(), tid, h5py.h5s.create(h5py.h5s.SCALAR))
    dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(raw + b"\0", f"S{len(raw) + 1}"), mtype=tid)


def load_scalar(group, name, path, kind="i"):
    """The first element of a numeric dataset (hdf5_load_int / hdf5_load_float)."""
    if name not in group:
        raise CaffepyError(f"{path}: no '{name}' dataset")
    values = np.asarray(group[name][()]).reshape(-1)
    if values.size < 1 or values.dtype.kind not in "fiu":
        raise CaffepyError(f"{path}: {name}: expected a number, got {values.dtype} of size {values.size}")
    return int(values[0]) if kind == "i" else float(values[0])


def load_string(group, name, path):
    """hdf5_load_string: the text up to the first NUL."""
    value = group[name][()]
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0] if value.size else b""
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, np.bytes_)):
        raise CaffepyError(f"{path}: {name}: expected a string, got {type(value).__name__}")
    return bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")


def read_array(dataset, path, where):
    """A float or integer dataset as float32 (Caffe's reader refuses the other classes)."""
    if dataset.dtype.kind not in "fiu":
        raise CaffepyError(f"{path}: {where}: unsupported dataset type {dataset.dtype}; Caffe reads "
                           f"float or integer data")
    return np.asarray(dataset[()], np.float32)


# -- the net's weights -------------------------------------------------------------
def _owned(net):
    """{(layer index, param index)} of the blobs each layer owns (first use of a Blob object)."""
    seen, owned = set(), set()
    for li, layer in enumerate(net.layers):
        for pi, blob in enumerate(layer.blobs):
            if id(blob) not in seen:
                seen.add(id(blob))
                owned.add((li, pi))
    return owned


def save(net, path, write_diff=False, arrays=None):
    """Net::ToHDF5, written atomically (a temporary file renamed over `path`). `arrays`
    maps a parameter Blob to the (data, diff) written in its place (as Net.to_proto)."""
    path = os.fspath(path)
    h5py = require_h5py(f"{path}: save_hdf5")
    owned = _owned(net)
    arrays = arrays or {}
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        data = f.create_group("data")
        diff = f.create_group("diff") if write_diff else None
        for li, (name, layer) in enumerate(zip(net._layer_names, net.layers)):
            if name in data:        # a repeated name (Caffe allows them): one group per name
                if layer.blobs:
                    raise CaffepyError(f"{path}: layer {li} '{name}' ({layer.type}) holds weights under "
                                       f"the name of an earlier layer; HDF5 weights are stored by "
                                       f"layer name, so rename one of them (or snapshot as binaryproto)")
                continue
            group = data.create_group(name)
            diff_group = diff.create_group(name) if write_diff else None
            for pi, blob in enumerate(layer.blobs):
                values, grads = arrays.get(blob, (blob.data, blob.diff))
                if (li, pi) in owned:
                    group.create_dataset(str(pi), data=np.asarray(values, np.float32))
                if write_diff:   # diffs of borrowed parameters too, as Caffe
                    diff_group.create_dataset(str(pi), data=np.asarray(grads, np.float32))


def load(net, path):
    """CopyTrainedLayersFromHDF5: each layer's datasets into the net's layer of that name.

    As copy_from: layers of the file the net lacks are ignored, layers of the net the file
    lacks keep their values (with a warning), and a file that fills no layer is refused."""
    path = os.fspath(path)
    h5py = require_h5py(f"{path}: HDF5 weights")
    owned = _owned(net)
    index = net._first_named         # as Caffe, a name's weights go to its first layer
    wanting = [name for name, li in index.items() if net.layers[li].blobs]
    loaded = set()
    with open_file(path, "HDF5 weights") as f:
        if "data" not in f or not isinstance(f["data"], h5py.Group):
            what = "a solver state (.solverstate.h5)" if "history" in f else "not Caffe HDF5 weights"
            raise CaffepyError(f"{path}: no 'data' group: {what}")
        for name, group in f["data"].items():
            if name not in index:
                log.info(f"Ignoring source layer {name}")
                continue
            li = index[name]
            layer = net.layers[li]
            if len(group) > len(layer.blobs):
                raise ShapeError(f"{path}: layer '{name}' ({layer.type}): has {len(group)} parameter "
                                 f"datasets, the net expects {len(layer.blobs)}")
            for pi, blob in enumerate(layer.blobs):
                key = str(pi)
                if key not in group:
                    if (li, pi) not in owned:
                        continue      # a shared parameter: its owner's dataset holds it
                    raise ShapeError(f"{path}: layer '{name}' ({layer.type}): dataset '{key}' is "
                                     f"missing; the net expects {len(layer.blobs)} parameter blobs")
                dataset = group[key]
                if tuple(dataset.shape) != blob.shape:
                    raise ShapeError(f"{path}: layer '{name}' ({layer.type}): blobs[{pi}]: shape "
                                     f"mismatch: file has {tuple(dataset.shape)}, net has {blob.shape}")
                blob.data[...] = read_array(dataset, path, f"data/{name}/{key}")
                loaded.add(name)
    missed = [name for name in wanting if name not in loaded]
    if wanting and not loaded:
        raise CaffepyError(f"{path}: no layer of the net got weights from this file; the net's are "
                           f"{quote(', '.join(wanting))}. Is it the weights of this net?")
    if missed:
        log.warning(f"{path}: no weights for layer(s) {quote(', '.join(missed))} of {net.source}; "
                    f"they keep their initial values")
