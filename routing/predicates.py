"""Route predicates: which records a route takes, and why it declines the rest.

A route may carry a predicate on descriptor fields that takes or declines
each record, with a short reason for the declines.  The routing sink runs it
on every batch; the dry-run trace (:mod:`taproute.routing.trace`) runs it on
one record.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

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
