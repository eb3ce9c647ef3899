"""`caffepy split_db INPUT_DB N [PREFIX]`: one database into N shards for split-DB training.

Shard r is the database `<PREFIX>_<r>` (PREFIX defaults to INPUT_DB), of the input's kind
(LMDB or LevelDB), and holds
records r, r+N, r+2N, ... of the input in key order, under their original
keys, so a net whose data source is `<PREFIX>_{rank}` reads on rank r exactly
what the shared-DB interleave would give it, and every record is read once per
epoch across the ranks. Shards are written under temporary names and renamed
together at the end: a failed split leaves no shard behind.
"""
import os
import shutil

from .. import log
from ..data.db import backend_of, open_reader, open_writer
from ..errors import DataError

_BATCH = 1000          # records per write transaction


def shard_path(prefix, rank):
    return f"{prefix}_{rank}"


def split_db(input_db, num_shards, output_prefix=None):
    """Write shards `<output_prefix>_<r>`, r = 0..num_shards-1; return their paths."""
    if num_shards < 1:
        raise DataError(f"{input_db}: split_db: num_shards must be at least 1, got {num_shards}")
    prefix = (output_prefix or input_db).rstrip("/")
    paths = [shard_path(prefix, r) for r in range(num_shards)]
    for path in paths:
        if os.path.exists(path):
            raise DataError(f"{path}: split_db: output already exists. Remove it or choose "
                            f"another prefix")
    if not os.path.exists(input_db):
        raise DataError(f"{input_db}: split_db: input database not found")
    backend = backend_of(input_db)
    source = open_reader(input_db)
    outputs = []
    counts = [0] * num_shards
    try:
        for path in paths:      # one by one: an interruption between two still aborts the first
            outputs.append(open_writer(path, backend, commit_every=_BATCH))
        with log.progress(source, "split_db", len(source)) as records:
            for index, (key, value) in enumerate(records):
                shard = index % num_shards
                outputs[shard].put(key, value)
                counts[shard] += 1
        for writer in outputs:
            writer.close()
    except BaseException:
        for writer in outputs:
            if writer.done:     # renamed already: ours, since no shard existed at the start
                shutil.rmtree(writer.path, ignore_errors=True)
            else:
                writer.abort()
        raise
    finally:
        source.close()
    total = sum(counts)
    for path, n in zip(paths, counts):
        log.info(f"Wrote {n} records to {path}")
    log.info(f"Split {total} records of {input_db} into {num_shards} shards")
    return paths
