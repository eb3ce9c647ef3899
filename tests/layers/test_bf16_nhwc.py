"""A bf16 TEST net's channels-last Convolution on AMX tiles (caffepy/layers/bf16.py
BF16NHWCConvolution, conv_algorithms.BF16Amx): the layer against a float64 reference on
bf16-rounded operands and its gradient check (the emulation's backward), and whole nets with the
TEST fusions (BatchNorm + Scale + ReLU, Eltwise SUM, a concat written in place) against the same
net emulated (CAFFEPY_BF16=emulate: NCHW, layer by layer) and against float32. Skipped where
the CPU (or Linux) gives no AMX-BF16.

Tolerances. The layer: the rounded operands' products are exact, so only float32's sums differ
from the float64 reference (rtol 1e-5, as tests/layers/test_bf16.py); its gradient as there.
A net against its emulation: each convolution's sums differ in order only (about 1e-7
relative), but the next convolution rounds its input to bf16 again, and an input that lands
within that difference of a rounding boundary moves by one bf16 step (2^-8 of it), one term of
a sum of hundreds: the bound is 1e-3 of the largest value (measured 2.3e-7 on these blobs).
Against float32: bf16's own error, about 2^-9 relative per operand and growing with depth:
the bound is 2e-2 of the largest value (measured 2e-3 to 5.5e-3), and the difference must be
above 1e-4 (bf16 ran).
"""
import numpy as np
import pytest
from google.protobuf import text_format

import caffepy
from caffepy import device, precision
from caffepy.blob import CHANNELS_LAST
from caffepy.kernels import bf16 as bf16_kernels
from caffepy.kernels.reference.bf16 import round_bf16
from caffepy.layer import NHWC
from caffepy.net import TEST, TRAIN, Net
from caffepy.proto import caffe_pb2
from layer_cases import Case, case_tests, randn

AMX_HERE = all(f in device.cpu_flags() for f in precision.KERNEL_NEEDS["AMX-BF16"]) \
    and bf16_kernels.amx_permitted()
needs_amx = pytest.mark.skipif(not AMX_HERE, reason="this CPU (or its kernel) gives no AMX-BF16")
GAUSS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 }'


def _top_weights(top):
    gen = np.random.default_rng(1701)
    return [round_bf16(gen.standard_normal(t.shape).astype(np.float32)).astype(np.float64)
            for t in top]


def _expected(pad, stride):
    def expected(x, layer):
        w = round_bf16(layer.blobs[0].data).astype(np.float64)
        x = round_bf16(x.astype(np.float32)).astype(np.float64)
        o, _, kh, kw = w.shape
        xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        oh = (xp.shape[2] - kh) // stride + 1
        ow = (xp.shape[3] - kw) // stride + 1
        y = np.zeros((x.shape[0], o, oh, ow))
        for i in range(kh):
            for j in range(kw):
                win = xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
                y += np.einsum("nchw,oc->nohw", win, w[:, :, i, j])
        return [y + layer.blobs[1].data[None, :, None, None]]
    return expected


class BF16Case(Case):
    """A case built while the precision is bf16 (the factory then picks the variant)."""

    def build(self):
        if not AMX_HERE:
            pytest.skip("this CPU (or its kernel) gives no AMX-BF16")
        precision.set_precision("bf16")
        try:
            return super().build()
        finally:
            precision.set_precision("f32")


CASES = [BF16Case("Convolution", "convolution_param { num_output: %d kernel_size: %d pad: %d "
                  "stride: %d %s }" % (o, k, p, s, GAUSS), [randn(2, c, 7, 6, seed=c)],
                  _expected(p, s), phase=TEST, layout=NHWC, variant=precision.BF16_NHWC,
                  rtol=1e-5, atol=1e-5, eps=1.0, threshold=2e-2, top_weights=_top_weights)
         for c, o, k, p, s in ((4, 5, 3, 1, 1), (3, 17, 1, 0, 2))]

test_forward, test_gradient = case_tests(CASES)


# A ResNet block (conv + BN + Scale + ReLU; a bottleneck whose last BN + Scale meets the shortcut
# in an Eltwise SUM + ReLU) and an Inception module (1x1, 1x1 -> 3x3, 1x1 -> 5x5, pool -> 1x1,
# concatenated) on it, then an InnerProduct
def _bn(name):
    return f"""
layer {{ name: "{name}_bn" type: "BatchNorm" bottom: "{name}" top: "{name}"
  batch_norm_param {{ use_global_stats: true }} }}
layer {{ name: "{name}_scale" type: "Scale" bottom: "{name}" top: "{name}"
  scale_param {{ bias_term: true }} }}"""


def _conv(name, bottom, o, k, pad=0, stride=1, bn=True, relu=True, group=1):
    text = f"""
layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}"
  convolution_param {{ num_output: {o} kernel_size: {k} pad: {pad} stride: {stride} group: {group}
    bias_term: {"false" if bn else "true"} weight_filler {{ type: "msra" }}
    bias_filler {{ type: "gaussian" std: 0.1 }} }} }}"""
    text += _bn(name) if bn else ""
    if relu:
        text += f"""
layer {{ name: "{name}_relu" type: "ReLU" bottom: "{name}" top: "{name}" }}"""
    return text


NET = ('name: "block" layer { name: "data" type: "Input" top: "data" '
       'input_param { shape { dim: 2 dim: 3 dim: 19 dim: 19 } } }'
       + _conv("conv1", "data", 32, 7, pad=3, stride=2)
       + _conv("res_a", "conv1", 16, 1) + _conv("res_b", "res_a", 16, 3, pad=1)
       + _conv("res_c", "res_b", 32, 1, relu=False) + """
layer { name: "res" type: "Eltwise" bottom: "conv1" bottom: "res_c" top: "res" }
layer { name: "res_relu" type: "ReLU" bottom: "res" top: "res" }"""
       + _conv("inc_1x1", "res", 24, 1, bn=False)
       + _conv("inc_3r", "res", 16, 1, bn=False) + _conv("inc_3x3", "inc_3r", 20, 3, pad=1, bn=False)
       + _conv("inc_5r", "res", 8, 1, bn=False) + _conv("inc_5x5", "inc_5r", 12, 5, pad=2, bn=False)
       + """
layer { name: "inc_pool" type: "Pooling" bottom: "res" top: "inc_pool"
  pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } }"""
       + _conv("inc_pp", "inc_pool", 8, 1, bn=False) + """
layer { name: "inc" type: "Concat" bottom: "inc_1x1" bottom: "inc_3x3" bottom: "inc_5x5"
  bottom: "inc_pp" top: "inc" }
layer { name: "fc" type: "InnerProduct" bottom: "inc" top: "fc"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }""")


def _net(name, phase=TEST, text=NET):
    """NET built in precision `name` (bf16, or 'emulate': bf16 under CAFFEPY_BF16=emulate) with
    the same weights (seeded fillers) and BatchNorm statistics."""
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    caffepy.set_random_seed(5)
    mp = pytest.MonkeyPatch()
    if name == "emulate":
        mp.setenv("CAFFEPY_BF16", "emulate")
    precision.set_precision("f32" if name == "f32" else "bf16")
    try:
        net = Net(p, phase)
    finally:
        precision.set_precision("f32")
        mp.undo()
    gen = np.random.default_rng(3)
    for layer in net.layers:
        if layer.type == "BatchNorm":
            c = layer.blobs[0].shape[0]
            layer.blobs[0].data[...] = gen.standard_normal(c) * 0.3
            layer.blobs[1].data[...] = gen.uniform(0.5, 2.0, c)
            layer.blobs[2].data[...] = 1
        if layer.type == "Scale":
            layer.blobs[0].data[...] = gen.uniform(0.5, 1.5, layer.blobs[0].shape)
            layer.blobs[1].data[...] = gen.standard_normal(layer.blobs[1].shape) * 0.1
    return net


def _forward(net):
    x = np.random.default_rng(9).standard_normal(net.blobs["data"].shape).astype(np.float32)
    net.forward(data=x)
    return {name: net.blobs[name].data.copy() for name in ("conv1", "res", "inc", "fc")}


@needs_amx
def test_a_bf16_test_net_runs_channels_last_with_the_fusions():
    net = _net("bf16")
    convs = [layer for layer in net.layers if layer.type == "Convolution"]
    assert {type(c).__name__ for c in convs} == {"BF16NHWCConvolution"}
    assert {c.algorithm for c in convs} == {"bf16 amx"}
    assert all(precision.of(c) == "bf16" for c in convs)
    assert net.blobs["res"].layout == CHANNELS_LAST and net.blobs["inc"].layout == CHANNELS_LAST
    assert net.fusions            # the TEST units formed, as in a float32 net
    assert net.fusions == _net("f32").fusions
    assert precision.summary(net.layers).startswith(
        "Precision per layer: bf16 (AMX-BF16, AMX-BF16 channels-last): conv1, res_a, ")


@needs_amx
def test_the_net_matches_its_emulation_and_float32():
    got, emulated, f32 = (_forward(_net(name)) for name in ("bf16", "emulate", "f32"))
    for name in got:
        scale = np.abs(f32[name]).max()
        assert np.abs(got[name] - emulated[name]).max() <= 1e-3 * scale, name
        assert 1e-4 * scale < np.abs(got[name] - f32[name]).max() <= 2e-2 * scale, name
    # the first convolution reads the input as both do: the same rounded operands and sums
    np.testing.assert_allclose(got["conv1"], emulated["conv1"], rtol=0,
                               atol=1e-5 * np.abs(emulated["conv1"]).max())


@needs_amx
def test_a_weight_written_between_forwards_is_read():
    net = _net("bf16")
    before = _forward(net)["fc"]
    net.params["res_b"][0].data[...] *= 2
    after = _forward(net)["fc"]
    want = _net("emulate")
    want.params["res_b"][0].data[...] *= 2
    assert np.abs(after - before).max() > 1e-2 * np.abs(before).max()
    assert np.abs(after - _forward(want)["fc"]).max() <= 1e-3 * np.abs(after).max()


@needs_amx
def test_training_nets_and_small_groups_stay_on_the_nchw_path():
    train = _net("bf16", TRAIN)
    assert {layer.variant for layer in train.layers if layer.type == "Convolution"} == {"bf16"}
    assert all(b.layout is None for b in train.blobs.values())
    grouped = NET.replace(_conv("res_b", "res_a", 16, 3, pad=1),
                          _conv("res_b", "res_a", 16, 3, pad=1, group=2))
    net = _net("bf16", text=grouped)
    variants = {layer.name: layer.variant for layer in net.layers if layer.type == "Convolution"}
    assert variants["res_b"] == "bf16" and variants["res_c"] == precision.BF16_NHWC


@needs_amx
def test_groups_of_16_channels_or_more_run_channels_last():
    grouped = NET.replace(_conv("inc_3r", "res", 16, 1, bn=False),
                          _conv("inc_3r", "res", 32, 1, bn=False, group=2)).replace(
        _conv("inc_3x3", "inc_3r", 20, 3, pad=1, bn=False),
        _conv("inc_3x3", "inc_3r", 32, 3, pad=1, bn=False, group=2))
    net = _net("bf16", text=grouped)
    assert {net.layer_dict[name].variant for name in ("inc_3r", "inc_3x3")} == {precision.BF16_NHWC}
    got, emulated = _forward(net), _forward(_net("emulate", text=grouped))
    for name in got:
        assert np.abs(got[name] - emulated[name]).max() <= 1e-3 * np.abs(emulated[name]).max()


@needs_amx
def test_depthwise_runs_channels_last_on_rounded_operands():
    # MobileNet's depthwise layers (a group per channel): the float32 depthwise kernel on
    # bf16-rounded input and weights (conv_algorithms.BF16Depthwise), which is bf16's
    # arithmetic; the NCHW bf16 path ran them as a GEMM per channel, 3.6-3.9x slower than f32
    dw = NET.replace(_conv("res_b", "res_a", 16, 3, pad=1),
                     _conv("res_b", "res_a", 16, 3, pad=1, group=16))
    net = _net("bf16", text=dw)
    layer = net.layer_dict["res_b"]
    assert layer.variant == precision.BF16_NHWC and layer.algorithm == "bf16 depthwise"
    got, emulated, f32 = (_forward(n) for n in (net, _net("emulate", text=dw), _net("f32", text=dw)))
    for name in got:
        scale = np.abs(f32[name]).max()
        assert np.abs(got[name] - emulated[name]).max() <= 1e-3 * scale, name
        assert 1e-4 * scale < np.abs(got[name] - f32[name]).max() <= 2e-2 * scale, name
    # the layer alone: exactly the float32 kernel on the rounded operands
    x = net.blobs["res_a"].data.copy()
    w = layer.blobs[0].data.copy()
    plain = _net("f32", text=dw)
    plain.params["res_b"][0].data[...] = round_bf16(w)
    plain.blobs["res_a"].data[...] = round_bf16(x)
    li = list(plain._layer_names).index("res_b")
    plain.forward_from_to(li, li)
    net.forward_from_to(li, li)
    np.testing.assert_array_equal(net.blobs["res_b"].data, plain.blobs["res_b"].data)
