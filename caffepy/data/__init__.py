"""The data path: LMDB of Datum, the Datum codec, transform_param, background prefetch,
and Caffe's image tools (convert_imageset, compute_image_mean).

    datum.py        Datum <-> array, encoded JPEG/PNG decode (OpenCV, BGR)
    db.py           LMDB Reader (read-only, lock=False, checked against its header) and Writer
                    (built under a temporary name)
    sources.py      record sources for the prefetcher: LMDB, image list file
    transformer.py  crop, mirror, mean, scale in Caffe's order, after Intel's augmentations
    augment.py      Intel Caffe's augmentations (distort, expand, random resize / aspect ratio,
                    resize, noise) on one image, with OpenCV
    prefetch.py     RecordOrder (epochs, shuffle, ranks), BatchFiller, Prefetcher
    tools.py        convert_imageset, compute_image_mean
    shapes.py       a generated detection set in VOC's layout (examples/shapes/make_shapes.py)

The layers themselves (Data, ImageData, MemoryData) live in caffepy/layers/data.py.
Multi-rank reading: a data_param.source containing `{rank}` is one shard per rank
(split-DB); otherwise the ranks interleave records of one database (shared-DB).
"""


def wait_seconds(net):
    """Seconds the net's data layers waited for their prefetch threads, summed."""
    return sum(getattr(layer, "wait_seconds", 0.0) for layer in net.layers
               if hasattr(layer, "prefetcher"))
