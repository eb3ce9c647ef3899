"""BVLC Caffe's own pycaffe test suite (python/caffe/test) run against caffepy as `caffe`.

The suite is read at test time from a BVLC Caffe checkout named by CAFFEPY_BVLC_CAFFE: a work
tree, or a git directory (bare or not) whose HEAD is read. Its files and the net prototxts
test_draw walks (models/, examples/) go to a temporary directory; nothing of them enters this
repository. Without a checkout the test skips and says why. `make test-pycaffe` runs it alone.
"""
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import pytest

from paths import REPO

SUITE = "python/caffe/test"

# Run inside the suite's process before its files import `caffe`: caffepy under pycaffe's name
CONFTEST = '''
import importlib.util
import sys

import caffepy

if importlib.util.find_spec("caffe") is None:
    # a caffepy without its own `caffe` package: its modules under pycaffe's names by hand
    import caffepy.coord_map, caffepy.draw, caffepy.io, caffepy.proto.caffe_pb2  # noqa: F401,E401
    for name, module in list(sys.modules.items()):
        if name == "caffepy" or name.startswith("caffepy."):
            sys.modules["caffe" + name[len("caffepy"):]] = module
import caffe  # noqa: E402
assert caffe is caffepy, f"`import caffe` gives {caffe.__file__}, not caffepy"
'''


def _checkout():
    where = os.environ.get("CAFFEPY_BVLC_CAFFE")
    if not where:
        pytest.skip("CAFFEPY_BVLC_CAFFE is not set: point it at a BVLC Caffe checkout (a work tree or "
                    "a git directory) to run pycaffe's own test suite")
    if not os.path.isdir(where):
        pytest.skip(f"CAFFEPY_BVLC_CAFFE={where}: no such directory")
    return where


def _copy_suite(where, dest):
    """BVLC's test files and net prototxts from a work tree or a git directory into `dest`."""
    if os.path.isdir(os.path.join(where, SUITE)):
        shutil.copytree(os.path.join(where, SUITE), os.path.join(dest, SUITE))
        for top in ("models", "examples"):
            for root, _, files in os.walk(os.path.join(where, top)):
                for name in files:
                    if name.endswith(".prototxt"):
                        path = os.path.join(root, name)
                        target = os.path.join(dest, os.path.relpath(path, where))
                        os.makedirs(os.path.dirname(target), exist_ok=True)
                        shutil.copyfile(path, target)
        return
    archive = subprocess.run(["git", "--git-dir", where, "archive", "HEAD", SUITE,
                              ":(glob)models/**/*.prototxt", ":(glob)examples/**/*.prototxt"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"CAFFEPY_BVLC_CAFFE={where}: neither a work tree holding {SUITE} nor a git "
                    f"directory whose HEAD does ({archive.stderr.decode().strip()})")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")


# BVLC's suite, file by file (BVLC Caffe is archived: the list no longer changes)
FILES = ["test_coord_map", "test_draw", "test_io", "test_layer_type_list", "test_nccl", "test_net",
         "test_net_spec", "test_python_layer", "test_python_layer_with_param_str", "test_solver"]
# pycaffe's draw_net renders a PNG through Graphviz, as caffe.draw does
NEEDS_DOT = "test_draw"


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    """BVLC's suite run once in its own process: {file: [(test, outcome, message)]}."""
    where = _checkout()
    if importlib.util.find_spec("six") is None:
        pytest.skip("BVLC's pycaffe tests import six: pip install six (make test-pycaffe installs it)")
    tmp = tmp_path_factory.mktemp("bvlc")
    _copy_suite(where, tmp)
    suite = tmp / SUITE
    (suite / "conftest.py").write_text(CONFTEST)
    (tmp / "pytest.ini").write_text("[pytest]\n")     # their rootdir, not ours
    report = tmp / "report.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    skip = [] if shutil.which("dot") else ["--deselect", f"{SUITE}/{NEEDS_DOT}.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                          f"--junitxml={report}", *skip, str(suite)], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=600)
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        results.setdefault(case.get("classname").rsplit(".", 2)[-2], []).append(
            (case.get("name"), "passed" if outcome is None else outcome.tag,
             "" if outcome is None else (outcome.get("message") or "") + "\n" + (outcome.text or "")))
    return results


@pytest.mark.parametrize("name", FILES)
def test_pycaffe_suite(suite_run, name):
    if name == NEEDS_DOT and not shutil.which("dot"):
        pytest.skip("BVLC's test_draw renders PNGs through Graphviz's dot, which is not on PATH")
    assert name in suite_run, f"{name}.py: nothing collected"
    failed = [f"{test}: {outcome}: {message}" for test, outcome, message in suite_run[name]
              if outcome in ("failure", "error")]
    assert not failed, "\n".join(failed)
    assert any(outcome == "passed" for _, outcome, _ in suite_run[name]), suite_run[name]
