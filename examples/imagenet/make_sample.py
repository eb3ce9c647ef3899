"""A small synthetic stand-in for ImageNet (ILSVRC12), at the paths models/intel_alexnet and
models/mpi_intel_alexnet name, to try those nets before the real data (`make imagenet-sample`).

    python examples/imagenet/make_sample.py [--classes 10] [--train 40] [--val 10] [--root .]

It writes, under --root (the directory you run `caffepy train` from; the repository root):

    examples/imagenet/sample/train/<wnid>/<wnid>_<i>.JPEG   --classes x --train images
    examples/imagenet/sample/val/ILSVRC2012_val_<i>.JPEG     --classes x --val images
    examples/imagenet/sample/train.txt, val.txt              Caffe's `path label` lists
    examples/imagenet/ilsvrc12_train_lmdb, ilsvrc12_val_lmdb  caffepy convert_imageset, 256 x 256
    data/ilsvrc12/imagenet_mean.binaryproto                  caffepy compute_image_mean

The images are JPEGs of ImageNet's usual sizes (sides of 250 to 500 pixels, mostly
landscape), each class a colour and a shape on a noisy background, so a net can learn them.
It runs the same caffepy commands as models/intel_alexnet/README.md does for the real data.
Existing LMDBs are never replaced (real ImageNet ones may sit there): it stops and says so.
Needs `caffepy` on PATH (the make target puts the venv's bin first).
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

import cv2
import numpy as np

SAMPLE = os.path.join("examples", "imagenet", "sample")
TRAIN_DB = os.path.join("examples", "imagenet", "ilsvrc12_train_lmdb")
VAL_DB = os.path.join("examples", "imagenet", "ilsvrc12_val_lmdb")
MEAN = os.path.join("data", "ilsvrc12", "imagenet_mean.binaryproto")
# (width, height) of common ImageNet photos
SIZES = [(500, 375), (500, 333), (375, 500), (500, 500), (400, 300), (500, 400), (333, 500), (300, 250)]


def image(gen, label, classes):
    """One photo-sized JPEG's pixels: class `label`'s colour and shape, at a random place and
    scale, over noise."""
    w, h = SIZES[gen.integers(len(SIZES))]
    img = gen.normal(110, 40, (h, w, 3)).clip(0, 255).astype(np.uint8)
    img = cv2.GaussianBlur(img, (0, 0), 3)
    hue = int(180 * label / classes)
    colour = cv2.cvtColor(np.uint8([[[hue, 200, 220]]]), cv2.COLOR_HSV2BGR)[0, 0].tolist()
    size = int(min(w, h) * gen.uniform(0.25, 0.45))
    cx, cy = int(gen.integers(size, w - size)), int(gen.integers(size, h - size))
    shape = label % 3
    if shape == 0:
        cv2.circle(img, (cx, cy), size, colour, -1)
    elif shape == 1:
        cv2.rectangle(img, (cx - size, cy - size), (cx + size, cy + size), colour, -1)
    else:
        points = np.array([[cx, cy - size], [cx - size, cy + size], [cx + size, cy + size]], np.int32)
        cv2.fillPoly(img, [points], colour)
    return img


def write_images(root, classes, per_class, split, gen):
    lines = []
    for i in range(classes * per_class):
        label = i % classes
        if split == "train":
            wnid = f"n{label:08d}"
            rel = f"{wnid}/{wnid}_{i // classes}.JPEG"
        else:
            rel = f"ILSVRC2012_val_{i + 1:08d}.JPEG"
        path = os.path.join(root, SAMPLE, split, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cv2.imwrite(path, image(gen, label, classes), [cv2.IMWRITE_JPEG_QUALITY, 90])
        lines.append(f"{rel} {label}\n")
    with open(os.path.join(root, SAMPLE, f"{split}.txt"), "w") as f:
        f.writelines(lines)


def caffepy(*args, cwd):
    exe = shutil.which("caffepy")
    if exe is None:
        sys.exit("make_sample.py: `caffepy` is not on PATH; run it through `make imagenet-sample` "
                 "or activate the venv (source .venv/bin/activate)")
    print("+ caffepy " + " ".join(args), flush=True)
    subprocess.run([exe, *args], cwd=cwd, check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--train", type=int, default=40, help="training images per class")
    parser.add_argument("--val", type=int, default=10, help="validation images per class")
    parser.add_argument("--root", default=".", help="where the models' relative paths start (default: .)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    done = os.path.join(root, SAMPLE, "DONE")
    existing = [p for p in (TRAIN_DB, VAL_DB) if os.path.exists(os.path.join(root, p))]
    if existing and os.path.exists(done) and os.path.exists(os.path.join(root, MEAN)):
        print(f"The ImageNet sample is already built ({', '.join(existing)}); "
              f"remove {SAMPLE} and the LMDBs to rebuild it.")
        return
    if existing:
        sys.exit(f"make_sample.py: {', '.join(existing)} already exist{'s' if len(existing) == 1 else ''} "
                 f"(real ImageNet LMDBs?); not replacing them. Remove them to build the sample.")
    start = time.time()
    shutil.rmtree(os.path.join(root, SAMPLE), ignore_errors=True)
    gen = np.random.default_rng(args.seed)
    write_images(root, args.classes, args.train, "train", gen)
    write_images(root, args.classes, args.val, "val", gen)
    os.makedirs(os.path.join(root, os.path.dirname(MEAN)), exist_ok=True)
    sample = os.path.join(SAMPLE, "")
    caffepy("convert_imageset", "--resize_height=256", "--resize_width=256", "--shuffle",
            sample + "train/", sample + "train.txt", TRAIN_DB, cwd=root)
    caffepy("convert_imageset", "--resize_height=256", "--resize_width=256",
            sample + "val/", sample + "val.txt", VAL_DB, cwd=root)
    caffepy("compute_image_mean", TRAIN_DB, MEAN, cwd=root)
    with open(done, "w") as f:
        f.write(f"{args.classes} classes, {args.classes * args.train} train, {args.classes * args.val} val\n")
    print(f"ImageNet sample: {args.classes * args.train} training and {args.classes * args.val} validation "
          f"JPEGs in {args.classes} classes -> {TRAIN_DB}, {VAL_DB}, {MEAN} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
