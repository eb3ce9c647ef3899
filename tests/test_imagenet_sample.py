"""`make imagenet-sample` (examples/imagenet/make_sample.py): generated ImageNet-shaped JPEGs
through caffepy convert_imageset / compute_image_mean at the paths the AlexNet models name;
and (slow) models/mpi_intel_alexnet and models/intel_alexnet training on it."""
import os
import re
import shutil
import subprocess
import sys

import cv2
import pytest

from caffepy.proto import caffe_pb2

from data_helpers import db_records
from paths import REPO
SCRIPT = os.path.join(REPO, "examples", "imagenet", "make_sample.py")
BIN = os.path.dirname(sys.executable)


def make_sample(root, *args):
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run([sys.executable, SCRIPT, "--root", str(root), *args], capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    result = make_sample(root, "--classes", "3", "--train", "4", "--val", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_sample_is_imagenet_shaped_at_the_models_paths(sample):
    base = sample / "examples" / "imagenet"
    train = (base / "sample" / "train.txt").read_text().splitlines()
    val = (base / "sample" / "val.txt").read_text().splitlines()
    assert len(train) == 12 and len(val) == 6
    assert re.fullmatch(r"n0000000\d/n0000000\d_\d+\.JPEG \d", train[0])
    assert re.fullmatch(r"ILSVRC2012_val_\d{8}\.JPEG \d", val[0])
    img = cv2.imread(str(base / "sample" / "train" / train[0].split()[0]))
    assert 250 <= min(img.shape[:2]) and max(img.shape[:2]) <= 500 and img.shape[2] == 3
    # what models/*alexnet/train_val.prototxt read: 256 x 256 colour Datums, and the mean
    for db, n in (("ilsvrc12_train_lmdb", 12), ("ilsvrc12_val_lmdb", 6)):
        recs = db_records(base / db)
        datum = caffe_pb2.Datum.FromString(recs[0][1])
        assert len(recs) == n and (datum.channels, datum.height, datum.width) == (3, 256, 256)
    mean = caffe_pb2.BlobProto.FromString((sample / "data" / "ilsvrc12" / "imagenet_mean.binaryproto").read_bytes())
    assert (mean.channels, mean.height, mean.width) == (3, 256, 256)
    for model in ("intel_alexnet", "mpi_intel_alexnet"):
        with open(os.path.join(REPO, "models", model, "train_val.prototxt")) as f:
            text = f.read()
        for path in ("examples/imagenet/ilsvrc12_train_lmdb", "examples/imagenet/ilsvrc12_val_lmdb",
                     "data/ilsvrc12/imagenet_mean.binaryproto"):
            assert f'"{path}"' in text, (model, path)


def test_sample_is_built_once_and_never_replaces_real_lmdbs(sample, tmp_path):
    again = make_sample(sample)
    assert again.returncode == 0 and "already built" in again.stdout
    (tmp_path / "examples" / "imagenet" / "ilsvrc12_train_lmdb").mkdir(parents=True)
    refused = make_sample(tmp_path)
    assert refused.returncode != 0 and "not replacing them" in refused.stderr
    assert not (tmp_path / "examples" / "imagenet" / "sample").exists()


def short_solver(root, model, max_iter):
    """The model's solver_sample.prototxt, stopped after `max_iter` iterations, tested once."""
    text = open(os.path.join(REPO, "models", model, "solver_sample.prototxt")).read()
    text = re.sub(r"max_iter: \d+", f"max_iter: {max_iter}", text)
    text = re.sub(r"test_interval: \d+", f"test_interval: {max_iter}", text)
    path = root / f"{model}_solver.prototxt"
    path.write_text(text + "snapshot_after_train: false\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_alexnet_trains_on_the_sample(sample):
    shutil.copytree(os.path.join(REPO, "models"), sample / "models", dirs_exist_ok=True)
    solver = short_solver(sample, "mpi_intel_alexnet", 2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([os.path.join(BIN, "mpiexec"), "-n", "2", os.path.join(BIN, "caffepy"), "train",
                             "--solver", solver], cwd=sample, capture_output=True, text=True, env=env,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "local batch 64, global batch 128" in result.stderr
    losses = [float(x) for x in re.findall(r"Iteration \d+ \(.*\), loss = ([\d.]+)", result.stderr)]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    assert "Iteration 2, Testing net (#0)" in result.stderr and "Test net output #0: accuracy = " in result.stderr


@pytest.mark.slow
def test_intel_alexnet_trains_on_the_sample(sample):
    shutil.copytree(os.path.join(REPO, "models"), sample / "models", dirs_exist_ok=True)
    solver = short_solver(sample, "intel_alexnet", 1)
    result = subprocess.run([os.path.join(BIN, "caffepy"), "train", "--solver", solver], cwd=sample,
                            capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"Iteration 0 \(.*\), loss = [\d.]+", result.stderr)
    assert "Iteration 1, Testing net (#0)" in result.stderr
