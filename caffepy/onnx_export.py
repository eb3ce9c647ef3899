"""Export a Net to ONNX (opset 17) for the layer types whose ONNX mapping is exact.

    caffepy export_onnx deploy.prototxt weights.caffemodel out.onnx
    caffepy.onnx_export.export(net, "out.onnx")

Every mapped layer computes in ONNX what it computes here, up to float rounding; a layer with no
faithful mapping is refused with one line that names it. The net is exported as built for the
TEST phase, with the fixed shapes its prototxt gives (the batch size included):

- Input layers, and the data layers of a train_val net (Data, ImageData, MemoryData, DummyData:
  any layer with no bottoms and no parameters), become graph inputs of the shape the net gives
  their tops, i.e. after transform_param's crop, mean and scale; the transform is not exported.
- Loss layers and Accuracy are left out (they need labels; a deploy net has neither), and so is
  Silence; a data top that only they read (the label) is then no input.
- Graph outputs are the blobs no exported layer reads, named as in the net. Every ONNX tensor
  named after a blob holds what `net.blobs[name].data` holds after a forward pass (a blob that
  in-place layers rewrite is named for its last value; earlier values get `<blob>_<layer>`, and
  so does the last value of an input rewritten in place); each output's doc_string names its blob.

Pooling is mapped with explicit pads, never ceil_mode: Caffe's output size (ceil rounding, then
dropping a last window that would start in the right padding) becomes end padding, which MAX
ignores. AVE divides by the window clipped to the image plus Caffe's pad, which ONNX's
count_include_pad cannot say once a window runs past that pad; those layers get an explicit
zero Pad of Caffe's size and then count_include_pad=0 over the rest.
"""
import numpy as np

from . import geometry
from .errors import CaffepyError, layer_error
from .proto import caffe_pb2

OPSET = 17      # ONNX Runtime 1.12+, TensorRT 8.6+; Softmax and Split take opset-13 semantics

_INSTALL_HINT = "export_onnx needs the onnx package: pip install 'caffepy[onnx]' (or pip install onnx)"


def _onnx():
    try:
        import onnx
    except ImportError:
        raise CaffepyError(_INSTALL_HINT) from None
    return onnx


# types left out of the exported graph (see the module docstring)
_DROPPED = {"Accuracy", "Silence"}


def export(net, path=None):
    """Export `net` (a caffepy.Net) to ONNX; write it to `path` if given; return the ModelProto."""
    onnx = _onnx()
    net = _plain(net)
    model, skeleton = _Exporter(net, onnx).models()
    _check(onnx, skeleton, net)
    if path is not None:
        onnx.save(model, str(path))
    return model


def export_files(model_file, weights, out):
    """The `export_onnx` command: build the TEST net, load the weights, export, log a summary."""
    _onnx()
    from . import log
    from .net import TEST, Net
    net = Net(model_file, weights, TEST)
    graph = export(net, out).graph

    def described(values):
        return ", ".join(f"{v.name} ({'x'.join(str(d.dim_value) for d in v.type.tensor_type.shape.dim)})"
                         for v in values)
    log.info(f"Wrote {out}: ONNX opset {OPSET}, {len(graph.node)} nodes from {len(net.layers)} layers")
    log.info(f"Inputs: {described(graph.input)}")
    log.info(f"Outputs: {described(graph.output)}")


def _plain(net):
    """The net itself, or for a net on the Intel path (IntelPack ... IntelUnpack) a plain NCHW
    twin with the same weights: Pack and Unpack are layout changes, identities in ONNX."""
    if not any(layer.type in ("IntelPack", "IntelUnpack") for layer in net.layers):
        return net
    from .net import Net
    param = caffe_pb2.NetParameter()
    param.CopyFrom(net.param)
    for lp in param.layer:
        del lp.include[:], lp.exclude[:]      # filtered already, under a state we do not know
        if lp.type in ("IntelPack", "IntelUnpack"):
            lp.type = "Split"
        _constant_fillers(lp)                  # the weights are copied in below
    twin = Net(param, phase=net.phase, source=net.source)
    for layer, original in zip(twin.layers, net.layers):      # the same layers, in order
        for mine, theirs in zip(layer.blobs, original.blobs):
            mine.data[...] = theirs.data
    return twin


def _constant_fillers(message):
    for field, value in message.ListFields():
        if field.message_type is caffe_pb2.FillerParameter.DESCRIPTOR:
            for filler in (value if field.is_repeated else [value]):
                filler.Clear()                 # caffe.proto's default filler is constant 0
        elif field.message_type is not None and field.name != "blobs":
            for sub in (value if field.is_repeated else [value]):
                _constant_fillers(sub)


def _check(onnx, model, net):
    """onnx.checker's verdict, and ONNX's own shape inference must give every tensor named after
    a blob the blob's shape (one strict inference pass serves both). Run on the skeleton, whose
    weights are inputs of their shape: the checks read shapes, and AlexNet's 240 MB of weights
    would take seconds to serialize for them."""
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    onnx.checker.check_model(inferred)
    inferred = inferred.graph
    for v in list(inferred.value_info) + list(inferred.output):
        if v.name in net.blobs:
            dims = tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
            assert dims == net.blobs[v.name].shape, (v.name, dims, net.blobs[v.name].shape)


class _Exporter:
    def __init__(self, net, onnx):
        self.net, self.onnx, self.h = net, onnx, onnx.helper
        self.nodes, self.initializers, self.inputs = [], [], []
        self.input_names = set()
        self.taken = set(net.blobs) | set(net._layer_names)
        self.current = {}           # blob name -> the ONNX tensor holding its value now
        self.read = set()           # ONNX tensors some node reads
        self.order = []             # (ONNX tensor, blob) for each blob's last value, in order
        last = {}
        self.bottoms = {b for name in net._layer_names for b in net.bottom_names[name]}
        for name in net._layer_names:
            for top in net.top_names[name]:
                last[top] = name
        self.last_producer = last

    # -- building blocks -----------------------------------------------------------
    def fresh(self, base):
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def const(self, base, value, dtype=np.float32):
        name = self.fresh(base)
        self.initializers.append((name, np.asarray(value, dtype)))
        return name

    def ints(self, base, values):
        return self.const(base, np.asarray(values, np.int64).reshape(-1), np.int64)

    def node(self, op, inputs, outputs=None, name=None, **attrs):
        """Add a node; `outputs` are names or an int (that many fresh names). Returns the outputs."""
        if outputs is None or isinstance(outputs, int):
            outputs = [self.fresh(f"{name}_{op}_{i}") for i in range(outputs or 1)]
        self.read.update(i for i in inputs if i)
        self.nodes.append(self.h.make_node(op, list(inputs), list(outputs),
                                           name=self.fresh(f"{name}/{op}"), **attrs))
        return outputs

    # -- the walk ------------------------------------------------------------------
    def models(self):
        """The model, and its skeleton: the same graph with the float weights as inputs."""
        net = self.net
        for name, layer in zip(net._layer_names, net.layers):
            bottoms, tops = net.bottom_names[name], net.top_names[name]
            if layer.type in _DROPPED or getattr(layer, "is_loss", False):
                continue
            if not bottoms:
                self._inputs(layer, tops)
                continue
            if layer.type == "Split":
                if bottoms[0] in self.current:      # else the layers reading it name the problem
                    self._split(name, self.current[bottoms[0]], tops)
                continue
            for b in bottoms:
                if b not in self.current:
                    raise layer_error(layer, "bottom", f"blob '{b}' comes from a layer left out of "
                                      "the ONNX graph (a loss layer or Accuracy)")
            mapper = MAPPERS.get(layer.type)
            if mapper is None:
                raise layer_error(layer, "type", "has no exact ONNX mapping",
                                  hint="Mapped types: " + ", ".join(sorted(MAPPERS)))
            outs = [self._top_name(name, t) for t in tops]
            ctx = _Layer(self, layer, name, [self.current[b] for b in bottoms],
                         [net.blobs[b].shape for b in bottoms], [net.blobs[t].shape for t in tops], outs)
            mapper(ctx)
            for t, o in zip(tops, outs):
                self.current[t] = o
        inputs = [v for v in self.inputs if v.name in self.read]
        outputs = [self.h.make_tensor_value_info(o, self.onnx.TensorProto.FLOAT, net.blobs[blob].shape,
                                                 doc_string=f"blob {blob}")
                   for o, blob in self.order if o not in self.read]
        FLOAT = self.onnx.TensorProto.FLOAT
        weights = [(n, a) for n, a in self.initializers if a.dtype == np.float32]
        small = [self.onnx.numpy_helper.from_array(a, n) for n, a in self.initializers if a.dtype != np.float32]
        model = self._model(inputs, outputs, small)
        for name, array in weights:      # in place: make_graph and make_model would copy them twice
            t = model.graph.initializer.add()
            t.name, t.data_type = name, FLOAT
            t.dims.extend(array.shape)
            t.raw_data = array.astype("<f4", copy=False).tobytes()
        as_inputs = [self.h.make_tensor_value_info(n, FLOAT, a.shape) for n, a in weights]
        return model, self._model(inputs + as_inputs, outputs, small)

    def _model(self, inputs, outputs, initializers):
        graph = self.h.make_graph(self.nodes, self.net.name or "net", inputs, outputs, initializers)
        opset = [self.h.make_opsetid("", OPSET)]
        return self.h.make_model(graph, opset_imports=opset, producer_name="caffepy",
                                 ir_version=self.h.find_min_ir_version_for(opset))

    def _split(self, name, x, tops):
        """Every top is the bottom: a name for the same tensor, or an Identity for a top that no
        layer reads (a net output, e.g. an IntelUnpack's)."""
        for t in tops:
            self.current[t] = x if t in self.bottoms else self.node("Identity", [x], [self._top_name(name, t)],
                                                                     name)[0]

    def _inputs(self, layer, tops):
        if layer.blobs:
            raise layer_error(layer, "type", "a layer with no bottoms and with parameters has no "
                              "exact ONNX mapping")
        for t in tops:
            v = self.h.make_tensor_value_info(t, self.onnx.TensorProto.FLOAT, self.net.blobs[t].shape)
            self.inputs.append(v)
            self.input_names.add(t)
            self.current[t] = t

    def _top_name(self, layer_name, top):
        last = self.last_producer[top] == layer_name
        # a graph input keeps the blob's name even when layers rewrite it in place
        name = top if last and top not in self.input_names else self.fresh(f"{top}_{layer_name}")
        if last:
            self.order.append((name, top))
        return name


class _Layer:
    """What a mapper sees: the layer, its ONNX inputs and the tensors it must write."""

    def __init__(self, ex, layer, name, inputs, in_shapes, out_shapes, outputs):
        self.ex, self.layer, self.name = ex, layer, name
        self.p = layer.param
        self.x, self.in_shapes, self.out_shapes, self.y = inputs, in_shapes, out_shapes, outputs

    def node(self, op, inputs, outputs=None, **attrs):
        return self.ex.node(op, inputs, outputs, name=self.name, **attrs)

    def out(self, op, inputs, **attrs):
        """The node writing the layer's single top."""
        return self.node(op, inputs, self.y[:1], **attrs)[0]

    def const(self, value, what="c"):
        return self.ex.const(f"{self.name}_{what}", value)

    def ints(self, values, what="shape"):
        return self.ex.ints(f"{self.name}_{what}", values)

    def blob(self, i):
        return self.layer.blobs[i].data

    def refuse(self, field, problem, value=None, hint=None):
        return layer_error(self.layer, field, problem, value, hint)

    def chain(self, steps):
        """Apply [(op, extra inputs)] to bottom[0] in order, the last one writing the top."""
        x = self.x[0]
        for i, (op, extra) in enumerate(steps):
            x = self.node(op, [x, *extra], self.y[:1] if i == len(steps) - 1 else None)[0]


MAPPERS = {}


def maps(*types):
    def deco(fn):
        for t in types:
            MAPPERS[t] = fn
        return fn
    return deco


def _axis(axis, ndim):
    return axis % ndim


# -- vision ---------------------------------------------------------------------------
def _refuse_fused(c, field):
    """Intel's fusions (common.FusedOutput) are not exported: the graph would need them apart."""
    if getattr(c.layer, "fused", None) is not None:
        raise c.refuse(f"{field}.relu", "Intel's fused ReLU / Eltwise SUM is not exported",
                       hint="Export the net with a ReLU (and an Eltwise) layer after the layer")


@maps("Convolution", "Deconvolution")
def _conv(c):
    _refuse_fused(c, "convolution_param")
    p = c.p.convolution_param
    inputs = [c.const(c.blob(i), what) for i, what in zip(range(len(c.layer.blobs)), ("weights", "bias"))]
    kernel, (ph, pw), stride, dilation = geometry.conv_window(c.layer)
    op = "Conv" if c.layer.type == "Convolution" else "ConvTranspose"
    for x, y in zip(c.x, c.y):   # several bottoms share the weights
        c.node(op, [x, *inputs], [y], kernel_shape=list(kernel), pads=[ph, pw, ph, pw],
               strides=list(stride), dilations=list(dilation), group=int(p.group))


@maps("Pooling")
def _pool(c):
    P = c.p.pooling_param
    if len(c.y) == 2:
        raise c.refuse("top", "the MAX pooling mask top has no exact ONNX mapping", len(c.y))
    if P.global_pooling:
        c.out("GlobalMaxPool" if P.pool == P.MAX else "GlobalAveragePool", c.x)
        return
    (_, _, H, W), (_, _, oh, ow) = c.in_shapes[0], c.out_shapes[0]
    k, p, s, _ = geometry.pool_window(c.layer)
    # end padding that makes ONNX's floor rounding give Caffe's output size
    end = [max((o - 1) * st + kk - size - pp, 0) for o, st, kk, size, pp in zip((oh, ow), s, k, (H, W), p)]
    window = dict(kernel_shape=list(k), strides=list(s))
    if P.pool == P.MAX:
        c.out("MaxPool", c.x, pads=[p[0], p[1], end[0], end[1]], **window)
        return
    if not P.avg_include_pad:
        # Intel Caffe's divisor, the window clipped to the image, is count_include_pad=0's
        c.out("AveragePool", c.x, pads=[p[0], p[1], end[0], end[1]], count_include_pad=0, **window)
        return
    if all(e <= pp for e, pp in zip(end, p)):
        # every window lies inside Caffe's padded image: its divisor is the whole kernel
        c.out("AveragePool", c.x, pads=[p[0], p[1], p[0], p[1]], count_include_pad=1, **window)
        return
    x = c.x[0]
    if any(p):
        x = c.node("Pad", [x, c.ints([0, 0, p[0], p[1], 0, 0, p[0], p[1]], "pads")], mode="constant")[0]
    rest = [max(e - pp, 0) for e, pp in zip(end, p)]
    c.out("AveragePool", [x], pads=[0, 0, rest[0], rest[1]], count_include_pad=0, **window)


@maps("Crop")
def _crop(c):
    w = c.layer.window
    axes = [i for i, sl in enumerate(w) if (sl.start, sl.stop) != (0, c.in_shapes[0][i])]
    if not axes:
        c.out("Identity", c.x[:1])
        return
    c.out("Slice", [c.x[0], c.ints([w[i].start for i in axes], "starts"),
                    c.ints([w[i].stop for i in axes], "ends"), c.ints(axes, "axes")])


# -- neurons --------------------------------------------------------------------------
@maps("ReLU")
def _relu(c):
    if c.layer.slope:
        c.out("LeakyRelu", c.x, alpha=c.layer.slope)
    else:
        c.out("Relu", c.x)


_SIMPLE = {"Sigmoid": "Sigmoid", "TanH": "Tanh", "AbsVal": "Abs", "BNLL": "Softplus"}


@maps(*_SIMPLE)
def _simple(c):
    c.out(_SIMPLE[c.layer.type], c.x)


@maps("ELU")
def _elu(c):
    c.out("Elu", c.x, alpha=c.layer.alpha)


@maps("Dropout")
def _dropout(c):
    if c.layer.train:
        raise c.refuse("phase", "TRAIN-phase dropout is random; export the TEST net", "TRAIN")
    c.out("Identity", c.x)


@maps("PReLU")
def _prelu(c):
    ndim = len(c.in_shapes[0])
    slope = c.blob(0).reshape(-1)
    if not c.layer.shared:
        slope = slope.reshape((-1,) + (1,) * (ndim - 2))
    c.out("PRelu", [c.x[0], c.const(slope, "slope")])


@maps("Power")
def _power(c):
    L = c.layer
    if L.scale == 0 or L.power == 0:     # a constant, as Caffe fills it
        value = 1.0 if L.power == 0 else L.shift ** L.power
        c.out("Expand", [c.const(np.float32(value), "value"), c.ints(c.out_shapes[0])])
        return
    steps = [("Mul", [c.const(np.float32(L.scale), "scale")])]
    if L.shift:
        steps.append(("Add", [c.const(np.float32(L.shift), "shift")]))
    if L.power != 1:
        steps.append(("Pow", [c.const(np.float32(L.power), "power")]))
    c.chain(steps)


@maps("Exp")
def _exp(c):
    L = c.layer
    steps = [("Mul", [c.const(np.float32(L.inner_scale), "inner_scale")]), ("Exp", [])]
    if L.outer_scale != 1:
        steps.append(("Mul", [c.const(np.float32(L.outer_scale), "outer_scale")]))
    c.chain(steps)


@maps("Log")
def _log(c):
    L = c.layer
    steps = [("Mul", [c.const(np.float32(L.scale), "scale")])]
    if L.shift:
        steps.append(("Add", [c.const(np.float32(L.shift), "shift")]))
    steps.append(("Log", []))
    if L.base_scale != 1:
        steps.append(("Mul", [c.const(np.float32(L.base_scale), "base_scale")]))
    c.chain(steps)


@maps("Threshold")
def _threshold(c):
    above = c.node("Greater", [c.x[0], c.const(c.layer.threshold, "threshold")])[0]
    c.out("Cast", [above], to=c.ex.onnx.TensorProto.FLOAT)


@maps("Clip")
def _clip(c):
    c.out("Clip", [c.x[0], c.const(c.layer.lo, "min"), c.const(c.layer.hi, "max")])


@maps("Swish")
def _swish(c):
    scaled = c.node("Mul", [c.x[0], c.const(np.float32(c.layer.beta), "beta")])[0]
    gate = c.node("Sigmoid", [scaled])[0]
    c.out("Mul", [c.x[0], gate])


# -- normalization --------------------------------------------------------------------
@maps("LRN")
def _lrn(c):
    L = c.layer
    if L.region == caffe_pb2.LRNParameter.ACROSS_CHANNELS:
        c.out("LRN", c.x, size=L.size, alpha=L.alpha, beta=L.beta, bias=L.k)
        return
    # WITHIN_CHANNEL as Caffe composes it: x * (1 + alpha * avgpool(x^2))^-beta, every window
    # inside the padded image (stride 1, pad (size-1)/2), so the divisor is size^2
    pre = (L.size - 1) // 2
    x = c.x[0]
    sq = c.node("Mul", [x, x])[0]
    avg = c.node("AveragePool", [sq], kernel_shape=[L.size, L.size], pads=[pre] * 4, strides=[1, 1],
                 count_include_pad=1)[0]
    scale = c.node("Mul", [avg, c.const(np.float32(L.alpha), "alpha")])[0]
    scale = c.node("Add", [scale, c.const(np.float32(1), "one")])[0]
    scale = c.node("Pow", [scale, c.const(np.float32(-L.beta), "neg_beta")])[0]
    c.out("Mul", [x, scale])


@maps("BatchNorm")
def _batch_norm(c):
    L = c.layer
    if not L.use_global_stats:
        raise c.refuse("batch_norm_param.use_global_stats", "batch statistics (TRAIN) have no exact "
                       "ONNX mapping; export the TEST net", False)
    channels = L.blobs[0].count
    factor = float(c.blob(2).reshape(-1)[0])
    factor = 0.0 if factor == 0 else 1.0 / factor
    mean = c.blob(0) * np.float32(factor)
    var = (c.blob(1).astype(np.float64) * np.float32(factor)).astype(np.float32)
    inputs = [c.x[0], c.const(np.ones(channels), "gamma"), c.const(np.zeros(channels), "beta"),
              c.const(mean, "mean"), c.const(var, "var")]
    if not L.relu:
        c.out("BatchNormalization", inputs, epsilon=L.eps)
        return
    c.out("Relu", c.node("BatchNormalization", inputs, epsilon=L.eps))      # Intel's fused relu


def _broadcast(c, field, blob_shape):
    """The shape that lines a Scale/Bias operand up with bottom[0] from its axis."""
    ndim = len(c.in_shapes[0])
    axis = 0 if len(blob_shape) == 0 else _axis(getattr(c.p, field).axis, ndim)
    return tuple(blob_shape) + (1,) * (ndim - axis - len(blob_shape))


def _operand(c, field, index, what):
    """Bottom[1] reshaped to broadcast, or learned blob `index` as a constant."""
    if len(c.x) == 2:
        return c.node("Reshape", [c.x[1], c.ints(_broadcast(c, field, c.in_shapes[1]))])[0]
    data = c.blob(index)
    return c.const(data.reshape(_broadcast(c, field, data.shape)), what)


@maps("Scale")
def _scale(c):
    steps = [("Mul", [_operand(c, "scale_param", 0, "scale")])]
    if c.layer.bias_term:
        bias = c.layer.blobs[-1].data
        shape = _broadcast(c, "scale_param", c.in_shapes[1] if len(c.x) == 2 else c.blob(0).shape)
        steps.append(("Add", [c.const(bias.reshape(shape), "bias")]))
    c.chain(steps)


@maps("Bias")
def _bias(c):
    c.out("Add", [c.x[0], _operand(c, "bias_param", 0, "bias")])


# -- common ---------------------------------------------------------------------------
@maps("InnerProduct")
def _inner_product(c):
    _refuse_fused(c, "inner_product_param")
    L = c.layer
    shape = c.in_shapes[0]
    axis = _axis(c.p.inner_product_param.axis, len(shape))
    x = c.x[0]
    if len(shape) != 2 or axis != 1:
        x = c.node("Flatten", [x], axis=axis)[0]
    inputs = [x, c.const(c.blob(0), "weights")] + ([c.const(c.blob(1), "bias")] if L.bias_term else [])
    if len(c.out_shapes[0]) == 2:
        c.out("Gemm", inputs, transB=0 if L.transpose else 1)
        return
    flat = c.node("Gemm", inputs, transB=0 if L.transpose else 1)[0]
    c.out("Reshape", [flat, c.ints(c.out_shapes[0])])


@maps("Flatten", "Reshape")
def _reshape(c):
    c.out("Reshape", [c.x[0], c.ints(c.out_shapes[0])])


@maps("Softmax")
def _softmax(c):
    c.out("Softmax", c.x, axis=_axis(c.p.softmax_param.axis, len(c.in_shapes[0])))


@maps("Concat")
def _concat(c):
    c.out("Concat", c.x, axis=c.layer.axis)


@maps("Slice")
def _slice(c):
    L = c.layer
    sizes = [hi - lo for lo, hi in L.bounds]
    c.node("Split", [c.x[0], c.ints(sizes, "split")], c.y, axis=L.axis)


@maps("Eltwise")
def _eltwise(c):
    L = c.layer
    if L.op == L.SUM:
        # Caffe's order: x0 * c0, then + c_i * x_i one by one
        terms = [x if w == 1 else c.node("Mul", [x, c.const(np.float32(w), "coeff")])[0]
                 for x, w in zip(c.x, L.coeff)]
        op = "Add"
    else:
        terms, op = c.x, "Mul" if L.op == L.PROD else "Max"
    y = terms[0]
    for i, t in enumerate(terms[1:], 2):
        y = c.node(op, [y, t], c.y[:1] if i == len(terms) else None)[0]


@maps("ArgMax")
def _argmax(c):
    # Caffe ranks the later index first among equal values; TopK ranks the earlier first, so
    # search the reversed axis and map the indices back
    p = c.p.argmax_param
    L = c.layer
    outer, dim, inner = L.dims
    k = p.top_k
    x = c.node("Reshape", [c.x[0], c.ints([outer, dim, inner])])[0]
    rev = c.node("Slice", [x, c.ints([-1], "starts"), c.ints([-dim - 1], "ends"), c.ints([1], "axes"),
                           c.ints([-1], "steps")])[0]
    values, index = c.node("TopK", [rev, c.ints([k], "k")], 2, axis=1, largest=1, sorted=1)
    index = c.node("Sub", [c.ex.ints(f"{c.name}_last", [dim - 1]), index])[0]
    index = c.node("Cast", [index], to=c.ex.onnx.TensorProto.FLOAT)[0]
    if p.HasField("axis"):
        c.out("Reshape", [values if p.out_max_val else index, c.ints(c.out_shapes[0])])
        return
    parts = [c.node("Reshape", [index, c.ints([outer, 1, k])])[0]]
    if p.out_max_val:
        parts.append(c.node("Reshape", [values, c.ints([outer, 1, k])])[0])
    both = c.node("Concat", parts, axis=1)[0] if len(parts) == 2 else parts[0]
    c.out("Reshape", [both, c.ints(c.out_shapes[0])])


@maps("Tile")
def _tile(c):
    shape = c.in_shapes[0]
    repeats = [1] * len(shape)
    repeats[_axis(c.p.tile_param.axis, len(shape))] = c.p.tile_param.tiles
    c.out("Tile", [c.x[0], c.ints(repeats, "repeats")])


@maps("Reduction")
def _reduction(c):
    L = c.layer
    Op = caffe_pb2.ReductionParameter
    shape = c.in_shapes[0]
    axis = _axis(c.p.reduction_param.axis, len(shape)) if shape else 0
    axes = list(range(axis, len(shape)))
    factor = L.coeff / L.dims[1] if L.op == Op.MEAN and L.dims[1] else L.coeff
    last = factor == 1
    out = c.y[:1] if last else None
    if not axes:
        raise c.refuse("bottom", "a 0-axis bottom has no ONNX reduction", "shape ()")
    if L.op == Op.ASUM:
        x = c.node("ReduceL1", c.x[:1], out, axes=axes, keepdims=0)[0]
    elif L.op == Op.SUMSQ:
        x = c.node("ReduceSumSquare", c.x[:1], out, axes=axes, keepdims=0)[0]
    else:
        x = c.node("ReduceSum", [c.x[0], c.ints(axes, "axes")], out, keepdims=0)[0]
    if not last:
        c.out("Mul", [x, c.const(np.float32(factor), "coeff")])

