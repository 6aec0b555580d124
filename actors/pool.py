"""Stateless routes: a pool of worker actors sharing one mailbox.

A batch the record worker hands over while the pool has nothing queued and a
worker idle, for a processor quick enough to run on the loop, is tried by the
record worker itself: a hop to a pool worker (a task wake-up and a scheduler
pass) costs a lone batch more than the call.  Only the call and the delivery
of its rows happen there; a failed call is queued for a pool worker, which
handles it by the route's failure policy exactly as it would its own.
"""

from __future__ import annotations

from typing import Any

import trio

from taproute.actors.attempt import Attempt, runs_inline
from taproute.actors.mailbox import Mailbox
from taproute.actors.parking import restored_attempt
from taproute.actors.route_actor import RESTORING, RouteActor
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
        #: Workers waiting on the mailbox with nothing to do.
        self._idle_workers = 0
        #: Attempts the record worker made itself, and how many of them failed
        #: (handed to a pool worker) -- for tests and profiles.
        self.made_here = 0
        self.failed_here = 0

    async def dispatch(self, batch: RecordBatch, *, wait: bool = True) -> None:
        if wait:
            await self.parked.wait_for_room()
        self.counters.accepted += len(batch)
        try:
            await self._enqueue(self.mailbox, Attempt(batch), batch, wait=wait)
        except Exception as exc:
            self._cut_dispatch(len(batch), [0], exc)

    async def dispatch_here(self, batch: RecordBatch) -> None:
        """Try ``batch`` in the calling task (the record worker) when the pool has
        nothing queued, a worker is idle and the processor runs on the loop;
        otherwise queue it as :meth:`dispatch` does.

        The same bookkeeping as a queued message (lease, in flight, backlog),
        so a flush waits for it and the counters read the same; the same
        backpressure (a full park waits first, delivering waits on a full
        destination).  A failed call is queued as is, for a pool worker to
        isolate, park or give up.
        """
        await self.parked.wait_for_room()
        self.counters.accepted += len(batch)
        attempt = Attempt(batch, tally=[0])
        if not (
            self._idle_workers
            and self.mailbox.idle
            and not self.handing_over
            and runs_inline(self.planned, self.placement)
        ):
            try:
                await self._enqueue(self.mailbox, attempt, batch)
            except Exception as exc:
                self._cut_dispatch(len(batch), [0], exc)
            return
        batch.lease.acquire()
        self._in_flight.add()
        self.counters.backlog += len(batch)
        self.made_here += 1
        try:
            outcome = await self._call(attempt)
            if outcome.code is None:
                await self._handle(attempt, outcome)
            else:
                self.failed_here += 1
                attempt.pending = outcome
                await self._enqueue(self.mailbox, attempt, batch)
        except Exception as exc:
            assert attempt.tally is not None
            self._count_given_up(len(batch), attempt.tally)
            self._latch.latch(exc, route=self.name, where="stateless attempt in the record worker")
        finally:
            self._settle(batch)

    async def restore(self, restored: Restored, *, copy: bool = False) -> None:
        self.counters.accepted += len(restored.records)
        if not copy:
            self.counters.restored += len(restored.records)
        try:
            await self._enqueue(self.mailbox, restored_attempt(restored), restored.records)
        except Exception as exc:
            self._cut_dispatch(len(restored.records), [0], exc, where=RESTORING)

    async def run(self, nursery: trio.Nursery) -> None:
        self._workers_left = self.planned.route.workers
        self._workers_done = trio.Event()
        for _ in range(self.planned.route.workers):
            nursery.start_soon(self._worker)
        nursery.start_soon(self._retry_loop)

    async def _worker(self) -> None:
        while True:
            self._idle_workers += 1
            try:
                attempt = await self.mailbox.receive()
            except trio.EndOfChannel:
                self._workers_left -= 1
                if not self._workers_left:
                    self._workers_done.set()
                return
            finally:
                self._idle_workers -= 1
            attempt.tally = tally = [0]
            try:
                if attempt.pending is not None:  # a failed call made by the record worker
                    outcome, attempt.pending = attempt.pending, None
                    await self._handle(attempt, outcome)
                else:
                    await self._process(attempt)
            except trio.Cancelled:  # a shutdown whose grace ran out: given up, counted
                self._count_cut(len(attempt.batch), tally)
                raise
            except Exception as exc:
                self._count_given_up(len(attempt.batch), tally)
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
