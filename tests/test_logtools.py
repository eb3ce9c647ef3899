"""parse_log / plot_log on a log in Caffe's exact shape."""
import builtins
import os

import pytest
from click.testing import CliRunner

from caffepy import logtools
from caffepy.cli import main
from caffepy.errors import CaffepyError

# lines as Caffe 1.0 prints them (set-up noise, a test at 0, displays, a multistep change)
CAFFE_LOG = """\
I1122 10:00:00.000000  4242 caffe.cpp:218] Using GPUs 0
I1122 10:00:01.000000  4242 solver.cpp:44] Initializing solver from parameters:
I1122 10:00:01.500000  4242 net.cpp:84] Creating Layer mnist
I1122 10:00:02.000000  4242 solver.cpp:310] Solving LeNet
I1122 10:00:02.000000  4242 solver.cpp:311] Learning Rate Policy: multistep
I1122 10:00:02.100000  4242 solver.cpp:367] Iteration 0, Testing net (#0)
I1122 10:00:03.000000  4242 solver.cpp:434]     Test net output #0: accuracy = 0.0912
I1122 10:00:03.000000  4242 solver.cpp:434]     Test net output #1: loss = 2.30937 (* 1 = 2.30937 loss)
I1122 10:00:03.100000  4242 solver.cpp:243] Iteration 0 (0 iter/s, 1.1s/100 iters), loss = 2.31482
I1122 10:00:03.100000  4242 solver.cpp:259]     Train net output #0: loss = 2.31482 (* 1 = 2.31482 loss)
I1122 10:00:03.100000  4242 sgd_solver.cpp:138] Iteration 0, lr = 0.01
I1122 10:00:05.100000  4242 solver.cpp:243] Iteration 100 (50 iter/s, 2s/100 iters), loss = 0.21
I1122 10:00:05.100000  4242 solver.cpp:259]     Train net output #0: loss = 0.2 (* 1 = 0.2 loss)
I1122 10:00:05.100000  4242 sgd_solver.cpp:46] MultiStep Status: Iteration 100, step = 1
I1122 10:00:05.100000  4242 sgd_solver.cpp:138] Iteration 100, lr = 0.001
I1122 10:00:07.100000  4242 solver.cpp:243] Iteration 200 (50 iter/s, 2s/100 iters), loss = 0.1
I1122 10:00:07.100000  4242 solver.cpp:259]     Train net output #0: loss = 1e-05 (* 1 = 1e-05 loss)
I1122 10:00:07.100000  4242 sgd_solver.cpp:138] Iteration 200, lr = 1e-04
I1122 10:00:08.000000  4242 solver.cpp:367] Iteration 200, Testing net (#0)
I1122 10:00:09.000000  4242 solver.cpp:434]     Test net output #0: accuracy = 0.98
I1122 10:00:09.000000  4242 solver.cpp:434]     Test net output #1: loss = 0.05 (* 1 = 0.05 loss)
I1122 10:00:09.500000  4242 solver.cpp:464] Snapshotting to binary proto file lenet_iter_200.caffemodel
I1122 10:00:09.600000  4242 solver.cpp:320] Optimization Done.
"""


@pytest.fixture
def caffe_log(tmp_path):
    path = tmp_path / "lenet.log"
    path.write_text(CAFFE_LOG)
    return path


def test_parse_log_rows_match_caffes_parser(caffe_log):
    train, test = logtools.parse_log(str(caffe_log))
    assert [dict(r) for r in train] == [
        {"NumIters": 0, "Seconds": 1.1, "LearningRate": 0.01, "loss": 2.31482},
        {"NumIters": 100, "Seconds": 3.1, "LearningRate": 0.01, "loss": 0.2},
        {"NumIters": 200, "Seconds": 5.1, "LearningRate": 0.001, "loss": 1e-05},
    ]
    assert [dict(r) for r in test] == [
        # no "lr =" before the first test: Caffe's parser borrows the next row's rate
        {"NumIters": 0, "Seconds": 1.0, "LearningRate": 1e-04, "accuracy": 0.0912, "loss": 2.30937},
        {"NumIters": 200, "Seconds": 7.0, "LearningRate": 1e-04, "accuracy": 0.98, "loss": 0.05},
    ]


def test_parse_log_command_writes_both_tables(caffe_log, tmp_path):
    result = CliRunner().invoke(main, ["parse_log", str(caffe_log), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    train = (tmp_path / "out" / "lenet.log.train").read_text().splitlines()
    test = (tmp_path / "out" / "lenet.log.test").read_text().splitlines()
    assert train == ["NumIters,Seconds,LearningRate,loss", "0,1.1,0.01,2.31482", "100,3.1,0.01,0.2",
                     "200,5.1,0.001,1e-05"]
    assert test == ["NumIters,Seconds,LearningRate,accuracy,loss", "0,1.0,0.0001,0.0912,2.30937",
                    "200,7.0,0.0001,0.98,0.05"]


def test_parse_log_delimiter(caffe_log, tmp_path):
    logtools.parse_log_command(str(caffe_log), str(tmp_path), delimiter="\t")
    assert (tmp_path / "lenet.log.test").read_text().splitlines()[1] == "0\t1.0\t0.0001\t0.0912\t2.30937"


def test_interrupted_last_row_is_dropped(tmp_path):
    cut = CAFFE_LOG.split("    Test net output #1: loss = 0.05")[0]
    path = tmp_path / "cut.log"
    path.write_text(cut)
    _, test = logtools.parse_log(str(path))
    assert [r["NumIters"] for r in test] == [0]


def test_missing_log_is_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["parse_log", str(tmp_path / "none.log"), str(tmp_path)])
    assert result.exit_code == 1
    assert "none.log: cannot read the log: No such file or directory" in result.stderr


def test_plot_log_without_matplotlib_says_how_to_install(caffe_log, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(CaffepyError, match=r"plot_log: needs matplotlib.*pip install matplotlib"):
        logtools.plot_log(str(caffe_log), str(tmp_path / "p.png"))


def test_plot_log_draws_a_png(caffe_log, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    result = CliRunner().invoke(main, ["plot_log", str(caffe_log), str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 1000
