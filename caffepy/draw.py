"""pycaffe's caffe.draw: a net as a Graphviz graph, drawn as Caffe's draw_net.py draws it.

Layers are boxes labelled `name (Type)` (pooling adds its method; Convolution, Deconvolution
and Pooling add kernel size, stride and pad), coloured by kind: convolution red, pooling
orange, inner product purple, other layers blue, in-place layers (a neuron layer whose top is
its bottom) green. Blobs are grey octagons. Edges into a blob are labelled with the batch size
(Data) or num_output (Convolution, Deconvolution, InnerProduct). `rankdir` lays the graph out
left to right (LR, the default), top to bottom (TB), bottom to top (BT) or right to left (RL);
in a vertical layout label parts are separated by spaces, else by line breaks.

    caffe.draw.draw_net_to_file(net_param, "net.png", "LR", phase=caffe.TRAIN)
    caffepy draw_net net.prototxt net.svg --rankdir TB --phase TEST

The DOT text needs nothing; drawing it needs Graphviz's `dot` program (Debian: apt-get install
graphviz), and get_pydot_graph needs pydot (pip install 'caffepy[draw]').
"""
import os
import shutil
import subprocess

from .errors import CaffepyError, LayerError
from .proto import caffe_pb2

LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
RANKDIRS = ("LR", "TB", "BT", "RL")
# formats that are the DOT text itself, written without running dot
RAW_FORMATS = ("raw", "dot", "gv")


def get_pooling_types_dict():
    """{pool method number: name}, e.g. {0: 'MAX', 1: 'AVE', 2: 'STOCHASTIC'}."""
    return {v.number: name for name, v in caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR.values_by_name.items()}


def get_edge_label(layer):
    """What the edges out of `layer` say: the batch size of Data, num_output of a learned layer."""
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return ""


def get_layer_lr_mult(layer):
    """(weights, bias) lr_mult of a Convolution, Deconvolution or InnerProduct layer."""
    if layer.type not in ("Convolution", "Deconvolution", "InnerProduct"):
        raise ValueError(f"{layer.type} layers do not have a learning rate multiplier")
    mults = [p.lr_mult if p.HasField("lr_mult") else 1.0 for p in layer.param[:2]]
    return tuple(mults + [1.0] * (2 - len(mults)))


def _spatial(layer):
    """(kernel, stride, pad) as Caffe's draw_net shows them; `HxW` where _h/_w are given."""
    def pair(h, w):
        return f"{h}x{w}" if h != w else str(h)

    if layer.type == "Pooling":
        p = layer.pooling_param
        kernel = pair(p.kernel_h, p.kernel_w) if p.HasField("kernel_h") else str(p.kernel_size)
        stride = pair(p.stride_h, p.stride_w) if p.HasField("stride_h") else str(p.stride)
        pad = pair(p.pad_h, p.pad_w) if p.HasField("pad_h") else str(p.pad)
        return kernel, stride, pad
    p = layer.convolution_param
    kernel = pair(p.kernel_h, p.kernel_w) if p.HasField("kernel_h") else str(p.kernel_size[0] if p.kernel_size else 1)
    stride = pair(p.stride_h, p.stride_w) if p.HasField("stride_h") else str(p.stride[0] if p.stride else 1)
    pad = pair(p.pad_h, p.pad_w) if p.HasField("pad_h") else str(p.pad[0] if p.pad else 0)
    return kernel, stride, pad


def get_layer_label(layer, rankdir, display_lrm=False):
    """The text of a layer's box (no quotes; see to_dot for the escaping)."""
    separator = " " if rankdir in ("TB", "BT") else "\n"
    parts = [layer.name]
    if layer.type == "Pooling":
        method = get_pooling_types_dict().get(layer.pooling_param.pool, str(layer.pooling_param.pool))
        parts.append(f"({layer.type} {method})")
    else:
        parts.append(f"({layer.type})")
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        kernel, stride, pad = _spatial(layer)
        parts.append(separator.join([f"kernel size: {kernel}", f"stride: {stride}", f"pad: {pad}"]))
    if display_lrm and layer.type in ("Convolution", "Deconvolution", "InnerProduct"):
        weights, bias = get_layer_lr_mult(layer)
        if weights or bias:
            parts.append(f"lr mult: {weights:.1f}, {bias:.1f}")
    return separator.join(parts)


def choose_color_by_layertype(layertype):
    if layertype in ("Convolution", "Deconvolution"):
        return "#FF5050"
    if layertype == "Pooling":
        return "#FF9900"
    if layertype == "InnerProduct":
        return "#CC33FF"
    return "#6495ED"


def _in_phase(layer, phase):
    """draw_net's phase rule: a layer is drawn unless its include/exclude rules name another
    phase (stages and levels are not considered, as in Caffe's draw_net)."""
    if len(layer.include) and len(layer.exclude):
        raise LayerError(f"layer '{layer.name}' ({layer.type}): include: a layer cannot have both "
                         f"include and exclude rules")
    included = not len(layer.include) or any(r.HasField("phase") and r.phase == phase for r in layer.include)
    return included and not any(r.HasField("phase") and r.phase == phase for r in layer.exclude)


def _quote(text):
    """A DOT identifier: in quoted strings only \" is an escape."""
    return '"' + text.replace('"', '\\"') + '"'


def _label(text, record=False):
    """A label's escString, quoted: backslashes doubled, line breaks as \\n, and (in a record
    label, where they are structure) braces, bars and angle brackets escaped."""
    text = text.replace("\\", "\\\\")
    if record:
        for ch in "{}|<>":
            text = text.replace(ch, "\\" + ch)
    return '"' + text.replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(style, label):
    return "[" + ", ".join([f"{k}={_quote(v)}" for k, v in style.items()] + [f"label={label}"]) + "]"


def _net_param(caffe_net):
    if isinstance(caffe_net, caffe_pb2.NetParameter):
        return caffe_net
    if isinstance(caffe_net, (str, os.PathLike)):
        from . import upgrade
        return upgrade.read_net(os.fspath(caffe_net))
    raise TypeError(f"draw: needs a caffe_pb2.NetParameter or a prototxt path, got {type(caffe_net)}")


def _check_rankdir(rankdir):
    if rankdir not in RANKDIRS:
        raise CaffepyError(f"draw: rankdir: must be one of {', '.join(RANKDIRS)}, got {rankdir!r}")


def to_dot(caffe_net, rankdir="LR", label_edges=True, phase=None, display_lrm=False):
    """The net as DOT text. `phase` (caffe.TRAIN / caffe.TEST) keeps that phase's layers;
    None draws them all."""
    _check_rankdir(rankdir)
    net = _net_param(caffe_net)
    nodes = {}       # node id -> attribute text, in first-seen order
    edges = []
    for li, layer in enumerate(net.layer):
        if phase is not None and not _in_phase(layer, phase):
            continue
        node = f"layer{li}"
        label = _label(get_layer_label(layer, rankdir, display_lrm), record=True)
        if len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]:
            nodes[node] = _attrs(NEURON_LAYER_STYLE, label)
        else:
            nodes[node] = _attrs({**LAYER_STYLE_DEFAULT, "fillcolor": choose_color_by_layertype(layer.type)},
                                 label)
        for blob in layer.bottom:
            nodes.setdefault(f"blob_{blob}", _attrs(BLOB_STYLE, _label(blob)))
            edges.append((f"blob_{blob}", node, ""))
        out_label = get_edge_label(layer) if label_edges else ""
        for blob in layer.top:
            nodes.setdefault(f"blob_{blob}", _attrs(BLOB_STYLE, _label(blob)))
            edges.append((node, f"blob_{blob}", out_label))
    lines = [f"digraph {_quote(net.name or 'Net')} {{", f"rankdir={rankdir};"]
    lines += [f"{_quote(node)} {attrs};" for node, attrs in nodes.items()]
    lines += [f"{_quote(src)} -> {_quote(dst)} [label={_label(label)}];" for src, dst, label in edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def get_pydot_graph(caffe_net, rankdir, label_edges=True, phase=None, display_lrm=False):
    """The net as a pydot.Dot graph (needs pydot: pip install 'caffepy[draw]')."""
    try:
        import pydot
    except ImportError:
        raise CaffepyError("draw: get_pydot_graph needs pydot, which is not installed. Install it with: "
                           "pip install pydot (or pip install 'caffepy[draw]')") from None
    graphs = pydot.graph_from_dot_data(to_dot(caffe_net, rankdir, label_edges, phase, display_lrm))
    return graphs[0]


def render(dot_text, ext):
    """Run Graphviz's dot on DOT text; returns the drawing in format `ext` (png, svg, pdf, ...)."""
    if ext in RAW_FORMATS:
        return dot_text.encode()
    dot = shutil.which("dot")
    if dot is None:
        raise CaffepyError(f"draw: drawing a .{ext} needs Graphviz's `dot` program, which is not on PATH. "
                           f"Install Graphviz (Debian/Ubuntu: apt-get install graphviz), or write a .raw "
                           f"file to get the DOT text")
    result = subprocess.run([dot, f"-T{ext}"], input=dot_text.encode(), capture_output=True)
    if result.returncode != 0:
        reason = " ".join(result.stderr.decode(errors="replace").split()) or f"exit code {result.returncode}"
        raise CaffepyError(f"draw: dot -T{ext} failed: {reason}")
    return result.stdout


def draw_net(caffe_net, rankdir, ext="png", phase=None, display_lrm=False):
    """The drawing of the net as bytes in format `ext` ('raw' gives the DOT text)."""
    return render(to_dot(caffe_net, rankdir, phase=phase, display_lrm=display_lrm), ext)


def draw_net_to_file(caffe_net, filename, rankdir="LR", phase=None, display_lrm=False):
    """Draw the net to `filename` in the format its extension names (.png, .svg, .pdf, ...;
    .raw, .dot or .gv write the DOT text)."""
    filename = os.fspath(filename)
    ext = os.path.splitext(filename)[1][1:].lower()
    if not ext:
        raise CaffepyError(f"{filename}: draw_net: the file name needs an extension naming the format "
                           f"(.png, .svg, .pdf, or .raw for the DOT text)")
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, "wb") as f:
        f.write(data)
