"""Data layers: Input, DummyData, and the readers Data (LMDB or LevelDB), AnnotatedData (SSD's boxed
records), ImageData (list file), MemoryData (arrays), WindowData (R-CNN window files)."""
import weakref

import numpy as np

from .. import fillers, log, memory, rng
from ..data.annotated import (AnnotatedBatchFiller, AnnotatedDBSource, AnnotatedTransformer, check_samplers,
                              crops)
from ..data.augment import RP
from ..data.prefetch import BatchFiller, Prefetcher, RecordOrder
from ..data.sources import DBSource, ImageListSource
from ..data import windows
from ..data.transformer import AUGMENTATIONS, DataTransformer
from ..errors import CaffepyError, DataError, SizeError
from ..layer import Layer, register
from ..proto import caffe_pb2


def _shapes(layer, shapes, count, field):
    """Caffe's one-or-N rule: a single shape applies to every top."""
    if len(shapes) not in (1, count):
        raise layer.error(field, f"give one shape or one per top ({count})", len(shapes))
    return [tuple(shapes[0 if len(shapes) == 1 else i].dim) for i in range(count)]


@register
class Input(Layer):
    """Net inputs: tops shaped by input_param.shape, filled by the caller."""
    min_tops = 1
    exact_bottoms = 0
    differentiable = False

    def setup(self, bottom, top):
        shapes = self.param.input_param.shape
        if not shapes:
            raise self.error("input_param.shape", "needs at least one shape")
        for t, shape in zip(top, _shapes(self, shapes, len(top), "input_param.shape")):
            t.reshape(shape)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass


@register
class DummyData(Layer):
    """Tops filled by data_filler (constant 0 by default); refilled each forward
    unless every filler is constant (Caffe's refill rule)."""
    min_tops = 1
    exact_bottoms = 0
    differentiable = False

    def setup(self, bottom, top):
        p = self.param.dummy_data_param
        n = len(top)
        if p.shape:
            shapes = _shapes(self, p.shape, n, "dummy_data_param.shape")
        else:
            legacy = [p.num, p.channels, p.height, p.width]
            for field, values in zip(("num", "channels", "height", "width"), legacy):
                if len(values) not in (1, n):
                    raise self.error(f"dummy_data_param.{field}", f"give one value or one per top ({n})",
                                     len(values))
            shapes = [tuple(v[0 if len(v) == 1 else i] for v in legacy) for i in range(n)]
        fills = list(p.data_filler)
        if len(fills) not in (0, 1, n):
            raise self.error("dummy_data_param.data_filler", f"give 0, 1 or {n} fillers", len(fills))
        if not fills:
            fills = [caffe_pb2.FillerParameter(type="constant", value=0)]
        self.fillers = [fills[0 if len(fills) == 1 else i] for i in range(n)]
        self.shapes = shapes
        self.refill = [f.type != "constant" for f in self.fillers]
        for t, shape, filler in zip(top, shapes, self.fillers):
            t.reshape(shape)
            try:
                t.data[...] = fillers.fill(filler, shape)
            except CaffepyError as e:
                raise self.error("dummy_data_param.data_filler", str(e)) from None

    def reshape(self, bottom, top):
        for t, shape in zip(top, self.shapes):
            t.reshape(shape)

    def forward(self, bottom, top):
        for t, shape, filler, refill in zip(top, self.shapes, self.fillers, self.refill):
            if refill:
                fillers.fill_into(filler, t.data)


# -- database readers -------------------------------------------------------------
def _transform_param(layer, legacy):
    """transform_param, with the deprecated crop/mirror/mean/scale of data_param or
    image_data_param filling fields transform_param leaves unset (Caffe's upgrade)."""
    tp = caffe_pb2.TransformationParameter()
    tp.CopyFrom(layer.param.transform_param)
    for field in ("scale", "mean_file", "crop_size", "mirror"):
        if legacy.HasField(field) and not tp.HasField(field):
            setattr(tp, field, getattr(legacy, field))
    return tp


class _PrefetchingLayer(Layer):
    """Shared by Data and ImageData: a record source, a RecordOrder over it, a
    DataTransformer and a Prefetcher; tops are data and (optionally) label.

    `wait_seconds` is the time forward() waited for the prefetch thread: the
    training loop's data-wait.

    read_state / set_read_state: the position after the batches forward() handed out
    (not the prefetch thread's, which reads ahead): reads done, the record order's seed
    and skip (so the shuffle continues its epoch's permutation) and the transformer's
    generator (mirror and crop draws); kept per rank in the solver's snapshots.
    """
    exact_bottoms = 0
    min_tops, max_tops = 1, 2
    differentiable = False
    _params_field = None

    def open_source(self, path):
        raise NotImplementedError

    def setup(self, bottom, top):
        p = getattr(self.param, self._params_field)
        self.batch_size = int(p.batch_size)
        if self.batch_size < 1:
            raise self.error(f"{self._params_field}.batch_size", "must be at least 1", self.batch_size)
        if not p.source:
            raise self.error(f"{self._params_field}.source", "is required")
        path = p.source
        context = self.context
        if "{rank}" in path:        # split-DB: each rank reads its own whole shard
            path, rank, ranks = path.replace("{rank}", str(context.rank)), 0, 1
        else:                       # shared-DB: the ranks interleave record by record
            rank, ranks = context.rank, context.size
        try:
            self.source_db = self.open_source(path)
        except DataError as e:
            problem = str(e)
            if problem.startswith(f"{path}: "):     # house shape: the path goes last, as the value
                problem = problem[len(path) + 2:]
            raise self.error(f"{self._params_field}.source", problem, None if path in problem else path,
                             cls=DataError) from None
        if len(self.source_db) == 0:
            raise self.error(f"{self._params_field}.source", "the database is empty", path, cls=DataError)
        log.info(f"Opened {path} ({len(self.source_db)} records)")

        # One draw seeds everything. The solver seeds each rank differently
        # (random_seed + rank), so interleaving ranks take rank 0's draw: they must
        # agree on the shuffle and the skip. Crops and mirrors differ per rank.
        base = int(rng.generator().integers(1 << 62))
        if ranks > 1:
            base = context.agree(base)
        skip = 0
        if p.rand_skip:
            skip = int(np.random.default_rng([base, 1]).integers(p.rand_skip))
            log.info(f"Skipping first {skip} data points")
        self._order_args = (len(self.source_db), rank, ranks, bool(p.shuffle))
        order = RecordOrder(*self._order_args, base, skip)
        tp = _transform_param(self, p)
        self.transformer = self.make_transformer(tp, np.random.default_rng([base, 2, context.rank]))
        try:
            key, raw = self.source_db.get(order.index(0))
            image, _ = self.source_db.decode(key, raw)
        except DataError as e:
            raise self.error(f"{self._params_field}.source", str(e), cls=DataError) from None
        try:
            shape = self.transformer.check(image.shape)
        except DataError as e:
            where = self.source_db.where(key).rstrip(": ")
            field, problem = str(e).split(": ", 1)      # the transformer's "<field>: <problem>"
            raise self.error(field, f"{problem} (first record: {where})", cls=DataError) from None
        self.top_shape = (self.batch_size,) + shape
        # the top and the prefetch buffers are allocated here at once: refuse what cannot fit
        buffers = max(1, int(self.prefetch_depth())) + 1
        why = memory.problem(buffers * memory.count(self.top_shape) * 4,
                             f"{buffers} batches of {memory.dims_text(self.top_shape)} floats")
        if why:
            raise self.error(f"{self._params_field}.batch_size", why, self.batch_size, cls=SizeError)
        self.filler = self.make_filler(order, shape, base)
        self._consumed = self.filler.position()
        self.prefetcher = Prefetcher(self.filler, self.prefetch_depth(), self.name,
                                     also_close=(self.source_db,))
        # a layer nobody holds stops its thread, which then closes the source (see Prefetcher)
        self._finalizer = weakref.finalize(self, self.prefetcher.request_close)
        log.info(f"output data size: {','.join(map(str, self.top_shape))}")
        self.reshape(bottom, top)

    def make_transformer(self, tp, generator):
        return DataTransformer(tp, self.phase, generator, layer=self)

    def make_filler(self, order, shape, seed):
        return BatchFiller(self.source_db, self.transformer, order, self.batch_size, shape)

    def prefetch_depth(self):
        return 4

    @property
    def wait_seconds(self):
        return self.prefetcher.wait_seconds

    def reshape(self, bottom, top):
        top[0].reshape(self.top_shape)
        if len(top) > 1:
            top[1].reshape(self.batch_size)

    def forward(self, bottom, top):
        try:
            buf = self.prefetcher.next()
        except DataError as e:      # a record the prefetch thread could not read: say which layer
            raise self.error(f"{self._params_field}.source", str(e), cls=DataError) from None
        try:
            top[0].data[...] = buf["data"]
            if len(top) > 1:
                top[1].data[...] = buf["label"]
            self._consumed = buf["position"]
        finally:
            self.prefetcher.release(buf)

    def read_state(self):
        reads, transform = self._consumed
        order = self.filler.order
        return {"records": order.size, "ranks": order.ranks, "seed": order.seed, "skip": order.skip,
                "reads": reads, "transform": transform}

    _STATE_KEYS = ("records", "ranks", "seed", "skip", "reads", "transform")

    def set_read_state(self, state, ranks=None):
        """`ranks`: the number of ranks of the run that saved `state` (rank 0's state when it
        differs from this run's). With as many ranks as then, each rank goes on exactly; else
        a record stream the ranks interleaved (shared DB, or one process) goes on from where
        they had read it together, with fresh mirror and crop draws; shards start over."""
        if set(state) != set(self._STATE_KEYS):
            raise DataError(f"expected the keys {', '.join(self._STATE_KEYS)}, got {', '.join(state)}")
        for field in self._STATE_KEYS[:-1]:
            value = state[field]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
                raise DataError(f"{field}: must be an integer in [0, 2^62), got {str(value)[:40]}")
        problem = rng.state_problem(state["transform"], self.transformer.gen.bit_generator.state)
        if problem:
            raise DataError(f"transform: not a generator state ({problem})")
        size, _, interleave, _ = self._order_args
        here, ranks = f"{self.filler.source.path}: layer '{self.name}'", ranks or self.context.size
        if state["records"] != size:
            log.warning(f"{here}: the snapshot was taken over {state['records']} records, the source has "
                        f"{size}: reading from the first record")
            return
        skip, reads, transform = state["skip"], state["reads"], state["transform"]
        if ranks != self.context.size:
            if state["ranks"] != ranks or interleave != self.context.size:
                log.warning(f"{here}: the snapshot's {ranks} ranks and this run's {self.context.size} do not "
                            f"read one record stream (a split DB): reading from the first record")
                return
            skip, reads, transform = skip + reads * ranks, 0, None
            log.info(f"{here}: continues the record stream where the snapshot's {ranks} ranks had read it "
                     f"together ({skip}); mirror and crop draws start afresh")

        def reposition():
            self.filler.order = RecordOrder(*self._order_args, state["seed"], skip)
            self.filler.reads = reads
            if transform is not None:
                self.transformer.gen.bit_generator.state = transform
            self._consumed = self.filler.position()
        self.prefetcher.restart(reposition)

    def close(self):
        """Stop the prefetch thread and close the source (also done at exit)."""
        self._finalizer.detach()
        self.prefetcher.close()


@register
class Data(_PrefetchingLayer):
    """Batches of Datum records from an LMDB or a LevelDB (data_param), transformed by transform_param.

    Tops: data (batch_size x C x H x W, after crop) and optionally label (batch_size).
    data_param: source (read as the kind of database it is; a `backend` naming the other kind
    gets a warning), batch_size, rand_skip, prefetch, shuffle (Intel), force_encoded_color.
    Encoded records are decoded by OpenCV in BGR order.

    Multi-rank (rank r of N in the layer's run context, `self.context`): a source
    containing `{rank}` names one shard per rank (split-DB: `{rank}` is replaced by the
    rank, each rank reads its whole shard; `caffepy split_db DB N` writes DB_0 ...
    DB_<N-1>, read as `DB_{rank}`). Otherwise all ranks read one database (shared-DB):
    rank r of N reads records r, r+N, r+2N, ..., so N ranks with batch_size b see
    together what one rank with batch_size N*b sees. With shuffle, each epoch's
    permutation comes from a seed drawn from rank 0's caffepy.rng and agreed
    (`context.agree`), so all ranks walk the same one. A solver's test nets run on
    rank 0 alone in a single-process context (solver.py), so they read every record,
    as Caffe's do.
    """
    _params_field = "data_param"

    def open_source(self, path):
        p = self.param.data_param
        # the database is read as what it is; a backend that says otherwise gets a warning
        backend = caffe_pb2.DataParameter.DB.Name(p.backend) if p.HasField("backend") else None
        tp = self.param.transform_param
        return DBSource(path, force_color=tp.force_color or p.force_encoded_color, force_gray=tp.force_gray,
                        backend=backend)

    def prefetch_depth(self):
        return self.param.data_param.prefetch


@register
class AnnotatedData(Data):
    """SSD's data layer: batches of AnnotatedDatum records (caffepy convert_annoset) from an LMDB
    or LevelDB, each image and its boxes carried together through transform_param and the batch
    samplers (caffepy/data/annotated.py gives the order and the rules).

    Tops: data (batch_size x C x H x W) and optionally label: [1, 1, boxes, 8], one row per box
    of the batch (item_id, group_label, instance_id, xmin, ymin, xmax, ymax, difficult; boxes
    normalized to the output image), one row of -1 when there is none; or [batch_size] labels
    for records without an annotation type (annotated_data_param.anno_type gives one to all).
    annotated_data_param: batch_sampler { sampler { min_scale max_scale min_aspect_ratio
    max_aspect_ratio } sample_constraint { min/max_jaccard_overlap, min/max_sample_coverage,
    min/max_object_coverage } max_sample max_trials use_original_image }, label_map_file (its
    labels: every record's labels must be among them), anno_type. data_param as Data's
    (source, batch_size, rand_skip, shuffle, prefetch, backend); transform_param as Data's,
    plus emit_constraint. Multi-rank reading as Data's; each image's random draws come from
    its place in the record stream, so N ranks give what one rank with N times the batch does.
    """

    def setup(self, bottom, top):
        # read before the source opens: its errors would be reported as the source's
        ap = self.param.annotated_data_param
        self.labels = None
        if ap.label_map_file:
            from ..data.annoset import read_label_map
            try:
                self.labels = {item.label for item in read_label_map(ap.label_map_file).item}
            except DataError as e:
                raise self.error("annotated_data_param.label_map_file", str(e), cls=DataError) from None
        super().setup(bottom, top)

    def open_source(self, path):
        p, ap = self.param.data_param, self.param.annotated_data_param
        labels = self.labels
        backend = caffe_pb2.DataParameter.DB.Name(p.backend) if p.HasField("backend") else None
        tp = self.param.transform_param
        source = AnnotatedDBSource(path, force_color=tp.force_color or p.force_encoded_color,
                                   force_gray=tp.force_gray, backend=backend, labels=labels,
                                   label_map_file=ap.label_map_file)
        if len(source):
            key, raw = source.get(0)
            first = source.parse(key, raw)
            source.boxes = first.HasField("type") or ap.HasField("anno_type")
            if first.HasField("type") and ap.HasField("anno_type"):
                log.warning(f"layer '{self.name}' (AnnotatedData): annotated_data_param.anno_type replaces the "
                            f"type stored in the records")
        return source

    def make_transformer(self, tp, generator):
        samplers = self.param.annotated_data_param.batch_sampler
        check_samplers(samplers, self.error)
        fixed = tp.HasField("resize_param") and tp.resize_param.resize_mode != RP.FIT_SMALL_SIZE
        if crops(samplers) and not fixed:
            raise self.error("annotated_data_param.batch_sampler", "crops the images to varying sizes",
                             hint="Give transform_param a resize_param of WARP or FIT_LARGE_SIZE_AND_PAD mode "
                                  "to bring them to one size, as SSD's nets do")
        return DataTransformer(tp, self.phase, generator, layer=self, boxes=True)

    def make_filler(self, order, shape, seed):
        transform = AnnotatedTransformer(self.transformer, self.param.annotated_data_param.batch_sampler)
        return AnnotatedBatchFiller(self.source_db, transform, order, self.batch_size, shape, seed)

    def reshape(self, bottom, top):
        top[0].reshape(self.top_shape)
        if len(top) > 1 and not self.source_db.boxes:
            top[1].reshape(self.batch_size)
        elif len(top) > 1 and top[1].shape[-1:] != (8,):     # forward gives each batch its own
            top[1].reshape((1, 1, 1, 8))

    def forward(self, bottom, top):
        try:
            buf = self.prefetcher.next()
        except DataError as e:
            raise self.error("data_param.source", str(e), cls=DataError) from None
        try:
            top[0].data[...] = buf["data"]
            if len(top) > 1:
                top[1].reshape(buf["label"].shape)
                top[1].data[...] = buf["label"]
            self._consumed = buf["position"]
        finally:
            self.prefetcher.release(buf)


@register
class ImageData(_PrefetchingLayer):
    """Batches of image files listed in image_data_param.source (`<path> <label>` lines).

    image_data_param: source, root_folder (prefixed to each path), batch_size,
    rand_skip, shuffle (a new order every epoch), new_height/new_width (resize with
    INTER_LINEAR, both or neither), is_color. Transformed by transform_param (Intel's
    bgr2rgb, which as in Intel Caffe only ImageData honours, gives colour images in RGB order).
    """
    _params_field = "image_data_param"

    def open_source(self, path):
        p = self.param.image_data_param
        if bool(p.new_height) != bool(p.new_width):
            raise self.error("image_data_param.new_height", "set new_height and new_width together",
                             f"{p.new_height}x{p.new_width}")
        return ImageListSource(path, p.root_folder, p.new_height, p.new_width, p.is_color,
                               self.param.transform_param.bgr2rgb)


@register
class MemoryData(Layer):
    """Batches from arrays handed over by `net.set_input_arrays(data, labels)` (or
    `layer.reset(data, labels)`): data N x C x H x W, labels N, N a multiple of batch_size.
    Walks the arrays batch by batch and starts over at the end.

    memory_data_param: batch_size, channels, height, width. Tops: data, label (batch_size).
    """
    exact_bottoms = 0
    exact_tops = 2
    differentiable = False

    def setup(self, bottom, top):
        p = self.param.memory_data_param
        self.batch_size, self.shape = int(p.batch_size), (int(p.channels), int(p.height), int(p.width))
        if self.batch_size < 1 or min(self.shape) < 1:
            raise self.error("memory_data_param", "batch_size, channels, height and width must be positive",
                             f"{self.batch_size}, {self.shape}")
        self.data = self.labels = None
        self.pos = 0

    def reset(self, data, labels):
        data = np.ascontiguousarray(data, np.float32)
        labels = np.ascontiguousarray(labels, np.float32).reshape(-1)
        if data.ndim != 4 or data.shape[1:] != self.shape:
            raise self.error("data", f"must be N x {' x '.join(map(str, self.shape))}", data.shape)
        if labels.size != data.shape[0]:
            raise self.error("labels", f"need one label per item ({data.shape[0]})", labels.size)
        if data.shape[0] % self.batch_size:
            raise self.error("data", f"the number of items must be a multiple of batch_size "
                             f"({self.batch_size})", data.shape[0])
        self.data, self.labels, self.pos = data, labels, 0

    def set_batch_size(self, batch_size):
        if self.data is not None and self.data.shape[0] % batch_size:
            raise self.error("batch_size", f"must divide the number of items ({self.data.shape[0]})",
                             batch_size)
        self.batch_size, self.pos = int(batch_size), 0

    def reshape(self, bottom, top):
        top[0].reshape((self.batch_size,) + self.shape)
        top[1].reshape(self.batch_size)

    def forward(self, bottom, top):
        if self.data is None:
            raise self.error("data", "no arrays to read",
                             hint="call net.set_input_arrays(data, labels) before forward")
        b = self.batch_size
        top[0].data[...] = self.data[self.pos:self.pos + b]
        top[1].data[...] = self.labels[self.pos:self.pos + b]
        self.pos = (self.pos + b) % self.data.shape[0]


@register
class WindowData(Layer):
    """Batches of windows sampled from an R-CNN window file (caffepy/data/windows.py gives
    the format, the sampling and the warping): tops data (batch_size x C x crop x crop) and
    label (batch_size; 0 for background windows).

    window_data_param: source, root_folder, batch_size, fg_threshold, bg_threshold,
    fg_fraction, context_pad, crop_mode ("warp" or "square"), cache_images, scale.
    transform_param: crop_size (required), mirror, mean_file or mean_value (the deprecated
    crop_size, mirror, mean_file and scale of window_data_param are read too). Windows are
    drawn in a prefetch thread from caffepy.rng's seed.
    """
    exact_bottoms = 0
    exact_tops = 2
    differentiable = False

    def setup(self, bottom, top):
        p = self.param.window_data_param
        tp = _transform_param(self, p)
        if p.batch_size < 1:
            raise self.error("window_data_param.batch_size", "must be at least 1", p.batch_size)
        if not p.source:
            raise self.error("window_data_param.source", "is required")
        if tp.crop_size < 1:
            raise self.error("transform_param.crop_size", "WindowData needs a crop size (the warped "
                             "window's side)", tp.crop_size)
        if p.crop_mode not in ("warp", "square"):
            raise self.error("window_data_param.crop_mode", "must be 'warp' or 'square'", f"'{p.crop_mode}'")
        if 2 * p.context_pad >= tp.crop_size:
            raise self.error("window_data_param.context_pad", f"must be less than half the crop size "
                             f"({tp.crop_size})", p.context_pad)
        try:
            images, fg, bg, channels = windows.read_window_file(p.source, p.root_folder, p.fg_threshold,
                                                                p.bg_threshold)
        except DataError as e:
            problem = str(e)
            if problem.startswith(f"{p.source}: "):
                problem = problem[len(p.source) + 2:]
            raise self.error("window_data_param.source", problem, p.source, cls=DataError) from None
        if channels != 3:
            raise self.error("window_data_param.source", "images are read in colour: the window file "
                             "must give 3 channels", f"{channels} (first image)", cls=DataError)
        num_fg = int(np.float32(p.batch_size) * np.float32(p.fg_fraction))
        for kind, found, wanted in (("foreground", fg, num_fg), ("background", bg, p.batch_size - num_fg)):
            if wanted and not found:
                raise self.error("window_data_param.source", f"no {kind} windows (fg_threshold "
                                 f"{p.fg_threshold:g}, bg_threshold {p.bg_threshold:g})", p.source,
                                 cls=DataError)
        log.info(f"Window data layer: {len(images)} images, foreground overlap >= {p.fg_threshold:g}, "
                 f"background < {p.bg_threshold:g}, foreground fraction {p.fg_fraction:g}")
        for label, count in windows.label_histogram(fg, bg).items():
            log.info(f"class {label} has {count} samples")
        for field in AUGMENTATIONS + ("crop_h", "crop_w", "flow"):
            if tp.HasField(field):
                raise self.error(f"transform_param.{field}", "is not read by WindowData, which samples and "
                                 "warps its own windows (Intel Caffe's augmentations run in Data and ImageData)",
                                 hint="Remove it")
        transformer = DataTransformer(tp, self.phase, layer=self)     # reads and checks the mean
        mean = transformer.mean if transformer.mean is not None else transformer.mean_values
        if transformer.mean is not None and min(transformer.mean.shape[1:]) < tp.crop_size:
            raise self.error("transform_param.mean_file", f"the mean must be at least crop_size "
                             f"({tp.crop_size}) a side", transformer.mean.shape, cls=DataError)
        if transformer.mean_values is not None and len(transformer.mean_values) not in (1, channels):
            raise self.error("transform_param.mean_value", f"give 1 value or one per channel ({channels})",
                             len(transformer.mean_values), cls=DataError)
        scale = tp.scale if tp.HasField("scale") else p.scale
        generator = np.random.default_rng([int(rng.generator().integers(1 << 62)), self.context.rank])
        self.filler = windows.WindowFiller(
            images, fg, bg, int(p.batch_size), channels, int(tp.crop_size), fg_fraction=p.fg_fraction,
            context_pad=int(p.context_pad), square=p.crop_mode == "square", mirror=tp.mirror, scale=scale,
            mean=mean, generator=generator, cache_images=p.cache_images, where=f"{p.source}: ")
        self.top_shape = (int(p.batch_size), channels, int(tp.crop_size), int(tp.crop_size))
        why = memory.problem(3 * memory.count(self.top_shape) * 4,
                             f"3 batches of {memory.dims_text(self.top_shape)} floats")
        if why:
            raise self.error("window_data_param.batch_size", why, p.batch_size, cls=SizeError)
        self.prefetcher = Prefetcher(self.filler, 2, self.name)
        self._finalizer = weakref.finalize(self, self.prefetcher.request_close)
        log.info(f"output data size: {','.join(map(str, self.top_shape))}")

    @property
    def wait_seconds(self):
        return self.prefetcher.wait_seconds

    def reshape(self, bottom, top):
        top[0].reshape(self.top_shape)
        top[1].reshape(self.top_shape[0])

    def forward(self, bottom, top):
        buf = self.prefetcher.next()
        try:
            top[0].data[...] = buf["data"]
            top[1].data[...] = buf["label"]
        finally:
            self.prefetcher.release(buf)

    def close(self):
        """Stop the prefetch thread (also done at exit)."""
        self._finalizer.detach()
        self.prefetcher.close()
