"""The embedded digits demo: its files, and (slow) the whole run.sh end to end."""
import collections
import os
import re
import stat
import subprocess
import sys

import cv2
import pytest

from paths import REPO
DIGITS = os.path.join(REPO, "examples", "digits")


def entries(name):
    with open(os.path.join(DIGITS, name)) as f:
        return [(p, int(label)) for p, label in (line.rsplit(" ", 1) for line in f.read().splitlines())]


def test_split_is_complete_disjoint_and_stratified():
    train, test = entries("train.txt"), entries("test.txt")
    assert (len(train), len(test)) == (1501, 296)
    names = [p for p, _ in train + test]
    assert len(set(names)) == 1797 == len(os.listdir(os.path.join(DIGITS, "images")))
    per_class = collections.Counter(label for _, label in test)
    assert sorted(per_class) == list(range(10)) and min(per_class.values()) >= 29
    img = cv2.imread(os.path.join(DIGITS, "images", train[0][0]), cv2.IMREAD_UNCHANGED)
    assert img.shape == (8, 8)


def test_test_iterations_cover_the_test_split_once():
    from caffepy import upgrade
    net = upgrade.read_net(os.path.join(DIGITS, "lenet_train_test.prototxt"))
    solver = upgrade.read_solver(os.path.join(DIGITS, "lenet_solver.prototxt"))
    test_batch = [lp.data_param.batch_size for lp in net.layer
                  if lp.type == "Data" and lp.include and lp.include[0].phase == 1][0]
    assert solver.test_iter[0] * test_batch == 296
    with open(os.path.join(DIGITS, "run.sh")) as f:
        assert f"--iterations {solver.test_iter[0]}" in f.read()


@pytest.mark.slow
def test_demo_reaches_97_percent(tmp_path):
    shim = tmp_path / "caffepy"
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m caffepy.cli \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    out = subprocess.run(["bash", os.path.join(DIGITS, "run.sh")], capture_output=True, text=True,
                         env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", last).group(1))
    assert accuracy >= 0.97, last
