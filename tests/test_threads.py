"""caffepy.threads: idle OpenMP threads spin briefly and OpenBLAS's sleep at once unless the
user said otherwise, set before any runtime loads (issue 12: long-spinning threads made batch-1
nets 9-100x slower beside a busy process), and the thread rule's count of the cores that other
processes leave free."""
import os
import subprocess
import sys
import time

import pytest

from caffepy import threads


def test_defaults_are_short_spins():
    env = {}
    threads.set_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "30000", "OPENBLAS_THREAD_TIMEOUT": "4"}


@pytest.mark.parametrize("user, kept", [
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}),
    ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000", "OPENBLAS_THREAD_TIMEOUT": "4"}),
    ({"GOTO_THREAD_TIMEOUT": "28"}, {"GOTO_THREAD_TIMEOUT": "28", "GOMP_SPINCOUNT": "30000"}),
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
            "print(os.environ['GOMP_SPINCOUNT'], os.environ['OPENBLAS_THREAD_TIMEOUT'], "
            "'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["30000", "4", "True"]


# The thread rule's reading of other processes' load (cext/rules.h), in a child process with a
# team of every core: our own threads, busy in regions and spinning between them, never count;
# a busy process takes a core; OMP_WAIT_POLICY=active keeps every thread.

TEAM_LIMIT = """
import time
import numpy as np
from caffepy.kernels import common
a = np.ones(1 << 22, np.float32)
seen = []
t = time.monotonic()
while time.monotonic() - t < 2.0:       # regions throughout; read past the first window
    common.add(a, a, a)
    a[:] = 1
    if time.monotonic() - t > 0.25:
        seen.append(common.team_limit())
print(*seen)
"""


def team_limit(busy, **extra):
    """The limits a child with a team of every core reads while it runs regions, and the cores."""
    cores = os.cpu_count()
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(OMP_NUM_THREADS=str(cores), **extra)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, "-c", TEAM_LIMIT], env=env, capture_output=True,
                             text=True, check=True).stdout
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return [int(v) for v in out.split()], cores


def share(readings, value):
    return sum(r == value for r in readings) / len(readings)


needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")


def others_load(seconds=0.5):
    """Cores the rest of the machine keeps busy now (/proc/stat's busy time less ours)."""
    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
        return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")
    b, c, t = busy(), time.process_time(), time.monotonic()
    time.sleep(seconds)
    return ((busy() - b) - (time.process_time() - c)) / (time.monotonic() - t)


@pytest.fixture
def quiet_machine():
    """The limits below hold on a machine nothing else keeps busy."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("needs /proc/stat")
    if others_load() > 0.3:
        pytest.skip("another process keeps a core busy")


@needs_two_cores
def test_our_own_threads_are_not_load(quiet_machine):
    readings, cores = team_limit(busy=False)
    assert share(readings, cores) >= 0.75     # a window's clock-tick noise may read a core taken


@needs_two_cores
def test_a_busy_process_takes_a_core(quiet_machine):
    readings, cores = team_limit(busy=True)
    assert share(readings, cores - 1) >= 0.75


@needs_two_cores
def test_active_waiting_keeps_every_thread(quiet_machine):
    readings, cores = team_limit(busy=True, OMP_WAIT_POLICY="ACTIVE")
    assert share(readings, cores) == 1


# After a pause, the first reading describes the machine now, not the pause: a process that kept
# a core busy while we idled and has just ended leaves every core to us, and one still running
# takes its core. Each round: regions, a spinner started, a pause, then the reading with the
# spinner gone ("ended") or still there ("running").
AFTER_PAUSE = """
import subprocess, sys, time
import numpy as np
from caffepy.kernels import common
a = np.ones(1 << 22, np.float32)
seen = {"ended": [], "running": []}
for _ in range(4):
    for case in seen:
        t = time.monotonic()
        while time.monotonic() - t < 0.1:
            common.add(a, a, a)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.6)
        if case == "ended":
            spinner.kill()
            spinner.wait()
        seen[case].append(common.team_limit())
        if case == "running":
            spinner.kill()
            spinner.wait()
print(*seen["ended"])
print(*seen["running"])
"""


@needs_two_cores
def test_the_reading_after_a_pause_is_of_now(quiet_machine):
    cores = os.cpu_count()
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = str(cores)
    ended, running = subprocess.run([sys.executable, "-c", AFTER_PAUSE], env=env,
                                    capture_output=True, text=True, check=True).stdout.splitlines()
    assert share([int(v) for v in ended.split()], cores) >= 0.75
    assert share([int(v) for v in running.split()], cores - 1) >= 0.75
