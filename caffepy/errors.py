"""One exception family for every mistake a user can make.

The CLI prints `str(error)` on one line and exits 1 (usage errors 2); anything
outside this family is a bug and keeps its traceback.
Message shape: `<file>: layer '<name>' (<Type>): <field>: <problem>, got <value>[. <hint>]`.
"""
from google.protobuf.message import Message


class CaffepyError(Exception):
    """A user-facing error: the message alone tells what is wrong and where."""

    exit_code = 1


class UsageError(CaffepyError):
    """Wrong command-line flags or arguments."""

    exit_code = 2


class PrototxtError(CaffepyError):
    """A prototxt or binary proto file that cannot be read or is invalid."""


class LayerError(CaffepyError):
    """A layer whose parameters or bottoms are invalid (names the layer)."""


class ShapeError(LayerError):
    """Blob shapes that do not fit together."""


class ArgumentTypeError(LayerError, TypeError):
    """A NetSpec argument of the wrong type (a TypeError too, as pycaffe raises)."""


class DataError(CaffepyError):
    """A database, image or record that cannot be used."""


class SolverError(CaffepyError):
    """A solver setting that cannot be honoured, or training that went wrong."""


class ParallelError(CaffepyError):
    """A problem in multi-rank training (names the rank)."""


def layer_error(layer, field, problem, value=None, hint=None, cls=LayerError, source=None):
    """Build the house-shaped message for a layer (a Layer or a LayerParameter); `source`
    names the file when it is not the layer's own (a weights file), or the layer has none."""
    param = layer if isinstance(layer, Message) else layer.param
    where = f"layer '{param.name}' ({param.type})"
    source = source or getattr(layer, "source", None)
    msg = f"{source + ': ' if source else ''}{where}: {field}: {problem}"
    if value is not None:
        msg += f", got {value}"
    if hint:
        msg += f". {hint}"
    return cls(msg)
