"""The dry-run trace: where a record would go, and why.

``trace`` answers "where
would this record go, and why?" without running a processor or writing
anything: for each route a verdict — ``match``, ``skip`` (its predicate
declined, with the reason), ``not_reached`` (its outputs do not match the
hook), or ``bypassed`` (no route took the record: it goes to the default
destination, or is dropped).
"""

from __future__ import annotations

from typing import Literal

import attrs

from taproute.native import make_descriptors
from taproute.routing.plan import RoutePlan
from taproute.routing.predicates import evaluate_predicate

Verdict = Literal["match", "skip", "not_reached", "bypassed"]


@attrs.frozen
class RouteVerdict:
    """What one route would do with the traced record."""

    route: str
    verdict: Verdict
    destination: str
    reason: str | None = None


@attrs.frozen
class TraceResult:
    """Where a record would go: a verdict per route, in route order, and the
    destinations it would reach (``dropped`` when no route takes it and
    unmatched records are dropped)."""

    hook: str
    verdicts: list[RouteVerdict]
    destinations: list[str]
    dropped: bool


def trace(
    plan: RoutePlan,
    hook: str,
    *,
    key: int = 0,
    step: int = 0,
    seq: int = 0,
    layout_id: int = 0,
    timestamp_ns: int = 0,
    output_id: int = 0,
) -> TraceResult:
    """Dry-run routing of one record of ``hook``: runs predicates, nothing else."""
    descriptors = make_descriptors(
        output_id,
        0,
        layout_ids=layout_id,
        keys=key,
        steps=step,
        seqs=seq,
        timestamps_ns=timestamp_ns,
        count=1,
    )
    verdicts: list[RouteVerdict] = []
    taken = False
    for planned in plan.routes:
        destination = planned.route.destination
        if not planned.matches(hook):
            verdicts.append(RouteVerdict(planned.name, "not_reached", destination))
            continue
        if planned.route.predicate is not None:
            mask, reason = evaluate_predicate(planned, descriptors)
            if not mask[0]:
                verdicts.append(RouteVerdict(planned.name, "skip", destination, reason))
                continue
        verdicts.append(RouteVerdict(planned.name, "match", destination))
        taken = True
    if taken:
        destinations = list(dict.fromkeys(v.destination for v in verdicts if v.verdict == "match"))
        return TraceResult(hook, verdicts, destinations, dropped=False)
    bypassed = [v if v.verdict == "skip" else attrs.evolve(v, verdict="bypassed") for v in verdicts]
    default = plan.default_destination
    return TraceResult(
        hook, bypassed, [] if default is None else [default], dropped=default is None
    )
