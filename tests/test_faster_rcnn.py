"""Faster R-CNN end to end as py-faster-rcnn's users run it: Python layers that `import caffe`,
SmoothL1Loss with inside and outside weights, ROIPooling, trained on the generated shapes set
(caffepy.data.shapes) through pycaffe's API. The net and our Python layers with
py-faster-rcnn's interfaces are examples/faster_rcnn/.

With CAFFEPY_PY_FASTER_RCNN pointing at a py-faster-rcnn checkout (its lib/ with rpn/,
fast_rcnn/, utils/, nms/), the same net trains with py-faster-rcnn's own lib/rpn layers in
place of ours. py-faster-rcnn is Python 2 code: the test runs a copy of those modules through
the edits every Python 3 port of it makes (listed in `_port`), with NumPy stand-ins for its two
Cython extensions (utils.cython_bbox, nms.cpu_nms), and needs its own requirements (PyYAML,
easydict).
"""
import os
import re
import shutil
import sys

import numpy as np
import pytest

from paths import REPO

from caffepy.data.shapes import write_shapes

EXAMPLE = os.path.join(REPO, "examples", "faster_rcnn")
sys.path.insert(0, EXAMPLE)
R = T = None


@pytest.fixture(autouse=True)
def example():
    """The example's modules, imported in a test (their `import caffe` binds the name, which
    conftest undoes after each test)."""
    global R, T
    import rcnn_layers
    import train_and_eval
    R, T = rcnn_layers, train_and_eval


def test_anchors_are_faster_rcnns():
    # Faster R-CNN's nine anchors of feature stride 16 as its MATLAB code lists them (1-based
    # pixels, hence the - 1 for py-faster-rcnn's 0-based ones)
    matlab = [[-83, -39, 100, 56], [-175, -87, 192, 104], [-359, -183, 376, 200],
              [-55, -55, 72, 72], [-119, -119, 136, 136], [-247, -247, 264, 264],
              [-35, -79, 52, 96], [-79, -167, 96, 184], [-167, -343, 184, 360]]
    np.testing.assert_array_equal(R.generate_anchors(), np.array(matlab) - 1)


@pytest.mark.parametrize("text,want", [
    ("'num_classes': 21", {"num_classes": 21}),
    ("{'feat_stride': 8, 'scales': [1, 2, 3]}", {"feat_stride": 8, "scales": [1, 2, 3]}),
    # py-faster-rcnn's COCO nets: one entry a line, YAML's tuple tag
    ("'feat_stride': 16 \n'scales': !!python/tuple [4, 8, 16, 32]", {"feat_stride": 16, "scales": [4, 8, 16, 32]}),
    ("", {}),
])
def test_param_str_reads_as_py_faster_rcnn_writes_it(text, want):
    assert R.parse_params(text) == want


def _losses_fall(losses, window, ratio):
    first, last = losses[:window].sum(axis=1).mean(), losses[-window:].sum(axis=1).mean()
    assert np.isfinite(losses).all()
    assert last < ratio * first, f"loss {first:.3f} -> {last:.3f}"
    return first, last


def test_faster_rcnn_trains_on_shapes(tmp_path):
    root = str(tmp_path / "shapes")
    write_shapes(root, trainval=24, test=0)
    solver, losses = T.train(T.prepare(str(tmp_path), root, iters=150), 150)
    _losses_fall(losses, 30, 0.85)
    # RPN classification, the first to learn: objects from background
    assert losses[-30:, 0].mean() < 0.7 * losses[:30, 0].mean()


def test_rfcn_with_online_hard_example_mining_trains_on_shapes(tmp_path):
    """Intel's R-FCN OHEM wiring: PSROIPooling, the OHEM losses' per-ROI tops summed by an
    Eltwise, BoxAnnotatorOHEM keeping 32 of the 64 ROIs for the losses that train."""
    root = str(tmp_path / "shapes")
    write_shapes(root, trainval=24, test=0)
    solver, losses = T.train(T.prepare(str(tmp_path), root, iters=300, net="train_rfcn_ohem.prototxt"), 300)
    # the head's losses are over the hardest ROIs, so they fall slowly by design (2.23 -> 1.71
    # in 300 iterations here, 2.08 in the first 150); the RPN's fall fast
    _losses_fall(losses, 30, 0.85)
    assert losses[-30:, 0].mean() < 0.5 * losses[:30, 0].mean()
    net = solver.net
    labels, kept = net.blobs["labels"].data.reshape(-1), net.blobs["labels_ohem"].data.reshape(-1)
    assert len(labels) == 64 and np.sum(kept != -1) == 32
    # the kept ROIs are the ones of highest loss, their labels unchanged
    loss = net.blobs["per_roi_loss"].data.reshape(-1)
    assert loss[kept != -1].min() >= loss[kept == -1].max()
    np.testing.assert_array_equal(kept[kept != -1], labels[kept != -1])


@pytest.mark.slow
def test_faster_rcnn_learns_to_detect_shapes(tmp_path):
    """The figures of the README: 2000 iterations on 200 images, mAP on 50 more."""
    root = str(tmp_path / "shapes")
    write_shapes(root, trainval=200, test=50)
    path = T.prepare(str(tmp_path), root, iters=2000)
    before, _ = T.evaluate(T.test_net(T.caffe.SGDSolver(path).net), root)
    solver, losses = T.train(path, 2000)
    _losses_fall(losses, 200, 0.7)
    after, aps = T.evaluate(T.test_net(solver.net), root)
    assert after > 0.5 and after > before + 0.4, (before, after, aps)


# -- py-faster-rcnn's own layers -------------------------------------------------------------
PY_FASTER_RCNN = os.environ.get("CAFFEPY_PY_FASTER_RCNN")

CYTHON_BBOX = '''
import numpy as np


def bbox_overlaps(boxes, query_boxes):
    iw = np.minimum(boxes[:, None, 2], query_boxes[None, :, 2]) - np.maximum(boxes[:, None, 0], query_boxes[None, :, 0]) + 1
    ih = np.minimum(boxes[:, None, 3], query_boxes[None, :, 3]) - np.maximum(boxes[:, None, 1], query_boxes[None, :, 1]) + 1
    inter = np.clip(iw, 0, None) * np.clip(ih, 0, None)
    area = lambda b: (b[:, 2] - b[:, 0] + 1) * (b[:, 3] - b[:, 1] + 1)
    return inter / (area(boxes)[:, None] + area(query_boxes)[None, :] - inter)
'''
CPU_NMS = '''
import numpy as np
import rcnn_layers


def cpu_nms(dets, thresh):
    return list(rcnn_layers.nms(dets[:, :4].astype(np.float64), dets[:, 4], thresh))
'''
GPU_NMS = '''
def gpu_nms(dets, thresh, device_id=0):
    raise RuntimeError("no GPU: set cfg.USE_GPU_NMS = False")
'''


def _print_calls(text):
    """Python 2's print statements as print() calls, continuation lines included."""
    out, lines = [], iter(text.splitlines())
    for line in lines:
        m = re.match(r"^(\s*)print\b(?!\()(.*)$", line)
        if not m:
            out.append(line)
            continue
        body = m.group(2).strip()
        while sum(body.count(c) for c in "([{") > sum(body.count(c) for c in ")]}"):
            body += " " + next(lines).strip()
        out.append(f"{m.group(1)}print({body})")
    return "\n".join(out) + "\n"


def _port(text):
    """The edits of a Python 3 (and NumPy 2, PyYAML 6) port of py-faster-rcnn."""
    text = _print_calls(text)
    text = text.replace("yaml.load(", "yaml.safe_load(")                          # PyYAML 6 wants a Loader
    text = re.sub(r"\bnp\.float\b(?!\d)", "np.float64", text)                     # NumPy 1.24 dropped the aliases
    text = re.sub(r"\bnp\.int\b(?!\d)", "np.int64", text)
    text = re.sub(r"\bxrange\(", "range(", text)
    # float indices and sizes, which NumPy refuses now
    text = text.replace("cfg.TRAIN.BATCH_SIZE / num_images", "cfg.TRAIN.BATCH_SIZE // num_images")
    text = text.replace("cls = clss[ind]", "cls = int(clss[ind])")
    text = text.replace("fg_rois_per_image = np.round(", "fg_rois_per_image = int(np.round(") \
        .replace("cfg.TRAIN.FG_FRACTION * rois_per_image)", "cfg.TRAIN.FG_FRACTION * rois_per_image))")
    return text


@pytest.fixture
def py_faster_rcnn(tmp_path, monkeypatch):
    if not PY_FASTER_RCNN:
        pytest.skip("CAFFEPY_PY_FASTER_RCNN (a py-faster-rcnn checkout) not set")
    for module in ("yaml", "easydict"):
        pytest.importorskip(module, reason=f"py-faster-rcnn needs {module}")
    lib = tmp_path / "lib"
    for package in ("rpn", "fast_rcnn", "utils", "nms"):
        shutil.copytree(os.path.join(PY_FASTER_RCNN, "lib", package), lib / package)
    for path in lib.rglob("*.py"):
        path.write_text(_port(path.read_text()))
    (lib / "utils" / "cython_bbox.py").write_text(CYTHON_BBOX)
    (lib / "nms" / "cpu_nms.py").write_text(CPU_NMS)
    (lib / "nms" / "gpu_nms.py").write_text(GPU_NMS)
    # lib/rpn too: its modules import generate_anchors as a top-level module (Python 2's rule)
    for path in (str(lib), str(lib / "rpn")):
        monkeypatch.syspath_prepend(path)
    for name in list(sys.modules):
        if name.split(".")[0] in ("rpn", "fast_rcnn", "utils", "nms", "generate_anchors"):
            monkeypatch.delitem(sys.modules, name)
    from fast_rcnn.config import cfg
    cfg.USE_GPU_NMS = False
    # py-faster-rcnn's faster_rcnn_end2end.yml, and sizes for 96 x 96 images
    cfg.TRAIN.BBOX_NORMALIZE_TARGETS_PRECOMPUTED = True
    cfg.TRAIN.BG_THRESH_LO = 0.0
    cfg.TRAIN.RPN_BATCHSIZE, cfg.TRAIN.BATCH_SIZE = 128, 64
    cfg.TRAIN.RPN_PRE_NMS_TOP_N, cfg.TRAIN.RPN_POST_NMS_TOP_N, cfg.TRAIN.RPN_MIN_SIZE = 1000, 200, 4
    return cfg


def test_py_faster_rcnn_layers_train_unchanged(tmp_path, py_faster_rcnn):
    root = str(tmp_path / "shapes")
    write_shapes(root, trainval=24, test=0)
    layers = {"anchor_target": "rpn.anchor_target_layer", "proposal": "rpn.proposal_layer",
              "proposal_target": "rpn.proposal_target_layer"}
    solver, losses = T.train(T.prepare(str(tmp_path), root, layers=layers, iters=150), 150)
    import rpn.proposal_layer
    from generate_anchors import generate_anchors
    assert any(isinstance(layer, rpn.proposal_layer.ProposalLayer) for layer in solver.net.layers)
    np.testing.assert_array_equal(generate_anchors(scales=np.array((1, 2, 3))), R.generate_anchors(scales=(1, 2, 3)))
    _losses_fall(losses, 30, 0.85)
