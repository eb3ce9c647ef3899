"""Small LMDBs and images for the data tests."""
import os

import cv2
import lmdb
import numpy as np

from caffepy.data.datum import array_to_datum


def db_records(path):
    """Every (key as text, value bytes) of the LMDB at `path`, in key order."""
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        out = [(key.decode(), value) for key, value in txn.cursor()]
    env.close()
    return out


def make_db(path, n, shape=(1, 2, 3), encoded=False, values=None):
    """An LMDB of n Datum: record i has label i and every pixel = i % 256 (or values[i])."""
    env = lmdb.open(os.fspath(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i in range(n):
            arr = np.full(shape, i % 256, np.uint8) if values is None else values[i]
            if encoded:
                from caffepy.data.datum import encoded_datum
                ok, buf = cv2.imencode(".png", arr.transpose(1, 2, 0))
                datum = encoded_datum(buf.tobytes(), i)
            else:
                datum = array_to_datum(arr, i)
            txn.put(f"{i:08d}".encode(), datum.SerializeToString())
    env.close()
    return os.fspath(path)


def put_raw(path, key, value):
    env = lmdb.open(os.fspath(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put(key.encode(), value)
    env.close()


def data_net_text(source, batch_size, extra_data="", transform="", tops=("data", "label")):
    top_lines = "".join(f'  top: "{t}"\n' for t in tops)
    return (f'layer {{\n  name: "data"\n  type: "Data"\n{top_lines}'
            f'  data_param {{ source: "{source}" batch_size: {batch_size} backend: LMDB {extra_data} }}\n'
            f'  transform_param {{ {transform} }}\n}}\n')
