"""The nets `make bench` trains, as TRAIN-phase NetParameters every framework reads alike.

    train_net("resnet50", 16)      # NetParameter: Input data + label, the net, its losses

Each net starts from its prototxt in this repository (models/intel_alexnet, models/zoo) or, for
BVLC's two small examples, from their published structure rebuilt here with NetSpec (LeNet of
examples/mnist, cifar10_quick of examples/cifar10). What changes for training, the same for
caffepy, BVLC Caffe and the PyTorch translation (benchmarks/torch_net.py):
  - the data comes from Input layers `data` and `label` of the net's batch (so no framework
    spends time in a data layer; the harness fills `data` with Gaussian noise once);
  - a deploy net's final Softmax becomes SoftmaxWithLoss on `label`;
  - BatchNorm's `use_global_stats` is cleared, so it normalizes by batch statistics (Caffe's
    TRAIN default);
  - TEST-only layers (Accuracy) are dropped; `plain()` drops IntelPack / IntelUnpack.
`force_caffe()` is the one place that asks caffepy for Caffe's own algorithms.
"""
import os

from google.protobuf import text_format

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(REPO, "models")


def _read(path):
    from caffepy import upgrade
    return upgrade.read_net(os.path.join(MODELS, path))


def lenet():
    """BVLC's examples/mnist LeNet: 1 x 28 x 28 in, 10 classes."""
    from caffepy import NetSpec, layers as L, params as P
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[64, 1, 28, 28]))
    xavier, const = dict(type="xavier"), dict(type="constant")
    lr = [dict(lr_mult=1), dict(lr_mult=2)]
    n.conv1 = L.Convolution(n.data, num_output=20, kernel_size=5, stride=1, param=lr,
                            weight_filler=xavier, bias_filler=const)
    n.pool1 = L.Pooling(n.conv1, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.conv2 = L.Convolution(n.pool1, num_output=50, kernel_size=5, stride=1, param=lr,
                            weight_filler=xavier, bias_filler=const)
    n.pool2 = L.Pooling(n.conv2, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, param=lr, weight_filler=xavier,
                           bias_filler=const)
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=10, param=lr, weight_filler=xavier,
                           bias_filler=const)
    n.prob = L.Softmax(n.ip2)
    param = n.to_proto()
    param.name = "LeNet"
    return param


def cifar10_quick():
    """BVLC's examples/cifar10 cifar10_quick: 3 x 32 x 32 in, 10 classes."""
    from caffepy import NetSpec, layers as L, params as P
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[100, 3, 32, 32]))
    lr = [dict(lr_mult=1), dict(lr_mult=2)]
    const = dict(type="constant")

    def conv(bottom, out, std):
        return L.Convolution(bottom, num_output=out, pad=2, kernel_size=5, stride=1, param=lr,
                             weight_filler=dict(type="gaussian", std=std), bias_filler=const)

    def fc(bottom, out):
        return L.InnerProduct(bottom, num_output=out, param=lr,
                              weight_filler=dict(type="gaussian", std=0.1), bias_filler=const)
    n.conv1 = conv(n.data, 32, 0.0001)
    n.pool1 = L.Pooling(n.conv1, pool=P.Pooling.MAX, kernel_size=3, stride=2)
    n.relu1 = L.ReLU(n.pool1, in_place=True)
    n.conv2 = conv(n.relu1, 32, 0.01)
    n.relu2 = L.ReLU(n.conv2, in_place=True)
    n.pool2 = L.Pooling(n.relu2, pool=P.Pooling.AVE, kernel_size=3, stride=2)
    n.conv3 = conv(n.pool2, 64, 0.01)
    n.relu3 = L.ReLU(n.conv3, in_place=True)
    n.pool3 = L.Pooling(n.relu3, pool=P.Pooling.AVE, kernel_size=3, stride=2)
    n.ip1 = fc(n.pool3, 64)
    n.ip2 = fc(n.ip1, 10)
    n.prob = L.Softmax(n.ip2)
    param = n.to_proto()
    param.name = "CIFAR10_quick"
    return param


# name: (title, source: a models/ path or a builder, default batch)
NETS = {
    "alexnet_intel": ("AlexNet, models/intel_alexnet", "intel_alexnet/train_val.prototxt", 64),
    "alexnet": ("AlexNet, plain NCHW", "intel_alexnet/train_val.prototxt", 64),
    "resnet50": ("ResNet-50, models/zoo", "zoo/resnet50_deploy.prototxt", 16),
    "googlenet": ("GoogLeNet (aux. heads), models/zoo", "zoo/googlenet_train.prototxt", 16),
    "vgg16": ("VGG-16, models/zoo", "zoo/vgg16_deploy.prototxt", 16),
    "mobilenet": ("MobileNet v1, models/zoo", "zoo/mobilenet_v1_deploy.prototxt", 16),
    "lenet": ("LeNet (BVLC mnist)", lenet, 64),
    "cifar10_quick": ("cifar10_quick (BVLC)", cifar10_quick, 100),
}


def source_net(name):
    """The net as its file (or builder) gives it."""
    source = NETS[name][1]
    return source() if callable(source) else _read(source)


def train_net(name, batch=None):
    """The TRAIN-phase net `name` with Input `data` / `label` of `batch` images (see above)."""
    from caffepy.net import filter_net, net_state
    from caffepy.proto import caffe_pb2

    batch = batch or NETS[name][2]
    src = filter_net(source_net(name), net_state(caffe_pb2.TRAIN))
    out = caffe_pb2.NetParameter()
    out.name = src.name
    out.state.phase = caffe_pb2.TRAIN
    data_shape = None
    for lp in src.layer:
        if lp.type in ("Data", "Input") and "data" in lp.top:
            data_shape = _data_shape(lp)
    data_shape[0] = batch
    _input(out, "data", data_shape)
    _input(out, "label", [batch])
    has_loss = any(lp.type.endswith("Loss") for lp in src.layer)
    for lp in src.layer:
        if lp.type in ("Data", "Input"):
            continue
        new = out.layer.add()
        new.CopyFrom(lp)
        if lp.type == "BatchNorm":
            new.batch_norm_param.ClearField("use_global_stats")
        if lp.type == "Softmax" and not has_loss:
            new.type, new.name = "SoftmaxWithLoss", "loss"
            new.bottom.append("label")
            new.top[0] = "loss"
    if name == "alexnet":
        out = plain(out)
    return out


# the deploy net of each (the TEST phase as a user deploys it): models/ path, or None for the
# TRAIN source filtered to TEST
DEPLOY = {
    "alexnet": "intel_alexnet/deploy.prototxt",
    "resnet50": "zoo/resnet50_deploy.prototxt",
    "googlenet": "zoo/googlenet_deploy.prototxt",
    "vgg16": "zoo/vgg16_deploy.prototxt",
    "mobilenet": "zoo/mobilenet_v1_deploy.prototxt",
}


def test_net(name, batch):
    """The deploy net `name` in its TEST phase with an Input `data` of `batch` images; AlexNet
    as BVLC's deploy net (models/intel_alexnet's without IntelPack / IntelUnpack)."""
    from caffepy.net import filter_net, net_state
    from caffepy.proto import caffe_pb2
    out = filter_net(_read(DEPLOY[name]), net_state(caffe_pb2.TEST))
    for lp in out.layer:
        if lp.type == "Input" and "data" in lp.top:
            lp.input_param.shape[0].dim[0] = batch
    return plain(out) if name == "alexnet" else out


def _data_shape(lp):
    if lp.type == "Input":
        return list(lp.input_param.shape[0].dim)
    crop = lp.transform_param.crop_size   # a Data layer: the crop of models/intel_alexnet
    return [lp.data_param.batch_size, 3, crop, crop]


def _input(net, top, shape):
    lp = net.layer.add(name=top, type="Input", top=[top])
    lp.input_param.shape.add(dim=shape)


def plain(net):
    """`net` without IntelPack / IntelUnpack (their readers take the NCHW blob)."""
    from caffepy.proto import caffe_pb2
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    renamed = {}
    for lp in net.layer:
        if lp.type in ("IntelPack", "IntelUnpack"):
            renamed[lp.top[0]] = renamed.get(lp.bottom[0], lp.bottom[0])
            continue
        new = out.layer.add()
        new.CopyFrom(lp)
        for i, b in enumerate(new.bottom):
            new.bottom[i] = renamed.get(b, b)
    return out


# The layer parameter messages that carry Caffe's `engine` enum (CAFFE = 1)
_ENGINE_PARAMS = ("convolution_param", "pooling_param", "lrn_param", "relu_param",
                  "sigmoid_param", "tanh_param", "softmax_param")


def force_caffe(net):
    """`net` asking for Caffe's own algorithms: `engine: CAFFE` in every layer parameter that
    has Caffe's engine enum (what turns off Winograd on the blocked path), and Intel's
    net-wide `engine: "CAFFE"`."""
    from caffepy.proto import caffe_pb2
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    out.engine = "CAFFE"
    for lp in out.layer:
        for field in _ENGINE_PARAMS:
            if lp.HasField(field) or _type_param(lp.type) == field:
                getattr(lp, field).engine = caffe_pb2.ConvolutionParameter.CAFFE
    return out


def _type_param(type_):
    return {"Convolution": "convolution_param", "Pooling": "pooling_param", "LRN": "lrn_param",
            "ReLU": "relu_param", "Sigmoid": "sigmoid_param", "TanH": "tanh_param",
            "Softmax": "softmax_param", "SoftmaxWithLoss": "softmax_param"}.get(type_)


def to_text(net):
    return text_format.MessageToString(net)


def training_flops(net):
    """(direct, executed) FLOPs of one forward-backward of a built caffepy Net.

    direct: 2 x the multiply-adds of every Convolution and InnerProduct forward, counted as a
    direct convolution, again for the weight gradient, and again for the bottom gradient where
    the bottom needs one (not the first convolution's: its bottom is the data). executed: the
    same, except that a pass a Convolution runs by Winograd (its `pass_tiles`, blocked or
    channels-last) counts the multiply-adds its a x a GEMMs over tiles really do (the tile
    transforms not counted)."""
    direct = executed = 0
    for i, layer in enumerate(net.layers):
        if layer.type not in ("Convolution", "InnerProduct"):
            continue
        need_bottom = bool(net.bottom_need_backward[i][0])
        fwd = layer_flops(layer.type, net.top_vecs[i][0].shape, layer.blobs[0].count)
        direct += fwd * (2 + need_bottom)

        def run(m):
            """A pass's multiply-adds x 2 with Winograd tile m (None: as direct)."""
            if m is None:
                return fwd
            r, top = layer.blobs[0].shape[-1], net.top_vecs[i][0].shape
            tiles = top[0] * -(-layer.oh // m) * -(-layer.ow // m)
            return 2 * (m + r - 1) ** 2 * tiles * layer.blobs[0].count // (r * r)
        by_pass = getattr(layer, "pass_tiles", {})
        executed += run(by_pass.get("forward")) + run(by_pass.get("weights")) + \
            (run(by_pass.get("data")) if need_bottom else 0)
    return direct, executed


def layer_flops(type_, top_shape, weight_count):
    """2 x multiply-adds of one Convolution or InnerProduct forward, from its NCHW shapes (a
    blocked top [N, C/V, H, W, V] has its spatial size at 2, 3 too)."""
    if type_ == "InnerProduct":
        # weight_count = outputs x inputs; every item of the batch (all axes before `axis`)
        rows = 1
        for d in top_shape[:-1]:
            rows *= d
        return 2 * rows * weight_count
    return 2 * top_shape[0] * top_shape[2] * top_shape[3] * weight_count
