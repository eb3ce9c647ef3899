"""LMDB databases of Datum records, as Caffe writes and reads them.

A database is a directory holding data.mdb and lock.mdb; records are read in
key order. Readers open it read-only with lock=False, so any number of
processes (MPI ranks on one machine) read it at once, which is only safe while
nobody writes to it.

LMDB maps data.mdb into memory and trusts what it finds there: a page past
the end of a truncated file is a SIGBUS that kills the process without a word.
So readers first check the file against its own header (the meta pages say
how many pages the data uses); then the part of the map past the end of the
file is backed by zero pages, and the map reaches 4 GiB past the data, so a
damaged page whose node claims any size (a 32-bit field) or points anywhere
near reads zeros instead of faulting; a value longer than the whole file is
refused before it is copied. Errors LMDB reports itself (pages of the wrong
type, page numbers past the end) become one DataError naming the file and the
record.

Writers build the database under a temporary name and rename it when done,
so a failed run leaves nothing behind; what a killed writer left (its pid is
in the name) is removed when a writer of the same database starts.
"""
import contextlib
import ctypes
import mmap
import os
import re
import shutil
import struct
import tempfile
import threading

import lmdb
import numpy as np

from ..errors import DataError, quote
from ..prototxt import remove_stale_temporaries, temporary_affixes

# Writers start with this map size and double it whenever the map is full.
_INITIAL_MAP_SIZE = 1 << 30
# the process umask, read once (reading it means setting it)
_UMASK = os.umask(0)
os.umask(_UMASK)

# LMDB's meta page (64-bit, little-endian): a 16-byte page header, then mm_magic
# (u32) at 16, mm_dbs[0].md_pad (the page size, u32) at 40, mm_last_pg (u64) at
# 136 and mm_txnid (u64) at 144. Pages 0 and 1 are the two metas; the one with
# the newer txnid is current.
_MAGIC = 0xBEEFC0DE
_META_BYTES = 152
# How far past the data a damaged leaf node can make LMDB or py-lmdb read: a
# value's size is 32 bits, a node's offset in its page 16 bits.
_REACH = (1 << 32) + (1 << 16)


def _damaged(data_file, problem):
    return DataError(f"{data_file}: damaged LMDB: {problem}. Copy or rebuild the database")


def _read_meta(f, offset):
    f.seek(offset)
    raw = f.read(_META_BYTES)
    if len(raw) < _META_BYTES:
        return None, raw
    magic, = struct.unpack_from("<I", raw, 16)
    if magic != _MAGIC:
        return None, raw
    psize, = struct.unpack_from("<I", raw, 40)
    last_pg, txnid = struct.unpack_from("<QQ", raw, 136)
    return {"psize": psize, "last_pg": last_pg, "txnid": txnid}, raw


def check_file(data_file):
    """Check data.mdb against its own meta pages before LMDB maps it.

    Returns (file size, bytes the pages in use span); raises DataError for an
    empty, foreign, zeroed or truncated file (shorter than its last used page).
    """
    try:
        with open(data_file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise _damaged(data_file, "the file is empty (0 bytes)")
            first, raw = _read_meta(f, 0)
            if first is None:
                if not raw.strip(b"\0"):
                    raise _damaged(data_file, "its header page is all zero bytes")
                if len(raw) < _META_BYTES:
                    raise _damaged(data_file, f"truncated to {size} bytes, shorter than LMDB's header")
                raise DataError(f"{data_file}: not an LMDB file (no LMDB header in its first page)")
            psize = first["psize"]
            if psize < 256 or psize > 1 << 16 or psize & (psize - 1):
                raise _damaged(data_file, f"its header gives an impossible page size, got {psize}")
            if size < 2 * psize:
                raise _damaged(data_file, f"truncated to {size} bytes: its second header page is missing")
            second, _ = _read_meta(f, psize)
    except OSError as e:
        raise DataError(f"{data_file}: cannot read: {e.strerror}") from None
    if second is None:
        raise _damaged(data_file, "its second header page is not an LMDB header")
    meta = max(first, second, key=lambda m: m["txnid"])
    need = (meta["last_pg"] + 1) * psize
    if size < need:
        raise _damaged(data_file, f"truncated to {size} bytes; its header says the data reaches "
                       f"{need} bytes ({meta['last_pg'] + 1} pages of {psize})")
    return size, need


def _find_map(data_file, length):
    """Start of this process's mapping of `data_file` from offset 0 spanning
    `length` bytes (LMDB's map, from /proc/self/maps), or None."""
    try:
        inode = os.stat(data_file).st_ino
        real = os.path.realpath(data_file)
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 6 or int(parts[4]) != inode or int(parts[2], 16) != 0:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if hi - lo >= length and os.path.realpath(parts[5].strip()) == real:
                    return lo
    except (OSError, ValueError):
        pass
    return None


def _round_up(n, page=mmap.PAGESIZE):
    return -(-n // page) * page


def _back_with_zeros(data_file, size, map_size):
    """Replace the pages of LMDB's read-only map past the end of the file (which
    fault with SIGBUS) by anonymous zero pages. True when done."""
    start = _find_map(data_file, map_size)
    if start is None:
        return False
    lo, hi = start + _round_up(size), start + _round_up(map_size)
    if lo >= hi:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    fixed = 0x10        # MAP_FIXED (Linux): replace what is mapped there
    got = libc.mmap(lo, hi - lo, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed, -1, 0)
    return got == lo


# py-lmdb refuses to open one environment twice in a process, yet a TRAIN and a
# TEST net (or two layers) may read the same database: readers share one
# environment per real path, closed with its last reader.
_envs = {}
_envs_lock = threading.Lock()


class _Env:
    """An open read-only environment whose map cannot fault (see the module's docstring)."""

    def __init__(self, path):
        self.data_file = os.path.join(path, "data.mdb")
        self.size, self.end = check_file(self.data_file)
        try:
            self.env = lmdb.open(path, readonly=True, lock=False, readahead=False, max_readers=512,
                                 subdir=True, map_size=self.end + _REACH)
        except lmdb.Error as e:
            raise DataError(f"{path}: cannot open the database: {e}") from None
        # not on Linux: the header check above still catches a truncated file
        self.shielded = _back_with_zeros(self.data_file, self.size, self.env.info()["map_size"])
        self.users = 0


def _acquire_env(path):
    real = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(real)
        if entry is None:
            entry = _envs[real] = _Env(path)
        entry.users += 1
        return entry


def _release_env(entry):
    with _envs_lock:
        entry.users -= 1
        if entry.users == 0:
            _envs.pop(os.path.realpath(os.path.dirname(entry.data_file)), None)
            entry.env.close()


def _check_exists(path):
    if not os.path.exists(path):
        raise DataError(f"{path}: no such database")
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
        raise DataError(f"{path}: not an LMDB database (expected a directory holding data.mdb)")


def _key_text(key):
    return quote(key, 100)


class Reader:
    """Read-only access to one LMDB: `len(reader)`, `reader.get(index)` -> (key, value).

    Records are addressed by their position in key order. Reading forward in
    small steps walks one cursor; other jumps (shuffled reading) go through an
    index of every key, built on the first jump.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        _check_exists(self.path)
        self._entry = _acquire_env(self.path)
        self.env = self._entry.env
        try:
            self.size = self.env.stat()["entries"]
            self._txn = self.env.begin(buffers=True)
            self._cursor = self._txn.cursor()
        except lmdb.Error as e:
            self.close()
            raise self._damaged(e) from None
        self._pos = None        # index the cursor stands on
        self._keys = None       # every key, in order, built on demand

    def __len__(self):
        return self.size

    def _damaged(self, error, key=None, after=None):
        where = f"key '{_key_text(key)}': " if key is not None else ""
        if after is not None:
            where = f"after key '{_key_text(after)}': "
        text = str(error).split(": ", 1)[-1] if isinstance(error, lmdb.Error) else str(error)
        return DataError(f"{self.path}: {where}damaged LMDB: {text}. Copy or rebuild the database")

    def _record(self, cursor):
        """The cursor's (key, value) as bytes; a value longer than the file is
        damage, refused before it is copied."""
        key, value = cursor.key(), cursor.value()
        if len(value) > self._entry.end:
            raise self._damaged(f"its value claims {len(value)} bytes, more than the "
                                f"{self._entry.end} of the whole file", key=key)
        return bytes(key), bytes(value)

    def keys(self):
        """Every key in order, as one NumPy bytes array (compact for millions of keys)."""
        if self._keys is None:
            keys = []
            try:
                with self.env.begin() as txn:
                    for key in txn.cursor().iternext(keys=True, values=False):
                        keys.append(key)
            except lmdb.Error as e:
                raise self._damaged(e, after=keys[-1] if keys else None) from None
            self._keys = np.array(keys, dtype=object if not keys else f"S{max(map(len, keys))}")
        return self._keys

    # forward steps up to this many walk the cursor instead of looking up the key
    _WALK = 64

    def get(self, index):
        """(key, value) of the record at position `index` in key order."""
        if not 0 <= index < self.size:
            raise IndexError(index)
        step = index - self._pos if self._pos is not None else -1
        cursor = self._cursor
        try:
            if not 0 <= step <= self._WALK and index <= self._WALK:
                found = cursor.first()
                step = index
            else:
                found = True
            if 0 <= step <= self._WALK:
                for _ in range(step):
                    found = cursor.next()
            else:
                key = self.keys()[index]
                found = cursor.set_key(key)
                if not found:
                    raise DataError(f"{self.path}: key '{_key_text(key)}': record vanished; was the "
                                    f"database changed while reading it?")
            if not found:
                raise self._damaged(f"record {index} of the {self.size} its header counts is missing")
            self._pos = index
            return self._record(cursor)
        except lmdb.Error as e:
            self._pos = None
            raise self._damaged(e, after=self._last_key()) from None

    def _last_key(self):
        with contextlib.suppress(lmdb.Error):
            key = self._cursor.key()
            return bytes(key) if len(key) else None
        return None

    def __iter__(self):
        """Every (key, value) in key order."""
        key = None
        try:
            with self.env.begin(buffers=True) as txn:
                cursor = txn.cursor()
                found = cursor.first()
                while found:
                    key, value = self._record(cursor)
                    yield key, value
                    found = cursor.next()
        except lmdb.Error as e:
            raise self._damaged(e, after=key) from None

    def close(self):
        if self.env is not None:
            with contextlib.suppress(AttributeError):
                self._cursor.close()
                self._txn.abort()
            _release_env(self._entry)
            self.env = None


class Writer:
    """Write records into a new LMDB, committing every `commit_every` puts (as Caffe).

    The database is built in a temporary directory next to `path` and renamed
    to `path` by `close()`; `abort()` (or leaving a `with` block by an
    exception) removes it, so a failed run leaves no half-written database.
    Temporary directories of `path` that a killed writer left are removed first.
    """

    def __init__(self, path, commit_every=1000):
        self.path = os.fspath(path).rstrip("/") or "/"
        parent = os.path.dirname(os.path.abspath(self.path))
        remove_stale_temporaries(parent, re.escape(os.path.basename(self.path)))
        if os.path.exists(self.path):
            raise DataError(f"{self.path}: database already exists; remove it or choose another name")
        prefix, suffix = temporary_affixes(self.path)
        try:
            self.tmp = tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent)
            # mkdtemp's 0700 would hide the database from other users: Caffe's mkdir uses 0744
            os.chmod(self.tmp, 0o744 & ~_UMASK)
        except OSError as e:
            raise DataError(f"{self.path}: cannot create the database: {e.strerror}") from None
        self.map_size = _INITIAL_MAP_SIZE
        try:
            self.env = lmdb.open(self.tmp, map_size=self.map_size, subdir=True)
        except BaseException as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(e, lmdb.Error):
                raise DataError(f"{self.path}: cannot create the database: {e}") from None
            raise
        self.commit_every = commit_every
        self._pending = []
        self.done = False       # renamed to `path`

    def put(self, key, value):
        if isinstance(key, str):
            key = key.encode()
        self._pending.append((key, value))
        if len(self._pending) >= self.commit_every:
            self.commit()

    def commit(self):
        while self._pending:
            try:
                with self.env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value)
                self._pending = []
            except lmdb.MapFullError:
                self.map_size *= 2
                self.env.set_mapsize(self.map_size)
            except lmdb.Error as e:
                raise DataError(f"{self.path}: cannot write the database: {e}") from None

    def close(self):
        """Commit what is pending and give the database its name."""
        if self.env is None:
            return
        try:
            self.commit()
            self.env.close()
            self.env = None
            if os.path.exists(self.path):
                raise DataError(f"{self.path}: database already exists (created while this one was "
                                f"written); remove it or choose another name")
            os.rename(self.tmp, self.path)
            self.done = True
        except BaseException:
            self.abort()
            raise

    def abort(self):
        """Drop everything written: the temporary database is removed."""
        if self.env is not None:
            self.env.close()
            self.env = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()
