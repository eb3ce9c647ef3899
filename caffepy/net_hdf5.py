"""Net weights in Caffe's HDF5 layout (Net::ToHDF5 / CopyTrainedLayersFromHDF5), through h5py.

    /data/<layer name>/<i>   float32 dataset of the layer's i-th parameter blob, the blob's shape
    /diff/<layer name>/<i>   its gradient (only when written with write_diff)

Every layer gets a group, Split layers and layers without parameters included (empty), as
Caffe writes them. A parameter shared by `param { name }` is written once, under the layer
that owns it; the layers that borrow it have no dataset for it, and loading skips them.
"""
import os

import numpy as np

from . import log
from .errors import CaffepyError, ShapeError


def require_h5py(what):
    try:
        import h5py
    except ImportError:
        raise CaffepyError(f"{what}: needs h5py, which is not installed. Install it with: "
                           f"pip install h5py (or pip install 'caffepy[hdf5]')") from None
    return h5py


def _owned(net):
    """{(layer index, param index)} of the blobs each layer owns (first use of a Blob object)."""
    seen, owned = set(), set()
    for li, layer in enumerate(net.layers):
        for pi, blob in enumerate(layer.blobs):
            if id(blob) not in seen:
                seen.add(id(blob))
                owned.add((li, pi))
    return owned


def save(net, path, write_diff=False):
    path = os.fspath(path)
    h5py = require_h5py(f"{path}: save_hdf5")
    owned = _owned(net)
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        diff = f.create_group("diff") if write_diff else None
        for li, (name, layer) in enumerate(zip(net._layer_names, net.layers)):
            group = data.create_group(name)
            diff_group = diff.create_group(name) if write_diff else None
            for pi, blob in enumerate(layer.blobs):
                if (li, pi) in owned:
                    group.create_dataset(str(pi), data=np.asarray(blob.data, np.float32))
                if write_diff:   # diffs of borrowed parameters too, as Caffe
                    diff_group.create_dataset(str(pi), data=np.asarray(blob.diff, np.float32))


def load(net, path):
    path = os.fspath(path)
    h5py = require_h5py(f"{path}: load_hdf5")
    if not os.path.isfile(path):
        raise CaffepyError(f"{path}: no such file")
    owned = _owned(net)
    index = {name: li for li, name in enumerate(net._layer_names)}
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CaffepyError(f"{path}: not an HDF5 file ({e})") from None
    with f:
        if "data" not in f or not isinstance(f["data"], h5py.Group):
            raise CaffepyError(f"{path}: no 'data' group; not Caffe HDF5 weights")
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
                if dataset.dtype.kind not in "fiu":
                    raise CaffepyError(f"{path}: data/{name}/{key}: unsupported dataset type "
                                       f"{dataset.dtype}; Caffe reads float or integer data")
                if tuple(dataset.shape) != blob.shape:
                    raise ShapeError(f"{path}: layer '{name}' ({layer.type}): blobs[{pi}]: shape "
                                     f"mismatch: file has {tuple(dataset.shape)}, net has {blob.shape}")
                blob.data[...] = dataset[()]
