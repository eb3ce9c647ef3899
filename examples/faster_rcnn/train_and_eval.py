"""Train the small Faster R-CNN of train.prototxt end to end on the generated shapes set, then
score it on the test split (PASCAL VOC 2007's 11-point mAP, difficult objects not counted),
through pycaffe's API as py-faster-rcnn's tools/train_net.py and tools/test_net.py do.

    python examples/faster_rcnn/train_and_eval.py [--trainval 200] [--test 50] [--iters 2000]
        [--work examples/faster_rcnn/work] [--plot loss.png]

Prints the four losses (RPN classification and box, head classification and box) averaged
over each 100 iterations, the mAP before and after training, and each class's AP.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import caffe  # noqa: E402  (caffepy, by pycaffe's name)
from caffepy.data.shapes import CLASSES, write_shapes  # noqa: E402
import rcnn_layers as R  # noqa: E402

LOSSES = ("rpn_cls_loss", "rpn_loss_bbox", "loss_cls", "loss_bbox")


def prepare(work, root, layers=None, iters=2000, base_lr=0.01, seed=0, net="train.prototxt"):
    """Write work/train.prototxt (`net` of this directory, reading the set at `root`, the Python
    layers from the modules `layers` names: {"anchor_target": ..., "proposal": ...,
    "proposal_target": ...}, ours by default) and work/solver.prototxt; return the solver's
    path."""
    os.makedirs(work, exist_ok=True)
    layers = {"anchor_target": "rcnn_layers", "proposal": "rcnn_layers", "proposal_target": "rcnn_layers",
              **(layers or {})}
    with open(os.path.join(HERE, net)) as f:
        text = f.read().replace("'root': 'examples/shapes/data'", f"'root': '{root}', 'seed': {seed}")
    for key, kind in (("anchor_target", "AnchorTargetLayer"), ("proposal", "ProposalLayer"),
                      ("proposal_target", "ProposalTargetLayer")):
        text = text.replace(f'module: "rcnn_layers" layer: "{kind}"', f'module: "{layers[key]}" layer: "{kind}"')
    with open(os.path.join(work, "train.prototxt"), "w") as f:
        f.write(text)
    with open(os.path.join(HERE, "solver.prototxt")) as f:
        solver = f.read()
    solver = solver.replace('train_net: "examples/faster_rcnn/train.prototxt"',
                            f'train_net: "{os.path.join(work, "train.prototxt")}"')
    solver = solver.replace("max_iter: 2000", f"max_iter: {iters}").replace("base_lr: 0.01", f"base_lr: {base_lr}")
    solver = solver.replace("stepsize: 1500", f"stepsize: {max(1, iters * 3 // 4)}")
    solver = solver.replace("random_seed: 1701", f"random_seed: {1701 + seed}")
    path = os.path.join(work, "solver.prototxt")
    with open(path, "w") as f:
        f.write(solver)
    return path


def train(solver_path, iters):
    """Run the solver `iters` iterations; return it and each iteration's four losses."""
    solver = caffe.SGDSolver(solver_path)
    losses = []
    for _ in range(iters):
        solver.step(1)
        losses.append([float(solver.net.blobs[name].data) for name in LOSSES])
    return solver, np.array(losses)


def detect(net, img, score_threshold=0.05, nms=0.3):
    """Per class (1..), the detections (x1, y1, x2, y2, score) of one BGR image."""
    h, w = img.shape[:2]
    data = (img.astype(np.float32) - R.PIXEL_MEANS).transpose(2, 0, 1)[None]
    net.blobs["data"].reshape(*data.shape)
    net.forward(data=data, im_info=np.array([[h, w, 1.0]], np.float32))
    rois = net.blobs["rois"].data[:, 1:5].astype(np.float64)
    probs = net.blobs["cls_prob"].data.reshape(len(rois), -1)
    deltas = net.blobs["bbox_pred"].data.reshape(len(rois), -1) * np.tile(R.TARGET_STDS, probs.shape[1])
    boxes = R.clip(R.decode(rois, deltas), h, w)
    out = {}
    for c in range(1, probs.shape[1]):
        keep = np.flatnonzero(probs[:, c] > score_threshold)
        b, s = boxes[keep, 4 * c:4 * c + 4], probs[keep, c]
        kept = R.nms(b, s, nms)
        out[c] = np.hstack([b[kept], s[kept, None]])
    return out


def voc07_ap(recall, precision):
    """VOC 2007's 11-point interpolated average precision."""
    return float(np.mean([precision[recall >= t].max() if np.any(recall >= t) else 0.0
                          for t in np.arange(0, 1.1, 0.1)]))


def evaluate(net, root, split="test", classes=CLASSES, iou=0.5):
    """(mAP, [AP per class]) of `net` (test.prototxt's) over a split of the set at `root`."""
    with open(os.path.join(root, "ImageSets", "Main", split + ".txt")) as f:
        ids = [line.strip() for line in f if line.strip()]
    found = {c: [] for c in range(1, len(classes) + 1)}      # (score, image, box)
    truth = {}
    for image_id in ids:
        img, boxes, labels, difficult = R.read_annotations(root, image_id, classes)
        truth[image_id] = (boxes, labels, difficult)
        for c, dets in detect(net, img).items():
            found[c] += [(d[4], image_id, d[:4]) for d in dets]
    aps = []
    for c in range(1, len(classes) + 1):
        positives = sum(int(np.sum((t[1] == c) & ~t[2])) for t in truth.values())
        claimed = {i: np.zeros(len(t[1]), bool) for i, t in truth.items()}
        hits = []
        for score, image_id, box in sorted(found[c], key=lambda d: -d[0]):
            boxes, labels, difficult = truth[image_id]
            same = np.flatnonzero(labels == c)
            hit = None
            if len(same):
                ov = R.overlaps(box[None], boxes[same])[0]
                best = same[int(np.argmax(ov))]
                if ov.max() > iou:
                    hit = None if difficult[best] else (not claimed[image_id][best])
                    claimed[image_id][best] |= hit is True
                else:
                    hit = False
            else:
                hit = False
            if hit is not None:
                hits.append(hit)
        tp = np.cumsum(hits)
        fp = np.cumsum(np.logical_not(hits))
        recall = tp / max(positives, 1)
        precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
        aps.append(voc07_ap(recall, precision) if hits else 0.0)
    return float(np.mean(aps)), aps


def test_net(weights_from):
    """test.prototxt's net with the weights of `weights_from` (a net)."""
    net = caffe.Net(os.path.join(HERE, "test.prototxt"), caffe.TEST)
    net.share_with(weights_from)
    return net


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainval", type=int, default=200)
    p.add_argument("--test", type=int, default=50)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--work", default=os.path.join(HERE, "work"))
    p.add_argument("--plot", help="write the loss curves to this image (needs matplotlib)")
    args = p.parse_args(argv)
    root = os.path.join(args.work, "shapes")
    write_shapes(root, trainval=args.trainval, test=args.test)
    solver_path = prepare(args.work, root, iters=args.iters)
    untrained = caffe.SGDSolver(solver_path)
    before, _ = evaluate(test_net(untrained.net), root)
    start = time.time()
    solver, losses = train(solver_path, args.iters)
    seconds = time.time() - start
    print(f"trained {args.iters} iterations in {seconds:.0f} s ({seconds / args.iters * 1000:.0f} ms each)")
    print("iterations  " + "  ".join(f"{name:>13}" for name in LOSSES) + "          total")
    for i in range(0, args.iters, 100):
        chunk = losses[i:i + 100].mean(axis=0)
        print(f"{i:5d}-{min(i + 100, args.iters) - 1:<5d} " + "  ".join(f"{v:13.4f}" for v in chunk)
              + f"  {chunk.sum():13.4f}")
    after, aps = evaluate(test_net(solver.net), root)
    print(f"test mAP (VOC07 11-point, {args.test} images): untrained {before:.3f}, trained {after:.3f}")
    print("AP per class: " + ", ".join(f"{c} {ap:.3f}" for c, ap in zip(CLASSES, aps)))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        window = 50
        for k, name in enumerate(LOSSES):
            smooth = np.convolve(losses[:, k], np.ones(window) / window, mode="valid")
            plt.plot(np.arange(len(smooth)) + window, smooth, label=name)
        plt.xlabel("iteration")
        plt.ylabel(f"loss (mean of {window})")
        plt.legend()
        plt.title(f"Faster R-CNN on shapes: mAP {before:.2f} -> {after:.2f}")
        plt.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
