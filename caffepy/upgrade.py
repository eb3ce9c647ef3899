"""Caffe's upgrade_proto.cpp: nets and solvers in the current format, whatever format they were written in.

Reading a net or a solver as Caffe reads it (ReadNetParamsFromTextFileOrDie,
ReadNetParamsFromBinaryFileOrDie, ReadSolverParamsFromTextFileOrDie) is
parsing it (prototxt.py) and then upgrading it here:

* nets: V0 layers (padding folded into the next conv / pool), V1 `layers {}`
  entries, the transformation fields of V1 data layers, net-level `input` /
  `input_shape` / `input_dim`, and 3-param BatchNorm specs;
* solvers: the deprecated `solver_type` enum becomes the `type` string (the
  names come from the solver type table, solvers/updates.py's RULES).

`upgrade_net_file` / `upgrade_solver_file` are the `caffepy upgrade_net_proto_text`,
`upgrade_net_proto_binary` and `upgrade_solver_proto_text` tools.
"""
import os

from . import log
from .errors import PrototxtError
from .proto import caffe_pb2
from .prototxt import copy_message, parse_text, read_binary, read_text, write_binary, write_text


# ---------------------------------------------------------------------------
# Reading, as Caffe reads

def read_net(path):
    """A net prototxt, upgraded to the current format (ReadNetParamsFromTextFileOrDie)."""
    net = read_text(caffe_pb2.NetParameter(), path)
    if not (len(net.layer) or len(net.layers) or len(net.input)):
        raise PrototxtError(f"{os.fspath(path)}: defines no layers"
                            f"{' (the file is empty)' if os.path.getsize(path) == 0 else ''}")
    _upgrade_net(net, os.fspath(path))
    return net


def parse_net_text(text, source="<string>"):
    """A net from prototxt text, upgraded to the current format."""
    net = parse_text(caffe_pb2.NetParameter(), text, source)
    _upgrade_net(net, source)
    return net


def read_binary_net(path):
    """A binary NetParameter (.caffemodel), upgraded (ReadNetParamsFromBinaryFileOrDie)."""
    net = read_binary(caffe_pb2.NetParameter(), path)
    _upgrade_net(net, os.fspath(path))
    return net


def read_solver(path):
    """A solver prototxt, upgraded (ReadSolverParamsFromTextFileOrDie)."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise PrototxtError(f"{os.fspath(path)}: the file is empty; a solver needs at least a net and base_lr")
    solver = read_text(caffe_pb2.SolverParameter(), path)
    return upgrade_solver(solver, os.fspath(path))[0]


def parse_solver_text(text, source="<string>"):
    """A solver from prototxt text, upgraded."""
    solver = parse_text(caffe_pb2.SolverParameter(), text, source)
    return upgrade_solver(solver, source)[0]


# ---------------------------------------------------------------------------
# Nets

# V1LayerParameter.LayerType -> the layer type string (UpgradeV1LayerType).
V1_TYPE_NAMES = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout", "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise", "EXP": "Exp", "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output", "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData", "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct",
    "LRN": "LRN", "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence", "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice", "TANH": "TanH",
    "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

# V0 layer type strings -> V1LayerParameter.LayerType names (UpgradeV0LayerType).
V0_TYPE_NAMES = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION", "data": "DATA",
    "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS", "flatten": "FLATTEN",
    "hdf5_data": "HDF5_DATA", "hdf5_output": "HDF5_OUTPUT", "im2col": "IM2COL", "images": "IMAGE_DATA",
    "infogain_loss": "INFOGAIN_LOSS", "innerproduct": "INNER_PRODUCT", "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS", "pool": "POOLING", "relu": "RELU",
    "sigmoid": "SIGMOID", "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS", "split": "SPLIT",
    "tanh": "TANH", "window_data": "WINDOW_DATA",
}

_V1 = caffe_pb2.V1LayerParameter
# The per-type messages a V1 layer carries under the same names as a layer.
_V1_PARAM_FIELDS = [f.name for f in _V1.DESCRIPTOR.fields
                    if f.name.endswith("_param") and f.message_type is not None]
# Deprecated transformation fields of V1 data layers (UpgradeNetDataTransformation).
_V1_DATA_PARAMS = {_V1.DATA: "data_param", _V1.IMAGE_DATA: "image_data_param",
                   _V1.WINDOW_DATA: "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def _needs_v0(net):
    return any(v1.HasField("layer") for v1 in net.layers)


def _needs_data(net):
    for v1 in net.layers:
        field = _V1_DATA_PARAMS.get(v1.type)
        if field and any(getattr(v1, field).HasField(f) for f in _TRANSFORM_FIELDS):
            return True
    return False


def _needs_batch_norm(net):
    # Caffe re-applies this upgrade to every 3-param BatchNorm; counting it
    # only when a rate is not yet an explicit 0 keeps `changed` meaningful.
    return any(layer.type == "BatchNorm" and len(layer.param) == 3
               and any(not (p.HasField("lr_mult") and p.lr_mult == 0 and p.HasField("decay_mult")
                            and p.decay_mult == 0) for p in layer.param)
               for layer in net.layer)


def upgrade_net(net_param, source="<net>"):
    """A copy of `net_param` in the current format, and whether anything changed
    (UpgradeNetAsNeeded).  `net_param` itself is left as it was."""
    net = copy_message(net_param)
    changed, _ = _upgrade_net(net, source)
    return net, changed


def _upgrade_net(net, source):
    """Upgrade `net` in place; returns (changed, every part upgraded)."""
    changed, ok = False, True
    if len(net.layer) and len(net.layers):
        raise PrototxtError(
            f"{source}: net has both 'layer' and 'layers' entries, the current and the V1 format; "
            f"rewrite the 'layers {{ type: ENUM }}' entries as 'layer {{ type: \"Name\" }}' to continue")
    if _needs_v0(net):
        log.info(f"Attempting to upgrade input file specified using deprecated V0LayerParameter: {source}")
        upgraded, part_ok = _upgrade_v0_net(net, source)
        net.CopyFrom(upgraded)
        ok &= part_ok
        changed = True
    if _needs_data(net):
        log.info(f"Attempting to upgrade input file specified using deprecated transformation "
                 f"parameters: {source}")
        for v1 in net.layers:
            field = _V1_DATA_PARAMS.get(v1.type)
            if field:
                old = getattr(v1, field)
                for name in _TRANSFORM_FIELDS:
                    if old.HasField(name):
                        setattr(v1.transform_param, name, getattr(old, name))
                        old.ClearField(name)
        changed = True
    if len(net.layers):
        log.info(f"Attempting to upgrade input file specified using deprecated V1LayerParameter: {source}")
        v1_layers = list(net.layers)
        net.ClearField("layers")
        for i, v1 in enumerate(v1_layers):
            if not _upgrade_v1_layer(v1, net.layer.add(), source):
                log.error(f"{source}: upgrade of input layer {i} failed")
                ok = False
        changed = True
    if len(net.input):
        _upgrade_net_input(net, source)
        changed = True
    if _needs_batch_norm(net):
        log.info(f"Attempting to upgrade batch norm layers using deprecated params: {source}")
        for layer in net.layer:
            if layer.type == "BatchNorm" and len(layer.param) == 3:
                # The statistics blobs are not learned: keep names, zero the rates.
                for spec in layer.param:
                    spec.lr_mult = 0.0
                    spec.decay_mult = 0.0
        changed = True
    if not ok:
        log.error(f"{source}: had one or more problems upgrading the net (see above); continuing anyway")
    return changed, ok


def _upgrade_v1_layer(v1, layer, source):
    """UpgradeV1LayerParameter: one `layers {}` entry into a `layer {}`."""
    layer.bottom.extend(v1.bottom)
    layer.top.extend(v1.top)
    if v1.HasField("name"):
        layer.name = v1.name
    layer.include.extend(v1.include)
    layer.exclude.extend(v1.exclude)
    if v1.HasField("type"):
        layer.type = V1_TYPE_NAMES[_V1.LayerType.Name(v1.type)]
    layer.blobs.extend(v1.blobs)

    def spec(i):
        while len(layer.param) <= i:
            layer.param.add()
        return layer.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        spec(i).share_mode = (caffe_pb2.ParamSpec.PERMISSIVE if mode == _V1.PERMISSIVE
                              else caffe_pb2.ParamSpec.STRICT)
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    layer.loss_weight.extend(v1.loss_weight)
    for field in _V1_PARAM_FIELDS:
        if v1.HasField(field):
            getattr(layer, field).CopyFrom(getattr(v1, field))
    if v1.HasField("layer"):
        log.error(f"{source}: layer '{v1.name}': input NetParameter has V0 layer -- ignoring")
        return False
    return True


def _upgrade_net_input(net, source):
    """UpgradeNetInput: net-level input / input_shape / input_dim become a
    first layer `input` of type Input."""
    inputs = list(net.input)
    if len(net.input_shape) or len(net.input_dim):
        if len(net.input_shape) and len(net.input_shape) != len(inputs):
            raise PrototxtError(f"{source}: input_shape: one is needed per input ({len(inputs)} inputs), "
                                f"got {len(net.input_shape)}")
        if not len(net.input_shape) and len(net.input_dim) != 4 * len(inputs):
            raise PrototxtError(f"{source}: input_dim: four are needed per input ({len(inputs)} inputs), "
                                f"got {len(net.input_dim)}")
        log.info(f"Attempting to upgrade input file specified using deprecated input fields: {source}")
        layer = caffe_pb2.LayerParameter(name="input", type="Input")
        for i, name in enumerate(inputs):
            layer.top.append(name)
            shape = layer.input_param.shape.add()
            if len(net.input_shape):
                shape.CopyFrom(net.input_shape[i])
            else:
                shape.dim.extend(net.input_dim[4 * i: 4 * i + 4])
        rest = list(net.layer)
        net.ClearField("layer")
        net.layer.append(layer)
        net.layer.extend(rest)
    # An input without shapes is a legacy .caffemodel: dropping it is enough.
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")


def _upgrade_v0_net(net, source):
    """UpgradeV0Net: fold padding layers into the next conv / pool, then turn
    each V0 layer into a V1 layer (the V1 upgrade follows)."""
    net = _fold_v0_padding(net, source)
    out = caffe_pb2.NetParameter()
    if net.HasField("name"):
        out.name = net.name
    ok = True
    for v0_conn in net.layers:
        ok &= _upgrade_v0_layer(v0_conn, out.layers.add(), source)
    out.input.extend(net.input)
    out.input_dim.extend(net.input_dim)
    if net.HasField("force_backward"):
        out.force_backward = net.force_backward
    return out, ok


def _fold_v0_padding(net, source):
    """UpgradeV0PaddingLayers."""
    out = copy_message(net, skip="layers")
    last_top = {name: -1 for name in net.input}
    for i, conn in enumerate(net.layers):
        v0 = conn.layer
        if v0.type != "padding":
            out.layers.add().CopyFrom(conn)
        for j, blob in enumerate(conn.bottom):
            if blob not in last_top:
                raise PrototxtError(f"{source}: layer '{v0.name}': bottom: unknown blob '{blob}'")
            top_index = last_top[blob]
            if top_index == -1:
                continue
            pad_conn = net.layers[top_index]
            if pad_conn.layer.type == "padding":
                if v0.type not in ("conv", "pool"):
                    raise PrototxtError(f"{source}: layer '{v0.name}': a padding layer feeds a "
                                        f"'{v0.type}' layer; only conv and pool can absorb padding")
                if len(conn.bottom) != 1 or len(pad_conn.bottom) != 1 or len(pad_conn.top) != 1:
                    raise PrototxtError(f"{source}: layer '{v0.name}': padding layers and the layer "
                                        f"they feed must have one bottom and one top")
                out.layers[-1].layer.pad = pad_conn.layer.pad
                out.layers[-1].bottom[j] = pad_conn.bottom[0]
        for blob in conn.top:
            last_top[blob] = i
    return out


# V0 field -> {V0 type: (V1 sub-message, field)}; "*" applies to every type.
_V0_FIELDS = {
    "num_output": {"conv": ("convolution_param", "num_output"),
                   "innerproduct": ("inner_product_param", "num_output")},
    "biasterm": {"conv": ("convolution_param", "bias_term"),
                 "innerproduct": ("inner_product_param", "bias_term")},
    "weight_filler": {"conv": ("convolution_param", "weight_filler"),
                      "innerproduct": ("inner_product_param", "weight_filler")},
    "bias_filler": {"conv": ("convolution_param", "bias_filler"),
                    "innerproduct": ("inner_product_param", "bias_filler")},
    "pad": {"conv": ("convolution_param", "pad"), "pool": ("pooling_param", "pad")},
    "kernelsize": {"conv": ("convolution_param", "kernel_size"), "pool": ("pooling_param", "kernel_size")},
    "group": {"conv": ("convolution_param", "group")},
    "stride": {"conv": ("convolution_param", "stride"), "pool": ("pooling_param", "stride")},
    "pool": {"pool": ("pooling_param", "pool")},
    "dropout_ratio": {"dropout": ("dropout_param", "dropout_ratio")},
    "local_size": {"lrn": ("lrn_param", "local_size")},
    "alpha": {"lrn": ("lrn_param", "alpha")},
    "beta": {"lrn": ("lrn_param", "beta")},
    "k": {"lrn": ("lrn_param", "k")},
    "source": {"data": ("data_param", "source"), "hdf5_data": ("hdf5_data_param", "source"),
               "images": ("image_data_param", "source"), "window_data": ("window_data_param", "source"),
               "infogain_loss": ("infogain_loss_param", "source")},
    "scale": {"*": ("transform_param", "scale")},
    "meanfile": {"*": ("transform_param", "mean_file")},
    "batchsize": {"data": ("data_param", "batch_size"), "hdf5_data": ("hdf5_data_param", "batch_size"),
                  "images": ("image_data_param", "batch_size"),
                  "window_data": ("window_data_param", "batch_size")},
    "cropsize": {"*": ("transform_param", "crop_size")},
    "mirror": {"*": ("transform_param", "mirror")},
    "rand_skip": {"data": ("data_param", "rand_skip"), "images": ("image_data_param", "rand_skip")},
    "shuffle_images": {"images": ("image_data_param", "shuffle")},
    "new_height": {"images": ("image_data_param", "new_height")},
    "new_width": {"images": ("image_data_param", "new_width")},
    "concat_dim": {"concat": ("concat_param", "concat_dim")},
    "det_fg_threshold": {"window_data": ("window_data_param", "fg_threshold")},
    "det_bg_threshold": {"window_data": ("window_data_param", "bg_threshold")},
    "det_fg_fraction": {"window_data": ("window_data_param", "fg_fraction")},
    "det_context_pad": {"window_data": ("window_data_param", "context_pad")},
    "det_crop_mode": {"window_data": ("window_data_param", "crop_mode")},
    "hdf5_output_param": {"hdf5_output": (None, "hdf5_output_param")},
}


def _upgrade_v0_layer(conn, v1, source):
    """UpgradeV0LayerParameter: a `layers { layer { type: "conv" ... } }` entry
    into V1 form.  Fields that do not fit the type are reported and dropped."""
    v1.bottom.extend(conn.bottom)
    v1.top.extend(conn.top)
    if not conn.HasField("layer"):
        return True
    v0 = conn.layer
    ok = True
    if v0.HasField("name"):
        v1.name = v0.name
    if v0.HasField("type"):
        if v0.type not in V0_TYPE_NAMES:
            raise PrototxtError(f"{source}: layer '{v0.name}': type: unknown V0 layer type, got '{v0.type}'. "
                                f"Known: {', '.join(sorted(V0_TYPE_NAMES))}")
        v1.type = _V1.LayerType.Value(V0_TYPE_NAMES[v0.type])
    v1.blobs.extend(v0.blobs)
    v1.blobs_lr.extend(v0.blobs_lr)
    v1.weight_decay.extend(v0.weight_decay)
    for field, targets in _V0_FIELDS.items():
        if not v0.HasField(field):
            continue
        target = targets.get(v0.type) or targets.get("*")
        if target is None:
            log.error(f"{source}: layer '{v0.name}': unknown parameter {field} for layer type {v0.type}")
            ok = False
            continue
        sub_name, name = target
        holder = getattr(v1, sub_name) if sub_name else v1
        value = getattr(v0, field)
        dest = holder.DESCRIPTOR.fields_by_name[name]
        if field == "pool":
            value = caffe_pb2.PoolingParameter.PoolMethod.Value(
                caffe_pb2.V0LayerParameter.PoolMethod.Name(value))
        if dest.message_type is not None:
            getattr(holder, name).CopyFrom(value)
        elif dest.is_repeated:
            getattr(holder, name).append(value)
        else:
            setattr(holder, name, value)
    return ok


# ---------------------------------------------------------------------------
# Solvers

def upgrade_solver(solver_param, source="<solver>"):
    """A copy with the deprecated solver_type enum turned into the `type`
    string, and whether anything changed (UpgradeSolverAsNeeded)."""
    solver = caffe_pb2.SolverParameter()
    solver.CopyFrom(solver_param)
    if not solver.HasField("solver_type"):
        return solver, False
    if solver.HasField("type"):
        raise PrototxtError(f"{source}: solver_type, type: both given; the old solver_type enum and the "
                            f"new type string cannot both be specified (keep type)")
    log.info(f"Attempting to upgrade input file specified using deprecated 'solver_type' field (enum): {source}")
    # the solvers package reads nets and solvers through this module, hence the late import
    from .solvers.updates import type_of_enum
    solver.type = type_of_enum(solver.solver_type)
    solver.ClearField("solver_type")
    return solver, True


# ---------------------------------------------------------------------------
# The upgrade tools

def upgrade_net_file(input_file, output_file, binary=False):
    """Caffe's upgrade_net_proto_text / _binary: read without upgrading, upgrade,
    write.  Returns False when some part could not be upgraded (the file is
    written anyway, as Caffe does)."""
    net = caffe_pb2.NetParameter()
    (read_binary if binary else read_text)(net, input_file)
    changed, ok = _upgrade_net(net, os.fspath(input_file))
    if not changed:
        log.warning(f"File already in latest proto format: {os.fspath(input_file)}")
    elif not ok:
        log.error("Encountered error(s) while upgrading prototxt; see details above.")
    (write_binary if binary else write_text)(net, output_file)
    log.info(f"Wrote upgraded NetParameter {'binary' if binary else 'text'} proto to {os.fspath(output_file)}")
    return ok


def upgrade_solver_file(input_file, output_file):
    """Caffe's upgrade_solver_proto_text.  Returns True (nothing can half-fail)."""
    solver = read_text(caffe_pb2.SolverParameter(), input_file)
    upgraded, changed = upgrade_solver(solver, os.fspath(input_file))
    if not changed:
        log.warning(f"File already in latest proto format: {os.fspath(input_file)}")
    write_text(upgraded, output_file)
    log.info(f"Wrote upgraded SolverParameter text proto to {os.fspath(output_file)}")
    return True

