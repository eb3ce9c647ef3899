"""User-facing output in glog's line shape, so Caffe's log tools keep working.

    I1122 13:39:22.381027 12345 solver.py:204] Iteration 100, loss = 0.123

Under MPI only rank 0 writes INFO lines unless `everyone=True`; warnings and
errors from any rank carry `[rank N]`.
"""
import datetime
import os
import sys

_rank = 0
_size = 1
_quiet = False


def fmt(x):
    """A number as C++'s ostream prints it by default (6 significant digits)."""
    return f"{x:.6g}"


def set_rank(rank, size):
    global _rank, _size
    _rank, _size = rank, size


def set_quiet(quiet):
    """Silence INFO lines (used by tests and the Python API)."""
    global _quiet
    _quiet = quiet


def rank_prefix():
    return f"[rank {_rank}] " if _size > 1 else ""


def _emit(level, msg, depth):
    frame = sys._getframe(depth)   # inspect.stack() costs milliseconds per line
    now = datetime.datetime.now()
    stamp = now.strftime(f"{level}%m%d %H:%M:%S.%f")
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    sys.stderr.write(f"{stamp} {os.getpid():5d} {where}] {msg}\n")
    sys.stderr.flush()


def info(msg, everyone=False):
    if _quiet or (_rank != 0 and not everyone):
        return
    _emit("I", (rank_prefix() if everyone else "") + msg, 2)


def warning(msg):
    _emit("W", rank_prefix() + msg, 2)


def error(msg):
    _emit("E", rank_prefix() + msg, 2)
