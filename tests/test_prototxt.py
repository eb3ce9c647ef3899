"""prototxt: reading, writing, upgrading, NetState filtering, solver nets."""
import glob
import os
import stat

import pytest

from caffepy import log
from caffepy.errors import CaffepyError, PrototxtError
from caffepy.proto import caffe_pb2
from caffepy import prototxt as P

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(REPO, "..", "shared", "reference-models")
NETS = sorted(p for p in glob.glob(os.path.join(REFERENCE, "*", "*.prototxt")) if "solver" not in p)
SOLVERS = sorted(p for p in glob.glob(os.path.join(REFERENCE, "*", "*.prototxt")) if "solver" in p)
needs_reference = pytest.mark.skipif(not NETS, reason="no reference models next to the repository")


@pytest.fixture(autouse=True)
def quiet():
    log.set_quiet(True)
    yield
    log.set_quiet(False)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- reference models --------------------------------------------------------

@needs_reference
@pytest.mark.parametrize("path", NETS, ids=os.path.basename)
def test_reference_net_round_trips(path, tmp_path):
    net = P.read_net(path)
    assert len(net.layer) > 0 and not len(net.layers) and not len(net.input)
    assert P.upgrade_net(net, path) == (net, False)
    P.write_binary(net, tmp_path / "net.binaryproto")
    back = P.read_binary_net(tmp_path / "net.binaryproto")
    P.write_text(back, tmp_path / "net.prototxt")
    assert P.read_net(tmp_path / "net.prototxt") == net


@needs_reference
@pytest.mark.parametrize("path", SOLVERS, ids=os.path.basename)
def test_reference_solver_round_trips(path, tmp_path):
    solver = P.read_solver(path)
    assert solver.HasField("net") and not solver.HasField("solver_type")
    P.write_text(solver, tmp_path / "solver.prototxt")
    assert P.read_solver(tmp_path / "solver.prototxt") == solver


# Every prototxt under the reference directories (bvlc, intel) and under the directories of
# CAFFEPY_REFERENCE_MODELS (os.pathsep-separated; e.g. checkouts of BVLC and Intel Caffe, whose
# models/ and examples/ hold 54 and 302 prototxts) must read, and every net must build in
# TRAIN and TEST or be refused in one line naming its file and the layer (a missing LMDB, an
# Intel layer or field caffepy does not run).
CORPUS_DIRS = [os.path.join(REFERENCE, "bvlc"), os.path.join(REFERENCE, "intel")] + \
    [d for d in os.environ.get("CAFFEPY_REFERENCE_MODELS", "").split(os.pathsep) if d]
CORPUS = sorted({os.path.abspath(f) for d in CORPUS_DIRS
                 for f in glob.glob(os.path.join(d, "**", "*.prototxt"), recursive=True)})


def corpus_kind(path):
    name = os.path.basename(path)
    return "solver" if "solver" in name else "labelmap" if "labelmap" in name else "net"


def corpus_id(path):
    for d in CORPUS_DIRS:
        if path.startswith(os.path.abspath(d) + os.sep):
            return os.path.relpath(path, os.path.dirname(os.path.abspath(d)))
    return path


@pytest.mark.skipif(not CORPUS, reason="no reference models")
@pytest.mark.parametrize("path", CORPUS, ids=corpus_id)
def test_reference_prototxt_reads(path):
    kind = corpus_kind(path)
    if kind == "solver":
        assert P.read_solver(path).ListFields()
    elif kind == "labelmap":
        assert P.read_text(caffe_pb2.LabelMap(), path).item
    else:
        assert P.read_net(path).layer


@pytest.mark.skipif(not CORPUS, reason="no reference models")
@pytest.mark.parametrize("phase", [caffe_pb2.TRAIN, caffe_pb2.TEST], ids=["TRAIN", "TEST"])
@pytest.mark.parametrize("path", [p for p in CORPUS if corpus_kind(p) == "net"], ids=corpus_id)
def test_reference_net_builds_or_is_refused_in_one_line(path, phase, monkeypatch):
    import numpy as np
    from caffepy import fillers
    from caffepy.net import Net
    # the weights' values do not matter here: zeros are faster to make than random numbers
    monkeypatch.setattr(fillers, "fill", lambda param, shape: np.zeros(shape, np.float32))
    try:
        Net(path, phase=phase)
    except CaffepyError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(path), message
        assert "layer '" in message, message


@needs_reference
def test_reference_intel_fields():
    solver = P.read_solver(os.path.join(REFERENCE, "intel", "multinode__alexnet_bn_64nodes__solver.prototxt"))
    assert solver.warmup_iter == 400 and solver.local_lr_auto and solver.base_lr == 32
    net = P.read_net(os.path.join(REFERENCE, "intel", "multinode__alexnet_4nodes__train_val.prototxt"))
    assert net.layer[0].data_param.shuffle


@needs_reference
def test_reference_deploy_input_becomes_input_layer():
    net = P.read_net(os.path.join(REFERENCE, "bvlc", "bvlc_alexnet__deploy.prototxt"))
    first = net.layer[0]
    assert first.type == "Input" and list(first.top) == ["data"]
    assert list(first.input_param.shape[0].dim) == [10, 3, 227, 227]


# -- upgrades ----------------------------------------------------------------

V1_NET = """
name: "v1"
layers {
  name: "mnist" type: DATA top: "data" top: "label"
  data_param { source: "db" batch_size: 64 scale: 0.00390625 mean_file: "m.binaryproto" crop_size: 24 }
  include { phase: TRAIN }
}
layers {
  name: "conv1" type: CONVOLUTION bottom: "data" top: "conv1"
  blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  param: "shared_w" param: "shared_b"
  convolution_param { num_output: 20 kernel_size: 5 }
}
layers { name: "relu1" type: RELU bottom: "conv1" top: "conv1" }
layers { name: "loss" type: SOFTMAX_LOSS bottom: "conv1" bottom: "label" top: "loss" loss_weight: 2 }
"""


def test_v1_net_upgrade():
    raw = P.parse_text(caffe_pb2.NetParameter(), V1_NET, "v1.prototxt")
    net, changed = P.upgrade_net(raw, "v1.prototxt")
    assert changed and len(raw.layers) == 4, "the input is left alone"
    assert not len(net.layers)
    assert [l.type for l in net.layer] == ["Data", "Convolution", "ReLU", "SoftmaxWithLoss"]
    conv = net.layer[1]
    assert [(p.name, p.lr_mult, p.decay_mult) for p in conv.param] == [("shared_w", 1, 1), ("shared_b", 2, 0)]
    assert conv.convolution_param.num_output == 20 and list(conv.convolution_param.kernel_size) == [5]
    data = net.layer[0]
    assert data.include[0].phase == caffe_pb2.TRAIN
    assert data.transform_param.scale == pytest.approx(0.00390625)
    assert data.transform_param.mean_file == "m.binaryproto" and data.transform_param.crop_size == 24
    assert not data.data_param.HasField("scale") and not data.data_param.HasField("mean_file")
    assert list(net.layer[3].loss_weight) == [2]
    assert P.upgrade_net(net)[1] is False


def test_v1_upgrade_keeps_blobs():
    raw = P.parse_text(caffe_pb2.NetParameter(), V1_NET, "v1")
    raw.layers[1].blobs.add().data.extend([1.0, 2.0, 3.0])
    net = P.upgrade_net(raw)[0]
    assert list(net.layer[1].blobs[0].data) == [1.0, 2.0, 3.0]


def test_net_with_layer_and_layers_is_refused():
    text = V1_NET + 'layer { name: "x" type: "ReLU" bottom: "conv1" top: "conv1" }'
    with pytest.raises(PrototxtError, match=r"^v1\.prototxt: net has both 'layer' and 'layers'"):
        P.parse_net_text(text, "v1.prototxt")


V0_NET = """
name: "v0"
input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers { layer { name: "conv1" type: "conv" num_output: 4 kernelsize: 3 stride: 2 blobs_lr: 1 blobs_lr: 2 }
         bottom: "pad1" top: "conv1" }
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 2 stride: 2 } bottom: "conv1" top: "pool1" }
layers { layer { name: "fc" type: "innerproduct" num_output: 10 } bottom: "pool1" top: "fc" }
layers { layer { name: "prob" type: "softmax" } bottom: "fc" top: "prob" }
"""


def test_v0_net_upgrade():
    net = P.parse_net_text(V0_NET, "v0.prototxt")
    assert [l.type for l in net.layer] == ["Input", "Convolution", "Pooling", "InnerProduct", "Softmax"]
    conv = net.layer[1]
    assert list(conv.bottom) == ["data"], "the padding layer is folded into the conv"
    cp = conv.convolution_param
    assert (list(cp.pad), list(cp.kernel_size), list(cp.stride), cp.num_output) == ([2], [3], [2], 4)
    assert [p.lr_mult for p in conv.param] == [1, 2]
    assert net.layer[2].pooling_param.pool == caffe_pb2.PoolingParameter.AVE
    assert list(net.layer[0].input_param.shape[0].dim) == [1, 3, 8, 8]


def test_unknown_v0_type_is_an_error():
    with pytest.raises(PrototxtError, match="unknown V0 layer type, got 'convolution'"):
        P.parse_net_text('layers { layer { name: "c" type: "convolution" } }', "v0.prototxt")


def test_input_fields_become_an_input_layer():
    net = P.parse_net_text('input: "a" input_shape { dim: 2 dim: 3 } input: "b" input_shape { dim: 5 }\n'
                           'layer { name: "r" type: "ReLU" bottom: "a" top: "r" }', "in.prototxt")
    assert [l.name for l in net.layer] == ["input", "r"]
    assert list(net.layer[0].top) == ["a", "b"]
    assert [list(s.dim) for s in net.layer[0].input_param.shape] == [[2, 3], [5]]
    assert not len(net.input) and not len(net.input_shape)


def test_input_dim_count_is_checked():
    with pytest.raises(PrototxtError, match=r"^in\.prototxt: input_dim: four are needed per input"):
        P.parse_net_text('input: "a" input_dim: 1 input_dim: 2', "in.prototxt")


def test_input_without_shape_is_dropped():
    net = P.parse_net_text('input: "data" layer { name: "r" type: "ReLU" }', "old.caffemodel")
    assert [l.name for l in net.layer] == ["r"] and not len(net.input)


def test_old_batch_norm_param_specs_get_zero_rates():
    net = P.parse_net_text('layer { name: "bn" type: "BatchNorm" param { lr_mult: 1 name: "m" } '
                           'param { lr_mult: 1 } param { lr_mult: 1 } }', "bn.prototxt")
    assert [(p.name, p.lr_mult, p.decay_mult) for p in net.layer[0].param] == [("m", 0, 0), ("", 0, 0), ("", 0, 0)]


def test_solver_type_upgrade():
    solver = P.parse_solver_text('net: "n.prototxt" solver_type: NESTEROV', "s.prototxt")
    assert solver.type == "Nesterov" and not solver.HasField("solver_type")
    with pytest.raises(PrototxtError, match="solver_type, type: both given"):
        P.parse_solver_text('solver_type: ADAM type: "Adam"', "s.prototxt")


def test_upgrade_files(tmp_path):
    src = write(tmp_path, "v1.prototxt", V1_NET)
    assert P.upgrade_net_file(src, tmp_path / "new.prototxt") is True
    upgraded = P.read_text(caffe_pb2.NetParameter(), tmp_path / "new.prototxt")
    assert len(upgraded.layer) == 4 and not len(upgraded.layers)

    raw = P.parse_text(caffe_pb2.NetParameter(), V1_NET, "v1")
    P.write_binary(raw, tmp_path / "v1.caffemodel")
    P.upgrade_net_file(tmp_path / "v1.caffemodel", tmp_path / "new.caffemodel", binary=True)
    assert P.read_binary(caffe_pb2.NetParameter(), tmp_path / "new.caffemodel") == upgraded

    src = write(tmp_path, "s.prototxt", 'net: "n" solver_type: ADAGRAD')
    P.upgrade_solver_file(src, tmp_path / "s2.prototxt")
    assert P.read_text(caffe_pb2.SolverParameter(), tmp_path / "s2.prototxt").type == "AdaGrad"


# -- errors ------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ('name: "n"\nlayer {\n  name: "c"\n  convolution_parm { num_output: 3 }\n}',
     "net.prototxt:4:3: unknown field 'convolution_parm' in LayerParameter; did you mean 'convolution_param'?"),
    ('layer {\n  pooling_param { pool: MAXX }\n}',
     "net.prototxt:2:25: unknown value 'MAXX' for pool (PoolingParameter.PoolMethod); "
     "known values: MAX, AVE, STOCHASTIC"),
    ('layer {\n  name: "a"\n', "net.prototxt:2:9: unexpected end of file: a '{' is not closed"),
    ('layer { name: "a" } }', "net.prototxt:1:21: expected a field name, got '}'"),
    ('layer { convolution_param { num_output: many } }', "net.prototxt:1:41: num_output: not an integer, got many"),
    ('layer { pooling_param { kernel_size: 3 kernel_size: 3 } }',
     "net.prototxt:1:53: field 'kernel_size' given more than once in PoolingParameter, which takes one value"),
    ('layer { clip_param { min: 0 } }', "net.prototxt: required field missing: layer[0].clip_param.max"),
])
def test_parse_errors_are_one_line_with_position(tmp_path, text, expected):
    path = write(tmp_path, "net.prototxt", text)
    with pytest.raises(PrototxtError) as info:
        P.read_net(path)
    message = str(info.value)
    assert "\n" not in message
    assert message == f"{tmp_path}/{expected}"


def test_missing_file_names_the_path():
    with pytest.raises(PrototxtError, match=r"^/no/such/lenet\.prototxt: cannot open: No such file"):
        P.read_net("/no/such/lenet.prototxt")


def test_binary_parse_failure_names_the_file(tmp_path):
    path = write(tmp_path, "lenet.caffemodel", 'name: "LeNet"\nlayer { name: "x" }\n')
    with pytest.raises(PrototxtError, match=r"lenet\.caffemodel: not a binary NetParameter .*text prototxt"):
        P.read_binary_net(path)


def test_not_utf8(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_bytes(b'name: "a"\nname2: "\xff"\n')
    with pytest.raises(PrototxtError, match=r"bad\.prototxt:2: not UTF-8"):
        P.read_net(path)


# -- writing -----------------------------------------------------------------

def test_writes_are_atomic_and_leave_no_temporaries(tmp_path):
    net = caffe_pb2.NetParameter(name="n")
    target = tmp_path / "out.prototxt"
    target.write_text("old")
    P.write_text(net, target)
    assert target.read_text() == 'name: "n"\n'
    assert os.listdir(tmp_path) == ["out.prototxt"]
    mode = stat.S_IMODE(os.stat(target).st_mode)
    assert mode & 0o044, "readable like any file the user creates, not mkstemp's 0600"


def test_write_into_missing_directory_is_a_clean_error(tmp_path):
    with pytest.raises(CaffepyError, match="cannot write"):
        P.write_binary(caffe_pb2.NetParameter(), tmp_path / "no" / "net.caffemodel")


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
    net = P.parse_net_text(FILTER_NET, "f.prototxt")
    return [l.name for l in P.filter_net(net, state).layer]


def test_filter_by_phase_and_level():
    assert kept(P.net_state(caffe_pb2.TRAIN)) == ["always", "train", "not_test", "level_le1", "not_a"]
    assert kept(P.net_state("test", level=2)) == ["always", "test", "level2", "not_a"]
    assert kept(P.net_state("TRAIN", level=3)) == ["always", "train", "not_test", "level2", "not_a", "train_lvl3"]


def test_filter_by_stage():
    assert kept(P.net_state("TEST", 1, ["a"])) == ["always", "test", "level_le1", "stage_a_or_b"]
    assert kept(P.net_state("TEST", 1, ["a", "b"])) == ["always", "test", "level_le1", "stage_ab", "stage_a_or_b"]
    assert kept(P.net_state("TEST", 1, ["b"])) == ["always", "test", "level_le1", "stage_a_or_b", "not_a"]


def test_filter_uses_the_nets_own_state_by_default():
    net = P.parse_net_text(FILTER_NET + "state { phase: TRAIN level: 5 }", "f")
    out = P.filter_net(net)
    assert "train_lvl3" in [l.name for l in out.layer]
    assert out.state.level == 5


def test_include_and_exclude_together_is_an_error():
    net = P.parse_net_text('layer { name: "d" type: "Data" include { phase: TRAIN } exclude { phase: TEST } }', "x")
    with pytest.raises(PrototxtError, match=r"^net\.prototxt: layer 'd' \(Data\): include, exclude: both given"):
        P.filter_net(net, P.net_state("TRAIN"), "net.prototxt")


def test_bad_phase_name():
    with pytest.raises(CaffepyError, match="phase: must be TRAIN or TEST, got val"):
        P.net_state("val")


# -- solver nets -------------------------------------------------------------

NET = """
name: "n"
state { stage: "from_net" }
layer { name: "data" type: "Input" top: "data" }
"""


def test_solver_net_file_resolved_from_cwd(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    write(tmp_path / "models", "net.prototxt", NET)
    solver_path = write(tmp_path / "models", "solver.prototxt",
                        'net: "models/net.prototxt" test_iter: 5 test_iter: 7 test_interval: 10\n'
                        'train_state { level: 2 } test_state { stage: "x" } test_state { level: 4 }')
    monkeypatch.chdir(tmp_path)
    solver = P.read_solver(solver_path)
    train = P.solver_train_net_param(solver, solver_path, level=1, stages=["cli"])
    param, state = train
    assert train.origin == "net file: models/net.prototxt"
    assert state.phase == caffe_pb2.TRAIN and state.level == 1
    assert list(state.stage) == ["from_net", "cli"]
    assert param.state == state
    tests = P.solver_test_net_params(solver, solver_path)
    assert [t.state.phase for t in tests] == [caffe_pb2.TEST] * 2
    assert list(tests[0].state.stage) == ["from_net", "x"] and tests[1].state.level == 4

    monkeypatch.chdir(tmp_path / "models")
    with pytest.raises(PrototxtError, match=r"net: cannot open 'models/net\.prototxt' \(paths are relative to "
                                            r"the current directory"):
        P.solver_train_net_param(solver, solver_path)


def test_solver_without_net():
    with pytest.raises(PrototxtError, match=r"^solver\.prototxt: solver specifies no net \(set 'net' or 'train_net'\)$"):
        P.solver_train_net_param(caffe_pb2.SolverParameter(base_lr=0.1), "solver.prototxt")


def test_solver_with_two_train_nets():
    solver = P.parse_solver_text('net: "a" train_net: "b"', "s")
    with pytest.raises(PrototxtError, match=r"more than one train net \(net, train_net\)"):
        P.solver_train_net_param(solver, "s")


def test_inline_nets_and_test_counts():
    solver = P.parse_solver_text(f'train_net_param {{ {NET} }} test_net_param {{ {NET} }} '
                                 f'test_iter: 3 test_interval: 100', "s")
    train = P.solver_train_net_param(solver, "s")
    assert train.origin == "train_net_param" and train.param.layer[0].name == "data"
    tests = P.solver_test_net_params(solver, "s")
    assert len(tests) == 1 and tests[0].origin == "test_net_param"

    bad = P.parse_solver_text(f'train_net_param {{ {NET} }} test_net_param {{ {NET} }} test_interval: 1', "s")
    with pytest.raises(PrototxtError, match=r"test_iter: one is needed per test net \(1 test nets\), got 0"):
        P.solver_test_net_params(bad, "s")

    no_interval = P.parse_solver_text(f'net_param {{ {NET} }} test_iter: 1', "s")
    with pytest.raises(PrototxtError, match="test_interval: must be > 0"):
        P.solver_test_net_params(no_interval, "s")

    states = P.parse_solver_text(f'net_param {{ {NET} }} test_iter: 1 test_iter: 1 test_interval: 1 '
                                 f'test_state {{ }}', "s")
    with pytest.raises(PrototxtError, match=r"test_state: must be unspecified or given once per test net \(2\), got 1"):
        P.solver_test_net_params(states, "s")


def test_generic_net_gives_one_test_net_per_remaining_test_iter():
    solver = P.parse_solver_text(f'net_param {{ {NET} }} test_iter: 1 test_iter: 2 test_interval: 5', "s")
    tests = P.solver_test_net_params(solver, "s")
    assert [t.origin for t in tests] == ["net_param", "net_param"]
    tests[0].param.name = "changed"
    assert tests[1].param.name == "n", "each test net is its own copy"
    assert P.solver_test_net_params(P.parse_solver_text('net: "x"', "s"), "s") == []


# -- solver state ------------------------------------------------------------

def test_solver_state_round_trip(tmp_path):
    state = caffe_pb2.SolverState(iter=100, learned_net="x_iter_100.caffemodel", current_step=2)
    state.history.add().data.extend([0.5, 1.5])
    P.write_solver_state(state, tmp_path / "x.solverstate")
    assert P.read_solver_state(tmp_path / "x.solverstate") == state


def test_intel_fields_of_the_38_reference_files_that_did_not_parse(tmp_path):
    """One of each field that kept Intel Caffe's reference prototxts from parsing."""
    net = P.parse_net_text('''
        layer { name: "data" type: "Data" top: "data" transform_param { pad: 3 bgr2rgb: true }
                data_param { source: "x" batch_size: 1 side: 13 } }
        layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
                quantization_param { bw_layer_in: 8 is_negative_input: true force_u8_input: true }
                convolution_param { num_output: 1 kernel_size: 1 fusion_type: SUM_FUSION coeff: 1 } }
        layer { name: "reorg" type: "Reorg" bottom: "conv" top: "reorg" reorg_param { stride: 2 } }
        layer { name: "cat" type: "Concat" bottom: "reorg" top: "cat" concat_param { per_fla_fuse: true } }
        layer { name: "loss" type: "RegionLoss" bottom: "cat" top: "loss" region_loss_param { biases: 1 } }
        layer { name: "eval" type: "EvalDetection" bottom: "cat" top: "eval"
                eval_detection_param { score_type: PROB } }
        layer { name: "pool" type: "Pooling" bottom: "cat" top: "pool" pooling_param { kernel_size_3d: 2 } }
        layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { relu: true } }
        layer { name: "up" type: "Reshape" bottom: "ip" top: "up" reshape_param { pixelshuffler: 2 } }
        compile_net_state { negative_conv_names: "conv" negative_conv_indexes: 1 }''', "intel.prototxt")
    assert net.layer[1].quantization_param.is_negative_input and net.layer[2].reorg_param.stride == 2
    solver = P.parse_solver_text('net: "n" lr_policy: "multifixed" stagelr: 0.1 stageiter: 10 test_offset: 5',
                                 "solver.prototxt")
    assert solver.test_offset == 5 and list(solver.stageiter) == [10]
