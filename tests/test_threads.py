"""caffepy.threads: idle OpenMP / OpenBLAS threads wait passively unless the user said otherwise,
set before any runtime loads (issue 12: spinning threads made batch-1 nets 9-100x slower beside
a busy process)."""
import os
import subprocess
import sys

import pytest

from caffepy import threads


def test_defaults_are_passive_waits():
    env = {}
    threads.set_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}


@pytest.mark.parametrize("user, kept", [
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}),
    ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000", "OPENBLAS_THREAD_TIMEOUT": "4"}),
    ({"GOTO_THREAD_TIMEOUT": "28"}, {"GOTO_THREAD_TIMEOUT": "28", "OMP_WAIT_POLICY": "PASSIVE"}),
])
def test_what_the_user_set_decides(user, kept):
    env = dict(user)
    threads.set_defaults(env)
    assert env == kept


def test_importing_caffepy_sets_them():
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT",
                        "GOTO_THREAD_TIMEOUT")}
    code = ("import os, sys, caffepy; from caffepy.kernels import vision; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['OPENBLAS_THREAD_TIMEOUT'], "
            "'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["PASSIVE", "4", "True"]
