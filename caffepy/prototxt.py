"""Reading, writing and upgrading nets and solvers, and picking layers by NetState.

Everything here follows Caffe's own rules (io.cpp, upgrade_proto.cpp, the
FilterNet / StateMeetsRule pair of net.cpp, Solver::InitTrainNet/InitTestNets),
so a file means what it means to Caffe:

* text nets and solvers are parsed, then upgraded as Caffe upgrades them
  (V0 and V1 layers, data-layer transform fields, net-level inputs, old
  BatchNorm param specs, the solver_type enum);
* every mistake in a file is one PrototxtError line naming `file:line:col`;
* every write is atomic (temporary file, fsync, rename), and a binary message
  over protobuf's 2 GiB limit is refused before anything is written.
"""
import collections
import contextlib
import difflib
import os
import re
import tempfile

from google.protobuf import message as _pb_message
from google.protobuf import text_format

from . import log
from .errors import CaffepyError, PrototxtError
from .proto import caffe_pb2

# Protobuf (and so Caffe's reader, which sets the same limit) refuses a
# serialized message of 2 GiB or more.
PROTO_LIMIT = 2**31 - 1

# Read once: atomic writes create files through mkstemp (mode 0600) and then
# give them the mode an ordinary open() would have.
_UMASK = os.umask(0)
os.umask(_UMASK)


# ---------------------------------------------------------------------------
# Files

def _read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise PrototxtError(f"{os.fspath(path)}: cannot open: {e.strerror}") from None


def atomic_write(path, data):
    """Write bytes to `path` so that readers see the old file or the whole new one."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    except OSError as e:
        raise CaffepyError(f"{path}: cannot write: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CaffepyError(f"{path}: cannot write: {e.strerror}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # The rename itself is durable only once the directory entry is on disk.
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ---------------------------------------------------------------------------
# Text format

def _short_type(full_name):
    return full_name[len("caffe."):] if full_name.startswith("caffe.") else full_name


def _field_before(line_text, column):
    """The field name written just before the value at 1-based `column`."""
    m = re.search(r"([A-Za-z_][A-Za-z0-9_]*)\s*:?\s*$", line_text[: max(column - 1, 0)])
    return m.group(1) if m else None


def _explain(problem, line_text, column, at_end):
    """Protobuf's ParseError text in caffepy's words (one line, no trailing dot)."""
    pool = caffe_pb2.DESCRIPTOR.pool
    m = re.match(r'Message type "([\w.]+)" has no field named "(\w+)"', problem)
    if m:
        msg_name, field = m.groups()
        msg = f"unknown field '{field}' in {_short_type(msg_name)}"
        with contextlib.suppress(KeyError):
            known = [f.name for f in pool.FindMessageTypeByName(msg_name).fields]
            close = difflib.get_close_matches(field, known, n=1)
            if close:
                msg += f"; did you mean '{close[0]}'?"
        return msg
    m = re.match(r'Enum type "([\w.]+)" has no value (named|with number) (\S+?)\.?$', problem)
    if m:
        enum_name, _, value = m.groups()
        field = _field_before(line_text, column)
        msg = f"unknown value '{value}'"
        msg += f" for {field} ({_short_type(enum_name)})" if field else f" for {_short_type(enum_name)}"
        with contextlib.suppress(KeyError):
            names = [v.name for v in pool.FindEnumTypeByName(enum_name).values]
            msg += f"; known values: {', '.join(names)}"
        return msg
    m = re.match(r'Message type "([\w.]+)" should not have multiple "(\w+)" fields', problem)
    if m:
        msg_name, field = m.groups()
        return f"field '{field}' given more than once in {_short_type(msg_name)}, which takes one value"
    m = re.match(r"Couldn't parse (integer|float|double)(?: number)?: (.*)$", problem)
    if m:
        kind, value = m.groups()
        field = _field_before(line_text, column)
        return f"{field + ': ' if field else ''}not {'an integer' if kind == 'integer' else 'a number'}, got {value}"
    m = re.match(r"Value out of range: (.*)$", problem)
    if m:
        field = _field_before(line_text, column)
        return f"{field + ': ' if field else ''}value out of range, got {m.group(1)}"
    m = re.match(r"Expected string but found: (.*)$", problem)
    if m:
        field = _field_before(line_text, column)
        return f"{field + ': ' if field else ''}expected a quoted string, got {m.group(1)}"
    if problem.startswith('Expected "}"') and at_end:
        return "unexpected end of file: a '{' is not closed"
    m = re.match(r'Expected "(.)"', problem)
    if m:
        return f"expected '{m.group(1)}'"
    m = re.match(r"Expected identifier or number, got (.*?)\.?$", problem)
    if m:
        return f"expected a field name, got '{m.group(1)}'"
    problem = problem.rstrip(".")
    return problem[:1].lower() + problem[1:]


def _parse_error(error, text, source):
    raw = str(error).replace("\n", " ")
    line, column = error.GetLine(), error.GetColumn()
    lines = text.splitlines()
    line_text = lines[line - 1] if line and 0 < line <= len(lines) else ""
    problem = re.sub(r"^\d+:\d+ : ", "", raw)
    snippet = f"'{line_text}': "
    if line_text and problem.startswith(snippet):
        problem = problem[len(snippet):]
    # Protobuf reports a missing closing brace at the last token, not at the end.
    bare = re.sub(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'', "", text)
    at_end = bare.count("{") > bare.count("}")
    where = f"{source}:{line}:{column}" if line else f"{source}"
    return PrototxtError(f"{where}: {_explain(problem, line_text, column, at_end)}")


def parse_text(msg, text, source="<string>"):
    """Parse text format into `msg` (a message instance); errors name source:line:col."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            line = text[: e.start].count(b"\n") + 1
            hint = "; it looks like a binary file, not a text prototxt" if b"\0" in text[:4096] else ""
            raise PrototxtError(f"{source}:{line}: not UTF-8 text (byte 0x{text[e.start]:02x}){hint}") from None
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:
        raise _parse_error(e, text, source) from None
    _check_required(msg, source)
    return msg


def _check_required(msg, source):
    missing = msg.FindInitializationErrors()
    if missing:
        raise PrototxtError(f"{source}: required field{'s' if len(missing) > 1 else ''} missing: "
                            f"{', '.join(missing)}")


def read_text(msg, path):
    """Parse the text file at `path` into `msg`, without any upgrade."""
    return parse_text(msg, _read_bytes(path), os.fspath(path))


def to_text(msg):
    """Text format as Caffe prints it (two-space indent, shortest floats)."""
    return text_format.MessageToString(msg)


def write_text(msg, path):
    """Write `msg` in text format, atomically."""
    atomic_write(path, to_text(msg).encode("utf-8"))


# ---------------------------------------------------------------------------
# Binary format

def read_binary(msg, path):
    """Parse the binary proto file at `path` into `msg`, without any upgrade."""
    source = os.fspath(path)
    data = _read_bytes(path)
    if not data:
        raise PrototxtError(f"{source}: the file is empty (0 bytes); expected a binary {msg.DESCRIPTOR.name}")
    try:
        msg.ParseFromString(data)
    except _pb_message.DecodeError as e:
        head = data[:200].decode("utf-8", "replace")
        text = all(ch.isprintable() or ch in "\n\r\t" for ch in head) and "\ufffd" not in head
        hint = "; it looks like a text prototxt" if text else ""
        raise PrototxtError(f"{source}: not a binary {msg.DESCRIPTOR.name} ({e}){hint}") from None
    _check_required(msg, source)
    return msg


def payload_bytes(msg):
    """Bytes taken by the packed numbers (blob data) and byte strings of `msg`,
    counted without serializing: a lower bound of its serialized size."""
    from google.protobuf.descriptor import FieldDescriptor as F

    sizes = {F.TYPE_FLOAT: 4, F.TYPE_FIXED32: 4, F.TYPE_SFIXED32: 4,
             F.TYPE_DOUBLE: 8, F.TYPE_FIXED64: 8, F.TYPE_SFIXED64: 8}
    total = 0
    for field, value in msg.ListFields():
        repeated = field.is_repeated
        if field.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
            for sub in (value if repeated else (value,)):
                total += payload_bytes(sub)
        elif field.type in sizes:
            total += sizes[field.type] * (len(value) if repeated else 1)
        elif field.type in (F.TYPE_BYTES, F.TYPE_STRING):
            total += sum(len(v) for v in value) if repeated else len(value)
    return total


def serialize(msg, source="<message>", limit=PROTO_LIMIT):
    """`msg` as binary bytes; a CaffepyError, before serializing, when it
    would exceed `limit` bytes (protobuf's 2 GiB message limit)."""
    def refuse(size):
        return CaffepyError(
            f"{source}: {msg.DESCRIPTOR.name} needs {size / 2**30:.2f} GiB, over protobuf's "
            f"{(limit + 1) / 2**30:.2f} GiB message limit; nothing was written (neither Caffe nor "
            f"caffepy could read such a file back). Reduce the model's parameters")

    # ByteSize() would cost a whole serialization under upb; the blob payload
    # is nearly all of the size and free to count.
    size = payload_bytes(msg)
    if size > limit:
        raise refuse(size)
    data = msg.SerializeToString()
    if len(data) > limit:
        raise refuse(len(data))
    return data


def write_binary(msg, path, limit=PROTO_LIMIT):
    """Write `msg` in binary format, atomically, refusing messages over `limit`."""
    atomic_write(path, serialize(msg, os.fspath(path), limit))


# ---------------------------------------------------------------------------
# Nets

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


def net_needs_upgrade(net):
    """Whether any of Caffe's net upgrades applies (NetNeedsUpgrade)."""
    return (_needs_v0(net) or _needs_data(net) or len(net.layers) > 0 or len(net.input) > 0
            or _needs_batch_norm(net))


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
    net = _copy(net_param)
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
    out = _copy(net, skip="layers")
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
# NetState filtering

def net_state(phase, level=0, stages=()):
    """A NetState; `phase` is caffe_pb2.TRAIN / TEST or their names."""
    if isinstance(phase, str):
        try:
            phase = caffe_pb2.Phase.Value(phase.upper())
        except ValueError:
            raise CaffepyError(f"phase: must be TRAIN or TEST, got {phase}") from None
    state = caffe_pb2.NetState(phase=phase, level=int(level))
    state.stage.extend(stages)
    return state


def state_meets_rule(state, rule):
    """StateMeetsRule: every condition the rule sets must hold."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    if any(s in stages for s in rule.not_stage):
        return False
    return True


def layer_included(layer, state, source=None):
    """Whether the layer takes part in a net of this state (FilterNet's rule)."""
    if len(layer.include) and len(layer.exclude):
        where = f"{source}: " if source else ""
        raise PrototxtError(f"{where}layer '{layer.name}' ({layer.type}): include, exclude: both given; "
                            f"specify either include rules or exclude rules, not both")
    if len(layer.include):
        return any(state_meets_rule(state, rule) for rule in layer.include)
    return not any(state_meets_rule(state, rule) for rule in layer.exclude)


def filter_net(net_param, state=None, source=None):
    """A copy of `net_param` holding only the layers the NetState keeps
    (FilterNet).  `state` defaults to the net's own `state`; the copy's
    `state` is set to the one used."""
    if state is None:
        state = net_param.state
    out = _copy(net_param, skip="layer")
    out.state.CopyFrom(state)
    for layer in net_param.layer:
        if layer_included(layer, state, source):
            out.layer.add().CopyFrom(layer)
    return out


# ---------------------------------------------------------------------------
# Solvers

_SOLVER_TYPE_NAMES = {"SGD": "SGD", "NESTEROV": "Nesterov", "ADAGRAD": "AdaGrad", "RMSPROP": "RMSProp",
                      "ADADELTA": "AdaDelta", "ADAM": "Adam"}


def read_solver(path):
    """A solver prototxt, upgraded (ReadSolverParamsFromTextFileOrDie)."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise PrototxtError(f"{os.fspath(path)}: the file is empty; a solver needs at least a net and base_lr")
    solver = read_text(caffe_pb2.SolverParameter(), path)
    return upgrade_solver(solver, os.fspath(path))[0]


def parse_solver_text(text, source="<string>"):
    solver = parse_text(caffe_pb2.SolverParameter(), text, source)
    return upgrade_solver(solver, source)[0]


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
    solver.type = _SOLVER_TYPE_NAMES[caffe_pb2.SolverParameter.SolverType.Name(solver.solver_type)]
    solver.ClearField("solver_type")
    return solver, True


def upgrade_solver_file(input_file, output_file):
    """Caffe's upgrade_solver_proto_text.  Returns True (nothing can half-fail)."""
    solver = read_text(caffe_pb2.SolverParameter(), input_file)
    upgraded, changed = upgrade_solver(solver, os.fspath(input_file))
    if not changed:
        log.warning(f"File already in latest proto format: {os.fspath(input_file)}")
    write_text(upgraded, output_file)
    log.info(f"Wrote upgraded SolverParameter text proto to {os.fspath(output_file)}")
    return True


class SolverNet(collections.namedtuple("SolverNet", "param state")):
    """A net the solver builds: its NetParameter (with `state` already set to
    the merged NetState, ready for filter_net) and that NetState.  `origin`
    says where it came from, as Caffe logs it ("net file: x.prototxt")."""

    def __new__(cls, param, state, origin=""):
        self = super().__new__(cls, param, state)
        self.origin = origin
        return self


def _read_solver_net(path, field, source):
    if not os.path.exists(path):
        raise PrototxtError(f"{source}: {field}: cannot open '{path}' (paths are relative to the "
                            f"current directory, {os.getcwd()})")
    return read_net(path)


def solver_train_net_param(solver, source="<solver>", level=None, stages=()):
    """The train net of a solver (Solver::InitTrainNet): exactly one of
    train_net_param, train_net, net_param, net; NetState = phase TRAIN, then
    the net's own state, then the solver's train_state.  `level` / `stages`
    are the command line's --level / --stage, applied to train_state as
    caffe train does."""
    given = [f for f in ("net", "net_param", "train_net", "train_net_param") if solver.HasField(f)]
    if not given:
        raise PrototxtError(f"{source}: solver specifies no net (set 'net' or 'train_net')")
    if len(given) > 1:
        raise PrototxtError(f"{source}: solver specifies more than one train net ({', '.join(given)}); "
                            f"keep one")
    field = given[0]
    if field == "train_net_param":
        param, origin = upgrade_net(solver.train_net_param, f"{source}: train_net_param")[0], "train_net_param"
    elif field == "train_net":
        param, origin = _read_solver_net(solver.train_net, field, source), f"train_net file: {solver.train_net}"
    elif field == "net_param":
        param, origin = upgrade_net(solver.net_param, f"{source}: net_param")[0], "net_param"
    else:
        param, origin = _read_solver_net(solver.net, field, source), f"net file: {solver.net}"
    train_state = caffe_pb2.NetState()
    train_state.CopyFrom(solver.train_state)
    if level is not None:
        train_state.level = int(level)
    train_state.stage.extend(stages)
    state = caffe_pb2.NetState(phase=caffe_pb2.TRAIN)
    state.MergeFrom(param.state)
    state.MergeFrom(train_state)
    param.state.CopyFrom(state)
    return SolverNet(param, state, origin)


def solver_test_net_params(solver, source="<solver>"):
    """The test nets of a solver (Solver::InitTestNets), in Caffe's order:
    test_net_param, test_net, then as many copies of net_param / net as
    test_iter entries remain.  NetState = phase TEST, then the net's own
    state, then test_state[i]."""
    generic = [f for f in ("net_param", "net") if solver.HasField(f)]
    if len(generic) > 1:
        raise PrototxtError(f"{source}: net, net_param: both given; a solver may name its generic net once")
    specific = len(solver.test_net_param) + len(solver.test_net)
    iters = len(solver.test_iter)
    if (generic and iters < specific) or (not generic and iters != specific):
        raise PrototxtError(f"{source}: test_iter: one is needed per test net ({specific} test nets"
                            f"{' plus the generic net' if generic else ''}), got {iters}")
    count = specific + (iters - specific if generic else 0)
    if len(solver.test_state) and len(solver.test_state) != count:
        raise PrototxtError(f"{source}: test_state: must be unspecified or given once per test net "
                            f"({count}), got {len(solver.test_state)}")
    if count and solver.test_interval <= 0:
        raise PrototxtError(f"{source}: test_interval: must be > 0 when there are test nets, "
                            f"got {solver.test_interval}")
    nets = []
    for i, inline in enumerate(solver.test_net_param):
        nets.append((upgrade_net(inline, f"{source}: test_net_param[{i}]")[0], "test_net_param"))
    for path in solver.test_net:
        nets.append((_read_solver_net(path, "test_net", source), f"test_net file: {path}"))
    remaining = iters - len(nets)
    if generic == ["net_param"]:
        inline = upgrade_net(solver.net_param, f"{source}: net_param")[0]
        nets.extend((_copy(inline), "net_param") for _ in range(remaining))
    elif generic == ["net"]:
        if remaining > 0:
            param = _read_solver_net(solver.net, "net", source)
            nets.extend((_copy(param), f"net file: {solver.net}") for _ in range(remaining))
    out = []
    for i, (param, origin) in enumerate(nets):
        state = caffe_pb2.NetState(phase=caffe_pb2.TEST)
        state.MergeFrom(param.state)
        if len(solver.test_state):
            state.MergeFrom(solver.test_state[i])
        param.state.CopyFrom(state)
        out.append(SolverNet(param, state, origin))
    return out


def _copy(msg, skip=None):
    """A copy of `msg`, without the field named `skip` (not copied at all)."""
    out = type(msg)()
    if skip is None:
        out.CopyFrom(msg)
        return out
    for field, value in msg.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(out, field.name).extend(value)
        elif field.message_type is not None:
            getattr(out, field.name).CopyFrom(value)
        else:
            setattr(out, field.name, value)
    return out


# ---------------------------------------------------------------------------
# Solver state (.solverstate)

def read_solver_state(path):
    """A binary SolverState (.solverstate)."""
    return read_binary(caffe_pb2.SolverState(), path)


def write_solver_state(state, path, limit=PROTO_LIMIT):
    """Write a SolverState atomically (refused over protobuf's 2 GiB limit)."""
    write_binary(state, path, limit)
