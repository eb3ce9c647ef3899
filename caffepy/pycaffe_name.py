"""`import caffe` gives caffepy: pycaffe's name for the same API.

Installing caffepy installs a package `caffe` beside it whose import binds the name to the
caffepy module itself (`import caffe; caffe is caffepy`), so scripts and Python layers written
for pycaffe (`import caffe`, `caffe.Layer`, `from caffe.proto import caffe_pb2`,
`caffe.io.load_image`) run unchanged. `caffe.X` is the module `caffepy.X`, never a second
copy of it (a second caffe_pb2 would register Caffe's messages twice).

When a real Caffe is on the path too:
- in your own Python process, Python's path order decides: a Caffe build's python/ directory
  on PYTHONPATH comes before site-packages, so `import caffe` finds that Caffe;
- when caffepy loads a Python layer (`caffepy train`, or a net you build), caffepy takes the
  name first if nothing has imported a `caffe` yet, and warns once that the Caffe it found on
  the path is shadowed: the layer's module then subclasses caffepy's caffe.Layer;
- if that real Caffe was imported before caffepy loads the layer, a layer class built on it
  cannot run in caffepy, and loading it is refused in one line naming that Caffe.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from . import log

_OURS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "caffe", "__init__.py")
_warned = []


def _caffepy():
    return sys.modules[__package__]


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds caffe.X as caffepy.X while `caffe` is caffepy."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("caffe.") or sys.modules.get("caffe") is not _caffepy():
            return None
        if name == "caffe.layers":
            # pycaffe has no such module either: caffe.layers is NetSpec's layer factory
            raise ModuleNotFoundError("caffe.layers is NetSpec's layer factory, not a module: write "
                                      "`from caffe import layers as L`", name=name)
        if importlib.util.find_spec("caffepy" + name[len("caffe"):]) is None:
            return None         # not there: Python's own message names caffe.X
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return importlib.import_module("caffepy" + spec.name[len("caffe"):])

    def exec_module(self, module):
        pass        # caffepy.X is loaded already: the same object, untouched


def install():
    """Bind `caffe` (and `caffe.X`) to caffepy in this process."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
    sys.modules["caffe"] = _caffepy()


def shadowed_caffe():
    """The file of a `caffe` package on sys.path other than caffepy's, or None."""
    spec = importlib.machinery.PathFinder.find_spec("caffe")
    if spec is None or not spec.origin:
        return None
    origin = os.path.abspath(spec.origin)
    return None if origin == _OURS else origin


def foreign_caffe():
    """The file of an imported `caffe` that is not caffepy, or None."""
    module = sys.modules.get("caffe")
    if module is None or module is _caffepy():
        return None
    return getattr(module, "__file__", None) or repr(module)


def claim():
    """Before a Python layer's module is imported: make `import caffe` give caffepy unless a
    `caffe` was imported already (then foreign_caffe() names it)."""
    if "caffe" in sys.modules:
        return
    other = shadowed_caffe()
    if other and not _warned:
        _warned.append(other)
        log.warning(f"a Caffe is on the Python path ({os.path.dirname(other)}); Python layers run by "
                    f"caffepy get caffepy as `caffe`")
    install()
