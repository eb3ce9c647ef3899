"""The bf16 variants of Convolution and InnerProduct (caffepy/layers/bf16.py) against float64
references computed on bf16-rounded operands, and their gradient check.

The cases run the path this CPU's bf16 kernels take (AMX-BF16, else AVX512_BF16: layers built
without CAFFEPY_BF16), or the emulation where it has neither (the conftest's CAFFEPY_BF16 set or
not, see precision.kernel); test_kernels_match_the_emulation compares the kernels, both paths
where the CPU has them, with the emulation, forward and backward.

Forward tolerance: the rounded operands' products are exact in float32 and in float64, so the
variants differ from the float64 reference by float32's summation only (rtol 1e-5); the same
reference without the rounding is 1e-3 or more away, so the cases see whether rounding happens.

Gradient tolerance: the forward is a step function of each operand (its rounding), so the
checker's step must span many bf16 steps: eps 1.0 (central differences are exact for a layer
linear in each operand, as both are, but for the rounding of the two perturbed ends: at most
half a bf16 step of |x| + 1 each, 2^-7 of the derivative for |x| < 3), threshold 2e-2; the top
weights (the top diff) are bf16 values, so that the backward's rounding of the top diff, whose
effect test_backward_products_take_rounded_operands checks exactly, adds nothing. Measured:
1.0e-2 at most over these cases (eps 0.25: 2.3e-2, 0.5: 1.5e-2); with float32 top weights the
weight gradients over 84 pixels are 2-5e-2 off (bf16's top diff: the straight-through
gradient is approximate).
"""
import numpy as np
import pytest

from caffepy import device, precision
from caffepy.net import TEST
from caffepy.kernels.reference.bf16 import round_bf16 as reference_bf16
from layer_cases import Case, case_tests, randn, setup_layer

GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


def bf16_top_weights(top):
    gen = np.random.default_rng(1701)
    return [reference_bf16(gen.standard_normal(t.shape).astype(np.float32)).astype(np.float64)
            for t in top]


GRAD = dict(eps=1.0, threshold=2e-2, top_weights=bf16_top_weights)


def conv64(x, w, b, pad=(0, 0), stride=(1, 1), dil=(1, 1), group=1):
    """A float64 convolution, one kernel tap at a time."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // group
    for g in range(group):
        for i in range(kh):
            for j in range(kw):
                win = xp[:, g * cg:(g + 1) * cg, i * dil[0]:i * dil[0] + stride[0] * oh:stride[0],
                         j * dil[1]:j * dil[1] + stride[1] * ow:stride[1]]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", win, w[g * og:(g + 1) * og, :, i, j])
    return out + (0 if b is None else b[None, :, None, None])


def _params(layer):
    w = reference_bf16(layer.blobs[0].data).astype(np.float64)
    b = layer.blobs[1].data.astype(np.float64) if len(layer.blobs) > 1 else None
    return w, b


def conv_expected(rounded=True, **geometry):
    def expected(x, layer):
        w, b = _params(layer)
        if not rounded:
            w = layer.blobs[0].data.astype(np.float64)
        x = reference_bf16(x.astype(np.float32)).astype(np.float64) if rounded else x
        return [conv64(x, w, b, **geometry)]
    return expected


def ip_expected(transpose=False, rounded=True):
    def expected(x, layer):
        w, b = _params(layer)
        if not rounded:
            w = layer.blobs[0].data.astype(np.float64)
        x = x.reshape(x.shape[0], -1)
        x = reference_bf16(x.astype(np.float32)).astype(np.float64) if rounded else x
        y = x @ (w if transpose else w.T)
        return [y + (0 if b is None else b)]
    return expected


X = randn(2, 4, 7, 6, seed=3)
CONVS = [
    ("convolution_param { num_output: 5 kernel_size: 3 pad: 1 %s }" % GAUSS, {"pad": (1, 1)}),
    ("convolution_param { num_output: 4 kernel_size: 3 stride: 2 group: 2 %s }" % GAUSS,
     {"stride": (2, 2), "group": 2}),
    ("convolution_param { num_output: 3 kernel_size: 2 dilation: 2 bias_term: false %s }" % GAUSS,
     {"dil": (2, 2)}),
]
IPS = [
    ("inner_product_param { num_output: 6 %s }" % GAUSS, X[:, :, :3, :3], False),
    ("inner_product_param { num_output: 5 transpose: true %s }" % GAUSS, randn(3, 11, seed=4), True),
]

CASES = [Case("Convolution", params, [X], conv_expected(**geometry), variant="bf16", rtol=1e-5,
              atol=1e-5, **GRAD) for params, geometry in CONVS] + \
        [Case("InnerProduct", params, [x], ip_expected(transpose), variant="bf16", rtol=1e-5, atol=1e-5,
              **GRAD) for params, x, transpose in IPS]

test_forward, test_gradient = case_tests(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rounding_is_what_the_cases_see(case):
    """Without the rounding the reference is far outside the cases' tolerance."""
    layer, bottom, top = case.build()
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    unrounded = (conv_expected(False, **CONVS[CASES.index(case)][1]) if case.type == "Convolution"
                 else ip_expected(IPS[CASES.index(case) - len(CONVS)][2], False))
    want = unrounded(case.bottoms[0].astype(np.float64), layer)[0]
    assert np.abs(top[0].data - want).max() > 1e-3 * np.abs(want).max()


def test_the_layer_keeps_its_float32_operands():
    """The rounding goes into scratch copies: the bottom and the weights (master) are unchanged."""
    layer, bottom, top = setup_layer("InnerProduct", IPS[0][0], [IPS[0][1]], variant="bf16")
    w = layer.blobs[0].data.copy()
    x = bottom[0].data.copy()
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert layer.blobs[0].data.dtype == np.float32
    np.testing.assert_array_equal(layer.blobs[0].data, w)
    np.testing.assert_array_equal(bottom[0].data, x)
    assert (w.view(np.uint32) & 0xFFFF).any()      # values bf16 cannot hold: they would change


def test_backward_products_take_rounded_operands():
    """dW = round(dy)^T round(x), dx = round(dy) round(W), the bias gradient sum(round(dy))."""
    params, x, _ = IPS[0]
    layer, bottom, top = setup_layer("InnerProduct", params, [x], variant="bf16")
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    dy = randn(*top[0].shape, seed=9)
    top[0].diff[...] = dy
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, [True], bottom)
    r = lambda a: reference_bf16(a).astype(np.float64)  # noqa: E731
    x2 = r(x.reshape(x.shape[0], -1))
    np.testing.assert_allclose(layer.blobs[0].diff, r(dy).T @ x2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.blobs[1].diff, r(dy).sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bottom[0].diff.reshape(x2.shape), r(dy) @ r(layer.blobs[0].data),
                               rtol=1e-5, atol=1e-6)


KERNEL_PATHS = [pytest.param("", id="best"), pytest.param("avx512_bf16", id="avx512_bf16")]
BIG = [Case("Convolution", "convolution_param { num_output: 24 kernel_size: 3 pad: 1 group: 2 %s }"
            % GAUSS, [randn(3, 128, 10, 9, seed=5)], variant="bf16"),         # Kg 576 > a k block
       # one image, large enough for both threads on each product (the packed weights' rows split)
       Case("Convolution", "convolution_param { num_output: 64 kernel_size: 3 pad: 1 %s }" % GAUSS,
            [randn(1, 256, 14, 14, seed=7)], variant="bf16"),
       Case("InnerProduct", "inner_product_param { num_output: 40 %s }" % GAUSS,
            [randn(5, 700, seed=6)], variant="bf16")]


def _run(case, setting, monkeypatch):
    """(top, bottom diff, param diffs) of one forward and backward under CAFFEPY_BF16=setting."""
    monkeypatch.setenv("CAFFEPY_BF16", setting)
    layer, bottom, top = case.build()
    assert layer.products == 0 if setting == "emulate" else layer.products != 0
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = randn(*top[0].shape, seed=11)
    for p in layer.blobs:
        p.diff[...] = 0.5                    # the weight and bias diffs accumulate into it
    layer.backward(top, [True], bottom)
    return [top[0].data.copy(), bottom[0].diff.copy()] + [p.diff.copy() for p in layer.blobs]


@pytest.mark.skipif(not all(f in device.cpu_flags() for f in precision.KERNEL_NEEDS["AVX512_BF16"]),
                    reason="this CPU runs no bf16 kernels (no AVX512_BF16 with AVX-512 BW and VL)")
@pytest.mark.parametrize("setting", KERNEL_PATHS)
@pytest.mark.parametrize("case", CASES + BIG, ids=[c.id for c in CASES + BIG])
def test_kernels_match_the_emulation(case, setting, monkeypatch):
    """The same rounded operands and exact products: the kernels and the emulation differ by
    the order of their float32 sums alone, 1e-5 of the largest value at these sizes (K <= 700:
    the worst case K 2^-24 is 4e-5; measured 1e-6)."""
    want = _run(case, "emulate", monkeypatch)
    got = _run(case, setting, monkeypatch)
    for name, g, w in zip(("top", "bottom diff", "weight diff", "bias diff"), got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max(), err_msg=name)


@pytest.mark.skipif(precision.kernel() is None, reason="this CPU runs no bf16 kernels")
@pytest.mark.parametrize("transpose", [False, True], ids=["w", "wT"])
def test_a_test_inner_product_reads_its_weights_packed_once_per_version(transpose):
    """A TEST net's InnerProduct keeps its weights rounded and packed (kernels.bf16.pack) and
    packs them again when the blob changes; the result is the rounded product's."""
    params = "inner_product_param { num_output: 37 transpose: %s %s }" % (
        "true" if transpose else "false", GAUSS)
    x = randn(3, 70, seed=12)
    layer, bottom, top = setup_layer("InnerProduct", params, [x], phase=TEST, variant="bf16")
    assert layer.packs
    for scale in (1.0, 3.0):
        layer.blobs[0].data[...] *= scale
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        w, b = _params(layer)
        want = reference_bf16(x).astype(np.float64) @ (w if transpose else w.T) + b
        np.testing.assert_allclose(top[0].data, want, rtol=1e-5, atol=1e-5)
