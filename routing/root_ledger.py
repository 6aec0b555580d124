"""The root ledger: per root, its pinned causal limits and its current minute's count.

The table itself is native (:class:`~taproute.native.RootTable`: open
addressing over root ids, a batch of derived records judged and counted in
one C loop, in order).  Memory stays small: a root pinned with the limits in
force is forgotten once its minute has passed (it would be pinned with the
same limits again); a root pinned with *other* limits (an older
configuration) is kept for its ``retention_minutes`` after its last accepted
derived record, so roots in flight across a reload keep theirs.

Bounded: the table holds at most the current limits' ``max_roots`` roots;
when full, the roots with the fewest derived records this minute are
evicted (counted in :attr:`RootLedger.evicted`) and start afresh if they
derive again, so memory is bounded by the table's size whatever the rate.
Roots pinned with earlier limits go only when nothing else is left (see
``taproute.native._roots``).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import RootTable
from taproute.routing.causal import CausalLimits, Depths, Roots

_ACCEPTED, _TOO_DEEP, _OVER_RATE = 0, 1, 2


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
        self._table = RootTable(capacity)
        #: Distinct limits roots were pinned with; the table holds an index here.
        self._limits: list[CausalLimits] = []
        self._limit_index: dict[CausalLimits, int] = {}
        self._max_depths = np.empty(0, np.int64)
        self._per_minutes = np.empty(0, np.int64)
        self._retention = np.empty(0, np.int64)
        self._swept_at: int | None = None

    def __len__(self) -> int:
        return len(self._table)

    @property
    def evicted(self) -> int:
        """Roots evicted because the ledger was full (``max_roots``)."""
        return int(self._table.evicted)

    @property
    def nbytes(self) -> int:
        """Bytes the ledger's table holds (bounded by ``max_roots``)."""
        return int(self._table.nbytes)

    def pinned(self, root: int) -> CausalLimits | None:
        """The limits ``root`` is pinned with, or None (no derived record of it
        was accepted, or it was forgotten)."""
        entry = self._table.entry(root)
        return None if entry is None else self._limits[entry[2]]

    def used(self, root: int, now: float) -> int:
        """Derived records of ``root`` accepted in the UTC minute of ``now``."""
        entry = self._table.entry(root)
        if entry is None or entry[0] != _minute_of(now):
            return 0
        return int(entry[1])

    def admit(self, roots: Roots, depths: Depths, now: float, limits: CausalLimits) -> Admission:
        """Judge derived records (in order) of ``roots`` at ``depths`` at UTC time
        ``now``; spend one token of its root's minute per accepted record and pin
        ``limits`` on roots not pinned yet.  The ledger holds at most
        ``limits.max_roots`` roots, evicting the lowest-count ones to make room."""
        minute = _minute_of(now)
        current = self._pin_index(limits)
        if self._swept_at != minute:  # once a minute: forget what is over
            self._swept_at = minute
            self._table.sweep(minute, current, self._retention)
        verdicts, max_depth, per_minute = self._table.admit(
            np.ascontiguousarray(roots, dtype=np.int64),
            np.ascontiguousarray(depths, dtype=np.int32),
            minute,
            current,
            self._max_depths,
            self._per_minutes,
            limits.max_roots,
        )
        return Admission(
            verdicts == _ACCEPTED,
            verdicts == _TOO_DEEP,
            verdicts == _OVER_RATE,
            max_depth,
            per_minute,
        )

    def _pin_index(self, limits: CausalLimits) -> int:
        index = self._limit_index.get(limits)
        if index is None:
            if len(self._limits) >= 2**15:
                raise OverflowError("more than 32768 distinct causal limits pinned")
            index = len(self._limits)
            self._limits.append(limits)
            self._limit_index[limits] = index
            self._max_depths = np.array([x.max_depth for x in self._limits], np.int64)
            self._per_minutes = np.array([x.per_root_per_minute for x in self._limits], np.int64)
            self._retention = np.array([x.retention_minutes for x in self._limits], np.int64)
        return index


def _minute_of(now: float) -> int:
    return int(now // 60)
