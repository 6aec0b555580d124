"""Rerouting dead letters: a copy of a given-up record sent to named routes only.

A copy bypasses the route table and the predicates: it goes to the routes the
operator named (checked to exist and to take the record's hook).  While the
copy is held, it stays linked to its dead letter, so a copy that fails again
is recorded against that letter (:meth:`Rerouter.copy_of`).

With a park store in the dead-letter store's file, a copy for a route that
parks (stateless, stateful) is parked in the transaction that marks its
letter rerouted, before the route takes it: a crash while the route holds it
leaves it parked, and the next start delivers it like any parked record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import trio

from taproute.actors.forward import ForwardRoute
from taproute.actors.parking import Parker
from taproute.actors.route_actor import RouteActor
from taproute.actors.turnstile import Turnstile
from taproute.native import BufferLease
from taproute.routing.batch import RecordBatch, readonly_bytes, readonly_descriptors
from taproute.routing.errors import RerouteRefused, SinkClosed
from taproute.routing.failures import FailureCode
from taproute.routing.parking import Parking, Restored

#: ``claim(connection)``: mark the letter rerouted inside the park store's transaction.
Claim = Callable[[Any], object]


class Rerouter:
    """A routing sink's reroute path: checks targets, sends copies under the
    sink's submit lock, and links each copy (while held) to its dead letter.

    ``check_open`` raises when the sink takes no records; ``check`` refuses a
    batch that cannot be routed (the sink's batch check).  ``routes`` is set
    once the sink's route actors are built.
    """

    def __init__(
        self,
        *,
        lock: Turnstile,
        check_open: Callable[[], None],
        check: Callable[[RecordBatch], object],
        parker: Parker | None = None,
    ) -> None:
        self._parker = parker
        self._lock = lock
        self._check_open = check_open
        self._check = check
        self.routes: Mapping[str, RouteActor] = {}
        #: id(lease) of a rerouted letter's copy -> the letter's id, while it is held.
        self._copies: dict[int, int] = {}

    def copy_of(self, batch: RecordBatch) -> int | None:
        """The dead letter ``batch`` is a copy of, or None."""
        return self._copies.get(id(batch.lease)) if self._copies else None

    def check_target(self, hook: str, route: str) -> None:
        """Raise :class:`RerouteRefused` unless ``route`` exists and takes ``hook``."""
        actor = self.routes.get(route)
        if actor is None:
            raise RerouteRefused(
                f"route {route!r} is not in the running configuration (routes: "
                f"{', '.join(self.routes) or 'none'}); nothing would take the record"
            )
        if not actor.planned.matches(hook):
            raise RerouteRefused(f"route {route!r} does not take hook {hook!r}")

    def parks_copies_in(self, route: str) -> Path | None:
        """The SQLite file a copy for ``route`` would be parked in (its letter's
        claim must be in that file to share the transaction), or None: the
        copy is held in memory only (no park store, or a forward route)."""
        store = None if self._parker is None else self._parker.store
        if isinstance(self.routes.get(route), ForwardRoute) or not hasattr(store, "park_copy"):
            return None
        file = getattr(store, "file", None)
        return file if isinstance(file, Path) else None

    def from_thread(
        self,
        token: trio.lowlevel.TrioToken,
        nursery: trio.Nursery,
        descriptors: Any,
        payload: bytes,
        routes: tuple[str, ...],
        letter_id: int,
        claim: Claim | None = None,
    ) -> None:
        """Send the copy from a thread other than the loop's (``token``), as a task
        of ``nursery``; returns once the routes took it (``claim``: see :meth:`send`)."""
        try:
            on_loop = trio.lowlevel.current_trio_token() is token
        except RuntimeError:
            on_loop = False
        if on_loop:
            raise RuntimeError("reroute from the routing sink's own loop would wait for itself")
        done: Future[None] = Future()

        async def send() -> None:
            try:
                await self.send(descriptors, payload, routes, letter_id, claim)
            except BaseException as exc:
                done.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                done.set_result(None)

        def start() -> None:  # a run_sync_soon callback: must not raise
            try:
                nursery.start_soon(send)
            except BaseException as exc:  # the nursery is closed: the sink stopped
                done.set_exception(SinkClosed(f"the routing sink stopped; reroute refused ({exc})"))

        try:
            token.run_sync_soon(start)
        except trio.RunFinishedError:
            raise SinkClosed("the routing sink is not running; reroute refused") from None
        done.result()

    async def send(
        self,
        descriptors: Any,
        payload: bytes,
        routes: tuple[str, ...],
        letter_id: int,
        claim: Claim | None = None,
    ) -> None:
        """On the loop: check the copy as a submitted batch, then hand it to ``routes``.

        ``claim`` (one route, which :meth:`parks_copies_in` the letter's file):
        the copy is parked in the transaction ``claim`` marks the letter
        rerouted in, then handed to the route with its park ids."""
        self._check_open()
        copies = self._copies
        key = 0

        def forget() -> None:  # the copy is let go: forget its link
            copies.pop(key, None)

        lease = BufferLease(forget)
        key = id(lease)
        copies[key] = letter_id
        batch = RecordBatch(readonly_descriptors(descriptors), readonly_bytes(payload), lease)
        try:
            self._check(batch)
            async with self._lock:
                if claim is not None:
                    await self._park_and_restore(batch, routes, letter_id, claim)
                    return
                for route in routes:
                    await self.routes[route].dispatch(batch)
        finally:
            batch.lease.release()  # this call's own hold

    async def _park_and_restore(
        self, batch: RecordBatch, routes: tuple[str, ...], letter_id: int, claim: Claim
    ) -> None:
        (route,) = routes
        parker = self._parker
        assert parker is not None and parker.store is not None
        store: Any = parker.store
        parking = Parking(
            route=route,
            records=batch,
            code=FailureCode.HANDLER_FAILED,
            error=f"rerouted copy of dead letter {letter_id}",
            failures=0,
            first_failure_at=0.0,
            last_failure_at=0.0,
        )
        ids = await trio.to_thread.run_sync(store.park_copy, parker.run, parking, claim)
        now = time.time()
        await self.routes[route].restore(
            Restored(
                route=route,
                records=batch,
                ids=np.asarray(ids, dtype=np.int64),
                failures=0,
                first_failure_at=now,
                last_failure_at=now,
            ),
            copy=True,
        )
