"""The Data layer's reader and prefetcher: every record once per epoch, shuffle,
shared-DB interleave and split-DB shards across ranks, errors from the prefetch thread."""
import contextlib
import os
import threading

import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng
from caffepy.context import SINGLE, RunContext
from caffepy.data.db import open_reader
from caffepy.data.prefetch import RecordOrder
from caffepy.errors import DataError
from caffepy.net import Net
from caffepy.proto import caffe_pb2
from data_helpers import data_net_text, make_db, put_raw

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def build(text, phase=TRAIN, seed=5, context=SINGLE):
    rng.seed(seed)
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return Net(p, phase=phase, source="net.prototxt", context=context)


def labels_read(net, batches):
    out = []
    for _ in range(batches):
        net.forward()
        out.extend(int(v) for v in net.blobs["label"].data)
    return out


def test_record_order_every_record_once_per_epoch():
    for shuffle in (False, True):
        order = RecordOrder(10, shuffle=shuffle, seed=3)
        reads = [order.index(i) for i in range(30)]
        for e in range(3):
            assert sorted(reads[10 * e:10 * e + 10]) == list(range(10))
        assert (reads[:10] != reads[10:20]) == shuffle    # a new permutation each epoch


def test_record_order_ranks_partition_the_single_rank_stream():
    for shuffle in (False, True):
        single = RecordOrder(7, shuffle=shuffle, seed=9, skip=2)
        ranks = [RecordOrder(7, r, 3, shuffle=shuffle, seed=9, skip=2) for r in range(3)]
        b = 2                           # local batch; the single rank reads 3 * b per batch
        for k in range(6):
            union = sorted(o.index(i) for o in ranks for i in range(k * b, k * b + b))
            want = sorted(single.index(i) for i in range(3 * b * k, 3 * b * (k + 1)))
            assert union == want


def test_data_layer_reads_every_record_once_per_epoch_with_wraparound(tmp_path):
    db = make_db(tmp_path / "db", 10)
    net = build(data_net_text(db, 4))
    labels = labels_read(net, 5)                  # 20 reads = 2 epochs of 10, batches straddle
    assert labels == list(range(10)) * 2
    data = net.blobs["data"].data
    assert data.shape == (4, 1, 2, 3)
    np.testing.assert_array_equal(data[:, 0, 0, 0], labels[-4:])   # pixels follow the label
    assert net.layers[0].wait_seconds >= 0


def test_data_layer_shuffle_is_a_permutation_per_epoch_and_seeded(tmp_path):
    db = make_db(tmp_path / "db", 10)
    text = data_net_text(db, 3, "shuffle: true")
    labels = labels_read(build(text, seed=11), 10)        # 30 reads = 3 epochs
    for e in range(3):
        assert sorted(labels[10 * e:10 * e + 10]) == list(range(10))
    assert labels[:10] != list(range(10))
    assert labels_read(build(text, seed=11), 10) == labels          # same seed, same order
    assert labels_read(build(text, seed=12), 10) != labels


def test_rand_skip_starts_later_and_wraps(tmp_path):
    db = make_db(tmp_path / "db", 10)
    labels = labels_read(build(data_net_text(db, 5, "rand_skip: 10"), seed=1), 2)
    start = labels[0]
    assert labels == [(start + i) % 10 for i in range(10)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_shared_db_ranks_together_read_the_single_rank_batches(tmp_path, shuffle):
    db = make_db(tmp_path / "db", 11)               # not a multiple of any batch
    extra = "shuffle: true" if shuffle else ""
    n, b, k = 3, 2, 8
    single = labels_read(build(data_net_text(db, n * b, extra), seed=4), k)
    per_rank = []
    for r in range(n):
        per_rank.append(labels_read(build(data_net_text(db, b, extra), seed=4, context=RunContext(r, n)), k))
    for j in range(k):
        union = sorted(lab for r in range(n) for lab in per_rank[r][j * b:(j + 1) * b])
        assert union == sorted(single[j * n * b:(j + 1) * n * b])
    # one epoch's worth of reads across the ranks covers every record exactly once
    # (rank r's i-th read is global position i * n + r)
    epoch0 = [per_rank[r][i] for r in range(n) for i in range(k * b) if i * n + r < 11]
    assert sorted(epoch0) == list(range(11))
    if not shuffle:
        assert per_rank[1][:4] == [1, 4, 7, 10]      # rank r reads r, r+N, r+2N, ...


def test_split_db_rank_placeholder_reads_own_shard(tmp_path):
    make_db(tmp_path / "shard_0", 4)
    make_db(tmp_path / "shard_1", 6, shape=(1, 1, 1))
    text = data_net_text(str(tmp_path / "shard_{rank}"), 3)
    net = build(text, context=RunContext(1, 2))
    assert labels_read(net, 2) == list(range(6))      # the whole shard, no interleave
    assert net.blobs["data"].data.shape == (3, 1, 1, 1)


def test_label_top_is_optional_and_encoded_records_decode(tmp_path):
    vals = [np.full((3, 4, 4), 10 * i, np.uint8) for i in range(5)]
    db = make_db(tmp_path / "db", 5, encoded=True, values=vals)
    net = build(data_net_text(db, 5, tops=("data",), transform="scale: 0.5"))
    net.forward()
    assert net.blobs["data"].data.shape == (5, 3, 4, 4)
    np.testing.assert_allclose(net.blobs["data"].data[:, 1, 2, 3], [0, 5, 10, 15, 20])


def test_corrupt_record_surfaces_from_the_prefetch_thread(tmp_path):
    db = make_db(tmp_path / "db", 6)
    put_raw(db, "00000003", b"\x0a\xff\xff\xff")
    net = build(data_net_text(db, 2))
    net.forward()
    with pytest.raises(DataError, match=r"db: key '00000003': corrupt or truncated Datum"):
        net.forward()
    with pytest.raises(DataError):            # and keeps failing the same way
        net.forward()


def test_record_with_another_shape_is_an_error(tmp_path):
    db = make_db(tmp_path / "db", 4)
    from caffepy.data.datum import array_to_datum
    put_raw(db, "00000002", array_to_datum(np.zeros((1, 3, 3), np.uint8), 2).SerializeToString())
    net = build(data_net_text(db, 4))
    with pytest.raises(DataError, match=r"key '00000002': image of shape 1x3x3 does not give the 1x2x3"):
        net.forward()


def test_missing_and_empty_database(tmp_path):
    with pytest.raises(DataError, match=r"^net.prototxt: layer 'data' \(Data\): data_param.source: "
                                        r"no such database, got .*nope$"):
        build(data_net_text(str(tmp_path / "nope"), 2))
    import lmdb
    lmdb.open(str(tmp_path / "empty")).close()
    with pytest.raises(DataError, match="data_param.source: the database is empty"):
        build(data_net_text(str(tmp_path / "empty"), 2))


def test_crop_larger_than_image_names_layer_and_record(tmp_path):
    db = make_db(tmp_path / "db", 3)
    with pytest.raises(DataError, match=r"layer 'data' \(Data\): transform_param.crop_size: larger than "
                                        r"the image \(2x3\), got 5 \(first record: .*db: key '00000000'\)"):
        build(data_net_text(db, 2, transform="crop_size: 5"))


def test_prefetch_threads_stop_on_close(tmp_path):
    db = make_db(tmp_path / "db", 8)
    net = build(data_net_text(db, 2))
    net.forward()
    thread = net.layers[0].prefetcher._thread
    assert thread.daemon and thread.is_alive()
    net.layers[0].close()
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t is thread]


def test_reader_random_access_matches_cursor_order(tmp_path):
    db = make_db(tmp_path / "db", 200)
    r = open_reader(db)
    assert len(r) == 200
    for i in [0, 1, 199, 5, 100, 101, 0, 150]:
        key, value = r.get(i)
        assert key == f"{i:08d}".encode()
    r.close()


def test_random_crops_and_mirrors_do_not_depend_on_the_decode_threads(tmp_path, monkeypatch):
    vals = [np.random.default_rng(i).integers(0, 256, (3, 9, 9), dtype=np.uint8) for i in range(12)]
    db = make_db(tmp_path / "db", 12, shape=(3, 9, 9), encoded=True, values=vals)
    text = data_net_text(db, 6, "shuffle: true", transform="crop_size: 5 mirror: true mean_value: 100")
    batches = {}
    for threads in ("1", "3"):
        monkeypatch.setenv("CAFFEPY_DATA_THREADS", threads)
        net = build(text, seed=21)
        assert net.layers[0].prefetcher.filler.threads == int(threads)
        out = []
        for _ in range(4):
            net.forward()
            out.append(net.blobs["data"].data.copy())
        batches[threads] = np.stack(out)
    np.testing.assert_array_equal(batches["1"], batches["3"])


def test_writer_grows_the_map_and_reader_refuses_non_databases(tmp_path, monkeypatch):
    from caffepy.data import db as dbmod
    monkeypatch.setattr(dbmod, "_INITIAL_MAP_SIZE", 1 << 20)
    with dbmod.open_writer(tmp_path / "big", commit_every=7) as w:
        for i in range(40):
            w.put(f"{i:04d}", bytes([i]) * 100_000)         # 4 MB through a 1 MB map
    r = open_reader(tmp_path / "big")
    assert len(r) == 40 and r.get(39)[1] == bytes([39]) * 100_000
    r.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="file: not a database"):
        open_reader(tmp_path / "file")


def test_writer_builds_under_a_temporary_name_and_leaves_nothing_on_failure(tmp_path):
    from caffepy.data import db as dbmod
    with dbmod.open_writer(tmp_path / "db") as w:
        w.put("a", b"1")
        w.commit()
        assert not (tmp_path / "db").exists()          # only the temporary directory so far
        assert [p.name.startswith(".db.") for p in tmp_path.iterdir()] == [True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]
    assert open_reader(tmp_path / "db").get(0) == (b"a", b"1")
    with pytest.raises(RuntimeError):
        with dbmod.open_writer(tmp_path / "db2") as w:
            w.put("a", b"1")
            raise RuntimeError("the tool failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]


@pytest.mark.parametrize("damage,message", [
    (lambda d: d[: len(d) // 2], r"data.mdb: damaged LMDB: truncated to \d+ bytes; its header says the data "
                                 r"reaches \d+ bytes"),
    (lambda d: d[:-4096], r"damaged LMDB: truncated"),
    (lambda d: bytes(len(d)), r"damaged LMDB: its header page is all zero bytes"),
    (lambda d: b"x" * len(d), r"data.mdb: not an LMDB file"),
    (lambda d: b"", r"damaged LMDB: the file is empty"),
])
def test_reader_checks_the_file_against_its_header_before_mapping_it(tmp_path, damage, message):
    db = make_db(tmp_path / "db", 24, shape=(3, 32, 32))
    data = tmp_path / "db" / "data.mdb"
    data.write_bytes(damage(data.read_bytes()))
    with pytest.raises(DataError, match=message):
        open_reader(db)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_reader_backs_the_map_past_the_file_with_zero_pages(tmp_path):
    # what keeps a damaged node from faulting (the corpus runs such files through the CLI)
    db = make_db(tmp_path / "db", 24, shape=(3, 32, 32))
    r = open_reader(db)
    assert r._entry.shielded
    assert len(list(r)) == 24 and r.get(23)[0] == b"00000023"
    r.close()
