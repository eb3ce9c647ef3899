"""Which engine runs each layer: Intel Caffe's `engine` rule, decided here and nowhere else.

caffepy has two engines: Caffe's own algorithms (plain NCHW, im2col + GEMM, no Winograd, no
fused units), named CAFFE, and its fast path (channels-last regions, Winograd, fused units),
the default, which Intel's fast engines MKL2017 and MKLDNN name. For each layer, the first of
these that names an engine decides (Intel Caffe's order: layer_factory.cpp reads a *_param's
enum before the layer's string; Net::Init gives the net's engine to a layer without one;
the -engine flag, and a solver's `engine` for the nets it builds, overwrite the net's):

    CAFFEPY_ENGINE=CAFFE in the environment      caffepy's own: every layer of every net
    the layer's *_param `engine` enum              convolution_param { engine: CAFFE }, not DEFAULT
    the layer's `engine` string                    engine: "CAFFE"; MKL2017 and MKLDNN give way to
                                                   the net's when the net names the other one
    the net's engine                               -engine X, else the solver's engine: X, else
                                                   the net's own engine: "X"
    none                                           the fast path

An engine string is NAME or NAME:SUB[,SUB...] (Intel's EngineParser): NAME is CAFFE, MKL2017 or
MKLDNN (any case), or DEFAULT / empty (no choice made); only MKLDNN takes subengines (CPU, FPGA,
DLA; caffepy runs them all on this CPU). Anything else is refused in one line, wherever it is
written, and so is CUDNN: a GPU engine, and caffepy runs on the CPU (Caffe built for the CPU
refuses it too).
"""
import os
import re

from .errors import CaffepyError, PrototxtError, layer_error, quote

CAFFE, MKL2017, MKLDNN = "CAFFE", "MKL2017", "MKLDNN"
NAMES = (CAFFE, MKL2017, MKLDNN)
SUBENGINES = ("CPU", "FPGA", "DLA")
ACCEPTED = ("CAFFE (Caffe's algorithms), MKLDNN, MKLDNN:CPU or MKL2017 (the fast path), or DEFAULT "
            "(what the net and its layers say)")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def problem(text):
    """What is wrong with engine string `text`, or None if it names an engine."""
    head, colon, tail = text.partition(":")
    head = head.strip().upper()
    if not colon:
        if head in ("", "DEFAULT") + NAMES:
            return None
        if head == "CUDNN":
            return "CUDNN is a GPU engine and caffepy runs on the CPU"
        return "unknown engine"
    if head not in NAMES:
        return "unknown engine" if head else "no engine before ':'"
    if head != MKLDNN:
        return f"{head} takes no subengines (only MKLDNN does)"
    subs = [s for s in re.split(r"[\s,;]+", tail) if s]
    if not subs:
        return "no subengine after ':'"
    for sub in subs:
        if not _IDENTIFIER.fullmatch(sub) or sub.upper() not in SUBENGINES:
            return f"unknown MKLDNN subengine '{quote(sub)}' (MKLDNN takes {', '.join(SUBENGINES)})"
    return None


def name(text):
    """The engine `text` names, without subengines: CAFFE, MKL2017, MKLDNN, or '' (no choice);
    `text` must be valid (see `problem`)."""
    head = text.partition(":")[0].strip().upper()
    return "" if head == "DEFAULT" else head


def _checked(text, where):
    """name(text), or a PrototxtError `<where>: <problem>, got '<text>'` (where names the file
    and field)."""
    wrong = problem(text)
    if wrong:
        raise PrototxtError(f"{where}: {wrong}, got '{quote(text)}'. Accepted: {ACCEPTED}")
    return name(text)


def _environment():
    value = os.environ.get("CAFFEPY_ENGINE", "").strip().upper()
    if value not in ("", "DEFAULT", CAFFE):
        raise CaffepyError(f"CAFFEPY_ENGINE: must be CAFFE or DEFAULT, got '{quote(value)}'")
    return value == CAFFE


def set_net_engine(net_param, text, where="engine"):
    """Give net_param the engine `text` (the -engine flag, or a solver's `engine` for its nets)
    unless it names none (DEFAULT or empty): it then wins over the net's own."""
    if _checked(text, where):
        net_param.engine = text.strip()


def net_engine(net_param, source=None):
    """The engine a net names for its layers ('' for none), checked."""
    return _checked(net_param.engine, f"{source or net_param.name or '<net>'}: engine")


def _param_engine(layer_param, source):
    """The engine a *_param's enum names ('' if none), checked."""
    for field, value in layer_param.ListFields():
        if field.message_type is None or field.is_repeated \
                or "engine" not in value.DESCRIPTOR.fields_by_name or not value.engine:
            continue
        enum = value.DESCRIPTOR.fields_by_name["engine"].enum_type
        chosen = enum.values_by_number[value.engine].name
        if chosen == "CUDNN":
            raise layer_error(layer_param, f"{field.name}.engine", "CUDNN is a GPU engine and caffepy "
                              "runs on the CPU", chosen, hint=f"Accepted: {ACCEPTED}", source=source)
        return chosen
    return ""


def layer_engine(layer_param, net_param=None, source=None):
    """The engine that runs the layer ('' for the default, the fast path), by the rule of the
    module docstring; every engine the layer and the net name is checked."""
    own = layer_param.engine
    wrong = problem(own)
    if wrong:
        raise layer_error(layer_param, "engine", wrong, f"'{own}'", hint=f"Accepted: {ACCEPTED}",
                          source=source)
    net = net_engine(net_param, source) if net_param is not None else ""
    enum = _param_engine(layer_param, source)
    if _environment():
        return CAFFE
    if enum:
        return enum
    if name(own):
        # Intel's Net::Init: a layer's MKL2017 and the net's MKLDNN (or the reverse) take the net's
        if net_param is not None and {own.strip().upper(), net_param.engine.strip().upper()} == {MKL2017, MKLDNN}:
            return net
        return name(own)
    return net


def caffe_engine(layer_param=None, net_param=None, source=None):
    """Whether Caffe's own algorithms run the layer (or, without one, the net's layers that
    name no engine of their own)."""
    if layer_param is not None:
        return layer_engine(layer_param, net_param, source) == CAFFE
    if _environment():
        return True
    return net_param is not None and net_engine(net_param, source) == CAFFE
