"""caffepy extract_features, Caffe's tools/extract_features: every item's values of the named
blobs of a TEST net, a Datum of float_data each, into new LMDBs keyed by the item's index."""
import os

import numpy as np
import pytest
from click.testing import CliRunner

import caffepy
from caffepy import actions, log
from caffepy.cli import main
from caffepy.proto import caffe_pb2
from data_helpers import data_net_text, db_records, make_db

IP = ('layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param {'
      ' num_output: 3 weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "constant" value: 0.5 } } }\n'
      'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param {'
      ' num_output: 2 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }\n')


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A net reading 5 records (pixels = record index) in batches of 2, and its weights."""
    monkeypatch.chdir(tmp_path)
    make_db(tmp_path / "db", 5, shape=(1, 2, 3))
    (tmp_path / "net.prototxt").write_text('name: "f"\n' + data_net_text(str(tmp_path / "db"), 2) + IP)
    net = caffepy.Net(str(tmp_path / "net.prototxt"), caffepy.TEST)
    net.save(str(tmp_path / "w.caffemodel"))
    return tmp_path, net


def test_each_item_of_each_blob_is_a_float_datum_keyed_by_its_index(job):
    tmp_path, net = job
    w, b = net.params["ip"][0].data, net.params["ip"][1].data
    wc = net.params["conv"][0].data.reshape(2, 1)
    result = CliRunner().invoke(main, ["extract_features", "w.caffemodel", "net.prototxt", "ip,conv",
                                       "ip_db,conv_db", "3", "lmdb", "CPU"])
    assert result.exit_code == 0, result.output
    ip, conv = db_records(tmp_path / "ip_db"), db_records(tmp_path / "conv_db")
    # 3 batches of 2 from 5 records: the Data layer wraps around to record 0
    assert [k for k, _ in ip] == [f"{i:010d}" for i in range(6)] == [k for k, _ in conv]
    for i, ((_, a), (_, c)) in enumerate(zip(ip, conv)):
        pixel = float(i % 5)
        d = caffe_pb2.Datum.FromString(a)
        assert (d.channels, d.height, d.width) == (3, 1, 1) and not d.data and not d.HasField("label")
        np.testing.assert_allclose(d.float_data, w @ np.full(6, pixel) + b, rtol=1e-5, atol=1e-6)
        d = caffe_pb2.Datum.FromString(c)
        assert (d.channels, d.height, d.width) == (2, 2, 3)
        np.testing.assert_allclose(np.reshape(d.float_data, (2, 6)), np.broadcast_to(wc * pixel, (2, 6)),
                                   rtol=1e-5, atol=1e-6)
        # the same bytes as protobuf's own serialization of that Datum
        again = caffe_pb2.Datum(channels=2, height=2, width=3)
        again.float_data.extend(d.float_data)
        assert again.SerializeToString() == c


def test_bad_arguments_are_one_line_errors_and_leave_no_database(job):
    tmp_path, _ = job
    run = lambda *args: CliRunner().invoke(main, ["extract_features", "w.caffemodel", "net.prototxt", *args])
    for args, words in [(("ip,conv", "a", "1", "lmdb"), "number of blob names (2"),
                        (("nope", "a", "1", "lmdb"), "unknown feature blob name 'nope'"),
                        (("ip", "a", "1", "hdf5"), "'hdf5' is not a database type"),
                        (("ip", "a", "x", "lmdb"), "'x' is not a valid integer")]:
        result = run(*args)
        assert result.exit_code != 0 and words in result.output and "Traceback" not in result.output, \
            (args, result.output)
        assert not os.path.exists(tmp_path / "a")
    os.mkdir(tmp_path / "taken")
    result = run("ip", "taken", "1", "lmdb")
    assert result.exit_code != 0 and "already exists" in result.output
    assert os.listdir(tmp_path / "taken") == []


def test_a_failure_on_the_second_database_removes_the_first(job):
    tmp_path, _ = job
    with pytest.raises(caffepy.errors.UsageError, match="0 or more"):
        actions.extract_features("w.caffemodel", "net.prototxt", "ip", "first", -1)
    os.mkdir(tmp_path / "second")
    with pytest.raises(caffepy.errors.DataError, match="already exists"):
        actions.extract_features("w.caffemodel", "net.prototxt", "ip,conv", "first,second", 1)
    assert not os.path.exists(tmp_path / "first")


def test_gpu_is_noted_and_the_cpu_used(job, capsys):
    log.set_quiet(False)
    try:
        result = CliRunner().invoke(main, ["extract_features", "w.caffemodel", "net.prototxt", "ip", "g",
                                           "1", "lmdb", "GPU", "1"])
    finally:
        log.set_quiet(True)
    assert result.exit_code == 0 and len(db_records(job[0] / "g")) == 2
    assert "ignoring --gpu 1" in result.output + capsys.readouterr().err


BRANCHES = "".join(
    f'layer {{ name: "{n}" type: "Convolution" bottom: "data" top: "{n}" convolution_param {{'
    f' num_output: {o} kernel_size: {k} pad: {k // 2} weight_filler {{ type: "gaussian" std: 0.3 }}'
    f' bias_filler {{ type: "constant" value: -0.1 }} }} }}\n'
    f'layer {{ name: "{n}_relu" type: "ReLU" bottom: "{n}" top: "{n}" }}\n'
    for n, o, k in (("b1", 5, 1), ("b3", 4, 3))) + (
    'layer { name: "cat" type: "Concat" bottom: "b1" bottom: "b3" top: "cat" }\n')


def test_a_blob_the_fused_net_leaves_unwritten_is_extracted_from_the_layers(tmp_path,
                                                                            monkeypatch, capfd):
    """A branch written straight into a concat's top is not written by the fused TEST net
    (net.unwritten_blobs): asked for, the features come from the net whose layers write it,
    as CAFFEPY_FOLD=0 builds it, and a line says so."""
    monkeypatch.chdir(tmp_path)
    make_db(tmp_path / "db", 4, shape=(16, 5, 5))
    (tmp_path / "net.prototxt").write_text('name: "b"\n' + data_net_text(str(tmp_path / "db"), 2)
                                           + BRANCHES)
    net = caffepy.Net(str(tmp_path / "net.prototxt"), caffepy.TEST)
    assert net.unwritten_blobs() == ["b1", "b3"]
    net.save(str(tmp_path / "w.caffemodel"))
    log.set_quiet(False)
    try:
        assert actions.extract_features("w.caffemodel", "net.prototxt", "b1,cat", "b1_db,cat_db",
                                        2) == [4, 4]
    finally:
        log.set_quiet(True)
    assert "b1 not written by the fused TEST net" in capfd.readouterr().err
    monkeypatch.setenv("CAFFEPY_FOLD", "0")
    plain = caffepy.Net(str(tmp_path / "net.prototxt"), caffepy.TEST, weights="w.caffemodel")
    want = {"b1": [], "cat": []}
    for _ in range(2):
        plain.forward()
        for name in want:
            want[name].extend(plain.blobs[name].data.reshape(2, -1).copy())
    for name in want:
        got = [caffe_pb2.Datum.FromString(v).float_data for _, v in db_records(tmp_path / f"{name}_db")]
        np.testing.assert_allclose(np.array(got), np.array(want[name]), rtol=1e-5, atol=1e-6)
