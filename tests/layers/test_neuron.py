import numpy as np
import pytest

from caffepy import rng
from caffepy.blob import Blob
from caffepy.errors import LayerError
from caffepy.kernels import neuron as kernels
from caffepy.kernels.reference import neuron as ref
from layer_cases import TEST, TRAIN, Case, case_tests, make_layer, randn, setup_layer


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def set_slopes(layer):
    layer.blobs[0].data[...] = np.linspace(-0.3, 0.6, layer.blobs[0].count).reshape(layer.blobs[0].shape)


def prelu_ref(x, layer):
    a = layer.blobs[0].data.astype(np.float64)
    a = a.reshape(1, -1, *([1] * (x.ndim - 2))) if a.ndim else a
    return [np.where(x > 0, x, a * x)]


X = randn(2, 3, 4, 5)
POS = np.abs(randn(2, 3, 4, 5, seed=1)) + 0.5          # inside the domain of Log / fractional Power
SPREAD = randn(2, 3, 4, 5, seed=2, scale=3.0)          # reaches both sides of Clip's bounds

CASES = [
    Case("ReLU", "", [X], expected=lambda x: [np.maximum(x, 0)], kink=0.0, kink_range=0.02),
    Case("ReLU", "relu_param { negative_slope: 0.1 }", [X],
         expected=lambda x: [np.where(x > 0, x, 0.1 * x)], kink=0.0, kink_range=0.02),
    Case("PReLU", "", [X], init=set_slopes, expected=prelu_ref, kink=0.0, kink_range=0.02),
    Case("PReLU", "prelu_param { channel_shared: true }", [X], init=set_slopes, expected=prelu_ref,
         kink=0.0, kink_range=0.02),
    Case("PReLU", "", [X], id="PReLU:default filler 0.25",
         expected=lambda x: [np.where(x > 0, x, 0.25 * x)], kink=0.0, kink_range=0.02),
    Case("ELU", "", [X], expected=lambda x: [np.where(x > 0, x, np.exp(x) - 1)], kink=0.0, kink_range=0.02),
    Case("ELU", "elu_param { alpha: 0.5 }", [X],
         expected=lambda x: [np.where(x > 0, x, 0.5 * (np.exp(x) - 1))], kink=0.0, kink_range=0.02),
    Case("Sigmoid", "", [SPREAD], expected=lambda x: [sigmoid(x)]),
    Case("TanH", "", [X], expected=lambda x: [np.tanh(x)]),
    Case("AbsVal", "", [X], expected=lambda x: [np.abs(x)], kink=0.0, kink_range=0.02),
    Case("Power", "", [X], expected=lambda x: [x]),
    Case("Power", "power_param { power: 2 scale: 0.5 shift: -1 }", [X],
         expected=lambda x: [(0.5 * x - 1) ** 2]),
    Case("Power", "power_param { power: 0.5 scale: 2 shift: 0.1 }", [POS],
         expected=lambda x: [(2 * x + 0.1) ** 0.5]),
    Case("Power", "power_param { power: 3 scale: 0 shift: 2 }", [X],
         expected=lambda x: [np.full_like(x, 8.0)]),
    Case("Exp", "", [X], expected=lambda x: [np.exp(x)]),
    Case("Exp", "exp_param { base: 2 scale: 0.5 shift: 1 }", [X], expected=lambda x: [2 ** (1 + 0.5 * x)]),
    Case("Log", "", [POS], expected=lambda x: [np.log(x)]),
    Case("Log", "log_param { base: 10 scale: 2 shift: 0.5 }", [POS],
         expected=lambda x: [np.log10(0.5 + 2 * x)]),
    Case("BNLL", "", [SPREAD], expected=lambda x: [np.log1p(np.exp(x))]),
    Case("BNLL", "", [np.array([-200, -30, 0, 30, 200], np.float32)], id="BNLL:extremes", grad=False,
         expected=lambda x: [np.logaddexp(0, x)]),
    Case("Threshold", "threshold_param { threshold: 0.3 }", [X], grad=False,
         expected=lambda x: [(x > 0.3).astype(np.float64)]),
    Case("Dropout", "", [X], phase=TEST, expected=lambda x: [x]),
    Case("Dropout", "dropout_param { dropout_ratio: 0.3 }", [X], phase=TRAIN,
         expected=lambda x, layer: [x * layer._mask[: x.size].reshape(x.shape)]),
    Case("Clip", "clip_param { min: -1 max: 2 }", [SPREAD], expected=lambda x: [np.clip(x, -1, 2)],
         kink=None),
    Case("Swish", "", [X], expected=lambda x: [x * sigmoid(x)]),
    Case("Swish", "swish_param { beta: 2.5 }", [X], expected=lambda x: [x * sigmoid(2.5 * x)]),
]

test_forward, test_gradient = case_tests(CASES)


def test_clip_gradient_away_from_both_bounds():
    # the declarative case checks only points far from one bound; check both explicitly
    from gradient_checker import check_gradient
    x = np.array([-3, -1.5, -0.5, 0.5, 1.5, 2.5, 4], np.float32)
    layer, bottom, top = _build("Clip", "clip_param { min: -1 max: 2 }", x)
    check_gradient(layer, bottom, top)
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff, [0, 0, 1, 1, 1, 0, 0])


def _build(type_, params, x, phase=TRAIN, in_place=False):
    rng.seed(5)
    layer = make_layer(type_, params, phase)
    b = Blob(name="b0")
    b.set_data(x)
    t = b if in_place else Blob(name="t0")
    layer.layer_setup([b], [t])
    return layer, [b], [t]


IN_PLACE = [
    ("ReLU", ""), ("ReLU", "relu_param { negative_slope: 0.2 }"),
    ("ReLU", "relu_param { negative_slope: -0.5 }"), ("PReLU", ""), ("ELU", ""),
    ("ELU", "elu_param { alpha: -0.5 }"), ("ELU", "elu_param { alpha: 0 }"), ("Sigmoid", ""),
    ("TanH", ""), ("AbsVal", ""), ("Power", "power_param { power: 2 scale: 0.5 shift: 1 }"),
    ("Exp", "exp_param { base: 3 }"), ("Log", "log_param { shift: 5 }"), ("BNLL", ""), ("Dropout", ""),
    ("Clip", "clip_param { min: -0.5 max: 0.5 }"), ("Swish", "swish_param { beta: 1.5 }"),
]


@pytest.mark.parametrize("type_,params", IN_PLACE, ids=[f"{t}:{p}" for t, p in IN_PLACE])
@pytest.mark.parametrize("phase", [TRAIN, TEST], ids=["TRAIN", "TEST"])
def test_in_place_matches_out_of_place(type_, params, phase):
    x = randn(2, 3, 4, 5, seed=3)
    dy = randn(2, 3, 4, 5, seed=4)
    results = []
    for in_place in (False, True):
        layer, bottom, top = _build(type_, params, x, phase, in_place)
        if layer.blobs:
            set_slopes(layer)
            layer.blobs[0].diff[...] = 0
        rng.seed(9)
        layer.forward(bottom, top)
        y = top[0].data.copy()
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        results.append((y, bottom[0].diff.copy(), [p.diff.copy() for p in layer.blobs]))
    (y0, dx0, p0), (y1, dx1, p1) = results
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-6, atol=1e-7)
    for a, b in zip(p1, p0):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_threshold_in_place_forward_and_no_backward():
    x = randn(3, 4, seed=6)
    layer, bottom, top = _build("Threshold", "threshold_param { threshold: 0.1 }", x, in_place=True)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, (x > 0.1).astype(np.float32))
    layer.backward(top, [False], bottom)
    with pytest.raises(LayerError, match=r"layer 'layer' \(Threshold\): propagate_down: .*no gradient"):
        layer.backward(top, [True], bottom)
    assert not layer.allow_force_backward(0)


def test_dropout_train_mask_statistics_and_repeatability():
    x = np.ones((100, 1000), np.float32)
    layer, bottom, top = _build("Dropout", "dropout_param { dropout_ratio: 0.3 }", x)
    rng.seed(42)
    layer.forward(bottom, top)
    y = top[0].data.copy()
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    rng.seed(42)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, y)
    layer.forward(bottom, top)
    assert not np.array_equal(top[0].data, y), "a new mask every forward"
    top[0].diff[...] = 2
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(bottom[0].diff, 2 * top[0].data)


def test_dropout_test_phase_is_identity_in_place():
    x = randn(4, 5, seed=7)
    layer, bottom, top = _build("Dropout", "dropout_param { dropout_ratio: 0.9 }", x, TEST, True)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, x)
    top[0].diff[...] = 3
    layer.backward(top, [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff, np.full_like(x, 3))


def test_prelu_param_diff_accumulates():
    x = randn(2, 3, 4, seed=8)
    layer, bottom, top = _build("PReLU", "", x)
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    layer.blobs[0].diff[...] = 0
    layer.backward(top, [True], bottom)
    once = layer.blobs[0].diff.copy()
    np.testing.assert_allclose(once, np.minimum(x, 0).sum(axis=(0, 2)), rtol=1e-5)
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * once, rtol=1e-6)
    assert layer.blobs[0].shape == (3,)


def test_prelu_shared_blob_is_a_scalar():
    layer, _, _ = _build("PReLU", "prelu_param { channel_shared: true }", randn(2, 3, 4))
    assert layer.blobs[0].shape == () and float(layer.blobs[0].data) == pytest.approx(0.25)


def test_sigmoid_and_bnll_do_not_overflow():
    x = np.array([-1000, -80, 0, 80, 1000], np.float32)
    for type_ in ("Sigmoid", "BNLL"):
        layer, bottom, top = _build(type_, "", x)
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            layer.forward(bottom, top)
            top[0].diff[...] = 1
            layer.backward(top, [True], bottom)
        assert np.all(np.isfinite(top[0].data)) and np.all(np.isfinite(bottom[0].diff))
    np.testing.assert_allclose(bottom[0].diff, [0, 0, 0.5, 1, 1], atol=1e-6)


@pytest.mark.parametrize("type_,params,field", [
    ("Dropout", "dropout_param { dropout_ratio: 1.0 }", "dropout_param.dropout_ratio"),
    ("Exp", "exp_param { base: -2 }", "exp_param.base"),
    ("Log", "log_param { base: 0 }", "log_param.base"),
    ("Clip", "clip_param { min: 2 max: 1 }", "clip_param"),
])
def test_bad_parameters_give_one_line_errors(type_, params, field):
    with pytest.raises(LayerError) as info:
        _build(type_, params, randn(2, 3))
    msg = str(info.value)
    assert msg.startswith(f"layer 'layer' ({type_}): {field}: ") and "\n" not in msg


def test_prelu_needs_channels():
    with pytest.raises(LayerError, match=r"\(PReLU\): bottom: needs at least 2 axes"):
        _build("PReLU", "", randn(5))


# -- kernels against their NumPy references (threaded sizes, odd tails, in place) -------------
N = 3 * 65536 + 7


@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_relu_kernels(slope):
    x, dy = randn(N, seed=1), randn(N, seed=2)
    y = np.empty_like(x)
    kernels.relu_forward(x, y, slope)
    np.testing.assert_array_equal(y, ref.relu_forward(x, slope))
    dx = np.empty_like(x)
    kernels.relu_backward(x, dy, dx, slope)
    np.testing.assert_allclose(dx, ref.relu_backward(x, dy, slope), rtol=1e-6)
    kernels.relu_forward(x, x, slope)                     # in place
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_sum_relu_kernels(slope):
    """An Eltwise SUM with the ReLU after it (and the Split after that) in one pass: the
    references of the two layers one after the other."""
    a, b, g0, g1 = (randn(N, seed=s) for s in (1, 2, 3, 4))
    y = np.empty_like(a)
    kernels.sum_relu_forward(a, b, y, slope)
    np.testing.assert_array_equal(y, ref.relu_forward(a + b, slope))
    d, da, db = np.empty_like(a), np.empty_like(a), np.empty_like(a)
    kernels.sum_relu_backward(y, g0, g1, d, [da, db], slope)
    want = ref.relu_backward(y, g0 + g1, slope)
    np.testing.assert_array_equal(d, want)
    np.testing.assert_array_equal(da, want)
    np.testing.assert_array_equal(db, want)
    g = g0.copy()
    kernels.sum_relu_backward(y, g, None, g, [da], slope)    # no Split: the top's diff in place
    np.testing.assert_array_equal(g, ref.relu_backward(y, g0, slope))
    np.testing.assert_array_equal(da, g)
    kernels.sum_relu_forward(a, b, a, slope)                 # in place on a bottom
    np.testing.assert_array_equal(a, y)
    with pytest.raises(ValueError, match="outs"):
        kernels.sum_relu_backward(y, g0, g1, d, [da, db, d], slope)
    with pytest.raises(ValueError, match="g1"):
        kernels.sum_relu_backward(y, g0, g1[1:], d, [], slope)


def test_elu_sigmoid_tanh_swish_dropout_kernels():
    x, dy = randn(N, seed=1), randn(N, seed=2)
    x64 = x.astype(np.float64)
    y = np.empty_like(x)
    kernels.elu_forward(x, y, 0.7)
    np.testing.assert_allclose(y, ref.elu_forward(x, 0.7), rtol=1e-5, atol=1e-7)
    dx = np.empty_like(x)
    kernels.elu_backward(x, y, dy, dx, 0.7)
    np.testing.assert_allclose(dx, ref.elu_backward(x, y, dy, 0.7), rtol=1e-5, atol=1e-7)
    s = sigmoid(x64).astype(np.float32)
    kernels.sigmoid_backward(s, dy, dx)
    np.testing.assert_allclose(dx, ref.sigmoid_backward(s, dy), rtol=1e-5, atol=1e-7)
    t = np.tanh(x)
    kernels.tanh_backward(t, dy, dx)
    np.testing.assert_allclose(dx, ref.tanh_backward(t, dy), rtol=1e-5, atol=1e-7)
    sw = (x64 * s).astype(np.float32)
    kernels.swish_backward(sw, s, dy, dx, 1.0)
    np.testing.assert_allclose(dx, ref.swish_backward(sw, s, dy, 1.0), rtol=1e-5, atol=1e-6)
    u = np.random.default_rng(0).random(N, dtype=np.float32)
    mask = u.copy()
    kernels.dropout_forward(x, mask, y, 0.25, 4 / 3)
    want, want_y = ref.dropout_forward(x, u, 0.25, 4 / 3)
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(y, want_y)


def test_exp_sigmoid_tanh_swish_forward_kernels():
    x = randn(N, seed=3, scale=4.0)
    y, s = np.empty_like(x), np.empty_like(x)
    kernels.exp_forward(x, y)
    np.testing.assert_allclose(y, ref.exp_forward(x), rtol=1e-6)
    kernels.sigmoid_forward(x, y)
    np.testing.assert_allclose(y, ref.sigmoid_forward(x), rtol=1e-6, atol=1e-7)
    kernels.tanh_forward(x, y)
    np.testing.assert_allclose(y, ref.tanh_forward(x), rtol=1e-6, atol=1e-7)
    kernels.swish_forward(x, s, y, 0.5)
    want_s, want_y = ref.swish_forward(x, 0.5)
    np.testing.assert_allclose(s, want_s, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-7)


def test_absval_and_clip_backward_kernels():
    x, dy = randn(N, seed=1), randn(N, seed=2)
    x[:5] = [0, -0.0, 1, -1, 0.5]
    dx = np.empty_like(x)
    kernels.absval_backward(x, dy, dx)
    np.testing.assert_array_equal(dx, ref.absval_backward(x, dy))
    kernels.clip_backward(x, dy, dx, -0.5, 0.5)
    np.testing.assert_array_equal(dx, ref.clip_backward(x, dy, -0.5, 0.5))
    kernels.clip_backward(x, dy, dy, -0.5, 0.5)       # in place
    np.testing.assert_array_equal(dy, dx)


def test_kernels_accept_empty_arrays():
    e = np.zeros(0, np.float32)
    kernels.relu_forward(e, e, 0.0)
    kernels.dropout_forward(e, e, e, 0.5, 2.0)


def test_prelu_kernels():
    x, dy = randn(3, 5, 20011, seed=1), randn(3, 5, 20011, seed=2)
    a = np.array([0.25, -0.5, 0, 1, 2], np.float32)
    y = np.empty_like(x)
    kernels.prelu_forward(x, y, a)
    np.testing.assert_array_equal(y, ref.prelu_forward(x, a))
    dx = np.empty_like(x)
    sums = np.ones(5)
    kernels.prelu_backward(x, dy, dx, a, sums)
    want_dx, want_sums = ref.prelu_backward(x, dy, a)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6)
    np.testing.assert_allclose(sums, 1 + want_sums, rtol=1e-4)
    kernels.prelu_backward(x, dy, None, a, None)      # nothing wanted: a no-op


def test_in_place_chain_in_a_net_matches_numeric_gradient():
    import caffepy
    from caffepy import upgrade
    fill = "weight_filler { type: 'gaussian' std: 0.5 } bias_filler { type: 'gaussian' std: 0.5 }"
    text = f"""
    force_backward: true
    layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ dim: 4 dim: 6 }} }} }}
    layer {{ name: "a" type: "InnerProduct" bottom: "x" top: "a"
             inner_product_param {{ num_output: 5 {fill} }} }}
    layer {{ name: "relu" type: "ReLU" bottom: "a" top: "a" relu_param {{ negative_slope: 0.1 }} }}
    layer {{ name: "drop" type: "Dropout" bottom: "a" top: "a" }}
    layer {{ name: "b" type: "InnerProduct" bottom: "a" top: "b"
             inner_product_param {{ num_output: 3 {fill} }} }}
    layer {{ name: "sig" type: "Sigmoid" bottom: "b" top: "b" }}
    layer {{ name: "loss" type: "Reduction" bottom: "b" top: "loss" loss_weight: 1
             reduction_param {{ operation: SUMSQ }} }}
    """
    rng.seed(1)
    net = caffepy.Net(upgrade.parse_net_text(text), caffepy.TRAIN)
    x = randn(4, 6, seed=11)

    def loss_at(values):
        net.blobs["x"].data[...] = values
        rng.seed(77)        # the same dropout mask every time
        return net.forward_from_to()

    loss_at(x)
    net.clear_param_diffs()
    net.backward_from_to()
    analytic = net.blobs["x"].diff.astype(np.float64).copy()
    eps = 1e-2
    numeric = np.zeros_like(analytic)
    for i in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[i] += eps
        minus[i] -= eps
        numeric[i] = (loss_at(plus) - loss_at(minus)) / (2 * eps)
    assert np.abs(analytic).max() > 1e-3
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3, atol=2e-3)


def test_exp_family_kernels_within_two_ulp():
    x = np.concatenate([np.linspace(-87, 88, 200001), np.logspace(-30, 0, 2001), -np.logspace(-30, 0, 2001),
                        [0.0]]).astype(np.float32)
    x64 = x.astype(np.float64)
    y = np.empty_like(x)

    def ulps(got, want):
        return np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-37)) / 2.0 ** -23

    kernels.exp_forward(x, y)
    assert ulps(y, np.exp(x64)) < 2
    kernels.sigmoid_forward(x, y)
    assert ulps(y, 1 / (1 + np.exp(-x64))) < 2
    kernels.tanh_forward(x, y)
    assert ulps(y, np.tanh(x64)) < 2
    s = np.empty_like(x)
    kernels.swish_forward(x, s, y, 0.5)
    assert ulps(s, 1 / (1 + np.exp(-0.5 * x64))) < 2
    np.testing.assert_array_equal(y, x * s)
    ends = np.array([-np.inf, -1000, 1000, np.inf, np.nan], np.float32)
    out = np.empty_like(ends)
    kernels.sigmoid_forward(ends, out)
    np.testing.assert_allclose(out[:4], [0, 0, 1, 1], atol=1e-37)
    assert np.isnan(out[4])
    kernels.tanh_forward(ends, out)
    np.testing.assert_array_equal(out[:4], [-1, -1, 1, 1])
    assert np.isnan(out[4])
    kernels.exp_forward(ends, out)
    assert out[0] < 1e-37 and out[3] > 1e38 and np.isfinite(out[3]) and np.isnan(out[4])


TORCH_OPS = [
    ("ReLU", "", lambda F, x: F.relu(x)),
    ("ReLU", "relu_param { negative_slope: 0.1 }", lambda F, x: F.leaky_relu(x, 0.1)),
    ("ELU", "elu_param { alpha: 0.7 }", lambda F, x: F.elu(x, 0.7)),
    ("Sigmoid", "", lambda F, x: F.sigmoid(x)),
    ("TanH", "", lambda F, x: F.tanh(x)),
    ("Swish", "", lambda F, x: F.silu(x)),
    ("BNLL", "", lambda F, x: F.softplus(x)),
    ("AbsVal", "", lambda F, x: x.abs()),
    ("Clip", "clip_param { min: -0.5 max: 1 }", lambda F, x: x.clamp(-0.5, 1)),
]


@pytest.mark.parametrize("type_,params,op", TORCH_OPS, ids=[f"{t}:{p}" for t, p, _ in TORCH_OPS])
def test_forward_and_backward_match_torch(type_, params, op):
    torch = pytest.importorskip("torch")
    x = randn(4, 8, 6, 6, seed=12, scale=2.0)
    dy = randn(4, 8, 6, 6, seed=13)
    layer, bottom, top = _build(type_, params, x)
    layer.forward(bottom, top)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    ty = op(torch.nn.functional, tx)
    ty.backward(torch.from_numpy(dy.astype(np.float64)))
    np.testing.assert_allclose(top[0].data, ty.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bottom[0].diff, tx.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_relu_fuse_mark_is_refused_in_one_line():
    """relu_param.fuse is Intel's compiler's mark (its ReLU then passes data on unchanged):
    refused, never run as a second ReLU."""
    with pytest.raises(LayerError, match=r"relu_param.fuse: .*Intel Caffe's internal mark"):
        setup_layer("ReLU", "relu_param { fuse: true }", [randn(2, 3)])
