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


class Blob:
    def __init__(self, shape=(), name=""):
        self.name = name
        self._data_buf = np.zeros(0, np.float32)
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
            if self._diff_buf is not None:
                self._diff_buf = memory.line_zeros(count)
        if self._layout == CHANNELS_LAST and len(shape) != 4:
            self._refuse(shape, f"blob '{self.name}' is channels-last (N, H, W, C) and takes 4 axes, "
                         f"got {memory.dims_text(shape)}")
        self._shape = shape
        self._views()

    def _view(self, buf):
        """(memory-order array, Caffe-order view) of the first `count` floats of `buf`."""
        flat = buf[:memory.count(self._shape)]
        if self._layout == CHANNELS_LAST:
            n, c, h, w = self._shape
            raw = flat.reshape(n, h, w, c)
            return raw, raw.transpose(0, 3, 1, 2)
        raw = flat.reshape(self._shape)
        return raw, raw

    def _views(self):
        self._raw, self._data = self._view(self._data_buf)
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
        return self._data

    @property
    def diff(self):
        if self._diff is None:
            if self._diff_buf is None or self._diff_buf.size < self._data_buf.size:
                why = memory.problem(self._data_buf.size * 4, f"the diff of blob '{self.name}' "
                                     f"({memory.dims_text(self._shape)} floats)")
                if why:
                    self._refuse(self._shape, why)
                self._diff_buf = memory.line_zeros(self._data_buf.size)
            self._raw_diff, self._diff = self._view(self._diff_buf)
        return self._diff

    @property
    def raw_data(self):
        """The data as stored (C-contiguous): `data` itself but for a channels-last blob."""
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
        self._data_buf = other._data_buf
        self._raw, self._data = self._view(self._data_buf)

    def share_diff(self, other):
        """Make this blob's diff a view of `other`'s, as share_data."""
        self._may_share(other, "diff")
        other.diff  # allocate on the owner so both see one buffer
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
        self._raw_diff, self._diff = self._view(flat)

    def set_data(self, array):
        """Copy `array` in, reshaping to its shape."""
        array = np.asarray(array, dtype=np.float32)
        self.reshape(array.shape)
        self._data[...] = array

    def __repr__(self):
        return f"Blob({self.name!r}, shape={self._shape})"


class Seen:
    """Copies of the arrays a derived value was computed from (weights reordered or
    Winograd-transformed for a kernel, BatchNorm folded into a convolution, int8 weights), so
    that the value is redone only when one of their floats changes. Whole contents are compared,
    bit for bit (memcmp: ~5 us per 100,000 floats), since pycaffe code writes `.data` arrays
    in place without a signal; a reorder of conv3 of cifar10_quick (64 x 32 x 5 x 5) took 20 us
    against the compare's 4, a Winograd transform of 512 x 512 x 3 x 3 weights 4 ms against 0.3.
    Arrays of other 4- or 8-byte dtypes (a float64 eps) are compared as their bytes."""

    def __init__(self):
        self.copies = None

    @staticmethod
    def _floats(a):
        a = np.ascontiguousarray(a).reshape(-1)
        return a if a.dtype == np.float32 else a.view(np.float32)

    def changed(self, *arrays):
        """Whether any of `arrays` (None allowed) differs from what the last `keep` saw."""
        from .kernels import nhwc
        return self.copies is None or len(arrays) != len(self.copies) or not all(
            (a is None) == (c is None) and (a is None or nhwc.same_floats(self._floats(a), c))
            for a, c in zip(arrays, self.copies))

    def keep(self, *arrays):
        """Remember `arrays`' contents (reusing the copies' memory when the sizes match)."""
        old = self.copies if self.copies is not None and len(self.copies) == len(arrays) else [None] * len(arrays)
        copies = []
        for a, c in zip(arrays, old):
            if a is None:
                copies.append(None)
                continue
            f = self._floats(a)
            if c is None or c.size != f.size:
                c = np.empty(f.size, np.float32)
            np.copyto(c, f)
            copies.append(c)
        self.copies = copies
