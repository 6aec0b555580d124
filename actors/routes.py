"""Route actors: forward, stateless pool, stateful owners.

The record worker calls :meth:`dispatch` with the part of a batch that
matched the route.  A forward route hands it straight to its destination
actor; a stateless route queues it for a pool of workers; a stateful route
splits it by key owner and queues each part for that owner.  Processors run
in worker threads under the route's own ``CapacityLimiter``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from taproute.actors.counters import RouteCounters
from taproute.actors.destination import DestinationActor
from taproute.actors.latch import FailureLatch
from taproute.actors.mailbox import Mailbox
from taproute.actors.pending import InFlight
from taproute.native import StateRegion, partition_keys
from taproute.routing.batch import RecordBatch, RowBatch
from taproute.routing.errors import KeyOutOfRange, OutputLayoutMismatch
from taproute.routing.failures import FailureHandler, RecordFailure
from taproute.routing.plan import PlannedRoute
from taproute.routing.records import Records
from taproute.routing.validation import check_rows


class RouteActor:
    """What every route kind shares: its plan, counters and destination."""

    def __init__(
        self,
        planned: PlannedRoute,
        destination: DestinationActor,
        *,
        latch: FailureLatch,
        in_flight: InFlight,
        on_failure: FailureHandler,
        hook_name: Callable[[int], str] | None = None,
    ) -> None:
        self.planned = planned
        self._hook_name = hook_name
        self.name = planned.name
        self.destination = destination
        self.counters = RouteCounters(
            planned.name, planned.route.mode.value, planned.route.destination
        )
        self._latch = latch
        self._in_flight = in_flight
        self._on_failure = on_failure
        self.mailboxes: list[Mailbox[Any]] = []

    async def dispatch(self, batch: RecordBatch) -> None:
        """Take ``batch`` (this route's records of one ingress batch)."""
        raise NotImplementedError

    async def run(self, nursery: trio.Nursery) -> None:
        """Start the route's actors in ``nursery`` (forward routes have none)."""

    def close(self) -> None:
        """Close the route's mailboxes: its actors drain them, then exit."""
        for mailbox in self.mailboxes:
            mailbox.close()

    def snapshot(self) -> RouteCounters:
        """A detached copy of the counters."""
        self.counters.queue_depth = sum(m.records for m in self.mailboxes)
        return attrs.evolve(self.counters)

    def _fail(self, records: RecordBatch, error: BaseException) -> None:
        """Count and report records this route could not process."""
        self.counters.failed += len(records)
        failure = RecordFailure(
            self.name,
            self.planned.route.processor,
            error,
            records,
        )
        try:
            self._on_failure(failure)
        except Exception as exc:
            self._latch.latch(exc, route=self.name, where="failure handler")

    async def _emit(self, inputs: RecordBatch, result: object) -> bool:
        """Validate a processor's result and deliver it; a bad result fails the inputs."""
        if result is None:
            return True
        planned = self.planned
        assert planned.output_layout is not None and planned.processor is not None
        try:
            rows = check_rows(
                result, planned.output_layout, route=self.name, processor=planned.processor.name
            )
        except OutputLayoutMismatch as exc:
            self._fail(inputs, exc)
            return False
        if len(rows):
            self.counters.emitted += len(rows)
            await self.destination.deliver(
                self.name, RowBatch(self.name, planned.output_layout.name, rows)
            )
        return True

    async def _enqueue(self, mailbox: Mailbox[Any], message: Any, batch: RecordBatch) -> None:
        """Queue a message that holds ``batch``: lease, in-flight and backlog."""
        batch.lease.acquire()
        self._in_flight.add()
        self.counters.backlog += len(batch)
        try:
            await mailbox.send(message, records=len(batch), nbytes=batch.nbytes)
        except BaseException:
            self._settle(batch)
            raise

    def _settle(self, batch: RecordBatch) -> None:
        """Undo what :meth:`_enqueue` took, once its message is handled."""
        self.counters.backlog -= len(batch)
        try:
            batch.lease.release()
        except Exception as exc:
            self._latch.latch(exc, route=self.name, where="buffer release callback")
        finally:
            self._in_flight.done()

    async def _process(self, batch: RecordBatch, *args: Any) -> bool:
        """Run the processor on ``batch`` in a worker thread, then emit.

        Returns True when the records were processed and their output delivered.
        """
        planned = self.planned
        assert planned.processor is not None
        records = (
            Records(batch, planned.input_layout, self._hook_name) if planned.input_layout else batch
        )
        try:
            result = await trio.to_thread.run_sync(
                planned.processor.fn, records, *args, limiter=self.limiter
            )
        except Exception as exc:
            self._fail(batch, exc)
            return False
        if not await self._emit(batch, result):
            return False
        self.counters.processed += len(batch)
        return True

    limiter: trio.CapacityLimiter


class ForwardRoute(RouteActor):
    """Hands batches to the destination as they are: no copy, no actor hop of its own."""

    async def dispatch(self, batch: RecordBatch) -> None:
        self.counters.processed += len(batch)
        self.counters.emitted += len(batch)
        await self.destination.deliver(self.name, batch)


class StatelessRoute(RouteActor):
    """A pool of ``workers`` actors sharing one mailbox; processors run concurrently."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route = self.planned.route
        self.limiter = trio.CapacityLimiter(route.workers)
        self.mailbox: Mailbox[RecordBatch] = Mailbox(
            f"route {self.name}",
            capacity_records=route.capacity,
            capacity_bytes=route.capacity_bytes,
        )
        self.mailboxes = [self.mailbox]

    async def dispatch(self, batch: RecordBatch) -> None:
        await self._enqueue(self.mailbox, batch, batch)

    async def run(self, nursery: trio.Nursery) -> None:
        for _ in range(self.planned.route.workers):
            nursery.start_soon(self._worker)

    async def _worker(self) -> None:
        while True:
            try:
                batch = await self.mailbox.receive()
            except trio.EndOfChannel:
                return
            try:
                await self._process(batch)
            except Exception as exc:
                self._latch.latch(exc, route=self.name, where="stateless worker")
            finally:
                self._settle(batch)


class StatefulRoute(RouteActor):
    """``workers`` owner actors, each holding one contiguous key range of the
    route's K x N state; a key's records are processed by one owner, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route = self.planned.route
        spec = self.planned.processor
        assert spec is not None and spec.key_range is not None and spec.slot is not None
        self.key_function = spec.key
        self.key_range = spec.key_range
        self.limiter = trio.CapacityLimiter(route.workers)
        self.state = StateRegion(spec.key_range, spec.slot.shape, spec.slot.dtype, route.workers)
        self.owner_mailboxes: list[Mailbox[tuple[RecordBatch, npt.NDArray[np.int64]]]] = [
            Mailbox(
                f"route {self.name} owner {j}",
                capacity_records=route.capacity,
                capacity_bytes=route.capacity_bytes,
            )
            for j in range(route.workers)
        ]
        self.mailboxes = list(self.owner_mailboxes)
        self.counters.valid_slots = 0

    async def dispatch(self, batch: RecordBatch) -> None:
        try:
            keys = self._keys(batch)
        except Exception as exc:
            self._fail(batch, exc)
            return
        per_owner, bad = partition_keys(keys, self.key_range, len(self.owner_mailboxes))
        if bad is not None:
            first = int(bad[0])
            self._fail(
                batch.select(bad),
                KeyOutOfRange(
                    f"route {self.name!r}: key {int(keys[first])} of record {first} is outside "
                    f"[0, {self.key_range}); {len(bad)} record(s) not processed"
                ),
            )
        for owner, selection in enumerate(per_owner):
            if selection is None:
                continue
            part = batch if len(selection) == len(batch) else batch.select(selection)
            await self._enqueue(self.owner_mailboxes[owner], (part, keys[selection]), part)

    def _keys(self, batch: RecordBatch) -> npt.NDArray[np.int64]:
        assert self.key_function is not None
        keys = np.ascontiguousarray(self.key_function(batch.descriptors), dtype=np.int64)
        if keys.shape != (len(batch),):
            raise KeyOutOfRange(
                f"route {self.name!r}: key function returned shape {keys.shape}, "
                f"expected ({len(batch)},)"
            )
        return keys

    async def run(self, nursery: trio.Nursery) -> None:
        for mailbox in self.owner_mailboxes:
            nursery.start_soon(self._owner, mailbox)

    async def _owner(self, mailbox: Mailbox[tuple[RecordBatch, npt.NDArray[np.int64]]]) -> None:
        while True:
            try:
                batch, keys = await mailbox.receive()
            except trio.EndOfChannel:
                return
            try:
                if await self._process(batch, keys, self.state):
                    self.state.valid[keys] = True
            except Exception as exc:
                self._latch.latch(exc, route=self.name, where="stateful owner")
            finally:
                self._settle(batch)

    def snapshot(self) -> RouteCounters:
        self.counters.valid_slots = self.state.valid_slots
        return super().snapshot()
