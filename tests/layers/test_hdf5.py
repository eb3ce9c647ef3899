"""HDF5Data and HDF5Output: forward cases (no gradients: differentiable = False), Caffe's row
order across files and batches, shuffling, ranks, float/integer/double datasets, the file
HDF5Output writes, and one-line errors."""
import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest

from caffepy.blob import Blob
from caffepy.context import SINGLE, RunContext
from caffepy.errors import CaffepyError, DataError, LayerError
from caffepy.layer import create_layer
from layer_cases import TEST, TRAIN, Case, case_tests, layer_param, setup_layer

h5py = pytest.importorskip("h5py")

_DIR = tempfile.mkdtemp(prefix="caffepy_hdf5_cases_")
atexit.register(shutil.rmtree, _DIR, True)


def h5_file(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, value in datasets.items():
            f.create_dataset(name, data=value)
    return str(path)


def file_list(path, *files):
    with open(path, "w") as f:
        f.write("\n".join(files) + "\n")
    return str(path)


# two files of 3 and 2 rows: data is 2 x 2 per row (float64 in the file), label an int vector;
# also as t0 / t1, the names the case harness gives the tops
_A = np.arange(12, dtype=np.float64).reshape(3, 2, 2) / 3
_B = 100 + np.arange(8, dtype=np.float64).reshape(2, 2, 2)
_LA, _LB = np.array([0, 1, 2], np.int64), np.array([3, 4], np.int64)
_LIST = file_list(os.path.join(_DIR, "list.txt"),
                  h5_file(os.path.join(_DIR, "a.h5"), data=_A, label=_LA, t0=_A, t1=_LA),
                  h5_file(os.path.join(_DIR, "b.h5"), data=_B, label=_LB, t0=_B, t1=_LB))
_ROWS = np.concatenate([_A, _B]).astype(np.float32)


def _hdf5(batch, extra=""):
    return f'hdf5_data_param {{ source: "{_LIST}" batch_size: {batch} {extra} }}'


CASES = [
    Case("HDF5Data", _hdf5(4), [], n_top=2, grad=False, id="HDF5Data:across two files",
         expected=lambda: [_ROWS[[0, 1, 2, 3]], np.array([0.0, 1, 2, 3])]),
    Case("HDF5Data", _hdf5(7), [], n_top=2, grad=False, id="HDF5Data:wraps to the first file",
         expected=lambda: [_ROWS[[0, 1, 2, 3, 4, 0, 1]], np.array([0.0, 1, 2, 3, 4, 0, 1])]),
]

test_forward, test_gradient = case_tests(CASES)


def hdf5_layer(params, phase=TRAIN, context=SINGLE, tops=("data", "label")):
    lp = layer_param("HDF5Data", params, n_bottom=0, n_top=0)
    lp.top.extend(tops)
    layer = create_layer(lp, phase, context=context)
    top = [Blob(name=n) for n in lp.top]
    layer.layer_setup([], top)
    return layer, top


def batches(layer, top, n):
    out = []
    for _ in range(n):
        layer.forward([], top)
        out.append([t.data.copy() for t in top])
    return out


def test_datasets_are_named_by_the_tops_and_any_axes_work(tmp_path):
    src = file_list(tmp_path / "l.txt", h5_file(tmp_path / "x.h5", v=np.arange(5.0),
                                                 cube=np.zeros((5, 2, 3, 4, 5), np.uint8)))
    layer, top = hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 2 }}', tops=["cube", "v"])
    assert top[0].shape == (2, 2, 3, 4, 5) and top[1].shape == (2,)
    (cube, v), (_, v2), (_, v3) = batches(layer, top, 3)
    assert v.tolist() == [0, 1] and v2.tolist() == [2, 3] and v3.tolist() == [4, 0]
    assert cube.dtype == np.float32


def test_double_and_integer_data_read_as_float(tmp_path):
    src = file_list(tmp_path / "l.txt", h5_file(tmp_path / "x.h5", data=np.array([[0.1], [1e40]]),
                                                 label=np.array([7, -3], np.int16)))
    layer, top = hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 2 }}')
    layer.forward([], top)
    assert top[0].data[0, 0] == np.float32(0.1) and np.isinf(top[0].data[1, 0])
    assert top[1].data.tolist() == [7.0, -3.0]


def test_shuffle_permutes_rows_and_files_each_pass(tmp_path):
    files = [h5_file(tmp_path / f"{i}.h5", data=np.arange(10 * i, 10 * i + 10, dtype=np.float32))
             for i in range(3)]
    src = file_list(tmp_path / "l.txt", *files)
    from caffepy import rng
    rng.seed(5)
    layer, top = hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 30 shuffle: true }}',
                            tops=["data"])
    first, second = (b[0] for b in batches(layer, top, 2))
    # each pass shows every row once, whole files at a time, in a new order
    for epoch in (first, second):
        assert sorted(epoch.tolist()) == list(range(30))
        assert [len({int(x) // 10 for x in epoch[i:i + 10]}) for i in (0, 10, 20)] == [1, 1, 1]
    assert first.tolist() != second.tolist()
    assert first.tolist() != sorted(first.tolist())
    rng.seed(5)
    again, _ = hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 30 shuffle: true }}',
                          tops=["data"])
    assert batches(again, top, 1)[0][0].tolist() == first.tolist()      # random_seed repeats it
    rng.seed(-1)


def test_ranks_keep_every_nth_row_in_train_and_all_in_test():
    rows = []
    for rank in range(2):
        layer, top = hdf5_layer(_hdf5(3), context=RunContext(rank=rank, size=2))
        rows.append(np.concatenate([b[1] for b in batches(layer, top, 2)]).tolist())
    # Caffe's Skip(): rank r keeps offsets r, r+2, ... of 0 1 2 3 4 0 1 2 3 4 ...
    assert rows == [[0, 2, 4, 1, 3, 0], [1, 3, 0, 2, 4, 1]]
    layer, top = hdf5_layer(_hdf5(3), phase=TEST, context=RunContext(rank=1, size=2))
    assert batches(layer, top, 1)[0][1].tolist() == [0, 1, 2]


@pytest.mark.parametrize("params, message", [
    ("", r"hdf5_data_param.batch_size: must be at least 1, got 0"),
    ('hdf5_data_param { batch_size: 1 }', r"hdf5_data_param.source: is required \(a text file listing .h5 files\)"),
    ('hdf5_data_param { source: "/nonexistent/list" batch_size: 1 }',
     r"hdf5_data_param.source: cannot read the file list: No such file or directory, got /nonexistent/list"),
    (_hdf5(1) + ' transform_param { scale: 2 }',
     r"transform_param: HDF5Data does not transform data. transform the data before writing the .h5 files"),
])
def test_bad_parameters_are_one_line(params, message):
    with pytest.raises(CaffepyError, match=r"^layer 'layer' \(HDF5Data\): " + message + "$"):
        hdf5_layer(params)


def test_bad_files_name_the_file_and_dataset(tmp_path):
    def layer_over(**datasets):
        src = file_list(tmp_path / "l.txt", h5_file(tmp_path / "x.h5", **datasets))
        return hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 1 }}')
    with pytest.raises(DataError, match=r"x.h5: no dataset 'label' for top 'label', got data$"):
        layer_over(data=np.zeros(3))
    with pytest.raises(DataError, match=r"dataset 'label' has 2 rows, dataset 'data' has 3"):
        layer_over(data=np.zeros(3), label=np.zeros(2))
    with pytest.raises(DataError, match=r"dataset 'data': unsupported type.*got \|S"):
        layer_over(data=np.array([b"a", b"b"]), label=np.zeros(2))
    with pytest.raises(DataError, match=r"dataset 'data' needs at least one axis"):
        layer_over(data=np.float32(3), label=np.zeros(2))
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(DataError, match="lists no HDF5 file"):
        hdf5_layer(f'hdf5_data_param {{ source: "{tmp_path / "empty.txt"}" batch_size: 1 }}')
    src = file_list(tmp_path / "l2.txt", h5_file(tmp_path / "z.h5", data=np.zeros(3), label=np.zeros(3)),
                    h5_file(tmp_path / "y.h5", data=np.zeros((2, 2)), label=np.zeros(2)))
    layer, top = hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 3 }}')
    with pytest.raises(DataError, match=r"y.h5: dataset 'data': rows of \(2,\), the first file's are \(\)"):
        layer.forward([], top)
    (tmp_path / "bad.h5").write_text("not hdf5")
    src = file_list(tmp_path / "l3.txt", str(tmp_path / "bad.h5"))
    with pytest.raises(DataError, match=r"bad.h5: cannot open HDF5 file"):
        hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 1 }}')


# -- HDF5Output ------------------------------------------------------------------
def test_output_writes_data_and_label_as_caffe_then_appends(tmp_path):
    path = tmp_path / "out.h5"
    data = np.arange(6, dtype=np.float32).reshape(3, 2)
    label = np.array([1, 2, 3], np.float32)
    layer, bottom, _ = setup_layer("HDF5Output", f'hdf5_output_param {{ file_name: "{path}" }}',
                                   [data, label], n_top=0)
    assert path.exists()                    # created (truncated) at setup, as Caffe
    layer.forward(bottom, [])
    with h5py.File(path, "r") as f:
        # Caffe's legacy num x channels x height x width, contiguous float32
        assert sorted(f) == ["data", "label"] and f["data"].chunks is None
        assert f["data"].shape == (3, 2, 1, 1) and f["label"].shape == (3, 1, 1, 1)
        assert f["data"].dtype == np.float32
        np.testing.assert_array_equal(f["data"][()].reshape(3, 2), data)
    bottom[0].data[...] += 10
    layer.forward(bottom, [])
    layer.close()
    with h5py.File(path, "r") as f:
        assert f["data"].shape == (6, 2, 1, 1) and f["label"][()].ravel().tolist() == [1, 2, 3, 1, 2, 3]
        np.testing.assert_array_equal(f["data"][3:].reshape(3, 2), data + 10)


def test_output_reads_back_through_hdf5data(tmp_path):
    path = tmp_path / "out.h5"
    data = np.random.default_rng(0).normal(size=(4, 3, 2, 2)).astype(np.float32)
    layer, bottom, _ = setup_layer("HDF5Output", f'hdf5_output_param {{ file_name: "{path}" }}',
                                   [data, np.arange(4.0)], n_top=0)
    layer.forward(bottom, [])
    layer.close()
    src = file_list(tmp_path / "l.txt", str(path))
    reader, top = hdf5_layer(f'hdf5_data_param {{ source: "{src}" batch_size: 4 }}')
    reader.forward([], top)
    np.testing.assert_array_equal(top[0].data, data)
    assert top[1].data.reshape(-1).tolist() == [0, 1, 2, 3]


def test_output_errors_are_one_line(tmp_path):
    with pytest.raises(LayerError, match=r"\(HDF5Output\): hdf5_output_param.file_name: is required"):
        setup_layer("HDF5Output", "", [np.zeros((2, 1)), np.zeros(2)], n_top=0)
    with pytest.raises(DataError, match=r"file_name: cannot create the file"):
        setup_layer("HDF5Output", 'hdf5_output_param { file_name: "/nonexistent/dir/o.h5" }',
                    [np.zeros((2, 1)), np.zeros(2)], n_top=0)
    with pytest.raises(LayerError, match=r"bottom: data and label must have the same number of rows, got 2 and 3"):
        setup_layer("HDF5Output", f'hdf5_output_param {{ file_name: "{tmp_path / "o.h5"}" }}',
                    [np.zeros((2, 1)), np.zeros(3)], n_top=0)
    with pytest.raises(LayerError, match=r"has more than 4 axes"):
        setup_layer("HDF5Output", f'hdf5_output_param {{ file_name: "{tmp_path / "o.h5"}" }}',
                    [np.zeros((2, 1, 1, 1, 1)), np.zeros(2)], n_top=0)


def test_without_h5py_the_layers_name_the_extra(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_h5py(name, *args, **kwargs):
        if name == "h5py":
            raise ImportError("No module named 'h5py'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_h5py)
    with pytest.raises(CaffepyError, match=r"layer 'layer' \(HDF5Data\): needs h5py, which is not installed. "
                                           r"Install it with: pip install h5py \(or pip install 'caffepy\[hdf5\]'\)"):
        hdf5_layer(_hdf5(1))
