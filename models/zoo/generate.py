"""Write the deploy prototxts of models/zoo/ from the published architectures, with caffepy's
NetSpec.

    .venv/bin/python models/zoo/generate.py            # rewrites models/zoo/*.prototxt

The published Caffe files are not shipped here; each net is rebuilt from its published structure,
with the layer names of the released Caffe models (BVLC GoogLeNet, the MSRA ResNet-50 release,
VGG's VGG_ILSVRC_16_layers, shicai's MobileNet-Caffe; ResNeXt-50 takes the ResNet-50 names).
Deploy files start with an Input layer of 10 x 3 x 224 x 224, as the released deploy files do,
and end in Softmax "prob". All carry weight fillers (xavier, or msra for the BatchNorm nets; the
released ResNet deploy files have none), so a net built without a .caffemodel computes something.
Deviations: MobileNet's classifier "fc7" is an InnerProduct (the release has a 1x1 convolution,
same weights) so that its output is [N, 1000]; googlenet_train.prototxt is the train_val net
(auxiliary heads loss1 / loss2 with loss weight 0.3, top-1 / top-5 accuracies in TEST) with its
Data layers swapped for Input layers "data" and "label" (batch 32).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from google.protobuf import text_format  # noqa: E402

from caffepy import NetSpec, layers as L, params as P  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402

XAVIER = dict(type="xavier")
MSRA = dict(type="msra")
CONST = dict(type="constant", value=0.0)
CONV_PARAMS = [dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)]


def input_layer(n, batch=10, size=224):
    n.data = L.Input(shape=dict(dim=[batch, 3, size, size]))


def conv(bottom, num_output, kernel, stride=1, pad=0, group=1, bias=True, filler=XAVIER, bias_value=0.0):
    kwargs = dict(num_output=num_output, kernel_size=kernel, weight_filler=filler)
    if stride != 1:
        kwargs["stride"] = stride
    if pad:
        kwargs["pad"] = pad
    if group != 1:
        kwargs["group"] = group
    if bias:
        kwargs["bias_filler"] = dict(type="constant", value=bias_value)
        kwargs["param"] = CONV_PARAMS
    else:
        kwargs["bias_term"] = False
        kwargs["param"] = [dict(lr_mult=1, decay_mult=1)]
    return L.Convolution(bottom, **kwargs)


def fc(bottom, num_output, filler=XAVIER, bias_value=0.0):
    return L.InnerProduct(bottom, num_output=num_output, weight_filler=filler,
                          bias_filler=dict(type="constant", value=bias_value), param=CONV_PARAMS)


def max_pool(bottom, kernel, stride, pad=0):
    kwargs = dict(pool=P.Pooling.MAX, kernel_size=kernel, stride=stride)
    if pad:
        kwargs["pad"] = pad
    return L.Pooling(bottom, **kwargs)


def relu(bottom):
    return L.ReLU(bottom, in_place=True)


# -- VGG-16 (VGG_ILSVRC_16_layers_deploy) ---------------------------------------------------
def vgg16():
    n = NetSpec()
    input_layer(n)
    x = n.data
    for stage, (width, depth) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)], 1):
        for i in range(1, depth + 1):
            n[f"conv{stage}_{i}"] = conv(x, width, 3, pad=1)
            n[f"relu{stage}_{i}"] = relu(n[f"conv{stage}_{i}"])
            x = n[f"relu{stage}_{i}"]
        n[f"pool{stage}"] = max_pool(x, 2, 2)
        x = n[f"pool{stage}"]
    for k in (6, 7):
        n[f"fc{k}"] = fc(x, 4096)
        n[f"relu{k}"] = relu(n[f"fc{k}"])
        n[f"drop{k}"] = L.Dropout(n[f"relu{k}"], dropout_ratio=0.5, in_place=True)
        x = n[f"drop{k}"]
    n.fc8 = fc(x, 1000)
    n.prob = L.Softmax(n.fc8)
    return n.to_proto(), "VGG_ILSVRC_16_layers"


# -- GoogLeNet (bvlc_googlenet) -------------------------------------------------------------
INCEPTIONS = [  # name, #1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj (Szegedy et al., table 1)
    ("3a", 64, 96, 128, 16, 32, 32), ("3b", 128, 128, 192, 32, 96, 64),
    ("4a", 192, 96, 208, 16, 48, 64), ("4b", 160, 112, 224, 24, 64, 64),
    ("4c", 128, 128, 256, 24, 64, 64), ("4d", 112, 144, 288, 32, 64, 64),
    ("4e", 256, 160, 320, 32, 128, 128), ("5a", 256, 160, 320, 32, 128, 128),
    ("5b", 384, 192, 384, 48, 128, 128),
]


def _named_conv(n, name, bottom, num_output, kernel, relu_name, **kw):
    n[name] = conv(bottom, num_output, kernel, bias_value=0.2, **kw)
    n[relu_name] = relu(n[name])
    return n[relu_name]


def inception(n, bottom, name, c1, c3r, c3, c5r, c5, cp):
    p = f"inception_{name}"
    b1 = _named_conv(n, f"{p}/1x1", bottom, c1, 1, f"{p}/relu_1x1")
    r3 = _named_conv(n, f"{p}/3x3_reduce", bottom, c3r, 1, f"{p}/relu_3x3_reduce")
    b3 = _named_conv(n, f"{p}/3x3", r3, c3, 3, f"{p}/relu_3x3", pad=1)
    r5 = _named_conv(n, f"{p}/5x5_reduce", bottom, c5r, 1, f"{p}/relu_5x5_reduce")
    b5 = _named_conv(n, f"{p}/5x5", r5, c5, 5, f"{p}/relu_5x5", pad=2)
    n[f"{p}/pool"] = max_pool(bottom, 3, 1, pad=1)
    bp = _named_conv(n, f"{p}/pool_proj", n[f"{p}/pool"], cp, 1, f"{p}/relu_pool_proj")
    n[f"{p}/output"] = L.Concat(b1, b3, b5, bp)
    return n[f"{p}/output"]


def aux_head(n, k, bottom, label):
    """loss1 / loss2: the auxiliary classifiers on inception_4a and inception_4d (train only)."""
    p = f"loss{k}"
    n[f"{p}/ave_pool"] = L.Pooling(bottom, pool=P.Pooling.AVE, kernel_size=5, stride=3)
    x = _named_conv(n, f"{p}/conv", n[f"{p}/ave_pool"], 128, 1, f"{p}/relu_conv")
    n[f"{p}/fc"] = fc(x, 1024, bias_value=0.2)
    n[f"{p}/relu_fc"] = relu(n[f"{p}/fc"])
    n[f"{p}/drop_fc"] = L.Dropout(n[f"{p}/relu_fc"], dropout_ratio=0.7, in_place=True)
    n[f"{p}/classifier"] = fc(n[f"{p}/drop_fc"], 1000)
    n[f"{p}/loss1"] = L.SoftmaxWithLoss(n[f"{p}/classifier"], label, loss_weight=0.3, name=f"{p}/loss")
    accuracy(n, p, label)


def accuracy(n, p, label):
    """<p>/top-1 and <p>/top-5, in the TEST phase only (as the train_val file)."""
    test = dict(phase=caffe_pb2.TEST)
    n[f"{p}/top-1"] = L.Accuracy(n[f"{p}/classifier"], label, include=test)
    n[f"{p}/top-5"] = L.Accuracy(n[f"{p}/classifier"], label, top_k=5, include=test)


def googlenet(train=False):
    n = NetSpec()
    input_layer(n, batch=32 if train else 10)
    if train:
        n.label = L.Input(shape=dict(dim=[32]))
    x = _named_conv(n, "conv1/7x7_s2", n.data, 64, 7, "conv1/relu_7x7", stride=2, pad=3)
    n["pool1/3x3_s2"] = max_pool(x, 3, 2)
    n["pool1/norm1"] = L.LRN(n["pool1/3x3_s2"], local_size=5, alpha=1e-4, beta=0.75)
    x = _named_conv(n, "conv2/3x3_reduce", n["pool1/norm1"], 64, 1, "conv2/relu_3x3_reduce")
    x = _named_conv(n, "conv2/3x3", x, 192, 3, "conv2/relu_3x3", pad=1)
    n["conv2/norm2"] = L.LRN(x, local_size=5, alpha=1e-4, beta=0.75)
    x = n["pool2/3x3_s2"] = max_pool(n["conv2/norm2"], 3, 2)
    for spec in INCEPTIONS:
        x = inception(n, x, *spec)
        if train and spec[0] in ("4a", "4d"):
            aux_head(n, 1 if spec[0] == "4a" else 2, x, n.label)
        if spec[0] in ("3b", "4e"):
            pool = "pool3/3x3_s2" if spec[0] == "3b" else "pool4/3x3_s2"
            x = n[pool] = max_pool(x, 3, 2)
    n["pool5/7x7_s1"] = L.Pooling(x, pool=P.Pooling.AVE, kernel_size=7, stride=1)
    n["pool5/drop_7x7_s1"] = L.Dropout(n["pool5/7x7_s1"], dropout_ratio=0.4, in_place=True)
    n["loss3/classifier"] = fc(n["pool5/drop_7x7_s1"], 1000)
    if train:
        n["loss3/loss3"] = L.SoftmaxWithLoss(n["loss3/classifier"], n.label, loss_weight=1)
        accuracy(n, "loss3", n.label)
        return n.to_proto(), "GoogleNet"
    n.prob = L.Softmax(n["loss3/classifier"])
    return n.to_proto(), "GoogleNet"


# -- ResNet-50 (MSRA release) and ResNeXt-50 (32x4d) ----------------------------------------
def bn_scale(n, bottom, bn_name, scale_name):
    """BatchNorm + Scale in place, as the MSRA release: global statistics in deploy."""
    n[bn_name] = L.BatchNorm(bottom, use_global_stats=True, in_place=True)
    n[scale_name] = L.Scale(n[bn_name], bias_term=True, in_place=True)
    return n[scale_name]


def _conv_bn(n, bottom, conv_name, suffix, num_output, kernel, stride=1, pad=0, group=1, relu_name=None):
    n[conv_name] = conv(bottom, num_output, kernel, stride, pad, group, bias=False, filler=MSRA)
    x = bn_scale(n, n[conv_name], f"bn{suffix}", f"scale{suffix}")
    if relu_name:
        n[relu_name] = relu(x)
        x = n[relu_name]
    return x


def bottleneck(n, bottom, name, mid, out, stride, project, group=1):
    """res<name>: 1x1 mid -> 3x3 mid -> 1x1 out, plus the shortcut (a 1x1 projection in the first
    block of a stage). ResNet-50 strides in branch2a (the MSRA release), ResNeXt in the 3x3."""
    if project:
        shortcut = _conv_bn(n, bottom, f"res{name}_branch1", f"{name}_branch1", out, 1, stride)
    else:
        shortcut = bottom
    s2a, s2b = (stride, 1) if group == 1 else (1, stride)
    x = _conv_bn(n, bottom, f"res{name}_branch2a", f"{name}_branch2a", mid, 1, s2a,
                 relu_name=f"res{name}_branch2a_relu")
    x = _conv_bn(n, x, f"res{name}_branch2b", f"{name}_branch2b", mid, 3, s2b, pad=1, group=group,
                 relu_name=f"res{name}_branch2b_relu")
    x = _conv_bn(n, x, f"res{name}_branch2c", f"{name}_branch2c", out, 1)
    n[f"res{name}"] = L.Eltwise(shortcut, x, operation=P.Eltwise.SUM)
    n[f"res{name}_relu"] = relu(n[f"res{name}"])
    return n[f"res{name}_relu"]


def resnet50(cardinality=1, width=64):
    """ResNet-50 (cardinality 1, bottleneck width 64) or ResNeXt-50 (32, 4: 32 x 4d)."""
    n = NetSpec()
    input_layer(n)
    x = _conv_bn(n, n.data, "conv1", "_conv1", 64, 7, 2, 3, relu_name="conv1_relu")
    n.pool1 = max_pool(x, 3, 2)
    x = n.pool1
    for stage, blocks in zip((2, 3, 4, 5), (3, 4, 6, 3)):
        scale = 2 ** (stage - 2)
        mid = cardinality * width * scale
        out = 256 * scale
        for b in range(blocks):
            letter = "abcdef"[b]
            stride = 2 if (b == 0 and stage > 2) else 1
            x = bottleneck(n, x, f"{stage}{letter}", mid, out, stride, b == 0, cardinality)
    n.pool5 = L.Pooling(x, pool=P.Pooling.AVE, kernel_size=7, stride=1)
    n.fc1000 = fc(n.pool5, 1000, filler=MSRA)
    n.prob = L.Softmax(n.fc1000)
    return n.to_proto(), "ResNet-50" if cardinality == 1 else "ResNeXt-50-32x4d"


# -- MobileNet v1 (MobileNet-Caffe naming) ---------------------------------------------------
MOBILENET = [  # name, output channels, stride of the depthwise conv
    ("2_1", 64, 1), ("2_2", 128, 2), ("3_1", 128, 1), ("3_2", 256, 2), ("4_1", 256, 1),
    ("4_2", 512, 2), ("5_1", 512, 1), ("5_2", 512, 1), ("5_3", 512, 1), ("5_4", 512, 1),
    ("5_5", 512, 1), ("5_6", 1024, 2), ("6", 1024, 1),
]


def mobilenet():
    n = NetSpec()
    input_layer(n)
    n.conv1 = conv(n.data, 32, 3, 2, 1, bias=False, filler=MSRA)
    x = bn_scale(n, n.conv1, "conv1/bn", "conv1/scale")
    n.relu1 = relu(x)
    x, channels = n.relu1, 32
    for name, out, stride in MOBILENET:
        dw = f"conv{name}/dw"
        n[dw] = conv(x, channels, 3, stride, 1, group=channels, bias=False, filler=MSRA)
        x = bn_scale(n, n[dw], f"{dw}/bn", f"{dw}/scale")
        n[f"relu{name}/dw"] = relu(x)
        sep = f"conv{name}/sep"
        n[sep] = conv(n[f"relu{name}/dw"], out, 1, bias=False, filler=MSRA)
        x = bn_scale(n, n[sep], f"{sep}/bn", f"{sep}/scale")
        n[f"relu{name}/sep"] = relu(x)
        x, channels = n[f"relu{name}/sep"], out
    n.pool6 = L.Pooling(x, pool=P.Pooling.AVE, global_pooling=True)
    n.fc7 = fc(n.pool6, 1000, filler=MSRA)
    n.prob = L.Softmax(n.fc7)
    return n.to_proto(), "MOBILENET"


NETS = {
    "vgg16_deploy.prototxt": vgg16,
    "googlenet_deploy.prototxt": googlenet,
    "googlenet_train.prototxt": lambda: googlenet(train=True),
    "resnet50_deploy.prototxt": resnet50,
    "resnext50_32x4d_deploy.prototxt": lambda: resnet50(cardinality=32, width=4),
    "mobilenet_v1_deploy.prototxt": mobilenet,
}


def build(filename):
    net, name = NETS[filename]()
    net.name = name
    return net


def main(out_dir=HERE):
    for filename in NETS:
        net = build(filename)
        header = "# generated by models/zoo/generate.py; do not edit\n"
        with open(os.path.join(out_dir, filename), "w") as f:
            f.write(header + text_format.MessageToString(net))
        print(f"{filename}: {len(net.layer)} layers")


if __name__ == "__main__":
    main(*sys.argv[1:])
