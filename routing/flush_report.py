"""What ``flush()`` returns: where every record accepted so far stands.

``flush()`` returns once every record accepted before it is in one of these
states: **delivered** (its route processed it, or forwarded it, and the
destination flushed the result: written, or durable in the destination's
spool; a spooling destination may still shed or refuse it afterwards,
counted per destination in ``shed_records`` / ``refused_records``),
**dead-lettered** (given up, handed to the failure handler),
**dropped** (discarded by an explicit, counted policy: a cancel, terminal
records with ``terminal_records = "drop"``), **given up** (left unfinished
by an unexpected failure, which is latched: the route's ``given_up``
counter) or **parked** (waiting for a retry, or behind a failing record of
its key).  Parked records are durable
when the routing sink has a park store (``parked_durable``): a crash then
loses none of them, and the next start retries them.  ``flush(wait=True)``
also waits until nothing is parked and every spool has drained.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class RouteAccount:
    """One route's records by state, counted since the routing sink started.

    ``accepted = delivered + dead_lettered + dropped + given_up + parked``
    once nothing is queued, which is what a flush guarantees.  Each field is
    the route's counter of the same meaning (``delivered``: ``processed``,
    ``dead_lettered``: ``failed``; ``given_up``: records an unexpected
    failure left unfinished, which latched it).  ``restored``: of
    ``accepted``, records a previous run left parked.
    """

    accepted: int
    delivered: int
    dead_lettered: int
    dropped: int
    parked: int
    restored: int = 0
    given_up: int = 0

    @property
    def settled(self) -> bool:
        """True when the states add up to what the route accepted."""
        return self.accepted == (
            self.delivered + self.dead_lettered + self.dropped + self.given_up + self.parked
        )


@attrs.frozen(kw_only=True)
class FlushReport:
    """Where every accepted record stands after a flush (see the module docstring).

    ``routes``: per route.  ``parked_durable``: parked records are in a park
    store.  ``spooled_bytes``: per destination with a spool, the bytes still
    in it (delivered as far as a flush is concerned: durable on local disk).
    ``unmatched_forwarded`` / ``unmatched_dropped``: records no route took.
    ``waited``: the flush waited for full delivery (``wait=True``).
    ``shed_records`` / ``refused_records``: per destination with a spool, the
    records it took from its routes (so ``delivered`` there) and then did not
    write, since the sink started: shed by its full spool's policy (dropped,
    or dead-lettered as ``spool_full``), or refused by the destination
    (dead-lettered as ``destination_refused``).
    """

    routes: dict[str, RouteAccount]
    parked_durable: bool
    spooled_bytes: dict[str, int]
    unmatched_forwarded: int
    unmatched_dropped: int
    waited: bool = False
    shed_records: dict[str, int] = attrs.field(factory=dict)
    refused_records: dict[str, int] = attrs.field(factory=dict)

    @property
    def parked(self) -> int:
        """Records parked on every route."""
        return sum(account.parked for account in self.routes.values())

    @property
    def fully_delivered(self) -> bool:
        """Nothing parked and no spool holding anything: all delivered or given up."""
        return self.parked == 0 and not any(self.spooled_bytes.values())


__all__ = ["FlushReport", "RouteAccount"]
