"""Refusals: why no route took a record, kept for a sample of recent ones.

A record no route takes goes to the default destination (or is dropped),
and the reason is otherwise reported nowhere: a route's predicate declined
it.  For a bounded sample of recent unmatched records per hook, the
:class:`RefusalLog` keeps each route that declined it, in route order, with
the predicate's reason cut to one line of at most 500 bytes; ``/status`` and
``taproute trace`` show them.

Batch-shaped: a batch costs a ``unique`` over its unmatched output ids and a
membership test per declining route; Python runs only for the few records
sampled (at most ``per_hook`` per hook per batch).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from taproute.routing.predicates import one_line

#: Route name, positions in the batch it declined, and its reason.
Decline = tuple[str, npt.NDArray[np.intp], str]


@attrs.frozen
class Refusal:
    """One route that declined a record, and why (one line, <= 500 bytes)."""

    route: str
    reason: str


@attrs.frozen
class UnmatchedSample:
    """A recent record no route took: its identity and every refusal, in route
    order (empty when no route's outputs match its hook)."""

    hook: str
    key: int
    step: int
    seq: int
    timestamp_ns: int
    refusals: tuple[Refusal, ...]


class RefusalLog:
    """The last ``per_hook`` unmatched records of each hook, with their refusals
    (at most ``max_hooks`` hooks: the one noted longest ago is forgotten first).

    Written on the routing loop, read from any thread (``/status``)."""

    def __init__(self, *, per_hook: int = 8, max_hooks: int = 256) -> None:
        if per_hook < 1 or max_hooks < 1:
            raise ValueError("per_hook and max_hooks must be >= 1")
        self.per_hook = per_hook
        self.max_hooks = max_hooks
        self._lock = threading.Lock()
        self._by_hook: dict[str, deque[UnmatchedSample]] = {}

    def note(
        self,
        descriptors: npt.NDArray[np.void],
        unmatched: npt.NDArray[np.intp],
        declines: Sequence[Decline],
        hook_name: Callable[[int], str],
    ) -> None:
        """Sample the records at ``unmatched`` (positions in ``descriptors``) with
        the routes that declined each of them."""
        if not len(unmatched):
            return
        ids = descriptors["output_id"][unmatched]
        samples: list[UnmatchedSample] = []
        for output_id in np.unique(ids).tolist():
            picked = unmatched[ids == output_id][-self.per_hook :]
            refused = [
                (route, np.isin(picked, positions), reason) for route, positions, reason in declines
            ]
            hook = hook_name(int(output_id))
            rows = descriptors[picked]
            for n, row in enumerate(rows):
                samples.append(
                    UnmatchedSample(
                        hook=hook,
                        key=int(row["key"]),
                        step=int(row["step"]),
                        seq=int(row["seq"]),
                        timestamp_ns=int(row["timestamp_ns"]),
                        refusals=tuple(
                            Refusal(route, one_line(reason))
                            for route, mask, reason in refused
                            if mask[n]
                        ),
                    )
                )
        with self._lock:
            for sample in samples:
                queue = self._by_hook.pop(sample.hook, None)
                if queue is None:
                    queue = deque(maxlen=self.per_hook)
                self._by_hook[sample.hook] = queue  # most recently noted last
                queue.append(sample)
            while len(self._by_hook) > self.max_hooks:
                del self._by_hook[next(iter(self._by_hook))]

    def recent(self, hook: str | None = None) -> list[UnmatchedSample]:
        """The sampled records of ``hook`` (all hooks when None), oldest first."""
        with self._lock:
            if hook is not None:
                return list(self._by_hook.get(hook, ()))
            return [s for queue in self._by_hook.values() for s in queue]

    def by_hook(self) -> dict[str, list[UnmatchedSample]]:
        """Every hook's sample, oldest first (a detached copy)."""
        with self._lock:
            return {hook: list(queue) for hook, queue in self._by_hook.items()}
