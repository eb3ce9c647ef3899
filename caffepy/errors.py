"""One exception family for every mistake a user can make.

The CLI prints `str(error)` on one line and exits 1 (usage errors 2); anything
outside this family is a bug and keeps its traceback.
Message shape: `<file>: layer '<name>' (<Type>): <field>: <problem>, got <value>[. <hint>]`.
"""
import traceback

from google.protobuf.message import Message


class CaffepyError(Exception):
    """A user-facing error: the message alone tells what is wrong and where."""

    exit_code = 1


class UsageError(CaffepyError):
    """Wrong command-line flags or arguments."""

    exit_code = 2


class PrototxtError(CaffepyError):
    """A prototxt or binary proto file that cannot be read or is invalid."""


class BlobValuesError(PrototxtError, ValueError):
    """A BlobProto whose values do not fit its shape (a ValueError too, as pycaffe's
    blobproto_to_array raises)."""


class LayerError(CaffepyError):
    """A layer whose parameters or bottoms are invalid (names the layer)."""


class ShapeError(LayerError):
    """Blob shapes that do not fit together."""


class ArgumentTypeError(LayerError, TypeError):
    """A NetSpec argument of the wrong type (a TypeError too, as pycaffe raises)."""


class SizeError(ShapeError):
    """A size that is negative, overflows, or needs more memory than there is.

    Raised by a Blob (`blob` and `shape` set, no layer in the message yet: the
    Net adds the layer and the field) or directly in the house shape.
    """

    def __init__(self, message, blob=None, shape=None):
        super().__init__(message)
        self.blob = blob
        self.shape = shape


class DataError(CaffepyError):
    """A database, image or record that cannot be used."""


class SolverError(CaffepyError):
    """A solver setting that cannot be honoured, or training that went wrong."""


class ParallelError(CaffepyError):
    """A problem in multi-rank training (names the rank)."""


# An error line quotes at most this many characters of a value (a repeated
# field of 100,000 entries would otherwise make a 600 KB line).
QUOTE_LIMIT = 200


def quote(value, limit=QUOTE_LIMIT):
    """`value` as text for an error line: bytes decoded, what is not printable escaped
    (a damaged record's key is any bytes), cut to `limit` characters."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8", "backslashreplace")
    text = str(value)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def one_line(message, limit=10 * QUOTE_LIMIT):
    """A message as one line of at most about `limit` characters (head and tail kept)."""
    text = " ".join(str(message).splitlines())
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return f"{text[:head]} ... [{len(text) - head - tail} characters cut] ... {text[-tail:]}"


def layer_error(layer, field, problem, value=None, hint=None, cls=LayerError, source=None):
    """Build the house-shaped message for a layer (a Layer or a LayerParameter); `source`
    names the file when it is not the layer's own (a weights file), or the layer has none."""
    param = layer if isinstance(layer, Message) else layer.param
    where = f"layer '{quote(param.name)}' ({quote(param.type)})"
    source = source or getattr(layer, "source", None)
    msg = f"{source + ': ' if source else ''}{where}: {field}: {problem}"
    if value is not None:
        msg += f", got {quote(value)}"
    if hint:
        msg += f". {hint}"
    return cls(msg)


# -- a Python layer's own exception ---------------------------------------------------------
_PYTHON_LAYER = "_caffepy_python_layer"


def mark_python_layer_error(exc, where, tb):
    """Record on `exc` (raised by a Python layer's code: the user's) the layer it came from and
    its traceback from the user's frame on; the note shows where in any traceback print."""
    if getattr(exc, _PYTHON_LAYER, None) is None:
        setattr(exc, _PYTHON_LAYER, (where, tb))
        if hasattr(exc, "add_note"):        # Python 3.11+
            exc.add_note(f"(raised in {where})")


def raised_in_python_layer(exc):
    return getattr(exc, _PYTHON_LAYER, None) is not None


def python_layer_report(exc):
    """For an exception a Python layer raised: the layer's name, then the traceback of the
    layer's code, as the command line prints it; None for any other exception."""
    mark = getattr(exc, _PYTHON_LAYER, None)
    if mark is None:
        return None
    where, tb = mark
    report = traceback.TracebackException(type(exc), exc, tb)
    if getattr(report, "__notes__", None):
        report.__notes__ = [n for n in report.__notes__ if n != f"(raised in {where})"] or None
    return (f"{where}: raised {type(exc).__name__} (the traceback of the layer's code follows)\n"
            + "".join(report.format(chain=False)).rstrip("\n"))
