"""The CLI surface: gflags spellings, help, usage errors and exit codes."""
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from caffepy.cli import gflags_to_click, main


@pytest.mark.parametrize("args,expected", [
    (["-solver", "s.prototxt"], ["--solver", "s.prototxt"]),
    (["-solver=s.prototxt"], ["--solver=s.prototxt"]),
    (["--solver", "s.prototxt"], ["--solver", "s.prototxt"]),
    (["--solver=s.prototxt"], ["--solver=s.prototxt"]),
    (["-gray"], ["--gray"]),
    (["-gray=true"], ["--gray"]),
    (["-gray=false"], ["--no-gray"]),
    (["-iterations", "-5"], ["--iterations", "-5"]),
    (["in/", "list.txt"], ["in/", "list.txt"]),
])
def test_gflags_spellings(args, expected):
    assert gflags_to_click(args, {"gray"}) == expected


def test_bad_boolean_value_is_a_usage_error():
    result = CliRunner().invoke(main, ["convert_imageset", "-gray=maybe", "a/", "b", "c"])
    assert result.exit_code == 2
    assert "expected true or false" in result.output


def test_snapshot_and_weights_together_is_a_usage_error():
    result = CliRunner().invoke(main, ["train", "-solver", "s.prototxt", "-snapshot", "a.solverstate",
                                       "-weights", "w.caffemodel"])
    assert result.exit_code == 2
    assert "--snapshot or --weights, not both" in result.output


def test_train_without_solver_is_a_usage_error():
    result = CliRunner().invoke(main, ["train"])
    assert result.exit_code == 2
    assert "--solver" in result.output


def test_unknown_sigint_effect_lists_choices():
    result = CliRunner().invoke(main, ["train", "-solver", "s", "-sigint_effect", "explode"])
    assert result.exit_code == 2
    assert "stop" in result.output and "snapshot" in result.output


def test_help_lists_caffe_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("train", "test", "time", "device_query", "convert_imageset", "compute_image_mean",
                    "upgrade_net_proto_text", "parse_log"):
        assert command in result.output


def test_device_query_describes_cpu():
    proc = subprocess.run([sys.executable, "-m", "caffepy.cli", "device_query"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Vector ISA:" in proc.stderr and "Threads in use:" in proc.stderr and "MPI:" in proc.stderr


def _device_query(**env):
    environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    environ.update(env)
    proc = subprocess.run([sys.executable, "-m", "caffepy.cli", "device_query"], capture_output=True,
                          text=True, timeout=60, env=environ)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_device_query_names_the_blas_kernel_and_warns_once_when_one_is_forced():
    from caffepy import device
    kernel = device.blas_kernel()
    if kernel is None:
        pytest.skip(f"the BLAS ({device.blas_name()}) does not name its kernel")
    assert f"BLAS: {device.blas_name()}, {kernel} kernel" in _device_query()
    assert "OPENBLAS_CORETYPE" not in _device_query()
    isa = device.vector_isa()[0]
    if isa == "SSE":
        pytest.skip("no older kernel to force on an SSE CPU")
    err = _device_query(OPENBLAS_CORETYPE="Nehalem")
    assert "Nehalem kernel (OPENBLAS_CORETYPE=Nehalem)" in err
    warnings = [line for line in err.splitlines() if line.startswith("W")]
    assert len(warnings) == 1 and f"Nehalem kernel (SSE) on this {isa} CPU" in warnings[0]
    # a kernel as new as the CPU's: named, not warned about
    same = {"AVX": "Sandybridge", "AVX2+FMA": "Haswell", "AVX-512": "SkylakeX"}[isa]
    err = _device_query(OPENBLAS_CORETYPE=same)
    assert f"{same} kernel" in err and not [l for l in err.splitlines() if l.startswith("W")]


def test_missing_model_file_is_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "caffepy.cli", "time", "-model", str(tmp_path / "nope.prototxt"),
                           "-iterations", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if "error" in l]
    assert len(errors) == 1 and "nope.prototxt" in errors[0]


def test_mpi_ranks_share_the_cores_by_default(tmp_path):
    # two ranks on this host each get cores // 2 OpenMP threads unless OMP_NUM_THREADS is set
    import os
    import shutil
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("mpiexec not installed")
    script = tmp_path / "threads.py"
    script.write_text("import os, caffepy\nprint(os.environ['OMP_NUM_THREADS'])\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    expected = str(max(1, len(os.sched_getaffinity(0)) // 2))
    # the launcher may merge the two ranks' lines ("11\n\n"): compare the characters only
    assert "".join(proc.stdout.split()) == expected * 2, proc.stdout


@pytest.mark.parametrize("args", [["-help"], ["--help"], ["help"], ["-h"], []])
def test_every_help_spelling_and_bare_caffepy_print_the_usage(args):
    # bare `caffepy` exits 0 as Caffe's does (its main() returns 0 after printing the usage)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "usage: caffepy <command> <args>" in result.output
    assert "export_onnx" in result.output and "No such option" not in result.output


def test_bare_caffepy_exits_0_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "caffepy.cli"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: caffepy <command> <args>" in proc.stdout


@pytest.mark.parametrize("args", [["help", "train"], ["train", "-help"], ["train", "--help"]])
def test_command_help(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "--solver" in result.output


@pytest.mark.parametrize("command", ["train", "test", "time"])
def test_gpu_flag_is_listed(command):
    result = CliRunner().invoke(main, [command, "--help"])
    assert "--gpu IDS" in result.output and "ignored" in result.output


def test_gpu_is_ignored_with_a_warning_and_checked(tmp_path):
    model = tmp_path / "net.prototxt"
    model.write_text('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 } } }\n'
                     'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                     'inner_product_param { num_output: 2 } }\n')
    base = [sys.executable, "-m", "caffepy.cli", "time", "-model", str(model), "-iterations", "1"]
    proc = subprocess.run(base + ["-gpu", "0,1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^W\d{4} .*\] caffepy runs on the CPU; ignoring --gpu 0,1$", proc.stderr, re.M)
    proc = subprocess.run(base + ["-gpu=one"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--gpu: expected 'all' or comma-separated device ids, got 'one'" \
        in proc.stderr
