"""pycaffe's Net helpers: forward_all / forward_backward_all (batching with a padded last
batch), share_with (Caffe's ShareTrainedLayersWith), save_hdf5 / load_hdf5 (Caffe's
`data/<layer>/<i>` layout), and has_nccl."""
import builtins

import numpy as np
import pytest
from google.protobuf import text_format

import caffepy as caffe
from caffepy.errors import CaffepyError, ShapeError
from caffepy.proto import caffe_pb2


def net_param(text):
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return p


def ip_net(batch=4, extra=""):
    """data (batch x 3) -> ip (2 outputs, random weights) -> sig (Sigmoid); force_backward."""
    return net_param(f"""
        name: "ipnet" force_backward: true
        layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {batch} dim: 3 }} }} }}
        layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
          inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 1 }}
                                bias_filler {{ type: "gaussian" std: 1 }} }} }}
        layer {{ name: "sig" type: "Sigmoid" bottom: "ip" top: "sig" }}
        {extra}""")


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("n", [10, 8, 3])     # a padded last batch, whole batches, one short batch
def test_forward_all_batches_pads_and_trims(n):
    caffe.set_random_seed(3)
    net = caffe.Net(ip_net(batch=4), caffe.TEST)
    w, b = (p.data.copy() for p in net.params["ip"])
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    out = net.forward_all(data=x, blobs=["ip"])
    assert sorted(out) == ["ip", "sig"]
    assert out["ip"].shape == (n, 2) and out["sig"].shape == (n, 2)
    np.testing.assert_allclose(out["ip"], x @ w.T + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["sig"], sigmoid(x @ w.T + b), rtol=1e-5, atol=1e-6)
    # results are copies, not views of the net's blobs
    net.forward(data=np.zeros((4, 3), np.float32))
    np.testing.assert_allclose(out["ip"], x @ w.T + b, rtol=1e-5, atol=1e-6)


def test_forward_all_pads_the_last_batch_with_zeros():
    caffe.set_random_seed(3)
    net = caffe.Net(ip_net(batch=4), caffe.TEST)
    x = np.ones((5, 3), np.float32)
    net.forward_all(data=x)
    # the last batch ran item 4 and three rows of zero padding
    np.testing.assert_array_equal(net.blobs["data"].data, [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_forward_all_refuses_arrays_of_different_lengths():
    net = caffe.Net(net_param("""
        layer { name: "a" type: "Input" top: "a" top: "b"
                input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 3 } } }
        layer { name: "s" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }"""), caffe.TEST)
    out = net.forward_all(a=np.ones((3, 3)), b=np.full((3, 3), 2.0))
    np.testing.assert_array_equal(out["s"], np.full((3, 3), 3.0))
    with pytest.raises(ShapeError, match="different numbers of items: a 3, b 4"):
        net.forward_all(a=np.ones((3, 3)), b=np.ones((4, 3)))


def test_forward_backward_all_returns_outputs_and_input_diffs():
    caffe.set_random_seed(5)
    net = caffe.Net(ip_net(batch=4), caffe.TEST)
    w, b = (p.data.copy() for p in net.params["ip"])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 3)).astype(np.float32)
    g = rng.normal(size=(7, 2)).astype(np.float32)
    outs, diffs = net.forward_backward_all(data=x, sig=g, blobs=["ip"], diffs=["ip"])
    y = sigmoid(x @ w.T + b)
    assert outs["sig"].shape == (7, 2) and diffs["data"].shape == (7, 3) and diffs["ip"].shape == (7, 2)
    np.testing.assert_allclose(outs["sig"], y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs["ip"], x @ w.T + b, rtol=1e-5, atol=1e-6)
    dip = g * y * (1 - y)
    np.testing.assert_allclose(diffs["ip"], dip, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(diffs["data"], dip @ w, rtol=1e-4, atol=1e-6)
    with pytest.raises(CaffepyError, match="'ip' is neither a net input"):
        net.forward_backward_all(data=x, ip=g)


def test_share_with_makes_two_nets_see_one_set_of_weights():
    caffe.set_random_seed(1)
    train = caffe.Net(ip_net(batch=4), caffe.TRAIN)
    caffe.set_random_seed(2)
    test = caffe.Net(ip_net(batch=2), caffe.TEST)
    assert not np.array_equal(test.params["ip"][0].data, train.params["ip"][0].data)
    test.share_with(train)
    np.testing.assert_array_equal(test.params["ip"][0].data, train.params["ip"][0].data)
    train.params["ip"][0].data[...] = 0.5          # an update in the source shows in the other net
    train.params["ip"][1].data[...] = -1
    out = test.forward(data=np.ones((2, 3), np.float32))
    np.testing.assert_allclose(out["sig"], sigmoid(np.full((2, 2), 0.5)), rtol=1e-6)
    # gradients stay apart (Caffe shares data only)
    assert test.params["ip"][0].diff is not train.params["ip"][0].diff


def test_share_with_ignores_extra_layers_and_refuses_mismatched_shapes():
    caffe.set_random_seed(1)
    extra = ('layer { name: "ip2" type: "InnerProduct" bottom: "sig" top: "ip2" '
             'inner_product_param { num_output: 1 } }')
    source = caffe.Net(ip_net(extra=extra), caffe.TEST)
    target = caffe.Net(ip_net(), caffe.TEST)
    target.share_with(source)                  # 'ip2' is not in the target: ignored
    np.testing.assert_array_equal(target.params["ip"][0].data, source.params["ip"][0].data)
    other = caffe.Net(net_param("""
        layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 5 } } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
        """), caffe.TEST)
    with pytest.raises(ShapeError, match=r"layer 'ip' \(InnerProduct\): blobs\[0\]: cannot share weights of "
                                         r"shape 2 3 \(6\), this net's are 2 5 \(10\)"):
        other.share_with(source)


def test_has_nccl_is_false_on_a_cpu_build():
    assert caffe.has_nccl() is False


# -- HDF5 -------------------------------------------------------------------------

SHARED = """
name: "shared"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
  param { name: "w" } param { name: "b1" }
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 }
                        bias_filler { type: "gaussian" std: 1 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "data" top: "ip2"
  param { name: "w" }
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 }
                        bias_filler { type: "gaussian" std: 1 } } }
layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "ip2" top: "sum" }
"""


def test_save_hdf5_writes_caffes_layout(tmp_path):
    h5py = pytest.importorskip("h5py")
    caffe.set_random_seed(4)
    net = caffe.Net(net_param(SHARED), caffe.TEST)
    assert [l.type for l in net.layers] == ["Input", "Split", "InnerProduct", "InnerProduct", "Eltwise"]
    path = str(tmp_path / "w.h5")
    net.save_hdf5(path)
    with h5py.File(path, "r") as f:
        assert list(f) == ["data"]
        # a group per layer, the Split layer and layers without parameters included
        assert sorted(f["data"]) == sorted(["data", "data_data_0_split", "ip1", "ip2", "sum"])
        assert list(f["data/data"]) == [] and list(f["data/sum"]) == []
        assert sorted(f["data/ip1"]) == ["0", "1"]
        # ip2 borrows 'w' from ip1: only its own bias is written
        assert list(f["data/ip2"]) == ["1"]
        assert f["data/ip1/0"].dtype == np.float32 and f["data/ip1/0"].shape == (3, 3)
        np.testing.assert_array_equal(f["data/ip1/0"][()], net.params["ip1"][0].data)
        np.testing.assert_array_equal(f["data/ip2/1"][()], net.params["ip2"][1].data)
    net.params["ip1"][0].diff[...] = 7
    net.save_hdf5(path, write_diff=True)
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["data", "diff"]
        assert sorted(f["diff/ip2"]) == ["0", "1"]       # diffs of borrowed parameters too
        np.testing.assert_array_equal(f["diff/ip2/0"][()], np.full((3, 3), 7, np.float32))


def test_load_hdf5_round_trip_and_errors(tmp_path):
    h5py = pytest.importorskip("h5py")
    caffe.set_random_seed(4)
    net = caffe.Net(net_param(SHARED), caffe.TEST)
    path = str(tmp_path / "w.h5")
    net.save_hdf5(path)
    caffe.set_random_seed(9)
    fresh = caffe.Net(net_param(SHARED), caffe.TEST)
    assert not np.array_equal(fresh.params["ip1"][0].data, net.params["ip1"][0].data)
    fresh.load_hdf5(path)
    for name in ("ip1", "ip2"):
        for mine, theirs in zip(fresh.params[name], net.params[name]):
            np.testing.assert_array_equal(mine.data, theirs.data)
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    np.testing.assert_array_equal(fresh.forward(data=x)["sum"], net.forward(data=x)["sum"])

    # a layer the net does not have is ignored; a missing own parameter or a wrong shape is an error
    with h5py.File(path, "a") as f:
        f.create_group("data/unknown_layer").create_dataset("0", data=np.zeros(2, np.float32))
    fresh.load_hdf5(path)
    with h5py.File(path, "a") as f:
        del f["data/ip2/1"]
    with pytest.raises(ShapeError, match=r"w.h5: layer 'ip2' \(InnerProduct\): dataset '1' is missing"):
        fresh.load_hdf5(path)
    with h5py.File(path, "a") as f:
        f["data/ip2"].create_dataset("1", data=np.zeros(4, np.float32))
    with pytest.raises(ShapeError, match=r"blobs\[1\]: shape mismatch: file has \(4,\), net has \(3,\)"):
        fresh.load_hdf5(path)
    (tmp_path / "not.h5").write_text("hello")
    with pytest.raises(CaffepyError, match="not.h5: not an HDF5 file"):
        fresh.load_hdf5(str(tmp_path / "not.h5"))


def test_hdf5_without_h5py_says_what_to_install(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_h5py(name, *args, **kwargs):
        if name == "h5py":
            raise ImportError("No module named 'h5py'")
        return real_import(name, *args, **kwargs)

    net = caffe.Net(ip_net(), caffe.TEST)
    monkeypatch.setattr(builtins, "__import__", no_h5py)
    with pytest.raises(CaffepyError, match=r"w.h5: save_hdf5: needs h5py, which is not installed. "
                                           r"Install it with: pip install h5py \(or pip install 'caffepy\[hdf5\]'\)"):
        net.save_hdf5(str(tmp_path / "w.h5"))
