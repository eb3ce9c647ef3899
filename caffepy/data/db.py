"""LMDB databases of Datum records, as Caffe writes and reads them.

A database is a directory holding data.mdb and lock.mdb; records are read in
key order. Readers open it read-only with lock=False, so any number of
processes (MPI ranks on one machine) read it at once, which is only safe while
nobody writes to it.
"""
import os
import threading

import lmdb
import numpy as np

from ..errors import DataError

# Writers start with this map size and double it whenever the map is full.
_INITIAL_MAP_SIZE = 1 << 30


# py-lmdb refuses to open one environment twice in a process, yet a TRAIN and a
# TEST net (or two layers) may read the same database: readers share one
# environment per real path, closed with its last reader.
_envs = {}
_envs_lock = threading.Lock()


def _acquire_env(path):
    real = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(real)
        if entry is None:
            try:
                env = lmdb.open(path, readonly=True, lock=False, readahead=False, max_readers=512,
                                subdir=True)
            except lmdb.Error as e:
                raise DataError(f"{path}: cannot open the database: {e}") from None
            entry = _envs[real] = [env, 0]
        entry[1] += 1
        return entry[0]


def _release_env(env):
    with _envs_lock:
        for real, entry in list(_envs.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] == 0:
                    del _envs[real]
                    env.close()
                return


def _check_exists(path):
    if not os.path.exists(path):
        raise DataError(f"{path}: no such database")
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
        raise DataError(f"{path}: not an LMDB database (expected a directory holding data.mdb)")


class Reader:
    """Read-only access to one LMDB: `len(reader)`, `reader.get(index)` -> (key, value).

    Records are addressed by their position in key order. Reading forward in
    small steps walks one cursor; other jumps (shuffled reading) go through an
    index of every key, built on the first jump.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        _check_exists(self.path)
        self.env = _acquire_env(self.path)
        self.size = self.env.stat()["entries"]
        self._txn = self.env.begin(buffers=False)
        self._cursor = self._txn.cursor()
        self._pos = None        # index the cursor stands on
        self._keys = None       # every key, in order, built on demand

    def __len__(self):
        return self.size

    def keys(self):
        """Every key in order, as one NumPy bytes array (compact for millions of keys)."""
        if self._keys is None:
            with self.env.begin() as txn:
                keys = list(txn.cursor().iternext(keys=True, values=False))
            self._keys = np.array(keys, dtype=object if not keys else f"S{max(map(len, keys))}")
        return self._keys

    # forward steps up to this many walk the cursor instead of looking up the key
    _WALK = 64

    def get(self, index):
        """(key, value) of the record at position `index` in key order."""
        if not 0 <= index < self.size:
            raise IndexError(index)
        step = index - self._pos if self._pos is not None else -1
        if not 0 <= step <= self._WALK and index <= self._WALK:
            self._cursor.first()
            step = index
        if 0 <= step <= self._WALK:
            for _ in range(step):
                self._cursor.next()
        else:
            key = self.keys()[index]
            if not self._cursor.set_key(key):
                raise DataError(f"{self.path}: key '{key.decode('utf-8', 'replace')}': record vanished; "
                                f"was the database changed while reading it?")
        self._pos = index
        return self._cursor.key(), self._cursor.value()

    def __iter__(self):
        """Every (key, value) in key order."""
        with self.env.begin() as txn:
            yield from txn.cursor()

    def close(self):
        if self.env is not None:
            self._cursor.close()
            self._txn.abort()
            _release_env(self.env)
            self.env = None


class Writer:
    """Write records into a new LMDB, committing every `commit_every` puts (as Caffe)."""

    def __init__(self, path, commit_every=1000):
        self.path = os.fspath(path)
        if os.path.exists(self.path):
            raise DataError(f"{self.path}: database already exists; remove it or choose another name")
        try:
            os.makedirs(self.path)
        except OSError as e:
            raise DataError(f"{self.path}: cannot create the database: {e.strerror}") from None
        self.map_size = _INITIAL_MAP_SIZE
        self.env = lmdb.open(self.path, map_size=self.map_size, subdir=True)
        self.commit_every = commit_every
        self._pending = []

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

    def close(self):
        if self.env is not None:
            self.commit()
            self.env.close()
            self.env = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
