"""Small LMDBs and LevelDBs and images for the data tests, through the plain libraries."""
import os

import cv2
import lmdb
import numpy as np
import plyvel

from caffepy.data.datum import array_to_datum


def db_records(path):
    """Every (key as text, value bytes) of the LMDB or LevelDB at `path`, in key order."""
    if os.path.exists(os.path.join(path, "CURRENT")):
        db = plyvel.DB(str(path))
        out = [(key.decode(), value) for key, value in db]
        db.close()
        return out
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        out = [(key.decode(), value) for key, value in txn.cursor()]
    env.close()
    return out


class _LevelDBTxn:
    """A LevelDB write batch that takes puts as an LMDB transaction does."""

    def __init__(self, path):
        self.db = plyvel.DB(os.fspath(path), create_if_missing=True)
        self.batch = self.db.write_batch()

    def put(self, key, value):
        self.batch.put(key, value)

    def close(self):
        self.batch.write()
        self.db.close()


def make_db(path, n, shape=(1, 2, 3), encoded=False, values=None, backend="lmdb"):
    """An LMDB (or LevelDB) of n Datum: record i has label i and every pixel = i % 256 (or
    values[i])."""
    if backend == "leveldb":
        txn = _LevelDBTxn(path)
        _put_datums(txn, n, shape, encoded, values)
        txn.close()
        return os.fspath(path)
    env = lmdb.open(os.fspath(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        _put_datums(txn, n, shape, encoded, values)
    env.close()
    return os.fspath(path)


def _put_datums(txn, n, shape, encoded, values):
    for i in range(n):
        arr = np.full(shape, i % 256, np.uint8) if values is None else values[i]
        if encoded:
            from caffepy.data.datum import encoded_datum
            ok, buf = cv2.imencode(".png", arr.transpose(1, 2, 0))
            datum = encoded_datum(buf.tobytes(), i)
        else:
            datum = array_to_datum(arr, i)
        txn.put(f"{i:08d}".encode(), datum.SerializeToString())


def put_raw(path, key, value):
    env = lmdb.open(os.fspath(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put(key.encode(), value)
    env.close()


def data_net_text(source, batch_size, extra_data="", transform="", tops=("data", "label"),
                  backend="LMDB"):
    top_lines = "".join(f'  top: "{t}"\n' for t in tops)
    backend = f"backend: {backend} " if backend else ""
    return (f'layer {{\n  name: "data"\n  type: "Data"\n{top_lines}'
            f'  data_param {{ source: "{source}" batch_size: {batch_size} {backend}{extra_data} }}\n'
            f'  transform_param {{ {transform} }}\n}}\n')


def annotated_datum(image, objects, encoded=True, typed=True, label=-1):
    """An AnnotatedDatum of an H x W x C uint8 image (PNG bytes when encoded) and its objects:
    [(label, (xmin, ymin, xmax, ymax) normalized, difficult)], grouped by label in the order
    labels first appear (as convert_annoset groups them)."""
    from caffepy.data.datum import encoded_datum, image_to_datum
    from caffepy.proto import caffe_pb2
    a = caffe_pb2.AnnotatedDatum()
    if encoded:
        ok, buf = cv2.imencode(".png", image)
        a.datum.CopyFrom(encoded_datum(buf.tobytes(), label))
    else:
        a.datum.CopyFrom(image_to_datum(image, label))
    if typed:
        a.type = caffe_pb2.AnnotatedDatum.BBOX
    groups = {}
    for lab, box, difficult in objects:
        if lab not in groups:
            groups[lab] = a.annotation_group.add(group_label=lab)
        g = groups[lab]
        an = g.annotation.add(instance_id=len(g.annotation))
        an.bbox.xmin, an.bbox.ymin, an.bbox.xmax, an.bbox.ymax = box
        an.bbox.difficult = bool(difficult)
    return a


def make_annotated_db(path, records):
    """An LMDB of AnnotatedDatum records (keys 00000000, 00000001, ...)."""
    env = lmdb.open(os.fspath(path), map_size=1 << 28)
    with env.begin(write=True) as txn:
        for i, a in enumerate(records):
            txn.put(f"{i:08d}".encode(), a.SerializeToString())
    env.close()
    return os.fspath(path)


def _sample_images():
    """examples/imagenet/make_sample.py, whose `image` draws a class's photo-sized JPEG."""
    import importlib.util
    from paths import REPO
    spec = importlib.util.spec_from_file_location(
        "make_sample", os.path.join(REPO, "examples", "imagenet", "make_sample.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_imagenet_lmdb(path, n, classes, size=256, seed=0):
    """An ImageNet-shaped LMDB as `caffepy convert_imageset --resize_height/width=size` makes:
    n JPEG-encoded color Datum (record i of class i % classes, make_sample's coloured shapes on
    noise) of size x size; returns (path, their mean as a 1 x 3 x size x size array)."""
    from caffepy.data.datum import encoded_datum
    draw = _sample_images().image
    gen = np.random.default_rng(seed)
    total = np.zeros((size, size, 3))
    env = lmdb.open(os.fspath(path), map_size=1 << 28)
    with env.begin(write=True) as txn:
        for i in range(n):
            img = cv2.resize(draw(gen, i % classes, classes), (size, size), interpolation=cv2.INTER_LINEAR)
            ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
            total += cv2.imdecode(buf, cv2.IMREAD_COLOR)
            txn.put(f"{i:08d}".encode(), encoded_datum(buf.tobytes(), i % classes).SerializeToString())
    env.close()
    return os.fspath(path), (total / n).transpose(2, 0, 1)[None].astype(np.float32)
