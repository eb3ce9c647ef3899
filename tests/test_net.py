"""Net construction and execution semantics, as Caffe's Net::Init defines them."""
import numpy as np
import pytest
from google.protobuf import text_format

import caffepy
from caffepy.blob import Blob
from caffepy.errors import CaffepyError, LayerError, PrototxtError, ShapeError
from caffepy.net import Net, filter_net, insert_splits, net_state
from caffepy.proto import caffe_pb2
from caffepy.upgrade import parse_net_text


def net_param(text):
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return p


INPUT = 'layer { name: "input" type: "Input" top: "data" input_param { shape { dim: 4 dim: 5 } } }\n'
IP = ('layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{top}" {extra}'
      ' inner_product_param {{ num_output: {n} weight_filler {{ type: "gaussian" std: 0.5 }}'
      ' bias_filler {{ type: "gaussian" std: 0.5 }} }} }}\n')


def ip(name, bottom, top, n=3, extra=""):
    return IP.format(name=name, bottom=bottom, top=top, n=n, extra=extra)


def test_split_inserted_where_a_top_feeds_two_layers():
    p = net_param(INPUT + ip("a", "data", "a") + ip("b", "data", "b"))
    out = insert_splits(p)
    names = [l.name for l in out.layer]
    assert names == ["input", "data_input_0_split", "a", "b"]
    split = out.layer[1]
    assert split.type == "Split" and list(split.top) == ["data_input_0_split_0", "data_input_0_split_1"]
    assert list(out.layer[2].bottom) == ["data_input_0_split_0"]
    assert list(out.layer[3].bottom) == ["data_input_0_split_1"]


def test_in_place_chain_needs_no_split():
    p = net_param(INPUT + ip("a", "data", "a")
                  + 'layer { name: "relu" type: "ReLU" bottom: "a" top: "a" }\n' + ip("b", "a", "b"))
    assert [l.type for l in insert_splits(p).layer] == ["Input", "InnerProduct", "ReLU", "InnerProduct"]


def test_unknown_bottom_names_layer_and_blob():
    p = net_param(INPUT + ip("a", "nope", "a"))
    with pytest.raises(LayerError, match=r"layer 'a' \(InnerProduct\).*unknown blob 'nope'"):
        Net(p, caffepy.TEST)


def test_unknown_type_lists_known_types():
    p = net_param(INPUT + 'layer { name: "x" type: "Convolutoin" bottom: "data" top: "x" }')
    with pytest.raises(LayerError, match=r"layer 'x' \(Convolutoin\).*unknown layer type.*Known types: .*InnerProduct"):
        Net(p, caffepy.TEST)


def test_top_produced_twice_is_an_error():
    p = net_param(INPUT + ip("a", "data", "x") + ip("b", "data", "x"))
    with pytest.raises(LayerError, match="produced by more than one layer"):
        Net(p, caffepy.TEST)


def _loss_net(extra_a="", extra_b="", force=False):
    text = INPUT + ip("a", "data", "a", extra=extra_a) + ip("b", "data", "b", extra=extra_b)
    text += 'layer { name: "target" type: "DummyData" top: "t" dummy_data_param { shape { dim: 4 dim: 3 }' \
            ' data_filler { type: "constant" value: 0.3 } } }\n'
    text += 'layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }\n'
    text += 'layer { name: "loss" type: "EuclideanLoss" bottom: "s" bottom: "t" top: "loss" }\n'
    if force:
        text = "force_backward: true\n" + text
    return net_param(text)


def test_backward_through_split_sums_gradients_and_matches_numeric():
    caffepy.set_random_seed(3)
    net = Net(_loss_net(force=True), caffepy.TRAIN)
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    net.blobs["data"].data[...] = x
    net.forward_from_to(1)      # keep our data; DummyData fills the target once
    net.clear_param_diffs()
    net.backward_from_to()
    analytic = net.blobs["data"].diff.copy()

    def loss_at(values):
        net.blobs["data"].data[...] = values
        return net.forward_from_to(1)
    eps = 1e-2
    numeric = np.zeros_like(x, dtype=np.float64)
    for i in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[i] += eps
        minus[i] -= eps
        numeric[i] = (loss_at(plus) - loss_at(minus)) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3, atol=2e-3)


def test_need_backward_follows_lr_mult_and_loss():
    frozen = 'param { lr_mult: 0 } param { lr_mult: 0 }'
    net = Net(_loss_net(extra_a=frozen, extra_b=frozen), caffepy.TRAIN)
    need = dict(zip(net._layer_names, net.layer_need_backward))
    assert not need["a"] and not need["b"] and not need["sum"]
    net = Net(_loss_net(extra_b=frozen), caffepy.TRAIN)
    need = dict(zip(net._layer_names, net.layer_need_backward))
    assert need["a"] and not need["b"] and need["sum"] and need["loss"]


def test_force_backward_reaches_inputs():
    net = Net(_loss_net(), caffepy.TRAIN)
    assert not net.bottom_need_backward[net._layer_names.index("data_input_0_split")][0]
    net = Net(_loss_net(force=True), caffepy.TRAIN)
    assert net.bottom_need_backward[net._layer_names.index("data_input_0_split")][0]


def test_shared_params_are_one_blob_and_one_learnable_param():
    shared = 'param { name: "w" } param { name: "bias" }'
    net = Net(_loss_net(extra_a=shared, extra_b=shared), caffepy.TRAIN)
    assert net.params["a"][0] is net.params["b"][0]
    assert len(net.learnable_params) == 2


def test_shared_param_shape_mismatch_names_the_param():
    text = INPUT + ip("a", "data", "a", n=3, extra='param { name: "w" }') \
        + ip("b", "data", "b", n=4, extra='param { name: "w" }')
    with pytest.raises(ShapeError, match="param 'w'.*shape mismatch"):
        Net(net_param(text), caffepy.TEST)


def test_loss_weight_scales_the_loss():
    base = _loss_net()
    caffepy.set_random_seed(5)
    net1 = Net(base, caffepy.TRAIN)
    loss1 = net1.forward_from_to()
    weighted = caffe_pb2.NetParameter()
    weighted.CopyFrom(base)
    weighted.layer[-1].loss_weight.append(2.5)
    caffepy.set_random_seed(5)
    net2 = Net(weighted, caffepy.TRAIN)
    assert net2.forward_from_to() == pytest.approx(2.5 * loss1, rel=1e-5)


def test_pycaffe_api_forward_outputs_and_save_load(tmp_path):
    text = 'name: "tiny"\n' + INPUT + ip("a", "data", "a")
    prototxt = tmp_path / "tiny.prototxt"
    prototxt.write_text(text)
    net = caffepy.Net(str(prototxt), caffepy.TEST)
    assert net.inputs == ["data"] and net.outputs == ["a"]
    assert list(net.params) == ["a"] and net.params["a"][0].data.shape == (3, 5)
    x = np.ones((4, 5), np.float32)
    out = net.forward(data=x)
    w, b = net.params["a"][0].data, net.params["a"][1].data
    np.testing.assert_allclose(out["a"], x @ w.T + b, rtol=1e-5)
    weights = tmp_path / "tiny.caffemodel"
    net.save(str(weights))
    again = caffepy.Net(str(prototxt), str(weights), caffepy.TEST)
    np.testing.assert_array_equal(again.params["a"][0].data, w)
    keyword = caffepy.Net(str(prototxt), caffepy.TEST, weights=str(weights))
    np.testing.assert_array_equal(keyword.params["a"][1].data, b)
    with pytest.raises(ShapeError, match="not batch sized"):
        net.forward(data=np.ones((2, 5), np.float32))


def test_copy_from_shape_mismatch_names_layer_and_both_shapes(tmp_path):
    small = tmp_path / "small.prototxt"
    small.write_text(INPUT + ip("a", "data", "a", n=3))
    big = tmp_path / "big.prototxt"
    big.write_text(INPUT + ip("a", "data", "a", n=6))
    weights = tmp_path / "small.caffemodel"
    caffepy.Net(str(small), caffepy.TEST).save(str(weights))
    with pytest.raises(ShapeError, match=r"layer 'a' \(InnerProduct\): blobs\[0\].*\(3, 5\).*\(6, 5\)"):
        caffepy.Net(str(big), str(weights), caffepy.TEST)


def test_a_repeated_layer_name_builds_and_its_weights_go_to_the_first_layer(tmp_path, capfd):
    """Caffe builds nets with a repeated layer name (BVLC's mnist_autoencoder has two "loss"
    layers): copying weights by name fills the first layer of that name; pycaffe's layer_dict
    holds the last; HDF5 weights, stored by name, refuse a second weighted layer of a name."""
    prototxt = tmp_path / "twice.prototxt"
    prototxt.write_text(INPUT + ip("a", "data", "a") + ip("a", "a", "b"))
    net = caffepy.Net(str(prototxt), caffepy.TEST)
    assert net._layer_names == ["input", "a", "a"] and net.layer_dict["a"] is net.layers[2]
    assert net.first_layer("a") is net.layers[1] and net.first_layer("nothing") is None
    assert "weights files and shared test nets fill only the first layer" in capfd.readouterr().err
    source = caffe_pb2.NetParameter()
    for shape in ((3, 5), (3, 3)):
        lp = source.layer.add(name="a", type="InnerProduct")
        for dims in (shape, shape[:1]):
            lp.blobs.add().shape.dim.extend(dims)
            lp.blobs[-1].data.extend(np.full(int(np.prod(dims)), 7.0, np.float32))
    first, second = net.layers[1].blobs[0].data.copy(), net.layers[2].blobs[0].data.copy()
    with pytest.raises(ShapeError, match=r"layer 'a'.*blobs\[0\]"):
        net.copy_from_param(source)          # as Caffe, both go to the first 'a' (3 x 5): the second misfits
    del source.layer[1]
    net.copy_from_param(source)
    assert (net.layers[1].blobs[0].data == 7).all()
    np.testing.assert_array_equal(net.layers[2].blobs[0].data, second)
    assert not (first == 7).all()
    pytest.importorskip("h5py")
    with pytest.raises(CaffepyError, match=r"layer 2 'a' \(InnerProduct\) holds weights under the name"):
        net.save_hdf5(str(tmp_path / "twice.h5"))
    assert not (tmp_path / "twice.h5").exists()


def test_a_layer_without_tops_in_the_middle_of_a_net_builds():
    """A sink (Silence, HDF5Output) followed by other layers: the fusion search once indexed
    its missing top and crashed with an IndexError."""
    text = (INPUT + 'layer { name: "quiet" type: "Silence" bottom: "data" }\n'
            + ip("a", "data", "a") + 'layer { name: "r" type: "ReLU" bottom: "a" top: "a" }\n')
    net = Net(net_param(text), caffepy.TEST)
    assert [layer.type for layer in net.layers][-3:] == ["Silence", "InnerProduct", "ReLU"]
    net.blobs["data"].data[...] = 1.0
    net.forward_from_to()
    assert (net.blobs["a"].data >= 0).all()


def test_a_bottom_only_left_out_layers_produce_names_them_and_their_rules():
    text = ('layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 4 dim: 5 } }'
            ' include { phase: TEST stage: "a" } }\n' + ip("b", "data", "b"))
    with pytest.raises(LayerError) as e:
        Net(net_param(text), caffepy.TEST)
    assert ("layer 'b' (InnerProduct): bottom: unknown blob 'data' (bottom index 0): in phase TEST, "
            "level 0, stage none no layer produces it; left out: layer 'in' (Input) with include "
            '{ phase: TEST stage: "a" }') in str(e.value) and "--stage" in str(e.value)
    assert Net(net_param(text), caffepy.TEST, stages=["a"]).blobs["b"].shape == (4, 3)
    with pytest.raises(LayerError, match="no earlier layer produces it"):     # nobody makes it
        Net(net_param(ip("b", "data", "b")), caffepy.TEST)


def test_phase_filtering_drops_layers():
    text = INPUT + ip("a", "data", "a") + ip("b", "data", "b", extra="include { phase: TEST }")
    train = Net(net_param(text), caffepy.TRAIN)
    test = Net(net_param(text), caffepy.TEST)
    assert "b" not in train.layer_dict and "b" in test.layer_dict


def test_missing_phase_is_a_type_error():
    with pytest.raises(TypeError):
        Net(net_param(INPUT))


def test_errors_are_caffepy_errors():
    assert issubclass(ShapeError, CaffepyError)


def test_the_run_context_reaches_every_layer():
    from caffepy.context import RunContext
    context = RunContext(rank=0, size=1, seed=7)
    net = Net(net_param(INPUT + ip("a", "data", "a") + ip("b", "a", "b")), caffepy.TRAIN, context=context)
    assert net.context is context and all(layer.context is context for layer in net.layers)
    assert Net(net_param(INPUT), caffepy.TRAIN).layers[0].context.size == 1


def test_a_distributed_context_gets_the_model_parallel_variant_with_full_weights():
    from caffepy.context import RunContext
    from caffepy.layer import MODEL_PARALLEL, PLAIN
    text = INPUT + ip("a", "data", "a", n=4, extra="multinode { model_parts: 0 }") + ip("b", "a", "b")
    two = RunContext(rank=0, size=2)       # the choice only: nothing runs without a communicator
    net = Net(net_param(text), caffepy.TRAIN, context=two)
    assert [layer.variant for layer in net.layers] == [PLAIN, MODEL_PARALLEL, PLAIN]
    assert all(layer.context is two for layer in net.layers) and net.layer_dict["a"] is net.layers[1]
    assert net.params["a"] is net.layers[1].blobs
    assert net.layers[1].m == 2 and net.layers[1].blobs[0].shape == (4, 5)     # full until split
    alone = Net(net_param(text), caffepy.TRAIN)
    assert [layer.variant for layer in alone.layers] == [PLAIN, PLAIN, PLAIN]


# -- NetState filtering ------------------------------------------------------

FILTER_NET = """
layer { name: "always" }
layer { name: "train" include { phase: TRAIN } }
layer { name: "test" include { phase: TEST } }
layer { name: "not_test" exclude { phase: TEST } }
layer { name: "level2" include { min_level: 2 } }
layer { name: "level_le1" include { max_level: 1 } }
layer { name: "stage_ab" include { stage: "a" stage: "b" } }
layer { name: "stage_a_or_b" include { stage: "a" } include { stage: "b" } }
layer { name: "not_a" include { not_stage: "a" } }
layer { name: "train_lvl3" include { phase: TRAIN min_level: 3 } }
"""


def kept(state):
    net = parse_net_text(FILTER_NET, "f.prototxt")
    return [l.name for l in filter_net(net, state).layer]


def test_filter_by_phase_and_level():
    assert kept(net_state(caffe_pb2.TRAIN)) == ["always", "train", "not_test", "level_le1", "not_a"]
    assert kept(net_state("test", level=2)) == ["always", "test", "level2", "not_a"]
    assert kept(net_state("TRAIN", level=3)) == ["always", "train", "not_test", "level2", "not_a", "train_lvl3"]


def test_filter_by_stage():
    assert kept(net_state("TEST", 1, ["a"])) == ["always", "test", "level_le1", "stage_a_or_b"]
    assert kept(net_state("TEST", 1, ["a", "b"])) == ["always", "test", "level_le1", "stage_ab", "stage_a_or_b"]
    assert kept(net_state("TEST", 1, ["b"])) == ["always", "test", "level_le1", "stage_a_or_b", "not_a"]


def test_filter_uses_the_nets_own_state_by_default():
    net = parse_net_text(FILTER_NET + "state { phase: TRAIN level: 5 }", "f")
    out = filter_net(net)
    assert "train_lvl3" in [l.name for l in out.layer]
    assert out.state.level == 5


def test_include_and_exclude_together_is_an_error():
    net = parse_net_text('layer { name: "d" type: "Data" include { phase: TRAIN } exclude { phase: TEST } }', "x")
    with pytest.raises(PrototxtError, match=r"^net\.prototxt: layer 'd' \(Data\): include, exclude: both given"):
        filter_net(net, net_state("TRAIN"), "net.prototxt")


def test_bad_phase_name():
    with pytest.raises(CaffepyError, match="phase: must be TRAIN or TEST, got val"):
        net_state("val")


def test_weights_filling_some_layers_warn_naming_the_others(tmp_path, capsys):
    from caffepy import log
    old = tmp_path / "old.prototxt"
    old.write_text(INPUT + ip("a", "data", "a") + ip("b", "a", "b"))
    new = tmp_path / "new.prototxt"
    new.write_text(INPUT + ip("a", "data", "a") + ip("b_renamed", "a", "b"))
    weights = tmp_path / "old.caffemodel"
    trained = caffepy.Net(str(old), caffepy.TEST)
    trained.save(str(weights))
    log.set_quiet(True)           # warnings print anyway
    net = caffepy.Net(str(new), str(weights), caffepy.TEST)      # fine-tuning renames layers: allowed
    np.testing.assert_array_equal(net.params["a"][0].data, trained.params["a"][0].data)
    err = capsys.readouterr().err
    assert "old.caffemodel: no weights for layer(s) b_renamed of " in err and "keep their initial values" in err


def test_weights_filling_no_layer_are_refused(tmp_path):
    a = tmp_path / "a.prototxt"
    a.write_text(INPUT + ip("a", "data", "a"))
    b = tmp_path / "b.prototxt"
    b.write_text(INPUT + ip("other", "data", "a"))
    weights = tmp_path / "a.caffemodel"
    caffepy.Net(str(a), caffepy.TEST).save(str(weights))
    with pytest.raises(CaffepyError, match=r"a.caffemodel: no layer of the net got weights from this file: "
                                           r"its layers with weights are a; the net's are other"):
        caffepy.Net(str(b), str(weights), caffepy.TEST)
    (tmp_path / "empty.caffemodel").write_bytes(b"")
    with pytest.raises(CaffepyError, match=r"empty.caffemodel: the file is empty \(0 bytes\)"):
        caffepy.Net(str(a), str(tmp_path / "empty.caffemodel"), caffepy.TEST)


def test_sizes_are_checked_before_allocating(monkeypatch):
    from caffepy import memory
    from caffepy.blob import Blob
    from caffepy.errors import SizeError
    monkeypatch.setattr(memory, "available", lambda: 1 << 30)
    blob = Blob((2, 3), name="x")
    with pytest.raises(SizeError, match=r"blob 'x' \(1000 x 1000 x 1000 floats\) needs 3.7 GiB, more than "
                                        r"the 1.0 GiB of memory available"):
        blob.reshape(1000, 1000, 1000)
    assert blob.shape == (2, 3) and blob.data.shape == (2, 3)      # untouched
    with pytest.raises(SizeError, match="needs 64.0 EiB"):         # 2**64 elements: no 64-bit wraparound
        blob.reshape(2**32, 2**32)
    blob.reshape(100, 100)                                          # within memory: allowed
    text = INPUT + ip("a", "data", "a", n=2_000_000_000)
    with pytest.raises(SizeError, match=r"^net: layer 'a' \(InnerProduct\): inner_product_param.num_output: "
                                        r"blob 'a.0' \(2000000000 x 5 floats\) needs 37.3 GiB.*, got 2000000000$"):
        Net(net_param(text), caffepy.TEST, source="net")


def test_unknown_layer_type_suggests_the_closest():
    with pytest.raises(LayerError, match=r"unknown layer type 'InerProduct'. did you mean 'InnerProduct'\? "
                                         r"Known types: AbsVal, "):
        Net(net_param(INPUT + ip("a", "data", "a").replace("InnerProduct", "InerProduct")), caffepy.TEST)


FAITHFUL_NET = """
name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 5 dim: 5 } shape { dim: 4 }
    data_filler { type: "constant" value: 0.5 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  param { lr_mult: 1 } param { lr_mult: 2 }
  convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "constant" value: 0.1 }
    bias_filler { type: "constant" value: 0.2 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "constant" value: 0.01 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
"""

# The layers of BVLC caffe's snapshot of FAITHFUL_NET (its .caffemodel read back): name, type,
# bottoms, tops, phase, loss_weight, blob shapes.  tests/test_caffe_binary.py compares bytes.
CAFFE_LAYERS = [
    ("data", "DummyData", [], ["data", "label"], caffe_pb2.TRAIN, [], []),
    ("label_data_1_split", "Split", ["label"], ["label_data_1_split_0", "label_data_1_split_1"],
     caffe_pb2.TRAIN, [], []),
    ("conv", "Convolution", ["data"], ["conv"], caffe_pb2.TRAIN, [], [(2, 3, 3, 3), (2,)]),
    ("relu", "ReLU", ["conv"], ["conv"], caffe_pb2.TRAIN, [], []),
    ("ip", "InnerProduct", ["conv"], ["ip"], caffe_pb2.TRAIN, [], [(3, 18), (3,)]),
    ("ip_ip_0_split", "Split", ["ip"], ["ip_ip_0_split_0", "ip_ip_0_split_1"], caffe_pb2.TRAIN, [], []),
    ("loss", "SoftmaxWithLoss", ["ip_ip_0_split_0", "label_data_1_split_0"], ["loss"], caffe_pb2.TRAIN,
     [1.0], []),
    ("acc", "Accuracy", ["ip_ip_0_split_1", "label_data_1_split_1"], ["acc"], caffe_pb2.TRAIN, [], []),
]


def test_to_proto_writes_the_layers_as_caffes_net_to_proto(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(FAITHFUL_NET)
    out = caffepy.Net(str(path), caffepy.TRAIN).to_proto()
    got = [(lp.name, lp.type, list(lp.bottom), list(lp.top), lp.phase, list(lp.loss_weight),
            [tuple(b.shape.dim) for b in lp.blobs]) for lp in out.layer]
    assert got == CAFFE_LAYERS
    assert all(lp.HasField("phase") for lp in out.layer)
    # read back into a net: the Split layers match by name and carry no blobs
    weights = tmp_path / "w.caffemodel"
    caffepy.Net(str(path), caffepy.TRAIN).save(str(weights))
    caffepy.Net(str(path), str(weights), caffepy.TEST)


def test_outputs_are_in_name_order_as_caffes_std_set(tmp_path):
    # the real caffe binary lists FAITHFUL_NET's outputs as acc, loss (loss is defined first)
    path = tmp_path / "net.prototxt"
    path.write_text(FAITHFUL_NET.replace('top: "acc"', 'top: "Zacc"'))
    assert caffepy.Net(str(path), caffepy.TRAIN).outputs == ["Zacc", "loss"]
    path.write_text(FAITHFUL_NET)
    assert caffepy.Net(str(path), caffepy.TRAIN).outputs == ["acc", "loss"]


# A layer whose reshape reads only shapes (Layer.reshape_from_shapes) is reshaped by the forward
# only when its bottoms' or tops' shapes differ from what its last reshape left.
SHAPES_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" } } }
"""


def _count_reshapes(net, monkeypatch):
    calls = {}
    for layer in net.layers:
        def counted(bottom, top, layer=layer, original=layer.reshape):
            calls[layer.name] = calls.get(layer.name, 0) + 1
            return original(bottom, top)
        monkeypatch.setattr(layer, "reshape", counted)
    return calls


def test_a_shapes_only_reshape_runs_when_a_shape_changed(monkeypatch):
    net = Net(net_param(SHAPES_NET), caffepy.TEST)
    assert all(net.layer_dict[n].reshape_from_shapes for n in ("conv", "pool", "ip"))
    assert not net.layer_dict["data"].reshape_from_shapes
    calls = _count_reshapes(net, monkeypatch)
    for _ in range(3):
        net.forward()
    assert calls == {"data": 3, "conv": 1, "pool": 1, "ip": 1}
    # a new batch size reaches every layer, and the numbers are a fresh net's
    x = np.random.default_rng(0).standard_normal((5, 3, 9, 9)).astype(np.float32)
    net.blobs["data"].reshape(*x.shape)
    net.blobs["data"].data[...] = x
    out = net.forward()["ip"].copy()
    assert out.shape == (5, 5) and calls["ip"] == 2
    fresh = Net(net_param(SHAPES_NET.replace("dim: 2", "dim: 5")), caffepy.TEST)
    for name in ("conv", "ip"):
        for mine, theirs in zip(net.params[name], fresh.params[name]):
            theirs.data[...] = mine.data
    fresh.blobs["data"].data[...] = x
    np.testing.assert_allclose(out, fresh.forward()["ip"], rtol=1e-5, atol=1e-6)
    # a top reshaped from outside is reshaped back
    net.blobs["pool"].reshape(1, 1, 1, 1)
    net.forward()
    assert net.blobs["pool"].shape == (5, 4, 4, 4) and calls["pool"] == 3


OWN_BLOBS_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 } } }
layer { name: "scale" type: "Scale" bottom: "data" top: "scaled" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "scaled" top: "scaled" }
layer { name: "prob" type: "Softmax" bottom: "scaled" top: "prob" }
"""


def test_a_reshape_that_reads_its_own_blobs_runs_when_they_change_shape(monkeypatch):
    """Scale's reshape checks its parameters against the bottom: reshaped from outside, the
    next forward refuses them in one line, as it did before the Net skipped reshapes; shapes
    changed elsewhere in the net run no layer's reshape whose own shapes stayed."""
    net = Net(net_param(OWN_BLOBS_NET), caffepy.TEST)
    assert all(net.layer_dict[n].reshape_from_shapes for n in ("scale", "relu", "prob"))
    calls = _count_reshapes(net, monkeypatch)
    for _ in range(3):
        net.forward()
    assert calls == {"data": 3, "scale": 1, "relu": 1, "prob": 1}
    net.params["scale"][0].reshape(7)
    with pytest.raises(ShapeError, match="scale"):
        net.forward()
    net.params["scale"][0].reshape(3)
    net.params["scale"][0].data[...] = 2
    net.params["scale"][1].data[...] = 0
    net.blobs["data"].data[...] = 1
    np.testing.assert_allclose(net.forward()["prob"], 1 / 3, rtol=1e-6)
    assert calls["relu"] == 1 and calls["prob"] == 1
    # a blob outside the layers (one the user made) changing shape reshapes none of them
    Blob((2, 2)).reshape(3, 3)
    net.forward()
    assert calls == {"data": 6, "scale": 2, "relu": 1, "prob": 1}


def test_a_loss_layer_without_a_top_gets_caffes_anonymous_one(tmp_path):
    """Caffe's AutoTopBlobs (BVLC's pascal_finetune example writes SoftmaxWithLoss without a
    top): the anonymous top carries the loss, which the net returns and trains on, but it is
    no output of the net and no layer can read it."""
    labels = ('layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }\n')
    body = INPUT + labels + ip("a", "data", "a")
    named = Net(net_param(body + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "a" '
                                 'bottom: "label" top: "loss" }'), caffepy.TRAIN)
    anonymous = Net(net_param(body + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "a" '
                                     'bottom: "label" }'), caffepy.TRAIN)
    for net in (named, anonymous):
        net.params["a"][0].data[...] = np.arange(15, dtype=np.float32).reshape(3, 5) / 10
        net.params["a"][1].data[...] = 0.5
        net.blobs["data"].data[...] = np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5)
        net.blobs["label"].data[...] = [0, 1, 2, 1]
    loss = named.forward_from_to()
    assert loss > 0 and anonymous.forward_from_to() == loss
    assert anonymous.outputs == [] and anonymous.blob_loss_weights["(automatic)"] == 1
    named.backward_from_to()
    anonymous.backward_from_to()
    np.testing.assert_array_equal(anonymous.params["a"][0].diff, named.params["a"][0].diff)
    assert anonymous.params["a"][0].diff.any()
    with pytest.raises(LayerError, match="unknown blob '\\(automatic\\)'"):
        Net(net_param(body + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "a" bottom: "label" }'
                      'layer { name: "more" type: "Power" bottom: "(automatic)" top: "p" }'), caffepy.TRAIN)


BN_SCALE = """
layer { name: "input" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: %s } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
"""


def _intel_merged_weights(net, with_shift):
    """A caffemodel as Intel's MKL engines write it: the BatchNorm holds mean, variance, factor,
    scale[, shift] and no Scale layer."""
    source = net.to_proto()
    del source.layer[:]
    for name, n in (("conv", 2), ("bn", 3)):
        lp = source.layer.add(name=name, type=net.layer_dict[name].type)
        for i in range(n):
            lp.blobs.add().CopyFrom(caffe_pb2.BlobProto())
            shape = net.layer_dict[name].blobs[i].shape
            lp.blobs[i].shape.dim.extend(shape)
            lp.blobs[i].data.extend(np.arange(1, 1 + int(np.prod(shape)), dtype=np.float32))
    extra = ([2.0, 3.0, 4.0], [0.5, -0.5, 1.5]) if with_shift else ([2.0, 3.0, 4.0],)
    for values in extra:
        b = source.layer[1].blobs.add()
        b.shape.dim.append(3)
        b.data.extend(values)
    return source


@pytest.mark.parametrize("with_shift", [True, False])
def test_intel_batchnorm_with_its_scale_folded_in_loads_into_batchnorm_and_scale(with_shift):
    net = Net(net_param(BN_SCALE % "true"), phase=caffepy.TEST)
    net.copy_from_param(_intel_merged_weights(net, with_shift))
    bn, sc = net.layer_dict["bn"], net.layer_dict["sc"]
    np.testing.assert_array_equal(bn.blobs[2].data, [1.0])
    np.testing.assert_array_equal(bn.blobs[1].data, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(sc.blobs[0].data, [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(sc.blobs[1].data, [0.5, -0.5, 1.5] if with_shift else [0, 0, 0])


def test_intel_merged_batchnorm_without_a_scale_to_take_it_is_one_line():
    text = BN_SCALE.replace('layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" '
                            'scale_param { bias_term: %s } }\n', "")
    net = Net(net_param(text), phase=caffepy.TEST)
    weights = _intel_merged_weights(Net(net_param(BN_SCALE % "true"), phase=caffepy.TEST), True)
    with pytest.raises(ShapeError, match=r"layer 'bn' \(BatchNorm\): blobs: the file has 5 parameter blobs "
                                         r"\(Intel Caffe's BatchNorm with its Scale folded in\).*Put a Scale"):
        net.copy_from_param(weights)
