"""convert_imageset and compute_image_mean, read back with plain lmdb + caffe_pb2 (as any
Caffe-schema reader would), and through the CLI."""
import os

import cv2
import lmdb
import numpy as np
import pytest
from click.testing import CliRunner

from caffepy import log
from caffepy.cli import main
from caffepy.data import tools
from caffepy.errors import DataError
from caffepy.proto import caffe_pb2


@pytest.fixture
def images(tmp_path):
    """Five 6x7 colour PNGs and a JPEG of another size; a list naming a missing file too."""
    root = tmp_path / "img"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for i in range(5):
        name = f"sub/a{i}.png"
        arrays[name] = rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)
        cv2.imwrite(str(root / name), arrays[name])
    lines = [f"{name} {i % 3}" for i, name in enumerate(arrays)]
    lines.insert(2, "sub/missing.png 1")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    return tmp_path, arrays


def read_plain(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        out = []
        for key, value in txn.cursor():
            d = caffe_pb2.Datum()
            d.ParseFromString(value)
            out.append((key.decode(), d))
    env.close()
    return out


def test_convert_raw_keys_labels_and_pixels(images):
    tmp, arrays = images
    n = tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db"))
    assert n == 5
    records = read_plain(tmp / "db")
    # Caffe's key: the line number over every line (the missing file keeps its number), then the path
    assert [k for k, _ in records] == ["00000000_sub/a0.png", "00000001_sub/a1.png",
                                       "00000003_sub/a2.png", "00000004_sub/a3.png",
                                       "00000005_sub/a4.png"]
    key, d = records[2]
    assert (d.channels, d.height, d.width, d.label, d.encoded) == (3, 6, 7, 2, False)
    want = arrays["sub/a2.png"].transpose(2, 0, 1)            # BGR, C x H x W
    assert d.data == want.tobytes()


def test_convert_gray_resized(images):
    tmp, arrays = images
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db"), gray=True,
                           resize_width=4, resize_height=3)
    _, d = read_plain(tmp / "db")[0]
    assert (d.channels, d.height, d.width) == (1, 3, 4)
    gray = cv2.imread(str(tmp / "img" / "sub/a0.png"), cv2.IMREAD_GRAYSCALE)
    want = cv2.resize(gray, (4, 3), interpolation=cv2.INTER_LINEAR)
    assert d.data == want.tobytes()


def test_convert_encoded_keeps_file_bytes_or_reencodes(images):
    tmp, arrays = images
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db"), encoded=True)
    _, d = read_plain(tmp / "db")[0]
    assert d.encoded and d.label == 0
    assert d.data == (tmp / "img" / "sub/a0.png").read_bytes()
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db2"), encoded=True,
                           encode_type="jpg")
    _, d = read_plain(tmp / "db2")[0]
    assert d.encoded and d.data[:2] == b"\xff\xd8"             # a JPEG now


def test_convert_shuffle_keeps_every_image(images):
    tmp, arrays = images
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db"), shuffle=True)
    keys = [k for k, _ in read_plain(tmp / "db")]
    # line numbers count the shuffled list, so the names come in a new order
    assert sorted(k.split("_", 1)[1] for k in keys) == sorted(arrays)
    assert len({k.split("_", 1)[0] for k in keys}) == 5


def test_convert_errors(images):
    tmp, _ = images
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db"))
    with pytest.raises(DataError, match="db: database already exists"):
        tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db"))
    with pytest.raises(DataError, match="nolist.txt: cannot read the list file"):
        tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "nolist.txt"), str(tmp / "db3"))
    (tmp / "bad.txt").write_text("sub/a0.png zero\n")
    with pytest.raises(DataError, match=r"bad.txt:1: expected '<image path> <integer label>'"):
        tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "bad.txt"), str(tmp / "db4"))
    cv2.imwrite(str(tmp / "img" / "big.png"), np.zeros((9, 9, 3), np.uint8))
    (tmp / "mixed.txt").write_text("sub/a0.png 0\nbig.png 1\n")
    with pytest.raises(DataError, match=r"key '00000001_big.png': image size 3x9x9 differs from the "
                                        r"first image's 3x6x7"):
        tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "mixed.txt"), str(tmp / "db5"),
                               check_size=True)


def test_compute_image_mean(images, capsys):
    tmp, arrays = images
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db"))
    log.set_quiet(False)
    mean = tools.compute_image_mean(str(tmp / "db"), str(tmp / "mean.binaryproto"))
    err = capsys.readouterr().err
    want = np.mean([a.transpose(2, 0, 1).astype(np.float64) for a in arrays.values()], axis=0)
    np.testing.assert_allclose(mean, want, rtol=1e-6)
    bp = caffe_pb2.BlobProto()
    bp.ParseFromString((tmp / "mean.binaryproto").read_bytes())
    assert (bp.num, bp.channels, bp.height, bp.width) == (1, 3, 6, 7)      # Caffe's legacy fields
    np.testing.assert_allclose(np.array(bp.data).reshape(3, 6, 7), want, rtol=1e-6)
    assert "Number of channels: 3" in err
    assert f"mean_value channel [0]: {want[0].mean():g}" in err


def test_compute_image_mean_of_encoded_db_matches_raw(images):
    tmp, _ = images
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "raw"))
    tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "enc"), encoded=True)
    np.testing.assert_allclose(tools.compute_image_mean(str(tmp / "raw")),
                               tools.compute_image_mean(str(tmp / "enc")), rtol=1e-6)


def test_compute_image_mean_errors(tmp_path):
    with pytest.raises(DataError, match="nope: no such database"):
        tools.compute_image_mean(str(tmp_path / "nope"))
    from data_helpers import make_db, put_raw
    db = make_db(tmp_path / "db", 3)
    put_raw(db, "00000001", b"\x0a\xff")
    with pytest.raises(DataError, match="key '00000001': corrupt or truncated Datum"):
        tools.compute_image_mean(db)


def test_cli_convert_and_mean(images):
    tmp, _ = images
    runner = CliRunner()
    res = runner.invoke(main, ["convert_imageset", "-resize_height=4", "-resize_width=5", "-gray",
                               str(tmp / "img") + "/", str(tmp / "list.txt"), str(tmp / "db")])
    assert res.exit_code == 0, res.output
    assert read_plain(tmp / "db")[0][1].height == 4
    res = runner.invoke(main, ["compute_image_mean", str(tmp / "db"), str(tmp / "m.binaryproto")])
    assert res.exit_code == 0, res.output
    assert os.path.getsize(tmp / "m.binaryproto") > 0
    res = runner.invoke(main, ["compute_image_mean", str(tmp / "missing_db")])
    assert res.exit_code == 1
    assert res.output.strip().splitlines()[-1].startswith("caffepy: error: ")
    assert "missing_db: no such database" in res.output


def test_failed_convert_leaves_nothing_and_the_rerun_succeeds(images):
    tmp, arrays = images
    cv2.imwrite(str(tmp / "img" / "big.png"), np.zeros((9, 9, 3), np.uint8))
    (tmp / "mixed.txt").write_text("sub/a0.png 0\nsub/a1.png 1\nbig.png 1\n")
    before = sorted(os.listdir(tmp))
    with pytest.raises(DataError, match="differs from the first image's"):
        tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "mixed.txt"), str(tmp / "db"),
                               check_size=True)
    assert sorted(os.listdir(tmp)) == before          # neither db nor a temporary directory
    assert tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "mixed.txt"), str(tmp / "db")) == 3
    assert len(read_plain(tmp / "db")) == 3
    assert sorted(os.listdir(tmp)) == sorted(before + ["db"])


def test_split_db_failure_leaves_no_shard(tmp_path):
    from caffepy.parallel.split_db import split_db
    from data_helpers import make_db
    db = make_db(tmp_path / "db", 30, shape=(3, 32, 32))
    data = tmp_path / "db" / "data.mdb"
    data.write_bytes(data.read_bytes()[:-4096])
    with pytest.raises(DataError, match=r"data.mdb: damaged LMDB: truncated"):
        split_db(db, 3, str(tmp_path / "part"))
    assert sorted(os.listdir(tmp_path)) == ["db"]


def test_a_killed_convert_leaves_a_temporary_that_the_rerun_removes(images, tmp_path):
    """kill -9 mid-write leaves the hidden `.db.<pid>@<host>.*.tmp` LMDB; running the tool
    again for the same output removes it (and leaves another output's alone)."""
    import signal
    import subprocess
    import sys
    import time
    tmp, _ = images
    (tmp / "long.txt").write_text("".join(f"sub/a{i % 5}.png {i % 3}\n" for i in range(200000)))
    (tmp / ".other.99999999@elsewhere.abcdefgh.tmp").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "caffepy.cli", "convert_imageset", str(tmp / "img") + "/",
                             str(tmp / "long.txt"), "db"], cwd=tmp, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not [p for p in os.listdir(tmp) if p.startswith(".db.")] and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [p for p in os.listdir(tmp) if p.startswith(".db.")]
    assert len(left) == 1 and left[0].startswith(f".db.{proc.pid}@") and not (tmp / "db").exists()
    (tmp / "short.txt").write_text("sub/a0.png 0\n")
    assert tools.convert_imageset(str(tmp / "img") + "/", str(tmp / "short.txt"), str(tmp / "db")) == 1
    assert sorted(p for p in os.listdir(tmp) if p.startswith(".")) == [".other.99999999@elsewhere.abcdefgh.tmp"]


def test_raw_records_are_byte_for_byte_caffes(tmp_path):
    # BVLC convert_imageset's record for this 1x2 BGR PNG, label 1 (read from its LMDB):
    # channels, height, width, data (C x H x W), label, and encoded: false (field 7 = 0)
    (tmp_path / "img").mkdir()
    cv2.imwrite(str(tmp_path / "img" / "a.png"), np.array([[[1, 2, 3], [4, 5, 6]]], np.uint8))
    (tmp_path / "list.txt").write_text("a.png 1\n")
    tools.convert_imageset(str(tmp_path / "img") + "/", str(tmp_path / "list.txt"), str(tmp_path / "db"))
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(b"00000000_a.png") == bytes.fromhex("08031001180222060104020503062801" "3800")
    env.close()
    assert oct(os.stat(tmp_path / "db").st_mode & 0o777) == oct(0o744 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- convert_mnist_data / convert_cifar_data --------------------------------------------------
def _mnist_files(tmp_path, n=7, rows=4, cols=3, gz=False, magic=(2051, 2049), labels=None):
    import gzip
    gen = np.random.default_rng(5)
    images = gen.integers(0, 256, (n, rows, cols), dtype=np.uint8)
    labels = gen.integers(0, 10, n, dtype=np.uint8) if labels is None else np.asarray(labels, np.uint8)
    blobs = {"img": np.array([magic[0], n, rows, cols], ">u4").tobytes() + images.tobytes(),
             "lab": np.array([magic[1], len(labels)], ">u4").tobytes() + labels.tobytes()}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(gzip.compress(data) if gz else data)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_convert_mnist_data_writes_caffes_keys_and_datums(tmp_path, gz):
    images, labels = _mnist_files(tmp_path, gz=gz, labels=[0, 9, 3, 200, 1, 2, 5])
    result = CliRunner().invoke(main, ["convert_mnist_data", str(tmp_path / "img"), str(tmp_path / "lab"),
                                       str(tmp_path / "db")])
    assert result.exit_code == 0, result.output
    records = read_plain(tmp_path / "db")
    assert [k for k, _ in records] == [f"{i:08d}" for i in range(7)]
    for (_, d), image, label in zip(records, images, labels):
        assert (d.channels, d.height, d.width) == (1, 4, 3) and not d.HasField("encoded")
        assert d.data == image.tobytes() and d.label == (int(label) if label < 128 else int(label) - 256)
    assert records[3][1].label == -56                                  # a signed char, as Caffe


def test_convert_mnist_data_errors(tmp_path):
    def run(*args):
        return CliRunner().invoke(main, ["convert_mnist_data", *map(str, args), str(tmp_path / "db")])
    _mnist_files(tmp_path, magic=(2049, 2049))
    result = run(tmp_path / "img", tmp_path / "lab")
    assert result.exit_code == 1 and "not an MNIST image file (magic number 2049, expected 2051)" in result.output
    _mnist_files(tmp_path, labels=[1, 2])
    result = run(tmp_path / "img", tmp_path / "lab")
    assert result.exit_code == 1 and "holds 7 images but" in result.output and "2 labels" in result.output
    _mnist_files(tmp_path)
    (tmp_path / "img").write_bytes((tmp_path / "img").read_bytes()[:-5])
    result = run(tmp_path / "img", tmp_path / "lab")
    assert result.exit_code == 1 and "ends before its 7 items" in result.output
    result = run(tmp_path / "nothing", tmp_path / "lab")
    assert result.exit_code == 1 and "nothing: no such file" in result.output
    assert not (tmp_path / "db").exists() and "Traceback" not in result.output


def test_convert_cifar_data_writes_both_databases_as_caffe(tmp_path):
    gen = np.random.default_rng(6)
    (tmp_path / "in").mkdir()
    expected = {"train": [], "test": []}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        records = np.concatenate([gen.integers(0, 10, (3, 1), dtype=np.uint8),
                                  gen.integers(0, 256, (3, 3072), dtype=np.uint8)], axis=1)
        (tmp_path / "in" / name).write_bytes(records.tobytes())
        expected["test" if name == "test_batch.bin" else "train"].extend(records)
    (tmp_path / "out").mkdir()
    result = CliRunner().invoke(main, ["convert_cifar_data", str(tmp_path / "in"), str(tmp_path / "out"), "lmdb"])
    assert result.exit_code == 0, result.output
    for part in ("train", "test"):
        records = read_plain(tmp_path / "out" / f"cifar10_{part}_lmdb")
        assert [k for k, _ in records] == [f"{i:05d}" for i in range(len(expected[part]))]
        for (_, d), record in zip(records, expected[part]):
            assert (d.channels, d.height, d.width, d.label) == (3, 32, 32, record[0])
            assert d.data == record[1:].tobytes()
    # a second run refuses before writing anything; a torn batch file is refused too
    result = CliRunner().invoke(main, ["convert_cifar_data", str(tmp_path / "in"), str(tmp_path / "out"), "lmdb"])
    assert result.exit_code == 1 and "cifar10_train_lmdb: database already exists" in result.output
    (tmp_path / "in" / "test_batch.bin").write_bytes(b"\0" * 100)
    result = CliRunner().invoke(main, ["convert_cifar_data", str(tmp_path / "in"), str(tmp_path / "o2"), "lmdb"])
    assert result.exit_code == 1 and "test_batch.bin: 100 bytes is not a whole number" in result.output
    assert not (tmp_path / "o2").exists()


# -- resize_and_crop_images: Caffe's tools/extra script ----------------------------------------------

def test_resize_and_crop_scales_the_short_side_then_takes_the_centre():
    # a 40 x 100 image in five vertical bands of 20 columns: side 16 scales it to 16 x 40
    # (40 = 16 * 100 // 40) and keeps columns 12..27, the middle band and a little of each side
    bands = np.repeat(np.arange(5, dtype=np.uint8) * 50, 20)[None, :, None].repeat(40, 0).repeat(3, 2)
    out = tools.resize_and_crop_image(bands, 16)
    expected = cv2.resize(bands, (40, 16), interpolation=cv2.INTER_LINEAR)[:, 12:28]
    assert out.shape == (16, 16, 3)
    np.testing.assert_array_equal(out, expected)
    assert (out[:, 4:12] == 100).all()        # the middle band fills the centre
    # tall images crop rows; Python 2's integer division rounds the long side down
    tall = np.zeros((101, 30, 3), np.uint8)
    tall[50] = 255
    assert tools.resize_and_crop_image(tall, 10).shape == (10, 10, 3)
    assert tools.resize_and_crop_image(tall, 10)[4:6].max() > 0


def test_resize_and_crop_images_command(images, tmp_path):
    root = str(tmp_path / "img")
    cv2.imwrite(os.path.join(root, "wide.jpg"), np.full((30, 60, 3), 128, np.uint8))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["resize_and_crop_images", f"--input_folder={root}",
                                       f"--output_folder={out}", "--output_side_length=4"])
    assert result.exit_code == 0, result.output
    written = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    assert written == [f"sub/a{i}.png" for i in range(5)] + ["wide.jpg"]
    for name in written:
        assert cv2.imread(str(out / name)).shape == (4, 4, 3)
    source = cv2.imread(os.path.join(root, "sub/a3.png"))          # 6 x 7: 4 x 4 (4 * 7 // 6 = 4)
    np.testing.assert_array_equal(cv2.imread(str(out / "sub/a3.png")), tools.resize_and_crop_image(source, 4))
    # a list (convert_imageset's, labels and a missing file too): only its images, the missing one warned
    listed = tmp_path / "listed"
    result = CliRunner().invoke(main, ["resize_and_crop_images", "--input_folder", root, "--output_folder",
                                       str(listed), "--input", str(tmp_path / "list.txt"), "--num_clients", "2"])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(listed / "sub")) == [f"a{i}.png" for i in range(5)]
    assert "Skipped 1 of" in result.output and "missing.png" in result.output
    result = CliRunner().invoke(main, ["resize_and_crop_images", "--output_folder", str(listed),
                                       "--image_lib", "pil"])
    assert result.exit_code == 2
