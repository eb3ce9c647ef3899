"""pycaffe's NetSpec: write a net in Python, get a caffe_pb2.NetParameter.

    from caffepy import layers as L, params as P, NetSpec
    n = NetSpec()
    n.data, n.label = L.Data(source="train_lmdb", backend=P.Data.LMDB, batch_size=64,
                             ntop=2, transform_param=dict(scale=1 / 255))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20,
                            weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.conv1, in_place=True)
    text = str(n.to_proto())

`L.<Type>(*bottoms, **kwargs)` makes one layer. Keywords are set on the layer's
`<type>_param` sub-message, found through the LayerParameter descriptor (the field whose
message is `<Type>Parameter`); keywords ending in `param` (`param`, `transform_param`,
`loss_param`, ...) and fields only LayerParameter has (`loss_weight`, `include`,
`propagate_down`, `name`) go to the layer itself. Special keywords: `ntop` (number of tops,
default 1; 0 gives the layer object, which NetSpec accepts too) and `in_place` (tops = bottoms).
Values: dicts fill sub-messages, lists fill repeated fields (a list of dicts adds one
message per dict), a scalar for a repeated field is a one-element list, enums take the
number (P.Pooling.MAX) or the name ("MAX").

Names: a top assigned to `n.<name>` is called <name>, and a layer takes the name of its
first top; anything unnamed is called <Type><k> (Convolution1, ...), as pycaffe names them.
"""
import collections
import importlib

from google.protobuf.descriptor import FieldDescriptor

from .errors import ArgumentTypeError, LayerError, layer_error, quote
from .proto import caffe_pb2

# layer types whose parameters live in another type's sub-message
_SHARED_PARAM = {"Deconvolution": "convolution_param", "Im2col": "convolution_param"}
# keywords that shape the layer and are not proto fields
_SPECIAL = ("ntop", "in_place")


def _param_fields():
    """{layer type: name of its `*_param` field} from the LayerParameter descriptor."""
    out = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            type_name = field.message_type.name
            if type_name.endswith("Parameter"):
                out.setdefault(type_name[: -len("Parameter")], field.name)
    out.update(_SHARED_PARAM)
    return out


PARAM_FIELDS = _param_fields()


def param_name_dict():
    """pycaffe's {layer type: parameter name}, e.g. {"Convolution": "convolution", ...}."""
    return {t: f[: -len("_param")] for t, f in PARAM_FIELDS.items()}


class _Where:
    """What layer_error needs to name a layer being built."""

    source = "NetSpec"

    def __init__(self, layer):
        self.param = layer


def _is_repeated(field):
    return field.is_repeated


def _enum_value(field, value, where, path):
    if isinstance(value, str):
        known = field.enum_type.values_by_name
        if value not in known:
            raise layer_error(where, path, "unknown enum value", repr(value),
                              f"Known values: {', '.join(known)}")
        return known[value].number
    return value


def _scalar(field, value, where, path):
    if field.type == FieldDescriptor.TYPE_ENUM:
        return _enum_value(field, value, where, path)
    return value


def assign(msg, name, value, where, path=None):
    """Set field `name` of proto `msg` from a Python value (dict, list or scalar)."""
    path = path or name
    field = msg.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        raise layer_error(where, path, f"no such field in {msg.DESCRIPTOR.name}", repr(value))
    is_message = field.type == FieldDescriptor.TYPE_MESSAGE
    try:
        if _is_repeated(field):
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            container = getattr(msg, name)
            for i, item in enumerate(values):
                if is_message:
                    _fill(container.add(), item, where, f"{path}[{i}]")
                else:
                    container.append(_scalar(field, item, where, path))
        elif is_message:
            _fill(getattr(msg, name), value, where, path)
        else:
            setattr(msg, name, _scalar(field, value, where, path))
    except LayerError:
        raise                 # from a nested field: already names it
    except TypeError as e:
        raise layer_error(where, path, f"cannot take this value ({e})", repr(value),
                          cls=ArgumentTypeError) from None
    except ValueError as e:
        raise layer_error(where, path, f"cannot take this value ({e})", repr(value)) from None


def assign_proto(proto, name, value):
    """pycaffe's assign_proto: set field `name` of `proto` from a dict, list or scalar."""
    assign(proto, name, value, _Where(proto if isinstance(proto, caffe_pb2.LayerParameter)
                                      else caffe_pb2.LayerParameter(name="?", type="?")))


def _fill(msg, value, where, path):
    if isinstance(value, type(msg)):
        msg.CopyFrom(value)
        return
    if not isinstance(value, dict):
        raise layer_error(where, path, f"needs a dict of {msg.DESCRIPTOR.name} fields", repr(value),
                          cls=ArgumentTypeError)
    for key, item in value.items():
        assign(msg, key, item, where, f"{path}.{key}")


class Top:
    """One output of a layer (what `L.<Type>(...)` returns, and what bottoms are made of)."""

    def __init__(self, fn, n):
        self.fn, self.n = fn, n

    def to_proto(self):
        """A NetParameter holding this top and every layer it depends on."""
        return to_proto(self)

    def _to_proto(self, layers, names, autonames):
        return self.fn._to_proto(layers, names, autonames)


class Function:
    """One layer call: its type, bottoms and keyword parameters."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for i, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                # pycaffe's exact words (its own test suite matches them); the hint rides in a
                # note, which tracebacks print
                error = ArgumentTypeError(f"{type_name} input {i} is not a Top (type is {type(inp)})")
                if hasattr(error, "add_note"):        # Python 3.11+
                    tuple_hint = "; a layer with ntop > 1 returns a tuple of tops: pick one with [i]"
                    error.add_note(f"a bottom is a top made by another layer (L.<Type>(...)), got "
                                   f"{quote(repr(inp))}{tuple_hint if isinstance(inp, tuple) else ''}")
                raise error
        self.inputs = list(inputs)
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        if self.in_place and self.ntop != len(self.inputs):
            raise LayerError(f"NetSpec: layer of type '{type_name}': in_place: needs as many tops as "
                             f"bottoms ({len(self.inputs)}), got ntop={self.ntop}")
        self.tops = tuple(Top(self, i) for i in range(self.ntop))

    def _top_name(self, top, names, autonames):
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = f"{top.fn.type_name}{autonames[top.fn.type_name]}"
        return names[top]

    def _name(self, names, autonames):
        if self not in names:
            if self.ntop > 0:
                names[self] = self._top_name(self.tops[0], names, autonames)
            else:
                autonames[self.type_name] += 1
                names[self] = f"{self.type_name}{autonames[self.type_name]}"
        return names[self]

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottoms = []
        for inp in self.inputs:
            inp._to_proto(layers, names, autonames)
            bottoms.append(layers[inp.fn].top[inp.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottoms)
        if self.in_place:
            layer.top.extend(bottoms)
        else:
            layer.top.extend(self._top_name(top, names, autonames) for top in self.tops)
        layer.name = self._name(names, autonames)
        where = _Where(layer)
        sub_name = PARAM_FIELDS.get(self.type_name)
        for key, value in self.params.items():
            if key.endswith("param"):
                assign(layer, key, value, where)
                continue
            sub = getattr(layer, sub_name) if sub_name else None
            if sub is not None and key in sub.DESCRIPTOR.fields_by_name:
                assign(sub, key, value, where, f"{sub_name}.{key}")
            elif key in layer.DESCRIPTOR.fields_by_name:
                assign(layer, key, value, where)
            else:
                inside = f"{sub_name} or " if sub_name else ""
                raise layer_error(where, key, f"no such field in {inside}LayerParameter", repr(value))
        layers[self] = layer


class NetSpec:
    """Named tops, in assignment order: `n.conv1 = L.Convolution(n.data, ...)`."""

    def __init__(self):
        super().__setattr__("tops", collections.OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(f"NetSpec has no top '{name}'") from None

    def __setitem__(self, key, value):
        self.__setattr__(key, value)

    def __getitem__(self, key):
        return self.__getattr__(key)

    def __delitem__(self, key):
        del self.tops[key]

    def keys(self):
        return list(self.tops.keys())

    def vals(self):
        return list(self.tops.values())

    def to_proto(self):
        names = {v: k for k, v in self.tops.items()}
        autonames = collections.Counter()
        layers = collections.OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


def to_proto(*tops):
    """A NetParameter with `tops` and everything they depend on (auto-named)."""
    layers = collections.OrderedDict()
    autonames = collections.Counter()
    for top in tops:
        top._to_proto(layers, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


class Layers:
    """`L.Convolution(bottom, ...)`: any capitalized attribute is a layer type (checked when
    the net is built, as Caffe does). Returns one Top, a tuple of tops (ntop > 1), or the
    layer itself (ntop=0).

    `caffepy.layers` is this object (pycaffe's name), which hides the caffepy.layers
    subpackage; lower-case attributes (`caffepy.layers.common`) still reach the subpackage.
    """

    def __getattr__(self, type_name):
        if type_name.startswith("__"):
            raise AttributeError(type_name)
        if not type_name[:1].isupper():
            return getattr(importlib.import_module("caffepy.layers"), type_name)

        def layer_fn(*args, **kwargs):
            fn = Function(type_name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops
        layer_fn.__name__ = type_name
        return layer_fn


class _ParamEnums:
    def __init__(self, message):
        self._message = message

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(self._message, name)
        except AttributeError:
            raise AttributeError(f"{self._message.DESCRIPTOR.name} has no enum value '{name}'") from None


class Parameters:
    """`P.Pooling.MAX`, `P.Data.LMDB`: enum values of `<Type>Parameter` messages."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        message = getattr(caffe_pb2, name + "Parameter", None)
        if message is None:
            raise AttributeError(f"caffe.proto has no message '{name}Parameter'")
        return _ParamEnums(message)


layers = Layers()
params = Parameters()
