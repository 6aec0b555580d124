# cython: language_level=3
"""One pass over a batch's descriptors checking what a producer submitted.

Returns the first problem as ``(code, record_index)``; the routing layer turns
it into an exception with a message.  No Python work per record.
"""

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t

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

    Per layout id ``l``: ``fixed_size[l] > 0`` means the payload is exactly that
    long; ``< 0`` that the layout cannot be a payload; ``0`` that it is ``tail_prefix[l]`` bytes plus a whole number of
    ``tail_element[l]``-byte elements.  With no layouts given (empty arrays)
    layouts are not checked.
    """
    cdef Py_ssize_t n = descriptors.shape[0]
    cdef Py_ssize_t n_layouts = fixed_size.shape[0]
    cdef Py_ssize_t i
    cdef int64_t off, length, fixed, prefix, element
    cdef int64_t total = 0
    cdef unsigned int layout
    for i in range(n):
        if descriptors[i].output_id >= bound_ids:
            return UNBOUND_OUTPUT_ID, i, total
        off = descriptors[i].offset
        length = descriptors[i].length
        if off < 0 or length < 0 or off > payload_size or length > payload_size - off:
            return RANGE_OUTSIDE_BUFFER, i, total
        total += length
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
