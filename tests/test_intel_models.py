"""Every net of Intel Caffe's models/ and examples/ builds and runs a training step.

The sweep walks every net prototxt of the reference models beside the repository (always), of
an Intel Caffe tree named by CAFFEPY_INTEL_CAFFE (its models/ and examples/, about 200 nets)
and of a BVLC Caffe tree named by CAFFEPY_BVLC_CAFFE. Each net is built in TRAIN and in TEST
with its data layers replaced by DummyData of the shapes they would produce (`synthetic_net`),
and runs one forward and one backward; every blob's data and diff, every parameter gradient
and the loss must be finite. A net passes too when it is refused in one line (a CaffepyError)
naming a layer type or field that another issue owns (OTHER_ISSUES), or that is left out on
purpose (LEFT: 3-D convolution); any other refusal, and any other exception, fails.
py-faster-rcnn's rpn Python layers (its lib, Python 2 code its users put on their path) are
played by examples/faster_rcnn's layers of the same interfaces (RPN_STAND_INS), and its train
nets run in TRAIN only. A net
whose layers need blobs that no layer of a phase makes (a deploy net in TRAIN, a train net in
TEST) is skipped in that phase, as Caffe would refuse it.

    CAFFEPY_INTEL_CAFFE=/work/intel-caffe python -m pytest tests/test_intel_models.py [-m slow]

prints the counts at the end (ran, skipped, refused by reason, failed).
"""
import ast
import glob
import math
import os
import re
import sys
import time
import types

import numpy as np
import pytest

from caffepy import upgrade as U
from caffepy.errors import CaffepyError
from caffepy.net import Net, filter_net, net_state
from caffepy.proto import caffe_pb2

from paths import REFERENCE_MODELS, REPO

INTEL_TREE = os.environ.get("CAFFEPY_INTEL_CAFFE")
BVLC_TREE = os.environ.get("CAFFEPY_BVLC_CAFFE")

# the batch every replaced data layer produces (and the one Input / DummyData shapes shrink to)
BATCH = 2


def _nets(root, subdirs):
    found = []
    for sub in subdirs:
        found += glob.glob(os.path.join(root, sub, "**", "*.prototxt"), recursive=True)
    return sorted(p for p in found
                  if not re.search(r"solver|labelmap", os.path.basename(p)))


CORPUS = {}        # id -> path
for _label, _root, _subdirs in [("reference", REFERENCE_MODELS, ["bvlc", "intel"]),
                                ("intel", INTEL_TREE, ["models", "examples"]),
                                ("bvlc", BVLC_TREE, ["models", "examples"])]:
    if _root and os.path.isdir(_root):
        for _path in _nets(_root, _subdirs):
            CORPUS[f"{_label}/{os.path.relpath(_path, _root)}"] = _path

# Nets (paths in their tree) whose step took 10 s or more on 2 busy cores: run with -m slow
SLOW = {
    "examples/LRCN_activity_recognition/train_test_lstm_RGB.prototxt",
    "examples/LRCN_activity_recognition/train_test_singleFrame_RGB.prototxt",
    "models/default_vgg_16/train_val.prototxt",
    "models/default_vgg_19/train_val.prototxt",
    "models/intel_optimized_models/benchmark/vgg16/deploy.prototxt",
    "models/intel_optimized_models/benchmark/vgg16/train_val.prototxt",
    "models/intel_optimized_models/benchmark/vgg16/train_val_dummydata.prototxt",
    "models/intel_optimized_models/multinode/alexnet_4nodes/train_val.prototxt",
    "models/intel_optimized_models/multinode/vgg_16_16nodes_1k_batch/train_val.prototxt",
    "models/intel_optimized_models/multinode/vgg_16_16nodes_1k_batch/train_val_ip_grad_compress.prototxt",
    "models/intel_optimized_models/multinode/vgg_16_32nodes_2k_batch/train_val.prototxt",
    "models/intel_optimized_models/multinode/vgg_16_64nodes_4k_batch/train_val.prototxt",
    "models/intel_optimized_models/multinode/vgg_16_8nodes_512_batch/train_val.prototxt",
    "models/intel_optimized_models/multinode/vgg_16_8nodes_512_batch/train_val_ip_grad_compress.prototxt",
    "models/intel_optimized_models/ssd/VGGNet/coco/SSD_300x300/deploy.prototxt",
    "models/intel_optimized_models/ssd/VGGNet/coco/SSD_300x300_webcam/test.prototxt",
    "models/intel_optimized_models/faster-rcnn/pascal_voc/VGG16/fast_rcnn/train.prototxt",
    "models/intel_optimized_models/benchmark/rfcn/deploy.prototxt",
    "models/intel_optimized_models/benchmark/ssd/train_val_dummydata.prototxt",
    "models/intel_optimized_models/benchmark/faster-rcnn/deploy.prototxt",
    "examples/model_optimization/models/Fast-RCNN/pascal_voc/VGG16-X2/faster_rcnn_end2end/train.prototxt",
    "examples/model_optimization/models/Fast-RCNN/pascal_voc/VGG16-X4/faster_rcnn_end2end/train.prototxt",
    "models/intel_optimized_models/faster-rcnn/coco/VGG16/fast_rcnn/train.prototxt",
    "models/intel_optimized_models/yolo/yolov2_train.prototxt",
    "models/intel_optimized_models/yolo/yolov2_train_RELU.prototxt",
    "models/intel_optimized_models/yolo/yolov2_test.prototxt",
    "models/intel_optimized_models/yolo/yolov2_test_RELU.prototxt",
}

# Refusals that belong to other issues: a net refused for one of these passes. Keys: a layer
# type caffepy does not know, a LayerParameter field, or "Python <module>". (The sweep replaces
# the data layers, AnnotatedData and VideoData of issue #36 among them.)
OTHER_ISSUES = {}        # none open today: SSD's layers (#36) and int8 (#40) run

# Refusals of work left out on purpose: key -> (pattern of the refusal's field and problem, why)
LEFT = {
    "3-D convolution": (r"bottom: needs a 4-axis \(N, C, H, W\) blob, got \(\d+, \d+, \d+, \d+, \d+\)$",
                        "Intel's VNet, whose Reshape layers fix its volume at 128x128x64: its 5x5x5 "
                        "convolutions over 32 channels there would need 16 GB im2col buffers"),
}

RESULTS = {}       # (id, phase name) -> (kind, why, seconds); see sweep()


# -- the synthetic net ---------------------------------------------------------------------------

DATA_TYPES = {"Data", "ImageData", "WindowData", "HDF5Data", "MemoryData", "AnnotatedData",
              "VideoData"}
# Python layers that read a data set (py-faster-rcnn's RoIDataLayer, LRCN's video clips)
PYTHON_DATA = {"roi_data_layer.layer", "sequence_input_layer"}

# item shapes (C, H, W) of data sets known by their source's name; other images are color, of
# the crop (or resize) size their transform_param asks for, else 224 x 224
SOURCES = [("mnist_siamese", (2, 28, 28)), ("mnist", (1, 28, 28)), ("cifar", (3, 32, 32)),
           ("hdf5_classification", (4,))]


def _item_shape(lp):
    """(C, H, W) of one item a data layer `lp` produces."""
    for field in ("data_param", "image_data_param", "hdf5_data_param", "window_data_param"):
        source = getattr(lp, field).source
        for pattern, shape in SOURCES:
            if source and pattern in source:
                return shape
    if lp.type == "MemoryData":
        p = lp.memory_data_param
        return (p.channels, p.height, p.width)
    tp = lp.transform_param
    channels = 1 if tp.force_gray or (lp.HasField("image_data_param") and not lp.image_data_param.is_color) else 3
    if tp.crop_size:
        return (channels, tp.crop_size, tp.crop_size)
    if tp.crop_h and tp.crop_w:
        return (channels, tp.crop_h, tp.crop_w)
    if lp.window_data_param.crop_size:
        return (channels, lp.window_data_param.crop_size, lp.window_data_param.crop_size)
    if tp.resize_param.height and tp.resize_param.width:
        return (channels, tp.resize_param.height, tp.resize_param.width)
    if lp.image_data_param.new_height and lp.image_data_param.new_width:
        return (channels, lp.image_data_param.new_height, lp.image_data_param.new_width)
    return (channels, 224, 224)


def _filler(kind, value=0.0):
    return caffe_pb2.FillerParameter(type=kind, value=value, std=1.0)


GAUSSIAN = _filler("gaussian")
ZEROS = _filler("constant")


def _data_tops(lp):
    """[(shape, filler)] for each top of the data layer `lp`."""
    tops = list(lp.top)
    if lp.type == "Python" and lp.python_param.module == "sequence_input_layer":
        # LRCN: one clip of 16 frames (synthetic_net cuts its Reshape layers to one clip)
        return [((16, 3, 227, 227), GAUSSIAN), ((16,), ZEROS), ((16,), ZEROS)]
    if lp.type == "Python":
        # py-faster-rcnn's RoIDataLayer: one image and its boxes, or (fast_rcnn) its rois
        classes = ast.literal_eval("{" + lp.python_param.param_str + "}").get("num_classes", 21)
        shapes = {"data": (1, 3, 224, 224), "im_info": (1, 3), "gt_boxes": (1, 5), "rois": (BATCH, 5),
                  "labels": (BATCH,), "bbox_targets": (BATCH, 4 * classes),
                  "bbox_inside_weights": (BATCH, 4 * classes), "bbox_outside_weights": (BATCH, 4 * classes)}
        return [(shapes[t], GAUSSIAN if t == "data" else ZEROS) for t in tops]
    data = ((BATCH,) + _item_shape(lp), GAUSSIAN)
    if lp.type == "AnnotatedData":
        label = ((1, 1, 1, 8), ZEROS)     # one ground-truth box: sweep() writes GROUND_TRUTH there
    else:
        label = ((BATCH,), ZEROS)
    return [data, label][:len(tops)]


def _shrunk(shapes, batch=BATCH):
    """Input / DummyData shapes with the batch (the first top's first axis) cut to `batch`."""
    first = shapes[0][0] if shapes and shapes[0] else None
    if not first or first <= batch:
        return shapes
    return [(batch,) + tuple(s[1:]) if s and s[0] == first else tuple(s) for s in shapes]


def _dummy(lp, tops):
    """A DummyData layer in place of `lp` producing `tops` [(shape, filler)]."""
    out = caffe_pb2.LayerParameter(name=lp.name, type="DummyData", top=lp.top)
    out.include.extend(lp.include)
    out.exclude.extend(lp.exclude)
    for shape, filler in tops:
        out.dummy_data_param.shape.add(dim=shape)
        out.dummy_data_param.data_filler.add().CopyFrom(filler)
    return out


def _frames(net):
    """LRCN's nets split their batch into (frames, clips) by Reshape layers, among them one of
    'clip_markers': the number of frames, else None."""
    for lp in net.layer:
        if lp.type == "Reshape" and list(lp.bottom) == ["clip_markers"]:
            return lp.reshape_param.shape.dim[0]
    return None


def synthetic_net(net):
    """A copy of the NetParameter `net` whose data layers are DummyData of BATCH items (see
    _data_tops), whose Input and DummyData layers make at most BATCH items (LRCN's: one clip),
    whose Reshape layers that name the batch size name the new one, and whose
    bn_stats_batch_size / stats_batch_size (Intel: BatchNorm statistics over groups of that many
    items, which must divide the batch) is 1 where it does not divide BATCH."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    frames = _frames(net)
    batches = set()                 # the batch sizes the prototxt wrote and we cut
    for lp in net.layer:
        if lp.type in DATA_TYPES or (lp.type == "Python" and lp.python_param.module in PYTHON_DATA):
            lp = _dummy(lp, _data_tops(lp))
        elif lp.type in ("Input", "DummyData"):
            given = lp.input_param.shape if lp.type == "Input" else lp.dummy_data_param.shape
            shapes = [tuple(s.dim) for s in given]
            cut = _shrunk(shapes, frames or BATCH)
            if cut != shapes:
                batches.add(shapes[0][0])
            if lp.type == "Input":
                lp = _dummy(lp, [(s, GAUSSIAN if i == 0 else ZEROS) for i, s in enumerate(cut)])
            else:
                copy = caffe_pb2.LayerParameter()
                copy.CopyFrom(lp)
                for s, shape in zip(copy.dummy_data_param.shape, cut):
                    s.dim[:] = shape
                if cut != shapes:
                    # a label top drawn uniformly (Intel's SSD benchmark: 1 to 10) is read as
                    # item indices by a detection loss: keep them within the cut batch
                    for filler in copy.dummy_data_param.data_filler[1:]:
                        if filler.type == "uniform" and filler.max >= BATCH:
                            filler.max = BATCH - 1
                            filler.min = min(filler.min, filler.max)
                lp = copy
        out.layer.add().CopyFrom(lp)
        dims = out.layer[-1].reshape_param.shape.dim
        if lp.type == "Reshape" and frames and len(dims) > 1 and dims[0] == frames:
            dims[1] = 1                                         # one clip
        elif lp.type == "Reshape" and dims and dims[0] in batches:
            dims[0] = BATCH                                     # DCGAN's generator
        # the test set's image sizes (a file of the data set, as the replaced sources are)
        out.layer[-1].detection_evaluate_param.ClearField("name_size_file")
        stats = out.layer[-1].batch_norm_param
        if stats.stats_batch_size and BATCH % stats.stats_batch_size:
            stats.stats_batch_size = 1
    if out.bn_stats_batch_size and BATCH % out.bn_stats_batch_size:
        out.bn_stats_batch_size = 1
    return out


def _unproduced(net, phase, stages):
    """A bottom no layer of the phase produces (the net is not one of that phase: a deploy net
    whose Reshape is TEST-only, a train.prototxt whose data layer is TRAIN-only), else None."""
    made = set()
    for lp in filter_net(net, net_state(phase, 0, stages)).layer:
        for name in lp.bottom:
            if name not in made:
                return f"layer '{lp.name}' reads '{name}', which no {caffe_pb2.Phase.Name(phase)} layer makes"
        made.update(lp.top)
    return None


def _training_only(net, phase):
    """py-faster-rcnn's train nets in TEST: their anchor and proposal target layers draw
    training samples and have no TEST settings (its train nets name no phase, but only its
    training runs them), else None."""
    for lp in net.layer:
        if phase == caffe_pb2.TEST and lp.type == "Python" and lp.python_param.module in TRAINING_ONLY:
            return f"layer '{lp.name}' ({lp.python_param.module}) samples training targets"
    return None


def _stages(net, phase):
    """The stages a TEST net runs with: those of its first data layer's TEST rule (as a
    solver's test_state names them: LRCN's and mnist_autoencoder's "test-on-test")."""
    if phase != caffe_pb2.TEST:
        return []
    for lp in net.layer:
        for rule in lp.include:
            if rule.HasField("phase") and rule.phase == phase and len(rule.stage):
                return list(rule.stage)
    return []


# -- the sweep -----------------------------------------------------------------------------------

LINE = re.compile(r"layer '(?P<name>[^']*)' \((?P<type>[^)]*)\): (?P<field>[^:]+): (?P<problem>.*)")


def refusal_reason(message):
    """The key of OTHER_ISSUES or LEFT a one-line refusal names, else None."""
    m = LINE.search(message)
    if not m:
        return None
    kind, field, problem = m["type"], m["field"], m["problem"]
    if field == "type" and problem.startswith("unknown layer type") and kind in OTHER_ISSUES:
        return kind
    if kind == "Python" and field == "python_param.module":
        module = re.search(r"got '([^']+)'", problem)
        key = f"Python {module.group(1)}" if module else None
        return key if key in OTHER_ISSUES else None
    if field in OTHER_ISSUES:
        return field
    for key, (pattern, _) in LEFT.items():
        if re.match(pattern, f"{field}: {problem}"):
            return key
    return None


def _finite(net, loss):
    """Names of blobs or parameters holding a value that is not finite."""
    bad = [] if math.isfinite(loss) else ["loss"]
    for name, blob in net.blobs.items():
        for what, array in (("data", blob.data), ("diff", blob.diff)):
            if array.size and not np.isfinite(array).all():
                bad.append(f"{name}.{what}")
    for layer in net.layers:
        for i, blob in enumerate(layer.blobs):
            if not np.isfinite(blob.diff).all():
                bad.append(f"{layer.name}.blobs[{i}].diff")
    return bad


def _global_stats(net):
    """BatchNorm's stored statistics as a trained net's (mean 0, variance 1): a new net's are
    zeros, which a TEST-phase BatchNorm reads as variance 0, multiplying by 1/sqrt(eps) layer
    after layer until the values overflow (in Caffe as well)."""
    for layer in net.layers:
        if layer.type == "BatchNorm" and len(layer.blobs) == 3:
            layer.blobs[0].data[...] = 0
            layer.blobs[1].data[...] = 1
            layer.blobs[2].data[...] = 1


# One ground-truth box as AnnotatedData writes it: [item, label, instance, xmin, ymin, xmax, ymax,
# difficult] (label 0 is the background, which detection losses refuse as a box's label)
GROUND_TRUTH = [0, 1, 0, 0.1, 0.2, 0.6, 0.7, 0]


# py-faster-rcnn's RoIDataLayer: the image's (height, width, scale) and one box (x1, y1, x2, y2, class)
IM_INFO = [224, 224, 1]
GT_BOXES = [16, 32, 150, 200, 1]


def _ground_truth(net, param):
    """The label tops of the layers that replaced AnnotatedData hold GROUND_TRUTH, and those
    that replaced a RoIDataLayer IM_INFO and GT_BOXES (DummyData fills a constant top once, so
    they stay)."""
    for lp in param.layer:
        if lp.type != "DummyData":
            continue
        for top, shape in zip(lp.top, lp.dummy_data_param.shape):
            if top not in net.blobs:
                continue
            if list(shape.dim) == [1, 1, 1, 8]:
                net.blobs[top].data[...] = np.reshape(GROUND_TRUTH, (1, 1, 1, 8))
            elif top == "im_info" and list(shape.dim) == [1, 3]:
                net.blobs[top].data[...] = [IM_INFO]
            elif top == "gt_boxes" and list(shape.dim) == [1, 5]:
                net.blobs[top].data[...] = [GT_BOXES]


# A filler draws at most this many values of a blob; the rest repeat them (see quick_fillers)
FILLER_SAMPLE = 1 << 20


@pytest.fixture
def quick_fillers(monkeypatch):
    """The nets' own fillers, but a large blob (AlexNet's fc6: 38M weights) gets its first rows
    drawn and repeated: the values keep the filler's distribution and scale (the fan-in comes
    from the rows' shape), and a net builds in a fraction of the time, which drawing 61M
    random numbers took for AlexNet."""
    from caffepy import fillers
    real = fillers.fill

    def fill(param, shape):
        shape = tuple(int(d) for d in shape)
        row = math.prod(shape[1:])
        if len(shape) < 2 or math.prod(shape) <= FILLER_SAMPLE or param.type in ("constant", "bilinear", "gabor"):
            return real(param, shape)
        rows = real(param, (max(1, FILLER_SAMPLE // row),) + shape[1:])
        return np.resize(rows, shape)

    monkeypatch.setattr(fillers, "fill", fill)


TRAINING_ONLY = {"rpn.anchor_target_layer", "rpn.proposal_target_layer"}

# Python layer modules the trees ship, and where (their `import caffe` gets caffepy)
PYTHON_MODULES = {"pyloss": os.path.join("examples", "pycaffe", "layers")}


# py-faster-rcnn's lib/rpn layers (Python 2 code its users put on their path) -> the layers of
# examples/faster_rcnn/rcnn_layers.py, which have their interfaces and stand in for them
RPN_STAND_INS = {"rpn.anchor_target_layer": "AnchorTargetLayer", "rpn.proposal_layer": "ProposalLayer",
                 "rpn.proposal_target_layer": "ProposalTargetLayer"}


@pytest.fixture
def python_layers(name, monkeypatch):
    import caffepy
    root = {"intel": INTEL_TREE, "bvlc": BVLC_TREE}.get(name.split("/")[0])
    if root:
        for where in PYTHON_MODULES.values():
            monkeypatch.syspath_prepend(os.path.join(root, where))
        monkeypatch.setitem(sys.modules, "caffe", caffepy)
        monkeypatch.syspath_prepend(os.path.join(REPO, "examples", "faster_rcnn"))
        import rcnn_layers
        monkeypatch.setitem(sys.modules, "rpn", types.ModuleType("rpn"))
        for module, cls in RPN_STAND_INS.items():
            stand_in = types.ModuleType(module)
            setattr(stand_in, cls, getattr(rcnn_layers, cls))
            monkeypatch.setitem(sys.modules, module, stand_in)


@pytest.mark.skipif(not CORPUS, reason="no reference models and no CAFFEPY_INTEL_CAFFE / CAFFEPY_BVLC_CAFFE tree")
@pytest.mark.parametrize("phase", [caffe_pb2.TRAIN, caffe_pb2.TEST], ids=["TRAIN", "TEST"])
@pytest.mark.parametrize("name", [pytest.param(k, id=k, marks=pytest.mark.slow if k.split("/", 1)[1] in SLOW else ())
                                  for k in CORPUS])
def test_net_runs_a_step_or_is_refused_for_another_issue(name, phase, summary, python_layers, quick_fillers):
    path = CORPUS[name]
    key = (name, caffe_pb2.Phase.Name(phase))
    start = time.perf_counter()
    try:
        kind, what = sweep(path, phase)
    except Exception as e:
        RESULTS[key] = ("failed", f"{type(e).__name__}: {e}", time.perf_counter() - start)
        raise
    RESULTS[key] = (kind, what, time.perf_counter() - start)
    if kind == "other phase":
        pytest.skip(f"not a {key[1]} net: {what}")
    assert kind in ("ran", "refused", "left"), what


def sweep(path, phase):
    """What the sweep makes of the net at `path` in `phase`: (kind, what), kind one of "ran",
    "other phase", "refused", "left", "failed"; `what` says why. A CaffepyError
    that is not one line naming the file, and any other exception, propagate."""
    param = synthetic_net(U.read_net(path))
    stages = _stages(param, phase)
    missing = _unproduced(param, phase, stages) or _training_only(param, phase)
    if missing:
        return "other phase", missing
    try:
        net = Net(param, phase=phase, stages=stages, source=path)
        _global_stats(net)
        _ground_truth(net, param)
        loss = net.forward_backward()
    except CaffepyError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(path), message
        reason = refusal_reason(message)
        if reason in OTHER_ISSUES:
            return "refused", f"{reason} ({OTHER_ISSUES[reason]})"
        if reason in LEFT:
            return "left", f"{reason}: {LEFT[reason][1]}"
        return "failed", message
    bad = _finite(net, loss)
    if bad:
        return "failed", f"not finite: {bad[:5]}"
    if phase == caffe_pb2.TEST:
        differ = _shared_twin_differs(net, param, stages, path)
        if differ:
            return "failed", f"keep_blobs=False changes outputs {differ}"
        if differ is not None:
            return "ran", TWIN_SAME
    return "ran", ""


TWIN_SAME = "the same outputs with keep_blobs=False"


def _shared_twin_differs(net, param, stages, path):
    """The outputs (names) that the TEST net built with keep_blobs=False (its activations in
    shared arenas: caffepy/net_memory.py) computes otherwise, bit for bit, from the same weights
    and the same data layers' tops, at its first forward (on the arenas planned before it) or
    its second ([] when none); None for a net whose layers past its data layers make values of
    their own (DummyData): not compared."""
    start = 0
    while start < len(net.layers) and not net.bottom_vecs[start]:
        start += 1
    if any(not bottoms for bottoms in net.bottom_vecs[start:]):
        return None
    twin = Net(param, phase=caffe_pb2.TEST, stages=stages, source=path, keep_blobs=False)
    twin.share_with(net)
    for li in range(start):
        for mine, theirs in zip(twin.top_vecs[li], net.top_vecs[li]):
            mine.reshape(theirs.shape)
            mine.data[...] = theirs.data
    net.forward_from_to(start)
    want = {name: net.blobs[name].data.copy() for name in net.outputs}
    differ = set()
    for _ in range(2):
        twin.forward_from_to(start)
        differ.update(name for name in want
                      if not np.array_equal(twin.blobs[name].data, want[name], equal_nan=True))
    return sorted(differ)


@pytest.fixture(scope="module")
def summary(request):
    """Print the sweep's counts when the module ends (with or without -s)."""
    start = time.perf_counter()
    yield
    if not RESULTS:
        return
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        _print_summary(time.perf_counter() - start)


def _print_summary(seconds):
    write = print
    kinds = {}
    for (name, phase), (kind, what, took) in sorted(RESULTS.items()):
        kinds.setdefault(kind, []).append((name, phase, what, took))
    write("")
    write(f"Intel/BVLC net sweep: {len(RESULTS)} net-phases in {seconds:.0f} s")
    write(f"  built and ran one step: {len(kinds.get('ran', []))}")
    twins = sum(what == TWIN_SAME for _, _, what, _ in kinds.get("ran", []))
    write(f"    TEST nets whose keep_blobs=False twin (shared activations) gave the same outputs: {twins}")
    write(f"  not a net of that phase (skipped): {len(kinds.get('other phase', []))}")
    for kind in ("refused", "left"):
        reasons = {}
        for _, _, what, _ in kinds.get(kind, []):
            reasons[what] = reasons.get(what, 0) + 1
        title = {"refused": "refused for another issue", "left": "refused, left out on purpose"}[kind]
        write(f"  {title}: {len(kinds.get(kind, []))}")
        for what, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            write(f"    {n:4d}  {what}")
    write(f"  failed: {len(kinds.get('failed', []))}")
    for name, phase, what, _ in kinds.get("failed", []):
        write(f"    {name} {phase}: {what[:300]}")
    slowest = sorted((r for rows in kinds.values() for r in rows), key=lambda r: -r[3])[:10]
    write("  slowest: " + ", ".join(f"{name} {phase} {t:.1f} s" for name, phase, _, t in slowest))


# -- the sweep's own rules -------------------------------------------------------------------------

@pytest.mark.parametrize("message,reason", [
    ("layer 'l' (MultiBoxLoss): type: unknown layer type 'MultiBoxLoss'. Known types: AbsVal", None),
    ("layer 'c' (Convolution): bottom: needs a 4-axis (N, C, H, W) blob, got (1, 1, 128, 128, 64)", "3-D convolution"),
    # anything else fails the sweep
    ("layer 'c' (Convolution): convolution_param.engine: unknown engine, got BOGUS", None),
    ("layer 'x' (Frobnicate): type: unknown layer type 'Frobnicate'. Known types: AbsVal", None),
    ("layer 'p' (Python): python_param.module: cannot import module, got 'pyloss'. Put pyloss.py", None),
    ("layer 'p' (Python): python_param.module: cannot import module, got 'rpn.proposal_layer'. Put rpn.py", None),
    ("layer 'c' (Convolution): bottom: needs a 4-axis (N, C, H, W) blob, got (1, 128)", None),
    ("layer 'c' (Convolution): blobs[0] filler: unknown filler type 'gabor'", None),
])
def test_refusals_map_to_their_issue_or_fail(message, reason):
    assert refusal_reason(f"/m/net.prototxt: {message}") == reason


def test_synthetic_net_replaces_data_layers_and_cuts_batches():
    from caffepy.prototxt import parse_text
    net = parse_text(caffe_pb2.NetParameter(), """
        bn_stats_batch_size: 32
        layer { name: "d" type: "Data" top: "data" top: "label" include { phase: TRAIN }
          transform_param { crop_size: 227 } data_param { source: "ilsvrc12_train_lmdb" batch_size: 256 } }
        layer { name: "m" type: "Data" top: "data" top: "label" include { phase: TEST }
          data_param { source: "examples/mnist/mnist_test_lmdb" batch_size: 100 } }
        layer { name: "z" type: "Input" top: "z" input_param { shape { dim: 64 dim: 100 } } }
        layer { name: "r" type: "Reshape" bottom: "z" top: "r" reshape_param { shape { dim: 64 dim: 100 dim: 1 dim: 1 } } }
        layer { name: "bn" type: "BatchNorm" bottom: "r" top: "r" batch_norm_param { stats_batch_size: 2 } }""")
    out = synthetic_net(net)
    shapes = [[tuple(s.dim) for s in lp.dummy_data_param.shape] for lp in out.layer[:3]]
    assert [lp.type for lp in out.layer[:3]] == ["DummyData"] * 3
    assert shapes == [[(BATCH, 3, 227, 227), (BATCH,)], [(BATCH, 1, 28, 28), (BATCH,)], [(BATCH, 100)]]
    assert [r.phase for r in out.layer[0].include] == [caffe_pb2.TRAIN]
    assert list(out.layer[3].reshape_param.shape.dim) == [BATCH, 100, 1, 1]
    assert out.bn_stats_batch_size == 1 and out.layer[4].batch_norm_param.stats_batch_size == 2
