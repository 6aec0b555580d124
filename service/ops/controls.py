"""Operator controls over dead letters: skip one, or feed it through routing again.

The controls act on a :class:`~taproute.service.ops.dead_letters.DeadLetterStore`
and on whatever takes records in (a running runtime or service): they know
nothing of threads or HTTP.  The HTTP endpoint and the ``taproute`` command
are two faces over the same :class:`DeadLetterControls`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs

from taproute.native import make_descriptors
from taproute.routing.errors import IngressFull
from taproute.service.ops.dead_letters import DeadLetter, DeadLetterStore


class RecordIntake(Protocol):
    """Where rerouted records go in: what a running runtime offers producers."""

    def bind_hook(self, name: str, *, layout: str | None = None) -> int: ...

    def submit_batch(
        self, descriptors: Any, payload: Any, release: Callable[[], object] | None = None
    ) -> None: ...

    def try_submit_batch(
        self, descriptors: Any, payload: Any, release: Callable[[], object] | None = None
    ) -> bool: ...


@attrs.frozen
class DeadLetterControls:
    """Skip and reroute dead letters of ``store`` into ``intake``.

    ``token``: the bearer token the HTTP face requires for mutations (None:
    mutations over HTTP are refused).
    """

    store: DeadLetterStore
    intake: RecordIntake
    token: str | None = attrs.field(default=None, repr=False)

    def skip(self, letter_id: int) -> DeadLetter:
        """Mark dead letter ``letter_id`` as skipped (kept, never rerouted by itself)."""
        return self.store.skip(letter_id)

    def reroute(self, letter_id: int) -> DeadLetter:
        """Feed dead letter ``letter_id`` through routing again, as new input.

        Any thread but the loop's; blocks while ingress is full.  A skipped or
        already rerouted letter goes again as a copy.
        """
        descriptors, payload = self._records(letter_id)
        self.intake.submit_batch(descriptors, payload)
        return self.store.mark_rerouted(letter_id)

    def reroute_now(self, letter_id: int) -> DeadLetter:
        """:meth:`reroute` that never waits: raises :class:`IngressFull` instead.

        For callers that must not wait (the HTTP endpoint, the loop thread itself).
        """
        descriptors, payload = self._records(letter_id)
        if not self.intake.try_submit_batch(descriptors, payload):
            raise IngressFull("ingress is full; reroute refused, try again")
        return self.store.mark_rerouted(letter_id)

    def _records(self, letter_id: int) -> tuple[Any, bytes]:
        letter = self.store.get(letter_id)
        assert letter.payload is not None
        output_id = self.intake.bind_hook(letter.hook)
        descriptors = make_descriptors(
            output_id,
            len(letter.payload),
            layout_ids=letter.layout_id,
            keys=letter.key,
            steps=letter.step,
            seqs=letter.seq,
            timestamps_ns=letter.timestamp_ns,
        )
        return descriptors, letter.payload


__all__ = ["DeadLetterControls", "RecordIntake"]
