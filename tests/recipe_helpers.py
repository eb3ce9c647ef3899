"""Intel Caffe's multinode recipes prepared for a short run on generated data, and run.

`prepare` copies a recipe's solver and net(s) with its data pointed at a generated ImageNet-shaped
LMDB (make_imagenet_lmdb: JPEG-encoded 256 x 256 color Datum) and everything else as shipped
except:
- every data layer reads the LMDB with a batch of BATCH per rank (RECORDS records of CLASSES
  classes, so that each iteration's global batch is the whole set); a mean_file is its mean;
- bn_stats_batch_size / stats_batch_size (BatchNorm statistics over groups of that many items,
  which must divide the batch) is cut to the batch where it is larger;
- max_iter is a few iterations, the test net runs one batch after the last one, no snapshots,
  the loss is displayed every iteration and not averaged (average_loss 1), random_seed is fixed;
- the learning rate, unless the recipe uses LARS: base_lr and warmup_start_lr are scaled to the
  global batch of BATCH * RANKS by the linear scaling rule the recipes follow themselves (times
  BATCH * RANKS / the recipe's global batch, GLOBAL_BATCH): at its own rate a batch of 4 diverged
  within a few iterations here (AlexNet at iteration 7, VGG-16 at 4); and a warm-up lasts the
  first half of the run instead of the recipe's hundreds or thousands of iterations, over which
  a few run at about warmup_start_lr, too slow to learn (VGG-16 16nodes: its loss went 7.11,
  6.26, ... 6.65, 6.99 over 8 iterations at its scaled warmup_start_lr, 7.11, 6.01, ... 2.34,
  2.69 at its scaled base_lr);
- recipes with LARS (local_lr_auto) keep their rate and warm-up: LARS bounds each layer's step by
  its weights' norm, whatever the batch, and a few iterations at about warmup_start_lr learn
  (AlexNet-BN: 6.91 to 2.42 in 8); warmed up to base_lr within 4 they diverged.
The policy is the recipe's: warm-up from warmup_start_lr to base_lr, then multistep (whose steps
come later) or poly decay over max_iter.
`check_trains` asserts a run ended well, its loss was finite at the first two iterations and
fell (the mean of the last two below the mean of the first two), and its test outputs were finite.
"""
import glob
import math
import os
import re
import subprocess
import sys

import numpy as np

from caffepy import prototxt as P
from caffepy import upgrade as U
from caffepy.blobproto import write_blobproto

from data_helpers import make_imagenet_lmdb
from mpi_helpers import MPIEXEC
from paths import REPO, TESTS

INTEL_TREE = os.environ.get("CAFFEPY_INTEL_CAFFE")
MULTINODE = os.path.join(INTEL_TREE or "", "models", "intel_optimized_models", "multinode")
CAFFEPY = os.path.join(os.path.dirname(sys.executable), "caffepy")
SMALL = os.path.join(TESTS, "recipes", "tiny_resnet")       # our own recipe, for CI
SMALL_SOLVERS = ("solver", "solver_lars")

ITERS = 8
BATCH = 2          # per rank
RANKS = 2
RECORDS = 4
CLASSES = 4


def _recipes():
    out = {}
    for path in sorted(glob.glob(os.path.join(MULTINODE, "*", "solver*.prototxt"))):
        name = os.path.basename(os.path.dirname(path))
        stem = os.path.splitext(os.path.basename(path))[0]
        out[name if stem == "solver" else f"{name}/{stem}"] = path
    return out


RECIPES = _recipes()         # name (its directory, /solver_x for another solver there) -> solver


# The global batch each recipe was written for: its per-rank batch times its ranks (the number
# of nodes its name gives, the ranks of its README for the *_Ns ones), as its solver's comments
# and name say
GLOBAL_BATCH = {
    "alexnet_4nodes": 1024, "alexnet_bn_32nodes": 32768, "alexnet_bn_64nodes": 32768,
    "default_resnet50_8nodes": 1024, "default_resnet50_16nodes": 2048, "default_resnet50_64nodes": 8192,
    "googlenet_4nodes": 256, "googlenet_8nodes": 512, "googlenet_16nodes_1k_batch": 1024,
    "googlenet_v2_8nodes": 512, "googlenet_v3_32nodes_2k_batch": 2048,
    "googlenet_v3_aux_32nodes_2k_batch": 2048, "resnet50_4nodes_4s": 1024, "resnet50_8nodes_2s": 1024,
    "ssd_16nodes_512_batch": 512, "vgg_16_8nodes_512_batch": 512, "vgg_16_16nodes_1k_batch": 1024,
    "vgg_16_32nodes_2k_batch": 2048, "vgg_16_64nodes_4k_batch": 4096,
}


def make_imagenet(root):
    """The generated LMDB (RECORDS records of CLASSES classes) and its mean file, in `root`."""
    db, mean = make_imagenet_lmdb(root / "ilsvrc12_lmdb", RECORDS, CLASSES)
    write_blobproto(mean, str(root / "mean.binaryproto"))
    return db, str(root / "mean.binaryproto")


def _net_path(solver_path, field):
    """A solver's net, found beside the solver (the recipes name paths from Intel Caffe's root,
    and two name a directory, mlperf_2018, that is not in the tree)."""
    return os.path.join(os.path.dirname(solver_path), os.path.basename(field))


def prepare_net(path, out, db, mean, batch=None):
    """The net at `path` reading `db` in batches of `batch` (None: its own), written to `out`
    (see the module's docstring)."""
    net = U.read_net(path)
    for lp in net.layer:
        for field in ("data_param", "image_data_param"):
            if lp.HasField(field):
                getattr(lp, field).source = db
                if batch:
                    getattr(lp, field).batch_size = batch
        if lp.transform_param.mean_file:
            lp.transform_param.mean_file = mean
        stats = lp.batch_norm_param
        if batch and stats.stats_batch_size > batch:
            stats.stats_batch_size = batch
    if batch and net.bn_stats_batch_size > batch:
        net.bn_stats_batch_size = batch
    P.write_text(net, out)
    return str(out)


def prepare(solver_path, work, db, mean, iters=ITERS, batch=BATCH, global_batch=None):
    """The recipe's solver and net(s) in `work`, as the module's docstring says; its rate scaled
    from `global_batch` to batch * RANKS (unless LARS sets it)."""
    solver = U.read_solver(solver_path)
    if global_batch and not solver.local_lr_auto:
        scale = batch * RANKS / global_batch
        solver.base_lr *= scale
        if solver.HasField("warmup_start_lr"):
            solver.warmup_start_lr *= scale
        solver.warmup_iter = min(solver.warmup_iter, iters // 2)
    for field in ("net", "train_net"):
        if solver.HasField(field):
            setattr(solver, field, prepare_net(_net_path(solver_path, getattr(solver, field)),
                                               work / f"{field}.prototxt", db, mean, batch))
    tests = [prepare_net(_net_path(solver_path, t), work / f"test_net{i}.prototxt", db, mean, batch)
             for i, t in enumerate(solver.test_net)]
    del solver.test_net[:]
    solver.test_net.extend(tests)
    solver.max_iter = iters
    del solver.test_iter[:]
    solver.test_iter.extend([1] * max(1, len(tests)))
    solver.test_interval = iters
    solver.test_initialization = False
    solver.snapshot = 0
    solver.snapshot_after_train = False
    solver.snapshot_prefix = str(work / "snap")
    solver.display = 1
    solver.average_loss = 1
    solver.random_seed = 1
    P.write_text(solver, work / "solver.prototxt")
    return work / "solver.prototxt"


def prepare_small(name, work, db, mean):
    """Our small recipe's solver `name` (SMALL_SOLVERS) as shipped, its LMDBs `db` and `mean`,
    in `work`."""
    solver = U.read_solver(os.path.join(SMALL, f"{name}.prototxt"))
    solver.net = prepare_net(os.path.join(REPO, solver.net), work / "train_val.prototxt", db, mean)
    solver.snapshot_prefix = str(work / "tiny_resnet")
    P.write_text(solver, work / "solver.prototxt")
    return work / "solver.prototxt", solver


def train(solver, ranks=RANKS, timeout=1800, cwd=None):
    cmd = [MPIEXEC, "-n", str(ranks), CAFFEPY, "train", "--solver", str(solver)]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or os.path.dirname(solver))


LOSS = re.compile(r"Iteration (\d+) \([^)]*\), loss = (\S+)")
TEST_OUTPUT = re.compile(r"Test net output #\d+: (\S+) = (\S+)")


def losses(stderr):
    """{iteration: loss} as displayed (rank 0's line: the mean over the ranks)."""
    return {int(i): float(v) for i, v in LOSS.findall(stderr)}


def check_trains(out, iters=ITERS):
    """The run ended well, its loss was finite at the first two iterations and fell."""
    assert out.returncode == 0, out.stderr[-3000:]
    seen = losses(out.stderr)
    assert sorted(seen) == list(range(iters)), sorted(seen)
    first, last = [seen[i] for i in (0, 1)], [seen[i] for i in (iters - 2, iters - 1)]
    assert all(math.isfinite(v) for v in first), first
    assert np.mean(last) < np.mean(first), [seen[i] for i in range(iters)]
    tested = TEST_OUTPUT.findall(out.stderr)
    assert tested and all(math.isfinite(float(v)) for _, v in tested), tested
    return seen
