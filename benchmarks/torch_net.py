"""A Caffe net in PyTorch, translated from its NetParameter: the benchmarks' PyTorch contender.

    s = spec(net_param)                   # needs caffepy: a JSON-able description of the net
    model = TorchNet(s)                   # needs torch only (the benchmark worker's imports)
    loss, blobs = model({"data": x, "label": y})
    copy_caffepy_weights(model, caffepy_net)   # for the equality test

`spec` reads each layer's fields the way caffepy does (windows through caffepy.geometry, so both
read one rule); `TorchNet` runs the layers in prototxt order over a dict of named blobs, as
Caffe's Net does, with torch's own operators (conv2d, linear, max/avg_pool2d with Caffe's ceil
rounding, local_response_norm, batch_norm, cross_entropy). Shapes are found by running the net
on the meta device while it is built, so every layer gets its channel count without a second
shape rule; the same pass counts FLOPs as nets.training_flops does, for the harness to check
that both frameworks run the same network. ReLU runs in place where Caffe's does (as a PyTorch
user writes it); the rest out of place. Weights: normal with variance 1 / fan-in (the variance
of Caffe's xavier filler), zero biases; the equality test copies caffepy's instead.
Types: Input, Convolution, InnerProduct, Pooling, ReLU, Sigmoid, TanH, LRN (across channels),
Dropout, Concat, Eltwise, BatchNorm, Scale, Softmax, SoftmaxWithLoss, Flatten, Split, and
IntelPack / IntelUnpack (the identity: the layout is caffepy's business). Any other type is
refused with the layer's name.
"""
import math

LOSS_TYPES = ("SoftmaxWithLoss",)


# ---------------------------------------------------------------------------------------------
# NetParameter -> spec (caffepy side)

def spec(net_param):
    """The JSON-able description TorchNet builds from: inputs and layers in order. `net_param`
    is a NetParameter already filtered to one phase (nets.train_net gives one)."""
    from caffepy import geometry
    from caffepy.layer import Layer
    from caffepy.proto import caffe_pb2

    inputs, layers = {}, []
    for lp in net_param.layer:
        if lp.type == "Input":
            shapes = list(lp.input_param.shape)
            for i, top in enumerate(lp.top):
                inputs[top] = list(shapes[min(i, len(shapes) - 1)].dim)
            continue
        d = {"name": lp.name, "type": lp.type, "bottom": list(lp.bottom), "top": list(lp.top),
             "loss_weight": list(lp.loss_weight)}
        shim = Layer(lp)       # geometry reads the param and words its errors through it
        if lp.type == "Convolution":
            p, w = lp.convolution_param, geometry.conv_window(shim)
            d.update(num_output=p.num_output, group=p.group, bias=p.bias_term,
                     kernel=w.kernel, pad=w.pad, stride=w.stride, dilation=w.dilation)
        elif lp.type == "InnerProduct":
            p = lp.inner_product_param
            d.update(num_output=p.num_output, bias=p.bias_term, axis=p.axis, transpose=p.transpose)
        elif lp.type == "Pooling":
            p, w = lp.pooling_param, geometry.pool_window(shim)
            d.update(pool=caffe_pb2.PoolingParameter.PoolMethod.Name(p.pool), kernel=w.kernel,
                     pad=w.pad, stride=w.stride,
                     ceil=p.round_mode == caffe_pb2.PoolingParameter.CEIL,
                     include_pad=p.avg_include_pad)
            if d["pool"] not in ("MAX", "AVE"):
                raise _refused(lp, f"pool {d['pool']}")
        elif lp.type == "ReLU":
            d.update(slope=lp.relu_param.negative_slope)
        elif lp.type == "LRN":
            p = lp.lrn_param
            if p.norm_region != caffe_pb2.LRNParameter.ACROSS_CHANNELS:
                raise _refused(lp, "norm_region WITHIN_CHANNEL")
            d.update(size=p.local_size, alpha=p.alpha, beta=p.beta, k=p.k)
        elif lp.type == "Dropout":
            d.update(ratio=lp.dropout_param.dropout_ratio)
        elif lp.type == "Concat":
            p = lp.concat_param
            d.update(axis=p.concat_dim if p.HasField("concat_dim") else p.axis)
        elif lp.type == "Eltwise":
            p = lp.eltwise_param
            d.update(op=caffe_pb2.EltwiseParameter.EltwiseOp.Name(p.operation), coeff=list(p.coeff))
        elif lp.type == "BatchNorm":
            p = lp.batch_norm_param
            global_stats = (p.use_global_stats if p.HasField("use_global_stats")
                            else net_param.state.phase == caffe_pb2.TEST)
            d.update(eps=p.eps, global_stats=global_stats, fraction=p.moving_average_fraction)
        elif lp.type == "Scale":
            p = lp.scale_param
            if len(lp.bottom) != 1 or p.axis != 1 or p.num_axes != 1:
                raise _refused(lp, "only the one-bottom, per-channel Scale translates")
            d.update(bias=p.bias_term)
        elif lp.type in ("Softmax", "SoftmaxWithLoss"):
            p = lp.softmax_param
            d.update(axis=p.axis)
            if lp.type == "SoftmaxWithLoss":
                lo = lp.loss_param
                d.update(ignore=lo.ignore_label if lo.HasField("ignore_label") else None,
                         normalization=_normalization(lo))
        elif lp.type == "Flatten":
            p = lp.flatten_param
            d.update(axis=p.axis, end_axis=p.end_axis)
        elif lp.type in ("IntelPack", "IntelUnpack", "Split", "Sigmoid", "TanH"):
            pass
        else:
            raise _refused(lp, "no PyTorch translation for this type")
        layers.append(d)
    return {"name": net_param.name, "inputs": inputs, "layers": layers}


def _normalization(lo):
    from caffepy.proto import caffe_pb2
    names = caffe_pb2.LossParameter.NormalizationMode
    if not lo.HasField("normalization") and lo.HasField("normalize"):
        return "VALID" if lo.normalize else "BATCH_SIZE"
    return names.Name(lo.normalization)


def _refused(lp, why):
    return ValueError(f"torch_net: layer '{lp.name}' ({lp.type}): {why}")


# ---------------------------------------------------------------------------------------------
# spec -> torch.nn.Module (torch side)

def _ops():
    """The layer modules; defined on first use so that importing this file needs no torch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Conv(nn.Module):
        def __init__(self, d, shapes):
            super().__init__()
            c = shapes[0][1]
            self.conv = nn.Conv2d(c, d["num_output"], d["kernel"], d["stride"], d["pad"],
                                  d["dilation"], d["group"], d["bias"], device="meta")

        def forward(self, x):
            return [self.conv(x)]

        def flops(self, shapes):
            n, _, h, w = shapes[0]
            return 2 * n * h * w * self.conv.weight.numel()

    class InnerProduct(nn.Module):
        def __init__(self, d, shapes):
            super().__init__()
            self.axis = d["axis"] % len(shapes[0])
            fan_in = math.prod(shapes[0][self.axis:])
            self.fc = nn.Linear(fan_in, d["num_output"], d["bias"], device="meta")

        def forward(self, x):
            return [self.fc(x.flatten(self.axis))]

        def flops(self, shapes):
            return 2 * math.prod(shapes[0][:-1]) * self.fc.weight.numel()

    class Pool(nn.Module):
        def __init__(self, d, shapes):
            super().__init__()
            self.d = d

        def forward(self, x):
            d = self.d
            k, s, p = (x.shape[2:] if d["kernel"] is None else d["kernel"]), d["stride"], d["pad"]
            if d["pool"] == "MAX":
                return [F.max_pool2d(x, k, s, p, ceil_mode=d["ceil"])]
            return [F.avg_pool2d(x, k, s, p, ceil_mode=d["ceil"],
                                 count_include_pad=d["include_pad"])]

    class ReLU(nn.Module):
        def __init__(self, d, shapes):
            super().__init__()
            self.slope, self.inplace = d["slope"], d["bottom"] == d["top"]

        def forward(self, x):
            if self.slope:
                return [F.leaky_relu(x, self.slope, inplace=self.inplace)]
            return [F.relu(x, inplace=self.inplace)]

    class Fn(nn.Module):
        """A layer without parameters: fn(d, *bottoms) -> tops."""
        def __init__(self, fn, d):
            super().__init__()
            self.fn, self.d = fn, d

        def forward(self, *xs):
            return self.fn(self.d, self.training, *xs)

    class BatchNorm(nn.Module):
        def __init__(self, d, shapes):
            super().__init__()
            c = shapes[0][1]
            self.d = d
            self.register_buffer("mean", torch.zeros(c, device="meta"))
            self.register_buffer("var", torch.ones(c, device="meta"))

        def forward(self, x):
            d = self.d
            return [F.batch_norm(x, self.mean, self.var, training=not d["global_stats"],
                                 momentum=1 - d["fraction"], eps=d["eps"])]

    class Scale(nn.Module):
        def __init__(self, d, shapes):
            super().__init__()
            c = shapes[0][1]
            self.weight = nn.Parameter(torch.ones(c, device="meta"))
            self.bias = nn.Parameter(torch.zeros(c, device="meta")) if d["bias"] else None

        def forward(self, x):
            shape = (1, -1) + (1,) * (x.dim() - 2)
            y = x * self.weight.view(shape)
            return [y if self.bias is None else y + self.bias.view(shape)]

    def lrn(d, training, x):
        return [F.local_response_norm(x, d["size"], d["alpha"], d["beta"], d["k"])]

    def dropout(d, training, x):
        return [F.dropout(x, d["ratio"], training)]

    def concat(d, training, *xs):
        return [torch.cat(xs, d["axis"])]

    def eltwise(d, training, *xs):
        if d["op"] == "PROD":
            return [math.prod(xs[1:], start=xs[0])]
        if d["op"] == "MAX":
            y = xs[0]
            for x in xs[1:]:
                y = torch.maximum(y, x)
            return [y]
        coeff = d["coeff"] or [1.0] * len(xs)
        y = xs[0] if coeff[0] == 1 else coeff[0] * xs[0]
        for c, x in zip(coeff[1:], xs[1:]):
            y = y + x if c == 1 else y + c * x
        return [y]

    def softmax(d, training, x):
        return [F.softmax(x, d["axis"])]

    def softmax_loss(d, training, x, label):
        axis = d["axis"] % x.dim()
        if axis != 1:
            x = x.movedim(axis, 1)
        label = label.reshape(x.shape[0], *x.shape[2:]).long()
        ignore = -100 if d["ignore"] is None else d["ignore"]
        total = F.cross_entropy(x, label, ignore_index=ignore, reduction="sum")
        mode = d["normalization"]
        if mode == "VALID":
            count = (label != ignore).sum().clamp(min=1) if d["ignore"] is not None else label.numel()
            return [total / count]
        return [total / {"FULL": label.numel(), "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]]

    def flatten(d, training, x):
        return [x.flatten(d["axis"], d["end_axis"])]

    def identity(d, training, x):
        return [x] * len(d["top"])

    with_params = {"Convolution": Conv, "InnerProduct": InnerProduct, "Pooling": Pool,
                   "ReLU": ReLU, "BatchNorm": BatchNorm, "Scale": Scale}
    functions = {"LRN": lrn, "Dropout": dropout, "Concat": concat, "Eltwise": eltwise,
                 "Softmax": softmax, "SoftmaxWithLoss": softmax_loss, "Flatten": flatten,
                 "Sigmoid": lambda d, t, x: [torch.sigmoid(x)], "TanH": lambda d, t, x: [torch.tanh(x)],
                 "IntelPack": identity, "IntelUnpack": identity, "Split": identity}

    def make(d, shapes):
        if d["type"] in with_params:
            return with_params[d["type"]](d, shapes)
        return Fn(functions[d["type"]], d)
    return make


def _key(name):
    return name.replace(".", "_")


def _net_class():
    import torch
    from torch import nn
    make = _ops()

    class TorchNet(nn.Module):
        """The layers of `spec` over a dict of named blobs; forward returns (weighted loss sum,
        blobs). `flops` and `shapes` come from the meta-device pass that sized the layers."""

        def __init__(self, spec):
            super().__init__()
            self.spec = spec
            self.layers = nn.ModuleDict()
            shapes = {name: tuple(shape) for name, shape in spec["inputs"].items()}
            needs_grad = {name: False for name in spec["inputs"]}
            self.flops = 0
            for d in spec["layers"]:
                bottoms = [shapes[b] for b in d["bottom"]]
                module = make(d, bottoms)
                self.layers[_key(d["name"])] = module
                with torch.no_grad():
                    tops = module(*[torch.empty(s, device="meta") for s in bottoms])
                grad_in = any(needs_grad[b] for b in d["bottom"])
                if hasattr(module, "flops"):
                    self.flops += module.flops([tuple(t.shape) for t in tops]) * (2 + grad_in)
                learns = any(p.requires_grad for p in module.parameters())
                for name, t in zip(d["top"], tops):
                    shapes[name] = tuple(t.shape)
                    needs_grad[name] = grad_in or learns
            self.shapes = shapes
            self.to_empty(device="cpu")
            self._init_weights()

        def _init_weights(self):
            with torch.no_grad():
                for module in self.modules():
                    for name, p in module.named_parameters(recurse=False):
                        if isinstance(module, (nn.Conv2d, nn.Linear)) and name == "weight":
                            p.normal_(0, (1.0 / (p.numel() / p.shape[0])) ** 0.5)
                        elif name == "weight":
                            p.fill_(1)
                        else:
                            p.zero_()
                    for name, b in module.named_buffers(recurse=False):
                        b.fill_(1 if name == "var" else 0)

        def forward(self, inputs):
            blobs = dict(inputs)
            loss = 0
            for d in self.spec["layers"]:
                tops = self.layers[_key(d["name"])](*[blobs[b] for b in d["bottom"]])
                for i, (name, t) in enumerate(zip(d["top"], tops)):
                    blobs[name] = t
                    weight = d["loss_weight"][i] if i < len(d["loss_weight"]) else (
                        1.0 if i == 0 and d["type"] in LOSS_TYPES else 0.0)
                    if weight:
                        loss = loss + weight * t
            return loss, blobs
    return TorchNet


def TorchNet(spec):  # noqa: N802  (reads as the class it builds)
    return _net_class()(spec)


def copy_caffepy_weights(model, net):
    """Copy a caffepy Net's learned blobs (and BatchNorm statistics) into `model`."""
    import numpy as np
    import torch
    with torch.no_grad():
        for d in model.spec["layers"]:
            if d["name"] not in net.params:
                continue
            blobs = [np.asarray(b.data) for b in net.params[d["name"]]]
            module = model.layers[_key(d["name"])]
            if d["type"] == "Convolution":
                targets = [module.conv.weight, module.conv.bias]
            elif d["type"] == "InnerProduct":
                if d["transpose"]:
                    blobs[0] = blobs[0].T
                targets = [module.fc.weight, module.fc.bias]
            elif d["type"] == "Scale":
                targets = [module.weight, module.bias]
            elif d["type"] == "BatchNorm":
                factor = float(blobs[2].reshape(-1)[0])
                scale = 0.0 if factor == 0 else 1.0 / factor
                blobs = [blobs[0] * scale, blobs[1] * scale]
                targets = [module.mean, module.var]
            else:
                raise ValueError(f"copy_caffepy_weights: layer '{d['name']}' ({d['type']}) has "
                                 f"blobs and no known mapping")
            for target, blob in zip(targets, blobs):
                if target is not None:
                    target.copy_(torch.from_numpy(np.ascontiguousarray(blob)).reshape(target.shape))


def param_grads(model):
    """{(layer name, blob index): gradient array} in caffepy's blob order."""
    out = {}
    for d in model.spec["layers"]:
        module = model.layers[_key(d["name"])]
        if d["type"] == "Convolution":
            params = [module.conv.weight, module.conv.bias]
        elif d["type"] == "InnerProduct":
            params = [module.fc.weight, module.fc.bias]
        elif d["type"] == "Scale":
            params = [module.weight, module.bias]
        else:
            continue
        for i, p in enumerate(params):
            if p is not None and p.grad is not None:
                g = p.grad.numpy()
                out[(d["name"], i)] = g.T if d["type"] == "InnerProduct" and d["transpose"] and i == 0 else g
    return out
