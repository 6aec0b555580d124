# cython: language_level=3
"""Batch updates of a K x N state region, without the GIL.

``np.add.at`` does the same job but walks the batch through numpy's generic
machinery (milliseconds for a few thousand 64-wide rows); these loops do it
in one pass with the GIL released, so owner actors of a stateful route run
truly in parallel.
"""

from libc.stdint cimport int64_t

ctypedef fused values_t:
    float
    double


def scatter_add(double[:, :] slots, const int64_t[::1] keys, const values_t[:, :] values):
    """``slots[keys[i]] += values[i]`` for every i, in order (keys may repeat).

    ``slots`` may be a column slice of a larger region (only its last
    dimension must be contiguous).  Raises IndexError for a key outside it.
    """
    cdef Py_ssize_t n = keys.shape[0]
    cdef Py_ssize_t width = values.shape[1]
    cdef Py_ssize_t rows = slots.shape[0]
    cdef Py_ssize_t i, j
    cdef int64_t k
    if values.shape[0] != n:
        raise ValueError(f"{n} keys but {values.shape[0]} value rows")
    if slots.shape[1] != width:
        raise ValueError(f"slots are {slots.shape[1]} wide, values {width}")
    for i in range(n):
        if keys[i] < 0 or keys[i] >= rows:
            raise IndexError(f"key {keys[i]} of row {i} outside [0, {rows})")
    with nogil:
        for i in range(n):
            k = keys[i]
            for j in range(width):
                slots[k, j] += values[i, j]
