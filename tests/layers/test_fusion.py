"""BatchNorm + Scale (+ ReLU) run as one on the fast path (Net.fusions,
NHWCBatchNorm.forward_with_scale, NHWCScale.backward_with_bn): the fused net computes what the
same net run layer by layer does (tops, parameter gradients, running statistics), in training
and with global statistics, with a plain and a leaky ReLU, and a run that stops inside a unit
sees each layer as written."""
import numpy as np
import pytest

import caffepy
from caffepy import memory
from caffepy.kernels import nhwc as kernels
from caffepy.net import Net

NET = """force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 7 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" %(bn)s }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1"
  scale_param { bias_term: true filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" %(relu)s }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 6 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "bn2" %(bn)s }
layer { name: "scale2" type: "Scale" bottom: "bn2" top: "bn2"
  scale_param { filler { type: "gaussian" std: 0.5 } } }
layer { name: "fc" type: "InnerProduct" bottom: "bn2" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def _twins(path, text, labels):
    """The net of `text` twice, its units fused in the first and run one by one in the second,
    with the same parameters (BatchNorm's statistics positive) and input."""
    path.write_text(text)
    fused, plain = Net(str(path), caffepy.TRAIN), Net(str(path), caffepy.TRAIN)
    plain.fusions = {}
    rng = np.random.default_rng(3)
    for name, layer in fused.layer_dict.items():
        for mine, theirs in zip(layer.blobs, plain.layer_dict[name].blobs):
            if layer.type == "BatchNorm":
                mine.data[...] = np.abs(rng.standard_normal(mine.shape)) + 0.5
            theirs.data[...] = mine.data
    for net in (fused, plain):
        data = net.blobs["data"]
        data.data[...] = np.random.default_rng(0).standard_normal(data.shape)
        net.blobs["label"].data[...] = labels
    return fused, plain


def _nets(tmp_path, bn="", relu=""):
    return _twins(tmp_path / "net.prototxt", NET % {"bn": bn, "relu": relu}, [0, 1, 2, 4])


def _close(a, b, what):
    """Within float rounding of the larger values (a gradient that is zero in exact arithmetic,
    like a bias before a BatchNorm, is rounding noise on both sides)."""
    assert float(np.abs(a - b).max()) <= 2e-5 * max(0.1, float(np.abs(b).max())), what


@pytest.mark.parametrize("relu", ["", "relu_param { negative_slope: 0.1 }"], ids=["relu", "leaky"])
@pytest.mark.parametrize("bn", ["", "batch_norm_param { use_global_stats: true }",
                                "batch_norm_param { stats_batch_size: 2 }"],
                         ids=["batch", "global", "groups"])
def test_fused_units_compute_the_layers(tmp_path, bn, relu):
    fused, plain = _nets(tmp_path, bn, relu)
    units = {fused.layers[i].name: fused.layers[j].name for i, j in fused.fusions.items()}
    assert units == {"bn1": "relu1"}    # bn2 writes a top of its own: its diff is seen
    for step in range(2):              # the second step starts from updated running statistics
        for net in (fused, plain):
            net.clear_param_diffs()
        losses = [net.forward_backward() for net in (fused, plain)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
        assert (fused.blobs["conv1"].data < 0).any() == bool(relu)     # the ReLU's slope ran
        for name in plain.blobs:
            _close(fused.blobs[name].data, plain.blobs[name].data, f"{name} data, step {step}")
            _close(fused.blobs[name].diff, plain.blobs[name].diff, f"{name} diff, step {step}")
        for name, layer in plain.layer_dict.items():
            for i, blob in enumerate(layer.blobs):
                mine = fused.layer_dict[name].blobs[i]
                _close(mine.data, blob.data, f"{name} blob {i}, step {step}")
                _close(mine.diff, blob.diff, f"{name} blob {i} diff, step {step}")


@pytest.mark.parametrize("relu", ["", "relu_param { negative_slope: 0.1 }"], ids=["relu", "leaky"])
def test_fused_unit_with_statistics_groups_against_numpy(tmp_path, relu):
    """bn1 + scale1 + relu1 with groups of 2 images (Intel's bn_stats_batch_size) against the
    formulas in float64: the unit's top, the three statistics blobs, the Scale's gradients and
    the data gradient, each group normalized and differentiated on its own."""
    text = "bn_stats_batch_size: 2\n" + NET % {"bn": "batch_norm_param { moving_average_fraction: 0.9 }",
                                               "relu": relu}
    net, _ = _twins(tmp_path / "net.prototxt", text, [0, 1, 2, 4])
    names = [layer.name for layer in net.layers]
    bn, r = names.index("bn1"), names.index("relu1")
    assert net.fusions[bn] == r
    stats0 = [b.data.astype(np.float64) for b in net.layers[bn].blobs]
    net.forward_from_to(0, bn - 1)
    x = net.blobs["conv1"].data.astype(np.float64)
    net.forward_from_to(bn)
    net.clear_param_diffs()
    net.backward_from_to(end=r + 1)
    dy = net.blobs["conv1"].diff.astype(np.float64)         # the unit's top diff
    net.backward_from_to(r, bn)
    scale = net.layer_dict["scale1"]
    gamma, beta = (b.data.astype(np.float64).reshape(1, -1, 1, 1) for b in scale.blobs)
    slope = 0.1 if relu else 0.0
    ys, dxs, dgamma, dbeta = [], [], 0.0, 0.0
    mean_sum, var_sum, factor = stats0[0], stats0[1], stats0[2][0]
    for g in (slice(0, 2), slice(2, 4)):
        xg = x[g]
        mean, var = xg.mean(axis=(0, 2, 3), keepdims=True), xg.var(axis=(0, 2, 3), keepdims=True)
        m = xg.size // xg.shape[1]
        factor = 0.9 * factor + 1
        mean_sum = mean.ravel() + 0.9 * mean_sum
        var_sum = var.ravel() * m / (m - 1) + 0.9 * var_sum
        xn = (xg - mean) / np.sqrt(var + 1e-5)
        v = gamma * xn + beta
        ys.append(np.where(v > 0, v, slope * v))
        dv = np.where(v > 0, dy[g], slope * dy[g])
        dgamma, dbeta = dgamma + (dv * xn).sum(axis=(0, 2, 3)), dbeta + dv.sum(axis=(0, 2, 3))
        dxn = dv * gamma
        dxs.append((dxn - dxn.mean(axis=(0, 2, 3), keepdims=True)
                    - xn * (dxn * xn).mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(var + 1e-5))
    _close(net.blobs["conv1"].data, np.concatenate(ys), "unit top")
    for blob, want in zip(net.layers[bn].blobs, (mean_sum, var_sum, [factor])):
        _close(blob.data, np.asarray(want), "statistics")
    _close(scale.blobs[0].diff, dgamma, "scale gradient")
    _close(scale.blobs[1].diff, dbeta, "bias gradient")
    _close(net.blobs["conv1"].diff, np.concatenate(dxs), "data gradient")


UNIT_NET = """force_backward: true bn_stats_batch_size: 2
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 3 dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 5 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1"
  scale_param { bias_term: true filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } } }
"""


class _Unit:
    """The fused BatchNorm + Scale of a net as one layer for the gradient checker: its own
    bottom blob (the unit works in place, the checker perturbs its input), the Scale's
    parameters."""
    type, name = "BatchNorm + Scale", "bn1 + scale1"

    def __init__(self, net, first, last):
        self.net, self.first, self.last = net, first, last
        self.blobs = net.layers[last].blobs
        self.param_propagate_down = [True, True]

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        np.copyto(top[0].raw_data, bottom[0].raw_data)
        self.net.forward_from_to(self.first, self.last)

    def backward(self, top, propagate_down, bottom):
        self.net.backward_from_to(self.last, self.first)
        np.copyto(bottom[0].raw_diff, top[0].raw_diff)


def test_fused_unit_with_statistics_groups_passes_the_gradient_checker(tmp_path):
    from caffepy.blob import Blob
    from gradient_checker import check_gradient
    path = tmp_path / "unit.prototxt"
    path.write_text(UNIT_NET)
    net = Net(str(path), caffepy.TRAIN)
    names = [layer.name for layer in net.layers]
    bn, scale = names.index("bn1"), names.index("scale1")
    assert net.fusions == {bn: scale} and net.layers[bn].groups == 2
    net.blobs["data"].data[...] = np.random.default_rng(5).standard_normal(net.blobs["data"].shape)
    net.forward_from_to(0, bn - 1)
    top = net.blobs["conv1"]
    bottom = Blob(top.shape, name="x")
    bottom.layout = top.layout
    np.copyto(bottom.raw_data, top.raw_data)
    check_gradient(_Unit(net, bn, scale), [bottom], [top])


def test_a_relu_with_a_negative_slope_is_not_fused(tmp_path):
    fused, _ = _nets(tmp_path, relu="relu_param { negative_slope: -0.5 }")
    assert {fused.layers[i].name: fused.layers[j].name for i, j in fused.fusions.items()} == \
        {"bn1": "scale1"}


def test_a_run_that_stops_inside_a_unit_runs_its_layers_apart(tmp_path):
    fused, plain = _nets(tmp_path)
    relu = [layer.name for layer in fused.layers].index("relu1")
    for net in (fused, plain):
        net.forward_from_to(0, relu - 1)    # bn1 and scale1 fused, relu1 not run
    _close(fused.blobs["conv1"].data, plain.blobs["conv1"].data, "before relu1")
    assert (fused.blobs["conv1"].data < 0).any()
    for net in (fused, plain):
        net.forward_from_to(relu)
        net.clear_param_diffs()
        net.backward_from_to(end=relu - 1)  # relu1 and scale1 backward, not bn1
    _close(fused.layer_dict["scale1"].blobs[0].diff, plain.layer_dict["scale1"].blobs[0].diff,
           "scale1 gradient")


def test_a_run_that_stops_between_the_pair_runs_them_apart(tmp_path):
    fused, plain = _nets(tmp_path)
    bn = [layer.name for layer in fused.layers].index("bn1")
    for net in (fused, plain):
        net.forward_from_to(0, bn)          # bn1's top: its normalized values, no scale applied
    _close(fused.blobs["conv1"].data, plain.blobs["conv1"].data, "bn1 alone")
    x = fused.blobs["conv1"].data
    assert np.abs(x.mean(axis=(0, 2, 3))).max() < 1e-4      # normalized per channel
    for net in (fused, plain):
        net.forward_from_to(bn + 1)
        net.backward_from_to(end=bn + 1)    # scale1's backward alone, after a split forward
    _close(fused.layer_dict["scale1"].blobs[0].diff, plain.layer_dict["scale1"].blobs[0].diff,
           "scale1 gradient")
    assert fused.layer_dict["bn1"].x_norm is not None


def test_caffes_algorithms_fuse_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CAFFEPY_ENGINE", "CAFFE")
    path = tmp_path / "net.prototxt"
    path.write_text(NET % {"bn": "", "relu": ""})
    assert Net(str(path), caffepy.TRAIN).fusions == {}


def test_bn_scale_kernel():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((70, 5)).astype(np.float32)
    sub, mul, gamma, beta = (rng.standard_normal(5).astype(np.float32) for _ in range(4))
    y, xn = np.empty_like(x), np.empty_like(x)
    kernels.bn_scale_forward(x, sub, mul, gamma, beta, y, xn)
    expected = (x.astype(np.float64) - sub) * mul
    assert np.allclose(xn, expected, rtol=1e-6, atol=1e-6)
    assert np.allclose(y, expected * gamma + beta, rtol=1e-6, atol=1e-6)
    kernels.bn_scale_forward(x, sub, mul, gamma, beta, x, xn)        # in place
    assert np.allclose(x, y)
    with pytest.raises(ValueError, match="gamma"):
        kernels.bn_scale_forward(x, sub, mul, gamma[:4], beta, y, xn)


@pytest.mark.parametrize("slope", [None, 0.0, 0.1])
def test_bn_scale_kernel_streams_xn_with_the_same_bits(slope):
    """On a line-aligned xn with whole vectors of channels the kernel takes its streaming path;
    one float off the line it takes the plain loop: both give the same bits."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((37, 24)).astype(np.float32)
    sub, mul, gamma, beta = (rng.standard_normal(24).astype(np.float32) for _ in range(4))
    aligned = memory.line_empty(x.size + 1)
    outs = []
    for xn in (aligned[:x.size].reshape(x.shape), aligned[1:].reshape(x.shape)):
        y = np.empty_like(x)
        kernels.bn_scale_forward(x, sub, mul, gamma, beta, y, xn, slope)
        outs.append((y, xn.copy()))
    (y0, n0), (y1, n1) = outs
    assert np.array_equal(n0, n1) and np.array_equal(y0, y1)
    v = n0.astype(np.float64) * gamma + beta
    want = np.where(v > 0, v, v * (1.0 if slope is None else slope))
    assert np.allclose(y0, want, rtol=1e-5, atol=1e-5)


# -- Eltwise SUM + ReLU (+ Split) -----------------------------------------------------------------
SUM_NET = """force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 3 dim: 4 dim: 5 dim: 6 } shape { dim: 3 } } }
layer { name: "conv_a" type: "Convolution" bottom: "data" top: "a"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "conv_b" type: "Convolution" bottom: "data" top: "b"
  convolution_param { num_output: 6 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum1" type: "Eltwise" bottom: "a" bottom: "b" top: "sum1" %(coeff)s }
layer { name: "relu1" type: "ReLU" bottom: "sum1" top: "sum1" %(relu)s }
layer { name: "conv_c" type: "Convolution" bottom: "sum1" top: "c"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum2" type: "Eltwise" bottom: "sum1" bottom: "c" top: "sum2" }
layer { name: "relu2" type: "ReLU" bottom: "sum2" top: "sum2" %(relu)s }
layer { name: "fc" type: "InnerProduct" bottom: "sum2" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def _sum_nets(tmp_path, relu="", coeff=""):
    return _twins(tmp_path / "sum.prototxt", SUM_NET % {"relu": relu, "coeff": coeff}, [0, 1, 4])


def _units(net):
    return {net.layers[i].name: net.layers[j].name for i, j in net.fusions.items()}


def _same_everywhere(fused, plain, what):
    for name in plain.blobs:
        np.testing.assert_array_equal(fused.blobs[name].data, plain.blobs[name].data,
                                      f"{name} data, {what}")
        np.testing.assert_array_equal(fused.blobs[name].diff, plain.blobs[name].diff,
                                      f"{name} diff, {what}")
    for name, layer in plain.layer_dict.items():
        for i, blob in enumerate(layer.blobs):
            np.testing.assert_array_equal(fused.layer_dict[name].blobs[i].diff, blob.diff,
                                          f"{name} blob {i} diff, {what}")


@pytest.mark.parametrize("relu", ["", "relu_param { negative_slope: 0.1 }"], ids=["relu", "leaky"])
def test_sum_units_compute_the_layers(tmp_path, relu):
    """sum1's top feeds conv_c and sum2, so the Split after relu1 joins its unit; sum2's does
    not feed two layers. The same float operations in the same order: equal, not close."""
    fused, plain = _sum_nets(tmp_path, relu)
    assert _units(fused) == {"sum1": "sum1_relu1_0_split", "sum2": "relu2"}
    for step in range(2):
        for net in (fused, plain):
            net.clear_param_diffs()
        losses = [net.forward_backward() for net in (fused, plain)]
        assert losses[0] == losses[1]
        assert (fused.blobs["sum1"].data < 0).any() == bool(relu)     # the ReLU's slope ran
        _same_everywhere(fused, plain, f"step {step}")


def test_a_sum_with_coefficients_or_a_negative_slope_is_not_fused(tmp_path):
    fused, _ = _sum_nets(tmp_path, coeff="eltwise_param { coeff: 1 coeff: -1 }")
    assert _units(fused) == {"sum2": "relu2"}
    fused, _ = _sum_nets(tmp_path, relu="relu_param { negative_slope: -0.5 }")
    assert _units(fused) == {}


def test_a_run_that_stops_inside_a_sum_unit_runs_its_layers_apart(tmp_path):
    fused, plain = _sum_nets(tmp_path)
    names = [layer.name for layer in fused.layers]
    relu = names.index("relu1")
    for net in (fused, plain):
        net.forward_from_to(0, relu - 1)    # sum1 alone: its sum, no ReLU
    np.testing.assert_array_equal(fused.blobs["sum1"].data, plain.blobs["sum1"].data)
    assert (fused.blobs["sum1"].data < 0).any()
    for net in (fused, plain):
        net.forward_from_to(relu)
        net.clear_param_diffs()
        net.backward_from_to(end=relu)      # down to relu1: the Split and the ReLU, not sum1
    np.testing.assert_array_equal(fused.blobs["sum1"].diff, plain.blobs["sum1"].diff)
    for net in (fused, plain):
        net.backward_from_to(relu - 1, 0)   # then sum1 and below, as its own layer
    _same_everywhere(fused, plain, "split run")


def test_a_shortcut_split_top_shares_the_sum_diff(tmp_path):
    """sum2's first bottom is a Split's top: after the first fused backward its diff is sum2's
    own (the values the Eltwise would copy there), the other bottom's is not, and every blob
    ends with the values of a net that runs its layers one by one and keeps each diff apart,
    whether the shared net runs fused or layer by layer."""
    fused, apart = _sum_nets(tmp_path)
    apart.fusions = {}                                  # one by one: no diff is joined
    top = fused.blobs["sum2"]
    for step in range(2):
        for net in (fused, apart):
            net.clear_param_diffs()
        losses = [net.forward_backward() for net in (fused, apart)]
        assert losses[0] == losses[1]
        assert [n for n in fused.blobs if n != "sum2" and fused.blobs[n].shares_diff(top)] == \
            ["sum1_relu1_0_split_1"]
        assert not fused.blobs["c"].shares_diff(top)
        assert not any(a.shares_diff(b) for a in apart.blobs.values()
                       for b in apart.blobs.values() if a is not b)
        _same_everywhere(fused, apart, f"step {step}")
        fused.fusions = {}                              # then the joined net one by one


def test_a_reshape_keeps_the_diffs_shared(tmp_path):
    fused, _ = _sum_nets(tmp_path)
    fused.forward_backward()
    fused.blobs["data"].reshape(5, 4, 5, 6)             # a larger batch: new buffers
    fused.blobs["label"].reshape(5)
    fused.reshape()
    fused.forward_backward()
    assert fused.blobs["sum1_relu1_0_split_1"].shares_diff(fused.blobs["sum2"])


def test_no_diff_is_shared_without_a_backward(tmp_path):
    """A net that runs only forwards shares (and allocates) no diff."""
    path = tmp_path / "sum.prototxt"
    path.write_text((SUM_NET % {"relu": "", "coeff": ""}).replace("force_backward: true", ""))
    net = Net(str(path), caffepy.TEST)
    net.forward()
    assert not any(blob.has_diff for blob in net.blobs.values())


# -- the named rules (caffepy/net_rules.py) ---------------------------------------------------------
def test_each_rule_runs_alone(tmp_path):
    """A rule finds its own units in a built net, whatever the other rules find."""
    from caffepy import net_rules
    fused, _ = _nets(tmp_path)
    assert [(u.first, u.last) for u in net_rules.BATCHNORM_SCALE.find(fused)] == \
        sorted(fused.fusions.items())
    assert net_rules.ELTWISE_RELU.find(fused) == []
    summed, _ = _sum_nets(tmp_path)
    assert _units(summed) == {summed.layers[u.first].name: summed.layers[u.last].name
                              for u in net_rules.ELTWISE_RELU.find(summed)}
    assert net_rules.BATCHNORM_SCALE.find(summed) == []
    assert net_rules.compile_net(summed, rules=()) == {}


def test_the_log_names_each_rule_and_what_it_matched(tmp_path, capsys):
    from caffepy import log
    log.set_quiet(False)
    _nets(tmp_path)
    _sum_nets(tmp_path)
    err = capsys.readouterr().err
    assert "BatchNorm+Scale(+ReLU): fused 1 BatchNorm + Scale pair(s), 1 with the ReLU after them" in err
    assert "Eltwise+ReLU(+Split): fused 2 Eltwise + ReLU pair(s), 1 with the Split after them" in err


@pytest.mark.parametrize("where", ["net", "layer"])
def test_engine_caffe_turns_the_rules_off(tmp_path, where):
    """A net's `engine: "CAFFE"` fuses nothing, not even the layout-agnostic Eltwise + ReLU;
    a layer's own keeps that layer out of any unit."""
    text = SUM_NET % {"relu": "", "coeff": ""}
    if where == "net":
        text = 'engine: "CAFFE"\n' + text
    else:
        text = text.replace('top: "sum2" }', 'top: "sum2" engine: "CAFFE" }')
    path = tmp_path / "sum.prototxt"
    path.write_text(text)
    net = Net(str(path), caffepy.TRAIN)
    assert _units(net) == ({} if where == "net" else {"sum1": "sum1_relu1_0_split"})


def test_every_declared_rule_exists():
    from caffepy import net_rules
    from caffepy.layer import LAYERS
    names = {rule.name for rule in net_rules.RULES}
    declared = {name for variants in LAYERS.values() for cls in variants.values() for name in cls.fuses}
    assert declared and declared <= names


# -- Convolution + BatchNorm (+ Scale) (+ ReLU) folded in TEST nets -------------------------------
FOLD_NET = """force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 7 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 1 bias_term: false weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" }
layer { name: "scale2" type: "Scale" bottom: "conv2" top: "conv2" }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 }
  bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn3" type: "BatchNorm" bottom: "conv3" top: "conv3" }
layer { name: "conv4" type: "Convolution" bottom: "conv3" top: "conv4"
  convolution_param { num_output: 5 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn4" type: "BatchNorm" bottom: "conv4" top: "bn4" }
layer { name: "scale4" type: "Scale" bottom: "bn4" top: "bn4" scale_param { bias_term: true } }
layer { name: "conv5" type: "Convolution" bottom: "bn4" top: "conv5"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 }
  bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu5" type: "ReLU" bottom: "conv5" top: "conv5" }
layer { name: "conv6" type: "Convolution" bottom: "conv5" top: "conv6"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu6" type: "ReLU" bottom: "conv6" top: "conv6" }
"""


def _fold_twins(tmp_path, monkeypatch, text=FOLD_NET):
    """FOLD_NET in the TEST phase twice, folded and with CAFFEPY_FOLD=0, same parameters
    (BatchNorm statistics with a factor that is not 1, variances > 0) and input."""
    path = tmp_path / "fold.prototxt"
    path.write_text(text)
    folded = Net(str(path), caffepy.TEST)
    monkeypatch.setenv("CAFFEPY_FOLD", "0")
    plain = Net(str(path), caffepy.TEST)
    monkeypatch.delenv("CAFFEPY_FOLD")
    rng = np.random.default_rng(5)
    for name, layer in folded.layer_dict.items():
        for i, (mine, theirs) in enumerate(zip(layer.blobs, plain.layer_dict[name].blobs)):
            if layer.type == "BatchNorm":
                mine.data[...] = [rng.normal(0, 1, mine.shape), rng.uniform(0.5, 2, mine.shape),
                                  [0.8]][i]
            elif layer.type == "Scale" or (layer.type == "Convolution" and i == 1):
                mine.data[...] = rng.normal(0, 0.7, mine.shape)
            theirs.data[...] = mine.data
    x = rng.standard_normal(folded.blobs["data"].shape)
    for net in (folded, plain):
        net.blobs["data"].data[...] = x
    return folded, plain


def _fold_units(net):
    return {net.layers[u.first].name: net.layers[u.last].name for u in net._units.values()
            if u.rule.name.startswith("Convolution")}


def _same_blobs(folded, plain, what):
    """Folding rounds the products differently: within 1e-5 of each blob's largest value (the
    blobs a chain's unit leaves unwritten aside)."""
    for name in set(plain.blobs) - set(folded.unwritten_blobs()):
        got, want = folded.blobs[name].data, plain.blobs[name].data
        assert float(np.abs(got - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max())), \
            f"{what}: {name}"


def test_folding_finds_in_place_chains_of_test_nets_only(tmp_path, monkeypatch):
    folded, plain = _fold_twins(tmp_path, monkeypatch)
    # bn4 writes a top of its own from conv4's, which nothing else reads: a chain (Intel's
    # Inception-v3 form), conv4 then unwritten; conv5 and conv6 have a ReLU alone (GoogLeNet's)
    assert _fold_units(folded) == {"conv1": "relu1", "conv2": "relu2", "conv3": "bn3",
                                   "conv4": "scale4", "conv5": "relu5", "conv6": "relu6"}
    assert folded.unwritten_blobs() == ["conv4"] and plain.unwritten_blobs() == []
    assert _fold_units(plain) == {}
    (tmp_path / "train.prototxt").write_text(FOLD_NET)
    assert _fold_units(Net(str(tmp_path / "train.prototxt"), caffepy.TRAIN)) == {}


def test_folded_units_compute_the_layers(tmp_path, monkeypatch):
    """Every blob as the layers leave it: the 1 x 1 convolution (GEMM) applies its BatchNorm,
    Scale and ReLU in its epilogue; the 3 x 3 over 3 channels (direct) folds them into its
    weights and takes the ReLU into its stores."""
    folded, plain = _fold_twins(tmp_path, monkeypatch)
    assert folded.layer_dict["conv2"].has_epilogue()
    assert not folded.layer_dict["conv1"].has_epilogue()
    assert folded.layer_dict["conv5"].has_epilogue()
    folded.forward()
    plain.forward()
    _same_blobs(folded, plain, "forward")
    for name in ("conv2", "conv5", "conv6"):
        assert (plain.blobs[name].data == 0).any(), name    # the ReLU cut something


DEPTHWISE_NET = """layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 1 dim: 43 dim: 9 dim: 7 } } }
layer { name: "dw" type: "Convolution" bottom: "data" top: "dw"
  convolution_param { num_output: 43 group: 43 kernel_size: 3 pad: 1 stride: 1
  weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn" type: "BatchNorm" bottom: "dw" top: "dw" }
layer { name: "scale" type: "Scale" bottom: "dw" top: "dw" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "dw" top: "dw" }
"""


FIRST_LAYER_NET = """layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 2 dim: 3 dim: 13 dim: 11 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 21 kernel_size: 3 pad: 1 stride: 2
  weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
"""


WINOGRAD_NET = """layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 2 dim: 12 dim: 10 dim: 9 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 19 kernel_size: 3 pad: 1
  weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
"""


def _relu_alone(text):
    """`text` without its BatchNorm and Scale, its convolution with a bias: GoogLeNet's form."""
    lines = [line for line in text.splitlines() if '"BatchNorm"' not in line
             and '"Scale"' not in line]
    bias = 'bias_filler { type: "gaussian" std: 0.5 } weight_filler {'
    return "\n".join(lines).replace("weight_filler {", bias)


# (text, layer, algorithm, where a NaN goes in)
STORE_RELU = [
    # MobileNet's depthwise + BatchNorm + Scale + ReLU (43 channels: vectors of 32 and 8 and
    # the lane-by-lane rest)
    (DEPTHWISE_NET, "dw", "depthwise", [(0, 35, 4, 3), (0, 41, 2, 2)]),
    # its first layer (3 channels, 3 x 3, stride 2) on the direct kernel (nhwc_direct.h; 21
    # outputs: a whole register block and a part one)
    (FIRST_LAYER_NET, "conv", "direct", [(1, 2, 6, 5)]),
    # Winograd's output transform (19 outputs: two whole blocks of 8 and a part one)
    (WINOGRAD_NET, "conv", "winograd F(2,3)", [(1, 7, 4, 4)]),
    (WINOGRAD_NET, "conv", "winograd F(4,3)", [(0, 11, 9, 8)])]


@pytest.mark.parametrize("alone", [False, True], ids=["batchnorm", "relu-alone"])
@pytest.mark.parametrize("text,layer,algorithm,nan_at", STORE_RELU,
                         ids=["depthwise", "direct", "winograd-F2", "winograd-F4"])
def test_a_unit_takes_its_relu_into_its_store(tmp_path, monkeypatch, text, layer, algorithm,
                                               nan_at, alone):
    """The kernel computes with the folded weights (or the layer's own, for a ReLU alone) and
    clips its sums as it stores them, no ReLU pass after it: the layers' values, and a NaN
    input stays NaN through the unit as through Caffe's ReLU."""
    folded, plain = _fold_twins(tmp_path, monkeypatch, text=_relu_alone(text) if alone else text)
    assert _fold_units(folded) == {layer: "relu"}
    folded.layer_dict[layer].force_algorithm(algorithm)
    ran = []
    # no layer of the unit but the convolution runs (a cost model once ran WINOGRAD_NET's
    # BatchNorm, Scale and ReLU as one pass after the convolution)
    for name, method in (("bn", "forward"), ("bn", "forward_with_scale"), ("scale", "forward"),
                         ("relu", "forward")):
        if name in folded.layer_dict:
            monkeypatch.setattr(folded.layer_dict[name], method, lambda *a: ran.append(a))
    for step in range(2):
        if step:
            for net in (folded, plain):
                for at in nan_at:
                    net.blobs["data"].data[at] = np.nan
        folded.forward()
        plain.forward()
        assert folded.layer_dict[layer].algos["forward"].name == algorithm
        got, want = folded.blobs[layer].data, plain.blobs[layer].data
        assert (want == 0).any() and (want > 0).any()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        assert float(np.abs(got[ok] - want[ok]).max()) <= 1e-5 * float(np.abs(want[ok]).max())
    assert np.isnan(want).sum() > 0 and ran == []


def test_every_algorithm_folds(tmp_path, monkeypatch):
    folded, plain = _fold_twins(tmp_path, monkeypatch)
    folded.forward()
    conv = folded.layer_dict["conv3"]
    names = list(conv.algorithms)
    assert any(name.startswith("winograd") for name in names) and "im2col+gemm" in names
    plain.forward()
    for name in names:
        conv.force_algorithm(name)
        folded.forward()
        _same_blobs(folded, plain, name)


def test_changed_weights_and_statistics_are_folded_again(tmp_path, monkeypatch):
    folded, plain = _fold_twins(tmp_path, monkeypatch)
    folded.forward()
    for net in (folded, plain):
        net.params["conv2"][0].data[0, 0] += 1.0        # pycaffe writes with no signal
        net.params["bn1"][1].data[3] *= 4.0
        net.params["scale2"][0].data[1] = -2.0
        net.forward()
    _same_blobs(folded, plain, "after the writes")


def test_a_backward_through_folded_units_runs_the_layers(tmp_path, monkeypatch):
    """A TEST net's gradients (pycaffe's net.backward: saliency, deep dream) as the layers
    give them: the unit's layers run their forwards again, then their backwards."""
    folded, plain = _fold_twins(tmp_path, monkeypatch)
    for net in (folded, plain):
        net.forward()
        net.blobs["conv6"].diff[...] = np.linspace(-1, 1, net.blobs["conv6"].count).reshape(
            net.blobs["conv6"].shape)
        net.backward()
    got, want = folded.blobs["data"].diff, plain.blobs["data"].diff
    assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max())
    for name in ("conv1", "conv2", "scale1", "conv5"):
        for mine, theirs in zip(folded.params[name], plain.params[name]):
            assert float(np.abs(mine.diff - theirs.diff).max()) <= 1e-5 * max(
                1.0, float(np.abs(theirs.diff).max())), name


# -- Convolution + BatchNorm (+ Scale) + Eltwise SUM + ReLU (+ Split) in TEST nets -----------------
CONV_SUM_NET = """force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 6 } } }
layer { name: "conv0" type: "Convolution" bottom: "data" top: "x"
  convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu0" type: "ReLU" bottom: "x" top: "x" }
layer { name: "conv1" type: "Convolution" bottom: "x" top: "y1"
  convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "y1" top: "y1" }
layer { name: "scale1" type: "Scale" bottom: "y1" top: "y1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "y1" top: "y1" %(leaky)s }
layer { name: "conv2" type: "Convolution" bottom: "y1" top: "y2"
  convolution_param { num_output: 8 kernel_size: 1 bias_term: false weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn2" type: "BatchNorm" bottom: "y2" top: "y2" }
layer { name: "scale2" type: "Scale" bottom: "y2" top: "y2" scale_param { bias_term: true } }
layer { name: "sum1" type: "Eltwise" bottom: "x" bottom: "y2" top: "s1" }
layer { name: "relu2" type: "ReLU" bottom: "s1" top: "s1" }
layer { name: "conv3" type: "Convolution" bottom: "s1" top: "y3"
  convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn3" type: "BatchNorm" bottom: "y3" top: "y3" }
layer { name: "sum2" type: "Eltwise" bottom: "y3" bottom: "s1" top: "s2" }
layer { name: "relu3" type: "ReLU" bottom: "s2" top: "s2" }
"""


def _conv_sum_nets(tmp_path, monkeypatch, leaky=""):
    """CONV_SUM_NET's TEST phase folded, with CAFFEPY_FOLD=0 (the Eltwise + ReLU rule still
    runs), and under engine: CAFFE (every layer apart, Caffe's layout), same parameters."""
    text = CONV_SUM_NET % {"leaky": leaky}
    nets = []
    for env, prefix in (("1", ""), ("0", ""), ("1", 'engine: "CAFFE"\n')):
        monkeypatch.setenv("CAFFEPY_FOLD", env)
        path = tmp_path / f"sum{len(nets)}.prototxt"
        path.write_text(prefix + text)
        nets.append(Net(str(path), caffepy.TEST))
    rng = np.random.default_rng(11)
    for name, layer in nets[0].layer_dict.items():
        for i, blob in enumerate(layer.blobs):
            if layer.type == "BatchNorm":
                blob.data[...] = [rng.normal(0, 1, blob.shape), rng.uniform(0.5, 2, blob.shape), [0.8]][i]
            else:
                blob.data[...] = rng.normal(0, 0.5, blob.shape)
            for other in nets[1:]:
                other.layer_dict[name].blobs[i].data[...] = blob.data
    x = rng.standard_normal(nets[0].blobs["data"].shape)
    for net in nets:
        net.blobs["data"].data[...] = x
        net.forward()
    return nets


@pytest.mark.parametrize("leaky", ["", "relu_param { negative_slope: 0.1 }"], ids=["relu", "leaky"])
def test_a_block_end_runs_in_the_convolutions_epilogue(tmp_path, monkeypatch, leaky):
    """ResNet's block end (the last convolution's BatchNorm and Scale, the sum with the shortcut,
    its ReLU and Split) is one unit of the folded TEST net, written by the 1 x 1 convolution's
    GEMM epilogue straight into the sum; every blob but the convolutions' own tops (y2, y3: not
    written) as the layers leave them, folded or not, within 1e-5 of each one's largest value.
    A leaky ReLU in an epilogue unit runs with its slope."""
    folded, plain, caffe = _conv_sum_nets(tmp_path, monkeypatch, leaky)
    units = _fold_units(folded)
    split = next(n for n in folded.layer_dict if n.startswith("s1") and "split" in n)
    assert units == {"conv0": "relu0", "conv1": "relu1", "conv2": split, "conv3": "relu3"}
    assert _fold_units(plain) == {} and _fold_units(caffe) == {}
    assert folded.unwritten_blobs() == ["y2", "y3"] and plain.unwritten_blobs() == []
    for name in plain.blobs:
        want = caffe.blobs[name].data
        nets = (plain,) if name in ("y2", "y3") else (folded, plain)
        for net in nets:
            got = net.blobs[name].data
            assert float(np.abs(got - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max())), name
    assert (caffe.blobs["s1"].data == 0).any() and (caffe.blobs["y1"].data < 0).any() == bool(leaky)


def test_a_backward_through_a_block_end_unit_runs_the_layers(tmp_path, monkeypatch):
    folded, plain, _ = _conv_sum_nets(tmp_path, monkeypatch)
    for net in (folded, plain):
        net.blobs["s2"].diff[...] = np.linspace(-1, 1, net.blobs["s2"].count).reshape(net.blobs["s2"].shape)
        net.backward()
    for name in ("data", "x", "y2"):
        got, want = folded.blobs[name].diff, plain.blobs[name].diff
        assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max()), name


# -- A Concat's convolution units written into its top in place (TEST nets) ---------------------
def _branch(name, bottom, outputs, k, bn=False):
    pad = k // 2
    text = (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"\n'
            f'  convolution_param {{ num_output: {outputs} kernel_size: {k} pad: {pad}\n'
            f'  weight_filler {{ type: "gaussian" std: 0.3 }} bias_filler {{ type: "gaussian" '
            f'std: 0.3 }} }} }}\n')
    if bn:
        text += (f'layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{name}" top: "{name}" }}\n'
                 f'layer {{ name: "{name}_scale" type: "Scale" bottom: "{name}" top: "{name}"\n'
                 f'  scale_param {{ bias_term: true }} }}\n')
    return text + f'layer {{ name: "{name}_relu" type: "ReLU" bottom: "{name}" top: "{name}" }}\n'


# GoogLeNet's inception block, its 3 x 3 branch with a BatchNorm (Inception-v3's form), a max
# pool straight into the concat as a fifth bottom, a depthwise unit (no slices: copied) as a
# sixth, and a 1 x 1 after the concat
CONCAT_NET = ("force_backward: true\n"
              'layer { name: "data" type: "Input" top: "data"\n'
              '  input_param { shape { dim: 2 dim: 16 dim: 9 dim: 8 } } }\n'
              + _branch("b1x1", "data", 5, 1) + _branch("b3x3", "data", 11, 3, bn=True)
              + _branch("b5x5", "data", 3, 5)
              + 'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool"\n'
                '  pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }\n'
              + _branch("proj", "pool", 4, 1)
              + 'layer { name: "pool2" type: "Pooling" bottom: "data" top: "pool2"\n'
                '  pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }\n'
              + _branch("dw", "data", 16, 3).replace("kernel_size: 3", "kernel_size: 3 group: 16")
              + 'layer { name: "cat" type: "Concat" bottom: "b1x1" bottom: "b3x3" bottom: "b5x5"\n'
              '  bottom: "proj" bottom: "pool2" bottom: "dw" top: "cat" }\n'
              + _branch("after", "cat", 7, 1))


def _copies(monkeypatch):
    """The runs the Concat copies (kernels.copy_columns' calls), counted."""
    calls = []
    real = kernels.copy_columns
    monkeypatch.setattr(kernels, "copy_columns", lambda *a: (calls.append(a[4]), real(*a)))
    return calls


def test_concat_in_place_finds_the_units_that_feed_it(tmp_path, monkeypatch):
    folded, plain = _fold_twins(tmp_path, monkeypatch, text=CONCAT_NET)
    slots = {folded.layers[first].name: (s.index, s.lo, s.hi)
             for first, s in folded._concat_slots.items()}
    # the pool's bottom is no convolution's: copied; the 1 x 1 after the concat feeds no concat
    assert slots == {"b1x1": (0, 0, 5), "b3x3": (1, 5, 16), "b5x5": (2, 16, 19),
                     "proj": (3, 19, 23), "dw": (5, 39, 55)}
    assert plain._concat_slots == {}
    assert folded.unwritten_blobs() == ["b1x1", "b3x3", "b5x5", "proj", "dw"]
    assert plain.unwritten_blobs() == []
    (tmp_path / "train.prototxt").write_text(CONCAT_NET)
    assert Net(str(tmp_path / "train.prototxt"), caffepy.TRAIN)._concat_slots == {}


GEMMS = {"b1x1": "gemm", "b3x3": "im2col+gemm", "b5x5": "im2col+gemm", "proj": "gemm",
         "dw": "depthwise"}


def _chained(text, name):
    """_branch's `name` with each of its BatchNorm, Scale and ReLU writing a top of its own
    (Intel's Inception-v3 form: conv -> conv_bn -> ... -> conv_relu)."""
    bn = f'"{name}_bn" type: "BatchNorm" bottom: "{name}" top: "{name}"'
    text = (text.replace(bn, bn[:-1] + '_b"')
            .replace(f'"{name}_scale" type: "Scale" bottom: "{name}" top: "{name}"',
                     f'"{name}_scale" type: "Scale" bottom: "{name}_b" top: "{name}_s"')
            .replace(f'"{name}_relu" type: "ReLU" bottom: "{name}" top: "{name}"',
                     f'"{name}_relu" type: "ReLU" bottom: "{name}_s" top: "{name}_r"'))
    return text.replace(f'bottom: "{name}" bottom:', f'bottom: "{name}_r" bottom:')


def test_a_chain_of_tops_runs_as_one_unit_into_the_concat(tmp_path, monkeypatch):
    """CONCAT_NET with b3x3's BatchNorm, Scale and ReLU each writing a blob of its own: one
    unit, written into the concat's top; the blobs before the last unwritten, the concat's top
    and everything after it as the layers compute them."""
    text = _chained(CONCAT_NET, "b3x3")
    assert 'bottom: "b3x3_r"' in text and 'top: "b3x3_b"' in text
    folded, plain = _fold_twins(tmp_path, monkeypatch, text=text)
    assert _fold_units(folded)["b3x3"] == "b3x3_relu"
    assert folded.layers[next(f for f in folded._concat_slots
                              if folded.layers[f].name == "b3x3")].name == "b3x3"
    assert set(folded.unwritten_blobs()) == {"b1x1", "b3x3", "b3x3_b", "b3x3_s", "b3x3_r",
                                             "b5x5", "proj", "dw"}
    for net in (folded, plain):
        net.forward()
        net.forward()
    _same_blobs(folded, plain, "chain")
    # CAFFEPY_FOLD=0 writes every blob of the chain
    assert all(np.isfinite(plain.blobs[n].data).all() for n in ("b3x3", "b3x3_b", "b3x3_s"))


@pytest.mark.parametrize("algorithms", [GEMMS, {**GEMMS, "b3x3": "winograd F(4,3)"},
                                        {**GEMMS, "b3x3": "winograd F(2,3)"},
                                        {**GEMMS, "b1x1": "direct", "b5x5": "direct"}],
                         ids=["gemm", "winograd-F4", "winograd-F2", "direct"])
def test_concat_in_place_gives_the_layers_values(tmp_path, monkeypatch, algorithms):
    """The concat's top and everything after it as the layers compute them (the BatchNorm
    folded: 1e-5), the concat copying only what no unit wrote into it: the pool's run and the
    depthwise unit's (its kernel writes no slice). A unit's own top is left unwritten; a batch
    size the concat's top does not have yet is copied once, then written in place; a backward
    (pycaffe's net.backward on a TEST net) gives the layers' gradients."""
    folded, plain = _fold_twins(tmp_path, monkeypatch, text=CONCAT_NET)
    for name, algorithm in algorithms.items():
        folded.layer_dict[name].force_algorithm(algorithm)
    copied = _copies(monkeypatch)
    for step in range(2):
        folded.blobs["b1x1"].data[...] = np.nan
        copied.clear()
        folded.forward()
        assert sorted(copied) == [16, 16], copied         # the pool's and the depthwise's
        plain.forward()
        _same_blob(folded, plain, "cat")
        _same_blob(folded, plain, "after")
        assert np.isnan(folded.blobs["b1x1"].data).all()
    x = np.random.default_rng(9).standard_normal((3, 16, 9, 8)).astype(np.float32)
    for net in (folded, plain):
        net.blobs["data"].reshape(*x.shape)
        net.blobs["data"].data[...] = x
    for want_copies in (6, 2):          # the first forward at 3 images copies them all
        copied.clear()
        folded.forward()
        assert len(copied) == want_copies
        plain.forward()
        _same_blob(folded, plain, "after")
        for name, algorithm in algorithms.items():      # a new shape's own choice otherwise
            folded.layer_dict[name].force_algorithm(algorithm)
    for net in (folded, plain):
        net.blobs["after"].diff[...] = np.linspace(-1, 1, net.blobs["after"].count).reshape(
            net.blobs["after"].shape)
        net.backward()
    _same_blob(folded, plain, "data", diff=True)


def _same_blob(folded, plain, name, diff=False):
    got = folded.blobs[name].diff if diff else folded.blobs[name].data
    want = plain.blobs[name].diff if diff else plain.blobs[name].data
    assert float(np.abs(got - want).max()) <= 1e-5 * max(1.0, float(np.abs(want).max())), name
