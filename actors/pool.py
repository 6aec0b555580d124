"""Stateless routes: a pool of worker actors sharing one mailbox."""

from __future__ import annotations

from typing import Any

import trio

from taproute.actors.attempt import Attempt
from taproute.actors.mailbox import Mailbox
from taproute.actors.parking import restored_attempt
from taproute.actors.route_actor import RouteActor
from taproute.routing.batch import RecordBatch
from taproute.routing.parking import Restored


class StatelessRoute(RouteActor):
    """A pool of ``workers`` actors sharing one mailbox; processors run concurrently.

    A parked attempt comes back through the same mailbox, behind what arrived
    meanwhile: a stateless route promises no order.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route = self.planned.route
        self.mailbox: Mailbox[Attempt] = Mailbox(
            f"route {self.name}",
            capacity_records=route.capacity,
            capacity_bytes=route.capacity_bytes,
        )
        self.mailboxes = [self.mailbox]
        self._workers_left = 0
        self._workers_done = trio.Event()

    async def dispatch(self, batch: RecordBatch, *, wait: bool = True) -> None:
        if wait:
            await self.parked.wait_for_room()
        self.counters.accepted += len(batch)
        await self._enqueue(self.mailbox, Attempt(batch), batch, wait=wait)

    async def restore(self, restored: Restored) -> None:
        self.counters.accepted += len(restored.records)
        self.counters.restored += len(restored.records)
        await self._enqueue(self.mailbox, restored_attempt(restored), restored.records)

    async def run(self, nursery: trio.Nursery) -> None:
        self._workers_left = self.planned.route.workers
        self._workers_done = trio.Event()
        for _ in range(self.planned.route.workers):
            nursery.start_soon(self._worker)
        nursery.start_soon(self._retry_loop)

    async def _worker(self) -> None:
        while True:
            try:
                attempt = await self.mailbox.receive()
            except trio.EndOfChannel:
                self._workers_left -= 1
                if not self._workers_left:
                    self._workers_done.set()
                return
            try:
                await self._process(attempt)
            except Exception as exc:
                self._latch.latch(exc, route=self.name, where="stateless worker")
            finally:
                self._settle(attempt.batch)

    def _park(self, unit: Attempt, due: float) -> None:
        self.parked.schedule(due, unit)

    async def _retry_loop(self) -> None:
        await self.parked.run(self._retry)
        # A retry sent just before closing may fail and park again: what is
        # parked is final once the workers have drained the mailbox.
        await self._workers_done.wait()
        if self.handing_over:
            return  # retired by a reload: the sink hands what is parked to the successor
        for attempt in self.parked.drain():
            if self.parker.durable:  # closing: it stays parked for the next start
                self.parked.release(attempt)
            else:  # closing: give up what still waits
                await self._give_up(attempt)

    async def _retry(self, attempt: Attempt) -> None:
        attempt.scheduled = False
        try:
            await self._enqueue(self.mailbox, attempt, attempt.batch)
        finally:
            # The mailbox message now holds the buffer; no worker can see the
            # attempt before this runs (no checkpoint after the send).
            self.parked.release(attempt)
