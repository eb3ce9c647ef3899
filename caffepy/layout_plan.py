"""The layout plan: which memory layout each layer of a net runs in, and where the conversions go.

An unmodified Caffe net gets the fast path by default. The Net asks this plan, layer by layer
as it builds them (the plan needs the blobs' shapes and current layouts), which bottoms to
convert first; the plan answers with conversion layers (NHWCPack, NHWCUnpack of
caffepy/layers/nhwc.py) and the blob names the layer then reads and writes. The rule:

- a Convolution with 4-axis bottoms starts a channels-last region (the fast path's layout,
  caffepy.blob.CHANNELS_LAST), and every following layer whose type has a channels-last
  implementation for its parameters (caffepy.layer.takes_layout) stays in it;
- a layer without one (InnerProduct, Softmax, the losses, Flatten, Reshape, ...) gets its
  bottoms converted back to NCHW, so packs and unpacks happen only where a region begins and
  ends (ResNet-50: one of each; GoogLeNet's train net: one pack, one unpack per classifier);
- blobs in the SIMD-blocked layout (the explicit IntelPack / IntelUnpack form) are left alone,
  and so are layers that handle layouts themselves.

After insert_splits every blob feeds one consumer, so a conversion serves one layer; the Net
runs it as part of that layer (before its forward, after its backward), and keeps it out of
`net.layers` and `net.blobs`. A layer working in place on a converted blob works on the
converted one, and later layers read that (`current`). The blobs keep Caffe's names, shapes
and values (a channels-last blob shows N, C, H, W views), so pycaffe code, snapshots, `caffepy
time` and the log see the net the prototxt describes.

Which layers run Caffe's algorithms (plain NCHW, im2col + GEMM, no Winograd) instead is
Intel Caffe's `engine` rule, decided in caffepy/engine.py.
"""
from .engine import caffe_engine, net_engine
from .layer import BLOCKED, LAYERS, NCHW, NHWC, OWN, PLAIN, Request, layout_of, takes_layout
from .proto import caffe_pb2

PACK = {NHWC: "NHWCPack", NCHW: "NHWCUnpack"}      # conversion layer type into each layout


class LayoutPlan:
    """The plan of one net (see the module docstring). The Net calls, for each layer in order,
    `current(name)` for its bottoms, `conversions(lp, bottoms)` and then `wired(lp)`.
    `net_param` is the net as given (its engine; what the factory's requests carry), `layers`
    the layers the Net builds (split layers included)."""

    def __init__(self, net_param, layers, phase, context, source=None):
        self.net_param, self.phase, self.context, self.source = net_param, phase, context, source
        net_engine(net_param, source)       # checked once, whatever the layers name
        self._current = {}       # user blob name -> the blob the net holds it in now
        self._names = {name for lp in layers for name in list(lp.top) + list(lp.bottom)}
        self._made = set()       # the blob names the plan made (its conversions' tops)
        self._wiring = None      # (bottom names, top names) of the layer being added
        self.regions = 0
        self.converted = 0

    def current(self, name):
        """The blob the net holds the prototxt's blob `name` in now."""
        return self._current.get(name, name)

    def made(self, name):
        """Whether blob `name` is one of the plan's (a converted copy)."""
        return name in self._made

    def user_name(self, name):
        """The prototxt's name of the blob the net holds as `name`."""
        for user, physical in self._current.items():
            if physical == name:
                return user
        return name

    def _target(self, lp, bottoms):
        """The layout `lp`'s bottoms should be in, or None to leave them as they are."""
        if not bottoms:
            return None
        kinds = {layout_of(b) for b in bottoms}
        variants = LAYERS.get(lp.type)
        if BLOCKED in kinds or variants is None:
            return None           # the explicit Intel form, or an unknown type (its own error)
        if variants[PLAIN].layout == OWN or caffe_engine(lp, self.net_param, self.source):
            return NCHW
        request = Request(lp, self.phase, self.source, tuple(bottoms), self.context, self.net_param)
        if all(b.num_axes == 4 for b in bottoms) and takes_layout(request, NHWC):
            if NHWC in kinds:
                return NHWC
            if lp.type == "Convolution":
                self.regions += 1
                return NHWC
        return NCHW

    def conversions(self, lp, bottoms):
        """LayerParameters of the conversion layers to add before `lp` (whose bottoms, as the
        net holds them now, are `bottoms`)."""
        target = self._target(lp, bottoms)
        bottom_names = [self.current(name) for name in lp.bottom]
        out = []
        for i, blob in enumerate(bottoms):
            if target is None or layout_of(blob) == target:
                continue
            converted = self._fresh(f"{lp.bottom[i]}@{target}")
            self._made.add(converted)
            conv = caffe_pb2.LayerParameter(name=converted, type=PACK[target])
            conv.bottom.append(bottom_names[i])
            conv.top.append(converted)
            out.append(conv)
            self.converted += 1
            bottom_names[i] = converted
        # in place on a blob the net holds under another name: the layer works on that blob
        top_names = [bottom_names[list(lp.bottom).index(top)] if top in lp.bottom else top
                     for top in lp.top]
        self._wiring = (bottom_names, top_names)
        return out

    def wired(self, lp):
        """`lp` with the blob names the net holds its bottoms and tops in."""
        bottom_names, top_names = self._wiring
        for user, physical in zip(lp.top, top_names):
            if user != physical:
                self._current[user] = physical
        if bottom_names == list(lp.bottom) and top_names == list(lp.top):
            return lp
        out = caffe_pb2.LayerParameter()
        out.CopyFrom(lp)
        out.bottom[:] = bottom_names
        out.top[:] = top_names
        return out

    def _fresh(self, name):
        candidate, k = name, 1
        while candidate in self._names:
            k += 1
            candidate = f"{name}{k}"
        self._names.add(candidate)
        return candidate

    def summary(self):
        """One log line, or None when the plan changed nothing."""
        if not self.converted:
            return None
        return (f"Layout plan: {self.regions} channels-last region(s), {self.converted} "
                f"conversion layer(s) (engine: CAFFE, -engine CAFFE or CAFFEPY_ENGINE=CAFFE keeps Caffe's NCHW)")
