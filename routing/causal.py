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

The ledger holds at most ``max_roots`` roots (default 65536, ~50 bytes
each): when full it evicts the roots with the fewest derived records this
minute, and an evicted root's count restarts (so the bound errs toward
admitting, never refusing more than an unbounded ledger would).

Everything is batch-shaped: the :class:`~taproute.routing.root_ledger.RootLedger`
keeps its roots in a numpy hash table and admits a whole batch of derived
records with a handful of vectorised operations, never a Python step per
record.
"""

from __future__ import annotations

from typing import Literal

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import DESCRIPTOR_DTYPE, native_root_ids
from taproute.routing.checks import Limit, config_check

Roots = npt.NDArray[np.int64]
Depths = npt.NDArray[np.int32]

#: Which limit refused a derived record.
LimitName = Literal["depth", "rate"]

#: Bounds of the limits (their own validators and config files use these).
CAUSAL_LIMITS: dict[str, Limit] = {
    "max_depth": Limit(1, 1024),
    "per_root_per_minute": Limit(1, 2**31),
    "retention_minutes": Limit(1, 7 * 24 * 60),
    # 2**26 roots is a ~3.4 GB table: past that a bound is no bound.
    "max_roots": Limit(16, 2**26),
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
    ``max_roots``: the most roots the ledger holds (its memory, ~50 bytes a
    root); when full, the roots with the fewest derived records this minute
    are evicted and counted, and an evicted root that derives again starts
    a fresh count under the limits then in force: the bound errs toward
    admitting (a root can pass ``per_root_per_minute`` in a minute it was
    evicted in), never toward refusing.  Roots deriving the most, a runaway
    chain's, are the last evicted.
    """

    max_depth: int = attrs.field(
        default=32, validator=CAUSAL_LIMITS["max_depth"].check(int, _owner)
    )
    per_root_per_minute: int = attrs.field(
        default=128, validator=CAUSAL_LIMITS["per_root_per_minute"].check(int, _owner)
    )
    redact_payload: bool = attrs.field(
        default=True,
        validator=config_check(
            attrs.validators.instance_of(bool), must="True or False", owner=_owner
        ),
    )
    retention_minutes: int = attrs.field(
        default=15, validator=CAUSAL_LIMITS["retention_minutes"].check(int, _owner)
    )
    max_roots: int = attrs.field(
        default=65536, validator=CAUSAL_LIMITS["max_roots"].check(int, _owner)
    )


def root_ids(descriptors: npt.NDArray[np.void]) -> Roots:
    """The root id of each captured (depth-0) record: a 64-bit hash of its
    identity (output_id, key, step, seq, timestamp_ns), so every route a record
    fans out to derives from the same root without anything stored per record.

    splitmix64's finaliser folded over the five fields, in one native pass
    (a numpy form of the same hash cost ~100 us per 1024 records here)."""
    return native_root_ids(np.ascontiguousarray(descriptors, dtype=DESCRIPTOR_DTYPE))


def root_hex(root: int) -> str:
    """A root id as operators see it: 16 hex digits."""
    return f"{root & (2**64 - 1):016x}"


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
    limit), roots whose limits are pinned now, roots evicted from the full
    ledger (``max_roots``; their counts restarted), the limits new roots
    get, and the most recent refusals (newest last)."""

    limits: CausalLimits = attrs.Factory(CausalLimits)
    derived: int = 0
    refused_depth: int = 0
    refused_rate: int = 0
    pinned_roots: int = 0
    evicted_roots: int = 0
    recent_refusals: tuple[CausalRefusal, ...] = ()
