"""The bad-input corpus (tests/bad_inputs/) run through the caffepy command.

Every case must end with its exit code and exactly one error line on stderr (besides
Caffe's INFO / WARNING log lines): `caffepy: error: ...`, no traceback, no signal,
at most a couple of thousand characters, naming what the case says it must (file,
layer, field, key); and the run must leave its input and output directories as it
found them (nothing half-written, no temporary files).

The default suite runs the whole corpus in one batch (a forked child per case, see
bad_inputs/runner.py); the slow variant runs each case through the installed
`caffepy` executable in its own process, and a truncated LMDB under mpiexec.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bad_inputs.corpus import CASES, Context, Fixtures, categories

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "bad_inputs", "runner.py")
GLOG = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+:\d+\] ")
MAX_LINE = 2100


def listing(root):
    """Every path under `root`, relative, with the size of files."""
    out = set()
    for here, dirs, files in os.walk(root):
        for name in dirs:
            out.add(os.path.relpath(os.path.join(here, name), root) + "/")
        for name in files:
            path = os.path.join(here, name)
            out.add((os.path.relpath(path, root), os.path.getsize(path)))
    return out


class Corpus:
    """Every case's inputs written under `root`, and what each directory held before."""

    def __init__(self, root):
        self.root = root
        self.fx = Fixtures(os.path.join(root, "fx"))
        self.jobs, self.names, self.dirs, self.before = [], {}, {}, {}
        for case in CASES:
            inp = os.path.join(root, "in", case.name)
            out = os.path.join(root, "out", case.name)
            os.makedirs(inp)
            os.makedirs(out)
            args, names = case.fn(Context(self.fx, inp, out))
            self.jobs.append({"name": case.name, "args": [str(a) for a in args], "cwd": out, "send": case.send})
            self.names[case.name] = [str(n) for n in names]
            self.dirs[case.name] = (inp, out)
            self.before[case.name] = (listing(inp), listing(out))
        self.fixtures_before = listing(self.fx.root)

    def run_batch(self):
        cases_file = os.path.join(self.root, "cases.json")
        results_file = os.path.join(self.root, "results.json")
        with open(cases_file, "w") as f:
            json.dump(self.jobs, f)
        # this tree's caffepy first (the venv's may be another checkout's), then the caller's path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE), HERE,
                                                                         os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, RUNNER, cases_file, results_file], env=env, cwd=self.root,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(results_file) as f:
            return {r["name"]: r for r in json.load(f)}

    def run_each(self):
        """Each case through the `caffepy` executable, in its own process."""
        from bad_inputs.runner import due
        exe = shutil.which("caffepy", path=os.path.dirname(sys.executable)) or shutil.which("caffepy")
        assert exe, "the caffepy command is not installed"
        results = {}
        for job in self.jobs:
            out_path, err_path = (os.path.join(self.root, f"{job['name']}.{s}") for s in ("stdout", "stderr"))
            with open(out_path, "w") as out, open(err_path, "w") as err:
                proc = subprocess.Popen([exe, *job["args"]], cwd=job["cwd"], stdout=out, stderr=err,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"))
                send, start = job["send"], time.perf_counter()
                while proc.poll() is None and time.perf_counter() - start < 300:
                    if send and due(send, job["cwd"], err_path):
                        proc.send_signal(signal.Signals[send["signal"]])
                        send = None
                    time.sleep(0.005)
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            killed = -proc.returncode if proc.returncode < 0 else None
            with open(out_path) as out, open(err_path) as err:
                results[job["name"]] = {"name": job["name"], "code": None if killed else proc.returncode,
                                        "signal": killed, "stdout": out.read(), "stderr": err.read()}
        return results


def check(corpus, case, result):
    """The contract of a bad input: one line, the right code, what it names, nothing written."""
    err = result["stderr"]
    assert result["signal"] is None, f"killed by {result['signal']}: {err[-2000:]}"
    assert "Traceback" not in err, err[-4000:]
    errors = [line for line in err.splitlines() if not GLOG.match(line)]
    assert len(errors) == 1, f"expected one error line, got {len(errors)}:\n" + "\n".join(
        line[:300] for line in errors[:10])
    line = errors[0]
    assert line.startswith("caffepy: error: "), line[:500]
    assert len(line) <= MAX_LINE, f"{len(line)} characters: {line[:300]}..."
    assert result["code"] == case.code, f"exit {result['code']}, expected {case.code}: {line}"
    for name in corpus.names[case.name]:
        assert name in line, f"{name!r} not in: {line}"
    inp, out = corpus.dirs[case.name]
    before_in, before_out = corpus.before[case.name]
    assert listing(out) == before_out, f"left behind in {out}: {listing(out) - before_out}"
    assert listing(inp) == before_in, f"changed in {inp}: {listing(inp) ^ before_in}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from caffepy import log
    quiet = log._quiet
    built = Corpus(str(tmp_path_factory.mktemp("bad_inputs")))
    log.set_quiet(quiet)
    return built


@pytest.fixture(scope="module")
def batch(corpus):
    return corpus.run_batch()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_input(corpus, batch, case):
    check(corpus, case, batch[case.name])


def test_corpus_covers_every_category_and_leaves_fixtures_alone(corpus, batch):
    counts = {cat: sum(1 for c in CASES if c.category == cat) for cat in categories()}
    assert set(counts) == {"syntax", "names", "wiring", "sizes", "caffemodel", "solverstate", "mean",
                           "lmdb", "tools", "solver_values", "signals", "augment", "detection"}
    assert all(n >= 5 for n in counts.values()), counts
    assert listing(corpus.fx.root) == corpus.fixtures_before
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.slow
def test_every_case_through_the_installed_command(tmp_path):
    corpus = Corpus(str(tmp_path))
    results = corpus.run_each()
    failures = []
    for case in CASES:
        try:
            check(corpus, case, results[case.name])
        except AssertionError as e:
            failures.append(f"{case.name}: {str(e)[:500]}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.mpi
def test_truncated_lmdb_under_mpiexec(tmp_path):
    """Every rank reports the damaged database; none dies of a signal."""
    from bad_inputs.corpus import solver, train_val
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec in the venv")
    fx = Fixtures(str(tmp_path / "fx"))
    db = str(tmp_path / "db")
    shutil.copytree(fx.db, db)
    with open(os.path.join(db, "data.mdb"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(db, "data.mdb")) // 2)
    (tmp_path / "net.prototxt").write_text(train_val(db))
    (tmp_path / "solver.prototxt").write_text(solver(str(tmp_path / "net.prototxt")))
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "caffepy.cli", "train", "--solver",
                           str(tmp_path / "solver.prototxt")], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    err = proc.stderr
    assert "Traceback" not in err and "signal" not in err.lower() and "Bus error" not in err, err[-3000:]
    for rank in (0, 1):
        assert re.search(rf"caffepy: error: \[rank {rank}\] .*data\.mdb: damaged LMDB: truncated", err), err[-3000:]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("snap")]
