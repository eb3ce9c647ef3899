"""Choosing model-parallel layers from the prototxt, and gradient buckets (no MPI needed)."""
import pytest
from google.protobuf import text_format

from caffepy import log
from caffepy.blob import Blob
from caffepy.errors import ParallelError
from caffepy.net import TRAIN, Net
from caffepy.parallel.allreduce import GradientReducer
from caffepy.parallel.strategies import model_parallel_layers, rank_report, rank_scalars
from caffepy.proto import caffe_pb2


def net_from(text):
    log.set_quiet(True)
    param = text_format.Parse(text, caffe_pb2.NetParameter())
    return Net(param, phase=TRAIN)


BODY = """
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 6 } } }
layer { name: "fc1" type: "InnerProduct" bottom: "x" top: "h" inner_product_param { num_output: 5 } %s }
layer { name: "relu" type: "ReLU" bottom: "h" top: "h" %s }
layer { name: "fc2" type: "InnerProduct" bottom: "h" top: "y" inner_product_param { num_output: 3 %s } }
"""


def body(fc1="", relu="", fc2=""):
    return BODY % (fc1, relu, fc2)


def test_per_layer_marks():
    net = net_from(body(fc1="multinode { model_parts: 0 }"))
    assert model_parallel_layers(net, 4) == [1]
    net = net_from(body(fc1="multinode { model_parts: 4 }"))
    assert model_parallel_layers(net, 4) == [1]
    assert model_parallel_layers(net_from(body()), 4) == []


def test_net_level_range_takes_inner_products_only():
    net = net_from('multinode { model_parallel { layer_from: "fc1" layer_to: "fc2" } }' + body())
    assert model_parallel_layers(net, 2) == [1, 3]
    net = net_from('multinode { model_parallel { layer_from: "fc2" } }' + body())
    assert model_parallel_layers(net, 2) == [3]


@pytest.mark.parametrize("text,message", [
    (body(relu="multinode { model_parts: 0 }"),
     "layer 'relu' (ReLU): multinode: model parallelism is implemented for InnerProduct layers only"),
    (body(fc1="multinode { model_parts: 2 }"),
     "layer 'fc1' (InnerProduct): multinode.model_parts: only splitting over all 4 ranks is "
     "supported (0 or 4), got 2"),
    (body(fc2="transpose: true } multinode { model_parts: 0"),
     "inner_product_param.transpose: model-parallel InnerProduct needs untransposed weights"),
    ('multinode { model_parallel { layer_from: "fc9" } }' + body(),
     "multinode.model_parallel.layer_from: no layer named 'fc9'"),
])
def test_unsupported_settings_are_refused(text, message):
    with pytest.raises(ParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_parallel_layers(net_from(text), 4)


def test_too_few_outputs_for_the_ranks():
    net = net_from(body(fc2="} multinode { model_parts: 0"))
    with pytest.raises(ParallelError, match=r"num_output: must be at least the number of ranks \(4\)"):
        model_parallel_layers(net, 4)
    assert model_parallel_layers(net, 3) == [3]


def test_buckets_follow_backward_order():
    blobs = [Blob((n,)) for n in (10, 2000, 30, 5000, 7)]
    ready = [0, 1, 1, 2, 3]
    buckets = GradientReducer._make_buckets(list(zip(blobs, ready)), bucket_bytes=4 * 1000)
    order = [[blobs.index(b) for b in bucket.blobs] for bucket in buckets]
    # 7 floats (layer 3) wait for the 5000 (own bucket); 2000 alone; 30 + 10 packed
    assert order == [[4], [3], [1], [2, 0]]
    assert [b.ready_layer for b in buckets] == [3, 2, 1, 0]


def test_rank_report_names_the_rank_that_works_longest():
    # rank 2 worked 0.9 s an iteration; the others waited for it in the small collectives
    timings = [[10, 0.5, 5.0], [10, 0.5, 4.5], [10, 0.5, 0.5], [10, 0.5, 4.8]]
    assert rank_report(40, timings, 10, images=256) == (
        "Iteration 40, 4 ranks: 256.0 images/s, slowest rank 2 (0.9 s/iter working; fastest rank 0 0.45), "
        "waiting 5.0% of the time for communication, 37.0% for other ranks")
    # no data layer to count images by
    assert rank_report(40, timings, 10).startswith("Iteration 40, 4 ranks: 1 iter/s, slowest rank 2 ")
    # the same figures as TensorBoard scalars
    assert rank_scalars(timings, 10) == pytest.approx({
        "mpi/slowest_rank": 2, "mpi/slowest_rank_seconds_per_iter": 0.9,
        "mpi/fastest_rank_seconds_per_iter": 0.45, "mpi/communication_wait_fraction": 0.05,
        "mpi/rank_wait_fraction": 0.37})
    # the records settled late: the ranks wait for rank 2 in the gradient exchange; what its
    # longer work explains is waiting for it, the rest (1 s each) communication
    timings = [[10, 5.5, 0], [10, 5.0, 0], [10, 1.0, 0], [10, 5.3, 0]]
    assert rank_report(40, timings, 10).endswith(
        "slowest rank 2 (0.9 s/iter working; fastest rank 0 0.45), "
        "waiting 10.0% of the time for communication, 32.0% for other ranks")


@pytest.mark.parametrize("progress,place", [
    ("thread", "the update of iteration 7"),
    ("blocking", "the update of iteration 7 or the forward of iteration 8"),
    ("none", "the update of iteration 7 or the forward of iteration 8")])
def test_the_watchdog_place_after_the_gradients_covers_the_next_forward(monkeypatch, progress, place):
    """Where a stalled rank is reported to be after its gradients: in the blocking and none
    modes nothing marks the next forward (the thread mode's first await does), so the place
    names both."""
    import contextlib
    import types
    from caffepy.parallel import watchdog
    from caffepy.parallel.strategies import DataParallel
    marks = []
    monkeypatch.setattr(watchdog, "_current", types.SimpleNamespace(
        place="start-up", mark=lambda place, waits: marks.append((place, waits))))
    strategy = types.SimpleNamespace(
        reducer=types.SimpleNamespace(progress=progress, issue_all=lambda: None, finish=lambda: None),
        _waiting=lambda *args: contextlib.nullcontext(), _reduced=())
    DataParallel.before_update(strategy, types.SimpleNamespace(iter=7))
    assert marks[-1] == (place, False)
