"""What operators do to a running routing sink besides routing batches: end
keys (complete/cancel/reopen), send dead letters' copies back to routes, and
trace where a record would go.

:class:`SinkOperations` is that part of
:class:`~taproute.actors.routing_sink.RoutingSink`; the sink sets every
attribute it uses in its constructor and ``run``.  Key controls take the
sink's lock, so they are ordered with the batches submitted before them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from taproute.actors.owners import StatefulRoute
from taproute.actors.reloading import Reloading
from taproute.routing.errors import KeyNotHeld, SinkClosed
from taproute.routing.keys import KeyAction, request_keys
from taproute.routing.refusals import RefusalLog
from taproute.routing.root_ledger import RootLedger

if TYPE_CHECKING:
    from taproute.routing.trace import TraceResult


class SinkOperations(Reloading):
    """Key controls, dead letters' reroutes and tracing of a routing sink."""

    #: Recent records no route took, per hook, with each route's refusal.
    refusals: RefusalLog
    _token: trio.lowlevel.TrioToken | None

    @property
    def running(self) -> bool:
        """True while the sink runs (the sink says)."""
        raise NotImplementedError

    # -- rerouting dead letters ---------------------------------------------------

    def reroute_targets(self, hook: str, route: str) -> None:
        """Raise :class:`RerouteRefused` unless ``route`` exists and takes ``hook``."""
        self._rerouter.check_target(hook, route)

    def reroute_parks_in(self, route: str) -> Path | None:
        """The SQLite file a dead letter's copy for ``route`` is parked in before
        the route takes it (the letter's claim must be in the same file, to
        share the transaction), or None (kept in memory only)."""
        return self._rerouter.parks_copies_in(route)

    def reroute_from_thread(
        self,
        descriptors: Any,
        payload: bytes,
        routes: tuple[str, ...],
        *,
        letter_id: int,
        claim: Callable[[Any], object] | None = None,
    ) -> None:
        """Send a dead letter's copy to ``routes`` only (not through the route
        table nor predicates), from a thread other than the loop's; returns once
        the routes took it.  A copy that fails again is linked to ``letter_id``.

        ``claim(connection)`` (one route whose :meth:`reroute_parks_in` is the
        letter's file): marks the letter rerouted in the transaction that parks
        the copy, so a crash cannot leave a rerouted letter without its copy."""
        token, nursery = self._token, self._nursery
        if token is None or nursery is None or not self.running:
            raise SinkClosed("the routing sink is not running; reroute refused")
        self._rerouter.from_thread(token, nursery, descriptors, payload, routes, letter_id, claim)

    def trace(self, hook: str, **fields: Any) -> TraceResult:
        """Where a record of ``hook`` with these descriptor fields would go, and why.

        A dry run: route predicates run, nothing else (no processor, no write).
        What submission would refuse is refused first (an unbound hook; with
        ``length``, a payload size its ``layout`` does not allow).  A record no
        route takes comes back with its refusals and this sink's recent
        unmatched records of the hook.
        """
        # The dry-run module stays off the hot path.
        from taproute.routing.trace import trace_descriptor, traced_descriptor

        descriptors = traced_descriptor(self.hooks, self.schema, hook, **fields)
        gen = self._gen
        result = trace_descriptor(gen.plan, hook, descriptors, generation=gen.number)
        if not any(v.verdict == "match" for v in result.verdicts):
            result.recent_unmatched.extend(self.refusals.recent(hook))
        return result

    @property
    def causal_ledger(self) -> RootLedger:
        """The roots and their pinned limits (the same for every generation of
        this sink; a new sink given it keeps the limits of roots in flight)."""
        return self.causal.ledger

    # -- key lifecycle -------------------------------------------------------

    async def complete(self, *keys: int) -> None:
        """End ``keys`` on every stateful route, after the records of theirs
        submitted before: then each processor's ``finalize`` emits the key's
        final rows and its slot is cleared.  Later records of those keys are
        ``terminal`` until :meth:`reopen`.

        Returns once the completion is queued in order; :meth:`flush` waits for
        it (and its rows) to be done.  A key no stateful route holds (outside
        every route's range) raises :class:`KeyNotHeld`, and none of ``keys``
        is completed; so do :meth:`cancel` and :meth:`reopen`.
        """
        await self._key_control(KeyAction.COMPLETE, keys)

    async def cancel(self, *keys: int) -> None:
        """End ``keys`` on every stateful route now: their records still queued are
        discarded (counted ``cancelled_records``), their slots cleared without
        ``finalize``.  Later records of those keys are ``terminal``."""
        await self._key_control(KeyAction.CANCEL, keys)

    async def reopen(self, *keys: int) -> None:
        """Let completed or cancelled ``keys`` take records again (a reused id)."""
        await self._key_control(KeyAction.REOPEN, keys)

    async def _key_control(self, action: KeyAction, keys: tuple[int, ...]) -> None:
        self._check_open()
        request = np.array(request_keys(keys), dtype=np.int64)
        async with self._lock:
            gen = self._gen
            _refuse_unheld(action, request, [r for r in gen.routes if isinstance(r, StatefulRoute)])
            if any(isinstance(r, StatefulRoute) and r.planned.derived_from for r in gen.routes):
                # A stateful route that takes derived records gets them only once
                # the routes before it processed what was accepted before this
                # control: wait for that (nothing new is accepted meanwhile), so
                # a complete does not overtake them either.
                await self._in_flight.wait_idle()
            for route in gen.routes:
                if isinstance(route, StatefulRoute):
                    await route.key_control(action, request)


_DONE = {
    KeyAction.COMPLETE: "completed",
    KeyAction.CANCEL: "cancelled",
    KeyAction.REOPEN: "reopened",
}


def _refuse_unheld(action: KeyAction, request: Any, routes: list[StatefulRoute]) -> None:
    """Raise :class:`KeyNotHeld` if stateful routes exist and some request key
    maps outside every one's range, or to nothing (its key function raised for
    it: an id it does not know); each route ignores keys outside its own:
    another route may hold them; a key none holds is the caller's mistake.
    Without stateful routes a key control does nothing, as before."""
    if not routes or not len(request):
        return
    mapped = [(route, *route.mapped_keys(request)) for route in routes]
    held = np.zeros(len(request), dtype=bool)
    for route, keys, _ in mapped:
        if len(keys) != len(request):  # not one key per request key: cannot tell
            return
        held |= (keys >= 0) & (keys < route.key_range)
    if held.all():
        return
    bad = np.flatnonzero(~held)
    unique = list(dict.fromkeys(int(k) for k in request[bad]))
    shown = ", ".join(str(k) for k in unique[:5]) + (
        f" (and {len(unique) - 5} more)" if len(unique) > 5 else ""
    )
    first = int(bad[0])
    detail = "; ".join(
        f"route {route.name!r}'s key function raised {errors[first]!r} for {int(request[first])}"
        if first in errors
        else f"route {route.name!r} maps {int(request[first])} to {int(keys[first])}, "
        f"outside [0, {route.key_range})"
        for route, keys, errors in mapped
    )
    raise KeyNotHeld(
        f"{action}: key(s) {shown} held by no stateful route: {detail}; nothing was {_DONE[action]}"
    )


__all__ = ["SinkOperations"]
