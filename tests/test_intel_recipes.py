"""Intel Caffe's multinode recipes train under `mpiexec -n 2 caffepy train --solver ...`.

Each solver of models/intel_optimized_models/multinode/*/ in the Intel Caffe tree named by
CAFFEPY_INTEL_CAFFE trains for a few iterations on a generated ImageNet-shaped LMDB, with its net
and solver as shipped but for the data, the batch, the iterations and the learning rate
(tests/recipe_helpers.py says exactly what changes and why), and its loss must be finite at the
first two iterations and fall over the run (slow: VGG-16 iterations take seconds).

Recipes that need work of another issue are xfail with the feature named (PENDING: SSD's training
layers, issue #36): the run must fail naming that feature, or the test fails. Remove the entry
when that work has merged.

`test_small_recipe_trains` is the CI version that needs no Intel tree: our own small recipe
(tests/recipes/tiny_resnet: the same features at a small scale) under mpiexec -n 2.
"""
import os
import re

import pytest

from caffepy import prototxt as P
from caffepy import upgrade as U

from mpi_helpers import MPIEXEC
from paths import REPO
from recipe_helpers import BATCH, GLOBAL_BATCH, RECIPES, SMALL, check_trains, make_imagenet, prepare, prepare_net, train

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")


class PendingFeature(AssertionError):
    """The run failed naming a feature that other work brings (see PENDING)."""


# recipe (a prefix of its name) -> (words its failure must hold, what is missing and who brings it)
PENDING = {
    "ssd_": ("AnnotatedData", "AnnotatedData and MultiBoxLoss: SSD training, issue #36"),
}


def pending(name):
    return next((v for k, v in PENDING.items() if name.startswith(k)), None)


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """The generated LMDB and its mean file."""
    return make_imagenet(tmp_path_factory.mktemp("imagenet"))


@pytest.mark.slow
@pytest.mark.skipif(not RECIPES, reason="no Intel Caffe tree (CAFFEPY_INTEL_CAFFE) with its multinode recipes")
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(raises=PendingFeature, reason=f"needs {pending(name)[1]}"))
    if pending(name) else name for name in RECIPES])
def test_intel_recipe_trains(name, imagenet, tmp_path):
    solver = prepare(RECIPES[name], tmp_path, *imagenet, global_batch=GLOBAL_BATCH[name.split("/")[0]])
    out = train(solver)
    need = pending(name)
    if need and out.returncode != 0:
        error = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        if need[0] in out.stderr:
            raise PendingFeature(error)
    seen = check_trains(out)
    print(f"{name}: loss " + " ".join(f"{seen[i]:.3f}" for i in sorted(seen)))


def test_small_recipe_trains(imagenet, tmp_path):
    """Our recipe in the shape of Intel's ResNet-50 ones (tests/recipes/tiny_resnet: ImageNet data
    and transform, BatchNorm + Scale, Eltwise shortcuts, multistep with warm-up) trains as shipped
    under mpiexec -n 2, its LMDBs pointed at the generated set: a batch of 2 per rank, the
    global batch of 4 is the whole set at each iteration."""
    db, mean = imagenet
    solver = U.read_solver(os.path.join(SMALL, "solver.prototxt"))
    solver.net = prepare_net(os.path.join(REPO, solver.net), tmp_path / "train_val.prototxt", db, mean, BATCH)
    solver.snapshot_prefix = str(tmp_path / "tiny_resnet")
    P.write_text(solver, tmp_path / "solver.prototxt")
    out = train(tmp_path / "solver.prototxt", timeout=300)
    check_trains(out, solver.max_iter)
    assert "local batch 2, global batch 4" in out.stderr
    # warm-up from 0.02 to 0.2 over 4 iterations, then 0.1x at iterations 10 and 14
    rates = {int(i): float(v) for i, v in re.findall(r"Iteration (\d+), lr = (\S+)", out.stderr)}
    want = {0: 0.02, 1: 0.065, 2: 0.11, 3: 0.155, 4: 0.2, 9: 0.2, 10: 0.02, 13: 0.02, 14: 0.002, 15: 0.002}
    assert {i: rates[i] for i in want} == pytest.approx(want, rel=1e-5)
