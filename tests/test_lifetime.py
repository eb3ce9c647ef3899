"""A net that is let go is freed at once, as a Caffe Net is when its last reference goes: no
reference cycle keeps its layers (weights, workspaces) for the cyclic garbage collector, its
prefetch threads stop and its databases close. A script that builds nets in a loop otherwise
grows by each net, and a LevelDB stays locked by a net nobody holds."""
import gc
import threading

import numpy as np
import plyvel
import pytest
from google.protobuf import text_format

import caffepy
from caffepy.net import Net
from caffepy.proto import caffe_pb2
from data_helpers import data_net_text, make_db

CONV = ('layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" convolution_param '
        '{{ num_output: 16 kernel_size: {k} pad: {p} weight_filler {{ type: "xavier" }} }} }}\n')
# a 3x3 convolution (Winograd on the fast path), a 1x1 one, BatchNorm + Scale + ReLU (fused),
# an Eltwise + ReLU, a loss
BODY = (CONV.format(name="c1", bottom="data", k=3, p=1) + CONV.format(name="c2", bottom="c1", k=1, p=0)
        + 'layer { name: "bn" type: "BatchNorm" bottom: "c2" top: "c2" }\n'
          'layer { name: "s" type: "Scale" bottom: "c2" top: "c2" scale_param { bias_term: true } }\n'
          'layer { name: "r" type: "ReLU" bottom: "c2" top: "c2" }\n'
          'layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c2" top: "sum" }\n'
          'layer { name: "r2" type: "ReLU" bottom: "sum" top: "sum" }\n'
          'layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip" inner_product_param '
          '{ num_output: 10 weight_filler { type: "xavier" } } }\n'
          'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
INPUTS = ('layer { name: "in" type: "Input" top: "data" top: "label" input_param { shape { dim: 2 '
          'dim: 8 dim: 12 dim: 12 } shape { dim: 2 } } }\n')
BLOCKED = ('layer { name: "pack" type: "IntelPack" bottom: "data" top: "packed" }\n'
           + CONV.format(name="c1", bottom="packed", k=3, p=1) + CONV.format(name="c2", bottom="c1", k=1, p=0)
           + 'layer { name: "unpack" type: "IntelUnpack" bottom: "c2" top: "out" }\n')


def param(text):
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return p


def cyclic_caffepy_garbage(make):
    """The caffepy objects that only the cyclic collector frees, once `make()`'s net is dropped."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        net = make()
        net.forward()
        if net.phase == caffepy.TRAIN:
            net.backward()
        del net
        gc.collect()
        return sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                       if type(o).__module__.startswith("caffepy")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("text", [INPUTS + BODY, INPUTS + BLOCKED], ids=["channels-last", "blocked"])
@pytest.mark.parametrize("phase", [caffepy.TRAIN, caffepy.TEST])
def test_a_dropped_net_leaves_no_cycles(text, phase):
    def make():
        net = Net(param(text), phase)
        net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
        net.blobs["label"].data[...] = 1
        return net
    assert cyclic_caffepy_garbage(make) == []


def test_a_dropped_data_net_stops_its_threads_and_closes_its_leveldb(tmp_path):
    db = make_db(tmp_path / "db", 12, shape=(8, 12, 12), backend="leveldb")
    text = data_net_text(db, 2, backend="LEVELDB") + BODY
    before = set(threading.enumerate())
    assert cyclic_caffepy_garbage(lambda: Net(param(text), caffepy.TRAIN)) == []
    for t in threading.enumerate():
        if t not in before and t.name.startswith("caffepy"):
            t.join(timeout=10)          # a dropped layer's thread ends by itself, closing its source
            assert not t.is_alive(), t.name
    plyvel.DB(db).close()            # unlocked: no reader holds it any more


def test_a_layer_collected_inside_its_own_prefetch_thread_does_not_deadlock(tmp_path, monkeypatch):
    """The collector runs a dropped layer's finalizer in whatever thread it interrupts: here the
    layer's own prefetch thread, inside ThreadPoolExecutor.submit with the pool's lock held.
    Closing the pool there would wait for that lock forever; the finalizer only asks the thread
    to stop, and the thread closes the pool and the database as it ends."""
    monkeypatch.setenv("CAFFEPY_DATA_THREADS", "2")
    db = make_db(tmp_path / "db", 12, shape=(8, 12, 12), backend="leveldb")
    net = Net(param(data_net_text(db, 2, backend="LEVELDB") + BODY), caffepy.TRAIN)
    layer = net.layers[0]
    pool, finalize = layer.filler._pool, layer._finalizer
    submit = pool.submit

    def collected_here(*args, **kwargs):
        with pool._shutdown_lock:
            finalize()
        return submit(*args, **kwargs)
    pool.submit = collected_here
    thread = layer.prefetcher._thread
    net.forward()                         # frees a buffer: the thread fills it, through submit
    thread.join(timeout=10)
    assert not thread.is_alive(), "the prefetch thread is stuck"
    assert pool._shutdown
    plyvel.DB(db).close()
