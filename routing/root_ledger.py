"""The root ledger: per root, its pinned causal limits and its current minute's count.

A numpy open-addressing hash table (linear probing) over root ids: a batch
of derived records is looked up, judged and counted with vectorised probes,
never a Python step per record or per root.  Memory stays small: a root
pinned with the limits in force is forgotten once its minute has passed (it
would be pinned with the same limits again); a root pinned with *other*
limits (an older configuration) is kept for its ``retention_minutes`` after
its last accepted derived record, so roots in flight across a reload keep
theirs.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.causal import CausalLimits, Depths, Roots

_MIX = np.uint64(0x9E3779B97F4A7C15)
#: Probes still running when this few are left finish one by one.
_TAIL = 32
_SHIFT = np.uint64(32)


@attrs.frozen
class Admission:
    """The ledger's answer for a batch of derived records: which are accepted,
    and for the rest which limit refused them (``depth`` first: a record too
    deep never reaches the rate check, and spends no token)."""

    accepted: npt.NDArray[np.bool_]
    too_deep: npt.NDArray[np.bool_]
    over_rate: npt.NDArray[np.bool_]
    #: Per record, the limits it was judged by (pinned for known roots).
    max_depth: npt.NDArray[np.int64]
    per_minute: npt.NDArray[np.int64]


class RootLedger:
    """Per root: the limits it is pinned with and how many derived records its
    current minute accepted.

    One ledger may outlive a configuration: hand it to the next generation's
    routing sink and roots in flight keep the limits they were pinned with.
    """

    def __init__(self, capacity: int = 1024) -> None:
        size = 1 << max(4, (capacity - 1).bit_length())
        self._alloc(size)
        self._count_used = 0
        #: Distinct limits roots were pinned with; entries hold an index here.
        self._limits: list[CausalLimits] = []
        self._limit_index: dict[CausalLimits, int] = {}
        self._swept_at: int | None = None

    def _alloc(self, size: int) -> None:
        self._used = np.zeros(size, dtype=bool)
        self._keys = np.zeros(size, dtype=np.int64)
        self._minute = np.zeros(size, dtype=np.int64)
        self._count = np.zeros(size, dtype=np.int64)
        self._pin = np.zeros(size, dtype=np.int16)

    def __len__(self) -> int:
        return self._count_used

    # -- lookup -------------------------------------------------------------------

    def _home(self, roots: Roots) -> npt.NDArray[np.intp]:
        mask = np.uint64(len(self._keys) - 1)
        with np.errstate(over="ignore"):
            h = roots.view(np.uint64) * _MIX
        return ((h >> _SHIFT) & mask).astype(np.intp)

    def _find(self, roots: Roots) -> npt.NDArray[np.intp]:
        """The slot of each root, or -1 (vectorised linear probing)."""
        n = len(roots)
        found = np.full(n, -1, dtype=np.intp)
        slot = self._home(roots)
        pending = np.arange(n)
        mask = len(self._keys) - 1
        while len(pending) > _TAIL:
            s = slot[pending]
            used = self._used[s]
            hit = used & (self._keys[s] == roots[pending])
            found[pending[hit]] = s[hit]
            pending = pending[used & ~hit]
            slot[pending] = (slot[pending] + 1) & mask
        # The few still probing (long collision chains): a vectorised step per
        # probe would cost more than stepping each one here.
        used_flags, keys = self._used, self._keys
        for i in pending.tolist():
            at, key = int(slot[i]), int(roots[i])
            while used_flags[at]:
                if keys[at] == key:
                    found[i] = at
                    break
                at = (at + 1) & mask
        return found

    def _insert(self, roots: Roots) -> npt.NDArray[np.intp]:
        """Slots for ``roots`` (unique, none present), claimed."""
        if (self._count_used + len(roots)) * 2 > len(self._keys):
            self._grow(self._count_used + len(roots))
        n = len(roots)
        placed = np.full(n, -1, dtype=np.intp)
        slot = self._home(roots)
        pending = np.arange(n)
        mask = len(self._keys) - 1
        while len(pending) > _TAIL:
            s = slot[pending]
            free = ~self._used[s]
            # Two roots may reach one free slot in the same step: the first takes it.
            _, first = np.unique(s[free], return_index=True)
            winners = pending[free][first]
            won = s[free][first]
            self._used[won] = True
            self._keys[won] = roots[winners]
            placed[winners] = won
            pending = pending[placed[pending] < 0]
            slot[pending] = (slot[pending] + 1) & mask
        used_flags, keys = self._used, self._keys
        for i in pending.tolist():  # the tail of long chains, one by one (see _find)
            at = int(slot[i])
            while used_flags[at]:
                at = (at + 1) & mask
            used_flags[at] = True
            keys[at] = roots[i]
            placed[i] = at
        self._count_used += n
        return placed

    def _grow(self, needed: int) -> None:
        keep = np.flatnonzero(self._used)
        keys, minute = self._keys[keep], self._minute[keep]
        count, pin = self._count[keep], self._pin[keep]
        size = len(self._keys)
        while needed * 2 > size:
            size *= 2
        self._alloc(size)
        self._count_used = 0
        at = self._insert(keys)
        self._minute[at], self._count[at], self._pin[at] = minute, count, pin

    # -- what others read ---------------------------------------------------------------

    def pinned(self, root: int) -> CausalLimits | None:
        """The limits ``root`` is pinned with, or None (no derived record of it
        was accepted, or it was forgotten)."""
        at = int(self._find(np.array([root], dtype=np.int64))[0])
        return None if at < 0 else self._limits[int(self._pin[at])]

    def used(self, root: int, now: float) -> int:
        """Derived records of ``root`` accepted in the UTC minute of ``now``."""
        at = int(self._find(np.array([root], dtype=np.int64))[0])
        if at < 0 or self._minute[at] != _minute_of(now):
            return 0
        return int(self._count[at])

    # -- admission ------------------------------------------------------------------

    def admit(self, roots: Roots, depths: Depths, now: float, limits: CausalLimits) -> Admission:
        """Judge derived records (in order) of ``roots`` at ``depths`` at UTC time
        ``now``; spend one token of its root's minute per accepted record and pin
        ``limits`` on roots not pinned yet."""
        minute = _minute_of(now)
        current = self._pin_index(limits)
        self._sweep(minute, current)
        n = len(roots)
        roots = np.ascontiguousarray(roots, dtype=np.int64)
        at = self._find(roots)
        known = at >= 0
        safe = np.where(known, at, 0)
        pins = np.where(known, self._pin[safe], current)
        max_depth = self._max_depths[pins]
        per_minute = self._per_minutes[pins]
        used = np.where(known & (self._minute[safe] == minute), self._count[safe], 0)
        too_deep = depths > max_depth
        # Rank of each record among the batch's in-depth records of its root,
        # in order: a stable sort by root, then the position within its run.
        candidates = np.flatnonzero(~too_deep)
        rank = np.zeros(n, dtype=np.int64)
        if len(candidates):
            order = candidates[np.argsort(roots[candidates], kind="stable")]
            ordered = roots[order]
            starts = np.r_[True, ordered[1:] != ordered[:-1]]
            run_start = np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))
            rank[order] = np.arange(len(order)) - run_start
        over_rate = ~too_deep & (used + rank >= per_minute)
        accepted = ~too_deep & ~over_rate
        if accepted.any():
            self._spend(roots[accepted], minute, current)
        return Admission(accepted, too_deep, over_rate, max_depth, per_minute)

    def _pin_index(self, limits: CausalLimits) -> int:
        index = self._limit_index.get(limits)
        if index is None:
            index = len(self._limits)
            self._limits.append(limits)
            self._limit_index[limits] = index
            self._max_depths = np.array([x.max_depth for x in self._limits], np.int64)
            self._per_minutes = np.array([x.per_root_per_minute for x in self._limits], np.int64)
            self._retention = np.array([x.retention_minutes for x in self._limits], np.int64)
        return index

    def _spend(self, roots: Roots, minute: int, current: int) -> None:
        unique, counts = np.unique(roots, return_counts=True)
        at = self._find(unique)
        new = at < 0
        if new.any():
            fresh = self._insert(unique[new])
            self._pin[fresh] = current
            self._minute[fresh] = minute
            self._count[fresh] = 0
            at = self._find(unique)  # the insert may have grown the table: slots moved
        stale = self._minute[at] != minute
        self._count[at] = np.where(stale, 0, self._count[at]) + counts
        self._minute[at] = minute

    def _sweep(self, minute: int, current: int) -> None:
        """Once a minute: forget roots whose minute passed and that are pinned with
        the limits in force, and roots pinned otherwise idle past their retention."""
        if self._swept_at == minute:
            return
        self._swept_at = minute
        used = np.flatnonzero(self._used)
        if not len(used):
            return
        pins = self._pin[used]
        last = self._minute[used]
        forget = np.where(pins == current, last < minute, last + self._retention[pins] < minute)
        if forget.any():
            keep = used[~forget]
            keys, kept_minute = self._keys[keep], self._minute[keep]
            count, pin = self._count[keep], self._pin[keep]
            self._alloc(len(self._keys))
            self._count_used = 0
            at = self._insert(keys)
            self._minute[at], self._count[at], self._pin[at] = kept_minute, count, pin


def _minute_of(now: float) -> int:
    return int(now // 60)
