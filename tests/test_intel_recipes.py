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
(tests/recipes/tiny_resnet: the same features at a small scale, two solvers) under mpiexec -n 2.
"""
import os
import re

import pytest

from mpi_helpers import MPIEXEC
from recipe_helpers import (GLOBAL_BATCH, RECIPES, SMALL_SOLVERS, check_trains, make_imagenet, prepare, prepare_small,
                            train)

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


# Our small recipe's solvers: the rate at each iteration (warm-up over 4, then the policy) and the
# iterations that test
SCHEDULES = {
    # warm-up from 0.02 to 0.2, then 0.1x at iterations 10 and 14; tests at 4 + 8k (test_offset)
    "solver": ({0: 0.02, 1: 0.065, 2: 0.11, 3: 0.155, 4: 0.2, 9: 0.2, 10: 0.02, 13: 0.02, 14: 0.002,
                15: 0.002}, [4, 12]),
    # LARS: warm-up from 0.05 to 0.5, then poly (power 2) over 16 iterations: 0.5 (1 - i / 16)^2
    "solver_lars": ({0: 0.05, 2: 0.275, 4: 0.28125, 8: 0.125, 12: 0.03125, 15: 0.001953125}, [16]),
}


@pytest.mark.parametrize("name", SMALL_SOLVERS)
def test_small_recipe_trains(name, imagenet, tmp_path):
    """Our recipe in the shape of Intel's ResNet-50 and Inception-v3 ones (tests/recipes/tiny_resnet:
    ImageNet data with their augmentations, BatchNorm statistics groups, BatchNorm + Scale, Eltwise
    shortcuts, label smoothing), with the schedules of their solvers (warm-up, multistep,
    test_offset; LARS, poly, average_loss), trains as shipped under mpiexec -n 2, its LMDBs pointed
    at the generated set."""
    solver_path, solver = prepare_small(name, tmp_path, *imagenet)
    out = train(solver_path, timeout=300)
    check_trains(out, solver.max_iter)
    assert "local batch 4, global batch 8" in out.stderr
    rates = {int(i): float(v) for i, v in re.findall(r"Iteration (\d+), lr = (\S+)", out.stderr)}
    want, tests = SCHEDULES[name]
    assert {i: rates[i] for i in want} == pytest.approx(want, rel=1e-5)
    assert [int(i) for i in re.findall(r"Iteration (\d+), Testing net", out.stderr)] == tests
