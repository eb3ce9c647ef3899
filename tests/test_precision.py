"""bf16 (caffepy/precision.py): the rounding against a NumPy reference and torch, the setting
and its refusal without bf16 kernels or CAFFEPY_BF16=emulate, which kernel path runs (from the
CPU's flags and CAFFEPY_BF16), the factory's choices in a net,
float32 master weights in training, the CLI's -precision flag, and LeNet's accuracy on the
bundled digits (benchmarks/bench_bf16.py measures the rest)."""
import re

import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import text_format

import caffepy
from caffepy import log, precision
from caffepy.cli import main
from caffepy.errors import CaffepyError, UsageError
from caffepy.kernels.reference.bf16 import round_bf16 as reference
from caffepy.net import TEST, Net
from caffepy.proto import caffe_pb2


@pytest.fixture
def emulate(monkeypatch):
    """CAFFEPY_BF16=emulate for the test; the process's precision back to f32 after it."""
    monkeypatch.setenv("CAFFEPY_BF16", "emulate")
    precision._warn_emulated.cache_clear()       # once per process: once per test here
    yield
    precision.set_precision("f32")


@pytest.fixture
def no_bf16_cpu(monkeypatch):
    """A CPU without bf16 instructions (AVX2 only), CAFFEPY_BF16 unset."""
    monkeypatch.delenv("CAFFEPY_BF16", raising=False)
    monkeypatch.setattr(precision.device, "cpu_flags", lambda: {"avx2", "fma"})


KERNELS_HERE = precision.hardware() is not None and precision.kernel() is not None
needs_kernels = pytest.mark.skipif(not KERNELS_HERE, reason="this CPU runs no bf16 kernels")


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_rounding_matches_the_reference_over_every_magnitude():
    gen = np.random.default_rng(0)
    # random bit patterns: every exponent, subnormals included (NaNs and infinities apart)
    u = gen.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32)
    x = x[np.isfinite(x)]
    np.testing.assert_array_equal(_bits(precision.round_bf16(x)), _bits(reference(x)))


def test_ties_go_to_even_and_the_rest_to_nearest():
    kept = np.array([0x3F80, 0x3F81, 0xBF81, 0x0001, 0x7F7E], np.uint32) << 16   # even, odd, -odd
    cases = {0x8000: "tie", 0x7FFF: "below half", 0x8001: "above half", 0x0000: "exact"}
    for low, what in cases.items():
        x = (kept | low).view(np.float32)
        got = _bits(precision.round_bf16(x)) >> 16
        odd = (kept >> 16) & 1
        want = (kept >> 16) + {0x8000: odd, 0x7FFF: 0, 0x8001: 1, 0x0000: 0}[low]
        np.testing.assert_array_equal(got, want, err_msg=what)


def test_infinities_nans_signs_and_overflow():
    specials = np.array([np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38,
                         np.float32(3.3895314e38)], np.float32)
    got = precision.round_bf16(specials)
    np.testing.assert_array_equal(got[:4], specials[:4])
    assert np.signbit(got[3])
    assert got[4] == np.inf and got[5] == -np.inf           # past bf16's largest: infinity
    assert got[6] == np.float32(3.3895314e38)               # bf16's largest stays
    # NaNs whose payload sits in the dropped bits alone must not become infinities
    nans = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F81FFFF], np.uint32).view(np.float32)
    out = precision.round_bf16(nans)
    assert np.isnan(out).all() and (_bits(out) & 0xFFFF == 0).all()
    np.testing.assert_array_equal(np.signbit(out), [False, True, False, False])


def test_rounding_in_place_and_against_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * 1e3
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(precision.round_bf16(x), want)
    precision.round_bf16(x, out=x)
    np.testing.assert_array_equal(x, want)


def test_bf16_is_refused_without_kernels_or_the_emulation_opt_in(monkeypatch, no_bf16_cpu):
    with pytest.raises(CaffepyError, match=r"^-precision bf16: this CPU has no bf16 instructions "
                                           r"\(AVX512_BF16 or AMX-BF16\); CAFFEPY_BF16=emulate"):
        precision.set_precision("bf16")
    with pytest.raises(CaffepyError, match="set_precision\\('bf16'\\): .*CAFFEPY_BF16=emulate"):
        caffepy.set_precision("bf16")
    assert precision.current() == "f32"
    monkeypatch.setenv("CAFFEPY_BF16", "yes")
    with pytest.raises(CaffepyError, match="CAFFEPY_BF16: must be 'emulate', 'avx512_bf16' or "
                                           "unset, got 'yes'"):
        precision.set_precision("bf16")
    with pytest.raises(UsageError, match="unknown precision 'fp16'; accepted: f32 .* or bf16"):
        precision.set_precision("fp16")


SPR = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"}


def test_the_kernel_path_follows_the_cpu_and_caffepy_bf16(monkeypatch):
    monkeypatch.delenv("CAFFEPY_BF16", raising=False)
    assert precision.kernel(SPR)[1] == "AMX-BF16"
    assert precision.kernel(SPR - {"amx_tile"})[1] == "AVX512_BF16"
    assert precision.kernel({"avx512f", "avx512_bf16"}) is None         # no BW, VL
    assert precision.kernel({"avx2", "fma"}) is None
    monkeypatch.setenv("CAFFEPY_BF16", "avx512_bf16")
    assert precision.kernel(SPR)[1] == "AVX512_BF16"
    monkeypatch.setenv("CAFFEPY_BF16", "emulate")
    assert precision.kernel(SPR) is None


def test_availability_names_the_kernels_or_why_there_are_none(monkeypatch):
    monkeypatch.delenv("CAFFEPY_BF16", raising=False)
    assert "this CPU has no bf16 instructions" in precision.availability({"avx2", "fma"})
    line = precision.availability({"avx512f", "avx512_bf16", "amx_bf16"})
    assert "this CPU has AMX-BF16, AVX512_BF16, but not what caffepy's bf16 kernels need" in line
    assert precision.availability(SPR).startswith("AMX-BF16 kernels (bf16-rounded operands")
    monkeypatch.setenv("CAFFEPY_BF16", "emulate")
    assert precision.availability(SPR).startswith("CAFFEPY_BF16=emulate: bf16's arithmetic emulated")


NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 3 dim: 2 dim: 6 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 } } }
"""


def _net():
    p = caffe_pb2.NetParameter()
    text_format.Parse(NET, p)
    caffepy.set_random_seed(5)
    return Net(p, TEST)


def test_a_bf16_net_runs_its_convolutions_and_inner_products_in_bf16(emulate):
    f32 = _net()
    caffepy.set_precision("BF16")
    assert caffepy.get_precision() == "bf16"
    bf16 = _net()
    assert {layer.name: layer.variant for layer in bf16.layers if layer.type in precision.TYPES} == \
        {"conv": "bf16", "ip": "bf16"}
    assert all(precision.of(layer) == "f32" for layer in bf16.layers if layer.type not in precision.TYPES)
    assert all(b.layout is None for b in bf16.blobs.values())      # no channels-last region
    assert precision.summary(bf16.layers) == \
        "Precision per layer: bf16 (emulated): conv, ip; f32: the other 3 layer(s)"
    x = np.random.default_rng(2).standard_normal((3, 2, 6, 6)).astype(np.float32)
    for name in ("conv", "ip"):
        bf16.params[name][0].data[...] = f32.params[name][0].data
    out32 = f32.forward(data=x)["ip"].copy()
    out16 = bf16.forward(data=x)["ip"]
    # the same net up to bf16's rounding: close, not equal
    assert 0 < np.abs(out16 - out32).max() < 0.05 * np.abs(out32).max()
    precision.set_precision("f32")
    assert _net().layers[1].variant != "bf16"


SOLVER = """
base_lr: 0.1 lr_policy: "fixed" momentum: 0 weight_decay: 0 max_iter: 1 display: 0
random_seed: 3 snapshot_after_train: false
net_param {
  name: "fit"
  layer { name: "data" type: "DummyData" top: "x" top: "y"
    dummy_data_param { shape { dim: 4 dim: 6 } shape { dim: 4 dim: 2 }
      data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
  layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
    inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.3 }
      bias_filler { type: "constant" value: 0 } } }
  layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "y" top: "loss" }
}
"""


def test_training_keeps_float32_master_weights_and_updates_them_with_the_bf16_gradient(emulate):
    from caffepy.solvers import Solver
    precision.set_precision("bf16")
    p = caffe_pb2.SolverParameter()
    text_format.Parse(SOLVER, p)
    solver = Solver(p)
    layer = solver.net.layer_dict["ip"]
    assert layer.variant == "bf16"
    w0 = layer.blobs[0].data.copy()
    solver.step(1)
    x = solver.net.blobs["x"].data.astype(np.float64)
    dy = (solver.net.blobs["ip"].data - solver.net.blobs["y"].data).astype(np.float64) / 4
    grad = reference(dy.astype(np.float32)).astype(np.float64).T @ reference(x.astype(np.float32))
    w1 = layer.blobs[0].data
    assert w1.dtype == np.float32
    np.testing.assert_allclose(w1, w0 - 0.1 * grad, rtol=1e-5, atol=1e-6)
    # an update smaller than bf16's step lands: the master weights are not bf16 values
    assert (_bits(w1) & 0xFFFF).any()


def _caffepy(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def test_cli_refuses_an_unknown_precision_in_one_line():
    for action, flag in (("train", "--solver"), ("test", "--model"), ("time", "--model")):
        result = _caffepy(action, flag, "x", "-precision", "fp8")
        lines = [line for line in result.output.splitlines() if line]
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert "'--precision': unknown precision 'fp8'; accepted: f32" in lines[0] and "bf16" in lines[0]


def test_cli_bf16_without_kernels_or_the_opt_in_is_one_line_and_exit_1(tmp_path, monkeypatch,
                                                                        no_bf16_cpu):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    result = _caffepy("time", "-model", "net.prototxt", "-iterations", "1", "-precision", "bf16")
    lines = [line for line in result.output.splitlines() if line]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("caffepy: error: -precision bf16: this CPU ") and "CAFFEPY_BF16=emulate" in lines[0]


def test_time_says_which_precision_each_layer_ran_in(tmp_path, monkeypatch, emulate):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    log.set_quiet(False)
    try:
        result = _caffepy("time", "-model", "net.prototxt", "-iterations", "1", "-precision", "bf16",
                          "-forward_only")
    finally:
        log.set_quiet(True)
    assert result.exit_code == 0, result.output
    assert re.search(r"bf16 emulated \(CAFFEPY_BF16=emulate\): Convolution and InnerProduct", result.stderr)
    assert "Precision per layer: bf16 (emulated): conv, ip; f32: the other 3 layer(s)" in result.stderr
    assert re.search(r"conv\tbf16 emulated: bf16-rounded operands, float32 GEMM", result.stderr)


@needs_kernels
def test_with_kernels_bf16_runs_without_the_opt_in_and_says_which(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CAFFEPY_BF16", raising=False)
    (tmp_path / "net.prototxt").write_text(NET)
    name = precision.kernel()[1]
    precision._say_kernel.cache_clear()
    log.set_quiet(False)
    try:
        result = _caffepy("time", "-model", "net.prototxt", "-iterations", "1", "-precision", "bf16",
                          "-forward_only")
        every = _caffepy("time", "-model", "net.prototxt", "-iterations", "1", "-precision", "all")
    finally:
        log.set_quiet(True)
        precision.set_precision("f32")
    assert result.exit_code == 0, result.output
    assert f"bf16 on {name} kernels: Convolution and InnerProduct" in result.stderr
    assert f"Precision per layer: bf16 ({name}): conv, ip; f32: the other 3 layer(s)" in result.stderr
    assert re.search(rf"conv\tbf16 {name}: bf16-rounded operands, float32 sums", result.stderr)
    assert every.exit_code == 0, every.output
    assert re.search(rf"   bf16: [0-9.]+ ms \([0-9.]+x f32; {name} kernels\)", every.stderr)
    assert precision.current() == "f32"
