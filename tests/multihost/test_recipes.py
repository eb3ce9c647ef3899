"""A multinode recipe trains across two emulated hosts (tests/multihost/testbed.py), one rank on
each, MPI over TCP: our small recipe always, Intel Caffe's alexnet_bn_64nodes (LARS, BatchNorm,
warm-up) where CAFFEPY_INTEL_CAFFE names its tree. tests/recipe_helpers.py says what a prepared
recipe changes; the loss must be finite at once and fall. `make test-multihost` runs it."""
import os
import sys

import pytest

from multihost.testbed import TestBed, unavailable
from paths import REPO
from recipe_helpers import GLOBAL_BATCH, RECIPES, check_trains, make_imagenet, prepare, prepare_small

pytestmark = pytest.mark.multihost

ENV = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(f"no emulated hosts: {reason}")
    return make_imagenet(tmp_path_factory.mktemp("imagenet"))


def across_two_hosts(solver, timeout):
    argv = [sys.executable, "-m", "caffepy.cli", "train", "--solver", str(solver)]
    with TestBed(2, rate="1gbit") as bed:
        out = bed.run(argv, 1, env=ENV, timeout=timeout, cwd=os.path.dirname(solver))
    assert "emu-host1" in out.stderr, out.stderr[-3000:]      # the ranks saw two hosts
    return out


def test_small_recipe_trains_across_hosts(imagenet, tmp_path):
    solver_path, solver = prepare_small("solver", tmp_path, *imagenet)
    out = across_two_hosts(solver_path, 300)
    check_trains(out, solver.max_iter)
    assert "algorithm: ring (2 ranks" in out.stderr


@pytest.mark.skipif("alexnet_bn_64nodes" not in RECIPES, reason="no Intel Caffe tree (CAFFEPY_INTEL_CAFFE)")
def test_intel_recipe_trains_across_hosts(imagenet, tmp_path):
    solver = prepare(RECIPES["alexnet_bn_64nodes"], tmp_path, *imagenet,
                     global_batch=GLOBAL_BATCH["alexnet_bn_64nodes"])
    check_trains(across_two_hosts(solver, 900))
