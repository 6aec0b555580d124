# cython: language_level=3
"""One pass over a batch's descriptors checking what a producer submitted.

Returns the first problem as ``(code, record_index)``; the routing layer turns
it into an exception with a message.  No Python work per record.
"""

import numpy as np
cimport numpy as cnp
from libc.stdint cimport INT64_MAX, int64_t

include "_descriptor.pxi"

cnp.import_array()

#: Codes returned by :func:`check_descriptors`.
OK = 0
UNBOUND_OUTPUT_ID = 1
RANGE_OUTSIDE_BUFFER = 2
UNKNOWN_LAYOUT = 3
LENGTH_MISMATCH = 4
NOT_A_PAYLOAD_LAYOUT = 5


def check_descriptors(
    const Descriptor[::1] descriptors,
    int64_t payload_size,
    int64_t bound_ids,
    const int64_t[::1] fixed_size,
    const int64_t[::1] tail_prefix,
    const int64_t[::1] tail_element,
):
    """Check every record.

    Returns ``(code, index, total)``: the first bad record's code and index, or
    ``(OK, -1, total)`` with ``total`` the payload bytes the records cover.

    Per layout id ``l``: ``fixed_size[l] > 0`` means the payload is exactly
    that long; ``< 0`` that the layout cannot be a payload; ``0`` that it is
    ``tail_prefix[l]`` bytes plus a whole number of ``tail_element[l]``-byte
    elements.  With no layouts given (empty arrays) layouts are not checked.

    The three rule arrays must have one entry per layout, with prefixes and
    elements >= 0, and ``payload_size`` and ``bound_ids`` must be >= 0
    (ValueError otherwise).  ``total`` saturates at ``2**63 - 1``
    (overlapping ranges may cover more bytes than that).
    """
    cdef Py_ssize_t n = descriptors.shape[0]
    cdef Py_ssize_t n_layouts = fixed_size.shape[0]
    cdef Py_ssize_t i
    cdef int64_t off, length, fixed, prefix, element
    cdef int64_t total = 0
    cdef unsigned int layout
    if tail_prefix.shape[0] != n_layouts or tail_element.shape[0] != n_layouts:
        raise ValueError(
            f"rule arrays differ in length: fixed_size {n_layouts}, "
            f"tail_prefix {tail_prefix.shape[0]}, tail_element {tail_element.shape[0]}"
        )
    if payload_size < 0:
        raise ValueError(f"payload_size must be >= 0, got {payload_size}")
    if bound_ids < 0:
        raise ValueError(f"bound_ids must be >= 0, got {bound_ids}")
    for i in range(n_layouts):
        if tail_prefix[i] < 0 or tail_element[i] < 0:
            raise ValueError(
                f"layout {i}: tail_prefix and tail_element must be >= 0, got "
                f"{tail_prefix[i]} and {tail_element[i]}"
            )
    for i in range(n):
        if descriptors[i].output_id >= bound_ids:
            return UNBOUND_OUTPUT_ID, i, total
        off = descriptors[i].offset
        length = descriptors[i].length
        if off < 0 or length < 0 or off > payload_size or length > payload_size - off:
            return RANGE_OUTSIDE_BUFFER, i, total
        total = INT64_MAX if length > INT64_MAX - total else total + length
        if n_layouts == 0:
            continue
        layout = descriptors[i].layout_id
        if layout >= n_layouts:
            return UNKNOWN_LAYOUT, i, total
        fixed = fixed_size[layout]
        if fixed < 0:
            return NOT_A_PAYLOAD_LAYOUT, i, total
        if fixed > 0:
            if length != fixed:
                return LENGTH_MISMATCH, i, total
        else:
            prefix = tail_prefix[layout]
            element = tail_element[layout]
            if length < prefix or (element > 0 and (length - prefix) % element != 0):
                return LENGTH_MISMATCH, i, total
    return OK, -1, total


def back_to_back(const Descriptor[::1] descriptors, int64_t stride):
    """True when every record is ``stride`` bytes long and each starts where
    the one before it ended (the batch's rows are one strided view of its
    buffer); one pass, stopping at the first record that is not."""
    cdef Py_ssize_t i, n = descriptors.shape[0]
    if n == 0:
        return True
    cdef int64_t expected = descriptors[0].offset
    cdef bint ok = True
    with nogil:
        for i in range(n):
            if descriptors[i].length != stride or descriptors[i].offset != expected:
                ok = False
                break
            expected += stride
    return ok
