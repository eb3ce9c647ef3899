"""SSD's AnnotatedData path: records of AnnotatedDatum, their boxes carried through every
transform, the batch samplers' IoU-constrained crops, and the label blob of a batch.

One image, in the fork's order:

    distort_param          photometric (boxes unchanged)
    expand_param           the image on a larger canvas: boxes move with it
    batch_sampler          each sampler draws up to max_trials boxes of the image (scale and
                           aspect ratio uniform in their ranges), keeping those that meet its
                           sample_constraint, up to max_sample; one of all the samplers' boxes,
                           drawn uniformly, is the crop (none: the whole image)
    random_resize_param / random_aspect_ratio_param, resize_param, noise_param
    crop_size / crop_h, crop_w, mirror, mean, scale (DataTransformer.finish)

Every step that takes part of the image (expansion's canvas, the sampled crop, the random
aspect region, the final crop) keeps the boxes that meet transform_param.emit_constraint
(CENTER: the box's centre lies in the part; MIN_OVERLAP: the part covers more than
emit_overlap of the box), projects them into the part and clips them to it, and drops those
left without area. resize_param's FIT_LARGE_SIZE_AND_PAD moves them into the padded frame;
mirror flips them. An annotation group whose boxes are all dropped is dropped.

The label top of a batch is [1, 1, boxes, 8], a row per box: item_id, group_label,
instance_id, xmin, ymin, xmax, ymax, difficult; one row of -1 when the batch has no box.
Records without an annotation type (convert_annoset's classification records), when
annotated_data_param.anno_type does not give one, give a label per image instead, as Data.

Randomness: every image draws from its own generator seeded by (the layer's seed, the
position of its read in the global record stream), so a run repeats and resumes exactly and
N ranks with batch b transform each image as one rank with batch N * b does.

Where caffepy departs from the fork: a sampled box meets its sample_constraint when one
object meets every bound given (the fork decides on the first kind of bound it is given:
jaccard, then sample coverage, then object coverage), the boxes follow the sampled crop's
whole pixels (the fork projects them onto the sampled box, up to a pixel away from the pixels
it crops), random_aspect_ratio_param moves the boxes with its region (the fork leaves them),
and the fork's JPEG re-encoding of distorted, expanded and cropped images is not done.
"""
import numpy as np
from google.protobuf.message import DecodeError

from .. import bbox
from ..errors import DataError
from ..proto import caffe_pb2
from .augment import RP, Augmentations
from .datum import datum_to_array
from .prefetch import BatchFiller
from .sources import DBSource

F = np.float32
EMIT = caffe_pb2.EmitConstraint
BBOX = caffe_pb2.AnnotatedDatum.BBOX
# the box's columns in a row (group_label, instance_id, xmin, ymin, xmax, ymax, difficult)
XMIN, YMIN, XMAX, YMAX = range(2, 6)


class Annotations:
    """The boxes of one image as they follow it: `rows` [n, 7] float32 (group_label,
    instance_id, xmin, ymin, xmax, ymax, difficult), in the record's group order."""

    def __init__(self, rows, emit=None):
        self.rows, self.emit = rows, emit

    @property
    def boxes(self):
        return self.rows[:, XMIN:YMAX + 1]

    def reframe(self, part):
        """The image became its part `part` (a normalized box of the old frame; beyond [0, 1] for
        a canvas): keep the boxes the emit constraint lets through, in the part's frame."""
        if not len(self.rows):
            return
        keep = np.ones(len(self.rows), bool)
        if self.emit is not None:
            if self.emit.emit_type == EMIT.CENTER:
                cx = (self.boxes[:, 0] + self.boxes[:, 2]) / F(2)
                cy = (self.boxes[:, 1] + self.boxes[:, 3]) / F(2)
                keep = (cx >= part[0]) & (cx <= part[2]) & (cy >= part[1]) & (cy <= part[3])
            else:
                keep = bbox.coverage(self.boxes, part)[:, 0] > F(self.emit.emit_overlap)
        projected, kept = bbox.project(self.boxes, part)
        rows = self.rows.copy()
        rows[:, XMIN:YMAX + 1] = projected
        self.rows = rows[keep & kept]

    def fit(self, resize, height, width):
        """resize_param's move of the boxes of a height x width image (the fork's
        UpdateBBoxByResizePolicy): into the padded frame for FIT_LARGE_SIZE_AND_PAD; WARP and
        FIT_SMALL_SIZE keep their fractions."""
        if not len(self.rows) or resize.mode != RP.FIT_LARGE_SIZE_AND_PAD:
            return
        b = self.boxes
        aspect, new_aspect = F(width) / F(height), F(resize.width) / F(resize.height)
        if aspect > new_aspect:       # as wide as asked: bands above and below
            pad = (F(resize.height) - F(resize.width) / aspect) / F(2)
            inner = F(1) - F(2) * pad / F(resize.height)
            b[:, [1, 3]] = pad / F(resize.height) + np.clip(b[:, [1, 3]], 0, 1) * inner
        else:
            pad = (F(resize.width) - aspect * F(resize.height)) / F(2)
            inner = F(1) - F(2) * pad / F(resize.width)
            b[:, [0, 2]] = pad / F(resize.width) + np.clip(b[:, [0, 2]], 0, 1) * inner
        self.rows[:, XMIN:YMAX + 1] = b

    def mirror(self):
        self.rows[:, XMIN:YMAX + 1] = bbox.mirror(self.boxes)


# -- batch sampling ------------------------------------------------------------------------------
def sample_boxes(sampler, n, gen):
    """n boxes [n, 4] of the unit square, each at a scale and aspect ratio drawn uniformly from
    the sampler's ranges (the ratio kept within [scale^2, 1 / scale^2], so the box fits), at a
    uniform place."""
    scale = gen.uniform(sampler.min_scale, sampler.max_scale, n).astype(F)
    ratio = gen.uniform(sampler.min_aspect_ratio, sampler.max_aspect_ratio, n).astype(F)
    ratio = np.minimum(np.maximum(ratio, scale * scale), F(1) / (scale * scale))
    w, h = scale * np.sqrt(ratio), scale / np.sqrt(ratio)
    x = gen.uniform(0, np.maximum(F(0), F(1) - w)).astype(F)
    y = gen.uniform(0, np.maximum(F(0), F(1) - h)).astype(F)
    return np.stack([x, y, x + w, y + h], axis=1)


BOUNDS = ("min_jaccard_overlap", "max_jaccard_overlap", "min_sample_coverage", "max_sample_coverage",
          "min_object_coverage", "max_object_coverage")


def meets(samples, objects, c):
    """Which sampled boxes [n, 4] have some object that meets every bound of SampleConstraint c
    with them (no bound: every box does): [n] bool."""
    samples = np.asarray(samples, F).reshape(-1, 4)
    bounds = [(f, getattr(c, f)) for f in BOUNDS if c.HasField(f)]
    if not bounds:
        return np.ones(len(samples), bool)
    if not len(objects):
        return np.zeros(len(samples), bool)
    values = {"jaccard_overlap": lambda: bbox.jaccard(samples, objects),
              "sample_coverage": lambda: bbox.coverage(samples, objects),
              "object_coverage": lambda: bbox.coverage(objects, samples).T}
    ok = np.ones((len(samples), len(objects)), bool)
    for field, bound in bounds:
        v = values[field[4:]]()
        ok &= (v >= F(bound)) if field.startswith("min") else (v <= F(bound))
    return ok.any(axis=1)


def batch_samples(samplers, objects, gen):
    """The fork's GenerateBatchSamples: each sampler (those with use_original_image) draws
    max_trials boxes, keeping those that meet its constraint, the first max_sample of them.
    (All trials are drawn at once: the boxes kept are the ones the fork's trial-by-trial loop,
    which stops at max_sample, keeps from the same draws.)"""
    found = []
    for s in samplers:
        if not s.use_original_image or not s.max_trials:
            continue
        boxes = sample_boxes(s.sampler, s.max_trials, gen)
        good = boxes[meets(boxes, objects, s.sample_constraint)]
        found.extend(good[:s.max_sample] if s.HasField("max_sample") else good)
    return found


def check_samplers(samplers, error):
    """The fork's CHECKs on each sampler, as one-line errors."""
    for i, s in enumerate(samplers):
        p, field = s.sampler, f"annotated_data_param.batch_sampler[{i}].sampler"
        if not 0 < p.min_scale <= p.max_scale <= 1:
            raise error(f"{field}.min_scale", "needs 0 < min_scale <= max_scale <= 1",
                        f"{p.min_scale:g}, {p.max_scale:g}")
        if not 0 < p.min_aspect_ratio <= p.max_aspect_ratio:
            raise error(f"{field}.min_aspect_ratio", "needs 0 < min_aspect_ratio <= max_aspect_ratio",
                        f"{p.min_aspect_ratio:g}, {p.max_aspect_ratio:g}")


def crops(samplers):
    """Can these samplers crop (give a box other than the whole image)?"""
    return any(s.use_original_image and s.max_trials and (s.sampler.min_scale < 1 or s.sampler.max_scale < 1)
               for s in samplers)


# -- records -------------------------------------------------------------------------------------
class AnnotatedDBSource(DBSource):
    """AnnotatedData's records: decode(key, raw) -> (C x H x W image, Annotations or the
    datum's label). `labels`: the label map's labels (None: not checked)."""

    def __init__(self, path, force_color=False, force_gray=False, backend=None, labels=None,
                 label_map_file=None, boxes=True):
        super().__init__(path, force_color, force_gray, backend)
        self.labels, self.label_map_file, self.boxes = labels, label_map_file, boxes

    def parse(self, key, raw):
        a = caffe_pb2.AnnotatedDatum()
        try:
            a.ParseFromString(bytes(raw))
        except DecodeError as e:
            raise DataError(f"{self.where(key)}corrupt or truncated AnnotatedDatum record ({len(raw)} bytes): "
                            f"{e}") from None
        return a

    def decode(self, key, raw):
        a = self.parse(key, raw)
        image = datum_to_array(a.datum, self.force_color, self.force_gray, self.path, key)
        if not self.boxes:
            return image, a.datum.label
        return image, self.rows(key, a)

    def rows(self, key, a):
        """The record's boxes as Annotations rows, checked."""
        n = sum(len(g.annotation) for g in a.annotation_group)
        rows = np.empty((n, 7), F)
        i = 0
        for g in a.annotation_group:
            if self.labels is not None and g.group_label not in self.labels:
                raise DataError(f"{self.where(key)}annotation_group label {g.group_label} is not in the label map "
                                f"{self.label_map_file} (its labels: {', '.join(map(str, sorted(self.labels)))})")
            for an in g.annotation:
                b = an.bbox
                box = (b.xmin, b.ymin, b.xmax, b.ymax)
                what = f"annotation_group label {g.group_label} instance {an.instance_id}"
                if b.xmin > b.xmax or b.ymin > b.ymax:
                    raise DataError(f"{self.where(key)}{what}: the box is inverted (xmin, ymin, xmax, ymax = "
                                    f"{', '.join(f'{v:g}' for v in box)})")
                if min(box) < 0 or max(box) > 1:
                    raise DataError(f"{self.where(key)}{what}: the box (xmin, ymin, xmax, ymax = "
                                    f"{', '.join(f'{v:g}' for v in box)}) lies outside the image (normalized "
                                    f"boxes lie in [0, 1])")
                rows[i] = (g.group_label, an.instance_id, *box, b.difficult)
                i += 1
        return rows


class AnnotatedTransformer:
    """One annotated image through the transforms: `transformer` a DataTransformer (boxes=True)
    of the layer's transform_param, `samplers` its BatchSamplers."""

    def __init__(self, transformer, samplers):
        self.t, self.samplers = transformer, list(samplers)
        p = transformer.param
        self.emit = p.emit_constraint if p.HasField("emit_constraint") else None
        self.augment = transformer.augment
        if self.augment is None and self.samplers:      # the samplers' place in the order is the chain's
            self.augment = Augmentations(p, (transformer.crop_h, transformer.crop_w), transformer.crop_field,
                                         transformer.crop_text, transformer.mean_values, transformer._param_error)
        self.fit_small_scales = (p.resize_param.height_scale, p.resize_param.width_scale) \
            if p.HasField("resize_param") and p.resize_param.resize_mode == RP.FIT_SMALL_SIZE \
            and p.resize_param.height_scale and p.resize_param.width_scale else None

    def _sample(self, boxes, gen):
        found = batch_samples(self.samplers, boxes.boxes, gen)
        return bbox.clip(found[int(gen.integers(len(found)))]) if found else None

    def __call__(self, image, rows, gen, out, where=""):
        """Transform C x H x W `image` with its box rows into `out`; return the rows that
        remain, in the output's frame. `gen` is the image's own generator."""
        draw = gen.integers(0, 1 << 62, size=3, dtype=np.int64)      # mirror coin, crop offsets
        boxes = Annotations(np.array(rows, F).reshape(-1, 7), self.emit)
        if self.augment is not None:
            image = self.augment.apply(image, gen, where, boxes, self._sample if self.samplers else None) \
                .transpose(2, 0, 1)
        _, h, w = image.shape
        h_off, w_off, mirrored = self.t.offsets(image.shape, draw)
        self.t.finish(image, draw, out, where)
        ch, cw = out.shape[1] - 2 * self.t.pad, out.shape[2] - 2 * self.t.pad
        # the fork projects onto the crop even when it is the whole image: boxes without area go
        boxes.reframe(np.array([w_off / F(w), h_off / F(h), (w_off + cw) / F(w), (h_off + ch) / F(h)], F))
        if mirrored:
            boxes.mirror()
        if self.fit_small_scales is not None and len(boxes.rows):
            hs, ws = self.fit_small_scales
            boxes.rows[:, [XMIN, XMAX]] *= F(cw) / F(ws)
            boxes.rows[:, [YMIN, YMAX]] *= F(ch) / F(hs)
        return boxes.rows


class AnnotatedBatchFiller(BatchFiller):
    """Fills {'data', 'label'} buffers: label [1, 1, boxes, 8] (or [batch] for records
    without boxes). `seed`: the layer's, from which each image's generator comes."""

    def __init__(self, source, transform, order, batch_size, shape, seed, threads=None):
        super().__init__(source, transform.t, order, batch_size, shape, threads)
        self.transform, self.seed = transform, int(seed)

    def allocate(self):
        buf = super().allocate()
        if self.source.boxes:
            buf["label"] = np.full((1, 1, 1, 8), -1, np.float32)
        return buf

    def fill(self, buf):
        b = self.batch_size
        items, positions = [], []
        for _ in range(b):
            items.append(self.source.get(self.order.index(self.reads)))
            positions.append(self.order.position(self.reads))
            self.reads += 1
        buf["position"] = self.position()
        found = [None] * b

        def work(lo, hi):
            for j in range(lo, hi):
                key, raw = items[j]
                image, anno = self.source.decode(key, raw)
                gen = np.random.default_rng([self.seed, 3, positions[j]])
                where = self.source.where(key)
                if self.source.boxes:
                    found[j] = self.transform(image, anno, gen, buf["data"][j], where)
                else:
                    self.transform(image, np.zeros((0, 7), F), gen, buf["data"][j], where)
                    buf["label"][j] = anno

        if self._pool is None:
            work(0, b)
        else:
            bounds = np.linspace(0, b, self.threads + 1).astype(int)
            for f in [self._pool.submit(work, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]:
                f.result()
        if self.source.boxes:
            rows = [np.concatenate([np.full((len(r), 1), j, F), r], axis=1) for j, r in enumerate(found)]
            rows = np.concatenate(rows) if rows else np.zeros((0, 8), F)
            buf["label"] = rows.reshape(1, 1, -1, 8) if len(rows) else np.full((1, 1, 1, 8), -1, np.float32)
        return buf
