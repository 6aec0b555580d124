"""Causal limits: how far a chain of routes may derive records from one root.

A record a route emits and another route takes again is *derived*; every
record knows its **root** (the captured record its chain started from, a
64-bit id hashed from the root's descriptor identity) and its **depth** (0
for a root, its parent's depth + 1 for a derived record).  Two limits bound
every chain, cycles included:

- ``max_depth`` (default 32): a derived record deeper than that is refused;
- ``per_root_per_minute`` (default 128): at most that many derived records
  of one root are accepted per fixed UTC minute (``floor(t / 60)``); the
  next minute restores only this rate capacity, never depth.

A refused record is not accepted and spends no token of its root's minute.
A root's limits are *pinned* when its first derived record is accepted: a
later configuration (a reload) with other limits applies to new roots only.

Everything is batch-shaped: :class:`RootLedger` keeps its roots in sorted
numpy arrays and admits a whole batch of derived records with a handful of
vectorised operations, never a Python step per record.
"""

from __future__ import annotations

from typing import Literal

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.checks import Limit

Roots = npt.NDArray[np.int64]
Depths = npt.NDArray[np.int32]

#: Which limit refused a derived record.
LimitName = Literal["depth", "rate"]

#: Bounds of the limits (their own validators and config files use these).
CAUSAL_LIMITS: dict[str, Limit] = {
    "max_depth": Limit(1, 1024),
    "per_root_per_minute": Limit(1, 2**31),
    "retention_minutes": Limit(1, 7 * 24 * 60),
}


def _owner(_: object) -> str:
    return "causal limits"


@attrs.frozen(kw_only=True)
class CausalLimits:
    """The bounds every chain of derived records lives under.

    ``max_depth``: the deepest derived record accepted (a root is 0).
    ``per_root_per_minute``: derived records accepted per root per fixed UTC
    minute.  ``redact_payload``: refused records reach the dead-letter store
    without their payload (the default; the diagnostic keeps route, root,
    depth and limit).  ``retention_minutes``: how long a root's pinned limits
    are kept after its last accepted derived record (a root that derives
    again later is pinned anew, with the limits then in force).
    """

    max_depth: int = attrs.field(
        default=32, validator=CAUSAL_LIMITS["max_depth"].check(int, _owner)
    )
    per_root_per_minute: int = attrs.field(
        default=128, validator=CAUSAL_LIMITS["per_root_per_minute"].check(int, _owner)
    )
    redact_payload: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    retention_minutes: int = attrs.field(
        default=15, validator=CAUSAL_LIMITS["retention_minutes"].check(int, _owner)
    )


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(value: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps)."""
    value = (value ^ (value >> np.uint64(30))) * _MIX1
    value = (value ^ (value >> np.uint64(27))) * _MIX2
    return value ^ (value >> np.uint64(31))


def root_ids(descriptors: npt.NDArray[np.void]) -> Roots:
    """The root id of each captured (depth-0) record: a 64-bit hash of its
    identity (output_id, key, step, seq, timestamp_ns), so every route a record
    fans out to derives from the same root without anything stored per record."""
    with np.errstate(over="ignore"):
        h = np.full(len(descriptors), _GOLDEN, dtype=np.uint64)
        for field in ("output_id", "key", "step", "seq", "timestamp_ns"):
            column = descriptors[field].astype(np.int64).view(np.uint64)
            h = _mix(h ^ (column + _GOLDEN))
    return h.view(np.int64)


def root_hex(root: int) -> str:
    """A root id as operators see it: 16 hex digits."""
    return f"{root & (2**64 - 1):016x}"


@attrs.frozen
class Admission:
    """The ledger's answer for a batch of derived records: which are accepted,
    and for the rest which limit refused them (``depth`` first: a record too
    deep never reaches the rate check)."""

    accepted: npt.NDArray[np.bool_]
    too_deep: npt.NDArray[np.bool_]
    over_rate: npt.NDArray[np.bool_]
    #: Per record, the limits it was judged by (pinned for known roots).
    max_depth: npt.NDArray[np.int64]
    per_minute: npt.NDArray[np.int64]


class RootLedger:
    """Per root: its pinned limits and how many derived records its current
    minute accepted.  Sorted numpy arrays, looked up with ``searchsorted``.

    One ledger may outlive a configuration: hand it to the next generation's
    routing sink and roots in flight keep the limits they were pinned with.
    """

    def __init__(self) -> None:
        self._ids: Roots = np.empty(0, np.int64)
        self._minute = np.empty(0, np.int64)  # the minute `_count` counts in
        self._count = np.empty(0, np.int64)
        self._max_depth = np.empty(0, np.int64)
        self._per_minute = np.empty(0, np.int64)
        self._retention = np.empty(0, np.int64)
        self._swept_at: int | None = None

    def __len__(self) -> int:
        return len(self._ids)

    def pinned(self, root: int) -> CausalLimits | None:
        """The limits ``root`` was pinned with, or None (no derived record of it
        was accepted, or it was forgotten after ``retention_minutes``)."""
        i = int(np.searchsorted(self._ids, root))
        if i == len(self._ids) or self._ids[i] != root:
            return None
        return CausalLimits(
            max_depth=int(self._max_depth[i]),
            per_root_per_minute=int(self._per_minute[i]),
            retention_minutes=int(self._retention[i]),
        )

    def used(self, root: int, now: float) -> int:
        """Derived records of ``root`` accepted in the UTC minute of ``now``."""
        i = int(np.searchsorted(self._ids, root))
        if i == len(self._ids) or self._ids[i] != root:
            return 0
        return int(self._count[i]) if self._minute[i] == _minute_of(now) else 0

    def admit(self, roots: Roots, depths: Depths, now: float, limits: CausalLimits) -> Admission:
        """Judge derived records (in order) of ``roots`` at ``depths`` at UTC time
        ``now``; spend one token of its root's minute per accepted record and pin
        the ``limits`` of roots seen for the first time."""
        minute = _minute_of(now)
        self._sweep(minute)
        n = len(roots)
        ids = self._ids
        index = np.searchsorted(ids, roots)
        known = index < len(ids)
        known[known] = ids[index[known]] == roots[known]
        if len(ids):
            at = np.where(known, index, 0)
            max_depth = np.where(known, self._max_depth[at], limits.max_depth)
            per_minute = np.where(known, self._per_minute[at], limits.per_root_per_minute)
            used = np.where(known & (self._minute[at] == minute), self._count[at], 0)
        else:
            max_depth = np.full(n, limits.max_depth, dtype=np.int64)
            per_minute = np.full(n, limits.per_root_per_minute, dtype=np.int64)
            used = np.zeros(n, dtype=np.int64)
        too_deep = depths > max_depth
        # Rank of each record among the batch's in-depth records of its root,
        # in order: a stable sort by root, then the position within its run.
        candidates = np.flatnonzero(~too_deep)
        rank = np.zeros(n, dtype=np.int64)
        if len(candidates):
            order = candidates[np.argsort(roots[candidates], kind="stable")]
            sorted_roots = roots[order]
            starts = np.r_[True, sorted_roots[1:] != sorted_roots[:-1]]
            run_start = np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))
            rank[order] = np.arange(len(order)) - run_start
        over_rate = ~too_deep & (used + rank >= per_minute)
        accepted = ~too_deep & ~over_rate
        if accepted.any():
            self._spend(roots[accepted], minute, limits)
        return Admission(accepted, too_deep, over_rate, max_depth, per_minute)

    def _spend(self, roots: Roots, minute: int, limits: CausalLimits) -> None:
        unique, counts = np.unique(roots, return_counts=True)
        index = np.searchsorted(self._ids, unique)
        known = index < len(self._ids)
        known[known] = self._ids[index[known]] == unique[known]
        at = index[known]
        fresh_minute = self._minute[at] != minute
        self._count[at] = np.where(fresh_minute, 0, self._count[at]) + counts[known]
        self._minute[at] = minute
        new = unique[~known]
        if len(new):
            where = index[~known]
            self._ids = np.insert(self._ids, where, new)
            self._minute = np.insert(self._minute, where, minute)
            self._count = np.insert(self._count, where, counts[~known])
            self._max_depth = np.insert(self._max_depth, where, limits.max_depth)
            self._per_minute = np.insert(self._per_minute, where, limits.per_root_per_minute)
            self._retention = np.insert(self._retention, where, limits.retention_minutes)

    def _sweep(self, minute: int) -> None:
        """Forget roots idle for longer than their retention (once per minute)."""
        if self._swept_at == minute:
            return
        self._swept_at = minute
        keep = self._minute + self._retention >= minute
        if not keep.all():
            self._ids = self._ids[keep]
            self._minute = self._minute[keep]
            self._count = self._count[keep]
            self._max_depth = self._max_depth[keep]
            self._per_minute = self._per_minute[keep]
            self._retention = self._retention[keep]


def _minute_of(now: float) -> int:
    return int(now // 60)


class CausalLimitExceeded(Exception):
    """Derived records a causal limit refused: the error of their dead letter."""


@attrs.frozen(kw_only=True)
class CausalRefusal:
    """A diagnostic: derived records of one root that a limit refused.

    ``route``: the route whose output they were; ``targets``: the routes that
    would have taken them; ``root`` (16 hex digits), ``depth``; ``limit``:
    ``depth`` or ``rate``, ``bound`` its value for that root; ``records``:
    how many; ``at``: UTC seconds.
    """

    route: str
    targets: tuple[str, ...]
    root: str
    depth: int
    limit: LimitName
    bound: int
    records: int
    at: float

    @property
    def message(self) -> str:
        """One line naming route, root, depth and the limit."""
        what = (
            f"depth {self.depth} exceeds max_depth {self.bound}"
            if self.limit == "depth"
            else f"root over {self.bound} derived records per minute"
        )
        return (
            f"route {self.route!r} -> {', '.join(self.targets)}: {self.records} derived "
            f"record(s) of root {self.root} at depth {self.depth} refused: {what} [{self.limit}]"
        )


@attrs.frozen(kw_only=True)
class CausalSnapshot:
    """What the causal limits did: derived records accepted and refused (by
    limit), roots whose limits are pinned now, the limits new roots get, and
    the most recent refusals (newest last)."""

    limits: CausalLimits = attrs.Factory(CausalLimits)
    derived: int = 0
    refused_depth: int = 0
    refused_rate: int = 0
    pinned_roots: int = 0
    recent_refusals: tuple[CausalRefusal, ...] = ()
