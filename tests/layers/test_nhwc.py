"""The fast path's channels-last layers (caffepy/layers/nhwc.py): every variant and every
convolution algorithm against the NCHW references (caffepy/kernels/reference/vision.py,
normalization.py; the layout itself: reference/nhwc.py), forward and backward through the
declarative cases; the blob views; the kernels' argument checks."""
import numpy as np
import pytest

from caffepy.blob import CHANNELS_LAST, Blob
from caffepy.errors import LayerError, ShapeError
from caffepy.kernels import nhwc as kernels
from caffepy.kernels.reference import nhwc as ref_layout
from caffepy.kernels.reference import normalization as ref_norm
from caffepy.kernels.reference import vision as ref
from caffepy.layer import NHWC, PLAIN
from caffepy.proto.caffe_pb2 import TEST, TRAIN
from caffepy.layers import conv_algorithms
from layer_cases import Case, case_tests, distinct, nhwc_blob, pool_expected, randn, setup_layer

FILL = "weight_filler { type: 'gaussian' std: 0.3 } bias_filler { type: 'gaussian' std: 0.3 }"


def _conv_expected(pad, stride, group=1, dilation=1):
    def expected(x, layer):
        w = layer.blobs[0].data.astype(np.float64)
        b = layer.blobs[1].data.astype(np.float64) if len(layer.blobs) > 1 else None
        return [ref.conv_forward(x, w, b, (pad, pad), (stride, stride), (dilation, dilation), group)]
    return expected


def _algorithm(name):
    def init(layer):
        layer.force_algorithm(name)
    return init


# (C, O, group, kernel, stride, pad, dilation, H, W, algorithm)
CONVS = [
    (8, 12, 1, 1, 1, 0, 1, 5, 4, "gemm"),                   # pointwise: no im2col
    (8, 12, 1, 1, 1, 0, 1, 5, 4, "direct"),                 # pointwise, direct
    (6, 4, 2, 1, 1, 0, 1, 3, 4, "gemm"),                    # pointwise, groups
    (8, 12, 1, 1, 2, 0, 1, 6, 5, "strided gemm"),           # pointwise stride 2 (ResNet's branch1)
    (6, 4, 2, 1, 3, 0, 1, 7, 8, "strided gemm"),            # stride 3, groups, pixels left over
    (8, 12, 1, 1, 2, 1, 1, 6, 5, "im2col+gemm"),            # pointwise with padding: im2col
    (8, 12, 2, 3, 1, 1, 1, 6, 6, "im2col+gemm"),            # groups
    (3, 8, 1, 7, 2, 3, 1, 11, 11, "im2col+gemm"),           # conv1 of ResNet / GoogLeNet
    (6, 4, 1, 3, 1, 2, 2, 7, 7, "im2col+gemm"),             # dilation
    (1, 20, 1, 5, 1, 0, 1, 9, 9, "direct"),                 # LeNet's conv1: few channels
    (3, 17, 1, 5, 1, 2, 1, 8, 7, "direct"),                 # CIFAR-10's: pad, outputs past a vector
    (3, 8, 1, 7, 2, 3, 1, 11, 11, "direct"),                # ResNet's: stride 2
    (2, 5, 1, 3, 2, 2, 2, 9, 8, "direct"),                  # dilation, uneven output
    (8, 8, 8, 3, 1, 1, 1, 6, 6, "depthwise"),               # MobileNet's
    (8, 8, 8, 3, 2, 1, 1, 7, 6, "depthwise"),
    (13, 13, 13, 3, 1, 1, 1, 5, 6, "depthwise"),            # a vector of channels and 5 more
    (19, 19, 19, 5, 2, 3, 2, 9, 8, "depthwise"),            # stride, dilation, wide padding
    (45, 45, 45, 3, 1, 2, 2, 5, 6, "depthwise"),            # 32 channels at once, 8, then 5
    (40, 40, 40, 3, 2, 1, 1, 7, 6, "depthwise"),            # and with stride 2
    (109, 109, 109, 3, 1, 1, 1, 5, 6, "depthwise"),         # AVX-512: 64 at once, then 32, 8, 5
    (72, 72, 72, 3, 2, 1, 1, 7, 6, "depthwise"),            # and with stride 2
    (8, 8, 8, 3, 1, 1, 1, 6, 6, "im2col+gemm"),             # depthwise as groups
    (16, 16, 1, 3, 1, 1, 1, 7, 6, "winograd F(2,3)"),
    (16, 16, 1, 3, 1, 1, 1, 7, 6, "winograd F(3,3)"),
    (12, 20, 1, 3, 1, 1, 1, 6, 5, "winograd F(4,3)"),       # channels not a whole block
    (16, 24, 2, 3, 1, 0, 1, 6, 6, "winograd F(4,3)"),       # groups, no padding
    (8, 8, 1, 5, 1, 2, 1, 7, 7, "winograd F(2,5)"),
    (8, 12, 1, 5, 1, 2, 1, 6, 7, "winograd F(3,5)"),
    (8, 8, 1, 3, 1, 1, 1, 11, 12, "winograd F(5,3)"),
    (8, 12, 1, 5, 1, 2, 1, 9, 8, "winograd F(4,5)"),
]


def _conv_cases():
    out = []
    for C, O, g, k, s, p, d, H, W, algo in CONVS:
        params = (f"convolution_param {{ num_output: {O} kernel_size: {k} stride: {s} pad: {p} "
                  f"dilation: {d} group: {g} {FILL} }}")
        out.append(Case("Convolution", params, [randn(2, C, H, W, seed=C + k, scale=0.5)],
                        layout=NHWC, expected=_conv_expected(p, s, g, d), init=_algorithm(algo),
                        atol=1e-4, rtol=1e-4, eps=0.5,     # linear in x and w: a wide step is exact
                        id=f"nhwc-conv-{algo}-C{C}O{O}g{g}k{k}s{s}p{p}d{d}"))
    return out


def _batch_norm_expected(eps=1e-5):
    def expected(x):
        mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
        return [(x - mean) / np.sqrt(var + eps)]
    return expected


def _global_stats(x):
    mean = np.array([1.0, -2.0, 0.5], np.float32).reshape(1, 3, 1, 1)
    var = np.array([4.0, 0.5, 2.0], np.float32).reshape(1, 3, 1, 1)
    return [(x - mean) / np.sqrt(var + 1e-5)]


def _set_global_stats(layer):
    layer.blobs[0].data[...] = [2.0, -4.0, 1.0]
    layer.blobs[1].data[...] = [8.0, 1.0, 4.0]
    layer.blobs[2].data[...] = 2.0


def _scale_expected(x, layer):
    s = layer.blobs[0].data.astype(np.float64).reshape(1, -1, 1, 1)
    b = layer.blobs[1].data.astype(np.float64).reshape(1, -1, 1, 1) if len(layer.blobs) > 1 else 0
    return [x * s + b]


def _bias_expected(x, layer):
    return [x + layer.blobs[0].data.astype(np.float64).reshape(1, -1, 1, 1)]


BN_X = randn(4, 3, 2, 3, seed=20, scale=2.0) + np.array([1.0, -2.0, 0.5], np.float32).reshape(1, 3, 1, 1)
GAUSS = "filler { type: 'gaussian' } bias_filler { type: 'gaussian' }"

CASES = [
    Case("NHWCPack", "", [randn(2, 3, 4, 5)], expected=lambda x: [x], atol=0, rtol=0),
    Case("NHWCUnpack", "", [randn(2, 11, 3, 2)], layout=NHWC, variant=PLAIN, expected=lambda x: [x],
         atol=0, rtol=0),
    *_conv_cases(),
    Case("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }", [distinct(2, 11, 7, 8)],
         layout=NHWC, expected=pool_expected("MAX", (3, 3), (2, 2), (1, 1)), id="nhwc-max-pad"),
    Case("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }", [distinct(2, 5, 5, 4)],
         layout=NHWC, expected=pool_expected("MAX", (3, 3), (1, 1), (1, 1)), id="nhwc-max-s1"),
    # 75 channels: two runs of 32 (AVX-512: one of 64), one of 8, three alone
    Case("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }", [distinct(2, 75, 5, 6)],
         layout=NHWC, expected=pool_expected("MAX", (3, 3), (2, 2), (1, 1)), id="nhwc-max-75-channels"),
    # 107 channels: AVX-512 runs of 64, 32, 8 and three alone
    Case("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }", [distinct(2, 107, 4, 5)],
         layout=NHWC, expected=pool_expected("MAX", (3, 3), (1, 1), (1, 1)), id="nhwc-max-107-channels"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }", [randn(2, 11, 7, 6)],
         layout=NHWC, expected=pool_expected("AVE", (3, 3), (2, 2), (1, 1)), id="nhwc-ave-pad"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 avg_include_pad: false }",
         [randn(2, 11, 7, 6)], layout=NHWC,
         expected=pool_expected("AVE", (3, 3), (2, 2), (1, 1), include_pad=False),
         id="nhwc-ave-pad-excluded"),
    Case("Pooling", "pooling_param { pool: AVE global_pooling: true }", [randn(2, 9, 5, 4)],
         layout=NHWC, expected=pool_expected("AVE", None, (1, 1), (0, 0), global_pooling=True),
         id="nhwc-ave-global"),
    Case("Pooling", "pooling_param { pool: AVE kernel_size: 5 stride: 3 }", [randn(2, 4, 14, 14)],
         layout=NHWC, expected=pool_expected("AVE", (5, 5), (3, 3), (0, 0)), id="nhwc-ave-googlenet-aux"),
    Case("BatchNorm", "", [BN_X], layout=NHWC, expected=_batch_norm_expected(), id="nhwc-batchnorm"),
    # the one-pass moments from a shift keep the variance of data far from zero (forward only:
    # central differences in float32 cannot resolve this gradient)
    Case("BatchNorm", "batch_norm_param { eps: 0.1 }", [randn(3, 16, 3, 2, seed=22) + 100],
         layout=NHWC, expected=_batch_norm_expected(0.1), grad=False, id="nhwc-batchnorm-offset"),
    Case("BatchNorm", "batch_norm_param { use_global_stats: true }", [BN_X], layout=NHWC,
         expected=_global_stats, init=_set_global_stats, id="nhwc-batchnorm-global"),
    Case("Scale", f"scale_param {{ bias_term: true {GAUSS} }}", [randn(2, 5, 3, 3)], layout=NHWC,
         expected=_scale_expected, id="nhwc-scale-bias"),
    Case("Scale", "scale_param { filler { type: 'gaussian' } }", [randn(2, 9, 2, 3)], layout=NHWC,
         expected=_scale_expected, id="nhwc-scale"),
    Case("Bias", "bias_param { filler { type: 'gaussian' } }", [randn(2, 5, 3, 3)], layout=NHWC,
         expected=_bias_expected, id="nhwc-bias"),
    Case("Concat", "", [randn(2, 3, 3, 2), randn(2, 13, 3, 2, seed=1), randn(2, 1, 3, 2, seed=2)],
         layout=NHWC, expected=lambda a, b, c: [np.concatenate([a, b, c], axis=1)], id="nhwc-concat"),
    Case("LRN", "lrn_param { local_size: 5 alpha: 0.8 beta: 0.75 k: 2 }", [randn(2, 11, 4, 3)],
         layout=NHWC, expected=lambda x: [ref_norm.lrn_across_forward(x, 5, 0.8, 0.75, 2.0)[0]],
         id="nhwc-lrn"),
    Case("LRN", "lrn_param { local_size: 3 alpha: 2 beta: 0.6 k: 1.5 }", [randn(2, 4, 3, 3, seed=3)],
         layout=NHWC, expected=lambda x: [ref_norm.lrn_across_forward(x, 3, 2.0, 0.6, 1.5)[0]],
         id="nhwc-lrn-beta0.6"),
    # the layout-agnostic plain layers run on channels-last blobs as they are
    Case("ReLU", "", [randn(2, 5, 3, 4)], layout=NHWC, variant=PLAIN, kink=0.0, kink_range=1e-2,
         expected=lambda x: [np.maximum(x, 0)], id="nhwc-relu"),
    Case("Eltwise", "", [randn(2, 5, 3, 4), randn(2, 5, 3, 4, seed=1)], layout=NHWC, variant=PLAIN,
         expected=lambda a, b: [a + b], id="nhwc-eltwise"),
]

test_forward, test_gradient = case_tests(CASES)


def test_channels_last_blob_shows_caffe_order():
    x = randn(2, 3, 4, 5)
    b = nhwc_blob(x)
    assert b.shape == (2, 3, 4, 5) and b.raw_data.shape == (2, 4, 5, 3)
    np.testing.assert_array_equal(b.data, x)
    np.testing.assert_array_equal(b.raw_data, ref_layout.pack(x))
    b.data[1, 2, 3, 4] = 7                  # writes go through the view
    assert b.raw_data[1, 3, 4, 2] == 7
    b.diff[...] = x
    np.testing.assert_array_equal(b.raw_diff, ref_layout.pack(x))
    b.reshape(1, 3, 2, 2)                   # keeps its layout
    assert b.raw_data.shape == (1, 2, 2, 3) and b.layout == CHANNELS_LAST
    with pytest.raises(ShapeError, match="channels-last"):
        b.reshape(3, 4)
    with pytest.raises(ShapeError, match="channels-last"):
        Blob((2, 3), name="flat").layout = CHANNELS_LAST


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 40, 33, 35), (3, 1, 2, 2)])
def test_pack_unpack_kernels_match_the_reference(shape):
    x = randn(*shape)
    y = np.full(ref_layout.pack(x).shape, np.nan, np.float32)
    kernels.pack(x, y)
    np.testing.assert_array_equal(y, ref_layout.pack(x))
    back = np.full_like(x, np.nan)
    kernels.unpack(y, back)
    np.testing.assert_array_equal(back, x)


def test_every_algorithm_of_a_shape_gives_the_same_numbers():
    """All candidates of one 3x3 shape agree with the reference, forward and backward."""
    params = f"convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {FILL} }}"
    x = randn(3, 16, 9, 8, seed=5)
    layer, bottom, top = setup_layer("Convolution", params, [x], layout=NHWC)
    assert set(layer.algorithms) == {"im2col+gemm", "direct", "winograd F(2,3)", "winograd F(3,3)",
                                     "winograd F(4,3)", "winograd F(5,3)"}
    w, b = (blob.data.astype(np.float64) for blob in layer.blobs)
    want = ref.conv_forward(x.astype(np.float64), w, b, (1, 1), (1, 1), (1, 1), 1)
    dy = randn(*want.shape, seed=6)
    dw, db, dx = ref.conv_backward(dy.astype(np.float64), x.astype(np.float64), w, (1, 1), (1, 1), (1, 1), 1)
    layer.param_propagate_down = [True, True]
    for name in layer.algorithms:
        layer.force_algorithm(name)
        layer.forward(bottom, top)
        np.testing.assert_allclose(top[0].data, want, rtol=1e-4, atol=1e-4, err_msg=name)
        top[0].diff[...] = dy
        for blob in layer.blobs:
            blob.diff[...] = 0
        layer.backward(top, [True], bottom)
        np.testing.assert_allclose(bottom[0].diff, dx, rtol=1e-4, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-4, atol=1e-3, err_msg=name)
        np.testing.assert_allclose(layer.blobs[1].diff, db, rtol=1e-4, atol=1e-3, err_msg=name)


@pytest.mark.parametrize("forward, weights, data", [
    ("winograd F(4,3)", "direct", "im2col+gemm"),
    ("direct", "im2col+gemm", "winograd F(2,3)"),
    ("im2col+gemm", "winograd F(3,3)", "winograd F(3,3)"),
])
def test_passes_by_different_algorithms_give_the_same_numbers(forward, weights, data):
    """A forward by one algorithm, the weight and data gradients by others (what the per-pass
    choice can pick): each must work from the weights, not from state another one left."""
    params = f"convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {FILL} }}"
    x = randn(2, 16, 7, 6, seed=8)
    layer, bottom, top = setup_layer("Convolution", params, [x], layout=NHWC)
    layer.param_propagate_down = [True, True]
    for step in range(2):                   # new weights between steps: nothing stale is used
        for blob in layer.blobs:
            blob.data[...] = randn(*blob.shape, seed=20 + step)
        layer._use({"forward": layer.algorithms[forward], "weights": layer.algorithms[weights],
                    "data": layer.algorithms[data]}, {"forward": "forced"})
        w, b = (blob.data.astype(np.float64) for blob in layer.blobs)
        want = ref.conv_forward(x.astype(np.float64), w, b, (1, 1), (1, 1), (1, 1), 1)
        dy = randn(*want.shape, seed=9 + step)
        dw, db, dx = ref.conv_backward(dy.astype(np.float64), x.astype(np.float64), w, (1, 1), (1, 1), (1, 1), 1)
        layer.forward(bottom, top)
        np.testing.assert_allclose(top[0].data, want, rtol=1e-4, atol=1e-4)
        top[0].diff[...] = dy
        for blob in layer.blobs:
            blob.diff[...] = 0
        layer.backward(top, [True], bottom)
        np.testing.assert_allclose(bottom[0].diff, dx, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(layer.blobs[1].diff, db, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("n, stride, dilation", [(1, 1, 1), (3, 1, 1), (1, 2, 1), (1, 1, 2),
                                                  (2, 3, 2)])
def test_direct_convolution_of_a_small_batch_splits_images_into_row_bands(n, stride, dilation):
    """Big enough for several threads (when the machine has them) with fewer images than two
    per thread: each image's output rows are split among tasks, each padding only the input
    rows its band reads, forward and weight gradient."""
    params = (f"convolution_param {{ num_output: 40 kernel_size: 5 pad: 2 stride: {stride} "
              f"dilation: {dilation} {FILL} }}")
    x = randn(n, 3, 75, 61, seed=11)        # 1.2-13.7M multiply-adds an image: bands of >= 1M
    layer, bottom, top = setup_layer("Convolution", params, [x], layout=NHWC)
    layer.force_algorithm("direct")
    layer.param_propagate_down = [True, True]
    w, b = (blob.data.astype(np.float64) for blob in layer.blobs)
    geometry = ((2, 2), (stride, stride), (dilation, dilation))
    want = ref.conv_forward(x.astype(np.float64), w, b, *geometry, 1)
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, want, rtol=1e-4, atol=1e-4)
    dy = randn(*want.shape, seed=12)
    dw, db, _ = ref.conv_backward(dy.astype(np.float64), x.astype(np.float64), w, *geometry, 1)
    top[0].diff[...] = dy
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, [False], bottom)
    np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-4, atol=2e-3)
    np.testing.assert_allclose(layer.blobs[1].diff, db, rtol=1e-4, atol=2e-3)


def test_strided_pointwise_convolution_overwrites_the_whole_bottom_diff():
    """The pixels a stride-2 1x1 convolution skips get a zero gradient, whatever the diff held."""
    params = f"convolution_param {{ num_output: 6 kernel_size: 1 stride: 2 {FILL} }}"
    x = randn(2, 5, 7, 6, seed=13)
    layer, bottom, top = setup_layer("Convolution", params, [x], layout=NHWC)
    layer.force_algorithm("strided gemm")
    w, b = (blob.data.astype(np.float64) for blob in layer.blobs)
    layer.forward(bottom, top)
    dy = randn(*top[0].shape, seed=14)
    _, _, dx = ref.conv_backward(dy.astype(np.float64), x.astype(np.float64), w, (0, 0), (2, 2), (1, 1), 1)
    top[0].diff[...] = dy
    bottom[0].diff[...] = np.nan
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(bottom[0].diff, dx, rtol=1e-5, atol=1e-5)
    assert not bottom[0].diff[:, :, 1::2].any() and not bottom[0].diff[:, :, :, 1::2].any()


def _forced_forward(outputs, params, x, algorithm):
    """A channels-last Convolution of `outputs` (and convolution_param `params`) on x, forced to
    `algorithm`, wanting both parameter gradients, after one forward: (layer, bottom, top)."""
    params = f"convolution_param {{ num_output: {outputs} {params} {FILL} }}"
    layer, bottom, top = setup_layer("Convolution", params, [x], layout=NHWC)
    layer.force_algorithm(algorithm)
    layer.param_propagate_down = [True, True]
    layer.forward(bottom, top)
    return layer, bottom, top


@pytest.mark.parametrize("params, algorithm", [
    ("kernel_size: 1", "gemm"),
    ("kernel_size: 1 group: 2", "gemm"),
    ("kernel_size: 1 stride: 2", "strided gemm"),
    ("kernel_size: 1 pad: 1", "im2col+gemm"),
])
def test_pointwise_weight_diffs_accumulate_in_caffe_order(params, algorithm):
    """A 1 x 1 kernel's GEMMs read Caffe's weights and add their gradient straight into the
    diff: what the diff held stays, twice the gradient after two backwards, and a diff that is
    no flat view (the fallback) gets the same."""
    layer, bottom, top = _forced_forward(6, params, randn(2, 4, 5, 6, seed=15), algorithm)
    top[0].diff[...] = randn(*top[0].shape, seed=16)
    held = [randn(*blob.shape, seed=17 + i) for i, blob in enumerate(layer.blobs)]
    for blob, start in zip(layer.blobs, held):
        blob.diff[...] = start
    layer.backward(top, [True], bottom)
    once = [blob.diff - start for blob, start in zip(layer.blobs, held)]
    assert np.abs(once[0]).max() > 0.1
    layer.backward(top, [False], bottom)
    for blob, start, grad in zip(layer.blobs, held, once):
        np.testing.assert_allclose(blob.diff, start + 2 * grad, rtol=1e-5, atol=1e-5)
    weights = layer.blobs[0]
    flat = weights._diff
    weights._diff = np.asfortranarray(flat)     # a layout reshape(-1) would have to copy
    assert not weights._diff.flags.c_contiguous
    weights._diff[...] = 0
    layer.backward(top, [False], bottom)
    np.testing.assert_allclose(weights._diff, once[0], rtol=1e-5, atol=1e-5)
    weights._diff = flat


def test_pointwise_kernel_adds_each_tasks_weight_gradient_to_the_sum():
    """conv_backward in Caffe's order with a diff to add to, over many tasks (a small `rows`),
    so that threads, when the machine has them, each add a part: the same sums as NumPy's."""
    c, o = 48, 32                           # 6.3M multiply-adds: two threads' worth
    x, dy = randn(4, 32, 32, c, seed=18), randn(4, 32, 32, o, seed=19)
    w = randn(1, o, c, seed=20)
    threads = kernels.max_threads()
    start = randn(o * c, seed=21)
    dw_sum, dx = start.copy(), np.full_like(x, np.nan)
    dwt = np.full((threads, o * c), np.nan, np.float32)
    kernels.conv_backward(x, w, dy, dx, dwt, np.zeros((0, 0), np.float32),
                          np.zeros((threads, 0), np.float32), o, 1, 1, 0, 0, 1, 1, 1, 1, 1, 256,
                          True, True, False, True, dw_sum)
    x2, dy2 = x.reshape(-1, c).astype(np.float64), dy.reshape(-1, o).astype(np.float64)
    np.testing.assert_allclose(dw_sum, start + (dy2.T @ x2).ravel(), rtol=1e-4, atol=2e-3)
    np.testing.assert_allclose(dx.reshape(-1, c), dy2 @ w[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pixels,threads,rows", [
    (784, 2, 784),              # fewer than a task a thread: the whole batch
    (2047, 2, 2047),
    (2048, 2, 1024), (3136, 2, 784), (50176, 2, 1004), (50177, 2, 1004),
    (3136, 1, 784), (12544, 4, 784),
])
def test_pointwise_backward_tasks_are_even_across_threads(pixels, threads, rows):
    assert conv_algorithms.pointwise_backward_rows(pixels, threads) == rows
    tasks = -(-pixels // rows)
    assert rows == pixels or (tasks % threads == 0 and rows <= conv_algorithms.POINTWISE_TASK)


@pytest.mark.parametrize("params, algorithm", [
    ("kernel_size: 1", "gemm"),
    ("kernel_size: 1 stride: 2", "strided gemm"),
])
def test_pointwise_backward_in_tasks_gives_the_reference_gradients(params, algorithm):
    """Over enough pixels for several tasks a thread (2 x 96 x 66 = 12672, or the 3168 a stride
    of 2 takes), the data and weight gradients are the whole batch's."""
    x = randn(2, 16, 96, 66, seed=25)
    layer, bottom, top = _forced_forward(24, params, x, algorithm)
    dy = randn(*top[0].shape, seed=26)
    top[0].diff[...] = dy
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, [True], bottom)
    s = 2 if "stride" in params else 1
    want_dw, want_db, want_dx = ref.conv_backward(dy, x, layer.blobs[0].data, (0, 0), (s, s), (1, 1), 1)
    np.testing.assert_allclose(bottom[0].diff, want_dx, rtol=1e-4, atol=1e-4 * np.abs(want_dx).max())
    np.testing.assert_allclose(layer.blobs[0].diff, want_dw, rtol=1e-4, atol=1e-4 * np.abs(want_dw).max())
    np.testing.assert_allclose(layer.blobs[1].diff, want_db, rtol=1e-4, atol=1e-4 * np.abs(want_db).max())


@pytest.mark.parametrize("algorithm,phase", [("direct", TRAIN), ("im2col+gemm", TRAIN),
                                             ("winograd F(4,3)", TEST), ("winograd F(2,3)", TEST)])
def test_reordered_weights_follow_a_change_of_one_float(algorithm, phase):
    """The algorithms that keep reordered (or, in a TEST net, Winograd-transformed) weights
    between forwards redo them when any float of the weights changes, written through an array
    held from before (as pycaffe code may)."""
    params = f"convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {FILL} }}"
    x = randn(2, 16, 6, 5, seed=23)
    layer, bottom, top = setup_layer("Convolution", params, [x], layout=NHWC, phase=phase)
    layer.force_algorithm(algorithm)
    held = layer.blobs[0].data
    for change in (None, (4, 2, 2, 1), (0, 0, 0, 0), None):
        if change is not None:
            held[change] += 0.25
        layer.forward(bottom, top)
        w, b = (blob.data.astype(np.float64) for blob in layer.blobs)
        want = ref.conv_forward(x.astype(np.float64), w, b, (1, 1), (1, 1), (1, 1), 1)
        # Winograd's float32 error: 2e-5 of the largest value (conv_algorithms.WINOGRAD_TILES)
        np.testing.assert_allclose(top[0].data, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_test_nets_winograd_transforms_its_weights_once(monkeypatch):
    """A TEST net's Winograd forward keeps its U across forwards and batch sizes while the
    weights hold the same floats; a TRAIN net's transforms them each forward."""
    params = f"convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 {FILL} }}"
    calls = []
    real = conv_algorithms._winograd

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def weight_transform(self, *args):
            calls.append(args[0].shape)
            return real.weight_transform(*args)

    monkeypatch.setattr(conv_algorithms, "_winograd", Counting())
    for phase, want in ((TEST, 2), (TRAIN, 4)):
        calls.clear()
        layer, bottom, top = setup_layer("Convolution", params, [randn(2, 16, 8, 8)], layout=NHWC,
                                         phase=phase)
        layer.force_algorithm("winograd F(4,3)")
        for n in (2, 2, 1):
            bottom[0].reshape(n, 16, 8, 8)
            layer.reshape(bottom, top)
            layer.forward(bottom, top)
        layer.blobs[0].data[0, 0, 0, 0] += 1
        layer.forward(bottom, top)
        assert len(calls) == want, phase


@pytest.mark.parametrize("kernel, stride, group, algorithm", [
    (1, 1, 1, "gemm"), (1, 2, 1, "strided gemm"), (3, 1, 2, "im2col+gemm"),
    (3, 2, 1, "im2col+gemm")])
def test_test_nets_im2col_packs_its_weights_once_and_follows_a_change(monkeypatch, kernel, stride,
                                                                   group, algorithm):
    """A TEST net's im2col forward reads its weights packed once (nhwc.pack_weights): packed
    again only when a float of them changes, written through an array held from before, and
    giving the TRAIN net's numbers (which packs on every product, or leaves it to the BLAS) to
    float rounding; a TRAIN net never keeps packed weights."""
    params = (f"convolution_param {{ num_output: 40 kernel_size: {kernel} stride: {stride} "
              f"group: {group} {FILL} }}")
    packs = []
    real = conv_algorithms._k

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def pack_weights(self, *args):
            packs.append(args[0].shape)
            return real.pack_weights(*args)

    monkeypatch.setattr(conv_algorithms, "_k", Counting())
    x = randn(1, 16, 9, 9, seed=31)
    test, bottom, top = setup_layer("Convolution", params, [x], layout=NHWC, phase=TEST)
    train, train_bottom, train_top = setup_layer("Convolution", params, [x], layout=NHWC)
    for layer in (test, train):
        layer.force_algorithm(algorithm)
    held = test.blobs[0].data
    for step, change in enumerate((None, (39, 7, 0, 0), None, (0, 0, 0, 0))):
        if change is not None:
            held[change] += 0.25
        train.blobs[0].data[...] = held
        test.forward(bottom, top)
        train.forward(train_bottom, train_top)
        w, b = (blob.data.astype(np.float64) for blob in test.blobs)
        want = ref.conv_forward(x.astype(np.float64), w, b, (0, 0), (stride, stride), (1, 1),
                                group)
        np.testing.assert_allclose(top[0].data, want, rtol=1e-5, atol=1e-5, err_msg=step)
        np.testing.assert_allclose(top[0].data, train_top[0].data, rtol=1e-5, atol=1e-5)
    assert len(packs) == 3
    assert test.algos["forward"].packed is not None
    assert train.algos["forward"].packed is None
    # with nothing held outside, a forward packs nothing and compares nothing (blob.Writes)
    del held
    test.forward(bottom, top)
    packs.clear()
    compares = []
    same_floats = real.same_floats
    monkeypatch.setattr(real, "same_floats", lambda a, b: compares.append(a.size) or same_floats(a, b))
    test.forward(bottom, top)
    assert packs == [] and compares == []
    test.blobs[0].data[0, 0, 0, 0] += 1         # taken and written: compared, packed again
    test.forward(bottom, top)
    assert len(packs) == 1 and compares


def test_strided_pointwise_convolution_is_no_direct_candidate():
    params = f"convolution_param {{ num_output: 4 kernel_size: 1 stride: 2 {FILL} }}"
    layer, _, _ = setup_layer("Convolution", params, [randn(1, 8, 6, 6)], layout=NHWC)
    with pytest.raises(LayerError, match=r"no algorithm 'direct' for this shape.*Candidates: strided gemm$"):
        layer.force_algorithm("direct")


def test_force_algorithm_names_the_candidates():
    layer, _, _ = setup_layer("Convolution", f"convolution_param {{ num_output: 4 kernel_size: 1 {FILL} }}",
                              [randn(1, 4, 3, 3)], layout=NHWC)
    with pytest.raises(LayerError, match=r"no algorithm 'winograd F\(4,3\)' for this shape.*Candidates: gemm"):
        layer.force_algorithm("winograd F(4,3)")


def test_the_rule_picks_winograd_depthwise_and_gemm(monkeypatch):
    monkeypatch.setenv("CAFFEPY_AUTOTUNE", "0")
    def chosen(params, shape):
        layer, _, _ = setup_layer("Convolution", f"convolution_param {{ {params} {FILL} }}",
                                  [randn(*shape)], layout=NHWC)
        return layer.algorithm, layer.tuning
    assert chosen("num_output: 32 kernel_size: 3 pad: 1", (1, 32, 12, 12)) == ("winograd F(4,3)", "rule")
    assert chosen("num_output: 32 kernel_size: 3 pad: 1 group: 32", (1, 32, 6, 6)) == ("depthwise", "rule")
    assert chosen("num_output: 8 kernel_size: 1", (1, 32, 6, 6)) == (
        "gemm", "forward rule; weights rule; data only")
    # the direct algorithm has no data gradient of its own (a layer built alone wants one)
    assert chosen("num_output: 8 kernel_size: 3 stride: 2", (1, 32, 6, 6)) == (
        "forward direct, weights direct, data im2col+gemm", "forward rule; weights rule; data only")
    assert chosen("num_output: 8 kernel_size: 5 stride: 2", (1, 32, 12, 12)) == (
        "im2col+gemm", "forward rule; weights rule; data only")     # 800 taps: direct is measured
    assert chosen("num_output: 8 kernel_size: 7 stride: 2", (1, 32, 12, 12)) == ("im2col+gemm", "only")


def test_kernels_refuse_mismatched_arguments():
    x = np.zeros((1, 4, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"conv_forward: y: needs shape \(1, 4, 4, 5\)"):
        kernels.conv_forward(x, np.zeros((1, 8, 5), np.float32), np.zeros(0, np.float32),
                             np.zeros((1, 4, 4, 6), np.float32), np.zeros((1, 0), np.float32),
                             5, 1, 1, 0, 0, 1, 1, 1, 1, 1, 16)
    v = kernels.direct_widths()[0]      # outputs per vector: 16 on AVX-512, 8 on AVX2
    # the direct convolution trusts its scratch: one too small is refused, never overrun
    y = np.zeros((1, 80), np.float32)
    with pytest.raises(ValueError, match=r"conv_direct_forward: xpad: needs shape \(>= 1, >= 288\)"):
        kernels.conv_direct_forward(x, 8, np.zeros((72, v), np.float32), np.zeros(v, np.float32),
                                    y, 5, 5, 5, 0, np.zeros((2, 287), np.float32), 3, 3, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"conv_direct_forward: y: needs shape \(1, >= 80\)"):
        kernels.conv_direct_forward(x, 8, np.zeros((72, v), np.float32), np.zeros(v, np.float32),
                                    y[:, :79], 5, 5, 5, 0, np.zeros((2, 288), np.float32), 3, 3, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"conv_direct_forward: C: must be 1 .. 8"):
        kernels.conv_direct_forward(x, 9, np.zeros((81, v), np.float32), np.zeros(v, np.float32),
                                    y, 5, 5, 5, 0, np.zeros((2, 400), np.float32), 3, 3, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"conv_direct_weight_grad: dyp: needs shape"):
        kernels.conv_direct_weight_grad(x, 8, y, 5, 5, 5, 0, np.zeros((2, 72 * v), np.float32),
                                        np.zeros((2, v), np.float32), np.zeros((2, 288), np.float32),
                                        np.zeros((2, 4 * v - 1), np.float32), 1, 3, 3, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"conv_forward: caffe_order: needs a 1 x 1 kernel, got 3x3"):
        kernels.conv_forward(x, np.zeros((1, 5, 72), np.float32), np.zeros(0, np.float32),
                             np.zeros((1, 2, 2, 5), np.float32), np.zeros((1, 4 * 72), np.float32),
                             5, 3, 3, 0, 0, 1, 1, 1, 1, 1, 4, True)
    with pytest.raises(ValueError, match=r"take_pixels: out: needs shape \(1, 2, 2, 8\)"):
        kernels.take_pixels(x, np.zeros((1, 2, 3, 8), np.float32), 2, 2)
    with pytest.raises(ValueError, match=r"put_pixels: d: needs shape \(1, 2, 1, 8\)"):
        kernels.put_pixels(np.zeros((1, 2, 2, 8), np.float32), x, 3, 4)
    with pytest.raises(ValueError, match=r"pack: y: needs shape \(1, 4, 8, 4\)"):
        kernels.pack(x, np.zeros((1, 4, 4, 8), np.float32))
    with pytest.raises(ValueError, match=r"channel_affine: mul: needs shape \(8,\)"):
        kernels.channel_affine(x.reshape(16, 8), np.zeros(8, np.float32), np.zeros(3, np.float32),
                               np.zeros(0, np.float32), x.reshape(16, 8), np.zeros((0, 0), np.float32))


@pytest.mark.parametrize("channels", [8, 12, 3, 43])
def test_max_pool_mask_keeps_the_first_maximum(channels):
    """Ties go to the first window position in row-major order (Caffe's rule), in the runs of
    eight channels and in the channels after them alike; padding is never the maximum."""
    x = np.zeros((1, 4, 4, channels), np.float32)
    x[0, 2, 1:3, :] = 5.0           # a tie at (2, 1) and (2, 2) in the last window, zeros before
    y = np.empty((1, 2, 2, channels), np.float32)
    mask = np.empty((1, 2, 2, channels), np.int32)
    kernels.pool_max_forward(x, y, mask, 3, 3, 2, 2, 1, 1)
    # windows: rows -1..1 / 1..3, cols -1..1 / 1..3 (padding ignored)
    np.testing.assert_array_equal(mask[0, :, :, 0], [[0, 1], [9, 9]])
    np.testing.assert_array_equal(y[0, :, :, 0], [[0, 0], [5, 5]])
    assert (mask == mask[..., :1]).all() and (y == y[..., :1]).all()


@pytest.mark.parametrize("channels,window", [(43, (3, 3, 2, 2, 1, 1)), (75, (3, 3, 1, 1, 1, 1)),
                                             (8, (2, 2, 2, 2, 0, 0)), (5, (3, 3, 2, 2, 0, 0))])
def test_max_pool_without_a_mask_gives_the_same_maxima(channels, window):
    """mask None (a TEST net's forward): the values of the masked forward, bit for bit, in the
    runs of 32 and 8 channels and the rest, NaN and infinities included."""
    rng_ = np.random.default_rng(channels)
    x = rng_.standard_normal((2, 9, 7, channels)).astype(np.float32)
    x[0, 3, 2, :5] = np.nan
    x[1, 4, 4, -3:] = np.inf
    x[1, 0, 0, :] = -np.inf
    kh, kw, sh, sw, ph, pw = window
    oh, ow = (9 + 2 * ph - kh) // sh + 1, (7 + 2 * pw - kw) // sw + 1
    y = np.full((2, oh, ow, channels), 7, np.float32)
    y0 = np.empty_like(y)
    mask = np.empty(y.shape, np.int32)
    kernels.pool_max_forward(x, y0, mask, *window)
    kernels.pool_max_forward(x, y, None, *window)
    np.testing.assert_array_equal(y.view(np.int32), y0.view(np.int32))


def test_a_test_nets_max_pool_backward_finds_its_argmax():
    """A TEST net's forward makes no mask; its backward (pycaffe's net.backward on a TEST
    net) routes the gradient as a TRAIN net's does, ties to the first maximum."""
    x = np.round(randn(2, 11, 7, 8) * 2)            # ties in many windows
    params = "pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }"
    dx = {}
    for phase in (TRAIN, TEST):
        layer, bottom, top = setup_layer("Pooling", params, [x], phase=phase, layout=NHWC)
        assert type(layer).__name__ == "NHWCPooling"
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        assert (layer.mask is None) == (phase == TEST)
        top[0].diff[...] = np.arange(top[0].count, dtype=np.float32).reshape(top[0].shape)
        layer.backward(top, [True], bottom)
        dx[phase] = bottom[0].diff.copy()
        layer.backward(top, [True], bottom)          # the argmax found once serves again
        np.testing.assert_array_equal(bottom[0].diff, dx[phase])
    np.testing.assert_array_equal(dx[TEST], dx[TRAIN])
