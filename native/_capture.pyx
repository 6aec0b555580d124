# cython: language_level=3
"""The tail of a capture hook in one native call: its payload and its descriptors.

A capture hook plans once per output shape and mask which bytes of the
output each record holds and their descriptor templates (:func:`plan_records`,
a plan shared by capture contexts alike in both); every call then needs those
bytes packed into a buffer (a pooled one, or a fresh one) and a fresh
descriptor array from the plan's template with its own output_id, capture
time, and its context's keys and step: :func:`capture_records` does both in
one call, instead of several Python operations (and torch views) on the
model's thread.  :func:`gather_ranges`, :func:`gather_address` and
:func:`stamped_copy` are its parts, for callers that need only one.
"""

cimport cython
import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t, uint16_t, uint32_t
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_REALTIME, clock_gettime, timespec

include "_descriptor.pxi"

cnp.import_array()

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)
    bint PyObject_GC_IsTracked(object op)

from taproute.native.descriptor import DESCRIPTOR_DTYPE

cdef object _DTYPE = DESCRIPTOR_DTYPE
cdef object _UINT8 = np.dtype(np.uint8)
cdef object _INT64 = np.dtype(np.int64)
cdef object _empty = np.empty


cdef inline bint _int64_vector(cnp.ndarray a):
    return (
        cnp.PyArray_NDIM(a) == 1
        and cnp.PyArray_TYPE(a) == cnp.NPY_INT64
        and cnp.PyArray_IS_C_CONTIGUOUS(a)
    )


def stamped_copy(
    cnp.ndarray template,
    uint32_t output_id,
    int64_t timestamp_ns,
    cnp.ndarray keys=None,
    int64_t step=0,
):
    """A new, read-only copy of ``template`` with every record's ``output_id``
    and ``timestamp_ns`` set, and with ``keys``: record ``i``'s ``key`` set to
    ``keys[i]`` and every record's ``step`` to ``step``.

    ``template`` must be a 1-D, C-contiguous array of ``DESCRIPTOR_DTYPE``
    and ``keys`` (when given) a 1-D, C-contiguous ``int64`` array of the same
    length (ValueError otherwise); the other fields are copied as they are.
    """
    if (
        cnp.PyArray_NDIM(template) != 1
        or not cnp.PyArray_IS_C_CONTIGUOUS(template)
        or (<object> cnp.PyArray_DESCR(template) is not _DTYPE and template.dtype != _DTYPE)
    ):
        raise ValueError(
            "stamped_copy needs a 1-D C-contiguous array of DESCRIPTOR_DTYPE, got "
            f"{template.dtype} with shape {(<object> template).shape}"
        )
    cdef Py_ssize_t i, n = cnp.PyArray_DIM(template, 0)
    cdef const int64_t* k = NULL
    if keys is not None:
        if not _int64_vector(keys) or cnp.PyArray_DIM(keys, 0) != n:
            raise ValueError(
                f"stamped_copy needs {n} keys as a 1-D C-contiguous int64 array, got "
                f"{keys.dtype} with shape {(<object> keys).shape}"
            )
        k = <const int64_t*> cnp.PyArray_DATA(keys)
    # A byte copy: numpy's own copy of a structured dtype goes field by field.
    cdef cnp.ndarray out = _empty(n, _DTYPE)
    cdef Descriptor* d = <Descriptor*> cnp.PyArray_DATA(out)
    memcpy(d, cnp.PyArray_DATA(template), n * sizeof(Descriptor))
    for i in range(n):
        d[i].output_id = output_id
        d[i].timestamp_ns = timestamp_ns
    if k != NULL:
        for i in range(n):
            d[i].key = k[i]
            d[i].step = step
    cnp.PyArray_CLEARFLAGS(out, cnp.NPY_ARRAY_WRITEABLE)
    return out


def plan_records(
    Py_ssize_t rows,
    int64_t row_bytes,
    int64_t per_token,
    int64_t positions,
    cnp.ndarray counts,
    cnp.ndarray starts,
    bint runs,
    uint16_t layout_id,
):
    """Which bytes of a captured ``(rows, ...)`` tensor each of its ``rows``
    records holds, and the descriptor templates for them, in one call.

    Without ``counts`` (None) each record is a whole row of ``row_bytes``.
    With them, record ``i`` is row ``i``'s ``counts[i]`` real positions of
    ``per_token`` bytes: from position ``starts[i]`` of its row of
    ``positions`` when ``runs``, else gathered back to back (the tensor
    holds only the real positions, row after row).

    Returns ``(offsets, lengths, covered, packed, in_source)``: the records'
    byte offsets and lengths in the tensor (int64), the bytes they cover,
    and two read-only ``DESCRIPTOR_DTYPE`` templates (``layout_id``, ``seq``
    0..rows-1, ``length``; ``offset`` back to back in ``packed``, as in the
    tensor in ``in_source``; every other field 0, stamped per call).
    ValueError when ``counts``/``starts`` are not ``rows`` int64 values or a
    record falls outside its row.
    """
    cdef Py_ssize_t i
    cdef const int64_t* c = NULL
    cdef const int64_t* st = NULL
    if rows < 0 or row_bytes < 0 or per_token < 0 or positions < 0:
        raise ValueError("rows, row_bytes, per_token and positions must be >= 0")
    if counts is not None:
        if not _int64_vector(counts) or cnp.PyArray_DIM(counts, 0) != rows:
            raise ValueError(f"counts must be {rows} int64 values")
        c = <const int64_t*> cnp.PyArray_DATA(counts)
        if runs:
            if starts is None or not _int64_vector(starts) or cnp.PyArray_DIM(starts, 0) != rows:
                raise ValueError(f"starts must be {rows} int64 values")
            st = <const int64_t*> cnp.PyArray_DATA(starts)
        for i in range(rows):
            if c[i] < 0 or c[i] > positions or (
                st != NULL and (st[i] < 0 or st[i] > positions - c[i])
            ):
                raise ValueError(f"row {i}: its real positions fall outside its {positions}")
    cdef cnp.ndarray offsets = _empty(rows, _INT64)
    cdef cnp.ndarray lengths = _empty(rows, _INT64)
    cdef cnp.ndarray packed = _empty(rows, _DTYPE)
    cdef cnp.ndarray in_source = _empty(rows, _DTYPE)
    cdef int64_t* off = <int64_t*> cnp.PyArray_DATA(offsets)
    cdef int64_t* length = <int64_t*> cnp.PyArray_DATA(lengths)
    cdef Descriptor* p = <Descriptor*> cnp.PyArray_DATA(packed)
    cdef Descriptor* q = <Descriptor*> cnp.PyArray_DATA(in_source)
    cdef int64_t at = 0
    memset(p, 0, rows * sizeof(Descriptor))
    for i in range(rows):
        if c == NULL:
            length[i] = row_bytes
            off[i] = i * row_bytes
        else:
            length[i] = c[i] * per_token
            off[i] = (i * positions + st[i]) * per_token if runs else at
        p[i].layout_id = layout_id
        p[i].seq = i
        p[i].offset = at
        p[i].length = length[i]
        at += length[i]
    memcpy(q, p, rows * sizeof(Descriptor))
    for i in range(rows):
        q[i].offset = off[i]
    cnp.PyArray_CLEARFLAGS(offsets, cnp.NPY_ARRAY_WRITEABLE)
    cnp.PyArray_CLEARFLAGS(lengths, cnp.NPY_ARRAY_WRITEABLE)
    cnp.PyArray_CLEARFLAGS(packed, cnp.NPY_ARRAY_WRITEABLE)
    cnp.PyArray_CLEARFLAGS(in_source, cnp.NPY_ARRAY_WRITEABLE)
    return offsets, lengths, at, packed, in_source


def gather_ranges(
    const unsigned char[::1] source,
    const int64_t[::1] offsets,
    const int64_t[::1] lengths,
    int64_t total,
):
    """``source[offsets[i] : offsets[i] + lengths[i]]`` for every ``i``, back to
    back in a new read-only ``uint8`` array of ``total`` bytes.

    Every range must lie inside ``source`` and the lengths must add up to
    ``total`` (ValueError otherwise, before anything is copied).  The copy
    keeps the GIL: it is short, and releasing it inside a forward pass would
    let another thread take it from the model.
    """
    cdef Py_ssize_t n = offsets.shape[0]
    cdef Py_ssize_t size = source.shape[0]
    if lengths.shape[0] != n:
        raise ValueError(f"{n} offsets but {lengths.shape[0]} lengths")
    return _gather(
        &source[0] if size else NULL,
        size,
        &offsets[0] if n else NULL,
        &lengths[0] if n else NULL,
        n,
        total,
    )


cdef int _check_ranges(
    int64_t size,
    const int64_t* offs,
    const int64_t* lens,
    Py_ssize_t n,
    int64_t total,
) except -1:
    """ValueError unless every range lies inside ``size`` bytes and the
    lengths add up to ``total``."""
    cdef Py_ssize_t i
    cdef int64_t sum = 0, off, length
    for i in range(n):
        off = offs[i]
        length = lens[i]
        if off < 0 or length < 0 or off > size or length > size - off:
            raise ValueError(
                f"range {i} [{off}, {off} + {length}) is outside the {size}-byte source"
            )
        sum += length
    if sum != total:
        raise ValueError(f"the ranges cover {sum} bytes, not {total}")
    return 0


cdef inline void _copy_ranges(
    unsigned char* dst,
    const unsigned char* src,
    const int64_t* offs,
    const int64_t* lens,
    Py_ssize_t n,
):
    cdef Py_ssize_t i
    cdef int64_t at = 0
    for i in range(n):
        if lens[i]:
            memcpy(dst + at, src + offs[i], lens[i])
        at += lens[i]


cdef cnp.ndarray _gather(
    const unsigned char* src,
    int64_t size,
    const int64_t* offs,
    const int64_t* lens,
    Py_ssize_t n,
    int64_t total,
):
    """The ranges checked, then copied back to back into a new read-only
    ``uint8`` array of ``total`` bytes: what both gathers do once they have
    their source and ranges as pointers."""
    _check_ranges(size, offs, lens, n, total)
    cdef cnp.ndarray out = _empty(total, _UINT8)
    _copy_ranges(<unsigned char*> cnp.PyArray_DATA(out), src, offs, lens, n)
    cnp.PyArray_CLEARFLAGS(out, cnp.NPY_ARRAY_WRITEABLE)
    return out


cdef inline bint _descriptor_vector(cnp.ndarray a):
    return (
        cnp.PyArray_NDIM(a) == 1
        and cnp.PyArray_IS_C_CONTIGUOUS(a)
        and (<object> cnp.PyArray_DESCR(a) is _DTYPE or a.dtype == _DTYPE)
    )


def capture_records(
    size_t address,
    int64_t size,
    cnp.ndarray offsets,
    cnp.ndarray lengths,
    int64_t total,
    cnp.ndarray into,
    cnp.ndarray template,
    uint32_t output_id,
    cnp.ndarray keys,
    int64_t step,
):
    """A capture hook's records in one call: ``(descriptors, payload)``.

    The payload is the ``size`` bytes at ``address`` (the ``data_ptr()`` of a
    contiguous CPU tensor the caller keeps alive for the call) gathered
    ``offsets[i] : offsets[i] + lengths[i]`` back to back, ``total`` bytes in
    all: into the first ``total`` bytes of ``into`` (a writable 1-D
    C-contiguous ``uint8`` array, e.g. a pooled buffer; the payload is a
    read-only view of it) or, when ``into`` is None, into a new read-only
    array.  The descriptors are a new read-only copy of ``template``
    (``DESCRIPTOR_DTYPE``, offsets back to back) with every record's
    ``output_id``, ``timestamp_ns`` (now, ``CLOCK_REALTIME`` as
    ``time.time_ns()``), ``key`` (``keys[i]``, int64) and ``step`` set.

    Everything is checked before a byte is copied (ValueError): the
    arrays' types and lengths, every range inside the source, the lengths
    adding up to ``total``, ``into`` large enough.  Keeps the GIL, as the
    other gathers do.
    """
    if not _int64_vector(offsets) or not _int64_vector(lengths):
        raise ValueError("offsets and lengths must be 1-D C-contiguous int64 arrays")
    cdef Py_ssize_t i, n = cnp.PyArray_DIM(offsets, 0)
    if cnp.PyArray_DIM(lengths, 0) != n:
        raise ValueError(f"{n} offsets but {cnp.PyArray_DIM(lengths, 0)} lengths")
    if not _descriptor_vector(template) or cnp.PyArray_DIM(template, 0) != n:
        raise ValueError(f"the template must be {n} descriptors (1-D, C-contiguous)")
    if not _int64_vector(keys) or cnp.PyArray_DIM(keys, 0) != n:
        raise ValueError(f"capture_records needs {n} keys as a 1-D C-contiguous int64 array")
    if address == 0 and size:
        raise ValueError("null address")
    cdef const int64_t* offs = <const int64_t*> cnp.PyArray_DATA(offsets)
    cdef const int64_t* lens = <const int64_t*> cnp.PyArray_DATA(lengths)
    _check_ranges(size, offs, lens, n, total)
    cdef cnp.ndarray payload
    if into is None:
        payload = _empty(total, _UINT8)
    else:
        if (
            cnp.PyArray_NDIM(into) != 1
            or cnp.PyArray_TYPE(into) != cnp.NPY_UINT8
            or not cnp.PyArray_IS_C_CONTIGUOUS(into)
            or not cnp.PyArray_ISWRITEABLE(into)
        ):
            raise ValueError("into must be a writable 1-D C-contiguous uint8 array")
        if cnp.PyArray_DIM(into, 0) < total:
            raise ValueError(f"into holds {cnp.PyArray_DIM(into, 0)} bytes, not {total}")
        payload = into[:total]
    _copy_ranges(
        <unsigned char*> cnp.PyArray_DATA(payload), <const unsigned char*> address, offs, lens, n
    )
    cnp.PyArray_CLEARFLAGS(payload, cnp.NPY_ARRAY_WRITEABLE)
    cdef timespec now
    clock_gettime(CLOCK_REALTIME, &now)
    cdef int64_t timestamp_ns = <int64_t> now.tv_sec * 1000000000 + now.tv_nsec
    cdef cnp.ndarray out = _empty(n, _DTYPE)
    cdef Descriptor* d = <Descriptor*> cnp.PyArray_DATA(out)
    cdef const int64_t* k = <const int64_t*> cnp.PyArray_DATA(keys)
    memcpy(d, cnp.PyArray_DATA(template), n * sizeof(Descriptor))
    for i in range(n):
        d[i].output_id = output_id
        d[i].timestamp_ns = timestamp_ns
        d[i].key = k[i]
        d[i].step = step
    cnp.PyArray_CLEARFLAGS(out, cnp.NPY_ARRAY_WRITEABLE)
    return out, payload


def gather_address(
    size_t address,
    int64_t size,
    cnp.ndarray offsets,
    cnp.ndarray lengths,
    int64_t total,
):
    """:func:`gather_ranges` over the ``size`` bytes at ``address``: the
    ``data_ptr()`` of a contiguous CPU tensor, which the caller keeps alive
    for the call.

    Skips the three views a tensor needs to become a ``uint8`` array (and
    the typed-memoryview set-up): a capture hook runs this once per call on
    the model's thread.  ``offsets`` and ``lengths`` must be 1-D C-contiguous
    ``int64`` arrays of one length; every range must lie inside the ``size``
    bytes and the lengths must add up to ``total`` (ValueError otherwise,
    before anything is copied).  Keeps the GIL, as :func:`gather_ranges` does.
    """
    if not _int64_vector(offsets) or not _int64_vector(lengths):
        raise ValueError("offsets and lengths must be 1-D C-contiguous int64 arrays")
    cdef Py_ssize_t n = cnp.PyArray_DIM(offsets, 0)
    if cnp.PyArray_DIM(lengths, 0) != n:
        raise ValueError(f"{n} offsets but {cnp.PyArray_DIM(lengths, 0)} lengths")
    if address == 0 and size:
        raise ValueError("null address")
    return _gather(
        <const unsigned char*> address,
        size,
        <const int64_t*> cnp.PyArray_DATA(offsets),
        <const int64_t*> cnp.PyArray_DATA(lengths),
        n,
        total,
    )


def untrack_acyclic(*objects):
    """Take ``objects`` out of the cyclic garbage collector's view; returns None.

    For objects that cannot be part of a reference cycle, as CPython itself
    untracks tuples and dicts that hold only atomic values: they are still
    freed by reference counting.  A capture hook's batch, its lease and its
    release callback are such objects (numpy arrays, ints, the pool's
    ``give_back`` bound to a buffer: nothing refers back to them).  Queued
    for up to a wake-up, they outlive two young collections and, tracked,
    were promoted to the oldest generation, three objects per hook call:
    enough to set off a full collection, which stops every thread for the
    whole heap (a model server's: hundreds of milliseconds), every few
    thousand calls.  Objects the collector does not track are skipped.
    """
    cdef object obj
    for obj in objects:
        if PyObject_GC_IsTracked(obj):
            PyObject_GC_UnTrack(<void*> obj)


@cython.no_gc
cdef class GiveBack:
    """``pool.give_back(buffer)`` when called: a pooled capture buffer's
    release callback.

    Not tracked by the cyclic garbage collector (one object per hook call,
    alive while its batch is; a pool never refers to its releases, so it
    cannot be part of a cycle), where a ``functools.partial`` and its
    argument tuple would be two tracked objects per call (see
    :func:`untrack_acyclic`).
    """

    cdef object _pool
    cdef object _buffer

    def __cinit__(self, pool, buffer):
        self._pool = pool
        self._buffer = buffer

    def __call__(self):
        return self._pool.give_back(self._buffer)
