"""Blob: an N-d float32 array of data and a gradient (`diff`) of the same shape.

Reshaping to a smaller or equal count reuses the buffers (as Caffe does), so a
net that changes batch size does not reallocate. `diff` is allocated on first
use: nets that only run forward never pay for it.

Layouts (`blob.layout`): None is Caffe's (N, C, H, W). `Blocked` is the SIMD-blocked layout
between IntelPack and IntelUnpack, whose `data` is the 5-axis array as stored. `CHANNELS_LAST`
is the fast path's (N, H, W, C) memory order (caffepy/layout_plan.py puts it where it pays):
its `data`, `diff` and `shape` stay Caffe's (N, C, H, W), as views of that memory, so pycaffe
code, the gradient checker and the NumPy layers read and write it unchanged; the kernels take
`raw_data` / `raw_diff`, the arrays in memory order (the same arrays for the other layouts).

Writes to the data are tracked (Writes, below) so that a value derived from weights (packed,
folded, quantized: Seen) is redone when they may have changed, without comparing them on every
forward: handing out `data` or `raw_data` counts as a possible write, and so does any array
still alive outside the blob that views its memory. Code that only reads takes `read_data`.
"""
import sys
import typing

import numpy as np

from . import memory
from .errors import ShapeError, SizeError

MAX_AXES = 32


class Blocked(typing.NamedTuple):
    """The SIMD-blocked layout between IntelPack and IntelUnpack.

    A blocked blob has shape (N, ceil(channels / width), H, W, width): channel c lives in
    block c // width, lane c % width; lanes past `channels` hold zeros.
    """
    width: int
    channels: int


class ChannelsLast:
    """The channels-last layout: a 4-axis blob of Caffe shape (N, C, H, W) stored as (N, H, W, C)."""
    def __eq__(self, other):
        return isinstance(other, ChannelsLast)

    def __hash__(self):
        return hash(ChannelsLast)

    def __repr__(self):
        return "NHWC"


CHANNELS_LAST = ChannelsLast()


# every count is taken the same way (the loop variables and attributes below), so the constant
# a call adds cancels; the builtin itself, not a function around it (a frame per view)
_refcount = sys.getrefcount

try:        # the same counts taken in C (cext/writes.pyx), where the kernels are built
    from .kernels import writes as _counts
except ImportError:
    _counts = None


class Writes:
    """The possible writers of one data buffer, shared by the blobs that view it (share_data).

    `count` goes up whenever a blob hands out a writable array of the buffer (`data`,
    `raw_data`) or writes it itself. `untouched()` says that no array outside the blobs views
    the buffer: every view of it is made from `root` (a NumPy array over a memoryview, so that
    NumPy sets `root`, not the buffer, as the base of any view taken of a view), so one taken
    by a user, or by code a user calls, raises the reference count of `root`; a user's reference
    to an array a blob holds raises that array's count. Both are measured against the counts
    with the blobs' own references alone. So "the count has not moved, and untouched()" means
    that no Python code could have written the buffer since the count was read: the answer a
    compare of the floats would give, but for writes through raw addresses (ctypes integers),
    which nothing tracks, and for a write from another thread racing the count's increment
    (unsynchronized, as writing weights during a forward always was).
    """

    def __init__(self, buf):
        self.count = 0
        self.root = np.frombuffer(memoryview(buf), np.float32)
        self.views = []             # the arrays the blobs hold, each made from root
        self.view_refs = []         # their reference counts with only the blobs holding them
        # with no view of root yet, as untouched() counts
        self.root_refs = _refcount(self.root) if _counts is None else _counts.root_refs(self)
        self.pending = None         # values held elsewhere until the floats are read (Blob.hold)

    def _view_refs(self):
        # measured as untouched() measures them: the loop's own reference to each is counted
        # alike (settle's measure and untouched's check must see the same temporaries)
        if _counts is not None:
            return _counts.view_refs(self.views)
        refs = []
        for v, _ in zip(self.views, self.view_refs):
            refs.append(_refcount(v))
        return refs

    def held(self, blob, dropped=()):
        """`blob`'s arrays are now its _raw and _data, in place of `dropped` (its arrays before,
        or () ); then `settle()` measures the new ones."""
        self.count += 1
        keep = [i for i, v in enumerate(self.views) if not any(v is d for d in dropped)]
        self.views = [self.views[i] for i in keep]
        self.view_refs = [self.view_refs[i] for i in keep]
        for mine in (blob._raw, blob._data):
            if mine is not None and not any(mine is v for v in self.views):
                self.views.append(mine)
                self.view_refs.append(None)

    def settle(self):
        """Measure the arrays `held` added, while only the blobs hold them (the caller keeps no
        reference of its own to them)."""
        refs = self._view_refs()
        self.view_refs = [r if was is None else was for r, was in zip(refs, self.view_refs)]

    def untouched(self):
        """Whether only the blobs hold arrays of the buffer (none outside may write it)."""
        if _counts is not None:
            return _counts.untouched(self)
        if _refcount(self.root) != self.root_refs + len(self.views):
            return False
        for v, r in zip(self.views, self.view_refs):
            if _refcount(v) != r:
                return False
        return True


class _NoArrays:
    _raw = _data = None


_NO_ARRAYS = _NoArrays()


class Blob:
    # goes up whenever any blob's shape, layout or buffers change: a layer that reshaped at the
    # same value would find every shape as it left them (the Net then skips its reshape)
    arrangement = 0

    def __init__(self, shape=(), name=""):
        self.name = name
        self._data_buf = np.zeros(0, np.float32)
        self._writes = Writes(self._data_buf)
        self._raw = self._data = None
        self._diff_buf = None
        self._shape = None
        self._layout = None       # None: plain (NCHW); Blocked; CHANNELS_LAST (see the docstring)
        self.reshape(shape)

    @property
    def layout(self):
        return self._layout

    @layout.setter
    def layout(self, layout):
        if layout == CHANNELS_LAST and len(self._shape) != 4:
            raise ShapeError(f"blob '{self.name}': the channels-last layout needs 4 axes, got "
                             f"{memory.dims_text(self._shape)}")
        self._layout = layout
        Blob.arrangement += 1
        self._views()

    # -- shape -----------------------------------------------------------
    def reshape(self, *shape):
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = shape[0]
        shape = tuple(int(s) for s in shape)
        if len(shape) > MAX_AXES:
            self._refuse(shape, f"blob '{self.name}' has {len(shape)} axes, more than the {MAX_AXES} "
                         f"a blob can have")
        if shape == self._shape:
            return
        if self._writes.pending is not None:     # the values as they were, in the old shape
            self._fill()
        count = memory.count(shape)
        if any(s < 0 for s in shape):
            self._refuse(shape, f"blob '{self.name}' has a negative dimension: {memory.dims_text(shape)}")
        if count == 0 and memory.count(s for s in shape if s) > sys.maxsize // 4:
            self._refuse(shape, f"blob '{self.name}' shape {memory.dims_text(shape)} is too large to address")
        if count > self._data_buf.size:
            buffers = 2 if self._diff_buf is not None else 1
            why = memory.problem(count * 4 * buffers, f"blob '{self.name}' ({memory.dims_text(shape)} floats)")
            if why:
                self._refuse(shape, why)
            self._data_buf = memory.line_zeros(count)
            self._leave_writes()
            self._writes = Writes(self._data_buf)
            if self._diff_buf is not None:
                self._diff_buf = memory.line_zeros(count)
        if self._layout == CHANNELS_LAST and len(shape) != 4:
            self._refuse(shape, f"blob '{self.name}' is channels-last (N, H, W, C) and takes 4 axes, "
                         f"got {memory.dims_text(shape)}")
        self._shape = shape
        Blob.arrangement += 1
        self._views()

    def _view(self, buf):
        """(memory-order array, Caffe-order view) of the first `count` floats of `buf` (an
        array, or the data's Writes.root)."""
        flat = buf[:memory.count(self._shape)]
        if self._layout == CHANNELS_LAST:
            n, c, h, w = self._shape
            raw = flat.reshape(n, h, w, c)
            return raw, raw.transpose(0, 3, 1, 2)
        raw = flat.reshape(self._shape)
        return raw, raw

    def _data_views(self):
        """Make the data's arrays afresh, from its Writes.root."""
        dropped = (self._raw, self._data)
        self._raw, self._data = self._view(self._writes.root)
        self._writes.held(self, dropped)
        del dropped
        self._writes.settle()

    def _leave_writes(self):
        """Stop being one of the blobs of self._writes (a new buffer, or another's shared)."""
        self._writes.held(_NO_ARRAYS, (self._raw, self._data))
        self._raw = self._data = None

    def _views(self):
        self._data_views()
        self._raw_diff = self._diff = None
        if self._diff_buf is not None:
            self._raw_diff, self._diff = self._view(self._diff_buf)

    def _refuse(self, shape, problem):
        raise SizeError(problem, blob=self.name, shape=shape)

    @property
    def shape(self):
        return self._shape

    @property
    def count(self):
        return self._data.size

    @property
    def num_axes(self):
        return len(self._shape)

    def shape_string(self):
        return " ".join([str(s) for s in self._shape] + [f"({self.count})"])

    def _legacy(self, index):
        # Caffe's num/channels/height/width: missing leading/trailing axes read as 1
        if self.num_axes > 4:
            raise ShapeError(f"blob '{self.name}': legacy accessor on a {self.num_axes}-axis blob")
        return self._shape[index] if index < self.num_axes else 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    # -- storage ---------------------------------------------------------
    @property
    def data(self):
        if self._writes.pending is not None:
            self._fill()
        self._writes.count += 1
        return self._data

    @property
    def read_data(self):
        """`data` for code that only reads it (a kernel taking its weights): taking it does not
        count as a possible write (Writes)."""
        if self._writes.pending is not None:
            self._fill()
        return self._data

    def hold(self, values):
        """The data's values are `values`, held elsewhere until the floats are read: the first
        `data`, `read_data` or `raw_data` fills them in (values.fill(flat floats), exact). An int8
        layer's 8-bit top kept as the bytes the int8 layers after it read (quantization.Bytes):
        its floats are written only for a reader that wants them."""
        self._writes.pending = values
        self._writes.count += 1

    def held(self):
        """The values `hold` gave, while the floats are not filled in; else None."""
        return self._writes.pending

    def overwrite(self):
        """`raw_data` for a writer about to replace every value: held values are dropped unread."""
        self._writes.pending = None
        self._writes.count += 1
        return self._raw

    def _fill(self):
        values, self._writes.pending = self._writes.pending, None
        values.fill(self._writes.root[:values.count])

    def written(self):
        """A mark of the data's possible writes: equal marks, the second taken while
        `untouched()`, mean the floats have not changed in between (Writes)."""
        return (self._writes, self._writes.count)

    def untouched(self):
        """Whether no array outside the blobs views the data (Writes.untouched)."""
        return self._writes.untouched()

    @property
    def diff(self):
        if self._diff is None:
            if self._diff_buf is None or self._diff_buf.size < self._data_buf.size:
                why = memory.problem(self._data_buf.size * 4, f"the diff of blob '{self.name}' "
                                     f"({memory.dims_text(self._shape)} floats)")
                if why:
                    self._refuse(self._shape, why)
                self._diff_buf = memory.line_zeros(self._data_buf.size)
                Blob.arrangement += 1
            self._raw_diff, self._diff = self._view(self._diff_buf)
        return self._diff

    @property
    def raw_data(self):
        """The data as stored (C-contiguous): `data` itself but for a channels-last blob."""
        if self._writes.pending is not None:
            self._fill()
        self._writes.count += 1
        return self._raw

    @property
    def raw_diff(self):
        self.diff
        return self._raw_diff

    @property
    def has_diff(self):
        return self._diff_buf is not None

    def share_data(self, other):
        """Make this blob a view of `other`'s data (Flatten, Reshape, Split); shapes may differ,
        except between channels-last blobs, which share as they are."""
        self._may_share(other, "data")
        if self._writes is other._writes and self._data_buf is other._data_buf:
            return      # shared already (a Split's reshape each forward): the arrays are current
        self._data_buf = other._data_buf
        if self._writes is not other._writes:
            self._leave_writes()
            self._writes = other._writes
        Blob.arrangement += 1
        self._data_views()

    def share_diff(self, other):
        """Make this blob's diff a view of `other`'s, as share_data."""
        self._may_share(other, "diff")
        other.diff  # allocate on the owner so both see one buffer
        if self._diff_buf is not other._diff_buf:
            Blob.arrangement += 1
        self._diff_buf = other._diff_buf
        self._raw_diff, self._diff = self._view(self._diff_buf)

    def _may_share(self, other, what):
        if other.count != self.count:
            raise ShapeError(f"blob '{self.name}': cannot share {what} of {other.count} values into "
                             f"{self.count}")
        if not (self._layout == CHANNELS_LAST and other._layout == CHANNELS_LAST
                and self._shape == other._shape):
            self._refuse_layouts(other, f"share {what}")

    def shares_diff(self, other):
        """Whether the two blobs' diffs are one buffer."""
        return self._diff_buf is not None and self._diff_buf is other._diff_buf

    def _refuse_layouts(self, other, what):
        if self._layout == CHANNELS_LAST or other._layout == CHANNELS_LAST:
            raise ShapeError(f"blob '{self.name}': cannot {what} with a channels-last blob")

    def place_diff(self, buffer):
        """Keep the diff in `buffer` from now on (a float32 array of `count` values, e.g. the
        shared memory the MPI gradient reducer reads in place); the current diff is copied in."""
        flat = buffer.reshape(-1)
        if flat.dtype != np.float32 or flat.size != self.count:
            raise ShapeError(f"blob '{self.name}': cannot place a diff of {self.count} float32 "
                             f"values in {flat.size} {flat.dtype} values")
        flat[...] = 0 if self._diff is None else self.raw_diff.reshape(-1)
        self._diff_buf = flat
        Blob.arrangement += 1
        self._raw_diff, self._diff = self._view(flat)

    def place_data(self, array, writes=None):
        """Take the data from `array` (float32, at least `count` values) from now on, the
        values not copied: memory that other blobs use at other times in a forward
        (caffepy/net_memory.py). The blobs that viewed one buffer are placed with the first
        one's `writes` (returned), so they stay one buffer."""
        self._writes.pending = None
        self._data_buf = array
        self._leave_writes()
        self._writes = Writes(array) if writes is None else writes
        Blob.arrangement += 1
        self._data_views()
        return self._writes

    def set_data(self, array):
        """Copy `array` in, reshaping to its shape."""
        array = np.asarray(array, dtype=np.float32)
        self.reshape(array.shape)
        self._writes.pending = None
        self._writes.count += 1
        self._data[...] = array

    def __repr__(self):
        return f"Blob({self.name!r}, shape={self._shape})"


class Seen:
    """What a derived value was computed from (weights reordered or Winograd-transformed for a
    kernel, BatchNorm folded into a convolution, int8 weights), so that the value is redone only
    when one of their floats may have changed. A source is a Blob (its data), an array, or None.

    A blob whose write mark (Blob.written) has not moved, and that nothing outside holds
    (Blob.untouched), has not changed: no compare. A blob that something outside held when it
    was kept (pycaffe code keeping `w = net.params[...][0].data` across forwards) is compared
    bit for bit with a copy taken then (memcmp: ~5 us per 100,000 floats); one that nothing
    held keeps no copy (ResNet-50's would be 100 MB) and counts as changed once its mark moves.
    A writable array is compared with its copy; a read-only one (a folded weight that caffepy
    made and never writes) that is the same object as before has not changed. Arrays of other
    4- or 8-byte dtypes (a float64 eps) are compared as their bytes."""

    def __init__(self):
        self.kept = None        # per source: (copy or the read-only array, blob mark or None)

    @staticmethod
    def _floats(a):
        a = np.ascontiguousarray(a).reshape(-1)
        return a if a.dtype == np.float32 else a.view(np.float32)

    def _same(self, i, source):
        kept = self.kept[i]
        if source is None or kept is None:
            return source is None and kept is None
        copy, mark = kept
        if isinstance(source, Blob):
            writes = source._writes
            if mark is not None and mark[0] is writes and mark[1] == writes.count \
                    and writes.untouched():
                return True
            from .kernels import nhwc
            if copy is None or not nhwc.same_floats(self._floats(source.read_data),
                                                    self._floats(copy)):
                return False
            if source.untouched():      # compared equal: no compare next time if left alone
                self.kept[i] = (copy, source.written())
            return True
        if not source.flags.writeable:
            return source is copy
        from .kernels import nhwc
        return copy is not None and nhwc.same_floats(self._floats(source), self._floats(copy))

    def changed(self, *sources):
        """Whether any of `sources` differs from what the last `keep` saw. A blob whose mark
        stands and that nothing outside holds is answered here, without _same's call (a TEST
        forward asks of ResNet-50's 53 units' seven blobs each)."""
        kept = self.kept
        if kept is None or len(sources) != len(kept):
            return True
        if _counts is not None:
            i = _counts.first_moved(kept, sources, Blob, 0)
            while i >= 0:
                if not self._same(i, sources[i]):
                    return True
                i = _counts.first_moved(kept, sources, Blob, i + 1)
            return False
        for i, source in enumerate(sources):
            entry = kept[i]
            if entry is not None and source.__class__ is Blob:
                mark, writes = entry[1], source._writes
                if mark is not None and mark[0] is writes and mark[1] == writes.count \
                        and writes.untouched():
                    continue
            if not self._same(i, source):
                return True
        return False

    def keep(self, *sources):
        """Remember `sources` (reusing the copies' memory when the sizes match). The caller
        holds no array of a source blob then (it would count as held from outside)."""
        old = self.kept if self.kept is not None and len(self.kept) == len(sources) else [None] * len(sources)
        kept = []
        for s, k in zip(sources, old):
            if s is None:
                kept.append(None)
                continue
            if isinstance(s, Blob):
                if s.untouched():           # nothing outside may write it: the mark will do
                    kept.append((None, s.written()))
                    continue
                s = s.read_data
            elif not s.flags.writeable:
                kept.append((s, None))
                continue
            f = self._floats(s)
            c = k[0] if k is not None and k[0] is not None and k[0].flags.writeable else None
            if c is None or c.size != f.size:
                c = np.empty(f.size, np.float32)
            np.copyto(c, f)
            kept.append((c, None))
        self.kept = kept
