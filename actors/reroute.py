"""Rerouting dead letters: a copy of a given-up record sent to named routes only.

A copy bypasses the route table and the predicates: it goes to the routes the
operator named (checked to exist and to take the record's hook).  While the
copy is held, it stays linked to its dead letter, so a copy that fails again
is recorded against that letter (:meth:`Rerouter.copy_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import trio

from taproute.actors.route_actor import RouteActor
from taproute.actors.turnstile import Turnstile
from taproute.native import BufferLease
from taproute.routing.batch import RecordBatch, readonly_bytes, readonly_descriptors
from taproute.routing.errors import RerouteRefused, SinkClosed


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
    ) -> None:
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

    def from_thread(
        self,
        token: trio.lowlevel.TrioToken,
        nursery: trio.Nursery,
        descriptors: Any,
        payload: bytes,
        routes: tuple[str, ...],
        letter_id: int,
    ) -> None:
        """Send the copy from a thread other than the loop's (``token``), as a task
        of ``nursery``; returns once the routes took it."""
        try:
            on_loop = trio.lowlevel.current_trio_token() is token
        except RuntimeError:
            on_loop = False
        if on_loop:
            raise RuntimeError("reroute from the routing sink's own loop would wait for itself")
        done: Future[None] = Future()

        async def send() -> None:
            try:
                await self.send(descriptors, payload, routes, letter_id)
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
        self, descriptors: Any, payload: bytes, routes: tuple[str, ...], letter_id: int
    ) -> None:
        """On the loop: check the copy as a submitted batch, then hand it to ``routes``."""
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
                for route in routes:
                    await self.routes[route].dispatch(batch)
        finally:
            batch.lease.release()  # this call's own hold
