"""`caffepy calibrate`: Intel Caffe's scripts/calibrator.py, a float32 net + its weights -> the
same net with `quantization_param` on its convolutions, as that script writes it.

The net's own TEST data layer gives the batches: the first `sampling_iterations` measure, per
convolution (and InnerProduct with `fc_int8`), the largest |input| and |output| (the output of
the unit Intel's compiled net makes of it: after the BatchNorm, Scale, Eltwise SUM and ReLU it
folds in, in place or each from the blob before it, as caffepy/net_rules.Int8Unit chains
them) and each output channel's largest |weight| (BatchNorm and Scale folded in); then
    scale_in     = 255 / max|input|  (127 and is_negative_input when an input was negative)
    scale_out    = 255 / max|output| after a ReLU, else 127 / max|output|
    scale_params = 127 / max|w| per output channel (weights_channel: multiple) or of the layer
                   (single, Intel's default); 0 for weights all 0
    bw_layer_in, bw_layer_out, bw_params = 8; bw_layer_out 32 and scale_out 1 for a layer no
    quantized layer reads (Intel's force-fp32 step: the top goes to float32 layers)
The first convolution stays float32 unless `first_conv` (Intel's -1st). The next `iterations`
batches, held out, score the float32 and the int8 nets (every Accuracy layer's top, and how
often their top-1 agree); while the int8 net's first accuracy differs from float32's by more
than `accuracy_loss`, either way, the first quantized layer goes back to float32 (Intel's
tuning step, which its script leaves disabled: a gain beyond it is as much a sign that int8
changed the net's answers as a loss; Intel stops at a difference below the bound, caffepy at
one up to it, so a bound of 0 asks for the same accuracy). A convolution whose top is the
summand of an Eltwise SUM folded into a quantized convolution keeps an 8-bit top (the fused
sum reads it as 8-bit values, as Intel's ResNet-50 int8 nets' branch1 convolutions have it).
With `unify_concat_scales` (Intel's -f) the convolutions feeding a concat share their
smallest scale_out, so the concat passes their 8-bit values on as bytes (net_rules.byte_tops).
Where caffepy differs: an input is unsigned when no sampled value was negative (Intel reads
it from the net: a convolution's input is unsigned when the convolutions before it end with a
ReLU), and an average pooling between two quantized convolutions leaves the second its own
scale_in (Intel's cac step gives it the first's scale_out: its 8-bit pooling keeps the scale;
caffepy pools in float32).
"""
import numpy as np
from google.protobuf import text_format

from . import log, net_rules
from .errors import CaffepyError, UsageError
from .net import TEST, Net
from .quantization import fold_batchnorm  # noqa: F401 (tests fold as calibrate does)
from .upgrade import read_net

U8_MAX, S8_MAX = 255.0, 127.0


def _next(net, li, x, layer_type):
    """Layer li's top when it is a `layer_type` on x alone, in place or from x, x's only reader,
    to a blob of its own (as net_rules.Int8Unit chains them); else None."""
    if not (li < len(net.layers) and net.layers[li].type == layer_type
            and len(net.bottom_vecs[li]) == 1 and net.bottom_vecs[li][0] is x
            and len(net.top_vecs[li]) == 1):
        return None
    y = net.top_vecs[li][0]
    if y is x or all(b is not x for j, bottoms in enumerate(net.bottom_vecs) if j != li
                     for b in bottoms):
        return y
    return None


def unit(net, li):
    """(BatchNorm or None, Scale or None, the unit's output blob, whether it ends with a ReLU of
    slope 0) of the layer at li as Intel's compiled net folds it."""
    bn, scale, x, relu, _ = _unit(net, li)
    return bn, scale, x, relu


def _unit(net, li):
    """unit(net, li) and the index of the Eltwise SUM it folds in (None without one)."""
    x = net.top_vecs[li][0]
    bn = scale = summed = None
    j = li + 1
    y = _next(net, j, x, "BatchNorm") if net.layers[li].type == "Convolution" else None
    if y is not None:
        bn, j, x = net.layers[j], j + 1, y
        y = _next(net, j, x, "Scale")
        if y is not None:
            scale, j, x = net.layers[j], j + 1, y
    if net.layers[li].type == "Convolution" and j < len(net.layers) \
            and net.layers[j].type == "Eltwise" and len(net.bottom_vecs[j]) == 2 \
            and any(b is x for b in net.bottom_vecs[j]):
        p = net.layers[j].param.eltwise_param
        if p.operation == p.SUM and all(c == 1 for c in p.coeff):
            summed, x, j = j, net.top_vecs[j][0], j + 1
    y = _next(net, j, x, "ReLU")
    relu = y is not None and float(net.layers[j].slope) == 0
    return bn, scale, x if y is None else y, relu, summed


def _candidates(net, first_conv, fc_int8):
    found, seen_conv = [], False
    for li, layer in enumerate(net.layers):
        if layer.type == "Convolution" and net.bottom_vecs[li][0].num_axes == 4:
            if seen_conv or first_conv:
                found.append(li)
            seen_conv = True
        elif layer.type == "InnerProduct" and fc_int8:
            found.append(li)
    return found


def _data_layers(net):
    """The index of the last layer that reads nothing (the data layers)."""
    last = -1
    for li, bottoms in enumerate(net.bottom_vecs):
        if not bottoms:
            last = li
    return last


def _readers(net, blob):
    """Indices of the layers reading `blob`, through Split, Pooling and Concat layers (which
    carry the 8-bit values on in Intel's net)."""
    out = []
    for li, bottoms in enumerate(net.bottom_vecs):
        converted = [b for _, b, _, _ in net._conversions[li]]    # a layout plan's copy
        if any(b is blob for b in bottoms + converted):
            if net.layers[li].type in ("Split", "Pooling", "Concat"):
                for t in net.top_vecs[li]:
                    out += _readers(net, t)
            else:
                out.append(li)
    return out


def measure(net, candidates, iterations):
    """{layer index: (max|input|, any input negative, max|unit output|, per-channel max|w|)}."""
    stats = {li: [0.0, False, 0.0] for li in candidates}
    for _ in range(iterations):
        net.forward()
        for li in candidates:
            x = net.bottom_vecs[li][0].data
            out = unit(net, li)[2].data
            s = stats[li]
            s[0] = max(s[0], float(np.abs(x).max()))
            s[1] = s[1] or bool((x < 0).any())
            s[2] = max(s[2], float(np.abs(out).max()))
    result = {}
    for li in candidates:
        layer = net.layers[li]
        w = layer.blobs[0].data
        bn, scale, _, _ = unit(net, li)
        if bn is not None:
            w, _ = fold_batchnorm(w, layer.blobs[1].data if layer.bias_term else None, bn, scale)
        wmax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
        result[li] = (*stats[li], wmax)
    return result


def quantize_param(param, net, stats, weights_channel, unify_concat_scales=False):
    """A copy of the NetParameter `param` with the quantization_param of `stats`' layers;
    unify_concat_scales: the 8-bit tops that a concat joins (through nested concats) all get
    the smallest of their scale_out (Intel's -f), which is then the scale_in that the concat's
    quantized readers measure (the concat's largest value is its inputs' largest)."""
    out = type(param)()
    out.CopyFrom(param)
    by_name = {lp.name: lp for lp in out.layer}
    # an Eltwise SUM folded into a quantized convolution reads its other bottom (the summand)
    # as the 8-bit values the layer writing it leaves: that layer's top stays 8-bit
    quantized = set(stats) | {_unit(net, li)[4] for li in stats} - {None}
    for li, (max_in, negative, max_out, wmax) in stats.items():
        name = net.layers[li].name
        if name not in by_name:
            raise CaffepyError(f"calibrate: layer '{name}' is not in the model file")
        q = by_name[name].quantization_param
        q.Clear()
        q.bw_layer_in = q.bw_layer_out = q.bw_params = 8
        q.scale_in.append((S8_MAX if negative else U8_MAX) / max_in if max_in > 0 else 1.0)
        relu, end = unit(net, li)[3], unit(net, li)[2]
        if any(r in quantized for r in _readers(net, end)):
            q.scale_out.append((U8_MAX if relu else S8_MAX) / max_out if max_out > 0 else 1.0)
        else:
            q.bw_layer_out = 32
            q.scale_out.append(1.0)
        if weights_channel == "single":
            wmax = np.array([wmax.max()])
        q.scale_params.extend([S8_MAX / float(m) if m > 0 else 0.0 for m in wmax])
        if negative:
            q.is_negative_input = True
    if unify_concat_scales:
        _unify_concats(net, stats, by_name)
    return out


def _unify_concats(net, stats, by_name):
    """Each concat's 8-bit input convolutions (through nested concats) to their smallest
    scale_out."""
    ends = {id(unit(net, li)[2]): li for li in stats}

    def inputs(li):
        found = []
        for b in net.bottom_vecs[li]:
            if id(b) in ends:
                found.append(ends[id(b)])
            else:
                for j in range(li - 1, -1, -1):      # a nested concat writing b
                    if any(t is b for t in net.top_vecs[j]):
                        if net.layers[j].type == "Concat":
                            found += inputs(j)
                        break
        return found

    for li, layer in enumerate(net.layers):
        if layer.type != "Concat":
            continue
        qs = [by_name[net.layers[j].name].quantization_param for j in inputs(li)]
        qs = [q for q in qs if q.bw_layer_out == 8]
        if len(qs) > 1:
            smallest = min(q.scale_out[0] for q in qs)
            for q in qs:
                q.scale_out[0] = smallest


def _unfolded(param, weights, source):
    """The float32 TEST net with every blob written by its forward (CAFFEPY_FOLD=0): the
    measure reads each convolution's unit output, which a folded net's concat slots leave
    unwritten (GoogLeNet's branches write straight into the concat's top)."""
    with net_rules.unfolded():
        return Net(param, phase=TEST, weights=weights, source=source)


def score(net, iterations, skip):
    """Per Accuracy top, the mean over `iterations` batches after `skip` batches of the data
    layers, and the top-1 predictions (of each Accuracy layer's first bottom)."""
    data_end = _data_layers(net)
    for _ in range(skip):
        net.forward_from_to(0, data_end)
    tops = [(net.top_vecs[li][0], net.bottom_vecs[li][0]) for li, layer in enumerate(net.layers)
            if layer.type == "Accuracy"]
    if not tops:
        raise UsageError("calibrate: --model: needs an Accuracy layer in its TEST phase to measure "
                         "the int8 net's loss, got none")
    values, predictions = np.zeros(len(tops)), []
    for _ in range(iterations):
        net.forward()
        values += [float(t.data.reshape(-1)[0]) for t, _ in tops]
        scores = tops[0][1].data
        predictions.append(scores.reshape(scores.shape[0], -1).argmax(axis=1))
    return values / iterations, np.concatenate(predictions)


def calibrate(model, weights, output, sampling_iterations=10, iterations=10, accuracy_loss=0.01,
              weights_channel="single", first_conv=False, fc_int8=False,
              unify_concat_scales=False):
    """Write `output`: `model` with quantization_param (see the module docstring). Returns
    (float32 accuracies, int8 accuracies, top-1 agreement, names of the quantized layers)."""
    if weights_channel not in ("single", "multiple"):
        raise UsageError(f"calibrate: --weights_channel: must be single or multiple, got "
                         f"'{weights_channel}'")
    param = read_net(model)
    if any(lp.HasField("quantization_param") for lp in param.layer):
        raise UsageError(f"calibrate: --model: {model} is quantized already (quantization_param); "
                         f"give the float32 net")
    net = _unfolded(param, weights, model)
    candidates = _candidates(net, first_conv, fc_int8)
    if not candidates:
        raise UsageError(f"calibrate: --model: {model} has no convolution to quantize")
    log.info(f"Calibrating {len(candidates)} layer(s) on {sampling_iterations} batch(es)")
    stats = measure(net, candidates, sampling_iterations)
    float_net = Net(param, phase=TEST, weights=weights, source=model)
    base, base_top1 = score(float_net, iterations, sampling_iterations)
    log.info(f"float32 on {iterations} held-out batch(es): accuracy {_fmt(base)}")
    while True:
        quantized = quantize_param(param, net, stats, weights_channel, unify_concat_scales)
        int8_net = Net(quantized, phase=TEST, weights=weights, source=output)
        acc, top1 = score(int8_net, iterations, sampling_iterations)
        agree = float((top1 == base_top1).mean())
        names = [net.layers[li].name for li in stats]
        log.info(f"int8 ({len(names)} layer(s)): accuracy {_fmt(acc)}, top-1 agreement "
                 f"{100 * agree:.2f}%")
        if abs(base[0] - acc[0]) <= accuracy_loss or len(stats) == 1:
            break
        first = min(stats)
        log.info(f"accuracy {acc[0] - base[0]:+.4f} against float32, beyond {accuracy_loss}: layer "
                 f"'{net.layers[first].name}' stays float32")
        del stats[first]
    with open(output, "w") as f:
        f.write(text_format.MessageToString(quantized))
    log.info(f"Wrote {output}")
    return base, acc, agree, names


def _fmt(values):
    return ", ".join(f"{v:.4f}" for v in values)
