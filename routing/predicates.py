"""Route predicates: which records a route takes, and why it declines the rest.

A route may carry a predicate on descriptor fields that takes or declines
each record, with a short reason for the declines.  The routing sink runs it
on every batch; the dry-run trace (:mod:`taproute.routing.trace`) runs it on
one record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from taproute.native import UNMATCHED
from taproute.routing.plan import PlannedRoute

MAX_REASON = 500


def one_line(reason: str) -> str:
    """A decline reason cut to one line of at most 500 bytes."""
    line = reason.strip().splitlines()[0] if reason.strip() else "declined"
    encoded = line.encode()[:MAX_REASON]
    return encoded.decode(errors="ignore")


def evaluate_predicate(
    planned: PlannedRoute, descriptors: npt.NDArray[np.void]
) -> tuple[npt.NDArray[np.bool_], str]:
    """Which records the route's predicate takes, and its reason for the rest."""
    predicate = planned.route.predicate
    assert predicate is not None
    result = predicate(descriptors)
    reason = "declined by the route's predicate"
    if isinstance(result, tuple):
        result, reason = result
    mask = np.asarray(result, dtype=bool)
    if mask.shape != (len(descriptors),):
        raise ValueError(
            f"route {planned.name!r}: predicate returned shape {mask.shape}, "
            f"expected ({len(descriptors)},)"
        )
    return mask, one_line(str(reason))


#: (route index or UNMATCHED, positions in the batch or None for all of it)
Groups = list[tuple[int, npt.NDArray[np.intp] | None]]


class PredicateFailed(Exception):
    """A route's predicate raised (or returned the wrong shape): a bug, raised loudly."""

    def __init__(self, route: str, cause: Exception) -> None:
        super().__init__(f"route {route!r}: predicate failed: {cause}")
        self.route = route
        self.cause = cause


def narrow(
    groups: Groups,
    descriptors: npt.NDArray[np.void],
    routes: Sequence[PlannedRoute],
    declined: Callable[[int, int, str], None],
) -> Groups:
    """Narrow each route's group by its predicate; what no route takes is unmatched.

    ``declined(route_index, count, reason)`` is told what each predicate
    declined.  A predicate that fails raises :class:`PredicateFailed`.
    """
    n = len(descriptors)
    taken = np.zeros(n, dtype=bool)
    narrowed: Groups = []
    for index, selection in groups:
        if index == UNMATCHED:
            continue  # recomputed below: what no route took
        positions = np.arange(n) if selection is None else selection
        planned = routes[index]
        if planned.route.predicate is not None:
            try:
                mask, reason = evaluate_predicate(planned, descriptors[positions])
            except Exception as exc:
                raise PredicateFailed(planned.name, exc) from exc
            count = int(len(mask) - mask.sum())
            if count:
                declined(index, count, reason)
            positions = positions[mask]
        if len(positions):
            taken[positions] = True
            narrowed.append((index, positions))
    routed_nowhere = np.flatnonzero(~taken)
    if len(routed_nowhere):
        narrowed.append((UNMATCHED, routed_nowhere))
    return narrowed
