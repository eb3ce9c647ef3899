import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # shared helpers: gradient_checker, layer_cases

from caffepy import log  # noqa: E402

# The suite runs the rules' choice of algorithm (caffepy/autotune.py): no measuring, nothing
# written to the user's cache; tests/test_autotune.py turns measuring on where it is the subject
os.environ["CAFFEPY_AUTOTUNE"] = "0"

# Ctrl-C as a terminal delivers it, whatever the suite was started from: a shell without job
# control starts a background job (`make test &`) with SIGINT ignored, which every process the
# tests start would inherit, and the tests of what SIGINT does would then wait for nothing
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _quiet_log():
    log.set_quiet(True)
    yield
    log.set_quiet(False)


@pytest.fixture(autouse=True)
def _measurements_stored(monkeypatch):
    """Whether a measurement is stored depends on other processes' load (autotune.free_threads):
    the tests see a free machine; tests/test_autotune.py sets it where it is the subject."""
    from caffepy import autotune
    monkeypatch.setattr(autotune, "free_threads", lambda: 1 << 16)


@pytest.fixture(autouse=True)
def _pycaffe_name_restored():
    """Loading a Python layer binds `caffe` to caffepy in the process (caffepy/pycaffe_name.py):
    each test ends with the binding it started with."""
    saved = {k: v for k, v in sys.modules.items() if k == "caffe" or k.startswith("caffe.")}
    meta = list(sys.meta_path)
    yield
    for k in [k for k in sys.modules if k == "caffe" or k.startswith("caffe.")]:
        del sys.modules[k]
    sys.modules.update(saved)
    sys.meta_path[:] = meta


def pytest_report_header(config):
    """The kernels' ISA path this run tests, and the paths it cannot (tests/kernels/test_isa.py
    skips them with the same reasons)."""
    from caffepy import isa
    path, how = isa.selected()
    skipped = [isa.skip_reason(p) for p in isa.PATHS if isa.unavailable(p)]
    return [f"caffepy kernels: {isa.NAMES[path]} ({how})"] + \
        [f"caffepy kernels skipped: {s}" for s in skipped]
