"""examples/pycaffe/tutorial.py, pycaffe's tutorials on the bundled digits, runs as a script."""
import os
import re
import subprocess
import sys

from paths import REPO
SCRIPT = os.path.join(REPO, "examples", "pycaffe", "tutorial.py")


def test_the_script_is_pycaffe_but_for_its_imports():
    with open(SCRIPT) as f:
        code = [line for line in f if not line.lstrip().startswith("#")]
    body = "".join(code).split('"""', 2)[2]         # past the module docstring
    imports = [line.split("#")[0].strip() for line in body.splitlines() if "caffepy" in line.split("#")[0]]
    assert imports == ["import caffepy as caffe", "from caffepy import layers as L, params as P",
                       "from caffepy.proto import caffe_pb2"]


def test_tutorial_trains_edits_and_classifies(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, SCRIPT, "--work", str(tmp_path), "--iters", "150"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "('conv1', (64, 20, 12, 12))" in out and "('ip1', (100, 200))" in out
    assert "ip1 weights (100, 200) -> ip1-conv weights (100, 50, 2, 2)" in out
    assert "the fully convolutional net scores each digit as the classifier does" in out
    solver_acc, clf_acc = map(float, re.search(r"test accuracy ([\d.]+) \(solver\), ([\d.]+) \(Classifier\)",
                                               out).groups())
    assert solver_acc > 0.9 and clf_acc > 0.9
    # the solver also ran its test net itself (test_initialization) and logged it as Caffe does:
    # outputs in the order of their names (Caffe keeps them in a std::set), accuracy before loss
    assert "Test net output #0: accuracy" in result.stderr and "Test net output #1: loss" in result.stderr
    for name in ("lenet.caffemodel", "lenet_full_conv.caffemodel", "deploy.prototxt", "lenet_solver.prototxt"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "lenet.png").is_file() or (tmp_path / "lenet.raw").is_file()
