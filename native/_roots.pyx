# cython: language_level=3, boundscheck=False, wraparound=False
"""The root table of the causal limits: per root, its pinned limits and how
many derived records its current minute accepted.

An open-addressing hash table (linear probing, at most half full) over
64-bit root ids.  :meth:`RootTable.admit` judges a batch of derived records
in order, one C loop: a record deeper than its root's pinned depth is
refused (spending nothing), one past its root's rate for the minute is
refused, the rest are accepted and counted (a root seen for the first time
is pinned with the limits in force).  Pins are small indices into the
caller's list of limits (``max_depths[pin]``, ``per_minutes[pin]``).

Layout: a byte per slot saying it is used (1 MB per million slots: probing
for a new root stays in cache) and one 24-byte entry per slot (root, minute,
count, pin: a root found or claimed touches one cache line, not one per
field).  The table holds the current minute's roots, far past the caches at
high rates; this layout cut a batch of 1024 new roots, growth included, from
~96 to ~59 us of CPU here.

Bounded: given ``max_roots``, :meth:`RootTable.admit` judges a batch in
chunks of at most a quarter of it, and before a chunk that would not fit
evicts the roots with the fewest derived records this minute (a root last
counted in an earlier minute has none) down to three quarters full, so the
table never holds more than ``max_roots`` roots (``2 * max_roots`` slots,
rounded up to a power of two, ~50 bytes per root) and evicts in bulk, one
pass per quarter of ``max_roots`` new roots.  An evicted root is forgotten:
its next derived record starts a fresh count (and is pinned with the limits
then in force), so a bounded table errs toward admitting, never refusing a
record the unbounded table would have accepted.  Roots deriving at a high
rate (a runaway chain) have the highest counts and are the last evicted.
Roots pinned with earlier limits (kept after a reload) are evicted only
when the table holds nothing else: pinned again with the current limits, a
tightened limit would apply to their chains, so the promise holds for them
while the table has room for them.  The probing helpers are ``noexcept``:
inside the ``nogil`` loop an exception check would take the GIL state per
record.

:func:`root_ids` hashes captured records' identities into their root ids.

Compiled without bounds checks: every entry point checks its arguments.
"""

import numpy as np
cimport numpy as cnp
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t

cnp.import_array()

include "_descriptor.pxi"

#: 2**64 / the golden ratio: the home slot's multiplier and splitmix64's increment.
cdef uint64_t _GOLDEN = 0x9E3779B97F4A7C15ULL
cdef uint64_t _MIX1 = 0xBF58476D1CE4E5B9ULL
cdef uint64_t _MIX2 = 0x94D049BB133111EBULL


cdef inline uint64_t _splitmix(uint64_t value) noexcept nogil:
    value = (value ^ (value >> 30)) * _MIX1
    value = (value ^ (value >> 27)) * _MIX2
    return value ^ (value >> 31)


cdef Py_ssize_t _slots_for(Py_ssize_t roots):
    """The table size (a power of two, at least 16) that holds ``roots`` at most half full."""
    cdef Py_ssize_t size = 16
    while size < 2 * roots:
        size *= 2
    return size


cdef inline Py_ssize_t _home(int64_t root, uint64_t mask) noexcept nogil:
    return <Py_ssize_t>((((<uint64_t>root) * _GOLDEN) >> 32) & mask)


cdef struct Entry:
    int64_t root
    int64_t minute
    uint32_t count
    int16_t pin


cdef class RootTable:
    """Roots -> (minute, count in that minute, pin index), at most half full."""

    cdef object _used_arr, _entries_arr
    cdef uint8_t[::1] _used
    cdef Entry *_entries
    cdef Py_ssize_t _size
    cdef uint64_t _mask
    cdef readonly unsigned long long evicted

    def __cinit__(self, Py_ssize_t capacity=1024):
        self._alloc(_slots_for(capacity))
        self.evicted = 0

    cdef _alloc(self, Py_ssize_t size):
        self._used_arr = np.zeros(size, dtype=np.uint8)
        # Read only where ``used`` says so: no need to zero.
        self._entries_arr = np.empty(size * sizeof(Entry), dtype=np.uint8)
        self._used = self._used_arr
        self._entries = <Entry *>cnp.PyArray_DATA(self._entries_arr)
        self._mask = <uint64_t>(size - 1)
        self._size = 0

    def __len__(self):
        return self._size

    @property
    def slots(self):
        """Slots allocated (a root takes one; at most half are used)."""
        return <Py_ssize_t>(self._mask + 1)

    @property
    def nbytes(self):
        """Bytes the table's arrays hold (the used bytes and the entries)."""
        return self._used_arr.nbytes + self._entries_arr.nbytes

    cdef inline Py_ssize_t _find(self, int64_t root) noexcept nogil:
        cdef Py_ssize_t at = _home(root, self._mask)
        while self._used[at]:
            if self._entries[at].root == root:
                return at
            at = <Py_ssize_t>((at + 1) & self._mask)
        return -1

    cdef inline Py_ssize_t _claim(self, int64_t root) noexcept nogil:
        cdef Py_ssize_t at = _home(root, self._mask)
        while self._used[at]:
            at = <Py_ssize_t>((at + 1) & self._mask)
        self._used[at] = 1
        self._entries[at].root = root
        self._size += 1
        return at

    cdef _rebuild(self, Py_ssize_t size, uint8_t[::1] keep):
        """Re-insert the kept entries (every one when ``keep`` is empty) into
        a table of ``size`` slots."""
        cdef uint8_t[::1] used = self._used
        cdef object old_arr = self._entries_arr  # alive until this returns
        cdef Entry *old = self._entries
        cdef Py_ssize_t i, at, n = used.shape[0]
        cdef bint every = keep.shape[0] == 0
        self._alloc(size)
        with nogil:
            for i in range(n):
                if used[i] and (every or keep[i]):
                    at = self._claim(old[i].root)
                    self._entries[at].minute = old[i].minute
                    self._entries[at].count = old[i].count
                    self._entries[at].pin = old[i].pin

    def entry(self, int64_t root):
        """``(minute, count, pin)`` of ``root``, or None."""
        cdef Py_ssize_t at = self._find(root)
        if at < 0:
            return None
        cdef Entry *e = &self._entries[at]
        return int(e.minute), int(e.count), int(e.pin)

    def admit(
        self,
        const int64_t[::1] roots,
        const int32_t[::1] depths,
        int64_t minute,
        int16_t current,
        const int64_t[::1] max_depths,
        const int64_t[::1] per_minutes,
        Py_ssize_t max_roots=0,
    ):
        """Judge derived records in order; returns ``(verdicts, max_depth,
        per_minute)``: per record 0 accepted, 1 too deep, 2 over rate, and the
        bounds it was judged by.  Accepted records are counted in ``minute``.
        ``max_roots`` (0: unbounded) bounds the roots held: the lowest-count
        ones are evicted to make room (see the module's docstring)."""
        cdef Py_ssize_t n = roots.shape[0]
        if depths.shape[0] != n:
            raise ValueError(f"{n} roots but {depths.shape[0]} depths")
        cdef Py_ssize_t pins = max_depths.shape[0]
        if per_minutes.shape[0] != pins or not 0 <= current < pins:
            raise ValueError(f"pin {current} outside the {pins} limits given")
        if max_roots < 0:
            raise ValueError(f"max_roots must be 0 (unbounded) or positive, found {max_roots}")
        verdicts_arr = np.zeros(n, dtype=np.uint8)
        depth_arr = np.empty(n, dtype=np.int64)
        rate_arr = np.empty(n, dtype=np.int64)
        cdef uint8_t[::1] verdicts = verdicts_arr
        cdef int64_t[::1] bound_depth = depth_arr
        cdef int64_t[::1] bound_rate = rate_arr
        cdef Py_ssize_t start = 0, stop
        cdef Py_ssize_t chunk = n if max_roots == 0 else max(1, max_roots // 4)
        cdef int16_t pin = 0
        cdef bint bad = False
        while start < n and not bad:
            stop = min(n, start + chunk)
            if max_roots and self._size + (stop - start) > max_roots:
                self._evict(max_roots - max(stop - start, max_roots // 4), minute, current, max_roots)
            # Room for every record to be a new root: the table never fills.
            if 2 * (self._size + stop - start) > <Py_ssize_t>(self._mask + 1):
                self._rebuild(_slots_for(self._size + stop - start), np.empty(0, dtype=np.uint8))
            bad = self._admit_chunk(
                roots, depths, start, stop, minute, current, max_depths, per_minutes,
                verdicts, bound_depth, bound_rate, &pin,
            )
            start = stop
        if bad:
            raise ValueError(f"a root is pinned with limits {pin}, not among the {pins} given")
        return verdicts_arr, depth_arr, rate_arr

    cdef bint _admit_chunk(
        self,
        const int64_t[::1] roots,
        const int32_t[::1] depths,
        Py_ssize_t start,
        Py_ssize_t stop,
        int64_t minute,
        int16_t current,
        const int64_t[::1] max_depths,
        const int64_t[::1] per_minutes,
        uint8_t[::1] verdicts,
        int64_t[::1] bound_depth,
        int64_t[::1] bound_rate,
        int16_t *bad_pin,
    ):
        """Judge records ``start:stop`` (the table has room for each to be a
        new root); True when a root is pinned outside the limits given."""
        cdef Py_ssize_t i, at, pins = max_depths.shape[0]
        cdef int16_t pin
        cdef int64_t used
        cdef bint bad = False
        cdef Entry *e
        with nogil:
            for i in range(start, stop):
                at = self._find(roots[i])
                pin = current if at < 0 else self._entries[at].pin
                if pin < 0 or pin >= pins:
                    bad_pin[0] = pin
                    bad = True
                    break
                bound_depth[i] = max_depths[pin]
                bound_rate[i] = per_minutes[pin]
                if depths[i] > max_depths[pin]:
                    verdicts[i] = 1
                    continue
                used = 0
                if at >= 0 and self._entries[at].minute == minute:
                    used = self._entries[at].count
                if used >= per_minutes[pin]:
                    verdicts[i] = 2
                    continue
                if at < 0:
                    at = self._claim(roots[i])
                    self._entries[at].pin = current
                e = &self._entries[at]
                e.minute = minute
                e.count = <uint32_t>(used + 1)
        return bad

    cdef _evict(self, Py_ssize_t keep, int64_t minute, int16_t current, Py_ssize_t max_roots):
        """Forget all but ``keep`` roots: first those pinned with the
        ``current`` limits, fewest derived records in ``minute`` first (a root
        last counted earlier has none); roots pinned with earlier limits only
        when no other is left.  The table shrinks to what ``max_roots`` needs
        if it was larger (a reload lowered it)."""
        cdef Py_ssize_t slots = <Py_ssize_t>(self._mask + 1)
        cdef Py_ssize_t i, k = 0
        cdef uint64_t count, older
        keep = max(keep, 0)
        where_arr = np.flatnonzero(self._used_arr)
        ranks_arr = np.empty(len(where_arr), dtype=np.uint64)
        cdef const int64_t[::1] where = where_arr
        cdef uint64_t[::1] ranks = ranks_arr
        with nogil:
            for k in range(where.shape[0]):
                i = where[k]
                count = self._entries[i].count if self._entries[i].minute == minute else 0
                if count > 0x7FFFFFFFULL:
                    count = 0x7FFFFFFFULL
                # The top bit: pinned with earlier limits.  Such a root, evicted,
                # would be pinned again with the current ones (a tightened
                # depth would then refuse its chain, which its own limits
                # allow); one pinned with the current limits only restarts its
                # count, which errs toward admitting.  So those go first.
                older = 1 if self._entries[i].pin != current else 0
                # Then the count, then a hash of the root: ties (most roots of
                # a flood have one record each) are broken at random, not by
                # slot.  Keeping the highest slots on a tie packed every
                # survivor into one end of the table, and after a few
                # evictions probing for a new root walked a cluster tens of
                # thousands of slots long (a 1024-root batch took 14 ms, not 25 us).
                ranks[k] = (
                    (older << 63)
                    | (count << 32)
                    | (_splitmix(<uint64_t>self._entries[i].root) & 0xFFFFFFFFULL)
                )
        keep_arr = np.zeros(slots, dtype=np.uint8)
        if 0 < keep < len(where_arr):
            # The ``keep`` highest ranks, in linear time.
            highest = np.argpartition(ranks_arr, len(where_arr) - keep)[len(where_arr) - keep:]
            keep_arr[where_arr[highest]] = 1
        elif keep >= len(where_arr):
            return
        self.evicted += <unsigned long long>(len(where_arr) - min(keep, len(where_arr)))
        self._rebuild(min(slots, _slots_for(max_roots)), keep_arr)

    def longest_probe(self):
        """The longest distance (in slots) from a held root's home slot to
        where it sits: how far a lookup may walk.  For tests and diagnosis;
        one pass over the table."""
        cdef Py_ssize_t i, home, distance, longest = 0
        cdef Py_ssize_t size = <Py_ssize_t>(self._mask + 1)
        with nogil:
            for i in range(size):
                if self._used[i]:
                    home = _home(self._entries[i].root, self._mask)
                    distance = (i - home) & <Py_ssize_t>self._mask
                    if distance > longest:
                        longest = distance
        return longest

    def sweep(self, int64_t minute, int16_t current, const int64_t[::1] retention):
        """Forget roots whose minute passed and that are pinned with ``current``,
        and roots pinned otherwise idle past ``retention[pin]`` minutes."""
        cdef Py_ssize_t i, size = <Py_ssize_t>(self._mask + 1)
        cdef Py_ssize_t pins = retention.shape[0]
        keep_arr = np.ones(size, dtype=np.uint8)
        cdef uint8_t[::1] keep = keep_arr
        cdef bint any_forgotten = False
        cdef int16_t pin
        for i in range(size):
            if not self._used[i]:
                continue
            pin = self._entries[i].pin
            if pin == current:
                keep[i] = self._entries[i].minute >= minute
            elif 0 <= pin < pins:
                keep[i] = self._entries[i].minute + retention[pin] >= minute
            if not keep[i]:
                any_forgotten = True
        if any_forgotten:
            self._rebuild(size, keep)


def root_ids(const Descriptor[::1] d):
    """The root id of each captured record: splitmix64's finaliser folded over
    its output_id, key, step, seq and timestamp_ns (each as a signed 64-bit
    value, arithmetic wrapping), one C pass."""
    cdef Py_ssize_t i, n = d.shape[0]
    out = np.empty(n, dtype=np.int64)
    cdef uint64_t[::1] h = out.view(np.uint64)
    cdef uint64_t v
    with nogil:
        for i in range(n):
            v = _GOLDEN
            v = _splitmix(v ^ (<uint64_t>(<int64_t>d[i].output_id) + _GOLDEN))
            v = _splitmix(v ^ (<uint64_t>d[i].key + _GOLDEN))
            v = _splitmix(v ^ (<uint64_t>d[i].step + _GOLDEN))
            v = _splitmix(v ^ (<uint64_t>d[i].seq + _GOLDEN))
            v = _splitmix(v ^ (<uint64_t>d[i].timestamp_ns + _GOLDEN))
            h[i] = v
    return out
