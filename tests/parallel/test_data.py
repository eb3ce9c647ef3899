"""Shared-DB and split-DB under real ranks: across the ranks, every record is
read exactly once per epoch, and the union of the ranks' k-th batches is the
k-th batch one rank with the global batch would read."""
import os
import subprocess
import sys
import textwrap

import pytest

from mpi_helpers import MPIEXEC, REPO, RECORDS, make_lmdb

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")

READER = """
    import sys
    import numpy as np
    from caffepy.parallel import mpi, world
    mpi.init_world()
    from caffepy import log
    log.set_quiet(True)
    from caffepy.net import Net, TRAIN
    from caffepy.proto import caffe_pb2
    from google.protobuf import text_format
    source, batch, epochs, shuffle = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    param = text_format.Parse(f'''
        name: "reader"
        layer {{ name: "data" type: "Data" top: "data" top: "label"
                 data_param {{ source: "{source}" batch_size: {batch} backend: LMDB shuffle: {shuffle} }} }}''',
        caffe_pb2.NetParameter())
    net = Net(param, phase=TRAIN, context=world)
    steps = epochs * {records} // (batch * world.size)
    seen = []
    for _ in range(steps):
        net.forward()
        seen.append(net.blobs["data"].data[:, 0, 0, 0].astype(int).tolist())
    everything = world.comm.gather(seen, root=0)
    if world.rank == 0:
        print(repr(everything))
    mpi.finish()
"""


def read_under_mpi(tmp_path, ranks, source, batch, epochs=2, shuffle=False):
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(READER.replace("{records}", str(RECORDS))))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    out = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, str(script), source, str(batch),
                          str(epochs), "true" if shuffle else "false"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return eval(out.stdout.strip().splitlines()[-1])


def check_epochs(per_rank, ranks, batch, epochs=2, shuffled=False):
    steps = len(per_rank[0])
    per_epoch = RECORDS // (batch * ranks)
    for e in range(epochs):
        records = [i for r in range(ranks) for k in range(e * per_epoch, (e + 1) * per_epoch)
                   for i in per_rank[r][k]]
        assert sorted(records) == list(range(RECORDS)), f"epoch {e}"
    for k in range(0 if shuffled else steps):
        union = sorted(i for r in range(ranks) for i in per_rank[r][k])
        start = (k % per_epoch) * batch * ranks
        assert union == list(range(start, start + batch * ranks))


@pytest.mark.parametrize("ranks", [2, 4])
def test_shared_db_reads_each_record_once_per_epoch(tmp_path, ranks):
    db = make_lmdb(tmp_path / "train_lmdb")
    per_rank = read_under_mpi(tmp_path, ranks, db, 4)
    check_epochs(per_rank, ranks, 4)
    assert per_rank[1][0] == [1 + ranks * j for j in range(4)]     # rank r reads r, r+N, ...


@pytest.mark.parametrize("ranks", [2, 4])
def test_split_db_reads_each_record_once_per_epoch(tmp_path, ranks):
    from caffepy.parallel.split_db import split_db
    db = make_lmdb(tmp_path / "train_lmdb")
    split_db(db, ranks, str(tmp_path / "shard"))
    per_rank = read_under_mpi(tmp_path, ranks, str(tmp_path / "shard_{rank}"), 4)
    check_epochs(per_rank, ranks, 4)
    shared = read_under_mpi(tmp_path, ranks, db, 4)
    assert per_rank == shared       # split-DB reads what shared-DB would


def test_shared_db_with_shuffle_reads_each_record_once_per_epoch(tmp_path):
    """Ranks agree on each epoch's permutation (no solver seed: the layer's seed is shared)."""
    db = make_lmdb(tmp_path / "train_lmdb")
    per_rank = read_under_mpi(tmp_path, 2, db, 4, shuffle=True)
    check_epochs(per_rank, 2, 4, shuffled=True)
    first = [i for r in range(2) for k in range(RECORDS // 8) for i in per_rank[r][k]]
    assert first != sorted(first)
