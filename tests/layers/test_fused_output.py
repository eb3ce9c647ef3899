"""Intel Caffe's fusions computed by the layer (caffepy.layers.common.FusedOutput): a
Convolution's `relu` / `negative_slope` and `fusion_type: SUM_FUSION` (bottom[1] the summand,
`coeff` the summand's and the convolution's weights), an InnerProduct's `relu`, on every path
(plain NCHW, channels-last, blocked). Each against the same layers apart (Convolution, then an
Eltwise SUM, then a ReLU: NumPy over the plain layer's output), forward and backward, and the
numerical gradient checker."""
import numpy as np
import pytest

from caffepy.blob import Blocked
from caffepy.errors import CaffepyError
from caffepy.kernels.reference.intel import pack as ref_pack, unpack as ref_unpack
from gradient_checker import check_gradient
from layer_cases import randn, setup_layer

CONV = "num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: 'gaussian' std: 0.3 } " \
       "bias_filler { type: 'gaussian' std: 0.3 }"
FUSIONS = {
    "relu": ("relu: true", None, 0.0),
    "leaky": ("relu: true negative_slope: 0.1", None, 0.1),
    "sum": ("fusion_type: SUM_FUSION", (1.0, 1.0), None),
    "sum+relu": ("fusion_type: SUM_FUSION relu: true", (1.0, 1.0), 0.0),
    "coeff+leaky": ("fusion_type: SUM_FUSION coeff: 0.5 coeff: -2 relu: true negative_slope: 0.2",
                    (0.5, -2.0), 0.2),
}
LAYOUTS = [None, "nhwc", "blocked"]


def _nchw(blob, diff=False):
    a = blob.diff if diff else blob.data
    return ref_unpack(a, blob.layout.channels) if isinstance(blob.layout, Blocked) else np.array(a)


def _set(blob, array, diff=False):
    """Write an NCHW array into a blob of any layout."""
    if isinstance(blob.layout, Blocked):
        array = ref_pack(np.asarray(array, np.float32), blob.layout.width)
    (blob.diff if diff else blob.data)[...] = array


def _apart(x, s, weights, coeff, slope, dy):
    """The layers apart: the plain Convolution (its output and backward), then NumPy's Eltwise
    SUM and ReLU. Returns (top, dx, dsummand, dW, db)."""
    conv, bottom, top = setup_layer("Convolution", f"convolution_param {{ {CONV} }}", [x])
    for mine, theirs in zip(conv.blobs, weights):
        mine.data[...] = theirs
    conv.forward(bottom, top)
    y = top[0].data.astype(np.float64)
    if coeff is not None:
        y = coeff[1] * y + coeff[0] * s
    out = y if slope is None else np.where(y > 0, y, slope * y)
    g = dy if slope is None else dy * np.where(y > 0, 1.0, slope)
    ds = None if coeff is None else coeff[0] * g
    top[0].diff[...] = g if coeff is None else coeff[1] * g
    conv.backward(top, [True], bottom)
    return out, bottom[0].diff.copy(), ds, conv.blobs[0].diff.copy(), conv.blobs[1].diff.copy()


def _fused(kind, layout, seed=0):
    fields, coeff, slope = FUSIONS[kind]
    x = randn(2, 3, 5, 4, seed=seed)
    bottoms = [x] if coeff is None else [x, randn(2, 4, 5, 4, seed=seed + 50)]
    layer, bottom, top = setup_layer("Convolution", f"convolution_param {{ {CONV} {fields} }}",
                                     bottoms, layout=layout)
    return layer, bottom, top, coeff, slope


@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "nhwc", "blocked"])
@pytest.mark.parametrize("kind", FUSIONS)
def test_fused_convolution_computes_the_layers_apart(kind, layout):
    layer, bottom, top, coeff, slope = _fused(kind, layout)
    assert layer.variant == (layout or "plain")
    x = _nchw(bottom[0])
    s = None if coeff is None else _nchw(bottom[1]).astype(np.float64)
    dy = randn(2, 4, 5, 4, seed=9)
    want, dx, ds, dw, db = _apart(x, s, [b.data for b in layer.blobs], coeff, slope, dy)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    np.testing.assert_allclose(_nchw(top[0]), want, rtol=1e-5, atol=1e-5)
    if slope:
        assert (_nchw(top[0]) < 0).any()            # the slope ran
    _set(top[0], dy, diff=True)
    for b in bottom:
        b.diff[...] = 0
    kept = top[0].diff.copy()
    layer.backward(top, [True] * len(bottom), bottom)
    np.testing.assert_array_equal(top[0].diff, kept)     # the top's diff is left as given
    np.testing.assert_allclose(_nchw(bottom[0], diff=True), dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.blobs[0].diff, dw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.blobs[1].diff, db, rtol=1e-4, atol=1e-4)
    if ds is not None:
        np.testing.assert_allclose(_nchw(bottom[1], diff=True), ds, rtol=1e-5, atol=1e-5)


def _away_from_the_kink(kind, layout):
    """A seed whose pre-activations all lie at least 0.05 from the ReLU's kink, so that the
    checker's steps (1e-2 on one value) never cross it."""
    for seed in range(100):
        layer, bottom, top, coeff, slope = _fused(kind, layout, seed)
        x = _nchw(bottom[0])
        s = None if coeff is None else _nchw(bottom[1])
        out, *_ = _apart(x, s, [b.data for b in layer.blobs], coeff, None,
                         np.zeros((2, 4, 5, 4)))
        if slope is None or np.abs(out).min() > 0.05:
            return layer, bottom, top
    raise AssertionError("no seed keeps the pre-activations off the kink")


@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "nhwc", "blocked"])
@pytest.mark.parametrize("kind", ["leaky", "coeff+leaky", "sum+relu"])
def test_fused_convolution_gradients(kind, layout):
    layer, bottom, top = _away_from_the_kink(kind, layout)
    weights = None
    if layout == "blocked":        # padding lanes carry no value: no weight there
        gen = np.random.default_rng(1701)
        weights = [gen.standard_normal(top[0].shape) * ref_pack(np.ones((1, 4, 1, 1)), top[0].layout.width)]
    check_gradient(layer, bottom, top, max_checks=60, top_weights=weights)


@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_fused_inner_product(slope):
    x = randn(3, 2, 2, 2, seed=4)
    params = ("inner_product_param { num_output: 5 weight_filler { type: 'gaussian' std: 0.5 } "
              "bias_filler { type: 'gaussian' std: 0.5 } %s }")
    fused, bottom, top = setup_layer("InnerProduct", params % f"relu: true negative_slope: {slope}", [x])
    plain, pbottom, ptop = setup_layer("InnerProduct", params % "", [x])
    for mine, theirs in zip(plain.blobs, fused.blobs):
        mine.data[...] = theirs.data
    for layer, b, t in ((fused, bottom, top), (plain, pbottom, ptop)):
        layer.forward(b, t)
    y = ptop[0].data.astype(np.float64)
    np.testing.assert_allclose(top[0].data, np.where(y > 0, y, slope * y), rtol=1e-6, atol=1e-6)
    dy = randn(3, 5, seed=8)
    top[0].diff[...] = dy
    ptop[0].diff[...] = dy * np.where(y > 0, 1.0, slope)
    fused.backward(top, [True], bottom)
    plain.backward(ptop, [True], pbottom)
    np.testing.assert_allclose(bottom[0].diff, pbottom[0].diff, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(fused.blobs, plain.blobs):
        np.testing.assert_allclose(mine.diff, theirs.diff, rtol=1e-5, atol=1e-6)
    if np.abs(y).min() > 0.05:
        check_gradient(fused, bottom, top)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "nhwc", "blocked"])
@pytest.mark.parametrize("params,bottoms,match", [
    ("fusion_type: SUM_FUSION", 1, r"convolution_param.fusion_type: SUM_FUSION takes two bottoms "
                                   r"\(the input and the summand\) and one top, got 1 bottom\(s\), 1 top\(s\)"),
    ("coeff: 1 coeff: 1", 1, r"convolution_param.coeff: weighs the summand of fusion_type: SUM_FUSION, "
                             r"which is not set"),
    ("fusion_type: SUM_FUSION coeff: 1", 2, r"convolution_param.coeff: needs two values"),
    ("relu: true negative_slope: -0.5", 1, r"convolution_param.negative_slope: a fused ReLU takes a "
                                           r"slope of at least 0 .*, got -0.5\. Use a ReLU layer"),
])
def test_bad_fusions_name_the_field(layout, params, bottoms, match):
    inputs = [randn(1, 3, 4, 4), randn(1, 4, 4, 4)][:bottoms]
    with pytest.raises(CaffepyError, match=match):
        setup_layer("Convolution", f"convolution_param {{ {CONV} {params} }}", inputs, layout=layout)


def test_a_summand_of_another_shape_is_refused():
    with pytest.raises(CaffepyError, match=r"bottom\[1\]: the summand of SUM_FUSION needs the top's "
                                           r"shape 1x4x4x4, got 1x4x2x4"):
        setup_layer("Convolution", f"convolution_param {{ {CONV} fusion_type: SUM_FUSION }}",
                    [randn(1, 3, 4, 4), randn(1, 4, 2, 4)])


def test_deconvolution_is_refused_the_fusions():
    with pytest.raises(CaffepyError, match=r"convolution_param.relu: a fused ReLU is run by "
                                           r"Convolution, not Deconvolution, got True"):
        setup_layer("Deconvolution", f"convolution_param {{ {CONV} relu: true }}", [randn(1, 3, 4, 4)])


APART = """force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 2 dim: 3 dim: 6 dim: 5 } shape { dim: 2 } } }
layer { name: "short" type: "Convolution" bottom: "data" top: "short"
  convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum" type: "Eltwise" bottom: "short" bottom: "conv" top: "sum" }
layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "fc" type: "InnerProduct" bottom: "sum" top: "fc"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""
# Intel's ConvSumFusion of the same net: conv takes the Eltwise's other bottom and its ReLU
FUSED = APART.replace(
    'bottom: "data" top: "conv"\n  convolution_param { num_output: 4 kernel_size: 3 pad: 1',
    'bottom: "data" bottom: "short" top: "sum"\n  convolution_param { fusion_type: SUM_FUSION relu: true '
    'num_output: 4 kernel_size: 3 pad: 1').replace(
    'layer { name: "sum" type: "Eltwise" bottom: "short" bottom: "conv" top: "sum" }\n'
    'layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" }\n', "")


@pytest.mark.parametrize("engine", ["", 'engine: "CAFFE"\n'], ids=["fast path", "caffe"])
def test_a_net_with_intels_sum_fusion_trains_as_the_layers_apart(tmp_path, engine):
    import caffepy
    from caffepy.net import Net
    nets = []
    for name, text in (("apart", APART), ("fused", FUSED)):
        path = tmp_path / f"{name}.prototxt"
        path.write_text(engine + text)
        nets.append(Net(str(path), caffepy.TRAIN))
    apart, fused = nets
    for name, layer in fused.layer_dict.items():
        for mine, theirs in zip(layer.blobs, apart.layer_dict[name].blobs):
            mine.data[...] = theirs.data
    for net in nets:
        net.blobs["data"].data[...] = randn(2, 3, 6, 5, seed=3)
        net.blobs["label"].data[...] = [0, 2]
        net.clear_param_diffs()
    losses = [net.forward_backward() for net in nets]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    np.testing.assert_allclose(fused.blobs["sum"].data, apart.blobs["sum"].data, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused.blobs["data"].diff, apart.blobs["data"].diff, rtol=1e-4, atol=1e-6)
    for name in ("short", "conv", "fc"):
        for mine, theirs in zip(fused.layer_dict[name].blobs, apart.layer_dict[name].blobs):
            np.testing.assert_allclose(mine.diff, theirs.diff, rtol=1e-4, atol=1e-6)
