"""What `make bench` computes beside the clock: FLOPs of a training iteration (counted by hand
here), the nets every framework trains (benchmarks/nets.py), the figures of the table
(benchmarks/bench_nets.py) and the declarative layer benchmark's rows (benchmarks/bench_layers.py).
No timing is asserted."""
import os
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_layers  # noqa: E402
import bench_nets  # noqa: E402
import nets  # noqa: E402

from caffepy.layer import LAYERS  # noqa: E402
from caffepy.net import TRAIN, Net  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402


def _net(text):
    return Net(text_format.Parse(text, caffe_pb2.NetParameter()), TRAIN)


def _input(name, dims):
    return (f"layer {{ name: '{name}' type: 'Input' top: '{name}' "
            f"input_param {{ shape {{ {' '.join(f'dim: {d}' for d in dims)} }} }} }}")


HEAD = _input("data", [2, 16, 6, 6]) + _input("label", [2])
TAIL = """
layer { name: 'ip' type: 'InnerProduct' bottom: 'conv_nchw' top: 'ip'
        inner_product_param { num_output: 10 weight_filler { type: 'xavier' } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' }
"""
CONV = """
layer { name: 'conv' type: 'Convolution' bottom: '%s' top: 'conv'
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 %s
                            weight_filler { type: 'xavier' } } }
"""
# by hand: conv 16 -> 16 channels, 3 x 3, pad 1 on 2 x 16 x 6 x 6: 2 x 36 outputs x 2304 weights
CONV_FWD = 2 * (2 * 6 * 6) * (16 * 16 * 3 * 3)
IP_FWD = 2 * 2 * (16 * 6 * 6) * 10           # 2 items x 576 inputs x 10 outputs


def test_layer_flops_by_hand():
    assert nets.layer_flops("Convolution", (2, 16, 6, 6), 16 * 16 * 9) == CONV_FWD
    # a grouped convolution's weight blob already holds C/group inputs per output
    assert nets.layer_flops("Convolution", (8, 256, 27, 27), 256 * 48 * 25) == \
        2 * 8 * 27 * 27 * 256 * 48 * 25
    # a blocked top [N, C/V, H, W, V]: the spatial size at 2, 3 as well
    assert nets.layer_flops("Convolution", (2, 2, 6, 6, 8), 16 * 16 * 9) == CONV_FWD
    assert nets.layer_flops("InnerProduct", (2, 10), 576 * 10) == IP_FWD
    # InnerProduct with axis 2: every position before the axis is a row
    assert nets.layer_flops("InnerProduct", (3, 5, 7), 11 * 7) == 2 * 15 * 11 * 7


def test_training_flops_counts_each_pass_by_hand():
    # the first convolution computes no bottom gradient (its bottom is the data): forward and
    # weight gradient; the InnerProduct all three passes
    # (Caffe's engine: no Winograd, so every pass executes as counted)
    net = _net(HEAD + CONV % ("data", "engine: CAFFE") +
               "layer { name: 'alias' type: 'Split' bottom: 'conv' top: 'conv_nchw' }" + TAIL)
    direct, executed = nets.training_flops(net)
    assert direct == executed == 2 * CONV_FWD + 3 * IP_FWD


def test_training_flops_counts_channels_last_winograd_per_pass():
    """The channels-last Convolution chooses per pass (forward, weights, data): each Winograd
    pass counts its tile's products, and the data pass is left out for the first layer."""
    net = _net(HEAD + CONV % ("data", "") +
               "layer { name: 'alias' type: 'Split' bottom: 'conv' top: 'conv_nchw' }" + TAIL)
    conv = next(layer for layer in net.layers if layer.type == "Convolution")
    if conv.pass_tiles["forward"] is None:
        pytest.skip("this build has no Winograd kernel")

    def products(m):
        return 2 * (m + 2) ** 2 * (2 * (-(-6 // m)) ** 2) * 16 * 16     # 2 images of tiles
    direct, executed = nets.training_flops(net)
    assert direct == 2 * CONV_FWD + 3 * IP_FWD
    assert executed == (products(conv.pass_tiles["forward"]) + products(conv.pass_tiles["weights"])
                        + 3 * IP_FWD)


def test_training_flops_counts_winograd_gemms_as_executed():
    blocked = (HEAD + "layer { name: 'pack' type: 'IntelPack' bottom: 'data' top: 'data_b' }"
               + CONV % ("data_b", "%s")
               + "layer { name: 'unpack' type: 'IntelUnpack' bottom: 'conv' top: 'conv_nchw' }"
               + TAIL)
    net = _net(blocked % "")
    conv = next(layer for layer in net.layers if layer.type == "Convolution")
    if not getattr(conv, "winograd", False):
        pytest.skip("this build has no Winograd kernel")
    # 6 x 6 output: F(3 x 3, 3 x 3) tiles (25 products each, 4 per image) are the fewest products
    assert conv.pass_tiles["forward"] == 3
    winograd_fwd = 2 * 25 * (2 * 4) * 16 * 16
    direct, executed = nets.training_flops(net)
    assert direct == 2 * CONV_FWD + 3 * IP_FWD
    assert executed == 2 * winograd_fwd + 3 * IP_FWD
    # asking for Caffe's algorithm: no Winograd, executed = direct
    forced = Net(nets.force_caffe(text_format.Parse(blocked % "", caffe_pb2.NetParameter())), TRAIN)
    assert nets.training_flops(forced) == (direct, direct)


def test_force_caffe_sets_every_engine_and_plain_drops_the_packs():
    param = nets.train_net("alexnet_intel", 2)
    types = [lp.type for lp in param.layer]
    assert "IntelPack" in types and "IntelUnpack" in types
    assert [lp.name for lp in param.layer[:2]] == ["data", "label"]
    assert param.layer[0].input_param.shape[0].dim == [2, 3, 227, 227]
    forced = nets.force_caffe(param)
    assert forced.engine == "CAFFE"
    for lp in forced.layer:
        if lp.type in ("Convolution", "Pooling", "LRN", "ReLU"):
            field = nets._type_param(lp.type)
            assert getattr(lp, field).engine == caffe_pb2.ConvolutionParameter.CAFFE, lp.name
    plain = nets.train_net("alexnet", 2)
    assert not {"IntelPack", "IntelUnpack"} & {lp.type for lp in plain.layer}
    fc6 = next(lp for lp in plain.layer if lp.name == "fc6")
    conv1 = next(lp for lp in plain.layer if lp.name == "conv1")
    assert fc6.bottom == ["pool5"] and conv1.bottom == ["data"]


def test_deploy_nets_train_on_a_loss_with_batch_statistics():
    param = nets.train_net("resnet50", 3)
    assert param.layer[-1].type == "SoftmaxWithLoss" and list(param.layer[-1].bottom)[1] == "label"
    bn = [lp for lp in param.layer if lp.type == "BatchNorm"]
    assert bn and not any(lp.batch_norm_param.HasField("use_global_stats") for lp in bn)
    assert param.layer[0].input_param.shape[0].dim[0] == 3


def test_table_figures():
    assert bench_nets.summary({0: 10.0, 1: 14.0, 2: 12.0}) == (12.0, pytest.approx(1 / 6))
    # caffepy vs X: X's time over caffepy's, per round, then the median and range
    assert bench_nets.ratio({0: 20.0, 1: 33.0, 2: 40.0}, {0: 10.0, 1: 11.0, 2: 10.0}) == (3.0, 2.0, 4.0)
    assert bench_nets.ratio({0: 1.0}, {1: 1.0}) is None
    log = ("I1124 07:00:00.0 1 caffe.cpp:415] Average Forward pass: 20.5 ms.\n"
           "I1124 07:00:00.0 1 caffe.cpp:417] Average Backward pass: 40.25 ms.\n"
           "I1124 07:00:00.0 1 caffe.cpp:419] Average Forward-Backward: 61 ms.\n")
    assert bench_nets._caffe_average(log) == 61.0
    assert bench_nets._caffe_average("F1124 check failed") is None
    env = bench_nets.thread_env(1)
    assert all(env[k] == "1" for k in bench_nets.THREAD_VARS)


def test_caffepy_worker_reports_flops_and_layer_times():
    class Args:
        net, batch, force_caffe, forward_only, iters = "lenet", 2, False, False, 1
    worker = bench_nets.CaffepyWorker(Args)
    info = worker.info()
    assert (info["flops"], info["executed_flops"]) == nets.training_flops(worker.net)
    sample = worker.step(2)
    assert [name for name, *_ in sample["layers"]] == [layer.name for layer in worker.net.layers]
    assert sample["ms"] == pytest.approx(sum(f + b for _, _, f, b in sample["layers"]))


def test_layer_benchmark_rows_name_registered_types_and_parse():
    for row in bench_layers.ROWS:
        assert row.type in LAYERS, row
        bench_layers.layer_param(row.type, row.params, n_bottom=len(row.shapes))
        assert bench_layers.label(row).startswith(row.type)
    assert bench_layers.label(bench_layers.ROWS[0]) == \
        "Convolution (AlexNet conv2) 16x96x27x27"


def test_layer_benchmark_times_every_variant_of_a_row(capsys, monkeypatch):
    small = bench_layers.Row("ReLU", "", [(2, 16, 4, 4)], in_place=True)
    monkeypatch.setattr(bench_layers, "ROWS", [small])
    monkeypatch.setattr(bench_layers, "ALEXNET_CONV1", (2, 3, 4, 4))
    bench_layers.main(["--reps", "1", "--no-torch"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("ReLU") or line.startswith(" " * 64)]
    names = [line[65:85].split()[0] for line in lines]
    assert names == list(LAYERS["ReLU"]), out
    assert "plain *" in out
    assert np.isfinite(float(lines[0][85:94]))


def test_multihost_cli_view_reads_the_train_log():
    """bench_multihost's CLI view takes its iteration times from the solver's display lines,
    the waits from the rank report (strategies.rank_report) and the allreduce from the line
    the strategy logs at start; a display of D iterations counts D times."""
    import bench_multihost

    from caffepy.parallel.strategies import rank_report
    report = rank_report(5, [[10.0, 1.0, 0.5], [10.0, 2.0, 0.0]], 2, images=128)
    log = "\n".join([
        "I1129 06:24:08.241546 1 strategies.py:168] Allreduce: 243.9 MB of gradients in 8 buckets, "
        "progress: thread, algorithm: ring (2 ranks, 2.4 MB pieces)",
        "I1129 06:24:09.000000 1 solver.py:315] Iteration 2 (0.2 iter/s, 5.0s/1 iters), loss = 6.9",
        "I1129 06:24:14.000000 1 solver.py:315] Iteration 3 (0.25 iter/s, 8.0s/2 iters), loss = 6.9",
        f"I1129 06:24:14.000001 1 strategies.py:237] {report}"])
    assert bench_multihost.cli_iterations(log, 2) == [4.0]
    # rank 1 worked 0.25 s an iteration less: 0.5 s of its gradient wait was for rank 0
    assert bench_multihost._WAITS.findall(log) == [("12.5", "5.0")]
    assert bench_multihost._GRADIENTS.search(log).groups() == ("243.9", "thread", "ring (2 ranks, 2.4 MB pieces)")
    assert [name for name, _ in bench_multihost.cli_modes(2)] == ["none", "default", "flat ring"]
    # the solver displays at 0, D, 2D, ... below max_iter: --iters timed lines after the skip
    for display in (1, 4, 20):
        shown = range(0, bench_multihost.cli_max_iter(2, 3, display), display)
        assert len([i for i in shown if i > 2]) == 3
    assert [name for name, _ in bench_multihost.cli_modes(1, wire=True)] == ["none", "default", "bfloat16"]


@pytest.mark.parametrize("name", sorted(nets.DEPLOY))
def test_deploy_nets_take_the_batch_and_keep_the_test_phase(name):
    """bench_inference's nets: an Input `data` of the batch asked for, no training-only layer
    (data layers, losses), and AlexNet without Intel's pack / unpack layers."""
    param = nets.test_net(name, 3)
    inputs = [lp for lp in param.layer if lp.type == "Input"]
    assert [list(lp.input_param.shape[0].dim)[0] for lp in inputs] == [3]
    types = {lp.type for lp in param.layer}
    assert not types & {"Data", "SoftmaxWithLoss", "Accuracy", "IntelPack", "IntelUnpack"}


def test_inference_agreement_is_relative_to_the_largest_value():
    import bench_inference
    want = np.array([[0.5, -2.0], [1.0, 0.0]], np.float32)
    assert bench_inference.agreement(want, want.ravel()) == 0
    assert bench_inference.agreement(want, want + np.float32(0.02)) == pytest.approx(0.01)
