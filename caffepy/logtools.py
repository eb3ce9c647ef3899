"""Training-log tools: Caffe's parse_log (LOG.train / LOG.test tables), the eight charts of
Caffe's plot_training_log.py (several logs on one), and caffepy's one-log overview plot.

A table row per iteration: NumIters, Seconds (since the "Solving" line),
LearningRate (the last "lr = " seen, as Caffe's parser does), then one column
per net output name.  Test rows take the iteration of the "Iteration N,
Testing net" line above them.
"""
import collections
import csv
import datetime
import io
import math
import os
import re

from . import log
from .errors import CaffepyError

_ITERATION = re.compile(r"Iteration (\d+)")
_TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+|nan|inf|-inf)")
_TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+|nan|inf|-inf)")
_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")
_STAMP = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?")


def _stamp(line, year):
    m = _STAMP.match(line)
    if not m:
        return None
    month, day, hour, minute, second, frac = m.groups()
    micro = int((frac or "0").ljust(6, "0")[:6])
    try:
        return datetime.datetime(year, int(month), int(day), int(hour), int(minute), int(second), micro)
    except ValueError:
        return None


def _read_lines(logfile):
    try:
        with open(logfile, errors="replace") as f:
            return f.read().splitlines()
    except OSError as e:
        raise CaffepyError(f"{logfile}: cannot read the log: {e.strerror}") from None


def _timeline(logfile):
    """(iteration, seconds, line) for each line from the first that names an iteration on:
    seconds since the "Solving" line (else the first stamped line), as Caffe's extract_seconds."""
    lines = _read_lines(logfile)
    year = datetime.datetime.fromtimestamp(os.path.getmtime(logfile)).year
    start = None
    for line in lines:
        if "Solving" in line:
            start = _stamp(line, year)
            if start is not None:
                break
    if start is None:
        for line in lines:
            start = _stamp(line, year)
            if start is not None:
                break
    iteration = -1
    previous = start
    for line in lines:
        m = _ITERATION.search(line)
        if m:
            iteration = int(m.group(1))
        if iteration == -1:
            continue     # before the first iteration (net set-up lines)
        stamp = _stamp(line, year)
        if stamp is not None and previous is not None and stamp < previous - datetime.timedelta(days=180):
            # the log crossed New Year
            year += 1
            stamp = _stamp(line, year)
        if stamp is not None:
            previous = stamp
        seconds = (previous - start).total_seconds() if previous is not None and start is not None else 0.0
        yield iteration, seconds, line


def parse_log(logfile):
    """Parse a caffe/caffepy training log into (train_rows, test_rows): lists of
    OrderedDicts with NumIters, Seconds, LearningRate and one key per output."""
    train_rows, test_rows = [], []
    train_row = test_row = None
    rate = float("nan")
    for iteration, seconds, line in _timeline(logfile):
        m = _LEARNING_RATE.search(line)
        if m:
            rate = float(m.group(1))
        train_row = _net_output(_TRAIN_OUTPUT, line, train_row, train_rows, iteration, seconds, rate)
        test_row = _net_output(_TEST_OUTPUT, line, test_row, test_rows, iteration, seconds, rate)
    # a complete last row is kept (Caffe's parser loses it when it is the only one);
    # one that never filled up (an interrupted run) is dropped
    for row, rows in ((train_row, train_rows), (test_row, test_rows)):
        if row is not None and (not rows or len(row) == len(rows[0])):
            rows.append(row)
    for rows in (train_rows, test_rows):
        # the first train rows come before any "lr =" line: take the next row's rate
        if len(rows) > 1 and math.isnan(rows[0]["LearningRate"]):
            rows[0]["LearningRate"] = rows[1]["LearningRate"]
    return train_rows, test_rows


def _net_output(regex, line, row, rows, iteration, seconds, rate):
    m = regex.search(line)
    if m:
        if row is None or row["NumIters"] != iteration:
            if row is not None:
                rows.append(row)
            row = collections.OrderedDict([("NumIters", iteration), ("Seconds", seconds),
                                           ("LearningRate", rate)])
        row[m.group(2)] = float(m.group(3))
    if row is not None and rows and len(row) == len(rows[0]):
        rows.append(row)
        row = None
    return row


def write_table(path, rows, delimiter=","):
    if not rows:
        log.info(f"Not writing {path}; no lines to write")
        return False
    fields = list(rows[0].keys())
    for row in rows[1:]:
        fields.extend(k for k in row if k not in fields)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields, delimiter=delimiter, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    from .prototxt import atomic_write
    atomic_write(path, text.getvalue().encode())
    return True


def parse_log_command(logfile, output_dir, delimiter=","):
    """`caffepy parse_log LOG OUTDIR`: write OUTDIR/<LOG name>.train and .test."""
    if len(delimiter) != 1:
        raise CaffepyError(f"parse_log: --delimiter: must be one character, got '{delimiter}'")
    train_rows, test_rows = parse_log(logfile)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise CaffepyError(f"{output_dir}: cannot create the output directory: {e.strerror}") from None
    base = os.path.join(output_dir, os.path.basename(logfile))
    write_table(base + ".train", train_rows, delimiter)
    write_table(base + ".test", test_rows, delimiter)
    return base + ".train", base + ".test"


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CaffepyError("plot_log: needs matplotlib, which is not installed. "
                           "Install it with: pip install matplotlib (or pip install 'caffepy[plot]')") from None
    return plt


def _save_figure(plt, fig, png):
    image = io.BytesIO()
    try:
        fig.savefig(image, format=os.path.splitext(png)[1].lstrip(".").lower() or "png")
    except ValueError as e:
        raise CaffepyError(f"{png}: cannot write: {e}") from None
    finally:
        plt.close(fig)
    from .prototxt import atomic_write
    atomic_write(png, image.getvalue())
    return png


def plot_log(logfile, png):
    """Draw training loss, test outputs and the learning rate against iterations (caffepy's
    overview of one log; plot_chart draws Caffe's charts)."""
    plt = _pyplot()
    train_rows, test_rows = parse_log(logfile)
    if not train_rows and not test_rows:
        raise CaffepyError(f"{logfile}: no 'Train net output' or 'Test net output' lines to plot; "
                           f"is this a training log?")
    fig, axes = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    for ax, rows, title in ((axes[0], train_rows, "train"), (axes[1], test_rows, "test")):
        names = [k for k in (rows[0] if rows else {}) if k not in ("NumIters", "Seconds", "LearningRate")]
        for name in names:
            xs = [r["NumIters"] for r in rows if name in r]
            ax.plot(xs, [r[name] for r in rows if name in r], label=f"{title} {name}")
        ax.set_ylabel(f"{title} outputs")
        if names:
            ax.legend(loc="best")
        ax.grid(True, alpha=0.3)
    rows = train_rows or test_rows
    axes[2].plot([r["NumIters"] for r in rows], [r["LearningRate"] for r in rows])
    axes[2].set_ylabel("learning rate")
    axes[2].set_xlabel("iterations")
    axes[2].grid(True, alpha=0.3)
    fig.suptitle(os.path.basename(logfile))
    fig.tight_layout()
    return _save_figure(plt, fig, png)


# -- Caffe's tools/extra/plot_training_log.py: eight charts, several logs on one ---------------------
# Every y field against every x field, numbered in the script's order (its fields sorted by name)
SEPARATOR = "  vs. "
CHART_TYPES = [f"{y}{SEPARATOR}{x}" for y in ("Test accuracy", "Test loss", "Train learning rate", "Train loss")
               for x in ("Iters", "Seconds")]
_DISPLAY_LOSS = re.compile(r"Iteration (\d+)(?: \([^)]*\))?, loss = ([-+.\deE]+|nan|inf|-inf)")
_RATE_LINE = re.compile(r"Iteration (\d+), lr = ([-+.\deE]+|nan|inf|-inf)")


def chart_types_text(indent="    "):
    return "\n".join(f"{indent}{i}: {name}" for i, name in enumerate(CHART_TYPES))


def _test_column(logfile, rows, word, position):
    """The test output a chart of `word` plots: the one named so, else the first whose name holds
    it, else Caffe's parse_log.sh's choice, output #`position` (with a warning)."""
    names = [k for k in (rows[0] if rows else {}) if k not in ("NumIters", "Seconds", "LearningRate")]
    for name in [n for n in names if n == word] + [n for n in names if word in n]:
        return name
    if len(names) > position:
        log.warning(f"{logfile}: no test output named '{word}'; plotting output #{position}, "
                    f"'{names[position]}', as Caffe's parse_log.sh does")
        return names[position]
    raise CaffepyError(f"{logfile}: no 'Test net output' lines for a {word} chart"
                       + (f" (its test outputs: {', '.join(names)})" if names else ""))


def chart_series(logfile, chart_type):
    """The (x, y) values chart `chart_type` draws for one log: test outputs from the test rows;
    the train loss from the display lines ("Iteration N (...), loss = X", the smoothed total) and
    the learning rate from the "Iteration N, lr = X" lines, as parse_log.sh reads them."""
    y_field, x_field = CHART_TYPES[chart_type].split(SEPARATOR)
    at = 0 if x_field == "Iters" else 1
    if y_field.startswith("Test"):
        _, rows = parse_log(logfile)
        word, position = ("accuracy", 0) if y_field == "Test accuracy" else ("loss", 1)
        name = _test_column(logfile, rows, word, position)
        points = [((r["NumIters"], r["Seconds"])[at], r[name]) for r in rows if name in r]
    else:
        regex = _RATE_LINE if y_field == "Train learning rate" else _DISPLAY_LOSS
        points = []
        for iteration, seconds, line in _timeline(logfile):
            m = regex.search(line)
            if m:
                points.append(((int(m.group(1)), seconds)[at], float(m.group(2))))
        if not points:
            raise CaffepyError(f"{logfile}: no '{'lr' if regex is _RATE_LINE else 'loss'} = ' display lines "
                               f"for a {y_field.lower()} chart; is this a training log?")
    return [p[0] for p in points], [p[1] for p in points]


def plot_chart(chart_type, png, logfiles):
    """Caffe's plot_training_log.py: chart `chart_type` (0-7, CHART_TYPES) of every log in
    `logfiles` on one figure, each labelled with its file name less `.log`."""
    if not 0 <= chart_type < len(CHART_TYPES):
        raise CaffepyError(f"plot_log: chart_type: must be 0 to {len(CHART_TYPES) - 1}, got {chart_type}. "
                           f"Chart types:\n{chart_types_text()}")
    series = [(path, *chart_series(path, chart_type)) for path in logfiles]
    plt = _pyplot()
    y_field, x_field = CHART_TYPES[chart_type].split(SEPARATOR)
    fig, ax = plt.subplots(figsize=(8, 6))
    markers = "os^vDx+*"
    for i, (path, xs, ys) in enumerate(series):
        name = os.path.basename(path)
        label = name[:-len(".log")] if name.endswith(".log") else name
        ax.plot(xs, ys, label=label, marker=markers[i % len(markers)], markevery=max(1, len(xs) // 40),
                linewidth=0.75)
    loud = "loss" in y_field or "learning rate" in y_field
    ax.legend(loc="upper right" if loud else "lower right", ncol=1)
    ax.set_title(CHART_TYPES[chart_type])
    ax.set_xlabel(x_field)
    ax.set_ylabel(y_field)
    return _save_figure(plt, fig, png)
