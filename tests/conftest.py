import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # shared helpers: gradient_checker, layer_cases

from caffepy import log  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_log():
    log.set_quiet(True)
    yield
    log.set_quiet(False)
