"""LRN, BatchNorm and MVN against float64 loop references written from Caffe's formulas."""
import numpy as np
import pytest

from caffepy.errors import LayerError, ShapeError
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


def _set_stats(mean, var, factor):
    def init(layer):
        layer.blobs[0].data[...] = mean
        layer.blobs[1].data[...] = var
        layer.blobs[2].data[...] = factor
    return init


BN_X = randn(4, 3, 2, 3, seed=20, scale=2.0) + np.array([1.0, -2.0, 0.5], np.float32).reshape(1, 3, 1, 1)
STATS_MEAN, STATS_VAR = np.array([2.0, -1.0, 4.0], np.float32), np.array([8.0, 2.0, 0.5], np.float32)

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


@pytest.mark.parametrize("params,field", [("relu: true", "relu"),
                                          ("stats_batch_size: 2", "stats_batch_size")])
def test_batch_norm_refuses_intel_extensions(params, field):
    with pytest.raises(LayerError, match=f"batch_norm_param.{field}: is not supported"):
        setup_layer("BatchNorm", f"batch_norm_param {{ {params} }}", [BN_X])


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
