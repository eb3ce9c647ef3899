"""HDF5 layers (through h5py, the `hdf5` extra): HDF5Data reads rows of .h5 files, HDF5Output
writes its two bottoms to one.  Neither has a gradient."""
import weakref

import numpy as np

from .. import log, memory, rng
from ..errors import DataError, SizeError
from ..layer import Layer, register
from ..net_hdf5 import require_h5py
from ..proto import caffe_pb2


# which permutation a draw is for (a part of its seed)
_FILES, _ROWS = 1, 2


@register
class HDF5Data(Layer):
    """Rows of HDF5 datasets, one top per dataset, named as the top (Caffe's HDF5DataLayer).

    hdf5_data_param: source (a text file listing .h5 files, whitespace-separated, paths as
    given), batch_size, shuffle.  Each file is loaded whole; dataset `<top>` of shape
    N x ... gives batches of batch_size x ... (any number of axes, at least one); every
    top's dataset has the same N.  Float and integer datasets are read as float32 (HDF5
    converts doubles and integers, as Caffe's H5LTread_dataset_float does); other types
    are refused.  The rows run through each file in order, then the next file; with
    shuffle, the file order is drawn anew at setup and at each pass over the list, and the
    row order each time a file is started (Caffe's Next(): a file's rows are shuffled again
    when it is loaded and when a single file starts over).  No transform_param: Caffe
    refuses it.

    Multi-rank: rank r of N keeps rows r, r+N, r+2N, ... of the common sequence in TRAIN,
    as Caffe's Skip() does (a TEST net reads every row); the
    permutations come from one seed the ranks agree on, so the ranks see disjoint rows.
    Permutation k of the files (of the rows) is drawn from (seed, kind, k): a snapshot
    keeps the seed, the counts and the position (read_state), which is all it takes to go on.
    """
    exact_bottoms = 0
    min_tops = 1
    differentiable = False
    _STATE_KEYS = ("seed", "files", "file_draws", "row_draws", "current_file", "current_row", "offset")

    def setup(self, bottom, top):
        self.h5py = require_h5py(f"{self.source or '<net>'}: layer '{self.name}' (HDF5Data)")
        p = self.param.hdf5_data_param
        if self.param.HasField("transform_param"):
            raise self.error("transform_param", "HDF5Data does not transform data",
                             hint="transform the data before writing the .h5 files")
        self.batch_size = int(p.batch_size)
        if self.batch_size < 1:
            raise self.error("hdf5_data_param.batch_size", "must be at least 1", self.batch_size)
        if not p.source:
            raise self.error("hdf5_data_param.source", "is required (a text file listing .h5 files)")
        log.info(f"Loading list of HDF5 filenames from: {p.source}")
        try:
            with open(p.source) as f:
                self.files = f.read().split()
        except (OSError, UnicodeDecodeError) as e:
            raise self.error("hdf5_data_param.source", f"cannot read the file list: "
                             f"{getattr(e, 'strerror', None) or e}", p.source, cls=DataError) from None
        log.info(f"Number of HDF5 files: {len(self.files)}")
        if not self.files:
            raise self.error("hdf5_data_param.source", "lists no HDF5 file", p.source, cls=DataError)
        self.names = list(self.param.top)
        self.shuffle = bool(p.shuffle)
        self.seed = int(self.context.agree(int(rng.generator().integers(1 << 62))))
        self.file_draws = self.row_draws = 0
        self.current_file = self.current_row = self.offset = 0
        self.row_shapes = None
        self._draw_files()
        self._start_file()
        self.row_shapes = [a.shape[1:] for a in self.arrays]
        self.reshape(bottom, top)

    # -- the order of files and rows --------------------------------------------------
    def _permutation(self, kind, draw, n):
        return np.random.default_rng([self.seed, kind, draw]).permutation(n)

    def _draw_files(self):
        if self.shuffle:
            self.file_order = self._permutation(_FILES, self.file_draws, len(self.files))
            self.file_draws += 1
        else:
            self.file_order = np.arange(len(self.files))

    def _draw_rows(self):
        rows = len(self.arrays[0])
        if self.shuffle:
            self.row_order = self._permutation(_ROWS, self.row_draws, rows)
            self.row_draws += 1
        else:
            self.row_order = np.arange(rows)

    def _start_file(self):
        self._load(self.files[self.file_order[self.current_file]])
        self._draw_rows()

    def _skip(self):
        c = self.context
        return self.phase != caffe_pb2.TEST and self.offset % c.size != c.rank

    def _next(self):
        self.current_row += 1
        if self.current_row == len(self.row_order):
            self.current_row = 0
            if len(self.files) > 1:
                self.current_file += 1
                if self.current_file == len(self.files):
                    self.current_file = 0
                    self._draw_files()
                self._start_file()
            else:
                self._draw_rows()
        self.offset += 1

    def _load(self, path):
        """Caffe's LoadHDF5FileData: every top's dataset of `path`, checked."""
        h5py = self.h5py
        where = f"hdf5_data_param.source: {path}"
        try:
            f = h5py.File(path, "r")
        except (OSError, ValueError) as e:
            raise self.error(where, f"cannot open HDF5 file ({e})", cls=DataError) from None
        arrays = []
        with f:
            for name in self.names:
                dataset = f.get(name)
                if not isinstance(dataset, h5py.Dataset):
                    raise self.error(where, f"no dataset '{name}' for top '{name}'",
                                     ", ".join(sorted(f)) or "no datasets", cls=DataError)
                if dataset.ndim < 1:
                    raise self.error(where, f"dataset '{name}' needs at least one axis (rows)",
                                     dataset.shape, cls=DataError)
                if dataset.dtype.kind not in "fiu":
                    raise self.error(where, f"dataset '{name}': unsupported type, Caffe reads float or "
                                     f"integer data", dataset.dtype, cls=DataError)
                why = memory.problem(memory.count(dataset.shape) * 4,
                                     f"dataset '{name}' of {memory.dims_text(dataset.shape)} floats")
                if why:
                    raise self.error(where, why, cls=SizeError)
                arrays.append(np.ascontiguousarray(dataset.astype(np.float32)[()]))
        rows = arrays[0].shape[0]
        for name, a in zip(self.names, arrays):
            if a.shape[0] != rows:
                raise self.error(where, f"dataset '{name}' has {a.shape[0]} rows, dataset "
                                 f"'{self.names[0]}' has {rows}", cls=DataError)
        for name, a, shape in zip(self.names, arrays, self.row_shapes or [a.shape[1:] for a in arrays]):
            if a.shape[1:] != shape:     # the tops were shaped by the first file
                raise self.error(where, f"dataset '{name}': rows of {a.shape[1:]}, the first file's "
                                 f"are {shape}", cls=DataError)
        if rows == 0:
            raise self.error(where, f"dataset '{self.names[0]}' has no rows", cls=DataError)
        self.arrays = arrays

    # -- the layer --------------------------------------------------------------------
    def reshape(self, bottom, top):
        for t, shape in zip(top, self.row_shapes):
            t.reshape((self.batch_size,) + shape)

    def forward(self, bottom, top):
        for i in range(self.batch_size):
            while self._skip():
                self._next()
            row = self.row_order[self.current_row]
            for t, a in zip(top, self.arrays):
                t.data[i] = a[row]
            self._next()

    def read_state(self):
        return {key: int(getattr(self, key)) if key != "files" else len(self.files) for key in self._STATE_KEYS}

    def set_read_state(self, state, ranks=None):
        """Go on from a snapshot's position: the same permutations (from the saved seed and
        counts) and row. The row sequence is common to all ranks, so another number of ranks
        goes on from the same place too."""
        if set(state) != set(self._STATE_KEYS):
            raise DataError(f"expected the keys {', '.join(self._STATE_KEYS)}, got {', '.join(state)}")
        for key in self._STATE_KEYS:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
                raise DataError(f"{key}: must be an integer in [0, 2^62), got {str(value)[:40]}")
        if state["files"] != len(self.files) or state["current_file"] >= len(self.files):
            log.warning(f"layer '{self.name}': the snapshot read {state['files']} HDF5 files, the list has "
                        f"{len(self.files)}: reading from the first row")
            return
        self.seed = state["seed"]
        self.file_draws = max(state["file_draws"] - 1, 0)
        self._draw_files()
        self.current_file = state["current_file"]
        self._load(self.files[self.file_order[self.current_file]])
        self.row_draws = max(state["row_draws"] - 1, 0)
        self._draw_rows()
        if state["current_row"] >= len(self.row_order):
            raise DataError(f"current_row: past the {len(self.row_order)} rows of the file, got "
                            f"{state['current_row']}")
        self.current_row, self.offset = state["current_row"], state["offset"]
        self.file_draws, self.row_draws = state["file_draws"], state["row_draws"]


@register
class HDF5Output(Layer):
    """Writes its bottoms to hdf5_output_param.file_name as datasets `data` and `label`
    (Caffe's HDF5OutputLayer): float32, shaped num x channels x height x width (fewer axes
    padded with 1s; at most 4), the file created (truncated) at setup.  Caffe writes one
    batch and aborts on the next forward (the datasets exist); here each later forward
    appends its rows, so a `caffepy test` run collects every batch."""
    exact_bottoms = 2
    exact_tops = 0
    differentiable = False
    DATASETS = ("data", "label")

    def setup(self, bottom, top):
        h5py = require_h5py(f"{self.source or '<net>'}: layer '{self.name}' (HDF5Output)")
        self.file_name = self.param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.error("hdf5_output_param.file_name", "is required")
        try:
            self.file = h5py.File(self.file_name, "w")
        except (OSError, ValueError) as e:
            raise self.error("hdf5_output_param.file_name", f"cannot create the file ({e})",
                             self.file_name, cls=DataError) from None
        self._finalizer = weakref.finalize(self, self.file.close)

    def reshape(self, bottom, top):
        for b, name in zip(bottom, self.DATASETS):
            if len(b.shape) > 4:
                raise self.error("bottom", f"'{b.name}' ({name}) has more than 4 axes", b.shape)
        if bottom[0].shape[0] != bottom[1].shape[0]:
            raise self.error("bottom", "data and label must have the same number of rows",
                             f"{bottom[0].shape[0]} and {bottom[1].shape[0]}")

    def forward(self, bottom, top):
        log.info(f"Saving HDF5 file {self.file_name}")
        for b, name in zip(bottom, self.DATASETS):
            rows = np.asarray(b.data, np.float32).reshape(b.shape + (1,) * (4 - len(b.shape)))
            if name not in self.file:
                self.file.create_dataset(name, data=rows)      # contiguous, as Caffe's
                continue
            old = self.file[name]
            if old.shape[1:] != rows.shape[1:]:
                raise self.error("bottom", f"'{b.name}' changed shape between batches, from "
                                 f"{old.shape[1:]} to", rows.shape[1:])
            if old.maxshape[0] is not None:          # the first append: make it growable
                kept = old[()]
                del self.file[name]
                old = self.file.create_dataset(name, data=kept, maxshape=(None,) + kept.shape[1:],
                                               chunks=True)
            n = old.shape[0]
            old.resize(n + rows.shape[0], axis=0)
            old[n:] = rows
        self.file.flush()
        log.info(f"Successfully saved {bottom[0].shape[0]} rows")

    def close(self):
        """Close the file (also done when the layer is collected, and at exit)."""
        self._finalizer()

