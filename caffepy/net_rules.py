"""Net compilation: the named rules that run groups of a built net's layers as one unit.

Intel Caffe's Net::CompileNet rewrites the NetParameter with a list of named passes before it
builds the net (RemoveScale, ConvReluFusion, FuseBnRelu, ConvSumFusion, ...). caffepy keeps the
net the prototxt describes (its layers, blobs and values, which pycaffe code, snapshots and
`caffepy time` see) and compiles the built net instead: each rule finds runs of consecutive
layers, a unit, that it can run as one (one pass over the activations instead of two or three)
with every blob ending as the layers one by one leave it. `Net.fusions` maps each unit's first
layer to its last; a run that does not cover a whole unit runs its layers one by one.

A rule is named, runs alone (`rule.find(net)`: its units in a built net), and knows the layers
it can fuse by their declaration: an implementation lists the rules it takes part in in its
`fuses` class attribute (caffepy.layer.Layer) and then has that rule's methods. `compile_net`
runs the rules in order (a layer joins one unit at most) and logs what each matched.
`engine: CAFFE` (caffepy.engine.caffe_engine: the net's, the environment's, or a layer's
own) turns them off here, in this one place.

The rules, in the order they run:
    Int8 convolution        a Convolution or InnerProduct with quantization_param (TEST), with
                            the BatchNorm (+ Scale) in place after a convolution folded into
                            its weights, the Eltwise SUM of two bottoms after that, and the
                            ReLU in place after them, run on 8-bit integers as Intel Caffe's
                            compiled net runs them (caffepy/quantization.py), or in float32
                            where that is measured faster; the blobs inside
                            the unit (a convolution's own top before the Eltwise) are not
                            written, and its layers run one by one compute in float32
    Convolution+BatchNorm(+Scale)(+ReLU)
                            TEST nets only: a convolution, the BatchNorm with global statistics
                            in place on its top, the Scale in place after it if there is one,
                            and the ReLU in place after them if there is one (or a ReLU in
                            place on its top alone), applied by the
                            convolution's GEMM to each output row as it writes it, or folded
                            into its weights and bias (inference only; Intel's compiler has no
                            such rule: its MKL-DNN engines fold BatchNorm and Scale into one)
    Convolution+BatchNorm(+Scale)+Eltwise+ReLU(+Split)
                            TEST nets only: that unit without its ReLU, then the Eltwise SUM of
                            its top and a shortcut, the ReLU (slope 0) in place on the sum and
                            the Split after it (ResNet's block end), applied by the GEMM's
                            epilogue straight into the sum's blob: the convolution's own top
                            is then not written (CAFFEPY_FOLD=0 keeps it). It runs just before
                            the rule above, which would otherwise take the convolution
    BatchNorm+Scale(+ReLU)  the fast path's BatchNorm in place, its Scale in place on the same
                            blob, and the ReLU in place after them if there is one (ResNet's
                            form; Intel's RemoveScale and FuseBnRelu)
    Eltwise+ReLU(+Split)    an Eltwise SUM of two bottoms with coefficients 1, the ReLU in place
                            on its top, and the Split after it if the top feeds two layers
                            (ResNet's shortcut)
A ReLU joins a unit only with a negative slope of at least 0 (its output's sign is then its
input's, which the fused backwards read).

Folding keeps every blob a user reads: the unit's layers all work in place on the
convolution's top, whose last value (the ReLU's, or the Scale's) is the one a net run layer by
layer leaves there too; what no longer exists after a folded forward is only the layers'
internal state (the convolution's output before the BatchNorm, which an in-place chain
overwrites anyway). The values differ from the layers' by float rounding (1e-5 of the largest
value at most: tests/layers/test_fusion.py). A backward through a folded unit (a TEST net's
gradients, pycaffe's net.backward) runs the unit's layers' forwards again one by one first,
then their backwards: right, at the cost of that forward.
`CAFFEPY_FOLD=0` (or `engine: CAFFE`) turns folding off; the other rules still run.

Intel's ConvReluFusion, FuseFCRelu and ConvSumFusion have no rule here, though caffepy computes
the fields they write (common.FusedOutput): its fused ReLU and sum run as their own pass after
the convolution's output is written, as the ReLU and Eltwise layers do, so a rule would save no
pass (conv 64 -> 64 3x3 over 16 x 28 x 28 with its ReLU, one TRAIN iteration: 71.9 ms apart,
75.6 fused), and ConvSumFusion would give the convolution's top blob the sum's values, which
net.blobs would then show in place of Caffe's.
"""
import contextlib
import os
import typing

import numpy as np

from . import log, quantization
from .blob import CHANNELS_LAST
from .engine import caffe_engine
from .proto import caffe_pb2


class Unit(typing.NamedTuple):
    """Layers first..last of a net, run as one by `rule`; `shortcut`: for an Eltwise unit, its
    bottom that shares the top's diff (EltwiseReLU.shortcut_bottom), else None."""
    rule: object
    first: int
    last: int
    shortcut: object = None


class Parts(typing.NamedTuple):
    """The layers of a unit after its first (a convolution or an inner product), each None
    where the unit has none."""
    bn: object
    scale: object
    eltwise: object         # the Eltwise SUM's index in the net
    summand: object         # that sum's bottom other than the first layer's top
    relu: object


def parts(net, unit, last):
    """The Parts of a unit of the convolution rules (Int8, Convolution+BatchNorm, ConvSum) up
    to `last`, by type: such a unit holds at most one of each, in place on the first layer's
    top up to the Eltwise SUM (a ReLU after the sum is in place on it). Kept per unit and last
    layer: a net's layers and blobs stay as built, and each unit asks at every forward."""
    known = net._unit_parts.get((unit.first, last))
    if known is None:
        known = net._unit_parts[unit.first, last] = _find_parts(net, unit, last)
    return known


def _find_parts(net, unit, last):
    bn = scale = eltwise = summand = relu = None
    y = net.top_vecs[unit.first][0]          # the unit's value so far
    for li in range(unit.first + 1, last + 1):
        layer = net.layers[li]
        if layer.type == "BatchNorm":
            bn = layer
        elif layer.type == "Scale":
            scale = layer
        elif layer.type == "Eltwise":
            eltwise, bottoms = li, net.bottom_vecs[li]
            summand = bottoms[1] if bottoms[0] is y else bottoms[0]
        elif layer.type == "ReLU":
            relu = layer
        y = net.top_vecs[li][0]
    return Parts(bn, scale, eltwise, summand, relu)


def takes_part(net, li, rule, layer_type):
    """Layer li is a `layer_type` whose implementation declares `rule` and that runs caffepy's
    algorithms (not `engine: CAFFE`)."""
    layer = net.layers[li]
    return (layer.type == layer_type and rule.name in type(layer).fuses
            and not caffe_engine(layer.param, net.param))


def in_place_on(net, li, x):
    """Layer li has x as its one bottom and one top, with no layout conversion before it."""
    return (li < len(net.layers) and not net._conversions[li] and len(net.bottom_vecs[li]) == 1
            and net.bottom_vecs[li][0] is x and len(net.top_vecs[li]) == 1
            and net.top_vecs[li][0] is x)


def fusable_relu(net, li):
    """Layer li is a ReLU of negative slope >= 0 running caffepy's algorithms."""
    layer = net.layers[li]
    return (layer.type == "ReLU" and layer.slope >= 0
            and not caffe_engine(layer.param, net.param))


def relu_in_place(net, li, x):
    """Layer li is a fusable_relu in place on x."""
    return in_place_on(net, li, x) and fusable_relu(net, li)


def blob_readers(net):
    """{id(blob): the indices of the layers that read it}"""
    readers = {}
    for li, bottoms in enumerate(net.bottom_vecs):
        for b in bottoms:
            readers.setdefault(id(b), set()).add(li)
    return readers


class Int8Unit:
    """A quantized Convolution (+ BatchNorm (+ Scale)) (+ Eltwise SUM) (+ ReLU), or a quantized
    InnerProduct (+ ReLU in place): Intel Caffe's RemoveBNScale, ConvReluFusion, ConvSumFusion
    and FuseFCRelu as its int8 layers run them. The BatchNorm, Scale and ReLU in place, or each
    from the blob before it, that blob read by nothing else (Intel's Inception-v3: conv ->
    conv_bn -> conv_relu): Intel's compiler then renames the convolution's top, and caffepy
    leaves the blobs between unwritten (net.unwritten_blobs). An Eltwise SUM
    after the convolution joins when its other bottom comes from a unit with an 8-bit top;
    otherwise Intel runs the fused convolution in float32, and so does caffepy (no unit: the
    layers run apart in float32). A channels-last convolution's unit runs int8 or, where that
    is measured faster, float32 (quantization.Int8.run, float_forward)."""
    name = "Int8 convolution"

    def find(self, net):
        units = []
        readers = blob_readers(net)
        for li, layer in enumerate(net.layers):
            if getattr(layer, "int8", None) is None:
                continue
            last = li
            x = net.top_vecs[li][0]
            conv = layer.type == "Convolution"
            own = layer.fused is not None          # Intel's relu / SUM_FUSION set in the prototxt
            y = self._next(net, last + 1, "BatchNorm", x, readers) if conv and not own else None
            if y is not None and net.layers[last + 1].use_global_stats \
                    and not net.layers[last + 1].relu:
                last, x = last + 1, y
                y = self._next(net, last + 1, "Scale", x, readers)
                if y is not None and len(net.bottom_vecs[last + 1]) == 1:
                    last, x = last + 1, y
            if conv and not own:
                summed = self._summand(net, last + 1, x, units)
                if summed is not None:
                    last += 1
                    x = net.top_vecs[last][0]
                elif self._sum_of(net, last + 1, x, any_layout=True):
                    continue        # Intel fuses the sum and, its summand float32, runs float32
            # any negative_slope: Intel's fused ReLU takes it (the top is then s8)
            y = None if own else self._next(net, last + 1, "ReLU", x, readers)
            if y is not None and not caffe_engine(net.layers[last + 1].param, net.param):
                last += 1
            units.append(Unit(self, li, last))
        return units

    @staticmethod
    def _next(net, li, layer_type, x, readers):
        """Layer li's top when it is a `layer_type` in place on x, or from x, x's only reader,
        to a blob of its own; else None."""
        if li >= len(net.layers) or net.layers[li].type != layer_type:
            return None
        if in_place_on(net, li, x):
            return x
        bottoms, tops = net.bottom_vecs[li], net.top_vecs[li]
        if (not net._conversions[li] and len(bottoms) == 1 and bottoms[0] is x and len(tops) == 1
                and tops[0] is not x and readers.get(id(x)) == {li}):
            return tops[0]
        return None

    @staticmethod
    def _sum_of(net, li, x, any_layout=False):
        """Layer li is an Eltwise SUM (coefficients 1) of x and another blob (converted to
        another layout first only with any_layout: a unit cannot take such a sum in)."""
        if li >= len(net.layers) or (net._conversions[li] and not any_layout) \
                or net.layers[li].type != "Eltwise":
            return False
        p = net.layers[li].param.eltwise_param
        bottoms = net.bottom_vecs[li]
        return (p.operation == p.SUM and len(bottoms) == 2 and all(c == 1 for c in p.coeff)
                and sum(b is x for b in bottoms) == 1 and net.top_vecs[li][0] is not x)

    @staticmethod
    def _summand(net, li, x, units):
        """The other bottom of an Eltwise SUM (coefficients 1) at li over x, when the unit that
        writes it has an 8-bit top; else None."""
        if not Int8Unit._sum_of(net, li, x):
            return None
        bottoms = net.bottom_vecs[li]
        other = bottoms[1] if bottoms[0] is x else bottoms[0]
        writer = Int8Unit._writer(net, other, li)
        for u in units:
            if u.first <= writer <= u.last and writer == u.last:
                if net.layers[u.first].int8.spec.bits_out == 8:
                    return other
        return None

    @staticmethod
    def _writer(net, blob, before):
        """The last layer before `before` that writes `blob`, through Split layers."""
        for li in range(before - 1, -1, -1):
            if any(t is blob for t in net.top_vecs[li]):
                if net.layers[li].type == "Split":
                    return Int8Unit._writer(net, net.bottom_vecs[li][0], li)
                return li
        return -1

    @staticmethod
    def describe(units):
        return f"{len(units)} layer(s) on 8-bit integers ({quantization.isa()})"

    @staticmethod
    def relu(net, unit, last):
        """(relu, slope) of a unit up to `last`: its ReLU layer's, or Intel's fused fields'."""
        layer = net.layers[unit.first]
        if layer.fused is not None:
            return layer.fused.relu, layer.fused.slope
        relu_layer = parts(net, unit, last).relu
        return relu_layer is not None, float(relu_layer.slope) if relu_layer is not None else 0.0

    @staticmethod
    def forward(net, unit, last):
        first = unit.first
        layer = net.layers[first]
        bn, scale, _, summand, _ = parts(net, unit, last)
        fold = None if bn is None else (bn, scale)
        relu, slope = Int8Unit.relu(net, unit, last)
        top = net.top_vecs[last][0]
        bottom = net.bottom_vecs[first]
        if layer.type == "InnerProduct":
            layer.int8.inner_product_forward(bottom[0].data.reshape(layer.M, layer.K),
                                             top.data.reshape(layer.M, layer.num_output), relu, slope)
            return
        coeff = (1, 1)
        if layer.fused is not None and layer.fused.summed:
            summand = bottom[1]
            coeff = layer.fused.coeff
        if not layer.int8.channels_last:
            x, y, s = bottom[0].data, top.data, None if summand is None else summand.data
            layer.int8.conv_forward(x, y, s, relu, slope, fold, coeff)
            return
        q = layer.int8
        shape = bottom[0].shape
        n, c, h, w = top.shape
        # the 8-bit input, summand and top as bytes where the layers around take them (Bytes);
        # the float path (its layers) reads floats, which a blob's held bytes fill in
        in_place = top is summand
        staged = bottom[0].held() if q.reads(bottom[0].held(), shape) else None
        held = None if summand is None or not q.decided(shape) else summand.held()
        s_bytes = held if isinstance(held, quantization.Bytes) else None
        out = (q.top_bytes((n, h, w, c), relu, slope) if q.byte_top and q.decided(shape)
               and not in_place and all(r.takes_bytes() for r in q.byte_readers)
               and top.untouched() else None)
        x = bottom[0].raw_data if staged is None else (shape[0], shape[2], shape[3], shape[1])
        s = None if summand is None or s_bytes is not None else channels_last(summand)
        y = top.raw_data if in_place else top.overwrite()

        def key():
            after = "".join(f" +{net.layers[li].type}" for li in range(first + 1, last + 1))
            return (f"Int8 Convolution -> {layer.num_output} k{'x'.join(map(str, layer.kernel))} "
                    f"s{'x'.join(map(str, layer.stride))} p{'x'.join(map(str, layer.pad))} "
                    f"d{'x'.join(map(str, layer.dilation))} g{layer.group}{after}"
                    f"{' fused' if layer.fused is not None else ''}")
        q.run(key, shape,
              lambda winograd: q.conv_forward(x, y, s, relu, slope, fold, coeff, winograd, staged,
                                              out, s_bytes),
              lambda: Int8Unit.float_forward(net, first, last))
        if out is not None:
            top.hold(out)

    @staticmethod
    def float_forward(net, first, last):
        """Layers first..last run in float32 as a float32 net runs them (its rules' fused
        forwards where they apply): a quantized convolution's float32 fallback."""
        conv = net.layers[first]
        kinds = [net.layers[li].type for li in range(first + 1, last + 1)]
        if conv.fused is not None or not kinds:         # Intel's fused fields: the layer's own
            conv.forward(net.bottom_vecs[first], net.top_vecs[first])
            return
        y = net.top_vecs[first][0]
        if any(net.top_vecs[li][0] is not y for li in range(first + 1, last + 1)
               if net.layers[li].type != "Eltwise"):    # a chain of tops: the layers apart
            for li in range(first, last + 1):
                net.layers[li].forward(net.bottom_vecs[li], net.top_vecs[li])
            return
        e = first + 1 + kinds.index("Eltwise") if "Eltwise" in kinds else last + 1
        relu = net.layers[last] if kinds[-1] == "ReLU" else None
        if e <= last and e - 1 > first and last == e + 1 and relu is not None and relu.slope == 0:
            CONV_SUM.forward(net, Unit(CONV_SUM, first, last), last)
            return
        end = e - 1 if e <= last else last
        if end > first:
            CONV_BATCHNORM.forward(net, Unit(CONV_BATCHNORM, first, end), end)
        else:
            conv.forward(net.bottom_vecs[first], net.top_vecs[first])
        for li in range(end + 1, last + 1):             # the sum, and the ReLU after it
            net.layers[li].forward(net.bottom_vecs[li], net.top_vecs[li])

    @staticmethod
    def backward(net, unit, last, every_layer):
        """Integer rounding has no gradient: a backward (pycaffe's net.backward on a TEST net;
        Intel's int8 layers have none) gives the unit's float32 layers' gradient at the inputs
        the int8 forward gave it (rerun_layers: afterwards the unit's tops hold float32 values)."""
        return rerun_layers(net, unit, last)


def channels_last(blob):
    """A 4-axis blob's values in (N, H, W, C) order, as stored when it is channels-last."""
    if blob.layout == CHANNELS_LAST:
        return blob.raw_data
    return np.ascontiguousarray(blob.data.transpose(0, 2, 3, 1))


def rerun_layers(net, unit, last):
    """A unit whose forward skips its layers' own: their forwards again one by one (their
    backwards read what those keep), then False: the Net runs their backwards one by one."""
    for li in range(unit.first, last + 1):
        net.layers[li].forward(net.bottom_vecs[li], net.top_vecs[li])
    return False


def folding_enabled():
    """CAFFEPY_FOLD: unset or 1 folds a TEST net's BatchNorm and Scale into its convolutions,
    0 runs them as layers."""
    return os.environ.get("CAFFEPY_FOLD", "1").strip().lower() not in ("0", "off", "no", "false")


@contextlib.contextmanager
def unfolded():
    """Nets built inside the block write every blob (CAFFEPY_FOLD=0), for code that reads blobs
    a fused unit computes past; the variable as it was after it."""
    old = os.environ.get("CAFFEPY_FOLD")
    os.environ["CAFFEPY_FOLD"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["CAFFEPY_FOLD"]
        else:
            os.environ["CAFFEPY_FOLD"] = old


class ConvBatchNorm:
    """In a TEST net: Convolution, then the BatchNorm (global statistics, no ReLU of its own)
    in place on its top, the Scale in place after it if any, and the ReLU in place after them if
    any (or the ReLU alone: GoogLeNet's, AlexNet's), run by the convolution
    (NHWCConvolution.forward_folded): a GEMM algorithm applies them
    in its epilogue, on the rows it has just written (no pass over the output of their own);
    another algorithm computes with them folded into its weights and bias, and takes the ReLU
    into its stores where it `fuses_relu` (Winograd, direct, depthwise; else the ReLU runs as a
    pass). The BatchNorm, Scale and ReLU may also each write a blob of their own from the one
    before, that blob read by nothing else (Intel's Inception-v3 prototxts: conv -> conv_bn ->
    conv_relu): the unit then writes the last, and the blobs between are not written
    (net.unwritten_blobs; CAFFEPY_FOLD=0 writes them). Folding costs once, not every forward:
    the folded weights and what the algorithm derives from them (Winograd's U, reordered
    weights) are kept, and the check for changed weights reads no float while nothing outside
    holds them (blob.Seen). (ResNet-50 b1's res3 and res4 3 x 3 units, which a cost model of
    rereading the weights ran as their layers, take 6-14% less time folded.) A ReLU alone goes
    into the stores of an algorithm that takes one."""
    name = "Convolution+BatchNorm(+Scale)(+ReLU)"

    def find(self, net, rule=None):
        """The units in `net`; those whose layers all take part in `rule` too (ConvSum's
        search), by default this rule."""
        if net.phase != caffe_pb2.TEST or not folding_enabled():
            return []
        rule = rule or self
        readers = blob_readers(net)

        def link(li, layer_type, x):
            """Layer li's top when it is a `layer_type` on x in place or, in this rule's own
            search, the next link of a chain of tops (Int8Unit._next); else None."""
            if rule is not self:
                return x if in_place_on(net, li, x) and net.layers[li].type == layer_type \
                    else None
            return Int8Unit._next(net, li, layer_type, x, readers)

        def step(li, layer_type, x):
            return link(li, layer_type, x) if takes_part(net, li, rule, layer_type) else None

        def relu_step(li, x):
            y = link(li, "ReLU", x) if li < len(net.layers) else None
            return y if y is not None and fusable_relu(net, li) else None

        units = []
        for li in range(len(net.layers) - 1):
            conv = net.layers[li]
            if not (takes_part(net, li, rule, "Convolution") and conv.fused is None
                    and len(net.bottom_vecs[li]) == 1 and len(net.top_vecs[li]) == 1):
                continue
            y = net.top_vecs[li][0]
            if relu_step(li + 1, y) is not None:        # no BatchNorm: the ReLU alone
                units.append(Unit(self, li, li + 1))
                continue
            x = step(li + 1, "BatchNorm", y)
            if x is None or not net.layers[li + 1].use_global_stats or net.layers[li + 1].relu:
                continue
            last = li + 1
            z = step(last + 1, "Scale", x) if last + 1 < len(net.layers) else None
            if z is not None and len(net.bottom_vecs[last + 1]) == 1:
                last, x = last + 1, z
            if relu_step(last + 1, x) is not None:
                last += 1
            units.append(Unit(self, li, last))
        return units

    @staticmethod
    def describe(units):
        return f"{len(units)} convolution(s) with the BatchNorm, Scale or ReLU after them"

    @staticmethod
    def forward(net, unit, last):
        first = unit.first
        conv, bottom = net.layers[first], net.bottom_vecs[first]
        # the unit's value goes to its last top: the convolution's own, or a chain's end (the
        # blobs between then unwritten)
        top = net.top_vecs[last]
        bn, scale, _, _, relu = parts(net, unit, last)
        # the epilogue's and the stores' ReLU has no slope: a leaky one runs after them
        plain = relu is not None and relu.slope == 0
        slot = net._concat_slots.get(first)
        out = None
        if slot is not None and (relu is None or plain) and conv.writes_slice(relu is not None):
            out = slot.run(net, top[0])
        if bn is None and not conv.has_epilogue():
            if not (plain and conv.forward_relu(bottom, top, out)):
                out = None
                conv.forward(bottom, top)
                relu.forward(top, top)
        elif not conv.forward_folded(bottom, top, bn, scale, plain, out=out) or (
                relu is not None and not plain):
            relu.forward(top, top)
        if slot is not None:
            slot.concat.placed[slot.index] = out is not None

    @staticmethod
    def backward(net, unit, last, every_layer):
        return rerun_layers(net, unit, last)


class ConvSum:
    """In a TEST net: the Convolution+BatchNorm(+Scale) unit without a ReLU (ResNet's last
    convolution of a block), then the Eltwise SUM of its top and a shortcut, the ReLU in place
    on the sum and the Split after it if any (ResNet's block end), run by the convolution: its
    GEMM's epilogue applies the BatchNorm and Scale, adds the shortcut and takes the ReLU on the
    rows it has just written, straight into the Eltwise's top (Intel's ConvSumFusion with the
    BatchNorm folded). No pass of the Eltwise+ReLU's own (it read two activations and wrote one;
    ResNet-50 has 16 such block ends), but the convolution's own top (the BatchNorm and
    Scale's values, `res2a_branch2c` ...) is then not written: CAFFEPY_FOLD=0 keeps it. When the
    convolution's algorithm has no epilogue the two units run as their rules run them."""
    name = "Convolution+BatchNorm(+Scale)+Eltwise+ReLU(+Split)"

    def find(self, net):
        if net.phase != caffe_pb2.TEST or not folding_enabled():
            return []
        units = []
        for conv in CONV_BATCHNORM.find(net, self):
            e, y = conv.last + 1, net.top_vecs[conv.first][0]
            if net.layers[conv.last].type == "ReLU" or e + 1 >= len(net.layers) \
                    or net._conversions[e] or not takes_part(net, e, self, "Eltwise"):
                continue
            bottoms, x = net.bottom_vecs[e], net.top_vecs[e][0]
            if not (len(bottoms) == 2 and sum(b is y for b in bottoms) == 1 and x not in bottoms
                    and net.layers[e].fuses_relu(bottoms, [x]) and relu_in_place(net, e + 1, x)
                    and net.layers[e + 1].slope == 0):
                continue
            last = e + 1
            if last + 1 < len(net.layers) and net.layers[last + 1].type == "Split" \
                    and not net._conversions[last + 1] and net.bottom_vecs[last + 1] == [x]:
                last += 1
            units.append(Unit(self, conv.first, last))
        return units

    @staticmethod
    def describe(units):
        return f"{len(units)} convolution(s) with the BatchNorm, Scale, Eltwise SUM and ReLU after them"

    @staticmethod
    def forward(net, unit, last):
        first = unit.first
        conv, y = net.layers[first], net.top_vecs[first][0]
        bn, scale, e, shortcut, relu = parts(net, unit, last)
        x = net.top_vecs[e]
        memory = net._activations
        if memory is not None and first in memory.over and not conv.adds_in_place():
            memory.part(first)
        if conv.has_epilogue() and shortcut.layout == x[0].layout == y.layout:
            conv.forward_folded(net.bottom_vecs[first], x, bn, scale, True, shortcut)
            return
        ConvBatchNorm.forward(net, Unit(CONV_BATCHNORM, first, e - 1), e - 1)
        net.layers[e].forward_with_relu(net.bottom_vecs[e], x, relu)

    @staticmethod
    def backward(net, unit, last, every_layer):
        return rerun_layers(net, unit, last)


class BatchNormScale:
    """BatchNorm in place, then Scale in place on the same blob (+ the ReLU in place after):
    one pass over the activations in forward (NHWCBatchNorm.forward_with_scale) and one
    reduction in backward (NHWCScale.backward_with_bn) instead of two or three of each."""
    name = "BatchNorm+Scale(+ReLU)"

    def find(self, net):
        units = []
        for li in range(len(net.layers) - 1):
            if not (net.top_vecs[li] and takes_part(net, li, self, "BatchNorm")
                    and takes_part(net, li + 1, self, "Scale")):
                continue
            x = net.top_vecs[li][0]
            # a BatchNorm's own ReLU (Intel's relu: true) comes before the Scale; the unit's
            # kernels take one after it only
            if net.bottom_vecs[li][0] is x and in_place_on(net, li + 1, x) and not net.layers[li].relu:
                units.append(Unit(self, li, li + 2 if relu_in_place(net, li + 2, x) else li + 1))
        return units

    @staticmethod
    def describe(units):
        relus = sum(u.last - u.first == 2 for u in units)
        return f"fused {len(units)} BatchNorm + Scale pair(s), {relus} with the ReLU after them"

    @staticmethod
    def forward(net, unit, last):
        first = unit.first
        net.layers[first].forward_with_scale(net.bottom_vecs[first], net.top_vecs[first],
                                             net.layers[first + 1],
                                             net.layers[last] if last > first + 1 else None)

    @staticmethod
    def backward(net, unit, last, every_layer):
        """False when the layers must run one by one: the forward did not run fused."""
        first = unit.first
        scale = net.layers[first + 1]
        if scale.fused_input is None:
            return False
        bn_runs = every_layer or net.layer_need_backward[first]
        scale.backward_with_bn(net.top_vecs[last], net.layers[first], net.bottom_vecs[first][0],
                               bn_runs and net.bottom_need_backward[first][0],
                               net.layers[last] if last > first + 1 else None)
        return True


class EltwiseReLU:
    """Eltwise SUM of two bottoms (coefficients 1, one layout), the ReLU in place on its top,
    and the Split after it if the top feeds two layers: one pass forward (the Split shares the
    data) and one backward instead of three (Eltwise.forward_with_relu, backward_with_relu)."""
    name = "Eltwise+ReLU(+Split)"

    def find(self, net):
        units = []
        for li in range(len(net.layers) - 1):
            if not (net.top_vecs[li] and takes_part(net, li, self, "Eltwise")):
                continue
            x = net.top_vecs[li][0]
            if not (net.layers[li].fuses_relu(net.bottom_vecs[li], [x])
                    and relu_in_place(net, li + 1, x)):
                continue
            last, split = li + 1, li + 2
            if split < len(net.layers) and net.layers[split].type == "Split" \
                    and not net._conversions[split] and net.bottom_vecs[split] == [x] \
                    and len(net.top_vecs[split]) == 2:
                last = split
            units.append(Unit(self, li, last, self.shortcut_bottom(net, li)))
        return units

    @staticmethod
    def shortcut_bottom(net, first):
        """The unit's bottom that shares its top's diff, or None.

        Such a bottom is a Split's top that the unit sends a gradient to: the layers give its
        diff the values of the top's diff (an Eltwise SUM with coefficients 1 hands its top
        diff to each bottom), and a Split's top has no other writer, so one buffer can hold
        both, and the unit's backward writes those values once instead of twice (ResNet-50
        b16: one pass fewer over each of its 16 shortcuts' gradients, and 16 fewer diff
        buffers). A bottom that is some other layer's top keeps its own diff: that layer may
        work on it in place. The buffers are joined at the unit's first fused backward (so a
        net that runs no backward allocates no diff), and again after a reshape gave one of
        them a buffer of its own."""
        top = net.top_vecs[first][0]
        for b, down in zip(net.bottom_vecs[first], net.bottom_need_backward[first]):
            li = next((i for i, tops in enumerate(net.top_vecs) if any(t is b for t in tops)), None)
            if down and li is not None and net.layers[li].type == "Split" \
                    and b is not top and b.layout == top.layout:
                return b
        return None

    @staticmethod
    def describe(units):
        splits = sum(u.last - u.first == 2 for u in units)
        return f"fused {len(units)} Eltwise + ReLU pair(s), {splits} with the Split after them"

    @staticmethod
    def forward(net, unit, last):
        first = unit.first
        net.layers[first].forward_with_relu(net.bottom_vecs[first], net.top_vecs[first],
                                            net.layers[first + 1])

    @staticmethod
    def backward(net, unit, last, every_layer):
        first, shortcut = unit.first, unit.shortcut
        top = net.top_vecs[first][0]
        if shortcut is not None and not shortcut.shares_diff(top) and shortcut.shape == top.shape:
            shortcut.share_diff(top)
        split = net.top_vecs[last] if last == first + 2 else []
        net.layers[first].backward_with_relu(net.top_vecs[first], net.layers[first + 1], split,
                                             net.bottom_need_backward[first],
                                             net.bottom_vecs[first])
        return True


BATCHNORM_SCALE = BatchNormScale()
ELTWISE_RELU = EltwiseReLU()
INT8 = Int8Unit()
CONV_BATCHNORM = ConvBatchNorm()
CONV_SUM = ConvSum()
RULES = (INT8, CONV_SUM, CONV_BATCHNORM, BATCHNORM_SCALE, ELTWISE_RELU)


class ConcatSlot(typing.NamedTuple):
    """In a TEST net: the Convolution+BatchNorm(+Scale)(+ReLU) unit whose top is bottom `index`
    of the channels-last Concat `concat` (layer `li`), and read by nothing else, writes its
    output straight into channels [lo, hi) of the concat's top, and the Concat copies the
    others only (Intel's and OpenVINO's concat in place). The unit's own top is then not
    written (GoogLeNet's inception_*/1x1, 3x3, 5x5 and pool_proj); CAFFEPY_FOLD=0 writes it.
    A unit falls back to its own top, and the Concat copies it, when the concat's top does not
    have the shape to take it (the first forward after a batch size changed) or when its
    algorithm cannot write a slice (depthwise; an int8 unit is never one of these)."""
    concat: object
    li: int
    index: int
    lo: int
    hi: int

    def run(self, net, y):
        """The concat top's channels [lo, hi) as a [N, H, W, hi - lo] array, for a unit whose
        own top is y; None when the concat's top is not shaped for y's batch and image."""
        z = net.top_vecs[self.li][0]
        n, c, h, w = y.shape
        if z.layout != CHANNELS_LAST or z.shape != (n, self.concat.runs[-1][1], h, w) \
                or c != self.hi - self.lo:
            return None
        return z.raw_data[..., self.lo:self.hi]


def concat_slots(net, units):
    """{first layer of a unit: ConcatSlot} for the units of ConvBatchNorm (`units`: the net's)
    that feed a channels-last Concat of a TEST net; logs a line when there are any."""
    if net.phase != caffe_pb2.TEST or not folding_enabled():
        return {}
    readers = blob_readers(net)
    makers = {id(net.top_vecs[u.last][0]): u for u in units.values()
              if u.rule is CONV_BATCHNORM and len(net.top_vecs[u.first]) == 1}
    slots, concats = {}, 0
    for li, layer in enumerate(net.layers):
        # (a bottom the layout plan converts first is the conversion's top: copied)
        if type(layer).__name__ != "NHWCConcat" or caffe_engine(layer.param, net.param):
            continue
        found = 0
        lo = 0
        for j, b in enumerate(net.bottom_vecs[li]):
            c = b.shape[1]
            unit = makers.get(id(b))
            # read by the unit's own in-place layers and the concat alone, once
            alone = unit is not None and readers.get(id(b), set()) <= set(
                range(unit.first + 1, unit.last + 1)) | {li} \
                and sum(x is b for x in net.bottom_vecs[li]) == 1
            if alone and net.top_vecs[unit.last][0] is b:
                slots[unit.first] = ConcatSlot(layer, li, j, lo, lo + c)
                found += 1
            lo += c
        if found:
            layer.placed = [False] * len(net.bottom_vecs[li])
            concats += 1
    if slots:
        log.info(f"Concat in place: {len(slots)} convolution unit(s) write their channels into "
                 f"{concats} concat top(s), their own tops not written (CAFFEPY_FOLD=0 writes them)")
    return slots


def _reads_of(net, readers, blob, inside):
    """(layer, blob) of every reader of blob outside the layers `inside`, through Split layers
    (a module function: a recursive closure would hold the net in a cycle)."""
    out = []
    for li in readers.get(id(blob), []):
        if li in inside:
            continue
        if net.layers[li].type == "Split" and not net._conversions[li]:
            for t in net.top_vecs[li]:
                out += _reads_of(net, readers, t, inside)
        else:
            out.append((li, blob))
    return out


def byte_tops(net, units):
    """Mark the layers of a TEST net that hand their 8-bit tops on as bytes (quantization.Bytes;
    Blob.hold: floats written only when something reads them): an int8 convolution's unit
    (Int8.byte_top) whose readers all take the bytes; a channels-last MAX pooling of such bytes
    (NHWCPooling.byte_pool) whose readers all take them; a channels-last concat of such bytes,
    all of one scale and range (NHWCConcat.byte_concat: Intel's calibrator unifies the scales
    of a concat's inputs), that at least one reader takes (one reading floats fills them, a
    pass the float concat would make anyway). A reader takes bytes as an int8 convolution's
    input of their scale and range on the byte paths' direct kernels, as an int8 unit's
    summand, or as such a pooling or concat. Logs a line when any are marked;
    CAFFEPY_INT8_BYTES=0 writes every top as floats. Returns how many int8 units."""
    if net.phase != caffe_pb2.TEST or not quantization.bytes_enabled():
        return 0
    readers = {}
    for li, bottoms in enumerate(net.bottom_vecs):
        for b in bottoms:
            readers.setdefault(id(b), []).append(li)
    owner = {li: u for u in units.values() if u.rule is INT8 for li in range(u.first, u.last + 1)}
    # the layers that may emit bytes, by their first layer: [layer, top, (scale, lo) or None]
    nodes, writer = {}, {}
    for li, layer in enumerate(net.layers):
        top = net.top_vecs[li][0] if len(net.top_vecs[li]) == 1 else None
        u = units.get(li)
        q = getattr(layer, "int8", None)
        if u is not None and u.rule is INT8 and layer.type == "Convolution" and q.channels_last \
                and q.spec.bits_out == 8 and q.isa in quantization.BYTE_PATHS:
            lo = quantization.U8[0] if Int8Unit.relu(net, u, u.last) == (True, 0.0) \
                else quantization.S8[0]
            nodes[li] = [layer, net.top_vecs[u.last][0], (q.spec.scale_out, lo)]
        elif top is not None and not net._conversions[li] and (
                (getattr(layer, "byte_pool", None) is not None
                 and layer.pool == caffe_pb2.PoolingParameter.MAX
                 and all(k > p for k, p in zip(layer.kernel, layer.pad)))
                or getattr(layer, "byte_concat", None) is not None):
            nodes[li] = [layer, top, None]
        elif layer.type == "Split" and not net._conversions[li]:
            for t in net.top_vecs[li]:
                writer[id(t)] = writer.get(id(net.bottom_vecs[li][0]))
            continue
        if li in nodes:
            writer[id(nodes[li][1])] = li

    def reads_of(blob, inside=range(0)):
        return _reads_of(net, readers, blob, inside)

    def takes(li, blob, scale, lo):
        """Whether layer li reads `blob`'s bytes of (scale, lo) as they are."""
        if li in nodes and nodes[li][2] is not None and nodes[li][0].type != "Convolution":
            return True                     # a pooling or concat that passes them on
        v = owner.get(li)
        if v is None or net._conversions[li]:
            return False
        layer = net.layers[v.first]
        if li != v.first:       # an Eltwise inside an int8 unit: its summand
            return net.layers[li].type == "Eltwise" and parts(net, v, v.last).summand is blob
        r = layer.int8
        fused_sum = (layer.fused is not None and layer.fused.summed
                     and net.bottom_vecs[li][1] is blob and net.bottom_vecs[li][0] is not blob)
        return fused_sum or (
            net.bottom_vecs[li][0] is blob and layer.type == "Convolution" and r.channels_last
            and r.isa in quantization.BYTE_PATHS
            and r.spec.scale_in == scale and not r.spec.force_u8
            and r.spec.signed_input == (lo < 0)
            and not (layer.channels & 1 and layer.channels < 8))

    def source(blob):
        w = writer.get(id(blob))
        return None if w is None else nodes[w][2]

    def emits(li):
        """Whether node li hands bytes on, as the other nodes stand."""
        layer, top, kind = nodes[li]
        if layer.type == "Convolution":
            inside = range(li, owner[li].last + 1)
        else:
            bottoms = net.bottom_vecs[li]
            kinds = {source(b) for b in bottoms}
            if len(kinds) != 1 or None in kinds:
                return False
            kind, inside = kinds.pop(), range(li, li + 1)
        reads = [takes(r, b, *kind) for r, b in reads_of(top, inside)]
        if layer.type == "Concat":
            return any(reads)
        return bool(reads) and all(reads)

    # the largest set of nodes that each emit as the others do: start from all, drop until none
    # changes (a pooling's or concat's kind comes from its bottoms')
    for li, node in nodes.items():
        if node[0].type != "Convolution":
            node[2] = (None, None)              # undecided: assumed to emit
    changed = True
    while changed:
        changed = False
        for li, node in nodes.items():
            if node[2] is None:
                continue
            if node[0].type != "Convolution":
                kinds = {source(b) for b in net.bottom_vecs[li]}
                kind = kinds.pop() if len(kinds) == 1 else None
                if kind == (None, None):
                    continue                    # its source undecided yet
                if kind != node[2]:
                    node[2], changed = kind, True
                if kind is None:
                    continue
            if not emits(li):
                node[2], changed = None, True

    def int8_readers(li):
        """The int8 convolutions reading node li's bytes, through poolings and concats (a
        stack: a recursive closure would hold the net in a cycle)."""
        out, todo = [], [(li, range(li, owner[li].last + 1))]
        while todo:
            node, inside = todo.pop()
            for r, b in reads_of(nodes[node][1], inside):
                if r in nodes and nodes[r][0].type != "Convolution":
                    todo.append((r, range(r, r + 1)))
                elif r in owner and owner[r].first == r and net.bottom_vecs[r][0] is b:
                    out.append(net.layers[r].int8)
        return out

    found = pools = concats = 0
    for li, (layer, top, kind) in nodes.items():
        ok = kind is not None and kind != (None, None)
        if layer.type == "Convolution":
            layer.int8.byte_top = ok
            layer.int8.byte_readers = int8_readers(li) if ok else []
            layer.int8.byte_slot = None
            found += ok
        elif layer.type == "Pooling":
            layer.byte_pool = ok
            # the int8 path its bytes come from: the units' (chosen when they were built), not
            # the one CAFFEPY_INT8_ISA names at the forward
            layer.byte_isa = next((net.layers[u.first].int8.isa for u in owner.values()), None)
            pools += ok
        else:
            layer.byte_concat = ok
            concats += ok
    slots = 0
    for li, (layer, top, kind) in nodes.items():
        if layer.type != "Concat" or not layer.byte_concat:
            continue
        bottoms = net.bottom_vecs[li]
        for j, b in enumerate(bottoms):
            w = writer.get(id(b))
            # an int8 unit's own top (not a Split's) that only this concat reads, once
            if w is None or nodes[w][0].type != "Convolution" or nodes[w][1] is not b \
                    or not nodes[w][0].int8.byte_top \
                    or sum(x is b for x in bottoms) != 1 \
                    or reads_of(b, range(w, owner[w].last + 1)) != [(li, b)]:
                continue
            nodes[w][0].int8.byte_slot = (layer, j, top)
            slots += 1
    if found:
        log.info(f"int8 tops as bytes: {found} int8 convolution(s), {pools} pooling(s) and "
                 f"{concats} concat(s) hand their 8-bit tops on as bytes ({slots} written "
                 f"straight into a concat's), floats written only where read "
                 f"(CAFFEPY_INT8_BYTES=0 writes them all)")
    return found


def unwritten(net):
    """The blobs a TEST net's units may leave unwritten: a block end's convolution top (ConvSum,
    and an int8 unit with its sum: the sum is written straight into the Eltwise's top), the
    blobs between a unit's layers when they are not in place (Int8, ConvBatchNorm), and the
    tops of the units that write into a concat (ConcatSlot). CAFFEPY_FOLD=0 writes the float
    units' (an int8 unit's are never written, as in Intel's compiled net: engine: CAFFE runs
    its layers apart)."""
    out = []
    for u in net._units.values():
        y = net.top_vecs[u.first][0]
        top = net.top_vecs[u.last][0]
        if u.rule in (INT8, CONV_BATCHNORM):    # the blobs inside: a chain's, a sum's bottom
            out.extend(b for b in {id(net.top_vecs[li][0]): net.top_vecs[li][0]
                                   for li in range(u.first, u.last)}.values() if b is not top)
        elif u.rule is CONV_SUM and y is not top:
            out.append(y)
    out.extend(net.top_vecs[net._units[first].last][0] for first in net._concat_slots)
    return out


def compile_net(net, rules=RULES):
    """{first layer index: Unit} of the units `rules` find in the built `net`, in order (a
    layer joins the first unit that claims it); none under `engine: CAFFE`. Logs one line
    naming each rule that matched and what it matched."""
    if caffe_engine(None, net.param):
        return {}
    units, taken, applied = {}, set(), []
    for rule in rules:
        found = [u for u in rule.find(net) if taken.isdisjoint(range(u.first, u.last + 1))]
        for u in found:
            units[u.first] = u
            taken.update(range(u.first, u.last + 1))
        if found:
            applied.append(f"{rule.name}: {rule.describe(found)}")
    if applied:
        log.info("Net compilation rules (engine: CAFFE runs the layers apart): "
                 + "; ".join(applied))
    return dict(sorted(units.items()))
