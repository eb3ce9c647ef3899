"""Export scikit-learn's 1,797 8x8 handwritten digits as the PNGs and list files of this demo.

Run once, in any environment that has scikit-learn and OpenCV (scikit-learn is not a
caffepy dependency; the exported files are committed):

    python examples/digits/export_digits.py

Pixels 0..16 become 0..255 (round(v * 255 / 16)), one 8x8 grayscale PNG per digit,
images/NNNN.png numbered as in sklearn.datasets.load_digits. The split is stratified
and deterministic: within each class, every 6th digit (in dataset order) goes to
test.txt (296 digits), the others to train.txt (1,501), which is written in a fixed
shuffled order (seed 0) so training batches mix the classes.
"""
import os

import cv2
import numpy as np
from sklearn.datasets import load_digits

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    labels = digits.target.astype(int)
    os.makedirs(os.path.join(HERE, "images"), exist_ok=True)
    for i, img in enumerate(images):
        cv2.imwrite(os.path.join(HERE, "images", f"{i:04d}.png"), img)
    train, test = [], []
    seen = {}
    for i, label in enumerate(labels):
        k = seen.get(label, 0)
        seen[label] = k + 1
        (test if k % 6 == 5 else train).append(i)
    train = [train[j] for j in np.random.default_rng(0).permutation(len(train))]
    for name, indices in (("train.txt", train), ("test.txt", test)):
        with open(os.path.join(HERE, name), "w") as f:
            f.writelines(f"{i:04d}.png {labels[i]}\n" for i in indices)
    print(f"{len(images)} images: {len(train)} train, {len(test)} test")


if __name__ == "__main__":
    main()
