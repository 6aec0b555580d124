"""The producer's calls of :class:`~taproute.service.host.runtime.RecordRuntime`:
submit a batch (blocking, never waiting, bounded by ``max_block``, from a
capture hook, from asyncio) or a single record, and count what a producer
dropped or skipped.

Each checks what it is handed with the runtime's intake in the producer's own
thread and queues it on the ingress; none crosses into the loop itself.  A
mixin of ``RecordRuntime``, which sets the state declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from taproute.routing.batch import RecordBatch
from taproute.routing.intake import Intake
from taproute.service.host.ingress import Ingress, PendingOffer


class ProducerCalls:
    """The thread-safe submit verbs, queued on the ingress."""

    # Set by RecordRuntime (and Producer, for the intake).
    intake: Intake
    max_block: float | None
    _ingress: Ingress

    def submit_batch(
        self,
        descriptors: Any,
        payload: Any,
        release: Callable[[], object] | None = None,
    ) -> None:
        """Submit many records sharing one payload buffer, without copying it.

        ``release`` runs once, on the loop thread, after the last route and
        destination are done with the buffer.  A batch that fails validation
        is refused whole (and ``release`` is not called: the buffer is still
        the caller's); blocks while ingress is full.  An empty batch (no
        records) is a no-op: refused like any batch after close or a
        failure, otherwise counted nowhere and routed nowhere.  Without a
        ``release`` it is queued nowhere either and never waits; with one,
        the release still runs once, on the loop thread, after what was
        queued before it, and until then the batch takes one record's
        ingress room (it waits for room as a record does).
        """
        batch = self.intake.batch(descriptors, payload, release)
        if not self._nothing_to_queue(batch, release):
            self._ingress.put_batch(batch)

    def _nothing_to_queue(self, batch: RecordBatch, release: object) -> bool:
        """True for an empty batch without a release: a no-op, refused only
        after close or a failure (as any batch), queued nowhere."""
        if release is None and not len(batch):
            self._ingress.check_open()
            return True
        return False

    def try_submit_batch(
        self,
        descriptors: Any,
        payload: Any,
        release: Callable[[], object] | None = None,
    ) -> bool:
        """``submit_batch`` that never waits: False (nothing queued) when ingress is full.

        Under ``when_full="reject"`` a full ingress raises ``IngressFull`` (and
        counts the records rejected), as ``submit_batch`` does there.  Safe on
        the loop thread itself, where waiting for room would deadlock.
        """
        batch = self.intake.batch(descriptors, payload, release)
        return self._nothing_to_queue(batch, release) or self._ingress.try_put_batch(batch)

    def offer_batch(
        self,
        descriptors: Any,
        payload: Any,
        release: Callable[[], object] | None = None,
    ) -> bool:
        """``submit_batch`` that waits at most ``max_block`` seconds for ingress room.

        False when the wait ran out: nothing was queued (``release`` is not
        called; the buffer is still the caller's) and the records are counted
        as shed.  Without a ``max_block`` it waits as long as ``submit_batch``.
        The bound a model's capture hooks use, so telemetry never stalls the
        forward pass longer than the user configured.  It does not wake the
        loop itself: the batch waits at most the ingress ``wake_delay``.
        """
        batch = self.intake.batch(descriptors, payload, release)
        if self._nothing_to_queue(batch, release):
            return True
        return self._ingress.offer_batch(batch, self.max_block, defer_wake=True)

    def offer_captured(self, batch: RecordBatch) -> bool:
        """``offer_batch`` for a batch a capture hook built itself.

        Its descriptors come from the hook's record plan (bound output_id,
        the layout's id, ranges inside the copied buffer), right by
        construction, so it is queued without the intake's check: that pass
        would run on the model's thread, and nothing checks it later (the
        routing sink takes the runtime's batches as checked).  The capture
        tests run the intake's check over every kind of batch a hook builds.
        Same ``max_block`` bound and result as :meth:`offer_batch`.
        """
        return self._ingress.offer_batch(batch, self.max_block, defer_wake=True)

    def count_dropped(self, hook: str, reason: str, records: int) -> None:
        """Count ``records`` of ``hook`` a producer dropped before submitting (``reason``)."""
        self._ingress.count_dropped(hook, reason, records)

    def count_skipped(self, hook: str, reason: str) -> None:
        """Count one call of ``hook`` that captured nothing (``reason``)."""
        self._ingress.count_skipped(hook, reason)

    async def asubmit_batch(
        self,
        descriptors: Any,
        payload: Any,
        release: Callable[[], object] | None = None,
    ) -> None:
        """``submit_batch`` for asyncio servers: never blocks the event loop.

        When ingress has room the batch is queued at once; when it is full,
        the wait happens in a worker thread while the event loop runs on.
        Cancelled while it waits (``asyncio.wait_for``, a client gone), it
        queues nothing and ``release`` is not called: the buffer is still the
        caller's.  Only a cancellation that comes just as the batch was queued
        leaves it queued (``release`` then runs as for any queued batch).
        """
        import asyncio

        batch = self.intake.batch(descriptors, payload, release)
        if self._nothing_to_queue(batch, release) or self._ingress.try_put_batch(batch):
            return
        offer = PendingOffer()
        waiting = asyncio.get_running_loop().run_in_executor(
            None, self._ingress.put_batch_unless, batch, offer
        )
        try:
            await waiting
        except asyncio.CancelledError:
            self._ingress.withdraw(offer)  # its thread returns at once, queueing nothing
            raise

    def submit(
        self,
        output_id: int,
        payload: Any,
        *,
        key: int = 0,
        step: int = 0,
        seq: int | None = None,
        timestamp_ns: int | None = None,
    ) -> None:
        """Submit one record; its payload bytes are copied into a coalesced batch.

        The layout is the one its hook was bound with (layout 0 otherwise).
        """
        row, data = self.intake.record(
            output_id, payload, key=key, step=step, seq=seq, timestamp_ns=timestamp_ns
        )
        self._ingress.put_record(row, data)
