"""Run bad-input cases through the caffepy command, each in its own process.

    python runner.py CASES.json RESULTS.json [WORKERS]

Each case ({"name", "args", "cwd"}) runs the real click entry point with its
arguments in a child forked from this warmed-up interpreter (importing caffepy,
NumPy and OpenCV costs more than most cases), with stdout and stderr on their
own files; an exception that escapes the command prints its traceback and exits
1, as the interpreter would. A child killed by a signal (the SIGBUS of a
truncated LMDB) is reported as such; WORKERS (2) children run at a time.
A case with a "send" ({"signal", "stderr" or "path"}) gets that signal once its
stderr holds the text, or once a file matching the glob exists in its directory.
Results: {"name", "code", "signal", "stdout", "stderr", "seconds"} per case.
"""
import glob
import json
import os
import signal
import sys
import tempfile
import time
import traceback

# what the commands import anyway, loaded once before forking; no kernel has run an
# OpenMP region yet, so each child starts its own thread team
import caffepy.actions  # noqa: F401
import caffepy.cli
import caffepy.data.tools  # noqa: F401
import caffepy.logtools  # noqa: F401
import caffepy.net  # noqa: F401
import caffepy.parallel.split_db  # noqa: F401
import caffepy.solvers  # noqa: F401

TIMEOUT = 120


def _child(case, out_path, err_path):
    code = 1
    try:
        os.chdir(case["cwd"])
        for fd, path in ((1, out_path), (2, err_path)):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(handle, fd)
            os.close(handle)
        try:
            caffepy.cli.main(case["args"], prog_name="caffepy")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _start(case, scratch):
    out_path = os.path.join(scratch, case["name"] + ".stdout")
    err_path = os.path.join(scratch, case["name"] + ".stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(case, out_path, err_path)
    return {"case": case, "pid": pid, "start": time.perf_counter(), "out": out_path, "err": err_path}


def due(send, cwd, err_path):
    """Whether a case's signal is due: its text on stderr, or its glob in the directory."""
    if "path" in send:
        return bool(glob.glob(os.path.join(cwd, send["path"])))
    try:
        with open(err_path, errors="replace") as f:
            return send["stderr"] in f.read()
    except OSError:
        return False


def _finish(job, status):
    result = {"name": job["case"]["name"], "seconds": time.perf_counter() - job["start"],
              "code": None, "signal": None}
    if os.WIFSIGNALED(status):
        result["signal"] = signal.Signals(os.WTERMSIG(status)).name
    else:
        result["code"] = os.WEXITSTATUS(status)
    for key, path in (("stdout", job["out"]), ("stderr", job["err"])):
        with open(path, errors="replace") as f:
            result[key] = f.read()
    return result


def run(cases, scratch, workers):
    """Every case, `workers` at a time; results in the order of `cases`."""
    pending, running, results = list(cases), {}, {}
    while pending or running:
        while pending and len(running) < workers:
            job = _start(pending.pop(0), scratch)
            running[job["pid"]] = job
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in running:
            job = running.pop(pid)
            results[job["case"]["name"]] = _finish(job, status)
            continue
        for job in list(running.values()):
            send = job["case"].get("send")
            if send and not job.get("sent") and due(send, job["case"]["cwd"], job["err"]):
                os.kill(job["pid"], signal.Signals[send["signal"]])
                job["sent"] = True
            if time.perf_counter() - job["start"] > TIMEOUT:
                os.kill(job["pid"], signal.SIGKILL)
        time.sleep(0.005)
    return [results[case["name"]] for case in cases]


def main(cases_file, results_file, workers="2"):
    with open(cases_file) as f:
        cases = json.load(f)
    with tempfile.TemporaryDirectory() as scratch:
        results = run(cases, scratch, max(1, int(workers)))
    with open(results_file, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
