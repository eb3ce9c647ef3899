"""LevelDB, Caffe's other database (and its proto's default backend): read and written as the
LMDB is, by the Data layer and by every tool. The databases here are written or read back with
plyvel directly (data_helpers), as any LevelDB program would."""
import os
import subprocess
import sys
import time

import numpy as np
import plyvel
import pytest
from click.testing import CliRunner
from google.protobuf import text_format

from caffepy import rng
from caffepy.cli import main
from caffepy.data import tools
from caffepy.data.db import abort_unfinished, open_reader, open_writer
from caffepy.errors import DataError
from caffepy.net import TEST, TRAIN, Net
from caffepy.proto import caffe_pb2
from data_helpers import data_net_text, db_records, make_db


def build(text, phase=TRAIN):
    rng.seed(5)
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return Net(p, phase=phase, source="net.prototxt")


def batches(net, n):
    out = []
    for _ in range(n):
        net.forward()
        out.append((net.blobs["data"].data.copy(), net.blobs["label"].data.copy()))
    return out


def compacted(path):
    """Move the records from LevelDB's log into a table file (.ldb), as a large database has them."""
    db = plyvel.DB(os.fspath(path))
    db.compact_range()
    db.close()
    return [name for name in os.listdir(path) if name.endswith(".ldb")]


def test_reader_reads_every_record_in_key_order_in_any_order_of_access(tmp_path):
    db = make_db(tmp_path / "db", 300, backend="leveldb")
    expected = [(k.encode(), v) for k, v in db_records(db)]
    reader = open_reader(db)
    assert len(reader) == 300 and list(reader) == expected
    order = np.random.default_rng(0).permutation(300).tolist() + list(range(300))
    assert [reader.get(i) for i in order] == [expected[i] for i in order]
    with pytest.raises(IndexError):
        reader.get(300)
    reader.close()


def test_writer_writes_what_plyvel_reads_and_a_failed_write_leaves_nothing(tmp_path):
    with open_writer(tmp_path / "db", "leveldb", commit_every=7) as w:
        for i in range(20):
            w.put(f"{i:03d}", bytes([i]) * i)
    assert db_records(tmp_path / "db") == [(f"{i:03d}", bytes([i]) * i) for i in range(20)]
    with pytest.raises(RuntimeError):
        with open_writer(tmp_path / "db2", "LEVELDB") as w:
            w.put("a", b"1")
            raise RuntimeError("stop")
    assert os.listdir(tmp_path) == ["db"]
    with pytest.raises(DataError, match="db: database already exists"):
        open_writer(tmp_path / "db", "leveldb")
    with pytest.raises(DataError, match="unknown database backend 'rocksdb'; use lmdb or leveldb"):
        open_writer(tmp_path / "db3", "rocksdb")


def test_data_layer_reads_a_leveldb_as_it_reads_the_same_lmdb(tmp_path):
    values = [np.random.default_rng(i).integers(0, 256, (3, 4, 5), dtype=np.uint8) for i in range(23)]
    make_db(tmp_path / "l", 23, shape=(3, 4, 5), values=values, backend="leveldb")
    make_db(tmp_path / "m", 23, shape=(3, 4, 5), values=values)
    for extra in ("", "shuffle: true", "rand_skip: 9"):
        ours = build(data_net_text(tmp_path / "l", 5, extra, "mirror: true crop_size: 3", backend="LEVELDB"))
        theirs = build(data_net_text(tmp_path / "m", 5, extra, "mirror: true crop_size: 3"))
        for (a, la), (b, lb) in zip(batches(ours, 7), batches(theirs, 7)):   # past an epoch
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(la, lb)
        ours.layers[0].close()
        theirs.layers[0].close()


def test_train_and_test_nets_in_one_process_share_the_leveldb(tmp_path):
    """LevelDB admits one handle per database: the two nets share it, and either may close first."""
    db = make_db(tmp_path / "db", 10, backend="leveldb")
    text = data_net_text(db, 4, backend="LEVELDB")
    train, test = build(text, TRAIN), build(text, TEST)
    assert batches(train, 1)[0][1].tolist() == batches(test, 1)[0][1].tolist() == [0, 1, 2, 3]
    train.layers[0].close()
    assert batches(test, 2)[1][1].tolist() == [8, 9, 0, 1]
    test.layers[0].close()
    plyvel.DB(db).close()               # the last reader let it go


@pytest.mark.parametrize("kind,said,source", [("leveldb", "LMDB", "a LevelDB"), ("lmdb", "LEVELDB", "an LMDB")])
def test_a_backend_naming_the_other_kind_reads_the_database_with_a_warning(tmp_path, capfd, kind, said, source):
    db = make_db(tmp_path / "db", 6, backend=kind)
    net = build(data_net_text(db, 3, backend=said))
    assert batches(net, 2)[1][1].tolist() == [3, 4, 5]
    net.layers[0].close()
    assert f"db: data_param.backend says {said}, but the database is {source}; reading it as one" \
        in capfd.readouterr().err


def test_a_leveldb_open_in_another_process_is_refused_in_one_line(tmp_path):
    db = make_db(tmp_path / "db", 3, backend="leveldb")
    holder = subprocess.Popen([sys.executable, "-c", "import plyvel, sys, time\n"
                               f"d = plyvel.DB({db!r}); print('open', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        result = CliRunner().invoke(main, ["compute_image_mean", db])
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"caffepy: error: {db}: the LevelDB is open in another process, and LevelDB admits one at a "
        f"time. Ranks that share a database need an LMDB (`caffepy convert_imageset --backend lmdb`) "
        f"or one shard each (`caffepy split_db`)")


def test_a_damaged_leveldb_is_refused_in_one_line(tmp_path):
    """A flipped byte in a table: LevelDB's block checksum catches it (plyvel's plain iterator
    would end there quietly, as if the database were shorter)."""
    db = make_db(tmp_path / "db", 50, shape=(3, 8, 8), backend="leveldb")
    table, = compacted(db)
    raw = bytearray((tmp_path / "db" / table).read_bytes())
    raw[100] ^= 0xFF
    (tmp_path / "db" / table).write_bytes(raw)
    result = CliRunner().invoke(main, ["compute_image_mean", db])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"caffepy: error: {db}: damaged LevelDB: Corruption: block checksum mismatch. Copy or "
        f"rebuild the database")
    (tmp_path / "db" / "CURRENT").write_text("MANIFEST-999999\n")
    result = CliRunner().invoke(main, ["compute_image_mean", db])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == (
        f"caffepy: error: {db}: damaged LevelDB: CURRENT names 'MANIFEST-999999', which is not a "
        f"manifest in the directory. Copy or rebuild the database")


def test_not_a_database_names_both_kinds(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="dir: not a database \\(expected an LMDB directory holding "
                                        "data.mdb or a LevelDB directory holding CURRENT\\)"):
        open_reader(tmp_path / "dir")


def test_the_tools_write_and_read_leveldbs(tmp_path):
    """convert_imageset, convert_mnist_data, convert_cifar_data, compute_image_mean and
    split_db, each with LevelDB: the same records as with LMDB."""
    import cv2
    gen = np.random.default_rng(1)
    (tmp_path / "img").mkdir()
    for i in range(6):
        cv2.imwrite(str(tmp_path / "img" / f"{i}.png"), gen.integers(0, 256, (4, 5, 3), dtype=np.uint8))
    (tmp_path / "list.txt").write_text("".join(f"{i}.png {i % 3}\n" for i in range(6)))
    runner = CliRunner()
    for backend in ("lmdb", "leveldb"):
        result = runner.invoke(main, ["convert_imageset", f"-backend={backend}", str(tmp_path / "img") + "/",
                                      str(tmp_path / "list.txt"), str(tmp_path / f"images_{backend}")])
        assert result.exit_code == 0, result.output
    assert os.path.exists(tmp_path / "images_leveldb" / "CURRENT")
    assert db_records(tmp_path / "images_leveldb") == db_records(tmp_path / "images_lmdb")
    np.testing.assert_array_equal(tools.compute_image_mean(str(tmp_path / "images_leveldb")),
                                  tools.compute_image_mean(str(tmp_path / "images_lmdb")))

    n = 30
    (tmp_path / "idx3").write_bytes(np.array([2051, n, 4, 4], ">u4").tobytes()
                                    + gen.integers(0, 256, (n, 4, 4), dtype=np.uint8).tobytes())
    (tmp_path / "idx1").write_bytes(np.array([2049, n], ">u4").tobytes()
                                    + gen.integers(0, 10, n, dtype=np.uint8).tobytes())
    for backend in ("lmdb", "leveldb"):
        result = runner.invoke(main, ["convert_mnist_data", str(tmp_path / "idx3"), str(tmp_path / "idx1"),
                                      str(tmp_path / f"mnist_{backend}"), "--backend", backend])
        assert result.exit_code == 0, result.output
    assert db_records(tmp_path / "mnist_leveldb") == db_records(tmp_path / "mnist_lmdb")

    (tmp_path / "cifar").mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (tmp_path / "cifar" / name).write_bytes(gen.integers(0, 256, (2, 3073), dtype=np.uint8).tobytes())
    for backend in ("lmdb", "leveldb"):
        result = runner.invoke(main, ["convert_cifar_data", str(tmp_path / "cifar"), str(tmp_path), backend])
        assert result.exit_code == 0, result.output
    for part in ("train", "test"):
        assert db_records(tmp_path / f"cifar10_{part}_leveldb") == db_records(tmp_path / f"cifar10_{part}_lmdb")

    from caffepy.parallel.split_db import split_db
    split_db(str(tmp_path / "mnist_leveldb"), 3, str(tmp_path / "shard"))
    everything = db_records(tmp_path / "mnist_lmdb")
    for r in range(3):
        assert os.path.exists(tmp_path / f"shard_{r}" / "CURRENT")
        assert db_records(tmp_path / f"shard_{r}") == everything[r::3]


def test_extract_features_writes_a_leveldb(tmp_path, monkeypatch):
    make_db(tmp_path / "db", 6, shape=(1, 2, 2))
    (tmp_path / "net.prototxt").write_text(
        'name: "f"\n' + data_net_text("db", 3)
        + 'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param {'
          ' num_output: 2 weight_filler { type: "constant" value: 1 } } }\n')
    monkeypatch.chdir(tmp_path)
    Net("net.prototxt", TEST).save("w.caffemodel")
    for kind in ("lmdb", "leveldb"):
        result = CliRunner().invoke(main, ["extract_features", "w.caffemodel", "net.prototxt", "ip,label",
                                           f"ip_{kind},label_{kind}", "2", kind])
        assert result.exit_code == 0, result.output
    for blob in ("ip", "label"):
        assert os.path.exists(tmp_path / f"{blob}_leveldb" / "CURRENT")
        records = db_records(tmp_path / f"{blob}_leveldb")
        assert records == db_records(tmp_path / f"{blob}_lmdb") and len(records) == 6
    result = CliRunner().invoke(main, ["extract_features", "w.caffemodel", "net.prototxt", "ip", "x", "1", "rocksdb"])
    assert result.exit_code == 2 and "db_type: 'rocksdb' is not a database type; use lmdb or leveldb" in result.output


def _digits(tmp_path, n, seed):
    """MNIST-shaped idx files of n 6x6 images of 4 classes: a class's pattern plus noise."""
    gen = np.random.default_rng(seed)
    labels = gen.integers(0, 4, n, dtype=np.uint8)
    patterns = gen.integers(0, 256, (4, 6, 6))
    images = np.clip(patterns[labels] + gen.integers(-20, 21, (n, 6, 6)), 0, 255).astype(np.uint8)
    (tmp_path / "img").write_bytes(np.array([2051, n, 6, 6], ">u4").tobytes() + images.tobytes())
    (tmp_path / "lab").write_bytes(np.array([2049, n], ">u4").tobytes() + labels.tobytes())
    return images, labels


def test_convert_mnist_siamese_data_pairs_items_at_random(tmp_path):
    images, labels = _digits(tmp_path, 300, 0)
    result = CliRunner().invoke(main, ["convert_mnist_siamese_data", str(tmp_path / "img"),
                                       str(tmp_path / "lab"), str(tmp_path / "pairs")])
    assert result.exit_code == 0, result.output
    assert os.path.exists(tmp_path / "pairs" / "CURRENT")          # a LevelDB, as Caffe's tool
    records = db_records(tmp_path / "pairs")
    assert [k for k, _ in records] == [f"{i:08d}" for i in range(300)]
    flat = images.reshape(300, -1)
    firsts, same = set(), 0
    for _, value in records:
        d = caffe_pb2.Datum.FromString(value)
        assert (d.channels, d.height, d.width) == (2, 6, 6)
        pair = np.frombuffer(d.data, np.uint8).reshape(2, -1)
        i, j = (int(np.flatnonzero((flat == half).all(axis=1))[0]) for half in pair)
        assert d.label == int(labels[i] == labels[j])
        firsts.add(i)
        same += d.label
    assert len(firsts) > 150 and 40 < same < 120      # random pairs: about a quarter of one class


def test_a_siamese_net_trains_on_the_pairs_with_caffes_default_backend(tmp_path, monkeypatch):
    """BVLC's siamese example in small: its Data layer names no backend (Caffe's default:
    LEVELDB), Slice splits the pair, two towers share weights by name, ContrastiveLoss."""
    import caffepy
    _digits(tmp_path, 400, 1)
    monkeypatch.chdir(tmp_path)
    tools.convert_mnist_siamese_data("img", "lab", "pairs")
    tower = ('layer {{ name: "ip{s}" type: "InnerProduct" bottom: "{b}" top: "feat{s}" '
             'param {{ name: "w" }} param {{ name: "b" }} inner_product_param {{ num_output: 2 '
             'weight_filler {{ type: "xavier" }} }} }}\n')
    (tmp_path / "net.prototxt").write_text(
        'name: "siamese"\n' + data_net_text("pairs", 32, transform="scale: 0.00390625",
                                            tops=("pair_data", "sim"), backend=None)
        + 'layer { name: "slice" type: "Slice" bottom: "pair_data" top: "data" top: "data_p" '
          'slice_param { slice_dim: 1 slice_point: 1 } }\n'
        + tower.format(s="", b="data") + tower.format(s="_p", b="data_p")
        + 'layer { name: "loss" type: "ContrastiveLoss" bottom: "feat" bottom: "feat_p" bottom: "sim" '
          'top: "loss" contrastive_loss_param { margin: 1 } }\n')
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.05 momentum: 0.9 '
                                              'lr_policy: "fixed" max_iter: 1000 display: 0 '
                                              'snapshot_after_train: false random_seed: 3\n')
    solver = caffepy.get_solver("solver.prototxt")
    assert solver.net.params["ip"][0] is solver.net.params["ip_p"][0]    # one weight blob
    first = [float(solver.net.forward()["loss"]) for _ in range(10)]    # untrained, 10 batches
    solver.step(150)
    last = []
    for _ in range(10):
        solver.step(1)
        last.append(float(solver.net.blobs["loss"].data))
    assert np.mean(last) < 0.1 * np.mean(first), (first, last)
    solver.net.layers[0].close()


@pytest.mark.parametrize("backend", ["lmdb", "leveldb"])
def test_a_writer_its_caller_never_held_is_aborted_on_ctrl_c(tmp_path, backend):
    # a Ctrl-C between open_writer's return and the caller's `with` (or list append) left its
    # temporary database behind (CI, split_db); the command line's handler aborts such writers
    orphan = open_writer(tmp_path / "orphan", backend)
    orphan.put(b"k", b"v")
    with open_writer(tmp_path / "kept", backend) as w:
        w.put(b"k", b"v")
    assert os.path.isdir(orphan.tmp)
    abort_unfinished()
    assert sorted(os.listdir(tmp_path)) == ["kept"]
    assert db_records(tmp_path / "kept") == [("k", b"v")]
