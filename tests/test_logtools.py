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


# -- Caffe's plot_training_log.py: eight chart types, several logs -----------------------------------

def test_chart_types_are_caffes_numbers():
    assert logtools.CHART_TYPES == [
        "Test accuracy  vs. Iters", "Test accuracy  vs. Seconds", "Test loss  vs. Iters", "Test loss  vs. Seconds",
        "Train learning rate  vs. Iters", "Train learning rate  vs. Seconds", "Train loss  vs. Iters",
        "Train loss  vs. Seconds"]
    # the command's help lists them
    help_text = CliRunner().invoke(main, ["plot_log", "--help"]).output
    assert logtools.chart_types_text("      ") in help_text


@pytest.mark.parametrize("chart, xs, ys", [
    (0, [0, 200], [0.0912, 0.98]),
    (1, [1.0, 7.0], [0.0912, 0.98]),
    (2, [0, 200], [2.30937, 0.05]),
    (3, [1.0, 7.0], [2.30937, 0.05]),
    # parse_log.sh's train table: the "lr = " lines, and the display's smoothed total loss
    (4, [0, 100, 200], [0.01, 0.001, 1e-04]),
    (5, [1.1, 3.1, 5.1], [0.01, 0.001, 1e-04]),
    (6, [0, 100, 200], [2.31482, 0.21, 0.1]),
    (7, [1.1, 3.1, 5.1], [2.31482, 0.21, 0.1]),
])
def test_each_chart_reads_what_caffes_parser_reads(caffe_log, chart, xs, ys):
    assert logtools.chart_series(str(caffe_log), chart) == (xs, ys)


def test_test_outputs_by_name_else_by_caffes_positions(tmp_path):
    path = tmp_path / "named.log"
    path.write_text(CAFFE_LOG.replace("#0: accuracy", "#0: top-1").replace("#1: loss", "#1: xent"))
    # no output named accuracy or loss: output #0 and #1, as parse_log.sh takes them
    assert logtools.chart_series(str(path), 0)[1] == [0.0912, 0.98]
    assert logtools.chart_series(str(path), 2)[1] == [2.30937, 0.05]
    path.write_text(CAFFE_LOG.replace("#0: accuracy", "#0: loss_a").replace("#1: loss", "#1: top1_accuracy"))
    assert logtools.chart_series(str(path), 0)[1] == [2.30937, 0.05]       # by name, wherever it is
    assert logtools.chart_series(str(path), 2)[1] == [0.0912, 0.98]


def test_several_logs_on_one_chart(caffe_log, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    other = tmp_path / "faster.log"
    other.write_text(CAFFE_LOG.replace("loss = 0.21", "loss = 0.11"))
    drawn = {}

    def keep(plt, fig, png):
        ax = fig.axes[0]
        drawn.update(title=ax.get_title(), x=ax.get_xlabel(), y=ax.get_ylabel(),
                     labels=[t.get_text() for t in ax.get_legend().get_texts()],
                     lines=[(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()])
        return real(plt, fig, png)
    real = logtools._save_figure
    monkeypatch.setattr(logtools, "_save_figure", keep)
    out = tmp_path / "loss.png"
    result = CliRunner().invoke(main, ["plot_log", "6", str(out), str(caffe_log), str(other)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == dict(title="Train loss  vs. Iters", x="Iters", y="Train loss", labels=["lenet", "faster"],
                         lines=[([0, 100, 200], [2.31482, 0.21, 0.1]), ([0, 100, 200], [2.31482, 0.11, 0.1])])


@pytest.mark.parametrize("args, message", [
    (["8", "o.png", "LOG"], "plot_log: chart_type: must be 0 to 7, got 8. Chart types:"),
    (["1"], "give CHART_TYPE OUT.png LOG [LOG...]"),
    (["0", "o.png", "none.log"], "none.log: cannot read the log"),
])
def test_plot_log_mistakes(caffe_log, tmp_path, args, message):
    args = [str(caffe_log) if a == "LOG" else str(tmp_path / a) if a.endswith(".log") else a for a in args]
    result = CliRunner().invoke(main, ["plot_log", *args])
    assert result.exit_code in (1, 2) and message in result.output, result.output
