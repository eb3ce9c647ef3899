"""SSD end to end on the generated shapes set, through the commands users type: the tiny SSD of
examples/shapes trains (its loss falls, its mAP rises from nothing), `caffepy test -detection`
scores the trained weights as the solver's test phase did, `mpiexec -n 2` trains it as one rank
with the global batch; slow: Intel Caffe's own SSD nets (CAFFEPY_INTEL_CAFFE, their models/ tree)
train and score as shipped with their data pointed at the generated set."""
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from caffepy.data.shapes import write_lmdbs, write_shapes
from mpi_helpers import MPIEXEC, max_rel_diff, weights
from paths import REPO

EXAMPLES = os.path.join(REPO, "examples", "shapes")
INTEL = os.environ.get("CAFFEPY_INTEL_CAFFE", "")
needs_intel = pytest.mark.skipif(not os.path.isdir(os.path.join(INTEL, "models", "intel_optimized_models")),
                                 reason="CAFFEPY_INTEL_CAFFE does not name Intel Caffe's tree (models/ ...)")


def intel_ssd():
    """examples/shapes/intel_ssd.py as a module."""
    spec = importlib.util.spec_from_file_location("intel_ssd", os.path.join(EXAMPLES, "intel_ssd.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shapes64(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes64")
    write_shapes(root, 96, 32, size=64, seed=0)
    write_lmdbs(root)
    return root


def caffepy(*args, cwd, ranks=1, timeout=900):
    cmd = [sys.executable, "-m", "caffepy.cli", *map(str, args)]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1" if ranks > 1 else os.environ.get("OMP_NUM_THREADS", ""))
    if not env["OMP_NUM_THREADS"]:
        del env["OMP_NUM_THREADS"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stderr


def tiny_job(tmp_path, data, name="job", max_iter=300, test_interval=300, batch=8, bn=True, test=True, sgd=False):
    """The tiny SSD's solver and nets, reading `data`, snapshots in tmp_path/name."""
    d = tmp_path / name
    d.mkdir()
    for kind in ("train", "test"):
        text = open(os.path.join(EXAMPLES, f"tiny_ssd_{kind}.prototxt")).read()
        text = text.replace("examples/shapes/data", str(data))
        if kind == "train":
            text = text.replace("batch_size: 8", f"batch_size: {batch}")
        if not bn:       # per-rank batch statistics would make ranks differ from one rank
            text = "\n".join(line for line in text.splitlines() if '_bn"' not in line and '_scale"' not in line)
        (d / f"{kind}.prototxt").write_text(text)
    solver = open(os.path.join(EXAMPLES, "tiny_ssd_solver.prototxt")).read()
    solver = solver.replace("examples/shapes/tiny_ssd_train.prototxt", str(d / "train.prototxt"))
    solver = solver.replace("examples/shapes/tiny_ssd_test.prototxt", str(d / "test.prototxt"))
    solver = solver.replace("examples/shapes/tiny_ssd", str(d / "snap"))
    solver = re.sub(r"max_iter: \d+", f"max_iter: {max_iter}", solver)
    solver = re.sub(r"test_interval: \d+", f"test_interval: {test_interval}", solver)
    # not a divisor of max_iter: Caffe's Solve runs one more forward of the train net at the end
    # when it is, which moves BatchNorm's statistics after the snapshot and before the last test
    solver = re.sub(r"display: \d+", "display: 7", solver)
    if not test:
        solver = solver.replace("test_initialization: true", "test_initialization: false")
    if sgd:     # Adam's first steps are lr * sign(gradient): float noise in a gradient near 0 flips them
        solver = solver.replace('type: "Adam"', 'type: "SGD"').replace("base_lr: 0.003", "base_lr: 0.01")
    (d / "solver.prototxt").write_text(solver)
    return d


def losses(log):
    return [float(m.group(1)) for m in re.finditer(r"Iteration \d+ \(.*\), loss = (\S+)", log)]


def maps(log):
    return [float(m.group(1)) for m in re.finditer(r"Test net output #0: detection_eval = (\S+)", log)]


def test_tiny_ssd_learns_and_test_detection_agrees(tmp_path, shapes64):
    job = tiny_job(tmp_path, shapes64)
    log = caffepy("train", "-solver", job / "solver.prototxt", cwd=job)
    loss, m_ap = losses(log), maps(log)
    assert len(m_ap) == 2 and m_ap[0] < 0.05, m_ap           # untrained: next to nothing
    assert m_ap[1] > 0.25, m_ap                              # after 300 iterations of batch 8
    assert all(math.isfinite(v) for v in loss)
    assert sum(loss[-5:]) / 5 < 0.5 * loss[0], loss         # the loss falls to under half
    assert sum(loss[-5:]) < sum(loss[5:10]), loss            # and keeps falling
    out = caffepy("test", "-model", job / "test.prototxt", "-weights", job / "snap_iter_300.caffemodel",
                  "-iterations", 4, "-detection", cwd=job)
    assert float(re.search(r"detection_eval = (\S+)", out).group(1)) == pytest.approx(m_ap[1], abs=1e-6)
    out = caffepy("test", "-model", job / "test.prototxt", "-weights", job / "snap_iter_300.caffemodel",
                  "-iterations", 4, "-detection", "-ap_version", "MaxIntegral", cwd=job)
    assert 0.25 < float(re.search(r"detection_eval = (\S+)", out).group(1)) <= 1


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")
def test_two_ranks_train_the_tiny_ssd_as_one_rank_with_their_batches(tmp_path, shapes64):
    """Augmented boxes, mining and the normalizer of the global batch: the same weights."""
    iters = 4
    one = tiny_job(tmp_path, shapes64, "one", iters, 1000, batch=8, bn=False, test=False, sgd=True)
    two = tiny_job(tmp_path, shapes64, "two", iters, 1000, batch=4, bn=False, test=False, sgd=True)
    log1 = caffepy("train", "-solver", one / "solver.prototxt", cwd=one)
    log2 = caffepy("train", "-solver", two / "solver.prototxt", cwd=two, ranks=2)
    assert "over 2 ranks: local batch 4, global batch 8" in log2
    # the loss of iteration 0, averaged over the ranks, is the one rank's: each rank normalizes by
    # the matches of the global batch (over the ranks)
    assert losses(log2)[0] == pytest.approx(losses(log1)[0], rel=1e-5) and losses(log1)[0] > 1
    w1, w2 = weights(one / f"snap_iter_{iters}.caffemodel"), weights(two / f"snap_iter_{iters}.caffemodel")
    assert max_rel_diff(w1, w2) < 1e-5


# -- Intel Caffe's nets, as shipped -----------------------------------------------------------------
@pytest.fixture(scope="module")
def shapes300(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes300")
    write_shapes(root, 8, 8, size=300, seed=1)
    write_lmdbs(root)
    return root


@pytest.mark.slow
@needs_intel
@pytest.mark.parametrize("model", ["ssd/VGGNet/VOC0712/SSD_300x300", "ssd/AlexNet/VOC0712/SSD_300x300"])
def test_intel_ssd_nets_train_and_test_as_shipped(tmp_path, shapes300, model):
    """Their 21 classes kept: the data alone changes. Two iterations, then the test phase."""
    solver = intel_ssd().point_solver(os.path.join(INTEL, "models", "intel_optimized_models", model, "solver.prototxt"),
                                      shapes300, tmp_path, INTEL, batch=2, test_batch=4, max_iter=2,
                                      test_interval=2, display=1)
    log = caffepy("train", "-solver", solver, cwd=tmp_path, timeout=3600)
    loss = losses(log)
    assert len(loss) == 2 and all(math.isfinite(v) and v > 0 for v in loss)
    assert len(maps(log)) == 1 and 0 <= maps(log)[0] <= 1


@pytest.mark.slow
@needs_intel
def test_intel_mobilenet_ssd_accuracy_net_scores(tmp_path, shapes300):
    """ssd_mobilenet/fp32_acc.prototxt (a TEST net: AnnotatedData to DetectionEvaluate) runs on
    the generated set; untrained weights score next to nothing."""
    import caffepy as caffe
    from caffepy.bbox import MeanAP
    net_path = os.path.join(INTEL, "models", "intel_optimized_models", "ssd_mobilenet", "fp32_acc.prototxt")
    module = intel_ssd()
    from caffepy import prototxt, upgrade
    net = module.point_net(upgrade.read_net(net_path), shapes300, test_batch=4)
    prototxt.write_text(net, str(tmp_path / "acc.prototxt"))
    n = caffe.Net(str(tmp_path / "acc.prototxt"), caffe.TEST)
    acc = MeanAP()
    for _ in range(2):
        n.forward()
        acc.add(n.blobs["detection_eval"].data)
    assert sorted(acc.num_pos) == list(range(1, 21))       # VOC's 20 labels, the shapes' 4 counted
    assert sum(acc.num_pos.values()) > 0 and acc.result("11point")[0] < 0.05


@pytest.mark.slow
@needs_intel
@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in the venv")
def test_intel_multinode_ssd_recipe_trains_on_two_ranks(tmp_path, shapes300):
    """models/intel_optimized_models/multinode/ssd_16nodes_512_batch: its solver (LR warm-up)
    and nets, 2 ranks of batch 1, one iteration."""
    solver = intel_ssd().point_solver(
        os.path.join(INTEL, "models", "intel_optimized_models", "multinode", "ssd_16nodes_512_batch", "solver.prototxt"),
        shapes300, tmp_path, INTEL, batch=1, test_batch=4, max_iter=1, test_interval=1000, display=1)
    log = caffepy("train", "-solver", solver, cwd=tmp_path, ranks=2, timeout=3600)
    assert "over 2 ranks: local batch 1, global batch 2" in log
    assert len(losses(log)) >= 1 and all(math.isfinite(v) for v in losses(log))


@pytest.mark.slow
@needs_intel
def test_intel_vgg_ssd300_learns_the_shapes(tmp_path_factory):
    """Intel's VGG SSD300 (heads given the set's 5 classes) from Xavier initialization on 400
    images of 300x300, batch 2, Adam at base_lr 0.0001 (SGD at the recipe's 0.001 diverges from
    scratch), 200 iterations (about an hour on 2 shared cores). Measured: loss 16.5 -> 6.7,
    mAP 0 -> 0.012 (100) -> 0.017 (200): it learns, slowly, as VGG from scratch on 400 images does."""
    data = tmp_path_factory.mktemp("shapes300_train")
    write_shapes(data, 400, 48, size=300, seed=0)
    write_lmdbs(data)
    out = tmp_path_factory.mktemp("vgg_ssd300")
    solver = intel_ssd().point_solver(
        os.path.join(INTEL, "models", "intel_optimized_models", "ssd", "VGGNet", "VOC0712", "SSD_300x300",
                     "solver.prototxt"), data, out, INTEL, classes=5, batch=2, test_batch=8, max_iter=200,
        test_interval=100, display=10, snapshot=1000, stepvalue=[100000], base_lr=0.0001, type="Adam",
        momentum2=0.999, test_initialization=True, random_seed=1)
    log = caffepy("train", "-solver", solver, cwd=out, timeout=4 * 3600)
    loss, m_ap = losses(log), maps(log)
    assert len(m_ap) == 3 and m_ap[0] < 0.005, m_ap
    assert m_ap[2] > 0.008, m_ap
    assert sum(loss[-5:]) / 5 < 0.5 * loss[0], loss
