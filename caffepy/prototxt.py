"""Caffe's io.cpp for protobuf messages: text and binary files in and out.

* every mistake in a file is one PrototxtError line naming `file:line:col`;
* every write is atomic (temporary file, fsync, rename), and a binary message
  over protobuf's 2 GiB limit is refused before anything is written;
* temporary names say who writes them, `.<name>.<pid>@<host>.<random>.tmp`, so
  the ones a killed process left behind can be told from those of a live writer
  and removed (`remove_stale_temporaries`).

Nothing here upgrades: a net or solver as Caffe reads it (parsed, then
upgraded from older formats) comes from upgrade.py's read_net / read_solver.
"""
import contextlib
import difflib
import math
import os
import re
import shutil
import socket
import tempfile

import numpy as np
from google.protobuf import message as _pb_message
from google.protobuf import text_encoding, text_format

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


def temporary_affixes(path):
    """(prefix, suffix) of the temporary names (mkstemp / mkdtemp in the same directory) under
    which `path` is written: `.<name>.<pid>@<host>.` + random + `.tmp`."""
    return f".{os.path.basename(path)}.{os.getpid()}@{socket.gethostname()}.", ".tmp"


# mkstemp's random part: 8 of [a-z0-9_]
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)@(?P<host>[^/]+)\.[a-z0-9_]{8}\.tmp")


def remove_stale_temporaries(directory, final_name):
    """Remove the temporary files and directories in `directory` that were being written to a
    final name matching the regular expression `final_name` (matched whole) by a process of
    this host that no longer exists (killed mid-write). Names of another host, of a live
    process, or not of our shape are left alone. Returns [(path, bytes)] of what was removed."""
    host, removed = socket.gethostname(), []
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return removed
    for entry in names:
        m = _TEMPORARY.fullmatch(entry)
        if not m or m["host"] != host or not re.fullmatch(final_name, m["name"]) or _alive(int(m["pid"])):
            continue
        path = os.path.join(directory, entry)
        size = _size(path)
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append((path, size))
    return removed


def _alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:         # another user's process: alive
        return True
    return True


def _size(path):
    if not os.path.isdir(path):
        with contextlib.suppress(OSError):
            return os.path.getsize(path)
        return 0
    total = 0
    for here, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(here, name))
    return total


@contextlib.contextmanager
def atomic_path(path):
    """A temporary name next to `path` for the block to write a file at: renamed to `path`
    (after fsync) when the block ends, removed when it raises.  Readers see the old file or
    the whole new one.  Temporary files of `path` left by a killed writer are removed first;
    OSErrors become one CaffepyError line naming `path`."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(directory, re.escape(os.path.basename(path)))
    prefix, suffix = temporary_affixes(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=directory)
    except OSError as e:
        raise CaffepyError(f"{path}: cannot write: {e.strerror}") from None
    try:
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)
        finally:
            os.close(fd)
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CaffepyError(f"{path}: cannot write: {e.strerror or e}") from None
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


def atomic_write(path, data):
    """Write bytes to `path` so that readers see the old file or the whole new one."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


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


def format_float(value, double=False):
    """A float field as C++ protobuf's TextFormat prints it (SimpleFtoa / SimpleDtoa):
    %g with 6 significant digits (15 for a double), or 9 (17) when that would not read
    back as the same number: `1`, `0.1`, `1e-05`, `0.123456791`, `3.40282347e+38`."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if not double:
        value = float(np.float32(value))
    short, full = (15, 17) if double else (6, 9)
    text = f"{value:.{short}g}"
    same = float(text) == value if double else np.float32(text) == np.float32(value)
    return text if same else f"{value:.{full}g}"


def _print_message(msg, indent, out):
    pad = " " * indent
    for field, value in msg.ListFields():
        values = value if field.is_repeated else [value]
        for v in values:
            if field.cpp_type == field.CPPTYPE_MESSAGE:
                out.append(f"{pad}{field.name} {{\n")
                _print_message(v, indent + 2, out)
                out.append(f"{pad}}}\n")
                continue
            if field.cpp_type == field.CPPTYPE_ENUM:
                named = field.enum_type.values_by_number.get(v)
                text = named.name if named is not None else str(v)
            elif field.cpp_type == field.CPPTYPE_STRING:
                raw = v if isinstance(v, bytes) else v.encode("utf-8")
                text = f'"{text_encoding.CEscape(raw, False)}"'
            elif field.cpp_type == field.CPPTYPE_BOOL:
                text = "true" if v else "false"
            elif field.cpp_type in (field.CPPTYPE_FLOAT, field.CPPTYPE_DOUBLE):
                text = format_float(v, field.cpp_type == field.CPPTYPE_DOUBLE)
            else:
                text = str(v)
            out.append(f"{pad}{field.name}: {text}\n")


def to_text(msg):
    """Text format as Caffe's WriteProtoToTextFile prints it: fields in number order,
    two-space indent, strings C-escaped, floats as C++ protobuf formats them."""
    out = []
    _print_message(msg, 0, out)
    return "".join(out)


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
# Messages

def copy_message(msg, skip=None):
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

