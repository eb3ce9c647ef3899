"""Python layers: `type: "Python"` runs a user class, as pycaffe does.

    layer { type: "Python" bottom: "data" top: "out"
            python_param { module: "my_layers" layer: "Double" param_str: "{'k': 2}" } }

`module` is imported from sys.path or the current directory; `layer` names a class in it
that subclasses caffepy.Layer (pycaffe's caffe.Layer: `import caffe` gives caffepy, see
caffepy/pycaffe_name.py) and defines setup / reshape / forward / backward(top,
propagate_down, bottom); any of them may be left out, as pycaffe's base class allows (a
layer may define only setup; a forward left out is reported when the net runs it). Tops may
be reshaped in reshape or in forward (py-faster-rcnn's layers size theirs there). Before
setup it gets `self.param_str` (and `self.param_str_`, the older pycaffe's name that
py-faster-rcnn reads) and `self.phase` (caffe.TRAIN or caffe.TEST: str() gives 'TRAIN' or
'TEST'), and `self.blobs.add_blob(*shape)` creates a learnable blob, as in pycaffe.
python_param { module layer param_str share_in_parallel (ignored: one process per rank) }.

Errors: a module that cannot be imported (or raises while imported) and a class that is not
there are one line naming the layer and the module. An exception from the layer's own code is
the user's: it propagates unchanged (type, message, traceback) with a note naming the layer,
and the command line prints the layer's name, then its traceback (errors.python_layer_report).
"""
import functools
import importlib
import os
import sys

from .. import pycaffe_name
from ..blob import Blob
from ..errors import CaffepyError, layer_error, mark_python_layer_error
from ..layer import Layer, Phase, register


class BlobVec(list):
    """A Python layer's parameter blobs: a list with pycaffe's `add_blob(*shape)`."""

    def __init__(self, name, blobs=()):
        super().__init__(blobs)
        self._name = name

    def add_blob(self, *shape):
        self.append(Blob(shape, name=f"{self._name}.{len(self)}"))


class _Where:
    """What layer_error needs to name a layer that has no instance yet."""

    def __init__(self, param, source):
        self.param, self.source = param, source


def _import(name):
    """Import `name` from sys.path, then from the current directory."""
    pycaffe_name.claim()
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(name)
    finally:
        if added:
            sys.path.remove(cwd)


def _user_class(param, source):
    p = param.python_param
    where = _Where(param, source)
    if not p.module:
        raise layer_error(where, "python_param.module", "is required (the Python module to import)")
    if not p.layer:
        raise layer_error(where, "python_param.layer", "is required (the class in the module)")
    try:
        module = _import(p.module)
    except ModuleNotFoundError as e:
        if e.name and (p.module == e.name or p.module.startswith(e.name + ".")):
            raise layer_error(where, "python_param.module", "cannot import module", f"'{p.module}'",
                              f"Put {p.module.split('.')[0]}.py in the current directory ({os.getcwd()}) "
                              f"or on PYTHONPATH") from None
        raise layer_error(where, "python_param.module", f"importing '{p.module}' failed",
                          f"ModuleNotFoundError: {e}") from e
    except Exception as e:   # the user's module is user input: report its error on one line
        text = " ".join(str(e).split())
        raise layer_error(where, "python_param.module", f"importing '{p.module}' failed",
                          f"{type(e).__name__}: {text}") from e
    cls = getattr(module, p.layer, None)
    if cls is None:
        known = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Layer) and v is not Layer)
        raise layer_error(where, "python_param.layer", f"module '{p.module}' has no class", f"'{p.layer}'",
                          f"Layer classes there: {', '.join(known) or 'none'}")
    if not (isinstance(cls, type) and issubclass(cls, Layer)):
        other = pycaffe_name.foreign_caffe()
        if other and isinstance(cls, type):
            raise layer_error(where, "python_param.layer", f"subclasses the caffe.Layer of another Caffe "
                              f"({other}, imported before caffepy loaded this layer), which caffepy cannot run",
                              f"'{p.layer}' in '{p.module}'", "Import caffepy's `caffe` instead: do not import "
                              "that Caffe in the same process (or put it off PYTHONPATH)")
        raise layer_error(where, "python_param.layer", "must name a subclass of caffepy.Layer (caffe.Layer)",
                          f"'{p.layer}' in '{p.module}'")
    return _runnable(cls)


class _Defaults:
    """What caffe.Layer supplies to a Python layer that leaves reshape or forward out (a layer
    may define only setup): reshape leaves the tops as they are; forward says what is missing."""

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        p = self.param.python_param
        raise layer_error(self, "python_param.layer", "class must define forward(bottom, top)",
                          f"'{p.layer}' in '{p.module}'")


def _reporting(method, name):
    """`method` of a user's class, its own exceptions marked with the layer that raised them."""
    @functools.wraps(method)
    def run(self, *args):
        try:
            return method(self, *args)
        except CaffepyError:
            raise           # caffepy's own (a blob reshaped wrongly): one line already
        except Exception as e:
            mark_python_layer_error(e, f"{self.source + ': ' if self.source else ''}layer '{self.name}' "
                                       f"(Python {type(self).__module__}.{type(self).__qualname__}): {name}",
                                    e.__traceback__.tb_next)
            raise
    return run


@functools.lru_cache(maxsize=None)
def _runnable(cls):
    """The user's class as the Net runs it: the base class's reshape and forward where it left
    them out, each method's exceptions marked (the class's name and isinstance unchanged)."""
    body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    for name in ("setup", "reshape", "forward", "backward"):
        method = getattr(cls, name)
        if method is getattr(Layer, name):
            method = getattr(_Defaults, name, method)
        body[name] = _reporting(method, name)
    return type(cls.__name__, (cls,), body)


@register
class Python(Layer):
    """Stands in the registry for every user class: constructing it returns the user's layer."""

    def __new__(cls, param, phase=0, source=None):
        user_cls = _user_class(param, source)
        layer = user_cls(param, phase, source)
        layer.param_str = layer.param_str_ = param.python_param.param_str
        layer.phase = Phase(phase)
        layer.blobs = BlobVec(param.name, layer.blobs)
        if layer.type is None:
            layer.type = "Python"     # for messages that name the type of a layer object
        return layer
