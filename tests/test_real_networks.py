"""Real networks at their published sizes build, run forward and backward, and stay finite.

BVLC's LeNet, CIFAR-10 quick/full, AlexNet and CaffeNet come from /work/shared/reference-models
(train nets with their Data layers swapped for Input layers), and every other train net there
runs one step at batch 1; GoogLeNet, ResNet-50, VGG-16,
ResNeXt-50 and MobileNet v1 are the deploy files of models/zoo (models/zoo/generate.py), run
with force_backward and a gradient set on "prob". Known facts are checked too: parameter counts
and the [N, 1000] output.
"""
import importlib.util
import os

import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng, upgrade
from caffepy.net import TEST, TRAIN, Net, filter_net, net_state
from caffepy.proto import caffe_pb2

from paths import REFERENCE_MODELS, REPO
ZOO = os.path.join(REPO, "models", "zoo")
BVLC = os.path.join(REFERENCE_MODELS, "bvlc")


def bvlc(name):
    path = os.path.join(BVLC, name)
    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this machine")
    return path


def swap_data_layers(path, data_shape):
    """The TRAIN net of a train_val prototxt, its Data layer replaced by Input 'data' and 'label'."""
    param = filter_net(upgrade.read_net(path), net_state(TRAIN), path)
    out = caffe_pb2.NetParameter()
    out.name = param.name
    for lp in param.layer:
        if lp.type == "Data":
            for top, shape in zip(lp.top, (data_shape, data_shape[:1])):
                text_format.Parse(f'name: "{top}" type: "Input" top: "{top}" '
                                  f'input_param {{ shape {{ {" ".join(f"dim: {d}" for d in shape)} }} }}',
                                  out.layer.add())
        else:
            out.layer.add().CopyFrom(lp)
    return out


def param_count(net):
    return sum(b.count for blobs in net.params.values() for b in blobs)


def assert_all_finite(net):
    for name, blob in net.blobs.items():
        assert np.isfinite(blob.data).all(), f"blob '{name}' data is not finite"
        if blob.has_diff:
            assert np.isfinite(blob.diff).all(), f"blob '{name}' diff is not finite"
    for name, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            assert np.isfinite(blob.data).all(), f"param {name}[{i}] is not finite"
            if blob.has_diff:
                assert np.isfinite(blob.diff).all(), f"param {name}[{i}] diff is not finite"


# -- BVLC train nets: Input instead of Data, a real loss, forward and backward -------------------
TRAIN_NETS = [
    pytest.param("mnist__lenet_train_test.prototxt", (2, 1, 28, 28), 431080, id="lenet"),
    pytest.param("cifar10__cifar10_quick_train_test.prototxt", (2, 3, 32, 32), 145578, id="cifar10_quick"),
    pytest.param("cifar10__cifar10_full_train_test.prototxt", (2, 3, 32, 32), 89578, id="cifar10_full"),
    pytest.param("bvlc_alexnet__train_val.prototxt", (1, 3, 227, 227), 60965224, id="alexnet"),
    pytest.param("bvlc_reference_caffenet__train_val.prototxt", (1, 3, 227, 227), 60965224, id="caffenet"),
]


@pytest.mark.parametrize("name, shape, n_params", TRAIN_NETS)
def test_bvlc_train_net_forward_backward(name, shape, n_params):
    rng.seed(7)
    net = Net(swap_data_layers(bvlc(name), shape), TRAIN)
    assert param_count(net) == n_params
    net.blobs["data"].data[...] = np.random.default_rng(0).uniform(0, 255 / 256, shape)
    net.blobs["label"].data[...] = np.arange(shape[0]) % 10
    loss = net.forward_backward()
    assert np.isfinite(loss) and loss > 0
    assert_all_finite(net)
    # every learnable blob got a gradient, and the first conv's is not zero
    first = next(iter(net.params.values()))
    assert np.abs(first[0].diff).sum() > 0
    assert all(b.has_diff for b in net.learnable_params)


def _reference_train_nets():
    """Every train net among the reference models (not the solvers, not the deploy nets)."""
    if not os.path.isdir(REFERENCE_MODELS):
        return [pytest.param("", marks=pytest.mark.skip(reason="no ../shared/reference-models"))]
    return [os.path.join(d, f) for d in ("bvlc", "intel")
            for f in sorted(os.listdir(os.path.join(REFERENCE_MODELS, d)))
            if f.endswith(".prototxt") and "solver" not in f and "deploy" not in f
            and f not in ("cifar10__cifar10_quick.prototxt", "mnist__lenet.prototxt")]  # deploy nets


@pytest.mark.parametrize("name", _reference_train_nets())
def test_every_reference_train_net_trains_one_step_at_batch_one(name):
    """Users bring these files: each TRAIN net builds as written (its data layers swapped for
    Input, or its DummyData cut to batch 1), runs forward and backward, and stays finite."""
    rng.seed(3)
    path = os.path.join(REFERENCE_MODELS, name)
    shape = (1, 1, 28, 28) if "mnist" in name else (1, 3, 32, 32) if "cifar" in name else (1, 3, 227, 227)
    param = swap_data_layers(path, shape)
    for lp in param.layer:
        for s in lp.dummy_data_param.shape:
            s.dim[0] = 1
    net = Net(param, TRAIN)
    for blob_name, value in (("data", np.random.default_rng(0).uniform(0, 1, shape)), ("label", 0)):
        if getattr(net.layer_dict.get(blob_name), "type", None) == "Input":
            net.blobs[blob_name].data[...] = value
    loss = net.forward_backward()
    assert np.isfinite(loss) and loss != 0
    assert_all_finite(net)
    assert all(np.abs(b.diff).sum() > 0 for b in net.learnable_params[:1])


@pytest.mark.parametrize("name, n_params, size", [
    ("bvlc_alexnet__deploy.prototxt", 60965224, 227),
    ("bvlc_reference_caffenet__deploy.prototxt", 60965224, 227),
    ("mnist__lenet.prototxt", 431080, 28),
    ("cifar10__cifar10_quick.prototxt", 145578, 32),
])
def test_bvlc_deploy_nets_shape_and_size(name, n_params, size):
    param = upgrade.read_net(bvlc(name))
    net = Net(param, TEST)
    assert param_count(net) == n_params
    assert net.blobs["data"].shape[2:] == (size, size)
    out = net.blobs[net.outputs[0]]
    assert out.shape[1:] == ((1000,) if size == 227 else (10,))


# -- the zoo: published architectures, deploy files ---------------------------------------------
def zoo_net(filename, batch, phase=TEST):
    param = upgrade.read_net(os.path.join(ZOO, filename))
    param.force_backward = True
    param.layer[0].input_param.shape[0].dim[0] = batch
    rng.seed(3)
    return Net(param, phase)


def calibrate(net, data):
    """Give every BatchNorm the statistics of its input (what a trained model's look like):
    with the fresh blobs (factor 0: mean 0, variance 0) each one would scale by 1/sqrt(eps)."""
    net.blobs["data"].data[...] = data
    for li, layer in enumerate(net.layers):
        if layer.type == "BatchNorm":
            x = net.bottom_vecs[li][0].data.astype(np.float64)
            layer.blobs[0].data[...] = x.mean(axis=(0, 2, 3))
            layer.blobs[1].data[...] = x.var(axis=(0, 2, 3))
            layer.blobs[2].data[...] = 1
        net.forward_from_to(li, li)


def run_zoo(net, batch):
    data = np.random.default_rng(1).standard_normal(net.blobs["data"].shape).astype(np.float32)
    calibrate(net, data)           # a whole forward pass, layer by layer
    prob = net.blobs["prob"].data
    assert prob.shape == (batch, 1000)
    assert np.isfinite(prob).all()
    np.testing.assert_allclose(prob.sum(axis=1), 1, rtol=1e-4)
    # any gradient on the probabilities: (random init saturates the softmax, so not -1/p)
    diff = np.random.default_rng(2).standard_normal(prob.shape).astype(np.float32)
    grads = net.backward(prob=diff)
    assert np.isfinite(grads["data"]).all() and np.abs(grads["data"]).sum() > 0
    assert_all_finite(net)
    for name, layer in net.layer_dict.items():
        if layer.blobs and layer.type != "BatchNorm":   # statistics get no gradient
            assert np.abs(layer.blobs[0].diff).sum() > 0, f"no gradient for {name}"


ZOO_NETS = [  # file, published size (Caffe's count: BatchNorm statistics included) and tolerance,
    #            exact count of the learned weights (without BatchNorm statistics)
    ("resnet50_deploy.prototxt", 25.5e6, 0.01, 25557032),
    ("googlenet_deploy.prototxt", 7.0e6, 0.01, 6998552),
    ("mobilenet_v1_deploy.prototxt", 4.2e6, 0.02, 4231976),
    ("resnext50_32x4d_deploy.prototxt", 25.0e6, 0.01, 25028904),
    # VGG-16 forward + backward: 12 s on an idle machine, over 20 s under load
    pytest.param("vgg16_deploy.prototxt", 138.36e6, 0.001, 138357544, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("filename, n_params, tol, n_weights", ZOO_NETS)
def test_zoo_net_forward_backward(filename, n_params, tol, n_weights):
    net = zoo_net(filename, batch=1)
    assert param_count(net) == pytest.approx(n_params, rel=tol)
    stats = sum(b.count for layer in net.layers if layer.type == "BatchNorm" for b in layer.blobs)
    assert param_count(net) - stats == n_weights
    assert net.blobs["data"].shape == (1, 3, 224, 224)
    run_zoo(net, 1)


def test_vgg16_builds_at_its_published_size():
    """VGG-16 without running it (forward and backward are marked slow): 138.36M parameters."""
    net = zoo_net("vgg16_deploy.prototxt", batch=2)
    assert param_count(net) == 138357544
    assert net.blobs["pool5"].shape == (2, 512, 7, 7)
    assert net.blobs["prob"].shape == (2, 1000)


def test_googlenet_train_with_auxiliary_heads():
    """The train_val GoogLeNet: two auxiliary classifiers (loss weight 0.3) and the main one."""
    param = upgrade.read_net(os.path.join(ZOO, "googlenet_train.prototxt"))
    for lp in param.layer[:2]:
        lp.input_param.shape[0].dim[0] = 2
    rng.seed(5)
    net = Net(param, TRAIN)
    losses = [n for n, w in net.blob_loss_weights.items() if w]
    assert sorted(losses) == ["loss1/loss1", "loss2/loss1", "loss3/loss3"]
    assert net.blob_loss_weights["loss1/loss1"] == pytest.approx(0.3)
    assert "loss1/loss" in net.layer_dict and "loss1/top-1" not in net.layer_dict
    assert net.blobs["loss1/ave_pool"].shape == (2, 512, 4, 4)
    assert net.blobs["loss2/ave_pool"].shape == (2, 528, 4, 4)
    assert sum(1 for layer in net.layers if layer.type == "LRN") == 2
    net.blobs["data"].data[...] = np.random.default_rng(2).standard_normal((2, 3, 224, 224))
    net.blobs["label"].data[...] = [3, 999]
    loss = net.forward_backward()
    # three softmax losses over 1000 classes near chance: about (0.3 + 0.3 + 1) * ln(1000)
    assert np.isfinite(loss) and 0.5 * 1.6 * np.log(1000) < loss < 2 * 1.6 * np.log(1000)
    assert_all_finite(net)
    assert np.abs(net.params["loss1/conv"][0].diff).sum() > 0


def test_zoo_structure_facts():
    """Layer names and wiring as the released models have them."""
    resnet = upgrade.read_net(os.path.join(ZOO, "resnet50_deploy.prototxt"))
    names = [lp.name for lp in resnet.layer]
    for name in ("conv1", "bn_conv1", "scale_conv1", "pool1", "res2a_branch1", "bn2a_branch2a",
                 "scale5c_branch2c", "res5c", "res5c_relu", "pool5", "fc1000", "prob"):
        assert name in names
    types = [lp.type for lp in resnet.layer]
    assert types.count("BatchNorm") == types.count("Scale") == 53
    assert types.count("Eltwise") == 16 and types.count("Convolution") == 53
    resnext = upgrade.read_net(os.path.join(ZOO, "resnext50_32x4d_deploy.prototxt"))
    groups = {lp.name: lp.convolution_param.group for lp in resnext.layer if lp.type == "Convolution"}
    assert groups["res2a_branch2b"] == groups["res5c_branch2b"] == 32
    mobilenet = upgrade.read_net(os.path.join(ZOO, "mobilenet_v1_deploy.prototxt"))
    dw = [lp for lp in mobilenet.layer if lp.name.endswith("/dw") and lp.type == "Convolution"]
    assert len(dw) == 13
    channels = [32, 64, 128, 128, 256, 256] + [512] * 6 + [1024]
    assert [lp.convolution_param.group for lp in dw] == channels
    assert all(lp.convolution_param.num_output == c for lp, c in zip(dw, channels))
    googlenet = upgrade.read_net(os.path.join(ZOO, "googlenet_deploy.prototxt"))
    assert [lp.name for lp in googlenet.layer if lp.type == "Concat"] == \
        [f"inception_{k}/output" for k in ("3a", "3b", "4a", "4b", "4c", "4d", "4e", "5a", "5b")]
    assert not any(lp.name.startswith(("loss1", "loss2")) for lp in googlenet.layer)


def test_zoo_files_are_what_the_generator_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("zoo_generate", os.path.join(ZOO, "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.main(str(tmp_path))
    for filename in generate.NETS:
        with open(os.path.join(ZOO, filename)) as f, open(tmp_path / filename) as g:
            assert f.read() == g.read(), f"models/zoo/{filename} is stale: run models/zoo/generate.py"


def test_googlenet_train_test_phase_has_the_accuracies():
    param = upgrade.read_net(os.path.join(ZOO, "googlenet_train.prototxt"))
    for lp in param.layer[:2]:
        lp.input_param.shape[0].dim[0] = 1
    net = Net(param, TEST)
    assert {"loss1/top-1", "loss1/top-5", "loss2/top-5", "loss3/top-1"} <= set(net.layer_dict)
    assert net.layer_dict["loss3/top-5"].param.accuracy_param.top_k == 5
