# cython: language_level=3
"""output_id -> route-set table and one-pass grouping of a batch by route.

Routes are numbered 0..n_routes-1 by the routing layer.  Each bound output_id
maps to a *route set* (the tuple of routes its hook name matches); distinct
sets are interned, so the per-record lookup is one array read.
"""

import threading

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int32_t, uint32_t

include "_descriptor.pxi"

cnp.import_array()

#: Route index used in :meth:`RouteTable.group` results for unmatched records.
UNMATCHED = -1

#: Output ids a table maps: ``0 .. MAX_OUTPUT_IDS - 1`` (hooks are numbered
#: densely from 0, and the table is an array indexed by output_id).
MAX_OUTPUT_IDS = 2**24


cdef class RouteTable:
    """Maps output_id to the set of routes it feeds.

    ``assign`` may be called at any time, from any thread (hooks bound after
    the table was built, by producer threads at once: ``HookRegistry`` calls
    its listeners outside its lock).  Assignments are serialised by a lock:
    each grows the table by a copy and interns route sets in several steps,
    between which numpy's Python-level helpers let another thread run (two
    concurrent ones lost an assignment, or copied the other's larger array).
    ``group`` holds the GIL for its whole run, and an assignment publishes a
    grown table and a new set before any output_id points at it, so ``group``
    never observes one half-done.
    """

    cdef readonly int n_routes
    cdef object _set_of          # int32[capacity]: output_id -> set id, -1 = unrouted
    cdef object _set_starts      # int32[n_sets + 1] CSR offsets into _set_routes
    cdef object _set_routes      # int32[...] route indices of every set, concatenated
    cdef list _sets              # set id -> tuple of route indices
    cdef dict _set_ids           # tuple of route indices -> set id
    cdef object _lock            # serialises assign (writers); readers hold the GIL

    def __init__(self, int n_routes):
        if n_routes < 0:
            raise ValueError(f"n_routes must be >= 0, got {n_routes}")
        self.n_routes = n_routes
        self._set_of = np.full(64, -1, dtype=np.int32)
        self._sets = []
        self._set_ids = {}
        self._set_starts = np.zeros(1, dtype=np.int32)
        self._set_routes = np.zeros(0, dtype=np.int32)
        self._lock = threading.Lock()

    def assign(self, uint32_t output_id, routes):
        """Route ``output_id`` (< :data:`MAX_OUTPUT_IDS`) to ``routes`` (route indices)."""
        if output_id >= MAX_OUTPUT_IDS:
            raise ValueError(f"output_id {output_id} outside [0, {MAX_OUTPUT_IDS})")
        key = tuple(sorted(set(int(r) for r in routes)))
        for r in key:
            if r < 0 or r >= self.n_routes:
                raise ValueError(f"route index {r} out of range [0, {self.n_routes})")
        cdef Py_ssize_t capacity
        with self._lock:
            capacity = len(self._set_of)
            if output_id >= capacity:
                grown = np.full(max(capacity * 2, output_id + 1), -1, dtype=np.int32)
                grown[:capacity] = self._set_of
                self._set_of = grown
            if not key:
                self._set_of[output_id] = -1
                return
            set_id = self._set_ids.get(key)
            if set_id is None:
                set_id = len(self._sets)
                self._sets.append(key)
                self._set_ids[key] = set_id
                self._set_routes = np.concatenate([self._set_routes, np.asarray(key, dtype=np.int32)])
                self._set_starts = np.append(self._set_starts, np.int32(len(self._set_routes)))
            self._set_of[output_id] = set_id

    def routes_of(self, uint32_t output_id):
        """The tuple of route indices ``output_id`` feeds (empty if none)."""
        if output_id >= len(self._set_of):
            return ()
        set_id = int(self._set_of[output_id])
        return () if set_id < 0 else self._sets[set_id]

    def group(self, const Descriptor[::1] descriptors):
        """Group one batch by route in a single pass over its descriptors' output_ids.

        Returns a list of ``(route_index, selection)`` pairs, in route order,
        with ``route_index == UNMATCHED`` (-1) for records no route takes.
        ``selection`` is ``None`` when the group is the whole batch (the common
        case of a batch from one hook: no index array is built) and otherwise
        an ``intp`` array of record positions in arrival order.
        """
        cdef Py_ssize_t n = descriptors.shape[0]
        if n == 0:
            return []
        cdef const int32_t[::1] set_of = self._set_of
        cdef Py_ssize_t capacity = set_of.shape[0]
        cdef Py_ssize_t i
        cdef uint32_t oid = descriptors[0].output_id
        cdef int32_t first = set_of[oid] if oid < capacity else -1
        cdef int32_t sid
        cdef bint uniform = True
        for i in range(1, n):
            oid = descriptors[i].output_id
            sid = set_of[oid] if oid < capacity else -1
            if sid != first:
                uniform = False
                break
        if uniform:
            if first < 0:
                return [(UNMATCHED, None)]
            return [(r, None) for r in self._sets[first]]
        return self._group_mixed(descriptors, set_of)

    cdef list _group_mixed(self, const Descriptor[::1] descriptors, const int32_t[::1] set_of):
        cdef Py_ssize_t n = descriptors.shape[0]
        cdef Py_ssize_t capacity = set_of.shape[0]
        cdef const int32_t[::1] starts = self._set_starts
        cdef const int32_t[::1] members = self._set_routes
        cdef Py_ssize_t slots = self.n_routes + 1   # last slot: unmatched
        counts_arr = np.zeros(slots, dtype=np.intp)
        cdef Py_ssize_t[::1] counts = counts_arr
        sids_arr = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] sids = sids_arr
        cdef Py_ssize_t i, j
        cdef uint32_t oid
        cdef int32_t sid
        for i in range(n):
            oid = descriptors[i].output_id
            sid = set_of[oid] if oid < capacity else -1
            sids[i] = sid
            if sid < 0:
                counts[slots - 1] += 1
            else:
                for j in range(starts[sid], starts[sid + 1]):
                    counts[members[j]] += 1
        # One flat index buffer, CSR-partitioned by route; each route's
        # selection is a slice (a view) of it.  Filled in a second linear scan.
        offsets_arr = np.zeros(slots + 1, dtype=np.intp)
        cdef Py_ssize_t[::1] offsets = offsets_arr
        cdef Py_ssize_t r
        for r in range(slots):
            offsets[r + 1] = offsets[r] + counts[r]
        flat_arr = np.empty(offsets[slots], dtype=np.intp)
        cdef Py_ssize_t[::1] flat = flat_arr
        fill_arr = offsets_arr[:slots].copy()
        cdef Py_ssize_t[::1] fill = fill_arr
        for i in range(n):
            sid = sids[i]
            if sid < 0:
                flat[fill[slots - 1]] = i
                fill[slots - 1] += 1
            else:
                for j in range(starts[sid], starts[sid + 1]):
                    r = members[j]
                    flat[fill[r]] = i
                    fill[r] += 1
        selections = [flat_arr[offsets[r]:offsets[r + 1]] for r in range(slots)]
        groups = []
        for r in range(self.n_routes):
            if counts[r]:
                groups.append((r, None if counts[r] == n else selections[r]))
        if counts[slots - 1]:
            groups.append((UNMATCHED, selections[slots - 1]))
        return groups
