# cython: language_level=3, boundscheck=False, wraparound=False
"""Blob write tracking's reference counts (caffepy/blob.py: Writes, Seen) without the
interpreter's loop: a TEST forward asks whether the weights it derived values from may have
changed at every unit (ResNet-50 b1: 106 Seen checks of 3 blobs each, 0.58 ms of a 25 ms
forward in Python). Writes measures its counts here too (root_refs, view_refs), so that each
count is taken the same way as the check takes it: the references this code holds itself are
the same constant on both sides.
"""
cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(object o)


def root_refs(writes):
    """The reference count of writes.root, as untouched() takes it."""
    cdef object root = writes.root
    return Py_REFCNT(root)


def view_refs(list views):
    """The reference counts of `views`, as untouched() takes them."""
    cdef list out = []
    cdef Py_ssize_t j
    cdef object v
    for j in range(len(views)):
        v = views[j]
        out.append(Py_REFCNT(v))
    return out


cdef inline bint _untouched(writes) except -1:
    cdef object root = writes.root
    cdef list views = writes.views
    cdef list refs = writes.view_refs
    cdef Py_ssize_t j
    cdef object v
    if Py_REFCNT(root) != <Py_ssize_t>writes.root_refs + len(views):
        return False
    for j in range(len(views)):
        v = views[j]
        if refs[j] is None or Py_REFCNT(v) != <Py_ssize_t>refs[j]:
            return False
    return True


def untouched(writes):
    """Whether only the blobs hold arrays of the buffer (Writes.untouched)."""
    return _untouched(writes)


def first_moved(list kept, tuple sources, blob_class, Py_ssize_t start):
    """The index of the first source from `start` on that Seen.changed must look at itself,
    or -1: every other one is None where None was kept, or a Blob whose kept write mark still
    stands (its Writes the same, its count unmoved) and that nothing outside holds."""
    cdef Py_ssize_t i
    cdef object source, entry, mark, writes
    for i in range(start, len(sources)):
        source = sources[i]
        entry = kept[i]
        if source is None and entry is None:
            continue
        if entry is None or type(source) is not blob_class:
            return i
        mark = (<tuple>entry)[1]
        if mark is None:
            return i
        writes = source._writes
        if (<tuple>mark)[0] is not writes or (<tuple>mark)[1] != writes.count \
                or not _untouched(writes):
            return i
    return -1
