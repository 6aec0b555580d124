# cython: language_level=3
"""key -> owner partitioning for stateful routes.

A stateful route's K keys are split into contiguous ranges, one per owner
actor: owner ``j`` owns keys ``k`` with ``k * n_owners // K == j``.  Contiguous
ranges keep each owner's slice of the K x N state region contiguous too.

The product ``k * n_owners`` is formed in 128 bits, so every ``int64`` key
and key range gives the exact owner (a 64-bit product overflows for keys
past ``2**63 / n_owners`` and, with bounds checks off, indexes out of the
result arrays).
"""

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int64_t

cnp.import_array()

cdef extern from *:
    """
    /* floor(k * n / range) for 0 <= k < range, 1 <= n <= range: the 128-bit
       product cannot overflow and the quotient is < n. */
    static inline Py_ssize_t taproute_owner(long long k, long long n, long long range) {
        return (Py_ssize_t)(((__int128)k * (__int128)n) / (__int128)range);
    }
    """
    Py_ssize_t taproute_owner(long long k, long long n, long long range) nogil


cdef _check_partition(int64_t key_range, Py_ssize_t n_owners):
    if key_range <= 0:
        raise ValueError(f"key_range must be > 0, got {key_range}")
    if n_owners <= 0 or n_owners > key_range:
        raise ValueError(f"n_owners must be in [1, key_range={key_range}], got {n_owners}")


def owner_of(int64_t key, int64_t key_range, Py_ssize_t n_owners):
    """The owner index of one key (for diagnostics and tests)."""
    _check_partition(key_range, n_owners)
    if key < 0 or key >= key_range:
        raise ValueError(f"key {key} outside [0, {key_range})")
    return taproute_owner(key, n_owners, key_range)


def partition_keys(const int64_t[::1] keys, int64_t key_range, Py_ssize_t n_owners):
    """Split record positions by owning actor, keeping arrival order.

    Returns ``(per_owner, out_of_range)``: ``per_owner[j]`` is an ``intp``
    array of positions into ``keys`` owned by owner ``j`` (``None`` if it has
    none), and ``out_of_range`` holds the positions whose key is outside
    ``[0, key_range)`` (``None`` if all are valid).  ``n_owners`` must be in
    ``[1, key_range]`` (a stateful route has at most one owner per key).
    """
    _check_partition(key_range, n_owners)
    cdef Py_ssize_t n = keys.shape[0]
    cdef Py_ssize_t slots = n_owners + 1   # last slot: out of range
    owner_arr = np.empty(n, dtype=np.intp)
    cdef Py_ssize_t[::1] owner = owner_arr
    counts_arr = np.zeros(slots, dtype=np.intp)
    cdef Py_ssize_t[::1] counts = counts_arr
    cdef Py_ssize_t i, o
    cdef int64_t k
    for i in range(n):
        k = keys[i]
        if k < 0 or k >= key_range:
            o = n_owners
        else:
            o = taproute_owner(k, n_owners, key_range)
        owner[i] = o
        counts[o] += 1
    offsets_arr = np.zeros(slots + 1, dtype=np.intp)
    cdef Py_ssize_t[::1] offsets = offsets_arr
    for o in range(slots):
        offsets[o + 1] = offsets[o] + counts[o]
    flat_arr = np.empty(n, dtype=np.intp)
    cdef Py_ssize_t[::1] flat = flat_arr
    fill_arr = offsets_arr[:slots].copy()
    cdef Py_ssize_t[::1] fill = fill_arr
    for i in range(n):
        o = owner[i]
        flat[fill[o]] = i
        fill[o] += 1
    per_owner = [flat_arr[offsets[o]:offsets[o + 1]] if counts[o] else None
                 for o in range(n_owners)]
    bad = flat_arr[offsets[n_owners]:] if counts[n_owners] else None
    return per_owner, bad
