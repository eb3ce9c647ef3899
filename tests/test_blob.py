"""Blob storage: where the buffers begin. The kernels' 32-byte stores ran up to 20% slower into
NumPy's usual start, 16 bytes past a 64-byte line (half of them straddle two lines), so every
blob buffer and layer workspace starts on a line."""
import numpy as np
import pytest

from caffepy import memory
from caffepy.blob import CHANNELS_LAST, Blob
from caffepy.layers import conv_algorithms, nhwc, normalization


def _on_line(a):
    return a.ctypes.data % memory.LINE == 0


@pytest.mark.parametrize("n", [0, 1, 3, 1000, 3 << 20])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint8])
def test_line_arrays_start_on_a_line_and_have_the_asked_size(n, dtype):
    for make in (memory.line_zeros, memory.line_empty):
        a = make(n, dtype)
        assert a.shape == (n,) and a.dtype == dtype
        assert _on_line(a) or n == 0        # an empty view's address means nothing
    assert not memory.line_zeros(n, dtype).any()


@pytest.mark.skipif(not memory._HUGE_PAGES, reason="no madvise(MADV_HUGEPAGE) here")
def test_large_arrays_start_on_a_huge_page_and_the_kernel_is_asked_for_them():
    """From HUGE_FROM bytes an array has a mapping of its own, madvised for transparent huge
    pages, and starts on a 2 MB boundary: the kernel's zeros, writable, the asked size; the
    mapping lives as long as a view of it does. Below, NumPy's allocation on a line."""
    import re
    n = memory.HUGE_FROM // 4 + 5
    a = memory.line_empty(n)
    assert a.shape == (n,) and a.dtype == np.float32 and a.flags.writeable
    assert a.ctypes.data % memory.HUGE_PAGE == 0 and not a.any()
    a[-1] = 2.5
    start = a.ctypes.data
    with open("/proc/self/smaps") as f:
        maps = f.read().split("\n")
    for i, line in enumerate(maps):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= start < int(m.group(2), 16):
            flags = next(x for x in maps[i:] if x.startswith("VmFlags:"))
            assert " hg" in flags            # MADV_HUGEPAGE
            break
    else:
        raise AssertionError("no mapping holds the array")
    view = a[10:20]
    del a
    view[...] = 1.0                          # still mapped through the view
    small = memory.line_zeros(memory.HUGE_FROM // 4 - 1)
    assert _on_line(small) and small.base is not None and not isinstance(small.base, memory.mmap.mmap)


def test_blob_data_and_diff_start_on_a_line_through_growth_and_layouts():
    b = Blob((2, 3, 5, 7), "x")
    assert _on_line(b.data) and _on_line(b.diff) and not b.data.any() and not b.diff.any()
    b.reshape(16, 64, 56, 56)              # grows: fresh buffers
    assert _on_line(b.raw_data) and _on_line(b.raw_diff)
    b.layout = CHANNELS_LAST
    assert _on_line(b.raw_data) and _on_line(b.raw_diff) and b.raw_data.shape == (16, 56, 56, 64)
    b.data[...] = 1.5
    b.reshape(4, 64, 56, 56)               # shrinks: the same buffers, still on their line
    assert _on_line(b.raw_data) and np.all(b.data == 1.5)


def test_layer_workspaces_and_kept_buffers_start_on_a_line():
    class Holder:
        pass
    assert _on_line(nhwc._workspace("test_line", (3, 1001)))
    assert _on_line(conv_algorithms._workspace("test_line", (5, 17)))
    assert _on_line(normalization.kept_buffer(Holder(), "_kept", (7, 33)))


def test_grown_buffers_are_reused_and_only_grow():
    store = {}
    a = memory.grown(store, "w", (4, 8))
    a[...] = 7
    b = memory.grown(store, "w", (2, 3))                 # smaller: a view of the same buffer
    assert b.shape == (2, 3) and np.shares_memory(a, b) and np.all(b == 7)
    c = memory.grown(store, "w", (10, 10))               # larger: a fresh buffer, kept after
    assert c.shape == (10, 10) and not np.shares_memory(a, c) and _on_line(c)
    assert np.shares_memory(memory.grown(store, "w", (4, 8)), c)
    assert memory.grown(store, "i", (3,), np.int32).dtype == np.int32


def test_grown_views_are_kept_by_shape_until_the_buffer_grows():
    store, views = {}, {}
    a = memory.grown(store, "w", (4, 8), views=views)
    assert memory.grown(store, "w", (4, 8), views=views) is a          # the view made before
    b = memory.grown(store, "w", (2, 3), views=views)
    assert b is not a and np.shares_memory(a, b)
    c = memory.grown(store, "w", (10, 10), views=views)               # grown: the views go
    d = memory.grown(store, "w", (4, 8), views=views)
    assert d is not a and np.shares_memory(d, c) and not np.shares_memory(d, a)
    assert set(views["w"]) == {(10, 10), (4, 8)}
