"""What came of each reload asked of a runtime: applied, refused (and why),
never queued, or still pending.

A reload is answered by whoever asked (``runtime.reload`` returns or raises,
``POST /reload`` answers 200 or 422) only while they wait for it; one whose
wait ran out (``POST /reload`` answers 202, ``reload(timeout=)`` raises
``TimeoutError``) is swapped in or refused later, on the loop, with nobody
listening.  The :class:`ReloadLedger` keeps every outcome where the snapshot
reads it (``reloads`` and ``last_reload`` in ``counters()``, ``/status``;
``taproute_config_reloads_*_total`` in ``/metrics``), so a refusal after
the answer is seen, with its cause.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

import attrs

from taproute.routing.errors import problem_lines
from taproute.service.host.counters import ReloadCounters, ReloadOutcome, ReloadStatus
from taproute.service.host.ingress import NotQueued

#: How many reloads the snapshot lists (``reloads.recent``, newest last).
RECENT_RELOADS = 16


class ReloadLedger:
    """The outcome of each reload asked of one runtime; thread-safe (reloads are
    asked in producer and HTTP worker threads, settled on the loop).

    :meth:`asked` opens a record (``pending``) and returns its id; exactly one
    of :meth:`applied`, :meth:`refused` or :meth:`settle` closes it.  The
    last :data:`RECENT_RELOADS` records are kept; the counts cover all."""

    def __init__(self, keep: int = RECENT_RELOADS) -> None:
        self._lock = threading.Lock()
        self._recent: deque[ReloadStatus] = deque(maxlen=keep)
        self._next_id = 1
        self._applied = 0
        self._refused = 0
        self._not_queued = 0
        self._last_successful = True

    def asked(
        self,
        *,
        running_generation: int,
        routes: Iterable[str] = (),
        source: str | None = None,
        config_sha256: str | None = None,
    ) -> int:
        """A reload was asked (under ``running_generation``): its id, pending."""
        with self._lock:
            reload_id = self._next_id
            self._next_id += 1
            self._recent.append(
                ReloadStatus(
                    id=reload_id,
                    source=source,
                    config_sha256=config_sha256,
                    routes=tuple(routes),
                    running_generation=running_generation,
                    outcome="pending",
                    requested_at=time.time(),
                )
            )
        return reload_id

    def applied(self, reload_id: int, generation: int) -> None:
        """Reload ``reload_id`` routes now, as generation ``generation``."""
        self._close(reload_id, "applied", generation=generation)

    def refused(self, reload_id: int, error: BaseException) -> None:
        """Reload ``reload_id`` was refused (at its check or at its swap) or never
        queued (``error`` a :class:`NotQueued`); the running generation goes on."""
        outcome: ReloadOutcome = "not_queued" if isinstance(error, NotQueued) else "refused"
        self._close(
            reload_id,
            outcome,
            error=str(error).strip() or type(error).__name__,
            problems=tuple(problem_lines(error)),
        )

    def settle(self, reload_id: int, done: Future[int]) -> None:
        """Close ``reload_id`` as its swap's future ``done`` settled; must never
        raise (it runs as that future's callback)."""
        if done.cancelled():
            self.refused(reload_id, RuntimeError("the reload's swap was cancelled"))
            return
        error = done.exception()
        if error is None:
            self.applied(reload_id, done.result())
        else:
            self.refused(reload_id, error)

    def _close(
        self,
        reload_id: int,
        outcome: ReloadOutcome,
        *,
        generation: int | None = None,
        error: str | None = None,
        problems: tuple[str, ...] = (),
    ) -> None:
        with self._lock:
            for i in range(len(self._recent) - 1, -1, -1):
                record = self._recent[i]
                if record.id == reload_id:
                    if record.outcome != "pending":
                        return  # closed already: counted once
                    self._recent[i] = attrs.evolve(
                        record,
                        outcome=outcome,
                        generation=generation,
                        error=error,
                        problems=problems,
                        settled_at=time.time(),
                    )
                    break
            self._last_successful = outcome == "applied"
            if outcome == "applied":
                self._applied += 1
            elif outcome == "refused":
                self._refused += 1
            else:
                self._not_queued += 1

    def snapshot(self) -> ReloadCounters:
        """The counts and the recent reloads (oldest first), detached."""
        with self._lock:
            return ReloadCounters(
                applied=self._applied,
                refused=self._refused,
                not_queued=self._not_queued,
                last_successful=self._last_successful,
                recent=list(self._recent),
            )


__all__ = ["RECENT_RELOADS", "ReloadLedger"]
