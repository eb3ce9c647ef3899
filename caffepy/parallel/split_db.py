"""`caffepy split_db INPUT_DB N [PREFIX]`: one LMDB into N shards for split-DB training.

Shard r is the LMDB `<PREFIX>_<r>` (PREFIX defaults to INPUT_DB) and holds
records r, r+N, r+2N, ... of the input in key order, under their original
keys, so a net whose data source is `<PREFIX>_{rank}` reads on rank r exactly
what the shared-DB interleave would give it, and every record is read once per
epoch across the ranks.
"""
import os

from .. import log
from ..errors import DataError

_BATCH = 1000          # records per write transaction
_MIN_MAP = 64 << 20


def shard_path(prefix, rank):
    return f"{prefix}_{rank}"


def _open_input(path):
    import lmdb
    if not os.path.exists(path):
        raise DataError(f"{path}: split_db: input database not found")
    try:
        return lmdb.open(path, readonly=True, lock=False, readahead=False,
                         subdir=os.path.isdir(path), max_readers=64)
    except lmdb.Error as e:
        raise DataError(f"{path}: split_db: cannot open as LMDB: {e}") from None


def split_db(input_db, num_shards, output_prefix=None):
    """Write shards `<output_prefix>_<r>`, r = 0..num_shards-1; return their paths."""
    import lmdb
    if num_shards < 1:
        raise DataError(f"{input_db}: split_db: num_shards must be at least 1, got {num_shards}")
    prefix = (output_prefix or input_db).rstrip("/")
    paths = [shard_path(prefix, r) for r in range(num_shards)]
    for path in paths:
        if os.path.exists(path):
            raise DataError(f"{path}: split_db: output already exists. Remove it or choose "
                            f"another prefix")
    source = _open_input(input_db)
    in_bytes = source.info()["last_pgno"] * source.stat()["psize"]
    map_size = max(_MIN_MAP, int(1.25 * in_bytes / num_shards))
    outputs = [lmdb.open(path, map_size=map_size, subdir=True, meminit=False)
               for path in paths]
    pending = [[] for _ in range(num_shards)]
    counts = [0] * num_shards
    try:
        with source.begin(buffers=False) as txn:
            for index, (key, value) in enumerate(txn.cursor()):
                shard = index % num_shards
                pending[shard].append((key, value))
                counts[shard] += 1
                if len(pending[shard]) >= _BATCH:
                    _write(outputs[shard], pending[shard])
                    pending[shard] = []
        for env, items in zip(outputs, pending):
            if items:
                _write(env, items)
    finally:
        for env in outputs:
            env.close()
        source.close()
    total = sum(counts)
    for path, n in zip(paths, counts):
        log.info(f"Wrote {n} records to {path}")
    log.info(f"Split {total} records of {input_db} into {num_shards} shards")
    return paths


def _write(env, items):
    import lmdb
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in items:
                    txn.put(key, value)
            return
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)
