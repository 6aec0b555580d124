"""Operator controls over dead letters: skip one, or feed it through routing again.

The controls act on a :class:`~taproute.service.ops.dead_letters.DeadLetterStore`
and on whatever takes records in (a running runtime or service): they know
nothing of threads or HTTP.  The HTTP endpoint and the ``taproute`` command
are two faces over the same :class:`DeadLetterControls`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs

from taproute.native import make_descriptors
from taproute.routing.errors import RerouteRefused
from taproute.service.ops.dead_letters import DeadLetter, DeadLetterStore


class RecordIntake(Protocol):
    """Where rerouted records go in: what a running runtime offers producers."""

    def bind_hook(self, name: str, *, layout: str | None = None) -> int: ...

    @property
    def record_sink(self) -> Any: ...


@runtime_checkable
class Rerouter(Protocol):
    """A sink that can send a dead letter's copy to named routes (a RoutingSink)."""

    def reroute_targets(self, hook: str, route: str) -> None: ...

    def reroute_from_thread(
        self,
        descriptors: Any,
        payload: bytes,
        routes: tuple[str, ...],
        *,
        letter_id: int,
        claim: Any = None,
    ) -> None: ...


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
        """Mark dead letter ``letter_id`` as skipped (kept, never rerouted).

        A rerouted letter cannot be skipped; skipping twice changes nothing."""
        return self.store.skip(letter_id)

    def reroute(self, letter_id: int, route: str | None = None) -> DeadLetter:
        """Send a copy of dead letter ``letter_id`` to the route that failed it
        (or to ``route``), and only there; any thread but the loop's.

        The copy gets its own id (``reroute_id``), linked to the letter; if it
        fails again, the new letter's ``reroute_of`` names this one.  Refused
        with :class:`~taproute.routing.errors.RerouteRefused`, the letter
        unchanged, when it was rerouted or skipped already, when the route is
        gone or does not take its hook, or when it is a causal-limit refusal
        whose payload was redacted.
        """
        letter = self.store.get(letter_id)
        if letter.code == "causal_limit" and letter.payload == b"":
            raise RerouteRefused(
                f"dead letter {letter_id}: a causal-limit refusal kept no payload (redacted); "
                "there is nothing to reroute, it stays a dead letter"
            )
        target = letter.route if route is None else route
        sink = self.intake.record_sink
        if not isinstance(sink, Rerouter):
            raise RerouteRefused(
                f"dead letter {letter_id}: the running sink ({type(sink).__name__}) has no "
                "routes to reroute to; it stays a dead letter"
            )
        try:
            sink.reroute_targets(letter.hook, target)
        except RerouteRefused as exc:
            raise RerouteRefused(
                f"dead letter {letter_id}: {exc}; it stays a dead letter"
            ) from None
        descriptors, payload = self._records(letter)
        parks_in = getattr(sink, "reroute_parks_in", None)
        file = parks_in(target) if parks_in is not None else None
        if file is not None and file == self.store.path.resolve():
            # The copy is parked in the transaction that marks the letter
            # rerouted: a crash cannot leave a rerouted letter without its copy.
            sink.reroute_from_thread(
                descriptors,
                payload,
                (target,),
                letter_id=letter_id,
                claim=lambda db: self.store.claim_reroute_in(db, letter_id, target),
            )
            return self.store.get(letter_id)
        self.store.claim_reroute(letter_id, target)  # refuses a second reroute, atomically
        try:
            sink.reroute_from_thread(descriptors, payload, (target,), letter_id=letter_id)
        except BaseException:
            self.store.unclaim_reroute(letter_id)
            raise
        return self.store.get(letter_id)

    def reroute_now(self, letter_id: int, route: str | None = None) -> DeadLetter:
        """:meth:`reroute` for the HTTP endpoint (the copy goes straight to its
        route's mailbox, not through ingress, so there is no ingress to be full)."""
        return self.reroute(letter_id, route)

    def _records(self, letter: DeadLetter) -> tuple[Any, bytes]:
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


__all__ = ["DeadLetterControls", "RecordIntake", "Rerouter"]
