"""pycaffe's tutorials in one script, on the bundled 8x8 digits: solving from Python, net
surgery, and classification with caffe.Classifier. Written against pycaffe's API: only the
imports name caffepy (`import caffe` -> `import caffepy as caffe`, `from caffe import ...` ->
`from caffepy import ...`).

    python examples/pycaffe/tutorial.py [--work DIR] [--iters N]

1. Solving from Python (pycaffe's "learning LeNet"): write the train and test nets with
   NetSpec, load a solver with caffe.SGDSolver (or caffe.get_solver), hand the images over with
   set_input_arrays, run solver.step and solver.net.forward, and score the test net by hand.
2. Net surgery: set filters by hand, then turn the classifier's InnerProduct layers into
   Convolutions (copying the reshaped weights) so the net scores every window of a larger image.
3. Classification: caffe.Classifier on the trained weights, with the training preprocessing
   (mean, raw_scale, input_scale) given to its Transformer.
4. Drawing the net with caffe.draw (a PNG when Graphviz's dot is installed, else the DOT text).
"""
import argparse
import os
import shutil

# This net's layers are too small to gain from a second OpenMP thread, and on a busy machine
# extra threads wait on each other at every parallel region (as the digits demo notes); the
# variable is read once, when the kernels load. Set OMP_NUM_THREADS yourself to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from google.protobuf import text_format  # noqa: E402

import caffepy as caffe  # noqa: E402
from caffepy import layers as L, params as P  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DIGITS = os.path.join(HERE, "..", "digits")
SIZE = 16                      # the digits are upscaled from 8x8, as the digits demo does


# -- data ---------------------------------------------------------------------------
def load_split(list_file):
    """Images (H x W x 1 in [0, 1], as caffe.io.load_image gives them) and labels of a list file."""
    images, labels = [], []
    with open(os.path.join(DIGITS, list_file)) as f:
        for line in f:
            name, label = line.split()
            images.append(caffe.io.load_image(os.path.join(DIGITS, "images", name), color=False))
            labels.append(int(label))
    return images, np.array(labels, np.float32)


def preprocessing(shape, mean):
    """The Transformer that turns an image into the net's input: resize, transpose, 0-255,
    subtract the mean, scale by 1/64."""
    t = caffe.io.Transformer({"data": shape})
    t.set_transpose("data", (2, 0, 1))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([mean]))
    t.set_input_scale("data", 1 / 64)
    return t


# -- 1. solving from Python ------------------------------------------------------------
def lenet(batch_size, with_accuracy=False):
    n = caffe.NetSpec()
    n.data, n.label = L.MemoryData(batch_size=batch_size, channels=1, height=SIZE, width=SIZE, ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=3, num_output=50, weight_filler=dict(type="xavier"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool2, num_output=100, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    if with_accuracy:
        n.accuracy = L.Accuracy(n.ip2, n.label)
    return n.to_proto()


def solve(work, iters, train_x, train_y, test_x, test_y):
    with open(os.path.join(work, "lenet_train.prototxt"), "w") as f:
        f.write(str(lenet(64)))
    with open(os.path.join(work, "lenet_test.prototxt"), "w") as f:
        f.write(str(lenet(74, with_accuracy=True)))
    solver_path = os.path.join(work, "lenet_solver.prototxt")
    with open(solver_path, "w") as f:
        f.write(f'train_net: "{work}/lenet_train.prototxt"\n'
                f'test_net: "{work}/lenet_test.prototxt"\n'
                f"test_iter: 4\ntest_interval: {iters}\n"
                "base_lr: 0.01\nmomentum: 0.9\nweight_decay: 0.0005\n"
                'lr_policy: "inv"\ngamma: 0.0001\npower: 0.75\n'
                f"display: 100\nmax_iter: {iters}\nsnapshot: 0\n"
                f'snapshot_prefix: "{work}/lenet"\nrandom_seed: 1\nsolver_mode: CPU\n')

    solver = caffe.SGDSolver(solver_path)      # or caffe.get_solver(solver_path)
    solver.net.set_input_arrays(train_x, train_y)
    solver.test_nets[0].set_input_arrays(test_x, test_y)
    print("blobs:", [(k, v.data.shape) for k, v in solver.net.blobs.items()])
    print("params:", [(k, v[0].data.shape) for k, v in solver.net.params.items()])

    solver.net.forward()                        # one batch through the train net
    solver.test_nets[0].forward()
    print(f"labels of the first test batch: {solver.test_nets[0].blobs['label'].data[:8].astype(int)}")

    train_loss = np.zeros(iters)
    for it in range(iters):
        solver.step(1)                          # forward, backward, update
        train_loss[it] = solver.net.blobs["loss"].data
        if it % 100 == 0 or it == iters - 1:
            correct = 0
            for _ in range(4):                  # the test split is 4 batches of 74
                solver.test_nets[0].forward()
                correct += int((solver.test_nets[0].blobs["ip2"].data.argmax(1)
                                == solver.test_nets[0].blobs["label"].data).sum())
            print(f"iteration {it}: train loss {train_loss[it]:.4f}, test accuracy {correct / 296:.3f}")
    weights = os.path.join(work, "lenet.caffemodel")
    solver.net.save(weights)
    return train_loss, correct / 296, weights


# -- 2. net surgery ---------------------------------------------------------------------
def deploy(path, fully_convolutional=False, height=SIZE, width=SIZE, batch=1):
    """The trained net for inference; fully convolutional: ip1 and ip2 become Convolutions
    (ip1 sees pool2's 50 x 2 x 2, so a 2 x 2 kernel; ip2 a 1 x 1 kernel)."""
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[batch, 1, height, width]))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20)
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=3, num_output=50)
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    if fully_convolutional:
        n["ip1-conv"] = L.Convolution(n.pool2, kernel_size=2, num_output=100)
        n.relu1 = L.ReLU(n["ip1-conv"], in_place=True)
        n["ip2-conv"] = L.Convolution(n.relu1, kernel_size=1, num_output=10)
        n.prob = L.Softmax(n["ip2-conv"])
    else:
        n.ip1 = L.InnerProduct(n.pool2, num_output=100)
        n.relu1 = L.ReLU(n.ip1, in_place=True)
        n.ip2 = L.InnerProduct(n.relu1, num_output=10)
        n.prob = L.Softmax(n.ip2)
    with open(path, "w") as f:
        f.write(str(n.to_proto()))
    return path


def surgery(work, weights, t, images, labels):
    net = caffe.Net(deploy(os.path.join(work, "deploy.prototxt")), weights, caffe.TEST)

    # Editing parameters: conv1's first filter becomes the identity (a 1 at the centre), so its
    # output is the input's centre 12 x 12.
    conv1 = caffe.Net(deploy(os.path.join(work, "deploy.prototxt")), weights, caffe.TEST)
    conv1.params["conv1"][0].data[0] = 0
    conv1.params["conv1"][0].data[0, 0, 2, 2] = 1
    conv1.params["conv1"][1].data[0] = 0
    x = t.preprocess("data", images[0])
    conv1.forward(data=x[None], end="conv1")
    assert np.allclose(conv1.blobs["conv1"].data[0, 0], x[0, 2:-2, 2:-2])
    print("net surgery: a hand-set identity filter reproduces the input")

    # Casting the classifier into a fully convolutional net: the same weights, reshaped.
    full = caffe.Net(deploy(os.path.join(work, "deploy_full_conv.prototxt"), True, SIZE, 2 * SIZE),
                     weights, caffe.TEST)
    for fc, conv in (("ip1", "ip1-conv"), ("ip2", "ip2-conv")):
        print(f"{fc} weights {net.params[fc][0].data.shape} -> {conv} weights {full.params[conv][0].data.shape}")
        full.params[conv][0].data.flat = net.params[fc][0].data.flat
        full.params[conv][1].data[...] = net.params[fc][1].data
    full.save(os.path.join(work, "lenet_full_conv.caffemodel"))

    # two test digits side by side (1 x 16 x 32): the first and last columns of the score map
    # are the classifier's answers for each (one map step is 4 pixels: the two 2x poolings)
    pair = np.concatenate([t.preprocess("data", images[0]), t.preprocess("data", images[1])], axis=2)
    scores = full.forward(data=pair[None])["prob"][0]
    print(f"score map {scores.shape}: argmax per position {scores.argmax(0).ravel()}, "
          f"labels {int(labels[0])} and {int(labels[1])}")
    for image, column in ((images[0], 0), (images[1], -1)):
        single = net.forward(data=t.preprocess("data", image)[None])["prob"][0]
        assert np.allclose(scores[:, 0, column], single, atol=1e-5)
    print("net surgery: the fully convolutional net scores each digit as the classifier does")
    return scores


# -- 3. classification -----------------------------------------------------------------
def classify(work, weights, mean, images, labels):
    # the Classifier runs its crops in batches of the deploy net's batch size (here 10)
    model = deploy(os.path.join(work, "deploy_batch10.prototxt"), batch=10)
    clf = caffe.Classifier(model, weights, image_dims=(SIZE, SIZE), mean=np.array([mean]), raw_scale=255,
                           input_scale=1 / 64)
    centre = clf.predict(images, oversample=False)
    accuracy = float((centre.argmax(1) == labels).mean())
    # ten crops (here: the whole image five times and its mirror five times; mirrored digits
    # are other shapes, so averaging them in costs accuracy on this data)
    ten = clf.predict(images[:50])
    print(f"Classifier: {len(images)} test digits, centre-crop accuracy {accuracy:.3f}; "
          f"oversampled accuracy on the first 50 {float((ten.argmax(1) == labels[:50]).mean()):.3f}")
    print(f"first prediction: class {centre[0].argmax()} with probability {centre[0].max():.3f} "
          f"(label {int(labels[0])})")
    return accuracy


# -- 4. drawing ----------------------------------------------------------------------
def draw(work):
    train = caffe_pb2.NetParameter()
    with open(os.path.join(work, "lenet_train.prototxt")) as f:
        text_format.Merge(f.read(), train)
    out = os.path.join(work, "lenet.png" if shutil.which("dot") else "lenet.raw")
    caffe.draw.draw_net_to_file(train, out, "LR")
    print(f"drew the train net to {out}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=os.path.join(HERE, "work"), help="where to write nets and weights")
    ap.add_argument("--iters", type=int, default=300, help="training iterations")
    args = ap.parse_args(argv)
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    caffe.set_mode_cpu()
    caffe.set_random_seed(1)

    train_images, train_y = load_split("train.txt")
    test_images, test_y = load_split("test.txt")
    train_images, train_y = train_images[:1472], train_y[:1472]      # 23 batches of 64
    mean = 255 * float(np.mean([caffe.io.resize_image(im, (SIZE, SIZE)).mean() for im in train_images]))
    t = preprocessing((1, 1, SIZE, SIZE), mean)
    train_x = np.stack([t.preprocess("data", im) for im in train_images])
    test_x = np.stack([t.preprocess("data", im) for im in test_images])

    loss, accuracy, weights = solve(work, args.iters, train_x, train_y, test_x, test_y)
    surgery(work, weights, t, test_images, test_y)
    clf_accuracy = classify(work, weights, mean, test_images, test_y)
    draw(work)
    print(f"done: final train loss {loss[-1]:.4f}, test accuracy {accuracy:.3f} (solver), "
          f"{clf_accuracy:.3f} (Classifier)")
    return loss, accuracy, clf_accuracy


if __name__ == "__main__":
    main()
