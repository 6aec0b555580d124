"""Route predicates: which records a route takes, and why it declines the rest.

A route may carry a predicate on descriptor fields that takes or declines
each record, with a short reason for the declines.  The routing sink runs it
on every batch, in a worker thread under the route's deadline (a predicate
that fails is that route's failure for those records, never the router's);
the dry-run trace (:mod:`taproute.routing.trace`) runs it on one record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

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

#: A predicate's verdict on a route's records: which it takes and why it
#: declines the rest, or None when it failed (the route gave those records up).
Verdict = tuple[npt.NDArray[np.bool_], str] | None


class PredicateFailed(Exception):
    """A route's predicate raised (or returned the wrong shape, or ran past
    the route's deadline): a failure of that route for those records."""

    def __init__(self, route: str, cause: BaseException) -> None:
        super().__init__(f"route {route!r}: predicate failed: {type(cause).__name__}: {cause}")
        self.route = route
        self.cause = cause


def positions_of(selection: npt.NDArray[np.intp] | None, n: int) -> npt.NDArray[np.intp]:
    """A group's positions in a batch of ``n`` records."""
    return np.arange(n) if selection is None else selection


def narrow(
    groups: Groups,
    n: int,
    verdicts: Mapping[int, Verdict],
    declined: Callable[[int, npt.NDArray[np.intp], str], None],
) -> Groups:
    """Narrow each route's group of a batch of ``n`` records by its predicate's
    verdict; what no route takes is unmatched.

    ``verdicts`` holds one verdict per route with a predicate; records of a
    failed verdict (None) count as taken by their route, which gave them up.
    ``declined(route_index, positions, reason)`` is told which records (positions
    in the batch) each predicate declined.
    """
    taken = np.zeros(n, dtype=bool)
    narrowed: Groups = []
    for index, selection in groups:
        if index == UNMATCHED:
            continue  # recomputed below: what no route took
        positions = positions_of(selection, n)
        if index in verdicts:
            verdict = verdicts[index]
            if verdict is None:
                taken[positions] = True
                continue
            mask, reason = verdict
            if not mask.all():
                declined(index, positions[~mask], reason)
            positions = positions[mask]
        if len(positions):
            taken[positions] = True
            narrowed.append((index, positions))
    routed_nowhere = np.flatnonzero(~taken)
    if len(routed_nowhere):
        narrowed.append((UNMATCHED, routed_nowhere))
    return narrowed
