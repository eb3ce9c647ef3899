"""Net: a DAG of layers over named blobs, built from a NetParameter as Caffe does.

Construction follows Caffe's Net::Init: filter layers by NetState (net_state,
filter_net: FilterNet and StateMeetsRule of net.cpp), insert Split layers where
one top feeds several bottoms (their backward sums the gradients),
wire in-place layers to the same Blob, decide which layers need backward, and
share parameters by `param { name }`. Which implementation of each layer runs is the
factory's choice (caffepy.layer.create_layer), from the layer's parameters, its bottoms
and the run context the Net was given.

The same class is the pycaffe-compatible Python API: `Net(prototxt, weights,
caffe.TEST)`, `net.blobs`, `net.params`, `net.forward(**inputs)`, ...
"""
import collections
import os
import types

import numpy as np
from google.protobuf import text_format

from . import layers as _layers  # noqa: F401  (registers every layer type)
from . import log, memory, net_memory, net_rules, precision, prototxt, upgrade
from .blob import Blob
from .context import SINGLE
from .errors import (CaffepyError, PrototxtError, ShapeError, SizeError, layer_error, quote,
                     raised_in_python_layer)
from .layer import LAYERS, Phase, create_layer
from .layout_plan import LayoutPlan
from .proto import caffe_pb2

TRAIN = Phase.TRAIN
TEST = Phase.TEST


# -- NetState filtering (Caffe's Net::FilterNet / Net::StateMeetsRule) ---------
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
    out = prototxt.copy_message(net_param, skip="layer")
    out.state.CopyFrom(state)
    for layer in net_param.layer:
        if layer_included(layer, state, source):
            out.layer.add().CopyFrom(layer)
    return out


def _state_text(state):
    stages = ", ".join(f'"{s}"' for s in state.stage) or "none"
    return f"phase {caffe_pb2.Phase.Name(state.phase)}, level {state.level}, stage {stages}"


def _rules_text(layer):
    """`layer 'x' (Type) with include { ... } or include { ... }` (or its exclude rules)."""
    kind, rules = ("include", layer.include) if len(layer.include) else ("exclude", layer.exclude)
    joined = " or ".join(f"{kind} {{ {text_format.MessageToString(r, as_one_line=True)} }}" for r in rules)
    return f"layer '{quote(layer.name)}' ({quote(layer.type)}) with {joined}"


# -- Split layers (Caffe's insert_splits.cpp) -----------------------------------
def split_layer_name(layer_name, blob_name, top_index):
    return f"{blob_name}_{layer_name}_{top_index}_split"


def split_blob_name(layer_name, blob_name, top_index, split_index):
    return f"{split_layer_name(layer_name, blob_name, top_index)}_{split_index}"


AUTOMATIC_TOP = "(automatic)"


def add_automatic_tops(param):
    """Caffe's AutoTopBlobs: a loss layer written without a top (BVLC's pascal_finetune example
    has one) gets an anonymous one, which carries its loss but feeds no layer and is no output of
    the net. Adds them to `param` (a copy of the user's) and returns their names."""
    made = []
    for lp in param.layer:
        variants = LAYERS.get(lp.type)
        cls = next(iter(variants.values())) if variants else None
        if cls is None or not cls.is_loss:
            continue
        while len(lp.top) < max(cls.min_tops or 0, cls.exact_tops or 0):
            name = AUTOMATIC_TOP if not made else f"{AUTOMATIC_TOP} {len(made) + 1}"
            lp.top.append(name)
            made.append(name)
    return made


def insert_splits(param, source=None, unfiltered=None):
    """Return a copy of `param` with Split layers wherever a top feeds several bottoms.

    A bottom always refers to the most recent layer that produced that name, so an
    in-place chain (conv -> relu in place -> pool) needs no split. `unfiltered`: the net
    before filter_net left layers out by `param.state`; the error for an unknown bottom names
    the left-out layers that produce it (BVLC's mnist_autoencoder reads 'data' from layers of
    stage test-on-train or test-on-test only).
    """
    last_producer = {}            # blob name -> (layer index, top index)
    consumers = collections.defaultdict(list)   # (layer, top) -> [(layer, bottom index)]
    loss_weighted = set()
    for li, layer in enumerate(param.layer):
        for bi, name in enumerate(layer.bottom):
            if name not in last_producer:
                producers = [o for o in (unfiltered.layer if unfiltered else ())
                             if name in o.top and not layer_included(o, param.state)]
                if producers:
                    raise layer_error(layer, "bottom", f"unknown blob '{quote(name)}' (bottom index "
                                      f"{bi}): in {_state_text(param.state)} no layer produces it; "
                                      f"left out: " + "; ".join(_rules_text(o) for o in producers),
                                      hint="Choose the net state with --phase, --level or --stage (a "
                                           "solver's test_state does it for its test nets)", source=source)
                raise layer_error(layer, "bottom", f"unknown blob '{quote(name)}' (bottom index {bi}); "
                                  "no earlier layer produces it", source=source)
            consumers[last_producer[name]].append((li, bi))
        for ti, name in enumerate(layer.top):
            last_producer[name] = (li, ti)
            if ti < len(layer.loss_weight) and layer.loss_weight[ti] != 0:
                loss_weighted.add((li, ti))

    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    renamed = {}   # (consumer layer, bottom index) -> new bottom name
    splits_after = {}
    for key, users in consumers.items():
        n_out = len(users) + (1 if key in loss_weighted else 0)
        if n_out > 1:
            splits_after.setdefault(key[0], []).append((key[1], users))
    for li, layer in enumerate(param.layer):
        new = out.layer.add()
        new.CopyFrom(layer)
        for bi in range(len(new.bottom)):
            if (li, bi) in renamed:
                new.bottom[bi] = renamed[(li, bi)]
        for ti, users in splits_after.get(li, []):
            blob = layer.top[ti]
            split = out.layer.add()
            split.name = split_layer_name(layer.name, blob, ti)
            split.type = "Split"
            split.bottom.append(blob)
            n = len(users)
            for k in range(n):
                split.top.append(split_blob_name(layer.name, blob, ti, k))
            if (li, ti) in loss_weighted:
                # the original top keeps its loss weight; the split's first top takes it
                split.top.append(split_blob_name(layer.name, blob, ti, n))
                split.loss_weight.extend([0.0] * n + [layer.loss_weight[ti]])
                new.loss_weight[ti] = 0
            for k, (ci, cb) in enumerate(users):
                renamed[(ci, cb)] = split_blob_name(layer.name, blob, ti, k)
    return out


def _size_error(layer, error):
    """A Blob's SizeError in the house shape: the layer, and the prototxt field that
    asked for the size when one holds the offending dimension."""
    if error.blob is None:
        return error
    field, value = memory.size_field(layer.param, error.shape or ())
    return layer.error(field or "shape", str(error), value, cls=SizeError)


class Net:
    """A network. `Net(path_or_NetParameter, [weights], phase, level=0, stages=())`;
    `context` is the run's RunContext (caffepy.context; one process alone by default).
    `keep_blobs=False` (a TEST net that only runs forward and whose outputs alone are read:
    caffepy/net_memory.py) lets the blobs between inputs and outputs share memory."""
    _activations = None             # SharedActivations, under keep_blobs=False

    def __init__(self, network=None, *args, phase=None, weights=None, level=0, stages=None, source=None,
                 network_file=None, context=SINGLE, keep_blobs=True):
        if network is None:
            network = network_file    # pycaffe's keyword: Net(network_file=..., phase=...)
        if network is None:
            raise TypeError("Net needs a network (a prototxt path or a NetParameter)")
        args = list(args)
        if args and isinstance(args[0], (str, os.PathLike)):
            weights = args.pop(0)
        if args:
            phase = args.pop(0)
        if args:
            raise TypeError("Net(network, [weights], phase)")
        if phase is None:
            raise TypeError("Net needs a phase (caffe.TRAIN or caffe.TEST)")
        if isinstance(network, caffe_pb2.NetParameter):
            param = network
            self.source = source or param.name or "<net>"
        else:
            self.source = os.fspath(network)
            param = upgrade.read_net(self.source)
        self.phase = phase
        self.context = context
        state = net_state(phase, level, stages or [])
        for s in param.state.stage:
            if s not in state.stage:
                state.stage.append(s)
        filtered = filter_net(param, state, self.source)
        self._init(filtered, param)
        if not keep_blobs and not net_memory.keep_every_blob():
            if phase != caffe_pb2.TEST:
                raise CaffepyError(f"{self.source}: keep_blobs=False is for a TEST net: training "
                                   f"reads every blob's values in backward")
            self._activations = net_memory.SharedActivations(self)
        if weights:
            for path in str(weights).split(","):
                self.copy_from(path)

    # -- construction ----------------------------------------------------
    def _init(self, param, unfiltered=None):
        self.name = param.name
        self.param = param
        param = insert_splits(param, self.source, unfiltered)
        automatic = add_automatic_tops(param)
        self._blobs = collections.OrderedDict()   # every blob, the plan's conversions' included
        self.layers = []
        self._layer_names = []
        self._first_named = {}        # name: index of the first layer of that name
        self.bottom_vecs, self.top_vecs = [], []
        self.bottom_names, self.top_names = collections.OrderedDict(), collections.OrderedDict()
        self.blob_loss_weights = {}
        self._top_loss_weights = []
        self.inputs = []
        self.bottom_need_backward = []
        self.layer_need_backward = []
        self._params = []             # (layer index, param index, Blob) in net order
        # per layer: the layout plan's conversions that run before it, as
        # (layer, bottom blob, top blob, index of the bottom of this layer it feeds)
        self._conversions = []
        self._blob_need_backward = {}
        self._available = collections.OrderedDict()

        # which bottoms to convert first is the layout plan's answer (caffepy/layout_plan.py);
        # `wired` is the net with the blob names the layers read and write
        plan = LayoutPlan(self.param, param.layer, self.phase, self.context, self.source)
        wired = prototxt.copy_message(param, skip="layer")
        aliases = {}                  # a conversion's top -> its bottom (one blob, two layouts)
        for user_lp in param.layer:
            for bi, name in enumerate(user_lp.bottom):
                if plan.current(name) not in self._available:
                    raise layer_error(user_lp, "bottom", f"unknown blob '{name}' (bottom index {bi})",
                                      source=self.source)
            bottoms = [self._blobs[plan.current(name)] for name in user_lp.bottom]
            conversions = []
            for clp in plan.conversions(user_lp, bottoms):
                conversions.append(self._add_conversion(clp))
                aliases[clp.top[0]] = clp.bottom[0]
            lp = plan.wired(user_lp)
            self._add_layer(lp, user_lp)
            self._conversions.append([conv + (list(lp.bottom).index(conv[2].name),)
                                      for conv in conversions])
            wired.layer.add().CopyFrom(lp)
            del wired.layer[-1].param[:]
            wired.layer[-1].param.extend(user_lp.param)   # as the layer's setup left them
        if plan.summary():
            log.info(plan.summary())
        del self._blob_need_backward
        for name in automatic:
            self._available.pop(name, None)

        self._prune_backward(wired, aliases)
        if wired.force_backward:
            for li, layer in enumerate(self.layers):
                self.layer_need_backward[li] = True
                self.bottom_need_backward[li] = [
                    need or layer.allow_force_backward(bi)
                    for bi, need in enumerate(self.bottom_need_backward[li])]
                layer.param_propagate_down = [True] * len(layer.blobs)
        # Caffe keeps the remaining blobs in a std::set: outputs come in byte order of their names
        self.outputs = sorted((plan.user_name(name) for name in self._available),
                              key=lambda name: name.encode())
        del self._available
        # pycaffe's view: the blobs under the prototxt's names (a blob the plan converted for an
        # in-place layer is seen as the converted one, its last value)
        self.blobs = collections.OrderedDict(
            (name, self._blobs[plan.current(name)]) for name in self._blobs if not plan.made(name))
        # pycaffe lists every blob, with 0 for those outside the loss
        self.blob_loss_weights = collections.OrderedDict(
            (name, self.blob_loss_weights.get(plan.current(name), 0.0)) for name in self.blobs)
        self._share_params(wired)
        self.layer_dict = collections.OrderedDict(zip(self._layer_names, self.layers))
        # the net-compilation rules' units (caffepy/net_rules.py); `fusions` says which run
        # fused (tests and benchmarks narrow it), `_units` how
        self._unit_parts = {}          # net_rules.parts, by (first, last) layer
        self._steps = {}               # _forward_steps, by (start, end) layer
        self._units = net_rules.compile_net(self)
        self._concat_slots = net_rules.concat_slots(self, self._units)
        net_rules.byte_tops(self, self._units)
        self.fusions = {first: unit.last for first, unit in self._units.items()}
        if precision.current() != precision.F32:
            log.info(precision.summary(self.layers))

    def _add_conversion(self, clp):
        """Build and set up one of the layout plan's conversion layers: (layer, bottom, top)."""
        name = clp.bottom[0]
        del self._available[name]
        bottom, top = self._blobs[name], Blob(name=clp.top[0])
        self._blobs[top.name] = top
        layer = create_layer(clp, self.phase, self.source, bottoms=[bottom], context=self.context,
                             net=self.param)
        self._setup_layer(layer, [bottom], [top])
        self._blob_need_backward[top.name] = self._blob_need_backward[name]
        self._available[top.name] = True
        log.info(f"Setting up {clp.name}")
        log.info(f"Top shape: {top.shape_string()} ({top.layout})")
        return layer, bottom, top

    def _add_layer(self, lp, user_lp):
        """Build, wire and set up one layer: `lp` names the blobs it reads and writes, the
        layer is constructed from `user_lp` (the prototxt's; the blob names differ where the
        layout plan converted a bottom)."""
        available, blob_need_backward = self._available, self._blob_need_backward
        bottoms, tops = [], []
        need_backward = False
        bottom_need = []
        if len(lp.propagate_down) not in (0, len(lp.bottom)):
            raise layer_error(lp, "propagate_down", f"needs one value per bottom ({len(lp.bottom)})",
                              len(lp.propagate_down), source=self.source)
        for bi, name in enumerate(lp.bottom):
            if name not in available:
                raise layer_error(lp, "bottom", f"unknown blob '{name}' (bottom index {bi})",
                                  source=self.source)
            del available[name]
            bottoms.append(self._blobs[name])
            need = blob_need_backward[name]
            if len(lp.propagate_down):
                need = need and bool(lp.propagate_down[bi])
            bottom_need.append(need)
            need_backward |= need
        layer = create_layer(user_lp, self.phase, self.source, bottoms=bottoms, context=self.context,
                             net=self.param)
        layer.bottom_need_backward = list(bottom_need)
        for ti, name in enumerate(lp.top):
            if name in lp.bottom:
                blob = self._blobs[name]           # in place
            elif name in self._blobs:
                raise layer.error("top", f"blob '{name}' is produced by more than one layer")
            else:
                blob = Blob(name=name)
                self._blobs[name] = blob
            if lp.type == "Input":
                self.inputs.append(name)
            available[name] = True
            tops.append(blob)
        self._setup_layer(layer, bottoms, tops)
        weights = layer.loss_weights(len(tops))
        for name, w in zip(lp.top, weights):
            if w:
                self.blob_loss_weights[name] = self.blob_loss_weights.get(name, 0.0) + w
        self._top_loss_weights.append(weights)
        log.info(f"Setting up {lp.name}")
        for blob in tops:
            log.info(f"Top shape: {blob.shape_string()}")
        if getattr(layer, "int8", None) is not None:
            # the path is chosen at the first forward (quantization.Int8.run); caffepy time's
            # summary names the one taken
            algorithm = f" ({layer.algorithm})" if getattr(layer, "algorithm", None) else ""
            float32 = f"; float32{algorithm} where measured faster" if layer.int8.may_fall_back else ""
            log.info(f"Algorithm: int8 (quantization_param{float32}, chosen at the first forward)")
        elif getattr(layer, "algorithm", None):
            log.info(f"Algorithm: {layer.algorithm} ({getattr(layer, 'tuning', 'rule')})")
        # parameters: lr_mult 0 means no gradient for that blob
        layer.param_propagate_down = []
        specs = user_lp.param               # as the layer's setup left them (BatchNorm adds some)
        for pi in range(len(layer.blobs)):
            spec = specs[pi] if pi < len(specs) else None
            lr_mult = spec.lr_mult if spec is not None and spec.HasField("lr_mult") else 1.0
            wants = lr_mult != 0
            layer.param_propagate_down.append(wants)
            need_backward |= wants
        if len(specs) > len(layer.blobs):
            raise layer.error("param", f"has {len(layer.blobs)} parameter blobs but "
                              f"{len(specs)} param specs")
        for name in lp.top:
            blob_need_backward[name] = need_backward
        if lp.name in self._first_named and layer.blobs:
            # Caffe allows a repeated name (BVLC's mnist_autoencoder has two "loss" layers);
            # weights, matched by name, then reach only the first of them
            log.warning(f"{self.source}: layer '{lp.name}' ({layer.type}) has the name of layer "
                        f"{self._first_named[lp.name]}; weights files and shared test nets fill "
                        f"only the first layer of a name")
        self._first_named.setdefault(lp.name, len(self.layers))
        self.layers.append(layer)
        self._layer_names.append(lp.name)
        self.bottom_vecs.append(bottoms)
        self.top_vecs.append(tops)
        self.bottom_names[lp.name] = list(user_lp.bottom)
        self.top_names[lp.name] = list(user_lp.top)
        self.bottom_need_backward.append(bottom_need)
        self.layer_need_backward.append(need_backward)

    @staticmethod
    def _setup_layer(layer, bottoms, tops):
        try:
            layer.layer_setup(bottoms, tops)
        except SizeError as e:
            raise _size_error(layer, e) from None
        except (ValueError, IndexError) as e:
            if raised_in_python_layer(e):
                raise           # the user's code: its own traceback (errors.python_layer_report)
            raise layer.error("setup", str(e), cls=ShapeError) from None
        except MemoryError:
            free = memory.available()
            raise layer.error("setup", "out of memory while allocating its blobs", cls=SizeError,
                              hint=f"{memory.human(free)} of memory available" if free else None) from None

    def _prune_backward(self, param, aliases):
        """Caffe's rule: skip backward where nothing downstream reaches a loss. A blob and the
        layout plan's converted copy of it (`aliases`: copy -> original) count as one."""
        under_loss, skip = set(), set()
        for li in reversed(range(len(self.layers))):
            lp = param.layer[li]
            contributes = False
            skip_down = True
            for ti, name in enumerate(lp.top):
                name = aliases.get(name, name)
                if self._top_loss_weights[li][ti] or name in under_loss:
                    contributes = True
                if name not in skip:
                    skip_down = False
                if contributes and not skip_down:
                    break
            if self.layer_need_backward[li] and skip_down:
                self.layer_need_backward[li] = False
                self.bottom_need_backward[li] = [False] * len(lp.bottom)
            if not contributes:
                self.layer_need_backward[li] = False
            for bi, name in enumerate(lp.bottom):
                name = aliases.get(name, name)
                if contributes:
                    under_loss.add(name)
                else:
                    self.bottom_need_backward[li][bi] = False
                if not self.bottom_need_backward[li][bi]:
                    skip.add(name)

    def _share_params(self, param):
        """Give layers that name the same param the owner's Blob object."""
        owners = {}
        self.learnable_params, self.params_lr, self.params_weight_decay = [], [], []
        self.param_names, self.param_owner_index = [], []
        self.param_display_names = []
        learnable_index = {}
        for li, (layer, lp) in enumerate(zip(self.layers, param.layer)):
            for pi, blob in enumerate(layer.blobs):
                spec = lp.param[pi] if pi < len(lp.param) else caffe_pb2.ParamSpec()
                name = spec.name
                display = name or f"{lp.name}[{pi}]"
                if name and name in owners:
                    oli, opi = owners[name]
                    owner = self.layers[oli].blobs[opi]
                    strict = spec.share_mode != caffe_pb2.ParamSpec.PERMISSIVE
                    if (strict and owner.shape != blob.shape) or owner.count != blob.count:
                        raise layer.error(f"param '{name}'", "shared parameter shape mismatch: owner "
                                          f"'{self.layers[oli].name}' has {owner.shape}", blob.shape,
                                          cls=ShapeError)
                    layer.blobs[pi] = owner
                    owner_spec_lr = self.params_lr[learnable_index[(oli, opi)]]
                    lr = spec.lr_mult if spec.HasField("lr_mult") else 1.0
                    if lr != owner_spec_lr:
                        raise layer.error(f"param '{name}'", f"shared parameter lr_mult differs from "
                                          f"the owner's ({owner_spec_lr})", lr)
                    continue
                if name:
                    owners[name] = (li, pi)
                learnable_index[(li, pi)] = len(self.learnable_params)
                self.learnable_params.append(blob)
                self.params_lr.append(spec.lr_mult if spec.HasField("lr_mult") else 1.0)
                self.params_weight_decay.append(spec.decay_mult if spec.HasField("decay_mult") else 1.0)
                self.param_display_names.append(display)
        self.params = collections.OrderedDict(
            (name, layer.blobs) for name, layer in zip(self._layer_names, self.layers) if layer.blobs)

    # -- running ---------------------------------------------------------
    def first_layer(self, name):
        """The first layer named `name` (None if there is none): the one Caffe gives the
        weights of that name when copying or sharing them; names may repeat."""
        li = self._first_named.get(name)
        return None if li is None else self.layers[li]

    def _index(self, name, default):
        if name is None:
            return default
        if name not in self.layer_dict:
            raise CaffepyError(f"{self.source}: no layer named '{name}'")
        return self._layer_names.index(name)

    def forward_from_to(self, start=0, end=None, before_layer=None):
        """Run layers start..end inclusive; return the weighted loss (summed in float, as Caffe).
        `before_layer(layer_index)` is called before each layer runs (the solver applies a late
        update there)."""
        end = len(self.layers) - 1 if end is None else end
        loss = np.float32(0)
        # the arenas planned (when a blob left its place) only where no blob but the kept
        # ones holds a value another part of a forward reads: before a forward from the first
        # layer (or from past the data layers, whose tops are kept), at the shapes the blobs
        # have now, and after one through the last
        plans = self._activations is not None
        if plans and all(not self.bottom_vecs[li] for li in range(start)):
            self._activations.check()
        li = start
        try:
            for first, last, unit, prepare, losses in self._forward_steps(start, end):
                if before_layer is not None:
                    before_layer(first)
                for li, layer, bottom, top, conversion in prepare:
                    _reshape(layer, bottom, top)
                    if conversion:
                        layer.forward(bottom, top)
                li = first
                if unit is None:
                    layer.forward(bottom, top)      # the step's lone layer, prepare's last
                else:
                    if before_layer is not None:    # their parameters' deferred updates first
                        for other in range(first + 1, last + 1):
                            before_layer(other)
                    unit.rule.forward(self, unit, last)
                for w, blob in losses:
                    loss += np.float32(w) * np.float32(_total(blob.data))
        except SizeError as e:
            if e.blob is None:
                raise
            raise _size_error(self.layers[li], e) from None
        if plans and end == len(self.layers) - 1:     # the next forward's, at this one's shapes
            self._activations.check()
        return float(loss)

    def _forward_steps(self, start, end):
        """forward_from_to's steps over layers start..end, made once per span: (first, last,
        unit or None, prepare, losses) per fused unit that ends by `end` (net_rules) or lone
        layer; `prepare`: (index, layer, bottom, top, conversion) for each layer of the step
        and each layout conversion before it, in order, to reshape (and run, a conversion)
        before the step runs: a unit writes its layers' tops (a block end's sum into the
        Eltwise's top, at the batch the input has now); `losses`: (weight, top) of the step's
        weighted tops."""
        steps = self._steps.get((start, end))
        if steps is not None:
            return steps
        steps, li = [], start
        while li <= end:
            last = self.fusions.get(li)
            unit = self._units[li] if last is not None and last <= end else None
            last = last if unit is not None else li
            prepare, losses = [], []
            for at in range(li, last + 1):
                tops = self.top_vecs[at]
                for conversion, b, t, _ in self._conversions[at]:
                    prepare.append((at, conversion, [b], [t], True))
                prepare.append((at, self.layers[at], self.bottom_vecs[at], tops, False))
                losses += [(w, blob) for w, blob in zip(self._top_loss_weights[at], tops) if w]
            steps.append((li, last, unit, prepare, losses))
            li = last + 1
        self._steps[start, end] = steps
        return steps

    def backward_from_to(self, start=None, end=0, on_layer_done=None, every_layer=False):
        """Run backward from `start` down to `end`; `on_layer_done(layer_index)` is called
        as soon as a layer's parameter gradients are final (to overlap communication).
        `every_layer` runs the layers that reach no loss too, as Caffe's `time` does: their
        parameter gradients (lr_mult != 0), never a bottom diff that backward does not need."""
        if self._activations is not None:
            raise CaffepyError(f"{self.source}: backward: this net shares its activations' "
                               f"memory (keep_blobs=False) and backward reads them: build it "
                               f"with keep_blobs=True")
        start = len(self.layers) - 1 if start is None else start
        fused_back = {last: first for first, last in self.fusions.items()}
        done = len(self.layers)       # the first layer of a fused unit that already ran
        for li in range(start, end - 1, -1):
            if not (every_layer or self.layer_need_backward[li]):
                continue
            top = self.top_vecs[li]
            for w, blob in zip(self._top_loss_weights[li], top):
                if w:
                    blob.diff[...] = w
            layer, first = self.layers[li], fused_back.get(li)
            if li >= done:
                pass
            elif first is not None and first >= end \
                    and self._units[first].rule.backward(self, self._units[first], li, every_layer):
                done = first
            else:
                layer.backward(top, self.bottom_need_backward[li], self.bottom_vecs[li])
            for conversion, b, t, bi in reversed(self._conversions[li]):
                if self.bottom_need_backward[li][bi]:
                    conversion.backward([t], [True], [b])
            if on_layer_done is not None and self.layers[li].blobs:
                on_layer_done(li)

    def units(self):
        """(first, last) layer indices of what runs as one, in net order: (i, i) for a layer,
        (i, j) for a fused unit (see fusions). Timing layer by layer times these."""
        out, li = [], 0
        while li < len(self.layers):
            last = self.fusions.get(li, li)
            out.append((li, last))
            li = last + 1
        return out

    def layer_bottoms(self, li):
        """The blobs holding layer li's bottoms as the prototxt names them: where the layout plan
        converts a bottom first, the blob it converts from (writing that feeds the layer)."""
        blobs = list(self.bottom_vecs[li])
        for _, source, _, bi in self._conversions[li]:
            blobs[bi] = source
        return blobs

    def forward_backward(self):
        loss = self.forward_from_to()
        self.backward_from_to()
        return loss

    def clear_param_diffs(self):
        for blob in self.learnable_params:
            blob.diff[...] = 0

    def reshape(self):
        for conversions, layer, bottom, top in zip(self._conversions, self.layers, self.bottom_vecs,
                                                   self.top_vecs):
            for conversion, b, t, _ in conversions:
                conversion.reshape([b], [t])
            layer.reshape(bottom, top)

    def unwritten_blobs(self):
        """Names of the blobs this net's forward may leave unwritten (their values stale): in a
        TEST net, the convolution tops that a fused unit computes past (ResNet's
        `res2a_branch2c`, ...: the sum is written straight into the Eltwise's top), the blobs
        between a chain's layers (Intel's Inception-v3: `conv_1_1_conv2d`, `..._bn` before
        `..._relu`) and the branches written straight into a concat's top (GoogLeNet's
        `inception_3a/1x1`, ...).
        CAFFEPY_FOLD=0 builds a net that writes them all; a TRAIN net always does. Under
        keep_blobs=False, also every blob whose memory it shares (caffepy/net_memory.py)."""
        skipped = net_rules.unwritten(self)
        return [name for name, blob in self.blobs.items() if any(blob is b for b in skipped)
                or (self._activations is not None and not self._activations.kept(blob))]

    # -- pycaffe API -----------------------------------------------------
    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """Set inputs from kwargs, run forward, return {output name: data}."""
        for name, value in kwargs.items():
            if name not in self.blobs:
                raise CaffepyError(f"{self.source}: forward: no blob named '{name}'")
            target = self.blobs[name]
            value = np.asarray(value)
            if value.shape != target.shape:
                if value.ndim and target.num_axes and value.shape[0] != target.shape[0]:
                    raise ShapeError(f"{self.source}: input '{name}' is not batch sized: expected "
                                     f"{target.shape}, got {value.shape}")
                raise ShapeError(f"{self.source}: input '{name}': expected shape {target.shape}, "
                                 f"got {value.shape}")
            target.data[...] = value
        s = self._index(start, 0)
        e = self._index(end, len(self.layers) - 1)
        outs = set(self.outputs if end is None else self.top_names[self._layer_names[e]])
        outs.update(blobs or [])
        if self._activations is not None:
            for name in sorted(outs):
                if name in self.blobs and not self._activations.kept(self.blobs[name]):
                    raise CaffepyError(f"{self.source}: forward: blob '{name}' is not kept: this "
                                       f"net shares its activations' memory (keep_blobs=False); "
                                       f"build it with keep_blobs=True to read it")
        self.forward_from_to(s, e)
        return {name: self.blobs[name].data for name in outs}

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """Set top diffs from kwargs, run backward, return {input name: diff}."""
        for name, value in kwargs.items():
            self.blobs[name].diff[...] = value
        s = self._index(start, len(self.layers) - 1)
        e = self._index(end, 0)
        self.backward_from_to(s, e)
        outs = set(self.inputs if end is None else self.bottom_names[self._layer_names[e]])
        outs.update(diffs or [])
        return {name: self.blobs[name].diff for name in outs}

    def forward_all(self, blobs=None, **kwargs):
        """pycaffe's forward_all: run `kwargs` (input name: N x ... array, any N) through the
        net in batches of the net's batch size; return {output or `blobs` name: N x ... array}.
        The last partial batch is padded with zeros and the padding trimmed from the outputs."""
        names = list(dict.fromkeys(self.outputs + list(blobs or [])))
        if not kwargs:
            outs = self.forward(blobs=blobs)
            return {name: outs[name].copy() for name in names}
        num = self._batch_count(kwargs)
        parts = {name: [] for name in names}
        for batch in self._batch(kwargs):
            outs = self.forward(blobs=blobs, **batch)
            for name in names:
                parts[name].append(outs[name].copy())
        return {name: np.concatenate(parts[name])[:num] for name in names}

    def forward_backward_all(self, blobs=None, diffs=None, **kwargs):
        """pycaffe's forward_backward_all: `kwargs` holds inputs (for forward) and output diffs
        (for backward), N items each, run in batches as forward_all. Returns ({output or `blobs`
        name: array}, {input or `diffs` name: diff array}), padding trimmed."""
        import itertools
        out_names = list(dict.fromkeys(self.outputs + list(blobs or [])))
        diff_names = list(dict.fromkeys(self.inputs + list(diffs or [])))
        for name in kwargs:
            if name not in self.inputs and name not in self.outputs:
                raise CaffepyError(f"{self.source}: forward_backward_all: '{name}' is neither a net "
                                   f"input ({', '.join(self.inputs) or 'none'}) nor an output "
                                   f"({', '.join(self.outputs)})")
        num = self._batch_count(kwargs) if kwargs else None
        forward_batches = self._batch({k: v for k, v in kwargs.items() if k in self.inputs})
        backward_batches = self._batch({k: v for k, v in kwargs.items() if k in self.outputs})
        all_outs = {name: [] for name in out_names}
        all_diffs = {name: [] for name in diff_names}
        for fb, bb in itertools.zip_longest(forward_batches, backward_batches, fillvalue={}):
            outs = self.forward(blobs=blobs, **fb)
            grads = self.backward(diffs=diffs, **bb)
            for name in out_names:
                all_outs[name].append(outs[name].copy())
            for name in diff_names:
                all_diffs[name].append(grads[name].copy())
        return ({name: np.concatenate(v)[:num] for name, v in all_outs.items()},
                {name: np.concatenate(v)[:num] for name, v in all_diffs.items()})

    def _batch_count(self, arrays):
        """The common number of items of the arrays handed to forward_all."""
        counts = {name: len(value) for name, value in arrays.items()}
        if len(set(counts.values())) > 1:
            raise ShapeError(f"{self.source}: the arrays hold different numbers of items: "
                             + ", ".join(f"{k} {v}" for k, v in counts.items()))
        return next(iter(counts.values()))

    def _batch(self, arrays):
        """Yield {name: batch} slices of `arrays` in the net's batch size (the first blob's first
        axis, as pycaffe), the last one padded with zeros to a full batch."""
        if not arrays:
            return
        num = self._batch_count(arrays)
        batch_size = next(iter(self.blobs.values())).shape[0]
        arrays = {name: np.asarray(value) for name, value in arrays.items()}
        for start in range(0, num - num % batch_size, batch_size):
            yield {name: value[start:start + batch_size] for name, value in arrays.items()}
        remainder = num % batch_size
        if remainder:
            yield {name: np.concatenate([value[num - remainder:],
                                         np.zeros((batch_size - remainder,) + value.shape[1:], value.dtype)])
                   for name, value in arrays.items()}

    def share_with(self, other):
        """Caffe's ShareTrainedLayersWith: every layer of `other` that this net also has (by
        name) lends its parameter data to it; the two nets then see one set of weights."""
        for name, source in zip(other._layer_names, other.layers):
            layer = self.first_layer(name)
            if layer is None:
                log.info(f"Ignoring source layer {name}")
                continue
            if len(layer.blobs) != len(source.blobs):
                raise ShapeError(f"{self.source}: layer '{name}' ({layer.type}): blobs: has "
                                 f"{len(layer.blobs)} parameter blobs, the source net's layer has "
                                 f"{len(source.blobs)}")
            for i, (mine, theirs) in enumerate(zip(layer.blobs, source.blobs)):
                if mine.shape != theirs.shape:
                    raise ShapeError(f"{self.source}: layer '{name}' ({layer.type}): blobs[{i}]: cannot "
                                     f"share weights of shape {theirs.shape_string()}, this net's "
                                     f"are {mine.shape_string()}")
                mine.share_data(theirs)

    def save_hdf5(self, path, write_diff=False):
        """Write the weights as Caffe's HDF5 (`data/<layer>/<i>`); needs h5py."""
        from . import net_hdf5
        net_hdf5.save(self, path, write_diff)

    def load_hdf5(self, path):
        """Load weights from Caffe's HDF5 layout by layer name; needs h5py."""
        from . import net_hdf5
        net_hdf5.load(self, path)

    def set_input_arrays(self, data, labels):
        """pycaffe: hand arrays to the net's first layer, which must be MemoryData
        (data N x C x H x W, labels N; N a multiple of its batch_size)."""
        if not self.layers or self.layers[0].type != "MemoryData":
            raise CaffepyError(f"{self.source}: set_input_arrays: the first layer must be MemoryData")
        self.layers[0].reset(data, labels)

    def copy_from(self, path):
        """Load weights by layer name (Caffe's CopyTrainedLayersFrom): from Caffe's HDF5
        layout when the file is HDF5 (a .caffemodel.h5; needs h5py), else a .caffemodel."""
        from . import net_hdf5
        if net_hdf5.is_hdf5(path) or str(path).endswith((".h5", ".hdf5")):
            net_hdf5.load(self, path)
            return
        source = upgrade.read_binary_net(path)
        self.copy_from_param(source, path)

    def copy_from_param(self, source, path="<weights>"):
        """Copy the blobs of `source`'s layers into the layers of the same name.

        As Caffe, layers of the file missing from the net are ignored and layers of
        the net missing from the file keep their initial values (fine-tuning renames
        layers on purpose), with a warning naming them; but weights that fill no
        layer at all are a mistake (a wrong or empty file) and are refused."""
        from .blobproto import blobproto_to_array
        wanting = [name for name in self._first_named if self.first_layer(name).blobs]
        loaded = set()
        for lp in self._split_merged_scales(source, path):
            layer = self.first_layer(lp.name)
            if layer is None:
                log.info(f"Ignoring source layer {lp.name}")
                continue
            if len(lp.blobs) != len(layer.blobs):
                raise layer_error(layer, "blobs", f"the file has {len(lp.blobs)} parameter blobs, "
                                  f"the net expects {len(layer.blobs)}", source=path, cls=ShapeError)
            if layer.blobs:
                loaded.add(lp.name)
            for i, (bp, blob) in enumerate(zip(lp.blobs, layer.blobs)):
                array = blobproto_to_array(bp, source=path, where=f"layer '{lp.name}' ({layer.type}): "
                                           f"blobs[{i}]")
                if array.shape != blob.shape:
                    legacy = (not bp.HasField("shape")) and array.size == blob.count
                    if not legacy:
                        raise layer_error(layer, f"blobs[{i}]", f"shape mismatch: file has "
                                          f"{array.shape}, net has {blob.shape}", source=path,
                                          cls=ShapeError)
                blob.data[...] = array.reshape(blob.shape)
        missed = [name for name in wanting if name not in loaded]
        if wanting and not loaded:
            names = [lp.name for lp in source.layer if lp.blobs]
            found = (f"its layers with weights are {quote(', '.join(names))}" if names
                     else "it holds no layer with weights")
            raise CaffepyError(f"{path}: no layer of the net got weights from this file: {found}; the "
                               f"net's are {quote(', '.join(wanting))}. Is it the caffemodel of this net?")
        if missed:
            log.warning(f"{path}: no weights for layer(s) {quote(', '.join(missed))} of {self.source}; "
                        f"they keep their initial values")

    def _split_merged_scales(self, source, path):
        """The layers of `source`, with Intel Caffe's merged BatchNorms given back their Scale.

        Intel's MKL2017 / MKLDNN engines fold the Scale after a BatchNorm into it (its compiler's
        RemoveScale rule), so their caffemodels hold a BatchNorm of 4 or 5 blobs (mean, variance,
        factor, then the Scale's scale and shift) and no Scale layer. Caffe's BatchNorm keeps 3: the
        last ones go to the Scale that takes the BatchNorm's top in this net."""
        from .blobproto import array_to_blobproto
        named = {lp.name for lp in source.layer if len(lp.blobs)}
        for lp in source.layer:
            layer = self.first_layer(lp.name)
            if layer is None or layer.type != "BatchNorm" or len(lp.blobs) not in (4, 5) \
                    or len(layer.blobs) != 3:
                yield lp
                continue
            scale = self._scale_after(self._first_named[lp.name])
            if scale is None or scale.name in named or len(lp.blobs) - 3 > len(scale.blobs):
                raise layer_error(layer, "blobs", f"the file has {len(lp.blobs)} parameter blobs (Intel "
                                  f"Caffe's BatchNorm with its Scale folded in), the net expects 3",
                                  source=path, cls=ShapeError,
                                  hint="Put a Scale layer (bias_term: true) in place after the BatchNorm "
                                       "to take the scale and shift, as Intel's prototxts have")
            head = caffe_pb2.LayerParameter(name=lp.name, type=lp.type)
            head.blobs.extend(lp.blobs[:3])
            tail = caffe_pb2.LayerParameter(name=scale.name, type="Scale")
            tail.blobs.extend(lp.blobs[3:])
            if len(scale.blobs) > len(tail.blobs):         # Intel's bias_term: false: no shift
                tail.blobs.add().CopyFrom(array_to_blobproto(np.zeros(scale.blobs[1].shape, np.float32)))
            log.info(f"{path}: layer '{lp.name}' holds Intel Caffe's merged Scale; its scale and shift "
                     f"go to layer '{scale.name}'")
            yield head
            yield tail

    def _scale_after(self, li):
        """The Scale layer with one bottom that reads layer li's first top, if the next layer
        reading that top is one."""
        top = self.top_vecs[li][0] if self.top_vecs[li] else None
        for lj in range(li + 1, len(self.layers)):
            if any(b is top for b in self.bottom_vecs[lj]):
                layer = self.layers[lj]
                return layer if layer.type == "Scale" and len(self.bottom_vecs[lj]) == 1 else None
        return None

    def to_proto(self, write_diff=False, arrays=None):
        """Caffe's Net::ToProto: every layer as the net runs it (Split layers and renamed
        bottoms included), each with its `phase` and, for a loss layer that gave none, the
        `loss_weight: 1` Caffe's LossLayer adds; then its blobs. `arrays` maps a parameter
        Blob to the (data, diff) written in its place (a solver's snapshot of parameters
        split across ranks: their whole arrays)."""
        from .blobproto import array_to_blobproto
        arrays = arrays or {}
        out = caffe_pb2.NetParameter()
        out.name = self.name
        for layer in self.layers:
            lp = out.layer.add()
            lp.CopyFrom(layer.param)
            del lp.blobs[:]
            if not lp.HasField("phase"):
                lp.phase = self.phase
            if layer.is_loss and not lp.loss_weight:
                lp.loss_weight.extend(layer.loss_weights(len(lp.top)))
            for blob in layer.blobs:
                data, diff = arrays.get(blob, (blob.data, blob.diff if write_diff else None))
                lp.blobs.append(array_to_blobproto(data, diff if write_diff else None))
        return out

    def save(self, path):
        prototxt.write_binary(self.to_proto(), path)

    @property
    def top_loss_weights(self):
        return self._top_loss_weights

    def __repr__(self):
        return f"<Net '{self.name}' with {len(self.layers)} layers>"


def _total(array):
    """The float64 sum of a loss top; a loss layer's one value as it is (np.sum: 4 us)."""
    return array.item() if array.size == 1 else np.sum(array, dtype=np.float64)


def _reshape(layer, bottom, top):
    """layer.reshape, skipped for a layer whose reshape depends on shapes alone when no blob has
    changed its shape, layout or buffers since its last one (Blob.arrangement: one compare, where
    listing the shapes cost ~1.5 us a layer, 1 ms of a ResNet-50 b1 forward), or when its
    bottoms, tops and own blobs have the shapes they had then; a layer whose reshape reads the
    blobs' buffers too (reshape_from_blobs: Split) only in the first case."""
    if layer._reshaped_arrangement == Blob.arrangement and (layer.reshape_from_shapes
                                                            or layer.reshape_from_blobs):
        return
    if not layer.reshape_from_shapes:
        layer.reshape(bottom, top)
        layer._reshaped_arrangement = Blob.arrangement
        return
    shapes = [b.shape for b in bottom] + [t.shape for t in top] + [b.shape for b in layer.blobs]
    if shapes != layer._reshaped_at:
        layer.reshape(bottom, top)
        layer._reshaped_at = ([b.shape for b in bottom] + [t.shape for t in top]
                              + [b.shape for b in layer.blobs])
    layer._reshaped_arrangement = Blob.arrangement
