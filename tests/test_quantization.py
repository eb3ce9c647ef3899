"""Intel Caffe's int8 inference in whole nets (caffepy/quantization.py, net_rules.Int8Unit):
quantization_param read, checked and run as Intel's compiled TEST net runs it, against a NumPy
reference written from the formulas (caffepy/kernels/reference/int8.py)."""
import re

import numpy as np
import pytest
from google.protobuf import text_format

import caffepy
from caffepy import quantization
from caffepy.errors import CaffepyError
from caffepy.kernels.reference import int8 as ref
from caffepy.net import Net
from caffepy.proto import caffe_pb2

Q = "quantization_param {{ bw_layer_in: 8 bw_layer_out: {out} bw_params: 8 scale_in: {si} " \
    "scale_out: {so} {sp} {neg} }}"


def _q(si, so, sp, out=8, neg=False):
    sps = " ".join(f"scale_params: {v}" for v in np.atleast_1d(sp))
    return Q.format(out=out, si=si, so=so, sp=sps, neg="is_negative_input: true" if neg else "")


def _conv(name, bottom, n, k, q, top=None):
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top or name}" '
            f'convolution_param {{ num_output: {n} kernel_size: {k} pad: {k // 2} '
            f'weight_filler {{ type: "gaussian" std: 0.3 }} bias_filler {{ type: "gaussian" std: 0.2 }} }} '
            f'{q} }}\n')


def _bn_scale(name, blob):
    return (f'layer {{ name: "bn_{name}" type: "BatchNorm" bottom: "{blob}" top: "{blob}" }}\n'
            f'layer {{ name: "sc_{name}" type: "Scale" bottom: "{blob}" top: "{blob}" '
            f'scale_param {{ bias_term: true }} }}\n')


def _relu(name, blob):
    return f'layer {{ name: "{name}" type: "ReLU" bottom: "{blob}" top: "{blob}" }}\n'


# scales as a calibrator would pick them for these weights and inputs (max |value| -> 127/255)
S_DATA, S_C1, S_SUM, S_POOL = 40.0, 30.0, 12.0, 40.0
SP1, SP2 = [60.0, 80.0, 70.0, 90.0], 75.0


def block_net(out_bits=32, engine=""):
    """A ResNet block: conv1 (s8 input) + BN + Scale + ReLU; a 1x1 shortcut and a 3x3 body,
    each + BN + Scale, summed by an Eltwise, ReLU; global average pooling; an int8 classifier."""
    return (f'name: "block" {engine}\n'
            'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }\n'
            + _conv("conv1", "data", 4, 3, _q(S_DATA, S_C1, SP1, neg=True)) + _bn_scale("1", "conv1")
            + _relu("relu1", "conv1")
            + _conv("short", "conv1", 4, 1, _q(S_C1, S_SUM, SP2)) + _bn_scale("short", "short")
            + _conv("body", "conv1", 4, 3, _q(S_C1, S_SUM, SP1)) + _bn_scale("body", "body")
            + 'layer { name: "sum" type: "Eltwise" bottom: "short" bottom: "body" top: "sum" }\n'
            + _relu("relu2", "sum")
            + 'layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool" pooling_param { pool: AVE global_pooling: true } }\n'
            + 'layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" inner_product_param { num_output: 3 '
              'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } } '
            + _q(S_POOL, 1.0, 100.0, out=out_bits) + ' }\n')


def _net(text, phase=caffepy.TEST, tmp_path=None):
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    # the fillers seeded: with weights from whatever state earlier tests left, some draws (seed
    # 90) took conv1's sums past 255 / S_C1, where int8 saturates as it should and the bounds
    # below do not hold
    caffepy.set_random_seed(3)
    net = Net(p, phase)
    rng = np.random.default_rng(3)
    for name, layer in net.layer_dict.items():
        if layer.type == "BatchNorm":
            c = layer.blobs[0].count
            layer.blobs[0].data[...] = rng.normal(0, 0.2, c) * 2      # sums over factor 2
            layer.blobs[1].data[...] = rng.uniform(0.5, 1.5, c) * 2
            layer.blobs[2].data[...] = 2
        elif layer.type == "Scale":
            layer.blobs[0].data[...] = rng.uniform(0.5, 1.5, layer.blobs[0].count)
            layer.blobs[1].data[...] = rng.normal(0, 0.1, layer.blobs[1].count)
    net.blobs["data"].data[...] = rng.normal(0, 1, net.blobs["data"].shape)
    return net


def _folded(net, conv):
    """Intel's folding, written out: alpha = s / sqrt(var + eps)."""
    L = net.layer_dict[conv]
    bn = net.layer_dict["bn_1" if conv == "conv1" else f"bn_{conv}"]
    sc = net.layer_dict["sc_1" if conv == "conv1" else f"sc_{conv}"]
    f = np.float32(1) / bn.blobs[2].data[0]
    alpha = sc.blobs[0].data / np.sqrt(bn.blobs[1].data * f + np.float32(bn.eps))
    w = L.blobs[0].data * alpha[:, None, None, None]
    b = L.blobs[1].data * alpha + (sc.blobs[1].data - bn.blobs[0].data * f * alpha)
    return w, b


def _ref_conv(net, conv, x, si, so, sp, relu, summand=None, signed=False):
    w, b = _folded(net, conv)
    sp = np.broadcast_to(np.float32(sp), (w.shape[0],))
    wq = ref.quantize_weights(w.reshape(w.shape[0], -1), sp).reshape(w.shape)
    bq = np.rint(b * (np.float32(si) * sp)).astype(np.int64)
    mult = np.float32(so) / (np.float32(si) * sp)
    k = w.shape[2]
    lo_in, hi_in = (-128, 127) if signed else (0, 255)
    lo, hi = (0, 255) if relu else (-128, 127)
    return ref.conv_forward(x, wq, bq, mult, summand, 1, (k, k), (k // 2,) * 2, (1, 1), (1, 1),
                            si, lo_in, hi_in, np.float32(so), relu, 0.0, True, lo, hi,
                            np.float32(1.0 / np.float32(so)))


@pytest.mark.parametrize("out_bits", [8, 32])
def test_block_runs_as_intel_compiles_it(out_bits):
    net = _net(block_net(out_bits))
    assert {net.layers[i].name: net.layers[j].name for i, j in net.fusions.items()
            if net._units[i].rule.name == "Int8 convolution"} == {
        "conv1": "relu1", "short": "sc_short", "body": "relu2", "fc": "fc"}
    net.forward()
    x = net.blobs["data"].data
    c1 = _ref_conv(net, "conv1", x, S_DATA, S_C1, SP1, relu=True, signed=True)
    np.testing.assert_array_equal(net.blobs["conv1"].data, c1)
    levels = c1 * np.float32(S_C1)             # u8 levels over scale_out
    assert not np.signbit(c1).any() and np.abs(levels - np.rint(levels)).max() < 1e-3
    short = _ref_conv(net, "short", c1, S_C1, S_SUM, SP2, relu=False)
    np.testing.assert_array_equal(net.blobs["short"].data, short)
    total = _ref_conv(net, "body", c1, S_C1, S_SUM, SP1, relu=True, summand=short)
    np.testing.assert_array_equal(net.blobs["sum"].data, total)
    pool = total.mean(axis=(2, 3))
    np.testing.assert_allclose(net.blobs["pool"].data.reshape(2, 4), pool, rtol=1e-6)
    fc = net.layer_dict["fc"]
    wq = ref.quantize_weights(fc.blobs[0].data, [100.0])
    bq = np.rint(fc.blobs[1].data * np.float32(S_POOL * 100.0)).astype(np.int64)
    want = ref.inner_product(net.blobs["pool"].data.reshape(2, 4), wq, bq,
                             np.full(3, np.float32(1.0) / np.float32(S_POOL * 100.0)), S_POOL,
                             0, 255, False, 0.0, out_bits == 8, -128, 127, 1.0)
    np.testing.assert_array_equal(net.blobs["fc"].data, want)


def _same_weights(net, other):
    for name, layer in net.layer_dict.items():
        for a, b in zip(layer.blobs, other.layer_dict[name].blobs):
            b.data[...] = a.data


def test_int8_stays_near_float32():
    int8 = _net(block_net())
    plain = _net(block_net(engine='engine: "CAFFE"'))
    _same_weights(int8, plain)
    assert not plain.fusions
    int8.forward()
    plain.forward()
    for name in ("conv1", "sum"):
        a, b = int8.blobs[name].data, plain.blobs[name].data
        assert np.abs(a - b).max() < 0.05 * np.abs(b).max(), name
    assert not np.array_equal(int8.blobs["sum"].data, plain.blobs["sum"].data)


def test_backward_through_int8_units_gives_the_float32_gradients():
    """pycaffe's net.backward on an int8 TEST net (Intel's int8 layers have no backward):
    rounding has no gradient, so each unit gives its float32 layers' gradient."""
    int8 = _net(block_net(engine="force_backward: true"))
    plain = _net(block_net(engine='engine: "CAFFE" force_backward: true'))
    _same_weights(int8, plain)
    int8.forward()
    plain.forward()
    assert not np.array_equal(int8.blobs["sum"].data, plain.blobs["sum"].data)
    diff = np.random.default_rng(5).normal(0, 1, int8.blobs["fc"].shape).astype(np.float32)
    for net in (int8, plain):
        net.blobs["fc"].diff[...] = diff
        net.backward()
    # each unit's gradient is the float32 layers' at the inputs the int8 forward gave it (a
    # summand from another unit included), so ReLU masks near 0 can differ from a float32 net's
    for name in ("conv1", "short", "body", "fc"):
        a, b = (n.layer_dict[name].blobs[0].diff.ravel().astype(np.float64) for n in (int8, plain))
        assert np.isfinite(a).all() and np.abs(b).max() > 0, name
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.95, name


def test_train_nets_ignore_quantization_param():
    train = _net(block_net(), caffepy.TRAIN)
    plain = _net(block_net(engine='engine: "CAFFE"'), caffepy.TRAIN)
    _same_weights(train, plain)
    assert all(getattr(layer, "int8", None) is None for layer in train.layers)
    train.forward()
    plain.forward()
    np.testing.assert_allclose(train.blobs["fc"].data, plain.blobs["fc"].data, rtol=1e-4, atol=1e-5)


def test_weights_written_through_pycaffe_are_requantized():
    net = _net(block_net())
    net.forward()
    before = net.blobs["fc"].data.copy()
    net.params["fc"][1].data[...] += 1.0
    net.forward()
    np.testing.assert_allclose(net.blobs["fc"].data, before + 1.0, atol=0.02)


def test_a_summand_from_a_float_layer_keeps_the_convolution_float():
    # Intel fuses the Eltwise into the convolution and, its other bottom float32, runs it in
    # float32: no int8 unit here
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 4 dim: 5 dim: 5 } } }\n'
            + _conv("body", "data", 4, 3, _q(S_DATA, S_SUM, SP2, neg=True))
            + 'layer { name: "sum" type: "Eltwise" bottom: "data" bottom: "body" top: "sum" }\n')
    net = _net(text)
    assert not net.fusions and net.layer_dict["body"].int8 is not None
    plain = _net(text.replace('name: "body"', 'name: "body" engine: "CAFFE"'))
    _same_weights(net, plain)
    net.forward()
    plain.forward()
    np.testing.assert_allclose(net.blobs["sum"].data, plain.blobs["sum"].data, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "vnni", "amx"])
def test_isa_paths_agree(monkeypatch, isa):
    if isa not in quantization.kernels().available_isas():
        pytest.skip(f"the int8 {isa} path: this CPU or build lacks it")
    monkeypatch.setenv("CAFFEPY_INT8_ISA", isa)
    fast = _net(block_net(8))
    monkeypatch.setenv("CAFFEPY_INT8_ISA", "generic")
    slow = _net(block_net(8))
    assert fast.layer_dict["body"].int8.isa == isa and slow.layer_dict["body"].int8.isa == "generic"
    _same_weights(fast, slow)
    fast.forward()
    slow.forward()
    for name in fast.blobs:
        np.testing.assert_array_equal(fast.blobs[name].data, slow.blobs[name].data, name)


def test_avx2bytes_sums_its_half_scale_weights_exactly(monkeypatch):
    # the opt-in AVX2 byte path quantizes the weights at sp / 2 (|w| <= 64, vpmaddubsw's exact
    # range): the portable C given the same half-scale weights gives every blob's bits
    if "avx2bytes" not in quantization.kernels().available_isas():
        pytest.skip("the int8 avx2bytes path: this CPU or build lacks it")
    monkeypatch.setenv("CAFFEPY_INT8_FALLBACK", "0")
    monkeypatch.setenv("CAFFEPY_INT8_BYTES", "0")
    monkeypatch.setenv("CAFFEPY_INT8_ISA", "avx2bytes")
    fast = _net(block_net(8))
    monkeypatch.setenv("CAFFEPY_INT8_ISA", "generic")
    slow, full = _net(block_net(8)), _net(block_net(8))
    for layer in slow.layers:
        if getattr(layer, "int8", None) is not None:
            assert layer.int8.weight_factor == 1.0 and layer.int8.wq is None
            layer.int8.weight_factor = 0.5
    _same_weights(fast, slow)
    _same_weights(fast, full)
    for net in (fast, slow, full):
        net.forward()
    body = fast.layer_dict["body"].int8
    assert body.isa == "avx2bytes" and body.weight_factor == 0.5
    assert np.abs(body.wq).max() <= 64 < np.abs(full.layer_dict["body"].int8.wq).max()
    for name in fast.blobs:
        np.testing.assert_array_equal(fast.blobs[name].data, slow.blobs[name].data, name)
    # one bit fewer of weight: near the full scale's result, not its bits
    assert not np.array_equal(fast.blobs["sum"].data, full.blobs["sum"].data)
    np.testing.assert_allclose(fast.blobs["sum"].data, full.blobs["sum"].data, atol=0.5)
    monkeypatch.setenv("CAFFEPY_INT8_ISA", "avx2bytes")
    assert "not the other paths' bits" in quantization.describe()


BASE = {"bw_layer_in": [8], "bw_layer_out": [8], "bw_params": [8], "scale_in": [1],
        "scale_out": [1], "scale_params": [1]}
BAD = [
    ({"scale_in": [0]}, "quantization_param.scale_in: must be positive and finite, got 0.0"),
    ({"scale_out": [-2]}, "quantization_param.scale_out: must be positive and finite, got -2.0"),
    ({"scale_params": [-1]}, "quantization_param.scale_params: must be positive and finite (0 for "
                             "a channel of zero weights), got -1.0"),
    ({"bw_layer_in": [16]}, "quantization_param.bw_layer_in: Intel Caffe's int8 layers take 8 "
                            "bits, got 16"),
    ({"bw_layer_out": [16]}, "quantization_param.bw_layer_out: Intel Caffe's int8 layers take 8 "
                             "or 32 bits, got 16"),
    ({"bw_params": [4]}, "quantization_param.bw_params: Intel Caffe's int8 layers take 8 bits, "
                         "got 4"),
    ({"scale_params": [2, 3]}, "quantization_param.scale_params: needs 1 value or one per output "
                               "channel (4), got 2 values"),
    ({"scale_in": [1, 2]}, "quantization_param.scale_in: needs exactly one value, got [1.0, 2.0]"),
    ({"scale_out": []}, "quantization_param.scale_out: needs exactly one value, got []"),
    ({"fl_params": [3]}, "quantization_param.fl_params: fixed point lengths are not supported"),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_quantization_param_is_one_line(fields, message):
    q = " ".join(f"{k}: {v}" for k, vs in {**BASE, **fields}.items() for v in vs)
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 3 dim: 3 } } }\n'
            + _conv("conv", "data", 4, 1, f"quantization_param {{ {q} }}"))
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    with pytest.raises(CaffepyError) as e:
        Net(p, caffepy.TEST)
    assert str(e.value).startswith("<net>: layer 'conv' (Convolution): " + message)
    assert "\n" not in str(e.value)


def test_weights_are_quantized_again_only_when_a_source_float_changes():
    net = _net(block_net())
    net.forward()
    body = net.layer_dict["body"].int8
    first = body.wq
    net.forward()
    assert body.wq is first                     # nothing changed: the cached integers
    mean = net.layer_dict["bn_body"].blobs[0].data      # a folded BatchNorm's mean, kept (writable)
    net.forward()                               # taken: quantized once more (blob.Seen)
    second = body.wq
    net.forward()
    assert body.wq is second                    # held, unchanged: compared, the cached integers
    mean[...] += 0.5                            # written through an array fetched earlier
    net.forward()
    assert body.wq is not second


def test_time_precision_all_puts_f32_int8_and_bf16_side_by_side(tmp_path, capfd):
    from caffepy import actions, log, precision
    log.set_quiet(False)        # the lines are the command's output (the suite runs quiet)
    model = tmp_path / "block.prototxt"
    model.write_text(block_net())
    ms = actions.time_precisions(str(model), iterations=1)
    bf16 = {"bf16"} if precision.kernel() else set()       # timed where its kernels run
    assert set(ms) == {"f32", "int8"} | bf16 and all(v > 0 for v in ms.values())
    err = capfd.readouterr().err
    assert "int8:" in err and "x f32" in err
    assert (f"f32; {precision.kernel()[1]} kernels)" if bf16 else "bf16: not run") in err
    assert precision.current() == "f32"
    plain = tmp_path / "plain.prototxt"
    plain.write_text(re.sub(r"quantization_param \{[^}]*\}", "", block_net()))
    assert set(actions.time_precisions(str(plain), iterations=1)) == {"f32"} | bf16
    assert "the net has no quantization_param" in capfd.readouterr().err


def _fall_back(net):
    """Every quantized convolution that may run float32 (channels-last) forced to."""
    fallen = [la for la in net.layers if getattr(la, "int8", None) is not None and la.int8.channels_last]
    for layer in fallen:
        layer.int8.force_path(quantization.FLOAT32)
    return [la.name for la in fallen]


def _window_sums(x, w, pad):
    """sum over each output's window of x * w (x [N, C, H, W], w [O, C, k, k], stride 1)."""
    k = w.shape[2]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    h, wd = xp.shape[2] - k + 1, xp.shape[3] - k + 1
    out = np.zeros((x.shape[0], w.shape[0], h, wd))
    for i in range(k):
        for j in range(k):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    return out


def test_a_float32_fallback_runs_the_float32_net_and_stays_within_int8s_roundings():
    int8, fell = _net(block_net(8)), _net(block_net(8))
    plain = _net(re.sub(r"quantization_param \{[^}]*\}", "", block_net(8)))
    _same_weights(int8, fell)
    _same_weights(int8, plain)
    assert _fall_back(fell) == ["conv1", "short", "body"]     # the InnerProduct stays int8
    for net in (int8, fell, plain):
        net.forward()
    assert [fell.layer_dict[n].algorithm.split(":")[0] for n in ("conv1", "body")] == ["float32 fallback"] * 2
    # up to the int8 classifier, the float32 net's values (Intel's float32 layers)
    for name in ("conv1", "short", "sum", "pool"):
        want = plain.blobs[name].data
        np.testing.assert_allclose(fell.blobs[name].data, want, rtol=0, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)
    # conv1 sees the same input both ways: the difference is int8's rounding, bounded
    x = int8.blobs["data"].data
    xq = np.clip(np.rint(x * np.float32(S_DATA)), -128, 127) / np.float32(S_DATA)
    w, _ = _folded(int8, "conv1")
    sp = np.asarray(SP1, np.float64)[None, :, None, None]
    ones = np.ones_like(w)
    bound = (_window_sums(np.abs(xq), ones, 1) * 0.5 / sp + _window_sums(np.abs(x - xq), np.abs(w), 1)
             + 0.5 / (S_DATA * sp) + 0.5 / S_C1)
    diff = np.abs(fell.blobs["conv1"].data.astype(np.float64) - int8.blobs["conv1"].data)
    assert (diff <= bound * (1 + 1e-5) + 1e-6).all(), (diff - bound).max()
    assert diff.max() > 0.5 / S_C1             # not the int8 values: it did run float32


def test_the_path_is_measured_once_per_shape_and_kept(tmp_path, monkeypatch):
    from caffepy import autotune
    monkeypatch.setenv("CAFFEPY_AUTOTUNE", "1")
    monkeypatch.setenv("CAFFEPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CAFFEPY_INT8_FALLBACK", "1")    # (unset: measured on AVX2 paths only)
    monkeypatch.setattr(autotune, "_cache", None)
    timed, keys = [], []
    choose = autotune.choose

    def keep_key(layer, key, candidates, default, threads, **options):
        keys.append(key)
        return choose(layer, key, candidates, default, threads, **options)

    def measure(candidates, rounds=3, keep=None):   # float32 the faster for 3x3 kernels only
        timed.append(keys[-1])
        if quantization.INT8 not in candidates:
            return dict.fromkeys(candidates, 1.0)
        three = " k3x3 " in keys[-1]         # 1.3x and 1.2x faster: beyond the margin, within it
        float32 = 1.0 if three else 1.0 / 1.2
        # a 3 x 3 convolution's int8 kernels (direct, Winograd) are both 1.3
        return {name: float32 if name == quantization.FLOAT32 else 1.3 if three else 1.0
                for name in candidates}
    monkeypatch.setattr(autotune, "measure", measure)
    monkeypatch.setattr(autotune, "choose", keep_key)
    net = _net(block_net(8))
    net.forward()
    paths = {n: net.layer_dict[n].int8.path for n in ("conv1", "short", "body")}
    assert paths == {"conv1": "float32", "short": "int8", "body": "float32"}
    isa = quantization.isa()
    assert [k for k in keys if k.startswith("Int8 Convolution")] == [
        f"Int8 Convolution -> 4 k3x3 s1x1 p1x1 d1x1 g1 +BatchNorm +Scale +ReLU 2-3x3x8x8 {isa}",
        f"Int8 Convolution -> 4 k1x1 s1x1 p0x0 d1x1 g1 +BatchNorm +Scale 2-3x4x8x8 {isa}",
        f"Int8 Convolution -> 4 k3x3 s1x1 p1x1 d1x1 g1 +BatchNorm +Scale +Eltwise +ReLU 2-3x4x8x8 {isa}"]
    measured = len(timed)
    net.forward()                                   # the same shape: no new measurement
    assert len(timed) == measured
    autotune._cache = None                          # a new process reads the cache
    again = _net(block_net(8))
    again.forward()
    assert {n: again.layer_dict[n].int8.path for n in paths} == paths
    assert again.layer_dict["body"].tuning == "cached"
    monkeypatch.setenv("CAFFEPY_INT8_FALLBACK", "0")   # the switch: every layer int8
    forced = _net(block_net(8))
    forced.forward()
    assert {forced.layer_dict[n].int8.path for n in paths} == {"int8"}
    assert forced.layer_dict["body"].tuning == "CAFFEPY_INT8_FALLBACK=0"
    assert forced.layer_dict["body"].algorithm.startswith("int8")
    monkeypatch.delenv("CAFFEPY_INT8_FALLBACK")        # the default: measured on AVX2 only
    default = _net(block_net(8))
    assert default.layer_dict["body"].int8.may_fall_back == (
        default.layer_dict["body"].int8.isa not in ("vnni", "amx"))


def test_the_setup_log_names_int8_not_the_float_algorithm(capfd, monkeypatch):
    """A quantized convolution's setup line says int8 (and the float32 it may be measured against),
    never the float algorithm alone: which path runs is chosen at the first forward."""
    from caffepy import log
    log.set_quiet(False)
    monkeypatch.setenv("CAFFEPY_INT8_FALLBACK", "1")
    _net(block_net(8))
    monkeypatch.setenv("CAFFEPY_INT8_FALLBACK", "0")
    _net(block_net(8))
    lines = [line for line in capfd.readouterr().err.splitlines() if "Algorithm: " in line]
    measured = [line for line in lines if "int8 (quantization_param; float32 (" in line]
    fixed = [line for line in lines if line.endswith("Algorithm: int8 (quantization_param, chosen at the first forward)")]
    # measured: conv1, short, body; fixed: the InnerProduct, then all four with the fallback off
    assert (len(measured), len(fixed)) == (3, 5), lines
    assert not [line for line in lines if "int8" not in line]    # no float-only line for them


def test_describe_names_the_path_in_use_and_the_others(monkeypatch):
    k = quantization.kernels()
    monkeypatch.setenv("CAFFEPY_INT8_ISA", "generic")
    line = quantization.describe()
    assert line.startswith("generic: portable C")
    assert f"CAFFEPY_INT8_ISA={'|'.join(k.available_isas())}" in line
    # the opt-in path whose bits differ is named as the exception
    assert ("but avx2bytes" in line) == ("avx2bytes" in k.available_isas())
    monkeypatch.setenv("CAFFEPY_INT8_ISA", "no-such-path")      # ignored: the best runs
    assert quantization.describe().startswith(k.best_isa() + ": ")


@pytest.fixture(params=quantization.BYTE_PATHS)
def byte_path(request):
    """Each int8 byte path (VNNI, AMX, AVX-VNNI, AVX2 on bytes) this CPU and build have; the
    others skipped."""
    if request.param not in quantization.kernels().available_isas():
        pytest.skip(f"the int8 {request.param} path: this CPU or build lacks it")
    return request.param


def _byte_nets(monkeypatch, path, text=None):
    """(bytes, floats): the net (block_net(8) by default) with the int8 tops handed on as bytes
    and without, the same weights, on byte path `path` (every quantized layer on its direct
    int8 kernel)."""
    monkeypatch.setenv("CAFFEPY_INT8_ISA", path)
    monkeypatch.setenv("CAFFEPY_INT8_FALLBACK", "0")
    monkeypatch.setenv("CAFFEPY_INT8_BYTES", "1")
    fast = _net(text or block_net(8))
    monkeypatch.setenv("CAFFEPY_INT8_BYTES", "0")
    slow = _net(text or block_net(8))
    _same_weights(fast, slow)
    # the direct kernels, which read bytes (a path's default for a 3 x 3 may be Winograd's
    # int16 rows, which read floats: avx2bytes's)
    for net in (fast, slow):
        for layer in net.layers:
            if getattr(layer, "int8", None) is not None:
                layer.int8.force_path(quantization.INT8)
    return fast, slow


def test_int8_tops_handed_on_as_bytes_give_every_blob_its_floats(monkeypatch, byte_path):
    fast, slow = _byte_nets(monkeypatch, byte_path)
    # conv1's top feeds two int8 convolutions of its scale, short's is body's summand; the
    # sum goes to a float pooling
    assert [n for n in ("conv1", "short", "body") if fast.layer_dict[n].int8.byte_top] == \
        ["conv1", "short"]
    assert not any(getattr(layer, "int8", None) and layer.int8.byte_top for layer in slow.layers)
    for net in (fast, slow):
        net.forward()           # the first forward at a shape writes floats: paths undecided
        net.forward()
    assert isinstance(fast.blobs["conv1"].held(), quantization.Bytes)
    assert isinstance(fast.blobs["short"].held(), quantization.Bytes)
    assert fast.blobs["sum"].held() is None
    for name in slow.blobs:
        np.testing.assert_array_equal(fast.blobs[name].data, slow.blobs[name].data, name)
    assert fast.blobs["conv1"].held() is None           # read: the floats are in place now


def test_a_view_a_user_holds_and_a_blob_a_user_writes_stay_floats(monkeypatch, byte_path):
    fast, slow = _byte_nets(monkeypatch, byte_path)
    for net in (fast, slow):
        net.forward()
    view = fast.blobs["conv1"].data         # held by the user: written as floats from now on
    for net in (fast, slow):
        net.blobs["data"].data[...] *= -1
        net.forward()
    assert fast.blobs["conv1"].held() is None
    np.testing.assert_array_equal(view, slow.blobs["conv1"].data)
    del view
    fast.forward()
    assert isinstance(fast.blobs["conv1"].held(), quantization.Bytes)
    # a user's own values in a blob the bytes came from: the layers after it read those
    for net in (fast, slow):
        net.blobs["conv1"].data[...] = np.float32(3) / np.float32(S_C1)
        net.forward(start="short")
    np.testing.assert_array_equal(fast.blobs["sum"].data, slow.blobs["sum"].data)
    assert np.array_equal(fast.blobs["conv1"].data, np.full((2, 4, 8, 8), np.float32(3) / np.float32(S_C1)))


def test_a_chain_of_tops_fuses_as_in_place_layers_do():
    """BatchNorm, Scale and ReLU each writing a blob of its own (Intel's Inception-v3 int8
    prototxt): one int8 unit as Intel's compiler makes it, the blobs between unwritten."""
    text = block_net(8)
    chained = (text.replace('bottom: "conv1" top: "conv1" }\nlayer { name: "sc_1" type: "Scale" '
                            'bottom: "conv1" top: "conv1"',
                            'bottom: "conv1" top: "conv1_bn" }\nlayer { name: "sc_1" type: "Scale" '
                            'bottom: "conv1_bn" top: "conv1_sc"')
               .replace('"relu1" type: "ReLU" bottom: "conv1" top: "conv1"',
                        '"relu1" type: "ReLU" bottom: "conv1_sc" top: "conv1_relu"')
               .replace('bottom: "conv1" top: "short"', 'bottom: "conv1_relu" top: "short"')
               .replace('bottom: "conv1" top: "body"', 'bottom: "conv1_relu" top: "body"'))
    assert chained.count("conv1_relu") == 3
    a, b = _net(text), _net(chained)
    for name, layer in a.layer_dict.items():
        for x, y in zip(layer.blobs, b.layer_dict[name].blobs if layer.blobs else ()):
            y.data[...] = x.data
    first = [b.layers[i].name for i in b.fusions if b._units[i].rule.name == "Int8 convolution"]
    assert b.layers[b.fusions[[layer.name for layer in b.layers].index("conv1")]].name == "relu1"
    assert set(first) == {"conv1", "short", "body", "fc"}
    assert set(b.unwritten_blobs()) >= {"conv1", "conv1_bn", "conv1_sc"}
    a.forward()
    b.forward()
    np.testing.assert_array_equal(a.blobs["conv1"].data, b.blobs["conv1_relu"].data)
    for name in ("short", "sum", "fc"):
        np.testing.assert_array_equal(a.blobs[name].data, b.blobs[name].data, name)
    # a blob between the layers read by another layer too: the chain ends there
    shared = chained.replace('bottom: "conv1_relu" top: "short"', 'bottom: "conv1_bn" top: "short"')
    c = _net(shared)
    names = [layer.name for layer in c.layers]
    assert names[c.fusions[names.index("conv1")]] == "bn_1"


def test_a_max_pooling_between_int8_layers_pools_the_bytes(monkeypatch, byte_path):
    text = block_net(8).replace(
        _relu("relu1", "conv1"),
        _relu("relu1", "conv1") + 'layer { name: "pool0" type: "Pooling" bottom: "conv1" '
        'top: "pool0" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }\n').replace(
        'bottom: "conv1" top: "short"', 'bottom: "pool0" top: "short"').replace(
        'bottom: "conv1" top: "body"', 'bottom: "pool0" top: "body"')
    fast, slow = _byte_nets(monkeypatch, byte_path, text)
    assert fast.layer_dict["pool0"].byte_pool and fast.layer_dict["conv1"].int8.byte_top
    assert not slow.layer_dict["pool0"].byte_pool
    # the nets keep the path they were built on (the pooling too: on avx2bytes, which is not
    # the default, it once took the default's and refused the bytes)
    monkeypatch.delenv("CAFFEPY_INT8_ISA")
    for net in (fast, slow):
        net.forward()
        net.forward()
    assert isinstance(fast.blobs["pool0"].held(), quantization.Bytes)
    for name in slow.blobs:
        np.testing.assert_array_equal(fast.blobs[name].data, slow.blobs[name].data, name)


def test_a_concat_of_int8_tops_of_one_scale_concatenates_the_bytes(monkeypatch, byte_path):
    """Two branches of one scale_out (as Intel's calibrator unifies a concat's) concatenated,
    read by an int8 convolution (bytes) and an average pooling (floats, filled in)."""
    text = ('name: "inception"\n'
            'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }\n'
            + _conv("conv1", "data", 8, 3, _q(S_DATA, S_C1, SP1[0], neg=True)) + _relu("relu1", "conv1")
            + _conv("a", "conv1", 4, 1, _q(S_C1, S_SUM, SP2)) + _relu("relu_a", "a")
            + _conv("b", "conv1", 6, 3, _q(S_C1, S_SUM, SP2)) + _relu("relu_b", "b")
            + 'layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" top: "cat" }\n'
            + _conv("c", "cat", 4, 3, _q(S_SUM, S_SUM, SP2)) + _relu("relu_c", "c")
            + 'layer { name: "avg" type: "Pooling" bottom: "cat" top: "avg" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }\n')
    fast, slow = _byte_nets(monkeypatch, byte_path, text)
    assert fast.layer_dict["cat"].byte_concat and not slow.layer_dict["cat"].byte_concat
    assert fast.layer_dict["a"].int8.byte_top and fast.layer_dict["b"].int8.byte_top
    # only the concat reads a and b: each writes its run of the concat's bytes, not copied
    assert [fast.layer_dict[n].int8.byte_slot[1] for n in ("a", "b")] == [0, 1]
    for net in (fast, slow):
        net.forward()
        net.forward()
    whole = fast.layer_dict["cat"]._bytes       # (its floats filled in: avg read them)
    assert fast.blobs["a"].held().whole is whole and fast.blobs["b"].held().offset == 4
    for name in ("c", "avg", "cat", "a", "b"):
        np.testing.assert_array_equal(fast.blobs[name].data, slow.blobs[name].data, name)
    # a read by an int8 layer of its own too: a's bytes its own, copied; b's still in place
    shared = text + _conv("d", "a", 4, 1, _q(S_SUM, S_SUM, SP2))
    fast, slow = _byte_nets(monkeypatch, byte_path, shared)
    assert fast.layer_dict["a"].int8.byte_top and fast.layer_dict["a"].int8.byte_slot is None
    assert fast.layer_dict["b"].int8.byte_slot[1] == 1
    for net in (fast, slow):
        net.forward()
        net.forward()
    for name in ("c", "avg", "cat", "a", "b", "d"):
        np.testing.assert_array_equal(fast.blobs[name].data, slow.blobs[name].data, name)
    # a branch of another scale: the concat stays float, and so do the branches' tops
    other = _net(text.replace(_q(S_C1, S_SUM, SP2) + " }\n" + _relu("relu_b", "b"),
                              _q(S_C1, S_SUM * 2, SP2) + " }\n" + _relu("relu_b", "b")))
    assert not other.layer_dict["cat"].byte_concat and not other.layer_dict["a"].int8.byte_top


def test_bytes_across_a_change_of_batch(monkeypatch, byte_path):
    """A new batch size: the first forward at it writes floats (the paths are chosen anew), the
    next hands bytes on in buffers of the new shape; every blob as without bytes."""
    fast, slow = _byte_nets(monkeypatch, byte_path)
    for net in (fast, slow):
        net.forward()
        net.forward()
        net.blobs["data"].reshape(3, 3, 8, 8)
        net.blobs["data"].data[...] = np.random.default_rng(5).normal(0, 1, (3, 3, 8, 8))
        net.reshape()
        net.forward()
    assert fast.blobs["conv1"].held() is None           # undecided at the new shape: floats
    for net in (fast, slow):
        net.forward()
    assert fast.blobs["conv1"].held().shape == (3, 8, 8, 4)
    for name in slow.blobs:
        np.testing.assert_array_equal(fast.blobs[name].data, slow.blobs[name].data, name)
