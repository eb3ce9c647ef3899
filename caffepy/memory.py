"""Sizes checked before they are allocated.

A prototxt, a caffemodel or a mean file can ask for any size: num_output 2e9,
a batch of 1e9, dims whose product overflows 64 bits. Every such size is
counted with Python integers (no wraparound) and compared with the memory the
machine has available now (MemAvailable) before NumPy is asked for it, so the
answer is one line naming what needs how much, not a traceback. Only what
cannot fit is refused: there is no cap of our own.
"""
import math
import mmap
import os
import sys

import numpy as np

# Below this an allocation is not worth a look at /proc/meminfo.
_SMALL = 64 << 20


def available():
    """Bytes of memory available now (MemAvailable), or None when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def human(nbytes):
    """A byte count as text: 512 bytes, 3.1 GiB, 7.9e+09 EiB."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024
        if value < 1024 or unit == "EiB":
            return f"{value:.1f} {unit}" if value < 1e6 else f"{value:.3g} {unit}"


def count(shape):
    """The number of elements of `shape`, exact (Python integers do not overflow)."""
    return math.prod(int(d) for d in shape)


def dims_text(shape):
    return " x ".join(str(int(d)) for d in shape) if len(shape) else "a scalar"


def problem(nbytes, what):
    """Why `nbytes` for `what` (e.g. "blob 'fc' (10 x 20 floats)") cannot be allocated,
    or None when it can be tried. Callers raise it in their own shape (naming the
    layer and field, or the flag)."""
    if nbytes <= _SMALL:
        return None
    free = available()
    if free is not None and nbytes > free:
        return f"{what} needs {human(nbytes)}, more than the {human(free)} of memory available"
    if nbytes > sys.maxsize:
        return f"{what} needs {human(nbytes)}, more than this machine can address"
    return None


def size_field(param, shape):
    """(field, value): the field of a LayerParameter that most likely asked for
    `shape`, the one whose value is the offending dimension (a negative one, else
    the largest); (None, None) when no field holds one (the size came from the bottoms)."""
    dims = [int(d) for d in shape]
    wanted = [d for d in dims if d < 0] or sorted({d for d in dims if d > 1}, reverse=True)
    found = {}

    def walk(msg, prefix):
        for field, value in msg.ListFields():
            if field.name in ("blobs", "param", "loss_weight", "include", "exclude"):
                continue
            values = value if field.is_repeated else [value]
            if field.message_type is not None:
                for sub in values:
                    walk(sub, f"{prefix}{field.name}.")
            elif field.cpp_type in (field.CPPTYPE_INT32, field.CPPTYPE_INT64, field.CPPTYPE_UINT32,
                                    field.CPPTYPE_UINT64):
                for v in values:
                    found.setdefault(int(v), f"{prefix}{field.name}")

    walk(param, "")
    for d in wanted:
        if d in found:
            return found[d], d
    return None, None


# Where arrays the kernels stream through begin: NumPy's large arrays start 16 bytes past a
# 64-byte line, so half of the kernels' 32-byte stores would straddle two lines.
LINE = 64


def line_zeros(n, dtype=np.float32):
    """A zeroed 1-D array of n items that starts on a LINE-byte boundary."""
    return _on_line(np.zeros, n, dtype)


def line_empty(n, dtype=np.float32):
    """As line_zeros, not zeroed."""
    return _on_line(np.empty, n, dtype)


def _on_line(make, n, dtype):
    size = np.dtype(dtype).itemsize
    if n * size >= HUGE_FROM and _HUGE_PAGES:
        return _on_huge_pages(n, dtype)
    raw = make(n + LINE // size, dtype)
    skip = (-raw.ctypes.data % LINE) // size
    return raw[skip:skip + n]


# Arrays of HUGE_FROM bytes or more (blobs, workspaces and packed weights of a net, which a
# forward streams through once each) get a mapping of their own that asks the kernel for
# transparent huge pages. On 4 KB pages a kernel's first stores to an output that is out of
# the cache miss the TLB on every page, and under a hypervisor each miss walks two page
# tables: a 56 x 56 x 256 convolution output (3.2 MB) written cold took 0.63 ms, 0.45 on huge
# pages, as fast as into a warm one. NumPy asks for them only from 4 MB. Where the kernel
# gives none (THP off, not Linux) the mapping is ordinary memory. The zeros are the kernel's.
HUGE_PAGE = 2 << 20
HUGE_FROM = 1 << 20
_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("CAFFEPY_HUGE_PAGES", "1") != "0"


def _on_huge_pages(n, dtype):
    nbytes = n * np.dtype(dtype).itemsize
    # one huge page of slack so that the array can start on one (never touched, never resident)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    area = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(area, np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE
    return raw[skip:skip + nbytes].view(dtype)


def grown(store, key, shape, dtype=np.float32, views=None):
    """A `shape` view of store[key], a line-aligned buffer reused call after call: it grows to
    the largest shape asked for and never shrinks (a fresh 100 MB array per call costs more in
    page faults than filling it). With `views` (a dict of the caller's), the views made are
    kept there by key and shape until the buffer grows (a TEST forward asks its workspaces
    ~100 times, ~1 us each to make a view)."""
    made = views.get(key) if views is not None else None
    if made is not None and shape in made:
        return made[shape]
    count = math.prod(shape)          # not np.prod: this runs in every forward (~2 us)
    buf = store.get(key)
    if buf is None or buf.size < count:
        buf = store[key] = line_empty(max(count, 1), dtype)
        made = None
    view = buf[:count].reshape(shape)
    if views is not None:
        if made is None:
            made = views[key] = {}
        made[shape] = view
    return view
