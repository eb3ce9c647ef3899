"""caffepy as a drop-in for pycaffe: the calls of an ordinary pycaffe script, run unchanged
after `import caffepy as caffe`."""
import numpy as np
import pytest

import caffepy as caffe

DEPLOY = """
name: "tiny"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "double" type: "Python" bottom: "conv1" top: "double"
  python_param { module: "pycaffe_api_layers" layer: "Scaled" param_str: "2.0" } }
layer { name: "pool1" type: "Pooling" bottom: "double" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""

LAYER_MODULE = '''
import caffepy as caffe


class Scaled(caffe.Layer):
    """top = k * bottom, k from param_str (a pycaffe Python layer)."""

    def setup(self, bottom, top):
        self.k = float(self.param_str)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.k * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.k * top[0].diff
'''

TRAIN = """
name: "tiny_train"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 6 } shape { dim: 4 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


@pytest.fixture
def files(tmp_path, monkeypatch):
    (tmp_path / "pycaffe_api_layers.py").write_text(LAYER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    deploy = tmp_path / "deploy.prototxt"
    deploy.write_text(DEPLOY)
    (tmp_path / "train.prototxt").write_text(TRAIN)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{tmp_path / "train.prototxt"}"\nbase_lr: 0.5\nlr_policy: "fixed"\n'
                      f'max_iter: 100\nmomentum: 0\nweight_decay: 0\ndisplay: 0\nsnapshot: 0\n'
                      f'snapshot_prefix: "{tmp_path / "snap"}"\nsolver_mode: CPU\n')
    caffe.set_mode_cpu()
    caffe.set_random_seed(1)
    return tmp_path, str(deploy), str(solver)


def test_net_construction_forms_and_introspection(files):
    tmp, deploy, _ = files
    net = caffe.Net(deploy, caffe.TEST)
    assert net.inputs == ["data"] and net.outputs == ["prob"]
    assert list(net.blobs) == ["data", "conv1", "double", "pool1", "fc", "prob"]
    assert list(net.params) == ["conv1", "fc"]
    w, b = net.params["conv1"]
    assert w.data.shape == (4, 3, 3, 3) and b.data.shape == (4,)
    assert np.allclose(b.data, 0.1)
    assert [layer.type for layer in net.layers] == ["Input", "Convolution", "ReLU", "Python", "Pooling",
                                                    "InnerProduct", "Softmax"]
    assert len(net.layers[1].blobs) == 2 and net.layers[1].blobs[0] is w
    assert list(net.layer_dict) == ["data", "conv1", "relu1", "double", "pool1", "fc", "prob"]
    assert net.layer_dict["fc"].type == "InnerProduct"
    assert net.top_names["relu1"] == ["conv1"] and net.bottom_names["fc"] == ["pool1"]
    assert net.blobs["data"].num == 2 and net.blobs["data"].channels == 3

    net.save(str(tmp / "w.caffemodel"))
    # the pycaffe forms: positional (file, weights, phase), keywords, phase then weights
    for other in (caffe.Net(deploy, str(tmp / "w.caffemodel"), caffe.TEST),
                  caffe.Net(network_file=deploy, weights=str(tmp / "w.caffemodel"), phase=caffe.TEST),
                  caffe.Net(deploy, caffe.TEST, weights=str(tmp / "w.caffemodel"))):
        for name in net.params:
            for mine, theirs in zip(net.params[name], other.params[name]):
                np.testing.assert_array_equal(mine.data, theirs.data)
    fresh = caffe.Net(deploy, caffe.TEST)
    assert not np.array_equal(fresh.params["fc"][0].data, net.params["fc"][0].data)
    fresh.copy_from(str(tmp / "w.caffemodel"))
    np.testing.assert_array_equal(fresh.params["fc"][0].data, net.params["fc"][0].data)


def reference_forward(net, x):
    w, b = (p.data.astype(np.float64) for p in net.params["conv1"])
    conv = np.zeros((x.shape[0], 4, 6, 6))
    for i in range(3):
        for j in range(3):
            conv += np.einsum("nchw,oc->nohw", x[:, :, i:i + 6, j:j + 6], w[:, :, i, j])
    conv = 2 * np.maximum(conv + b[None, :, None, None], 0)
    pool = conv.reshape(x.shape[0], 4, 3, 2, 3, 2).max(axis=(3, 5))
    fw, fb = (p.data.astype(np.float64) for p in net.params["fc"])
    fc = pool.reshape(x.shape[0], -1) @ fw.T + fb
    e = np.exp(fc - fc.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_forward_backward_and_blob_views(files):
    _, deploy, _ = files
    net = caffe.Net(deploy, caffe.TEST)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    out = net.forward(data=x)
    assert set(out) == {"prob"}
    np.testing.assert_allclose(out["prob"], reference_forward(net, x), rtol=1e-4, atol=1e-6)

    # writing into .data views changes what the net computes
    net.blobs["data"].data[...] = 0
    net.params["conv1"][1].data[...] = 0
    out = net.forward()
    np.testing.assert_allclose(out["prob"], reference_forward(net, np.zeros_like(x)), rtol=1e-5)
    assert np.all(net.blobs["conv1"].data == 0)

    # partial forward: start / end by layer name, extra blobs on request
    net.blobs["data"].data[...] = x
    out = net.forward(end="double")
    assert set(out) == {"double"}
    net.blobs["double"].data[...] = 1
    out = net.forward(start="pool1", blobs=["pool1"])
    assert set(out) == {"prob", "pool1"} and np.all(out["pool1"] == 1)

    # backward with a diff on the output: the input diff through softmax, fc, pool, x2, relu, conv
    net.params["conv1"][1].data[...] = 0.1
    net.forward(data=x)
    grads = net.backward(prob=np.eye(2, 5, dtype=np.float32))
    assert set(grads) == {"data"}
    h = 1e-2
    x64 = x.astype(np.float64)
    for idx in [(0, 1, 3, 4), (1, 2, 5, 5)]:
        xp, xm = x64.copy(), x64.copy()
        xp[idx] += h
        xm[idx] -= h
        n = idx[0]
        numeric = (reference_forward(net, xp)[n, n] - reference_forward(net, xm)[n, n]) / (2 * h)
        assert grads["data"][idx] == pytest.approx(numeric, rel=2e-2, abs=1e-4)
    assert grads["data"] is net.blobs["data"].diff
    # the same gradient when the diff is written into the output blob's .diff view
    expected = grads["data"].copy()
    net.blobs["data"].diff[...] = 0
    net.blobs["prob"].diff[...] = np.eye(2, 5, dtype=np.float32)
    np.testing.assert_array_equal(net.backward()["data"], expected)
    assert np.abs(net.params["conv1"][0].diff).sum() > 0


def test_reshape_after_changing_the_input_blob(files):
    _, deploy, _ = files
    net = caffe.Net(deploy, caffe.TEST)
    net.blobs["data"].reshape(5, 3, 8, 8)
    net.reshape()
    assert net.blobs["prob"].data.shape == (5, 5)
    x = np.random.default_rng(1).standard_normal((5, 3, 8, 8)).astype(np.float32)
    prob = net.forward(data=x)["prob"]
    np.testing.assert_allclose(prob, reference_forward(net, x), rtol=1e-4, atol=1e-6)
    # a new spatial size changes fc's input size: refused, as Caffe does
    net.blobs["data"].reshape(1, 3, 10, 10)
    with pytest.raises(caffe.errors.ShapeError, match="layer 'fc' \\(InnerProduct\\)"):
        net.reshape()


def test_io_transformer_and_blobproto(files):
    _, deploy, _ = files
    net = caffe.Net(deploy, caffe.TEST)
    image = np.random.default_rng(2).uniform(0, 1, (8, 8, 3)).astype(np.float32)   # H x W x C, RGB
    mean = np.array([104.0, 117.0, 123.0], np.float32)
    t = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", mean)
    x = t.preprocess("data", image)
    expected = image.transpose(2, 0, 1)[::-1] * 255 - mean[:, None, None]
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-4)
    net.blobs["data"].data[...] = x
    net.forward()
    np.testing.assert_allclose(t.deprocess("data", net.blobs["data"].data[0]), image, atol=1e-5)

    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    proto = caffe.io.array_to_blobproto(array)
    assert isinstance(proto, caffe.proto.caffe_pb2.BlobProto)
    assert list(proto.shape.dim) == [2, 3, 4]
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(proto), array)
    param = caffe.proto.caffe_pb2.NetParameter()
    param.name = "x"
    assert param.IsInitialized()


def test_python_layer_backward_and_learnable_blobs(files):
    _, deploy, _ = files
    net = caffe.Net(deploy, caffe.TEST)
    layer = net.layer_dict["double"]
    assert isinstance(layer, caffe.Layer) and layer.param_str == "2.0" and layer.k == 2.0
    net.forward(data=np.ones((2, 3, 8, 8), np.float32))
    np.testing.assert_allclose(net.blobs["double"].data, 2 * net.blobs["conv1"].data)


def test_get_solver_and_step_lower_the_loss(files):
    _, _, solver_path = files
    solver = caffe.get_solver(solver_path)
    assert isinstance(solver, caffe.SGDSolver)       # the type the file names, as pycaffe
    net = solver.net
    assert "loss" in net.outputs
    first = float(net.forward()["loss"])
    w0 = net.params["fc"][0].data.copy()
    solver.step(20)
    assert solver.iter == 20
    assert not np.array_equal(net.params["fc"][0].data, w0)
    # every sample has label 1: the trained layer puts it first
    assert float(net.forward()["loss"]) < first / 2
    solver2 = caffe.SGDSolver(solver_path)
    solver2.net.copy_from_param(net.to_proto())
    np.testing.assert_array_equal(solver2.net.params["fc"][0].data, net.params["fc"][0].data)
