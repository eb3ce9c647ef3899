"""`caffepy summarize`: a net at a glance, as Caffe's tools/extra/summarize.py prints it, with sizes.

One row per layer of the prototxt (the phase's layers), BVLC's columns first:

    name  type  (param specs)  bottoms  ->  tops  window

`type` is `module.layer` for a Python layer; `(param specs)` lists each param's name and its
lr_mult (`x0.1`) and decay_mult (`Dx0`) where they are not 1; a top no layer reads is bold and
underlined and a bottom no layer wrote red (on a terminal); `window` is `k/s+p n/g` for a convolution (kernel,
stride, pad, num_output, group), `k/s+p` for pooling. Then what BVLC's tool cannot know without
building the net, which caffepy builds (engine CAFFE: the layers as written, no fusion):

    top shape   parameters   forward FLOPs   memory (the tops' float32 values)

FLOPs count 2 per multiply-add in Convolution, Deconvolution and InnerProduct (plus one per
output for the bias), a window's size per output in Pooling, nothing for layers that only move
or reshape data, and one per output value elsewhere (a lower bound for Softmax, LRN, ...). A
top computed in place takes no memory of its own. A net that cannot be built (a Data layer's
database missing) is summarized with BVLC's columns alone and a warning saying why.
"""
import os
import re
import sys

from . import geometry, log, memory
from .errors import CaffepyError

# ANSI colours of blobs, used in turn (BVLC's palette); a bottom no layer wrote is on red
COLORS = ["92", "93", "94", "95", "97", "96", "42", "43;30", "100", "444", "103;30", "107;30"]
DISCONNECTED = "41"
_ANSI = re.compile(r"\033\[[\d;]+m")
# layers that move, copy or reshape values without arithmetic
_NO_ARITHMETIC = {"Input", "Data", "ImageData", "HDF5Data", "MemoryData", "DummyData", "WindowData",
                  "AnnotatedData", "Python", "Split", "Reshape", "Flatten", "Concat", "Slice", "Crop",
                  "Silence", "Dropout", "Tile", "Permute"}
HEADER = ["name", "type", "params", "bottoms", "", "tops", "window", "top shape", "parameters", "FLOPs",
          "memory"]


def printed_len(text):
    return len(_ANSI.sub("", text))


def _param_text(spec):
    out = [spec.name] if spec.name else []
    if spec.lr_mult != 1:
        out.append(f"x{spec.lr_mult:g}")
    if spec.decay_mult != 1:
        out.append(f"Dx{spec.decay_mult:g}")
    return " ".join(out)


def _window_text(lp, layer):
    """BVLC's `k/s+p n/g` (convolution) and `k/s+p` (pooling), from caffepy's geometry when the
    net was built (rectangular windows as `khxkw`)."""
    def pair(values, skip):
        h, w = values
        return "" if (h, w) == (skip, skip) else (str(h) if h == w else f"{h}x{w}")
    if lp.type in ("Convolution", "Deconvolution"):
        p = lp.convolution_param
        if layer is not None:
            window = geometry.conv_window(layer)
            text = pair(window.kernel, None)
            stride, pad = pair(window.stride, 1), pair(window.pad, 0)
        elif len(p.kernel_size) == 1:
            text = str(p.kernel_size[0])
            stride = str(p.stride[0]) if len(p.stride) and p.stride[0] != 1 else ""
            pad = str(p.pad[0]) if len(p.pad) and p.pad[0] != 0 else ""
        else:
            return ""
        text += (f"/{stride}" if stride else "") + (f"+{pad}" if pad else "") + f" {p.num_output}"
        return text + (f"/{p.group}" if p.group != 1 else "")
    if lp.type == "Pooling":
        p = lp.pooling_param
        if layer is not None:
            window = geometry.pool_window(layer)
            if window.kernel is None:
                return "global"
            return pair(window.kernel, None) + (f"/{pair(window.stride, 1)}" if pair(window.stride, 1) else "") \
                + (f"+{pair(window.pad, 0)}" if pair(window.pad, 0) else "")
        return str(p.kernel_size) + (f"/{p.stride}" if p.stride != 1 else "") + (f"+{p.pad}" if p.pad else "")
    return ""


def forward_flops(lp, layer, bottom_shapes, top_shapes):
    """Floating-point operations of one forward pass of the layer (see the module's rule)."""
    tops = sum(memory.count(s) for s in top_shapes)
    if lp.type in _NO_ARITHMETIC:
        return 0
    weights = layer.blobs[0].data.shape if layer is not None and layer.blobs else None
    bias = tops if layer is not None and len(layer.blobs) > 1 else 0
    if lp.type == "Convolution" and weights:
        return 2 * tops * memory.count(weights[1:]) + bias
    if lp.type == "Deconvolution" and weights:
        return 2 * memory.count(bottom_shapes[0]) * memory.count(weights[1:]) + bias
    if lp.type == "InnerProduct" and weights:
        return 2 * tops * (memory.count(weights) // weights[0]) + bias
    if lp.type == "Pooling" and layer is not None:
        window = geometry.pool_window(layer).sized(*bottom_shapes[0][-2:])
        return tops * window.kernel[0] * window.kernel[1]
    return tops


def _shape_text(shape):
    return "x".join(str(int(d)) for d in shape) if len(shape) else "scalar"


def _count_text(n):
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def summarize_net(param, net=None, color=False):
    """The table (a list of rows of cells) and the totals {parameters, flops, activations,
    parameter_bytes}; `net` the built net (its layers by name), or None for BVLC's columns only."""
    disconnected = set()
    for lp in param.layer:
        disconnected |= set(lp.top)
        disconnected -= set(lp.bottom)
    paint = (lambda code, text: f"\033[{code}m{text}\033[0m") if color else (lambda code, text: text)
    colors, table = {}, []
    totals = dict(parameters=0, flops=0, activations=0, parameter_bytes=0)
    for lp in param.layer:
        tops = []
        for i, top in enumerate(lp.top):
            code = colors.setdefault(top, COLORS[len(colors) % len(COLORS)])
            text = "\033[1;4m" + top if color and top in disconnected else top
            if len(lp.loss_weight):
                text = f"{lp.loss_weight[i]:g} * {text}"
            tops.append(paint(code, text))
        bottoms = [paint(colors.get(b, DISCONNECTED), b) for b in lp.bottom]
        kind = f"{lp.python_param.module}.{lp.python_param.layer}" if lp.type == "Python" else lp.type
        specs = [_param_text(p) for p in lp.param]
        specs = f"({', '.join(specs)})" if any(specs) else ""
        layer = net.layer_dict.get(lp.name) if net is not None else None
        row = [lp.name, kind, specs, ", ".join(bottoms), "->", ", ".join(tops), _window_text(lp, layer)]
        if net is not None:
            bottom_shapes = [net.blobs[b].data.shape for b in lp.bottom]
            top_shapes = [net.blobs[t].data.shape for t in lp.top]
            count = sum(b.data.size for b in layer.blobs)
            flops = forward_flops(lp, layer, bottom_shapes, top_shapes)
            own = sum(memory.count(s) * 4 for t, s in zip(lp.top, top_shapes) if t not in lp.bottom)
            totals["parameters"] += count
            totals["parameter_bytes"] += sum(b.data.nbytes for b in layer.blobs)
            totals["flops"] += flops
            totals["activations"] += own
            row += [", ".join(_shape_text(s) for s in top_shapes), _count_text(count) if count else "",
                    _count_text(flops) if flops else "", memory.human(own) if own else ""]
        table.append(row)
    return table, totals


def format_table(table, max_width=30):
    """BVLC's layout: columns as narrow as their cells, at most `max_width`; a longer cell
    overflows into the next column's space when it can."""
    widths = [min(max(printed_len(row[j]) + 1 for row in table), max_width) for j in range(len(table[0]))]
    lines = []
    for row in table:
        text, right = "", 0
        for cell, width in zip(row, widths):
            right += width
            text += cell + " "
            text += " " * max(right - printed_len(text), 0)
        lines.append(text.rstrip())
    return lines


def summarize(model, phase="TEST", level=0, stages=(), max_width=30, color=None):
    """Print the summary of the net file `model` in `phase` to stdout."""
    from . import upgrade
    from .engine import set_net_engine
    from .net import TEST, TRAIN, Net, filter_net, net_state

    param = upgrade.read_net(model)
    phase_value = TRAIN if phase == "TRAIN" else TEST
    state = net_state(phase_value, level, stages)
    state.stage.extend(s for s in param.state.stage if s not in state.stage)     # as Net merges them
    filtered = filter_net(param, state, source=model)
    set_net_engine(param, "CAFFE")
    # built only to be measured: no set-up lines, and the rules' algorithms rather than timing each
    autotune = os.environ.get("CAFFEPY_AUTOTUNE")
    os.environ["CAFFEPY_AUTOTUNE"] = "0"
    try:
        with log.quieted():
            net = Net(param, phase=phase_value, level=level, stages=list(stages), source=model)
    except CaffepyError as e:
        log.warning(f"summarize: shapes, parameters and FLOPs need the net built, and it cannot be: {e}")
        net = None
    finally:
        if autotune is None:
            del os.environ["CAFFEPY_AUTOTUNE"]
        else:
            os.environ["CAFFEPY_AUTOTUNE"] = autotune
    color = sys.stdout.isatty() if color is None else color
    table, totals = summarize_net(filtered, net, color)
    header = HEADER if net is not None else HEADER[:7]
    for line in format_table([header] + table, max_width):
        print(line)
    if net is not None:
        batch = net.blobs[net.inputs[0]].data.shape[0] if net.inputs else None
        per = f" for a batch of {batch}" if batch else ""
        print(f"Total: {len(table)} layers, {totals['parameters']:,} parameters "
              f"({memory.human(totals['parameter_bytes'])}), {totals['flops'] / 1e9:.3g} GFLOPs forward{per}, "
              f"{memory.human(totals['activations'])} of activations (training also keeps a diff of each "
              f"blob and parameter)")
    return table, totals
