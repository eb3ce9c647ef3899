"""LRN, BatchNorm and MVN against float64 loop references written from Caffe's formulas;
BatchNorm's Intel Caffe extensions (statistics groups, the fused ReLU) on each of its paths:
plain, channels-last, blocked."""
import numpy as np
import pytest

from caffepy.errors import LayerError, ShapeError
from caffepy.layer import BLOCKED, NHWC, VIA_NCHW
from layer_cases import TEST, TRAIN, Case, case_tests, make_layer, randn, setup_layer


def lrn_ref(size, alpha, beta, k, region):
    pre = (size - 1) // 2

    def ref(x):
        N, C, H, W = x.shape
        scale = np.empty_like(x)
        for c in range(C):
            if region == "ACROSS_CHANNELS":
                window = x[:, max(0, c - pre):min(C, c + pre + 1)]
                scale[:, c] = k + alpha / size * np.sum(window ** 2, axis=1)
        if region == "WITHIN_CHANNEL":
            padded = np.pad(x ** 2, ((0, 0), (0, 0), (pre, pre), (pre, pre)))
            for h in range(H):
                for w in range(W):
                    box = padded[:, :, h:h + size, w:w + size].sum(axis=(2, 3))
                    scale[:, :, h, w] = 1.0 + alpha / size ** 2 * box
        return [x * scale ** -beta]
    return ref


def batch_norm_ref(eps=1e-5):
    def ref(x):
        N, C = x.shape[:2]
        rows = np.moveaxis(x.reshape(N, C, -1), 1, 0).reshape(C, -1)
        mean, var = rows.mean(axis=1), rows.var(axis=1)
        shape = (1, C) + (1,) * (x.ndim - 2)
        return [(x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)]
    return ref


def mvn_ref(normalize_variance=True, across_channels=False, eps=1e-9):
    def ref(x):
        rows = x.reshape(x.shape[0], -1) if across_channels else x.reshape(x.shape[0] * x.shape[1], -1)
        out = rows - rows.mean(axis=1, keepdims=True)
        if normalize_variance:
            out = out / (np.sqrt((out ** 2).mean(axis=1, keepdims=True)) + eps)
        return [out.reshape(x.shape)]
    return ref


def _lrn_cases():
    out = []
    for region in ("ACROSS_CHANNELS", "WITHIN_CHANNEL"):
        for size, shape in ((3, (2, 5, 4, 3)), (5, (2, 7, 5, 4)), (5, (1, 3, 3, 2))):
            params = f"lrn_param {{ local_size: {size} alpha: 0.8 beta: 0.75 k: 2 norm_region: {region} }}"
            out.append(Case("LRN", params, [randn(*shape, seed=size + shape[1])],
                            expected=lrn_ref(size, 0.8, 0.75, 2.0, region),
                            id=f"LRN:{region}-size{size}-C{shape[1]}-H{shape[2]}"))
    out.append(Case("LRN", "lrn_param { local_size: 3 alpha: 2 beta: 0.6 k: 1.5 }",
                    [randn(2, 4, 3, 3, seed=3)],
                    expected=lrn_ref(3, 2.0, 0.6, 1.5, "ACROSS_CHANNELS"), id="LRN:beta0.6"))
    out.append(Case("LRN", "", [randn(2, 6, 2, 2, seed=4)],
                    expected=lrn_ref(5, 1.0, 0.75, 1.0, "ACROSS_CHANNELS"),
                    id="LRN:defaults"))
    return out


def grouped_bn_ref(group, eps=1e-5, relu=False):
    """Intel Caffe's statistics groups: each run of `group` items normalized by its own mean
    and biased variance (0: the whole batch), then max(y, 0) with relu."""
    def ref(x):
        size = group or x.shape[0]
        out = np.concatenate([batch_norm_ref(eps)(x[i:i + size])[0] for i in range(0, x.shape[0], size)])
        return [np.maximum(out, 0) if relu else out]
    return ref


def grouped_statistics(x, group, maf, blobs=None):
    """The three statistics blobs after a forward over x (float64), one update per group in
    batch order, starting from `blobs` (zeros by default)."""
    c = x.shape[1]
    mean_sum, var_sum, factor = blobs or (np.zeros(c), np.zeros(c), 0.0)
    for i in range(0, x.shape[0], group):
        rows = np.moveaxis(x[i:i + group].astype(np.float64), 1, 0).reshape(c, -1)
        m = rows.shape[1]
        factor = maf * factor + 1.0
        mean_sum = rows.mean(axis=1) + maf * mean_sum
        var_sum = rows.var(axis=1) * m / (m - 1) + maf * var_sum
    return mean_sum, var_sum, factor


def away_from_zero(n, c, s, group, seed, margin=0.3):
    """(n, c, s) values whose normalized values in each group of `group` items are at least
    about `margin` from 0: per group and channel, pairs v, -v (|v| >= margin) around an offset.
    A fused ReLU's kink then lies between the gradient checker's steps."""
    r = np.random.default_rng(seed)
    x = np.empty((n // group, c, group * s), np.float32)
    half = group * s // 2
    for g in range(n // group):
        for ch in range(c):
            v = r.uniform(margin, 2.0, half) * r.choice([-1.0, 1.0], half)
            x[g, ch] = r.permutation(np.concatenate([v, -v])) + 3.0 * ch - 2.0
    return np.ascontiguousarray(x.reshape(n // group, c, group, s).transpose(0, 2, 1, 3)).reshape(n, c, s)


def _set_stats(mean, var, factor):
    def init(layer):
        layer.blobs[0].data[...] = mean
        layer.blobs[1].data[...] = var
        layer.blobs[2].data[...] = factor
    return init


BN_X = randn(4, 3, 2, 3, seed=20, scale=2.0) + np.array([1.0, -2.0, 0.5], np.float32).reshape(1, 3, 1, 1)
STATS_MEAN, STATS_VAR = np.array([2.0, -1.0, 4.0], np.float32), np.array([8.0, 2.0, 0.5], np.float32)

GLOBAL_RELU_X = (STATS_MEAN / 2).reshape(1, 3, 1, 1) + away_from_zero(4, 3, 6, 4, seed=41).reshape(4, 3, 2, 3)


def _global_relu(x):
    y = (x - (STATS_MEAN / 2).reshape(1, 3, 1, 1)) / np.sqrt((STATS_VAR / 2).reshape(1, 3, 1, 1) + 1e-5)
    return [np.maximum(y, 0)]


def _intel_batch_norm_cases():
    """Statistics groups and the fused ReLU on every path of BatchNorm (for a ReLU, inputs whose
    normalized values keep away from its kink)."""
    out = []
    for layout, variant, tag in ((None, None, ""), (NHWC, None, "[nhwc]"), (BLOCKED, VIA_NCHW, "[blocked]")):
        def case(params, x, expected, name, **kw):
            out.append(Case("BatchNorm", params, [x], expected=expected, layout=layout, variant=variant,
                            id=f"BatchNorm{tag}:{name}", **kw))
        case("batch_norm_param { stats_batch_size: 2 }", BN_X, grouped_bn_ref(2), "groups-of-2")
        case("batch_norm_param { stats_batch_size: 1 moving_average_fraction: 0.5 }", BN_X,
             grouped_bn_ref(1), "groups-of-1")
        case("batch_norm_param { stats_batch_size: 4 }", BN_X, grouped_bn_ref(0), "one-group")
        case("batch_norm_param { relu: true }", away_from_zero(4, 3, 6, 4, seed=42).reshape(4, 3, 2, 3),
             grouped_bn_ref(0, relu=True), "relu")
        case("batch_norm_param { relu: true stats_batch_size: 2 }",
             away_from_zero(6, 3, 4, 2, seed=43).reshape(6, 3, 2, 2), grouped_bn_ref(2, relu=True),
             "relu-groups")
        case("batch_norm_param { relu: true use_global_stats: true stats_batch_size: 3 }", GLOBAL_RELU_X,
             _global_relu, "relu-global", init=_set_stats(STATS_MEAN, STATS_VAR, 2.0))
    return out


CASES = [
    *_lrn_cases(),
    Case("BatchNorm", "", [BN_X], expected=batch_norm_ref()),
    Case("BatchNorm", "batch_norm_param { eps: 0.1 }", [randn(6, 4, seed=21)], expected=batch_norm_ref(0.1),
         id="BatchNorm:2d-eps"),
    Case("BatchNorm", "", [randn(2, 3, 2, 2, 2, seed=22)], expected=batch_norm_ref(), id="BatchNorm:5d"),
    Case("BatchNorm", "batch_norm_param { use_global_stats: true }", [BN_X],
         init=_set_stats(STATS_MEAN, STATS_VAR, 2.0), id="BatchNorm:global",
         expected=lambda x: [(x - (STATS_MEAN / 2).reshape(1, 3, 1, 1))
                             / np.sqrt((STATS_VAR / 2).reshape(1, 3, 1, 1) + 1e-5)]),
    Case("BatchNorm", "", [BN_X], phase=TEST, init=_set_stats(STATS_MEAN, STATS_VAR, 0.0),
         id="BatchNorm:test-zero-factor",
         expected=lambda x: [x / np.sqrt(1e-5)], grad=False),
    *_intel_batch_norm_cases(),
    Case("MVN", "", [randn(2, 3, 4, 5, seed=30, scale=3.0) + 1.0], expected=mvn_ref()),
    Case("MVN", "mvn_param { across_channels: true }", [randn(2, 3, 4, 2, seed=31)],
         expected=mvn_ref(across_channels=True)),
    Case("MVN", "mvn_param { normalize_variance: false }", [randn(2, 3, 4, 2, seed=32)],
         expected=mvn_ref(False)),
    Case("MVN", "mvn_param { normalize_variance: false across_channels: true eps: 0.01 }",
         [randn(3, 2, 3, seed=33)], expected=mvn_ref(False, True)),
    Case("MVN", "mvn_param { eps: 0.1 }", [randn(2, 3, 6, seed=34)], expected=mvn_ref(eps=0.1), id="MVN:eps",
         threshold=2e-3),
]

test_forward, test_gradient = case_tests(CASES)


def test_batch_norm_moving_averages_after_two_forwards():
    x1, x2 = BN_X, randn(4, 3, 2, 3, seed=23, scale=0.5)
    layer, bottom, top = setup_layer("BatchNorm", "batch_norm_param { moving_average_fraction: 0.9 }", [x1])
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,)]
    layer.forward(bottom, top)
    bottom[0].data[...] = x2
    layer.forward(bottom, top)

    def stats(x):
        rows = np.moveaxis(x.astype(np.float64), 1, 0).reshape(3, -1)
        m = rows.shape[1]
        return rows.mean(axis=1), rows.var(axis=1) * m / (m - 1)
    (m1, v1), (m2, v2) = stats(x1), stats(x2)
    np.testing.assert_allclose(layer.blobs[2].data, [0.9 * 1.0 + 1.0], rtol=1e-6)
    np.testing.assert_allclose(layer.blobs[0].data, m2 + 0.9 * m1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.blobs[1].data, v2 + 0.9 * v1, rtol=1e-5)
    # the stored statistics, divided by the factor, are what TEST uses
    test_layer, tb, tt = setup_layer("BatchNorm", "", [x2], phase=TEST)
    for src, dst in zip(layer.blobs, test_layer.blobs):
        dst.data[...] = src.data
    test_layer.forward(tb, tt)
    mean, var = (m2 + 0.9 * m1) / 1.9, (v2 + 0.9 * v1) / 1.9
    want = (x2 - mean.reshape(1, 3, 1, 1)) / np.sqrt(var.reshape(1, 3, 1, 1) + 1e-5)
    np.testing.assert_allclose(tt[0].data, want, rtol=1e-4, atol=1e-5)
    assert np.all(test_layer.blobs[2].data == layer.blobs[2].data)   # TEST does not update


def test_batch_norm_forces_lr_mult_zero():
    layer = make_layer("BatchNorm", "")
    from caffepy.blob import Blob
    b, t = Blob(name="b"), Blob(name="t")
    b.set_data(BN_X)
    layer.layer_setup([b], [t])
    assert [p.lr_mult for p in layer.param.param] == [0.0, 0.0, 0.0]
    with pytest.raises(LayerError, match=r"param\[1\].lr_mult: .*got 1"):
        setup_layer("BatchNorm", "param { lr_mult: 0 } param { lr_mult: 1 }", [BN_X])
    # a spec without lr_mult means lr_mult 1 in Caffe: refused too
    with pytest.raises(LayerError, match=r"param\[0\].lr_mult"):
        setup_layer("BatchNorm", "param { decay_mult: 0 }", [BN_X])
    setup_layer("BatchNorm", "param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 }", [BN_X])


def test_batch_norm_in_place_matches_out_of_place():
    layer, bottom, top = setup_layer("BatchNorm", "", [BN_X])
    layer.forward(bottom, top)
    dy = randn(*BN_X.shape, seed=24)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    want_y, want_dx = top[0].data.copy(), bottom[0].diff.copy()

    from caffepy.blob import Blob
    blob = Blob(name="x")
    blob.set_data(BN_X)
    inplace = make_layer("BatchNorm", "")
    inplace.layer_setup([blob], [blob])
    inplace.forward([blob], [blob])
    np.testing.assert_allclose(blob.data, want_y, rtol=1e-6, atol=1e-6)
    blob.data[...] = 123.0          # a later in-place layer overwrites the top
    blob.diff[...] = dy
    inplace.backward([blob], [True], [blob])
    np.testing.assert_allclose(blob.diff, want_dx, rtol=1e-5, atol=1e-6)


def test_batch_norm_default_stats_by_phase():
    assert setup_layer("BatchNorm", "", [BN_X], phase=TEST)[0].use_global_stats
    assert not setup_layer("BatchNorm", "", [BN_X], phase=TRAIN)[0].use_global_stats
    assert not setup_layer("BatchNorm", "batch_norm_param { use_global_stats: false }", [BN_X],
                           phase=TEST)[0].use_global_stats


def test_batch_norm_channel_change_is_a_shape_error():
    layer, bottom, top = setup_layer("BatchNorm", "", [randn(2, 3, 2)])
    bottom[0].reshape(2, 4, 2)
    with pytest.raises(ShapeError, match="has 4 channels, the statistics blobs 3"):
        layer.reshape(bottom, top)


def test_batch_norm_against_torch():
    torch = pytest.importorskip("torch")
    x = randn(8, 5, 4, 4, seed=25, scale=3.0)
    layer, bottom, top = setup_layer("BatchNorm", "batch_norm_param { moving_average_fraction: 0.95 }", [x])
    layer.forward(bottom, top)
    dy = randn(*x.shape, seed=26)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.batch_norm(xt, None, None, training=True, eps=1e-5)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(top[0].data, yt.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bottom[0].diff, xt.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_lrn_against_torch():
    torch = pytest.importorskip("torch")
    x = randn(2, 7, 6, 5, seed=27)
    layer, bottom, top = setup_layer("LRN", "lrn_param { local_size: 5 alpha: 1e-2 beta: 0.75 k: 2 }", [x])
    layer.forward(bottom, top)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.local_response_norm(xt, 5, alpha=1e-2, beta=0.75, k=2.0)
    dy = randn(*x.shape, seed=28)
    yt.backward(torch.tensor(dy))
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(top[0].data, yt.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bottom[0].diff, xt.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("params,bottom,match", [
    ("lrn_param { local_size: 4 }", randn(1, 3, 2, 2), "local_size: must be odd"),
    ("", randn(2, 3, 4), "needs 4 axes"),
])
def test_lrn_errors(params, bottom, match):
    with pytest.raises(LayerError, match=match):
        setup_layer("LRN", params, [bottom])


def test_lrn_in_place_is_refused():
    from caffepy.blob import Blob
    blob = Blob(name="x")
    blob.set_data(randn(1, 3, 2, 2))
    layer = make_layer("LRN", "")
    with pytest.raises(LayerError, match="in place"):
        layer.layer_setup([blob], [blob])


def test_mvn_in_place():
    x = randn(2, 3, 4, 5, seed=35)
    from caffepy.blob import Blob
    blob = Blob(name="x")
    blob.set_data(x)
    layer = make_layer("MVN", "")
    layer.layer_setup([blob], [blob])
    layer.forward([blob], [blob])
    np.testing.assert_allclose(blob.data, mvn_ref()(x.astype(np.float64))[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("region", ["ACROSS_CHANNELS", "WITHIN_CHANNEL"])
def test_lrn_without_compiled_kernels(region):
    x = randn(2, 5, 4, 3, seed=36)
    params = f"lrn_param {{ local_size: 3 alpha: 0.8 norm_region: {region} }}"
    layer, bottom, top = setup_layer("LRN", params, [x])
    layer.forward(bottom, top)
    top[0].diff[...] = randn(*x.shape, seed=37)
    layer.backward(top, [True], bottom)
    want_y, want_dx = top[0].data.copy(), bottom[0].diff.copy()
    layer.compiled = False
    layer.forward(bottom, top)
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(top[0].data, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bottom[0].diff, want_dx, rtol=1e-4, atol=1e-6)


def test_lrn_huge_window_uses_the_reference():
    x = randn(1, 3, 2, 2, seed=40)
    layer, bottom, top = setup_layer("LRN", "lrn_param { local_size: 513 norm_region: WITHIN_CHANNEL }", [x])
    assert not layer.compiled
    layer.forward(bottom, top)
    want = lrn_ref(513, 1.0, 0.75, 1.0, "WITHIN_CHANNEL")(x.astype(np.float64))[0]
    np.testing.assert_allclose(top[0].data, want, rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 4, 5, 7), (4, 4, 96, 96)])   # below / above threading
@pytest.mark.parametrize("type_,params,phase", [
    ("BatchNorm", "", TRAIN), ("BatchNorm", "", TEST),
    ("BatchNorm", "batch_norm_param { stats_batch_size: 1 relu: true }", TRAIN),
    ("MVN", "", TRAIN), ("MVN", "mvn_param { normalize_variance: false across_channels: true }", TRAIN),
])
def test_kernels_match_numpy_path(monkeypatch, type_, params, phase, shape):
    from caffepy.layers import normalization
    if normalization._kernels is None:
        pytest.skip("caffepy.kernels.normalization is not built")
    x = randn(*shape, seed=38, scale=2.0) + 3.0
    dy = randn(*x.shape, seed=39)
    results = []
    for kernels in (normalization._kernels, None):
        monkeypatch.setattr(normalization, "_kernels", kernels)
        layer, bottom, top = setup_layer(type_, params, [x], phase=phase)
        if type_ == "BatchNorm" and phase == TEST:
            _set_stats(STATS_MEAN[:1].repeat(4), np.full(4, 3.0, np.float32), 1.5)(layer)
        layer.forward(bottom, top)
        top[0].diff[...] = dy
        layer.backward(top, [True], bottom)
        results.append((top[0].data.copy(), bottom[0].diff.copy(), [b.data.copy() for b in layer.blobs]))
    (y1, dx1, b1), (y2, dx2, b2) = results
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx1, dx2, rtol=1e-4, atol=1e-5)
    for p, q in zip(b1, b2):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


# -- Intel Caffe's statistics groups and fused ReLU ------------------------------------------
@pytest.mark.parametrize("layout,variant", [(None, None), (NHWC, None), (BLOCKED, VIA_NCHW)],
                         ids=["plain", "nhwc", "blocked"])
def test_batch_norm_groups_update_the_statistics_once_per_group(layout, variant):
    x1, x2 = randn(6, 3, 2, 3, seed=44, scale=2.0) + 1.0, randn(6, 3, 2, 3, seed=45)
    layer, bottom, top = setup_layer("BatchNorm", "batch_norm_param { stats_batch_size: 2 "
                                     "moving_average_fraction: 0.9 }", [x1], layout=layout, variant=variant)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    want = grouped_statistics(x1, 2, 0.9)
    for blob, w in zip(layer.blobs, want):
        np.testing.assert_allclose(blob.data, np.reshape(w, blob.shape), rtol=1e-5, atol=1e-6)
    bottom2 = setup_layer("BatchNorm", "", [x2], layout=layout, variant=variant)[1]
    layer.forward(bottom2, top)
    want = grouped_statistics(x2, 2, 0.9, want)
    assert layer.blobs[2].data[0] == pytest.approx(want[2], rel=1e-6)   # 6 updates, not 2
    for blob, w in zip(layer.blobs, want):
        np.testing.assert_allclose(blob.data, np.reshape(w, blob.shape), rtol=1e-5, atol=1e-6)


def test_batch_norm_groups_give_their_gradient():
    """The data gradient of groups against the NumPy formula applied to each group."""
    x, dy = randn(4, 3, 2, 3, seed=46, scale=2.0), randn(4, 3, 2, 3, seed=47)
    layer, bottom, top = setup_layer("BatchNorm", "batch_norm_param { stats_batch_size: 2 }", [x])
    layer.forward(bottom, top)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    want = []
    for g in (slice(0, 2), slice(2, 4)):
        xg, dg = x[g].astype(np.float64), dy[g].astype(np.float64)
        mean, var = xg.mean(axis=(0, 2, 3), keepdims=True), xg.var(axis=(0, 2, 3), keepdims=True)
        y = (xg - mean) / np.sqrt(var + 1e-5)
        want.append((dg - dg.mean(axis=(0, 2, 3), keepdims=True)
                     - y * (dg * y).mean(axis=(0, 2, 3), keepdims=True)) / np.sqrt(var + 1e-5))
    np.testing.assert_allclose(bottom[0].diff, np.concatenate(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout,variant", [(None, None), (NHWC, None), (BLOCKED, VIA_NCHW)],
                         ids=["plain", "nhwc", "blocked"])
def test_batch_norm_group_that_does_not_divide_the_batch(layout, variant):
    with pytest.raises(LayerError, match=r"layer 'layer' \(BatchNorm\): batch_norm_param.stats_batch_size: "
                                         r"must divide the batch size \(4, bottom\[0\]'s first axis\), got 3\. "
                                         r"Give a divisor"):
        setup_layer("BatchNorm", "batch_norm_param { stats_batch_size: 3 }", [BN_X], layout=layout,
                    variant=variant)


def test_batch_norm_global_statistics_use_no_groups():
    """As in Intel Caffe: with the stored statistics (TEST by default) the group size is not
    read, so it need not divide the batch."""
    layer, bottom, top = setup_layer("BatchNorm", "batch_norm_param { stats_batch_size: 3 }", [BN_X],
                                     phase=TEST)
    assert layer.groups == 1
    assert setup_layer("BatchNorm", "batch_norm_param { stats_batch_size: 2 }", [BN_X])[0].groups == 2


GROUPS_NET = """name: "groups" %(net)s
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 5 dim: 4 } } }
layer { name: "bn0" type: "BatchNorm" bottom: "data" top: "bn0" }
layer { name: "conv1" type: "Convolution" bottom: "bn0" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "bn2" type: "BatchNorm" bottom: "conv1" top: "bn2" %(layer)s }
layer { name: "pack" type: "IntelPack" bottom: "bn2" top: "packed" }
layer { name: "bn3" type: "BatchNorm" bottom: "packed" top: "packed" }
layer { name: "unpack" type: "IntelUnpack" bottom: "packed" top: "out" }
"""


def _groups_net(tmp_path, net="", layer=""):
    import caffepy
    from caffepy.net import Net
    path = tmp_path / "net.prototxt"
    path.write_text(GROUPS_NET % {"net": net, "layer": layer})
    return Net(str(path), caffepy.TRAIN)


def _group_sizes(net):
    """{BatchNorm name: (its implementation, items per statistics group)}."""
    out = {}
    for layer in net.layers:
        if layer.type == "BatchNorm":
            inner = getattr(layer, "inner", layer)
            out[layer.name] = (layer.variant, inner.dims[0] // inner.groups)
    return out


def test_net_bn_stats_batch_size_reaches_every_batch_norm(tmp_path):
    net = _groups_net(tmp_path, "bn_stats_batch_size: 2", "batch_norm_param { stats_batch_size: 4 }")
    assert _group_sizes(net) == {"bn0": ("plain", 2), "bn1": ("nhwc", 2), "bn2": ("nhwc", 2),
                                 "bn3": (VIA_NCHW, 2)}
    assert [net.layers[i].name for i in net.fusions] == ["bn1"]       # the fused unit too
    net.forward()
    np.testing.assert_allclose(net.blobs["bn0"].data,
                               grouped_bn_ref(2)(net.blobs["data"].data.astype(np.float64))[0],
                               rtol=1e-4, atol=1e-4)


def test_the_layer_form_applies_without_the_net_form(tmp_path):
    net = _groups_net(tmp_path, layer="batch_norm_param { stats_batch_size: 2 }")
    assert _group_sizes(net) == {"bn0": ("plain", 4), "bn1": ("nhwc", 4), "bn2": ("nhwc", 2),
                                 "bn3": (VIA_NCHW, 4)}


def test_the_net_form_set_to_zero_overrides_the_layer_form(tmp_path):
    """Intel's Net writes the net's value into every BatchNorm whenever the field is present,
    0 (the whole batch) included."""
    net = _groups_net(tmp_path, "bn_stats_batch_size: 0", "batch_norm_param { stats_batch_size: 2 }")
    assert _group_sizes(net)["bn2"] == ("nhwc", 4)


def test_net_form_that_does_not_divide_the_batch_names_the_field_and_the_layer(tmp_path):
    with pytest.raises(LayerError, match=r"net.prototxt: layer 'bn0' \(BatchNorm\): NetParameter."
                                         r"bn_stats_batch_size: must divide the batch size \(4, "
                                         r"bottom\[0\]'s first axis\), got 3\."):
        _groups_net(tmp_path, "bn_stats_batch_size: 3")


RELU_NET = """name: "relu" %(net)s
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 5 dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 }
    bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1"
  batch_norm_param { stats_batch_size: 2 %(relu)s } }
%(relu_layer)s
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true
  filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 5 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
"""


@pytest.mark.parametrize("engine", ["", 'engine: "CAFFE"'], ids=["fast", "caffe"])
def test_batch_norm_relu_computes_batch_norm_then_relu(tmp_path, engine):
    """relu: true against the same net with a ReLU layer after the BatchNorm: tops, gradients
    and statistics; with a Scale in place after it (the BatchNorm + Scale unit is not formed:
    its ReLU would come after the Scale)."""
    import caffepy
    from caffepy.net import Net
    nets = []
    for relu, relu_layer in (("relu: true", ""),
                             ("", 'layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }')):
        path = tmp_path / f"net{len(nets)}.prototxt"
        path.write_text(RELU_NET % {"net": engine, "relu": relu, "relu_layer": relu_layer})
        net = Net(str(path), caffepy.TRAIN)
        net.blobs["data"].data[...] = randn(4, 3, 5, 4, seed=48)
        for name in ("conv1", "scale1", "conv2"):
            for mine, first in zip(net.layer_dict[name].blobs, nets[0].layer_dict[name].blobs if nets else ()):
                mine.data[...] = first.data
        nets.append(net)
    fused, apart = nets
    assert fused.fusions == {}
    assert fused.layer_dict["bn1"].variant == ("plain" if engine else "nhwc")
    for net in nets:
        net.forward()
        net.blobs["conv2"].diff[...] = randn(*net.blobs["conv2"].shape, seed=49)
        net.backward()
    assert (fused.blobs["conv1"].data < 0).any()       # the Scale after the ReLU ran
    for name in ("conv1", "conv2"):
        np.testing.assert_allclose(fused.blobs[name].data, apart.blobs[name].data, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused.blobs["data"].diff, apart.blobs["data"].diff, rtol=1e-4, atol=1e-6)
    for name in ("conv1", "bn1", "scale1"):
        for mine, theirs in zip(fused.layer_dict[name].blobs, apart.layer_dict[name].blobs):
            np.testing.assert_allclose(mine.data, theirs.data, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(mine.diff, theirs.diff, rtol=1e-4, atol=1e-5)
