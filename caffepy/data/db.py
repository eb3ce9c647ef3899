"""The databases of Datum records Caffe writes and reads: LMDB and LevelDB.

Both are directories of records read in key order; `open_reader` tells them
apart by what the directory holds (data.mdb or CURRENT) and `open_writer`
writes either (`backend` "lmdb" or "leveldb", as Caffe's tools spell it).

LMDB: readers open it read-only with lock=False, so any number of processes
(MPI ranks on one machine) read it at once, which is only safe while nobody
writes to it. LMDB maps data.mdb into memory and trusts what it finds there: a
page past the end of a truncated file is a SIGBUS that kills the process
without a word. So readers first check the file against its own header (the
meta pages say how many pages the data uses); then the part of the map past
the end of the file is backed by zero pages, and the map reaches 4 GiB past the
data, so a damaged page whose node claims any size (a 32-bit field) or points
anywhere near reads zeros instead of faulting; a value longer than the whole
file is refused before it is copied. Errors LMDB reports itself (pages of the
wrong type, page numbers past the end) become one DataError naming the file
and the record.

LevelDB (through plyvel, which bundles the reference library with snappy, as
Caffe links it): one process at a time may open a database (LevelDB locks it),
so ranks that share one need an LMDB or `caffepy split_db`. It keeps no record
count: a reader counts the keys when it opens. Damage is checked by LevelDB's
own block checksums (paranoid checks on) and reported as one DataError.

Writers build the database under a temporary name and rename it when done,
so a failed run leaves nothing behind; what a killed writer left (its pid is
in the name) is removed when a writer of the same database starts.
"""
import contextlib
import ctypes
import functools
import mmap
import os
import re
import shutil
import struct
import tempfile
import threading

import lmdb
import numpy as np
import plyvel

from .. import log
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


@functools.cache
def _libc_mmap():
    """libc's mmap through ctypes, made once (a CDLL is cyclic garbage when dropped)."""
    mmap_ = ctypes.CDLL(None, use_errno=True).mmap
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
    return mmap_


def _back_with_zeros(data_file, size, map_size):
    """Replace the pages of LMDB's read-only map past the end of the file (which
    fault with SIGBUS) by anonymous zero pages. True when done."""
    start = _find_map(data_file, map_size)
    if start is None:
        return False
    lo, hi = start + _round_up(size), start + _round_up(map_size)
    if lo >= hi:
        return True
    fixed = 0x10        # MAP_FIXED (Linux): replace what is mapped there
    got = _libc_mmap()(lo, hi - lo, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed, -1, 0)
    return got == lo


# A TRAIN and a TEST net (or two layers) may read the same database, yet py-lmdb refuses
# to open one environment twice in a process and LevelDB one database twice: readers share
# one open store per real path (an _Env or a _LevelDB), closed with its last reader.
_shared = {}
_shared_lock = threading.Lock()


def _acquire(path, open_store):
    """The open store of `path` (`open_store(path)` makes it on first use), one more user."""
    real = os.path.realpath(path)
    with _shared_lock:
        entry = _shared.get(real)
        if entry is None:
            entry = _shared[real] = open_store(path)
            entry.real, entry.users = real, 0
        entry.users += 1
        return entry


def _release(entry):
    """One user fewer; the last one closes the store."""
    with _shared_lock:
        entry.users -= 1
        if entry.users == 0:
            _shared.pop(entry.real, None)
            entry.close()


def _key_array(keys):
    """Every key, in order, as one NumPy bytes array (compact for millions of keys)."""
    return np.array(keys, dtype=object if not keys else f"S{max(map(len, keys))}")


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

    def close(self):
        self.env.close()


BACKENDS = ("lmdb", "leveldb")


def backend_of(path):
    """"lmdb" or "leveldb": the kind of database the directory `path` holds (DataError if none)."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such database")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "data.mdb")):
            return "lmdb"
        if os.path.exists(os.path.join(path, "CURRENT")):
            return "leveldb"
    raise DataError(f"{path}: not a database (expected an LMDB directory holding data.mdb or a "
                    f"LevelDB directory holding CURRENT)")


def open_reader(path, backend=None, field="backend"):
    """A reader of the database at `path`, of the kind found there. `backend`, when the user
    named one, only matters when it is wrong: a warning says which `field` and what was read."""
    kind = backend_of(os.fspath(path))
    if backend is not None and backend.lower() != kind:
        log.warning(f"{os.fspath(path)}: {field} says {backend.upper()}, but the database is "
                    f"{'an LMDB' if kind == 'lmdb' else 'a LevelDB'}; reading it as one")
    return LMDBReader(path) if kind == "lmdb" else LevelDBReader(path)


def open_writer(path, backend="lmdb", commit_every=1000):
    """A writer of a new database at `path`: "lmdb" or "leveldb" (any case)."""
    kind = backend.lower()
    if kind not in BACKENDS:
        raise DataError(f"{os.fspath(path)}: unknown database backend '{backend}'; use lmdb or leveldb")
    return (LMDBWriter if kind == "lmdb" else LevelDBWriter)(path, commit_every)


def _key_text(key):
    return quote(key, 100)


class LMDBReader:
    """Read-only access to one LMDB: `len(reader)`, `reader.get(index)` -> (key, value).

    Records are addressed by their position in key order. Reading forward in
    small steps walks one cursor; other jumps (shuffled reading) go through an
    index of every key, built on the first jump.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._entry = _acquire(self.path, _Env)
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
            self._keys = _key_array(keys)
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
            _release(self._entry)
            self.env = None


def _leveldb_text(error):
    """plyvel's message (it carries LevelDB's status as bytes)."""
    text = error.args[0] if error.args else error
    return text.decode(errors="replace") if isinstance(text, bytes) else str(text)


def _check_current(path):
    """Refuse a LevelDB whose CURRENT names no manifest before opening it: opening writes LOCK
    and LOG files into the directory, which a broken database should be spared."""
    try:
        with open(os.path.join(path, "CURRENT"), "rb") as f:
            name = f.read(256).decode(errors="replace").strip()
    except OSError as e:
        raise DataError(f"{path}: cannot read the LevelDB's CURRENT: {e.strerror}") from None
    if not name.startswith("MANIFEST-") or not os.path.isfile(os.path.join(path, name)):
        raise DataError(f"{path}: damaged LevelDB: CURRENT names '{quote(name, 60)}', which is not a "
                        f"manifest in the directory. Copy or rebuild the database")


class _LevelDB:
    """An open LevelDB (shared by the readers of one process: see _acquire)."""

    def __init__(self, path):
        _check_current(path)
        try:
            # paranoid_checks: a damaged block is an error, not a silently skipped record
            self.db = plyvel.DB(path, create_if_missing=False, paranoid_checks=True, max_open_files=100)
        except plyvel.IOError as e:
            if "lock" in _leveldb_text(e).lower():
                raise DataError(f"{path}: the LevelDB is open in another process, and LevelDB admits "
                                f"one at a time. Ranks that share a database need an LMDB (`caffepy "
                                f"convert_imageset --backend lmdb`) or one shard each (`caffepy "
                                f"split_db`)") from None
            raise DataError(f"{path}: cannot open the LevelDB: {_leveldb_text(e)}") from None
        except plyvel.Error as e:
            raise DataError(f"{path}: damaged LevelDB: {_leveldb_text(e)}. Copy or rebuild the "
                            f"database") from None

    def close(self):
        self.db.close()


class LevelDBReader:
    """Read-only access to one LevelDB, as LMDBReader: `len(reader)`, `reader.get(index)` ->
    (key, value), records by position in key order, every key read once when it opens (LevelDB
    keeps no count). Reading forward walks one iterator; a jump seeks it to the key. All reads
    see the database as it was when the reader opened (a snapshot)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._entry = _acquire(self.path, _LevelDB)
        try:
            self._snapshot = self._entry.db.snapshot()
            self._keys = self._read_keys()
        except BaseException:
            self.close()
            raise
        self.size = len(self._keys)
        self._iter = None
        self._pos = None        # index of the record the iterator returned last

    def __len__(self):
        return self.size

    def _damaged(self, error, after=None):
        where = f"after key '{_key_text(after)}': " if after is not None else ""
        text = _leveldb_text(error) if isinstance(error, plyvel.Error) else error
        return DataError(f"{self.path}: {where}damaged LevelDB: {text}. Copy or rebuild the database")

    def _raw_iterator(self):
        # plyvel's plain iterators end quietly at a damaged block; raw ones raise
        return self._snapshot.raw_iterator(verify_checksums=True)

    def _read_keys(self):
        keys = []
        try:
            it = self._raw_iterator()
            it.seek_to_first()
            while it.valid():
                keys.append(it.key())
                it.next()
        except plyvel.Error as e:
            raise self._damaged(e, after=keys[-1] if keys else None) from None
        return _key_array(keys)

    def keys(self):
        return self._keys

    def get(self, index):
        """(key, value) of the record at position `index` in key order."""
        if not 0 <= index < self.size:
            raise IndexError(index)
        expected = bytes(self._keys[index])
        try:
            if self._iter is None or self._pos is None or index != self._pos + 1:
                if self._iter is None:
                    self._iter = self._raw_iterator()
                self._iter.seek(expected)
            else:
                self._iter.next()
            key, value = (self._iter.key(), self._iter.value()) if self._iter.valid() else (None, None)
        except plyvel.Error as e:
            self._pos = None
            raise self._damaged(e, after=self._keys[index - 1] if index else None) from None
        if key != expected:
            self._pos = None
            raise self._damaged(f"record {index} of the {self.size} counted when it opened "
                                f"(key '{_key_text(expected)}') is missing")
        self._pos = index
        return key, value

    def __iter__(self):
        """Every (key, value) in key order."""
        key = None
        try:
            it = self._raw_iterator()
            it.seek_to_first()
            while it.valid():
                key = it.key()
                yield key, it.value()
                it.next()
        except plyvel.Error as e:
            raise self._damaged(e, after=key) from None

    def close(self):
        if self._entry is None:
            return
        if getattr(self, "_iter", None) is not None:
            self._iter.close()
            self._iter = None
        if getattr(self, "_snapshot", None) is not None:
            self._snapshot.close()
        _release(self._entry)
        self._entry = None


# the writers neither closed nor aborted: a Ctrl-C that lands between a writer's creation and
# the caller's hold on it (`with open_writer(...)`, a list's append) leaves no one to abort it
# but the command line's handler (abort_unfinished)
_UNFINISHED = set()


def abort_unfinished():
    """Abort every writer still open: their temporary databases removed."""
    for writer in list(_UNFINISHED):
        writer.abort()


@contextlib.contextmanager
def _interrupts_held():
    """SIGINT and SIGTERM held off (delivered when the block ends) in the main thread, where
    Python runs their handlers; elsewhere nothing to hold."""
    import signal
    if threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Writer:
    """Write records into a new database, committing every `commit_every` puts (as Caffe).

    The database is built in a temporary directory next to `path` and renamed
    to `path` by `close()`; `abort()` (or leaving a `with` block by an
    exception) removes it, so a failed run leaves no half-written database.
    Temporary directories of `path` that a killed writer left are removed first.
    Subclasses open the store (`_open`), write a batch (`_write`) and close it (`_close`).
    """

    def __init__(self, path, commit_every=1000):
        self.path = os.fspath(path).rstrip("/") or "/"
        parent = os.path.dirname(os.path.abspath(self.path))
        remove_stale_temporaries(parent, re.escape(os.path.basename(self.path)))
        if os.path.exists(self.path):
            raise DataError(f"{self.path}: database already exists; remove it or choose another name")
        prefix, suffix = temporary_affixes(self.path)
        self.tmp = self.store = None
        try:
            # a Ctrl-C between the directory's creation and self.tmp's assignment left it
            # behind (CI saw it once: the bad-input test interrupts split_db as the directory
            # appears); held off until then, it is delivered inside this try
            with _interrupts_held():
                try:
                    self.tmp = tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent)
                    # mkdtemp's 0700 would hide the database from others: Caffe's mkdir uses 0744
                    os.chmod(self.tmp, 0o744 & ~_UMASK)
                except OSError as e:
                    raise DataError(f"{self.path}: cannot create the database: "
                                    f"{e.strerror}") from None
            self.store = self._open()
            _UNFINISHED.add(self)
        except BaseException:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
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
        if self._pending:
            self._write(self._pending)
            self._pending = []

    def close(self):
        """Commit what is pending and give the database its name."""
        if self.store is None:
            return
        try:
            self.commit()
            self._close()
            self.store = None
            if os.path.exists(self.path):
                raise DataError(f"{self.path}: database already exists (created while this one was "
                                f"written); remove it or choose another name")
            os.rename(self.tmp, self.path)
            self.done = True
            _UNFINISHED.discard(self)
        except BaseException:
            self.abort()
            raise

    def abort(self):
        """Drop everything written: the temporary database is removed."""
        _UNFINISHED.discard(self)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self._close()
            self.store = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()


class LMDBWriter(_Writer):
    """A new LMDB; its map starts at _INITIAL_MAP_SIZE and doubles whenever it is full."""

    def _open(self):
        self.map_size = _INITIAL_MAP_SIZE
        try:
            return lmdb.open(self.tmp, map_size=self.map_size, subdir=True)
        except lmdb.Error as e:
            raise DataError(f"{self.path}: cannot create the database: {e}") from None

    def _write(self, records):
        while True:
            try:
                with self.store.begin(write=True) as txn:
                    for key, value in records:
                        txn.put(key, value)
                return
            except lmdb.MapFullError:
                self.map_size *= 2
                self.store.set_mapsize(self.map_size)
            except lmdb.Error as e:
                raise DataError(f"{self.path}: cannot write the database: {e}") from None

    def _close(self):
        self.store.close()


class LevelDBWriter(_Writer):
    """A new LevelDB with the options Caffe's writer sets (64 KiB blocks, a 256 MiB write
    buffer, 100 open files; snappy, LevelDB's default), one write batch per commit."""

    def _open(self):
        try:
            return plyvel.DB(self.tmp, create_if_missing=True, error_if_exists=True,
                             block_size=64 << 10, write_buffer_size=256 << 20, max_open_files=100,
                             compression="snappy")
        except plyvel.Error as e:
            raise DataError(f"{self.path}: cannot create the database: {e}") from None

    def _write(self, records):
        try:
            with self.store.write_batch() as batch:
                for key, value in records:
                    batch.put(key, value)
        except plyvel.Error as e:
            raise DataError(f"{self.path}: cannot write the database: {e}") from None

    def _close(self):
        self.store.close()
