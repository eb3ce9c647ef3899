"""blob.Writes and blob.Seen, their reference counts taken in C and in Python: a value derived
from a blob's data (packed, folded, quantized weights) is redone whenever the data may have
changed. A blob left alone is neither compared nor copied; any way Python code can write the
floats (through `data`, `raw_data`, a view or buffer held from before, shared data) makes the
next check say changed, or, for a blob held from outside when it was kept, compare it with a
copy, which finds a change."""
import numpy as np
import pytest

from caffepy import blob as blob_module
from caffepy.blob import CHANNELS_LAST, Blob, Seen
from caffepy.kernels import nhwc


@pytest.fixture(autouse=True, params=["C", "Python"])
def counts(request, monkeypatch):
    """Every test with the reference counts taken in C (cext/writes.pyx) and in Python (where
    the kernels are not built): each Writes made in a test is measured and checked one way."""
    if request.param == "Python":
        monkeypatch.setattr(blob_module, "_counts", None)
    else:
        assert blob_module._counts is not None


@pytest.fixture
def compares(monkeypatch):
    """The sizes of the float compares Seen runs."""
    calls = []
    real = nhwc.same_floats
    monkeypatch.setattr(nhwc, "same_floats", lambda a, b: calls.append(a.size) or real(a, b))
    return calls


def _weights(seed=0, shape=(8, 4, 3, 3)):
    b = Blob(shape, "w")
    b.data[...] = np.random.default_rng(seed).standard_normal(shape)
    return b


def _kept(b):
    seen = Seen()
    assert seen.changed(b)
    seen.keep(b)
    return seen


def test_a_blob_left_alone_is_not_compared(compares):
    b = _weights()
    seen = _kept(b)
    for _ in range(3):
        assert not seen.changed(b)
    assert b.read_data.sum() == b.read_data.sum()       # reading does not count as a write
    assert not seen.changed(b)
    assert compares == []


def test_a_blob_nothing_held_keeps_no_copy_and_taking_data_counts_as_a_change(compares):
    b = _weights()
    seen = _kept(b)
    assert seen.kept[0][0] is None          # no copy
    b.data                                  # taken, not written: the value is redone once
    assert seen.changed(b)
    seen.keep(b)
    assert not seen.changed(b) and compares == []
    b.data[2, 1, 0, 0] += 1
    assert seen.changed(b)
    seen.keep(b)
    b.raw_data.reshape(-1)[5] = 7
    assert seen.changed(b)
    seen.keep(b)
    b.set_data(np.zeros(b.shape, np.float32))
    assert seen.changed(b)
    seen.keep(b)
    b.data.flat = np.ones(b.count)
    assert seen.changed(b)


@pytest.mark.parametrize("hold", [
    lambda b: b.data,                                   # the array itself
    lambda b: b.data[3],                                # a view of it
    lambda b: b.data.reshape(-1)[::2],                  # a view of a view
    lambda b: np.frombuffer(memoryview(b.data.reshape(-1)), np.float32),   # its buffer
    lambda b: np.asarray(b.raw_data).T,
])
def test_a_write_through_an_array_held_from_before_is_found(compares, hold):
    b = _weights()
    held = hold(b)
    seen = _kept(b)
    assert seen.kept[0][0] is not None      # held from outside: a copy to compare with
    for _ in range(2):                      # while it is held, every check compares
        assert not seen.changed(b)
    assert len(compares) == 2
    held.flat[0] += 1                       # no blob method runs: only the hold tells
    assert seen.changed(b)
    seen.keep(b)
    del held                                # let go: one more compare, then none
    compares.clear()
    assert not seen.changed(b)
    assert not seen.changed(b)
    assert len(compares) == 1


def test_a_write_through_a_blob_sharing_the_data_is_found(compares):
    train = _weights()
    test = Blob(train.shape, "w_test")
    test.share_data(train)                  # a TEST net's weights seen through the TRAIN net's
    seen = _kept(test)
    arrays = [id(a) for a in train._writes.views]
    test.share_data(train)                  # again (a Split's reshape, every forward): nothing new
    assert [id(a) for a in train._writes.views] == arrays
    assert not seen.changed(test) and compares == []
    train.data[0, 0, 0, 0] -= 1             # the solver's update
    assert seen.changed(test)
    seen.keep(test)
    held = train.data[1]
    assert seen.changed(test)               # taken: redone once, then held: a copy kept
    seen.keep(test)
    assert not seen.changed(test) and compares
    held[...] = 3
    assert seen.changed(test)


def test_reshaping_keeps_the_tracking(compares):
    b = _weights(shape=(2, 3, 4, 5))
    old = b.data
    b.reshape(2, 3, 2, 5)                   # smaller: the same buffer, new arrays
    seen = _kept(b)
    assert not seen.changed(b)              # compared with the copy: the old array holds it
    old.reshape(-1)[0] += 1                 # the array from before the reshape still writes it
    assert seen.changed(b)
    del old
    seen.keep(b)
    b.reshape(4, 8, 4, 5)                   # larger: a new buffer
    seen = _kept(b)
    compares.clear()
    assert not seen.changed(b) and compares == []
    b.layout = CHANNELS_LAST
    seen.keep(b)
    b.data[0, 0, 0, 0] = 9
    assert seen.changed(b)


def test_a_read_only_array_is_known_by_identity_and_a_writable_one_compared(compares):
    folded = np.arange(6, dtype=np.float32)
    folded.flags.writeable = False
    seen = Seen()
    assert seen.changed(folded)
    seen.keep(folded)
    assert not seen.changed(folded) and compares == []
    other = folded.copy()
    other.flags.writeable = False
    assert seen.changed(other)              # another array: changed, whatever it holds
    plain = np.arange(6, dtype=np.float32)
    seen.keep(plain)
    plain[0] = 1
    assert seen.changed(plain) and compares


def test_sources_of_several_kinds_together():
    b = _weights()
    eps = np.array([1e-5])
    seen = Seen()
    seen.keep(b, None, eps)
    assert not seen.changed(b, None, eps)
    assert seen.changed(b, eps, None)
    assert seen.changed(b, None, np.array([2e-5]))
    assert seen.changed(b)


def test_untouched_follows_references(compares):
    b = _weights()
    assert b.untouched()
    d = b.data
    assert not b.untouched()
    del d
    assert b.untouched()
    v = b.raw_data[0]
    assert not b.untouched()
    del v
    assert b.untouched()
    assert isinstance(blob_module.Writes, type)


NET = """layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 8 dim: 9 dim: 9 } } }
layer { name: "a" type: "Convolution" bottom: "data" top: "a"
  convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn" type: "BatchNorm" bottom: "a" top: "a" }
layer { name: "relu" type: "ReLU" bottom: "a" top: "a" }
layer { name: "b" type: "Convolution" bottom: "a" top: "b"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "dw" type: "Convolution" bottom: "b" top: "dw"
  convolution_param { num_output: 16 group: 16 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "fc" type: "InnerProduct" bottom: "dw" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
"""


def test_a_test_net_follows_weights_loaded_or_written_between_forwards(tmp_path):
    """What users do between forwards of one TEST net (packed 1 x 1 and 3 x 3 weights, a
    folded BatchNorm, a depthwise layer, an InnerProduct): load other weights with copy_from,
    write through net.params, and each forward gives what a fresh net with those weights gives."""
    import caffepy
    from caffepy.net import Net
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 8, 9, 9)).astype(np.float32)

    def fresh_output(weights):
        other = Net(str(path), caffepy.TEST)
        other.copy_from(str(weights))
        other.blobs["data"].data[...] = x
        return other.forward()["fc"].copy()

    net = Net(str(path), caffepy.TEST)
    for blob in net.params["bn"][:2]:
        blob.data[...] = rng.uniform(0.5, 2, blob.shape)
    net.params["bn"][2].data[...] = 1
    net.blobs["data"].data[...] = x
    first = net.forward()["fc"].copy()
    net.save(str(tmp_path / "first.caffemodel"))
    for name in ("a", "b", "dw", "fc", "bn"):
        net.params[name][0].data[...] *= 1.5
    second = net.forward()["fc"].copy()
    net.save(str(tmp_path / "second.caffemodel"))
    assert not np.allclose(first, second)
    net.copy_from(str(tmp_path / "first.caffemodel"))
    np.testing.assert_allclose(net.forward()["fc"], first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fresh_output(tmp_path / "second.caffemodel"), second, rtol=1e-5,
                               atol=1e-5)
