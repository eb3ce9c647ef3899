"""Shared activation memory for a forward-only TEST net (`Net(..., keep_blobs=False)`).

A Caffe net gives every blob its own memory, and pycaffe code reads any of them after a forward
(`net.blobs['fc7'].data`). A net built with keep_blobs=False keeps only its inputs (and the
tops of its data layers) and its outputs: every other blob takes its data from one of a few
arenas, handed on to another blob once the last layer that reads it has run, as inference
runtimes plan their tensors. The values are the same; what changes is where each layer
writes: into memory a layer or two before it wrote, still in cache, rather than into a buffer
last touched a whole forward ago, which came back from memory line by line and pushed the
weights out of the cache. MobileNet v1 b16's blobs (317 MiB apart) fit in 3 arenas of 74 MiB,
ResNet-50 b16's (1005 MiB) in 4 of 196. A residual block's end (net_rules.ConvSum: the
convolution's GEMM adds the shortcut as it stores each sum) writes its sum over the shortcut
when the shortcut has no reader after it and the GEMM sums in one pass (Gemm.adds_in_place:
ResNet-50's 7 block ends at 56 x 56 and 28 x 28 at b1, all 16 at b16): the shortcut's lines,
just read, are written back, where another buffer's would first come from memory (ResNet-50's
56 x 56 block end alone, caches cold: 0.67 -> 0.57 ms; the net at b1 about 1% faster, at b16
315 -> 303 ms with the 7 of K <= 128, and all 16 a further 1.00-1.03x, alternating in one
process).

`caffepy test`, `caffepy time --phase TEST --forward_only`, `caffepy time --precision` and
`caffepy train`'s test phases build their nets this way (they read outputs only), and
Classifier and Detector take keep_blobs=False too (pycaffe's solver keeps its test nets'
blobs); CAFFEPY_KEEP_BLOBS=1 keeps every blob in every net, as the switch for comparing
values. Such a net refuses backward (it reads the blobs forward wrote) and a forward(blobs=...)
that names a blob it does not keep.
"""
import os

from . import log, memory
from .blob import Blob, Blocked


def keep_every_blob():
    """CAFFEPY_KEEP_BLOBS=1: no net shares its activations' memory."""
    return os.environ.get("CAFFEPY_KEEP_BLOBS", "0") not in ("", "0")


class SharedActivations:
    """The arenas of one net and which blobs live in them. `check()` before and after a
    forward plans them when a blob left its place: before the first forward, at the shapes the
    net was built with (the blobs' own buffers are never written: ResNet-50 b16's first forward
    faulted in their 1005 MiB, 2.5 s -> 0.76 s), and a blob that grows past its place (a larger
    batch) takes a buffer of its own (Blob.reshape) until the plan after that forward. A blob
    that shrinks stays (a smaller batch, a detection layer's rows): the arenas keep the largest
    sizes seen, as Caffe's blobs keep theirs."""

    def __init__(self, net):
        self.net = net
        self.arrangement = None
        self.arenas = []
        # the blobs that give up their values (which ones does not depend on the shapes)
        self.members = [b for group in self._groups() for b in group[3]]
        self.shared = {id(b) for b in self.members}
        self.placed = {}            # id(blob): the array it was placed on
        self.over = {}              # a ConvSum unit's first layer: the blobs of its sum, when
                                    # the plan put them over its shortcut

    def check(self):
        if self.arrangement == Blob.arrangement:
            return
        if any(b._data_buf is not self.placed.get(id(b)) for b in self.members):
            self._plan()
        self.arrangement = Blob.arrangement

    def part(self, first):
        """Give the sum of the ConvSum unit at `first` memory of its own, away from its
        shortcut's, until the next plan: its convolution's algorithm (chosen again at another
        shape, or forced) cannot write over what it adds."""
        blobs = self.over.pop(first)
        _place(blobs, memory.line_empty(max(b.count for b in blobs)))

    def kept(self, blob):
        """Whether the blob holds its values after a forward."""
        return id(blob) not in self.shared

    def _groups(self):
        """The blobs by data buffer (in-place layers, Split, Flatten: one buffer for several
        blobs), each with the span of layers [first, last] that read or write it; a unit that
        runs several layers as one (net_rules) counts as reading and writing all their blobs
        over its span, and a convolution writing straight into a concat's top writes it then."""
        net = self.net
        span = {}
        for first, last in net.units():
            for li in range(first, last + 1):
                span[li] = (first, last)
        groups = {}

        def touch(blob, li):
            first, last = span[li]
            g = groups.setdefault(id(blob._data_buf), [blob._data_buf, [], first, last])
            if not any(blob is b for b in g[1]):
                g[1].append(blob)
            g[2], g[3] = min(g[2], first), max(g[3], last)

        for li in range(len(net.layers)):
            for conversion in net._conversions[li]:
                touch(conversion[1], li)
                touch(conversion[2], li)
            for b in net.bottom_vecs[li] + net.top_vecs[li]:
                touch(b, li)
        for first, slot in net._concat_slots.items():
            touch(net.top_vecs[slot.li][0], first)
        # the values a caller sets or reads: inputs, data layers' tops, outputs
        kept = {id(net.blobs[name]) for name in list(net.inputs) + list(net.outputs)}
        for li, layer in enumerate(net.layers):
            if not net.bottom_vecs[li]:
                kept.update(id(t) for t in net.top_vecs[li])
        out = []
        for buf, blobs, first, last in groups.values():
            # a blocked blob's padding lanes must stay zero, and memory another blob wrote
            # would not be
            if not any(id(b) in kept or isinstance(b.layout, Blocked) for b in blobs):
                out.append((first, last, max(b.count for b in blobs), blobs, id(buf)))
        return out

    def _sums_over_shortcuts(self):
        """{buffer id of a block end's sum: (buffer id of its shortcut, the unit's first and
        last layers)} for the ConvSum units whose convolution may write its sum over the
        shortcut: the same shape and layout, and the convolution not reading it."""
        from .net_rules import CONV_SUM, parts
        net, pairs = self.net, {}
        for first, unit in net._units.items():
            if unit.rule is not CONV_SUM:
                continue
            conv = net.layers[first]
            e, shortcut = parts(net, unit, unit.last)[2:4]
            x = net.top_vecs[e][0]
            if getattr(conv, "adds_in_place", None) is not None and conv.adds_in_place() \
                    and shortcut.layout == x.layout == net.top_vecs[first][0].layout \
                    and shortcut.count == x.count \
                    and all(b._data_buf is not shortcut._data_buf for b in net.bottom_vecs[first]):
                pairs[id(x._data_buf)] = (id(shortcut._data_buf), first, unit.last)
        return pairs

    def _plan(self):
        groups = sorted(self._groups(), key=lambda g: g[0])
        over = self._sums_over_shortcuts()
        # interval colouring, first come first placed: a block end's sum over its shortcut
        # when the shortcut ends with that unit, else a free arena that fits (the smallest),
        # else the largest free one, grown, else a new one
        sizes, busy, where, holds, self.over = [], [], [], [], {}
        for first, last, count, blobs, key in groups:
            free = [a for a in range(len(sizes)) if busy[a] < first]
            fits = [a for a in free if sizes[a] >= count]
            shortcut, unit_first, unit_last = over.get(key, (None, None, None))
            below = [a for a in range(len(sizes)) if holds[a] == shortcut and busy[a] == unit_last]
            if below:
                a = below[0]
                self.over[unit_first] = blobs
            elif fits:
                a = min(fits, key=lambda a: sizes[a])
            elif free:
                a = max(free, key=lambda a: sizes[a])
            else:
                a = len(sizes)
                sizes.append(0)
                busy.append(-1)
                holds.append(None)
            sizes[a] = max(sizes[a], count)
            busy[a] = last
            holds[a] = key
            where.append(a)
        before = sum(g[2] for g in groups)
        self.arenas = [memory.line_zeros(n) for n in sizes]
        for (_, _, count, blobs, _), a in zip(groups, where):
            array = self.arenas[a][:count]
            _place(blobs, array)
            self.placed.update((id(b), array) for b in blobs)
        log.info(f"Sharing activation memory: {len(groups)} blob buffers in {len(sizes)} "
                 f"arenas, {memory.human(sum(sizes) * 4)} (kept apart: {memory.human(before * 4)})"
                 + (f"; {len(self.over)} block end(s) write their sum over the shortcut"
                    if self.over else ""))


def _place(blobs, array):
    """The blobs of one buffer take their data from `array`, still one buffer (one Writes)."""
    writes = None
    for b in blobs:
        writes = b.place_data(array, writes)
