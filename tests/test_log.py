"""glog's switches (GLOG_minloglevel, GLOG_logtostderr, GLOG_log_dir, GLOG_alsologtostderr,
GLOG_stderrthreshold) in the Python API and the `caffepy` command, and glog's file naming."""
import getpass
import os
import re
import socket
import subprocess
import sys

import pytest

from caffepy import log

GLOG = ("GLOG_minloglevel", "GLOG_logtostderr", "GLOG_log_dir", "GLOG_alsologtostderr",
        "GLOG_stderrthreshold")


@pytest.fixture
def glog(monkeypatch):
    """Set GLOG_* switches for the Python API; the defaults come back afterwards."""
    for name in GLOG:
        monkeypatch.delenv(name, raising=False)
    log.set_quiet(False)

    def switch(program="script", **env):
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        log.configure(program=program)
    yield switch
    for name in GLOG:
        monkeypatch.delenv(name, raising=False)
    log.configure()


def say_all():
    log.info("an info line")
    log.warning("a warning line")
    log.error("an error line")


def lines(text):
    """Severity letter + message of each glog-shaped line."""
    return [line[0] + line.split("] ", 1)[1] for line in text.splitlines()
            if re.match(r"[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+:\d+\] ", line)]


def test_without_switches_everything_goes_to_stderr(glog, capsys):
    glog()
    say_all()
    assert lines(capsys.readouterr().err) == ["Ian info line", "Wa warning line", "Ean error line"]


@pytest.mark.parametrize("level,expected", [(1, ["Wa warning line", "Ean error line"]), (2, ["Ean error line"]),
                                            (3, [])])
def test_minloglevel_drops_lower_severities(glog, capsys, level, expected):
    glog(GLOG_minloglevel=level)
    say_all()
    assert lines(capsys.readouterr().err) == expected


def glog_files(directory, program):
    host, user = socket.gethostname(), getpass.getuser()
    pattern = re.compile(rf"{re.escape(program)}\.{re.escape(host)}\.{re.escape(user)}\.log\."
                         r"(INFO|WARNING|ERROR)\.\d{8}-\d{6}\.(\d+)$")
    found = {}
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            found[m.group(1)] = (name, int(m.group(2)))
    return found


def test_log_dir_writes_glogs_files_and_symlinks(glog, capsys, tmp_path):
    glog(GLOG_log_dir=tmp_path)
    say_all()
    files = glog_files(tmp_path, "script")
    assert sorted(files) == ["ERROR", "INFO", "WARNING"]
    assert all(pid == os.getpid() for _, pid in files.values())
    for severity, expected in [("INFO", ["Ian info line", "Wa warning line", "Ean error line"]),
                               ("WARNING", ["Wa warning line", "Ean error line"]),
                               ("ERROR", ["Ean error line"])]:
        name = files[severity][0]
        text = (tmp_path / name).read_text()
        assert text.startswith("Log file created at: ")
        assert "Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg" in text
        assert lines(text) == expected
        link = tmp_path / f"script.{severity}"
        assert link.is_symlink() and os.readlink(link) == name
    # glog's default stderrthreshold (2): only errors reach stderr when files are written
    assert lines(capsys.readouterr().err) == ["Ean error line"]


def test_stderrthreshold_and_alsologtostderr(glog, capsys, tmp_path):
    glog(GLOG_log_dir=tmp_path, GLOG_stderrthreshold=1)
    say_all()
    assert lines(capsys.readouterr().err) == ["Wa warning line", "Ean error line"]
    glog(GLOG_log_dir=tmp_path, GLOG_alsologtostderr="true")
    say_all()
    assert lines(capsys.readouterr().err) == ["Ian info line", "Wa warning line", "Ean error line"]


def test_logtostderr_writes_no_files(glog, capsys, tmp_path):
    glog(GLOG_log_dir=tmp_path, GLOG_logtostderr=1)
    say_all()
    assert os.listdir(tmp_path) == []
    assert len(lines(capsys.readouterr().err)) == 3


def test_unwritable_log_dir_falls_back_to_stderr(glog, capsys, tmp_path):
    glog(GLOG_log_dir=tmp_path / "missing")
    say_all()
    err = capsys.readouterr().err
    assert "Could not create log file" in err
    assert lines(err) == ["Ian info line", "Wa warning line", "Ean error line"]


NET = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 } } }\n'
       'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
       'inner_product_param { num_output: 2 } }\n')


def run(args, tmp_path, **env):
    full = {k: v for k, v in os.environ.items() if k not in GLOG}
    full.update({k: str(v) for k, v in env.items()})
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                          cwd=tmp_path) as proc:
        stdout, stderr = proc.communicate(timeout=120)
    proc.stdout, proc.stderr = stdout, stderr
    return proc


def test_python_api_honours_minloglevel(tmp_path):
    (tmp_path / "net.prototxt").write_text(NET)
    script = "import caffepy; caffepy.Net('net.prototxt', caffepy.TEST)"
    loud = run([sys.executable, "-c", script], tmp_path)
    assert loud.returncode == 0 and "Setting up ip" in loud.stderr
    quiet = run([sys.executable, "-c", script], tmp_path, GLOG_minloglevel=1)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_cli_log_dir_keeps_stderr_and_names_files_caffepy(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    proc = run([sys.executable, "-m", "caffepy.cli", "device_query"], tmp_path, GLOG_log_dir=logs)
    assert proc.returncode == 0, proc.stderr
    assert "Vector ISA:" in proc.stderr             # Caffe's tool sets alsologtostderr
    files = glog_files(logs, "caffepy")
    assert list(files) == ["INFO"] and files["INFO"][1] == proc.pid
    assert "Vector ISA:" in (logs / "caffepy.INFO").read_text()


def test_cli_minloglevel_and_logtostderr(tmp_path):
    proc = run([sys.executable, "-m", "caffepy.cli", "device_query"], tmp_path, GLOG_minloglevel=1)
    assert proc.returncode == 0 and "Vector ISA:" not in proc.stderr
    proc = run([sys.executable, "-m", "caffepy.cli", "device_query"], tmp_path, GLOG_logtostderr=1,
               GLOG_log_dir=tmp_path)
    assert proc.returncode == 0 and "Vector ISA:" in proc.stderr
    assert glog_files(tmp_path, "caffepy") == {}


class Terminal:
    """A stderr that says it is a terminal and keeps what is written."""

    def __init__(self, tty=True):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text += text

    def flush(self):
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_on_a_terminal_log_lines_everywhere(glog, monkeypatch, tty):
    glog()
    err = Terminal(tty)
    monkeypatch.setattr(sys, "stderr", err)
    seen = []
    with log.progress(range(4), "convert_imageset") as items:
        for i in items:
            seen.append(i)
            if i == 1:
                log.info("Processed 2 files.")
    assert seen == [0, 1, 2, 3]
    assert "] Processed 2 files.\n" in err.text        # Caffe's line, terminal or not
    if tty:
        # the log line erases the bar's line, then the bar is drawn again where it was, below it
        before, after = err.text.split("] Processed 2 files.\n")
        assert before.startswith("\r\033[?25lconvert_imageset  [") and "\r\033[KI" in before
        assert before.rsplit("\r", 2)[-2].endswith("25%")
        assert after.split("\r")[1].endswith("25%") and err.text.rstrip().endswith("100%\033[?25h")
    else:
        assert "convert_imageset" not in err.text and "\r" not in err.text


def test_no_progress_bar_when_quiet_or_on_other_ranks(glog, monkeypatch):
    glog()
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    log.set_quiet(True)
    with log.progress([1, 2], "x") as items:
        assert list(items) == [1, 2]
    log.set_quiet(False)
    monkeypatch.setattr(log, "_rank", 1)
    with log.progress([1, 2], "x") as items:
        assert list(items) == [1, 2]
    assert err.text == ""
