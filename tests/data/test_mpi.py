"""Shared-DB with shuffle on real ranks seeded differently (as the solver seeds them,
random_seed + rank): the ranks still agree on each epoch's permutation, so the union
of their k-th batches is one rank's k-th batch of the global size."""
import os
import subprocess
import sys
import textwrap

import pytest

from data_helpers import make_db

from paths import REPO
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")]

READER = textwrap.dedent("""
    import sys
    from google.protobuf import text_format
    from caffepy.parallel import mpi, world
    mpi.init_world()
    from caffepy import log, rng
    log.set_quiet(True)
    from caffepy.net import Net, TRAIN
    from caffepy.proto import caffe_pb2
    source, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng.seed(7 + world.rank)
    param = text_format.Parse(f'''
        layer {{ name: "data" type: "Data" top: "data" top: "label"
                 data_param {{ source: "{source}" batch_size: {batch} backend: LMDB shuffle: true }} }}''',
        caffe_pb2.NetParameter())
    net = Net(param, phase=TRAIN, context=world)
    seen = []
    for _ in range(steps):
        net.forward()
        seen.append([int(v) for v in net.blobs["label"].data])
    everything = world.comm.gather(seen, root=0) if world.comm is not None else [seen]
    if world.rank == 0:
        print(repr(everything))
    mpi.finish()
""")


def run(tmp_path, ranks, db, batch, steps):
    script = tmp_path / "reader.py"
    script.write_text(READER)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = ([MPIEXEC, "-n", str(ranks)] if ranks > 1 else []) + [sys.executable, str(script), db,
                                                                 str(batch), str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return eval(out.stdout.strip().splitlines()[-1])


def test_shuffled_shared_db_agrees_across_differently_seeded_ranks(tmp_path):
    db = make_db(tmp_path / "db", 13)                 # 13 records: batches straddle epochs
    single = run(tmp_path, 1, db, 4, 6)[0]
    per_rank = run(tmp_path, 2, db, 2, 6)
    for k in range(6):
        assert sorted(per_rank[0][k] + per_rank[1][k]) == sorted(single[k])
    flat = [lab for batch in single for lab in batch]
    assert sorted(flat[:13]) == list(range(13)) and flat[:13] != list(range(13))
