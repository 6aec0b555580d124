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


#: What one batch left for one hook: its last sampled descriptors and, per
#: declining route, which of them it declined and why.
_Entry = tuple[npt.NDArray[np.void], tuple[tuple[str, npt.NDArray[np.bool_], str], ...]]


class RefusalLog:
    """The last ``per_hook`` unmatched records of each hook, with their refusals
    (at most ``max_hooks`` hooks: the one noted longest ago is forgotten first).

    Written on the routing loop, read from any thread (``/status``).  A batch
    stores a few descriptor rows and masks; the samples are built when read.
    """

    def __init__(self, *, per_hook: int = 8, max_hooks: int = 256) -> None:
        if per_hook < 1 or max_hooks < 1:
            raise ValueError("per_hook and max_hooks must be >= 1")
        self.per_hook = per_hook
        self.max_hooks = max_hooks
        self._lock = threading.Lock()
        self._by_hook: dict[int, deque[_Entry]] = {}
        self._hook_name: Callable[[int], str] | None = None

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
        self._hook_name = hook_name
        ids = descriptors["output_id"][unmatched]
        first = int(ids[0])
        if len(ids) == 1 or not (ids != first).any():  # the usual case: one hook
            groups = [(first, unmatched[-self.per_hook :])]
        else:
            groups = [
                (int(output_id), unmatched[ids == output_id][-self.per_hook :])
                for output_id in np.unique(ids)
            ]
        entries = [
            (
                output_id,
                (
                    descriptors[picked],
                    tuple(
                        (route, np.isin(picked, positions), reason)
                        for route, positions, reason in declines
                    ),
                ),
            )
            for output_id, picked in groups
        ]
        with self._lock:
            for output_id, entry in entries:
                queue = self._by_hook.pop(output_id, None)
                if queue is None:
                    queue = deque(maxlen=self.per_hook)
                self._by_hook[output_id] = queue  # most recently noted last
                queue.append(entry)
            while len(self._by_hook) > self.max_hooks:
                del self._by_hook[next(iter(self._by_hook))]

    def recent(self, hook: str | None = None) -> list[UnmatchedSample]:
        """The sampled records of ``hook`` (all hooks when None), oldest first."""
        if hook is None:
            return [s for samples in self.by_hook().values() for s in samples]
        return self.by_hook().get(hook, [])

    def by_hook(self) -> dict[str, list[UnmatchedSample]]:
        """Every hook's sample, oldest first (built now, detached)."""
        with self._lock:
            held = {output_id: list(queue) for output_id, queue in self._by_hook.items()}
        hook_name = self._hook_name
        if hook_name is None:
            return {}
        return {
            hook_name(output_id): _samples(hook_name(output_id), entries)[-self.per_hook :]
            for output_id, entries in held.items()
        }


def _samples(hook: str, entries: list[_Entry]) -> list[UnmatchedSample]:
    samples = []
    for rows, refused in entries:
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
    return samples
