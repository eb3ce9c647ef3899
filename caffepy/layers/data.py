"""Data layers: Input, DummyData (and the database readers Data, ImageData, MemoryData)."""
import numpy as np

from .. import fillers
from ..layer import Layer, register


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
            from ..proto import caffe_pb2
            fills = [caffe_pb2.FillerParameter(type="constant", value=0)]
        self.fillers = [fills[0 if len(fills) == 1 else i] for i in range(n)]
        self.shapes = shapes
        self.refill = [f.type != "constant" for f in self.fillers]
        for t, shape, filler in zip(top, shapes, self.fillers):
            t.reshape(shape)
            t.data[...] = fillers.fill(filler, shape)

    def reshape(self, bottom, top):
        for t, shape in zip(top, self.shapes):
            t.reshape(shape)

    def forward(self, bottom, top):
        for t, shape, filler, refill in zip(top, self.shapes, self.fillers, self.refill):
            if refill:
                t.data[...] = fillers.fill(filler, shape)
