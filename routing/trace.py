"""The dry-run trace: where a record would go, and why.

``trace`` answers "where
would this record go, and why?" without running a processor or writing
anything: for each route a verdict — ``match``, ``skip`` (its predicate
declined, with the reason), ``not_reached`` (its outputs do not match the
hook), or ``bypassed`` (no route took the record: it goes to the default
destination, or is dropped).

A trace first refuses what submission would refuse (:func:`traced_descriptor`):
an unbound hook (never traced under another hook's output_id), an unknown
layout, a payload length the layout does not allow; the error is the one
``submit`` raises.  When nothing takes the record, the result lists the
refusals (each route that declined it, in order, with its reason), and a
sink's trace adds the recent unmatched records of that hook it sampled.
"""

from __future__ import annotations

from typing import Literal

import attrs

from taproute.native import make_descriptors
from taproute.routing.batch import Descriptors
from taproute.routing.errors import PayloadSizeMismatch, UnboundOutputId
from taproute.routing.hooks import HookRegistry
from taproute.routing.plan import RoutePlan
from taproute.routing.predicates import evaluate_predicate
from taproute.routing.refusals import Refusal, UnmatchedSample
from taproute.routing.schema import RecordSchema
from taproute.routing.validation import check_batch

Verdict = Literal["match", "skip", "not_reached", "bypassed"]

#: Which configuration a trace ran against: a running generation's number, or
#: ``"candidate"`` for a configuration that is not applied (a file, a plan).
TracedGeneration = int | Literal["candidate"]


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
    unmatched records are dropped).  ``generation`` says which configuration
    was traced: the running generation's number, or ``"candidate"``."""

    hook: str
    verdicts: list[RouteVerdict]
    destinations: list[str]
    dropped: bool
    #: When no route takes the record: each route that declined it, in order.
    refusals: list[Refusal] = attrs.field(factory=list)
    #: A sink's recent records of this hook that no route took (with refusals).
    recent_unmatched: list[UnmatchedSample] = attrs.field(factory=list)
    generation: TracedGeneration = "candidate"


#: Descriptor fields a trace may set -> make_descriptors' argument names.
_FIELDS = {
    "key": "keys",
    "step": "steps",
    "seq": "seqs",
    "timestamp_ns": "timestamps_ns",
    "layout_id": "layout_ids",
}


def traced_descriptor(
    hooks: HookRegistry,
    schema: RecordSchema,
    hook: str,
    *,
    layout: str | None = None,
    length: int | None = None,
    **fields: int,
) -> Descriptors:
    """The one descriptor a trace of ``hook`` routes, refused as submission would.

    An unbound hook raises :class:`UnboundOutputId`; with ``length`` (payload
    bytes) the descriptor goes through submission's own check against its
    layout (``layout``, else the layout the hook was bound with), so a size
    the layout does not allow raises the same ``PayloadSizeMismatch``.
    """
    output_id = hooks.id_of(hook)
    if output_id is None:
        raise UnboundOutputId(
            f"hook {hook!r} was never bound with bind_hook ({len(hooks)} hooks bound); "
            "a record of it would be refused, so there is nothing to trace"
        )
    if layout is None and "layout_id" not in fields:
        layout = hooks.layout_of(output_id)
    if layout is not None:
        fields["layout_id"] = schema.layout_id(layout)
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length < 0
    ):
        # Named as the caller named it (it reached the native check as
        # "payload_size", a field no trace takes).
        raise PayloadSizeMismatch(f"trace: length must be payload bytes >= 0, got {length!r}")
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise TypeError(
            f"trace takes the descriptor fields {', '.join(_FIELDS)}, layout and length; "
            f"got {', '.join(unknown)}"
        )
    descriptors = make_descriptors(
        output_id,
        0 if length is None else length,
        count=1,
        **{_FIELDS[name]: value for name, value in {"timestamp_ns": 0, **fields}.items()},
    )
    if length is not None:
        check_batch(
            descriptors,
            int(descriptors["length"][0]),
            bound_ids=len(hooks),
            schema=schema,
            hook_name=hooks.name_of,
        )
    return descriptors


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
    generation: TracedGeneration = "candidate",
) -> TraceResult:
    """Dry-run routing of one record of ``hook``: runs predicates, nothing else.

    ``generation`` is reported as the one traced (a plan on its own is a
    candidate; a running sink passes its generation's number)."""
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
    return trace_descriptor(plan, hook, descriptors, generation=generation)


def trace_descriptor(
    plan: RoutePlan,
    hook: str,
    descriptors: Descriptors,
    *,
    generation: TracedGeneration = "candidate",
) -> TraceResult:
    """Dry-run routing of the one record ``descriptors`` holds, of ``hook``
    (``generation``: the one traced, reported on the result)."""
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
        return TraceResult(hook, verdicts, destinations, dropped=False, generation=generation)
    bypassed = [v if v.verdict == "skip" else attrs.evolve(v, verdict="bypassed") for v in verdicts]
    refusals = [Refusal(v.route, v.reason or "") for v in verdicts if v.verdict == "skip"]
    default = plan.default_destination
    return TraceResult(
        hook,
        bypassed,
        [] if default is None else [default],
        dropped=default is None,
        refusals=refusals,
        generation=generation,
    )
