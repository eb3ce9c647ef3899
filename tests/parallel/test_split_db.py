"""split_db: shards `<prefix>_<r>` hold records r, r+N, ... under their original keys."""
import os

import lmdb
import pytest

from caffepy.errors import DataError
from caffepy.parallel.split_db import split_db


def make_lmdb(path, n):
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(f"{i:08d}".encode(), f"value-{i}".encode() * (i % 7 + 1))
    env.close()


def read_lmdb(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        items = list(txn.cursor())
    env.close()
    return items


@pytest.mark.parametrize("n,shards", [(10, 3), (2500, 4), (5, 1), (3, 5)])
def test_shards_interleave_every_record_once(tmp_path, n, shards):
    src = tmp_path / "train_lmdb"
    make_lmdb(src, n)
    paths = split_db(str(src), shards, str(tmp_path / "part"))
    assert paths == [str(tmp_path / f"part_{r}") for r in range(shards)]
    original = read_lmdb(src)
    for r, path in enumerate(paths):
        assert read_lmdb(path) == original[r::shards]
    assert sum(len(read_lmdb(p)) for p in paths) == n


def test_default_prefix_is_the_input(tmp_path):
    src = tmp_path / "db"
    make_lmdb(src, 4)
    split_db(str(src) + "/", 2)
    assert os.path.isdir(tmp_path / "db_0") and os.path.isdir(tmp_path / "db_1")


def test_existing_output_is_refused(tmp_path):
    src = tmp_path / "db"
    make_lmdb(src, 4)
    (tmp_path / "db_1").mkdir()
    with pytest.raises(DataError, match="db_1: split_db: output already exists"):
        split_db(str(src), 2)


def test_missing_input(tmp_path):
    with pytest.raises(DataError, match="input database not found"):
        split_db(str(tmp_path / "nope"), 2)


def test_cli_split_db(tmp_path):
    from click.testing import CliRunner
    from caffepy.cli import main
    src = tmp_path / "db"
    make_lmdb(src, 7)
    result = CliRunner().invoke(main, ["split_db", str(src), "3", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    assert [len(read_lmdb(tmp_path / f"s_{r}")) for r in range(3)] == [3, 2, 2]
