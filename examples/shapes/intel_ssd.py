"""Point Intel Caffe's SSD nets at the generated shapes set: the same nets, their data read from
examples/shapes/make_shapes.py's LMDBs.

    python examples/shapes/intel_ssd.py SOLVER_OR_NET DATA_ROOT OUT_DIR [--classes N]
        [--batch B] [--test-batch B] [--max-iter N] [--test-interval N] [--display N]
        [--base-lr X] [--type SOLVER_TYPE] [--stepvalue N ...]

SOLVER_OR_NET is an Intel solver (its train_net and test_net are read, relative to the
directory caffe runs from: CAFFEPY_INTEL_CAFFE or the current one; else beside the solver, where
the AlexNet SSD solver's nets are) or a single net (a TEST-only
net such as ssd_mobilenet/fp32_acc.prototxt). Written to OUT_DIR: the nets with every
AnnotatedData source pointed at DATA_ROOT/trainval_lmdb (TRAIN) or test_lmdb (TEST), every
label_map_file at DATA_ROOT/labelmap.prototxt and name_size_file at DATA_ROOT/test_name_size.txt
(save_output_param, which writes detections to files, is dropped), and the solver with its nets,
snapshot_prefix and test_iter (the test images over the test batch) in OUT_DIR. Nothing else
changes, unless asked: --classes N gives the heads N classes (VOC's nets have 21: the
background and 20; the shapes set has the background and its shapes), as one regenerating the
net for a new dataset would: num_classes of MultiBoxLoss, DetectionOutput and DetectionEvaluate,
the *_mbox_conf convolutions' outputs and mbox_conf_reshape's class axis. The other flags set
batch sizes and solver fields.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from caffepy import prototxt, upgrade  # noqa: E402
from caffepy.errors import CaffepyError  # noqa: E402
from caffepy.proto import caffe_pb2  # noqa: E402


def _classes_of(net):
    for layer in net.layer:
        for field in ("multibox_loss_param", "detection_output_param", "detection_evaluate_param"):
            if layer.HasField(field):
                return getattr(layer, field).num_classes
    return None


def point_net(net, data_root, classes=None, batch=None, test_batch=None):
    """The NetParameter `net` with its data at `data_root` (see the module's docstring)."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    data_root = os.path.abspath(data_root)
    old = _classes_of(out)
    for layer in out.layer:
        if layer.type == "AnnotatedData":
            test = any(rule.phase == caffe_pb2.TEST for rule in layer.include) or \
                (not layer.include and out.state.phase == caffe_pb2.TEST)
            layer.data_param.source = os.path.join(data_root, "test_lmdb" if test else "trainval_lmdb")
            if (test_batch if test else batch):
                layer.data_param.batch_size = test_batch if test else batch
            if layer.annotated_data_param.label_map_file:
                layer.annotated_data_param.label_map_file = os.path.join(data_root, "labelmap.prototxt")
        if layer.HasField("detection_evaluate_param") and layer.detection_evaluate_param.name_size_file:
            layer.detection_evaluate_param.name_size_file = os.path.join(data_root, "test_name_size.txt")
        if layer.HasField("detection_output_param"):
            layer.detection_output_param.ClearField("save_output_param")
        if classes and old and classes != old:
            for field in ("multibox_loss_param", "detection_output_param", "detection_evaluate_param"):
                if layer.HasField(field):
                    getattr(layer, field).num_classes = classes
            if layer.type == "Convolution" and layer.name.endswith("_mbox_conf"):
                layer.convolution_param.num_output = layer.convolution_param.num_output // old * classes
            if layer.type == "Reshape" and layer.name.endswith("mbox_conf_reshape"):
                dims = layer.reshape_param.shape.dim
                for i, d in enumerate(dims):
                    if d == old:
                        dims[i] = classes
    return out


def _test_images(data_root):
    with open(os.path.join(data_root, "test.txt")) as f:
        return sum(1 for line in f if line.strip())


def point_solver(solver_path, data_root, out_dir, root=".", classes=None, batch=None, test_batch=None, **fields):
    """Write the solver at `solver_path` and its nets, pointed at `data_root`, into `out_dir`;
    return the new solver's path. `fields`: solver fields to set (max_iter=..., stepvalue=[...])."""
    os.makedirs(out_dir, exist_ok=True)
    solver = upgrade.read_solver(solver_path)
    if not solver.train_net:
        raise SystemExit(f"{solver_path}: names no train_net (SSD's solvers name train_net and test_net)")
    test_net = None
    for kind in ("train_net", "test_net"):
        paths = getattr(solver, kind)
        for i, path in enumerate(paths if kind == "test_net" else [paths]):
            where = os.path.join(root, path)
            if not os.path.exists(where):   # AlexNet's SSD solver names examples/ssd/...: its nets are beside it
                where = os.path.join(os.path.dirname(solver_path), os.path.basename(path))
            net = upgrade.read_net(where)
            net = point_net(net, data_root, classes, batch, test_batch)
            dest = os.path.join(os.path.abspath(out_dir), f"{kind.split('_')[0]}{'' if i == 0 else i}.prototxt")
            prototxt.write_text(net, dest)
            if kind == "train_net":
                solver.train_net = dest
            else:
                solver.test_net[i] = dest
                test_net = net
    if test_net is not None:
        batch_size = next(l.data_param.batch_size for l in test_net.layer if l.type == "AnnotatedData")
        del solver.test_iter[:]
        solver.test_iter.append(math.ceil(_test_images(data_root) / batch_size))
    solver.snapshot_prefix = os.path.join(os.path.abspath(out_dir), os.path.basename(solver.snapshot_prefix))
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, list):
            del getattr(solver, name)[:]
            getattr(solver, name).extend(value)
        else:
            setattr(solver, name, value)
    dest = os.path.join(out_dir, "solver.prototxt")
    prototxt.write_text(solver, dest)
    return dest


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an Intel solver prototxt, or a single net")
    p.add_argument("data_root", help="make_shapes.py --lmdb's --root")
    p.add_argument("out_dir")
    p.add_argument("--classes", type=int, help="give the heads this many classes (background included)")
    p.add_argument("--batch", type=int)
    p.add_argument("--test-batch", type=int)
    p.add_argument("--max-iter", type=int)
    p.add_argument("--test-interval", type=int)
    p.add_argument("--display", type=int)
    p.add_argument("--snapshot", type=int)
    p.add_argument("--base-lr", type=float)
    p.add_argument("--type", help="the solver type (SGD, Adam, ...)")
    p.add_argument("--stepvalue", type=int, nargs="*")
    args = p.parse_args(argv)
    root = os.environ.get("CAFFEPY_INTEL_CAFFE", ".")
    path = args.model if os.path.exists(args.model) else os.path.join(root, args.model)
    try:        # a solver names its nets; a net file does not parse as a solver
        solver = upgrade.read_solver(path)
        is_solver = bool(solver.train_net or solver.net)
    except CaffepyError:
        is_solver = False
    if is_solver:
        dest = point_solver(path, args.data_root, args.out_dir, root, args.classes, args.batch, args.test_batch,
                            max_iter=args.max_iter, test_interval=args.test_interval, display=args.display,
                            snapshot=args.snapshot, base_lr=args.base_lr, type=args.type,
                            stepvalue=args.stepvalue)
    else:
        os.makedirs(args.out_dir, exist_ok=True)
        net = point_net(upgrade.read_net(path), args.data_root, args.classes, args.batch, args.test_batch)
        dest = os.path.join(args.out_dir, os.path.basename(path))
        prototxt.write_text(net, dest)
    print(dest)


if __name__ == "__main__":
    main()
