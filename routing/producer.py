"""The producer-facing surface, written once for its two shells.

A producer binds hooks, submits batches (or single records), ends keys,
flushes, and reads counters and the latched failure.  Two shells offer it,
the way httpx offers one client as ``Client`` and ``AsyncClient``:

- :class:`~taproute.actors.RoutingSink`, the async shell: on the Trio loop,
  its ``submit``/``flush``/``complete``/... are awaited;
- :class:`~taproute.service.RecordRuntime`, the sync shell: any thread; it
  carries each call into the loop through its ingress, where the routing
  sink does the work.

What both do is here, once: every check is the shells' shared
:class:`~taproute.routing.intake.Intake` (one object when a runtime hosts a
routing sink, so a batch is checked once, where the producer hands it in),
key lifecycle requests are :class:`~taproute.routing.keys.KeyAction` s over
:func:`~taproute.routing.keys.request_keys`, and the observation verbs are
one pair (``snapshot``, ``counters``) plus ``failure``.  A shell adds only how
a call reaches the work: awaited in place, or queued for the loop.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from taproute.routing.errors import SinkClosed
from taproute.routing.hooks import HookRegistry
from taproute.routing.intake import Intake
from taproute.routing.latch import FailureLatch

SnapshotT = TypeVar("SnapshotT", covariant=True)


class Producer(Generic[SnapshotT]):
    """What the sync and async shells share: the intake, hook binding, the
    latched failure and the observation verbs (``snapshot`` is the shell's)."""

    def __init__(self, intake: Intake) -> None:
        #: Every check of what producers hand in (shared by a runtime and the
        #: routing sink it hosts).
        self.intake = intake
        self._latch = FailureLatch()

    @property
    def hooks(self) -> HookRegistry:
        """The hook registry producers bind in."""
        return self.intake.hooks

    def bind_hook(self, name: str, *, layout: str | None = None) -> int:
        """The output_id for hook ``name`` (routes match it by name); an unknown
        ``layout`` is refused now.  Once the shell is closed it raises
        :class:`~taproute.routing.errors.SinkClosed` and binds nothing, as
        ``submit`` does: a hook bound then could never submit."""
        closed = self._closed_reason()
        if closed is not None:
            raise SinkClosed(f"{closed}; bind_hook({name!r}) refused")
        return self.intake.bind_hook(name, layout=layout)

    def _closed_reason(self) -> str | None:
        """What is closed (``"runtime is closed"``), or None while producers may
        still bind; each shell says."""
        return None

    @property
    def failure(self) -> BaseException | None:
        """The latched failure, or None."""
        return self._latch.failure

    def snapshot(self) -> SnapshotT:
        """Counters and live state, detached, at one moment."""
        raise NotImplementedError

    def counters(self) -> SnapshotT:
        """Same as :meth:`snapshot`."""
        return self.snapshot()
