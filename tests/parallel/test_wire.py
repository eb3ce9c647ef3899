"""The bfloat16 wire (CAFFEPY_MPI_WIRE_TYPE=bfloat16) over a real training run: LeNet on the
bundled digits, 2 ranks over the ring, against the float32 wire. It must be used (other
weights, bit for bit) and train as well (final loss and test accuracy within a tolerance)."""
import os
import re
import subprocess
import sys

import pytest

from mpi_helpers import MPIEXEC, REPO, make_lmdb, max_rel_diff, train, weights, write_job

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")

DIGITS = os.path.join(REPO, "examples", "digits")
ITERS = 200


def _caffepy(*args, cwd):
    out = subprocess.run([sys.executable, "-m", "caffepy.cli", *args], capture_output=True, text=True,
                         cwd=cwd, env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The demo's LMDBs and mean (examples/digits/run.sh), in a temporary directory."""
    work = tmp_path_factory.mktemp("digits")
    for split in ("train", "test"):
        _caffepy("convert_imageset", "--gray", "--resize_height", "16", "--resize_width", "16",
                 os.path.join(DIGITS, "images") + "/", os.path.join(DIGITS, f"{split}.txt"),
                 str(work / f"digits_{split}_lmdb"), cwd=work)
    _caffepy("compute_image_mean", str(work / "digits_train_lmdb"), str(work / "digits_mean.binaryproto"),
             cwd=work)
    return work


def lenet_job(directory, work, iters, local_batch):
    """The demo's net and solver: the given local batch (2 ranks x 32 = the demo's 64), a test
    of the whole test split at the end, a snapshot at the end."""
    directory.mkdir()
    with open(os.path.join(DIGITS, "lenet_train_test.prototxt")) as f:
        net = f.read().replace("examples/digits/work/", f"{work}/").replace("batch_size: 64",
                                                                            f"batch_size: {local_batch}")
    (directory / "net.prototxt").write_text(net)
    with open(os.path.join(DIGITS, "lenet_solver.prototxt")) as f:
        solver = f.read()
    solver = re.sub(r'net: ".*"', f'net: "{directory}/net.prototxt"', solver)
    solver = re.sub(r"max_iter: \d+", f"max_iter: {iters}", solver)
    solver = re.sub(r"test_interval: \d+", f"test_interval: {iters}", solver)
    solver = re.sub(r'snapshot_prefix: ".*"', f'snapshot_prefix: "{directory}/lenet"', solver)
    (directory / "solver.prototxt").write_text(solver)
    return directory


def train_lenet(job, wire, ranks=2):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", CAFFEPY_MPI_ALLREDUCE="ring",
               CAFFEPY_MPI_WIRE_TYPE=wire)
    out = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, "-m", "caffepy.cli", "train", "--solver",
                          str(job / "solver.prototxt")], capture_output=True, text=True, env=env, cwd=job,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\] Iteration \d+(?: \([^)]*\))?, loss = ([\d.e+-]+)", out.stderr)]
    accuracy = float(re.findall(r"Test net output #0: accuracy = ([\d.]+)", out.stderr)[-1])
    return out.stderr, losses, accuracy


def test_bfloat16_wire_trains_like_float32(tmp_path, digits):
    log32, loss32, acc32 = train_lenet(lenet_job(tmp_path / "f32", digits, ITERS, 32), "float32")
    log16, loss16, acc16 = train_lenet(lenet_job(tmp_path / "bf16", digits, ITERS, 32), "bfloat16")
    assert "algorithm: ring (2 ranks" in log32 and "on the wire" not in log32
    assert "bfloat16 on the wire" in log16
    w32 = weights(tmp_path / "f32" / f"lenet_iter_{ITERS}.caffemodel")
    w16 = weights(tmp_path / "bf16" / f"lenet_iter_{ITERS}.caffemodel")
    assert max_rel_diff(w32, w16) > 1e-4                 # the wire was used: other weights
    print(f"final loss {loss32[-1]:.4f} / {loss16[-1]:.4f}, test accuracy {acc32:.4f} / {acc16:.4f}")
    # the same learning: both fall far from the start (ln 10 = 2.3), end near each other
    assert loss32[-1] < 0.5 and loss16[-1] < 0.5
    assert abs(loss16[-1] - loss32[-1]) < 0.05 + 0.25 * loss32[-1]
    assert abs(acc16 - acc32) <= 0.02                    # 6 of the 296 test digits


def test_bfloat16_wire_between_emulated_hosts_and_refused_with_mpi(tmp_path):
    """4 ranks as 2 hosts of 2 (shared memory within a host, the bfloat16 ring between): close
    to 1 rank, not equal; with MPI's Allreduce (no bfloat16 sum) one line says why not."""
    db = make_lmdb(tmp_path / "db")
    single = write_job(tmp_path, "single", db, 12, 4)
    assert train(single).returncode == 0
    multi = write_job(tmp_path, "multi", db, 3, 4)
    out = train(multi, 4, env={"CAFFEPY_MPI_RANKS_PER_NODE": "2", "CAFFEPY_MPI_WIRE_TYPE": "bfloat16"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "algorithm: shm (2 ranks per host, 2 hosts, bfloat16 on the wire)" in out.stderr
    diff = max_rel_diff(weights(single / "snap_iter_4.caffemodel"), weights(multi / "snap_iter_4.caffemodel"))
    assert 1e-5 < diff < 0.05, diff
    refused = write_job(tmp_path, "refused", db, 6, 2)
    out = train(refused, 2, env={"CAFFEPY_MPI_ALLREDUCE": "mpi", "CAFFEPY_MPI_WIRE_TYPE": "bfloat16"})
    assert out.returncode == 1
    assert ("CAFFEPY_MPI_WIRE_TYPE: bfloat16 needs the ring or shm allreduce, got algorithm mpi (progress "
            "thread)") in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
