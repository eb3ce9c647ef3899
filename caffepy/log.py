"""User-facing output in glog's line shape, so Caffe's log tools keep working.

    I1122 13:39:22.381027 12345 solver.py:204] Iteration 100, loss = 0.123

Under MPI only rank 0 writes INFO lines unless `everyone=True`; warnings and
errors from any rank carry `[rank N]`.

glog's environment switches are honoured, for the CLI and the Python API alike:
    GLOG_minloglevel      drop messages below this severity (0 INFO, 1 WARNING, 2 ERROR)
    GLOG_logtostderr      everything to stderr, no log files
    GLOG_log_dir          also write glog's files there: one per severity, each holding that
                          severity and the ones above, named
                          <program>.<hostname>.<user>.log.<SEVERITY>.<yyyymmdd-hhmmss>.<pid>,
                          with a <program>.<SEVERITY> symlink to the newest
    GLOG_alsologtostderr  with GLOG_log_dir: every message to stderr too (the `caffepy` command
                          always does this, as Caffe's tool sets FLAGS_alsologtostderr)
    GLOG_stderrthreshold  with GLOG_log_dir: messages at or above it go to stderr too (default 2)
Unlike glog, nothing is written to /tmp when GLOG_log_dir is unset: every message goes to stderr.
The switches are read at the first message; `configure()` reads them again.
"""
import contextlib
import datetime
import getpass
import os
import socket
import sys

INFO, WARNING, ERROR = 0, 1, 2
_NAMES = ("INFO", "WARNING", "ERROR")

_rank = 0
_size = 1
_quiet = False
_settings = None
_files = {}          # severity -> open log file
_bar = None          # the progress bar showing on stderr's terminal, if any


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


@contextlib.contextmanager
def quieted():
    """No INFO lines in the block (a tool building a net only to look at it)."""
    global _quiet
    before, _quiet = _quiet, True
    try:
        yield
    finally:
        _quiet = before


class _Progress:
    def __init__(self, items, label, length):
        import click
        self.bar = click.progressbar(items, length=length, label=label, file=sys.stderr)

    def __enter__(self):
        global _bar
        items = self.bar.__enter__()
        _bar = self.bar
        return items

    def __exit__(self, *exc):
        global _bar
        _bar = None
        return self.bar.__exit__(*exc)


def progress(items, label, length=None):
    """`with progress(items, label) as items:` a long tool's loop. On a terminal (stderr, rank 0,
    INFO lines shown) a bar counts the items, the log lines written meanwhile printed above it;
    elsewhere (a log file, a pipe) the items alone: the tool's own periodic lines say how far it got,
    as Caffe's do. `length` for items that have no len()."""
    if _rank == 0 and not _quiet and sys.stderr.isatty():
        return _Progress(items, label, length)
    return contextlib.nullcontext(items)


def rank_prefix():
    return f"[rank {_rank}] " if _size > 1 else ""


def _env_int(name, default):
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        return default


def _env_bool(name):
    # gflags' spellings of true
    return os.environ.get(name, "").strip().lower() in ("1", "t", "true", "y", "yes")


def configure(program=None, also_to_stderr=False):
    """(Re)read the GLOG_* switches; close any log files opened under the previous ones.

    `program` names the log files (default: the script's name); `also_to_stderr` is Caffe's
    FLAGS_alsologtostderr = 1, which its command-line tool sets whatever the environment says.
    """
    global _settings
    for f in _files.values():
        f.close()
    _files.clear()
    if program is None:
        program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "python"
    _settings = {
        "min": _env_int("GLOG_minloglevel", 0),
        "to_stderr_only": _env_bool("GLOG_logtostderr"),
        "also": also_to_stderr or _env_bool("GLOG_alsologtostderr"),
        "threshold": _env_int("GLOG_stderrthreshold", ERROR),
        "dir": os.environ.get("GLOG_log_dir", ""),
        "program": program,
    }


def _log_file(severity, now):
    """glog's file for `severity`, created at its first message, and its symlink."""
    f = _files.get(severity)
    if f is not None:
        return f
    s = _settings
    name = (f"{s['program']}.{socket.gethostname()}.{_user()}.log.{_NAMES[severity]}."
            f"{now:%Y%m%d-%H%M%S}.{os.getpid()}")
    path = os.path.join(s["dir"], name)
    try:
        f = open(path, "a")
    except OSError as e:
        sys.stderr.write(f"Could not create log file: {path}: {e.strerror}\n")
        s["dir"] = ""          # as glog: carry on with stderr alone
        return None
    f.write(f"Log file created at: {now:%Y/%m/%d %H:%M:%S}\n"
            f"Running on machine: {socket.gethostname()}\n"
            "Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg\n")
    link = os.path.join(s["dir"], f"{s['program']}.{_NAMES[severity]}")
    try:
        if os.path.islink(link):
            os.unlink(link)
        os.symlink(name, link)
    except OSError:
        pass               # a symlink is a convenience; glog ignores failures too
    _files[severity] = f
    return f


def _user():
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "invalid-user"


def _emit(severity, msg, depth):
    if _settings is None:
        configure()
    s = _settings
    if severity < s["min"]:
        return
    frame = sys._getframe(depth)   # inspect.stack() costs milliseconds per line
    now = datetime.datetime.now()
    stamp = now.strftime(f"{'IWE'[severity]}%m%d %H:%M:%S.%f")
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    line = f"{stamp} {os.getpid():5d} {where}] {msg}\n"
    to_files = bool(s["dir"]) and not s["to_stderr_only"]
    if to_files:
        for level in range(severity, -1, -1):     # the INFO file holds everything, ...
            f = _log_file(level, now)
            if f is not None:
                f.write(line)
                f.flush()
        to_files = bool(s["dir"])
    if not to_files or s["also"] or severity >= s["threshold"]:
        if _bar is not None:
            sys.stderr.write("\r\033[K")       # the line goes above the bar, which is drawn again
        sys.stderr.write(line)
        sys.stderr.flush()
        if _bar is not None:
            _bar._last_line = None       # click skips drawing a line it drew last: draw it again
            _bar.render_progress()


def info(msg, everyone=False):
    if _quiet or (_rank != 0 and not everyone):
        return
    _emit(INFO, (rank_prefix() if everyone else "") + msg, 2)


def warning(msg):
    _emit(WARNING, rank_prefix() + msg, 2)


def error(msg):
    _emit(ERROR, rank_prefix() + msg, 2)
