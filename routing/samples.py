"""Route samplers: named sample records a processor or predicate offers, so an
operator can trace a configuration against realistic input.

A processor registers a sampler with ``samples=`` on its decorator; a
predicate offers one by having a ``samples`` method (a callable object, see
:class:`OffersSamples`).  A sampler gets the route's configuration, the hook
names it would take and the router's clock (so a sample whose fields carry a
time, a ``timestamp_ns`` inside a predicate's window, stays inside it under a
test clock), and returns :class:`Sample` values.  :func:`route_samples`
collects them in route order; the dry-run trace then traces each one.

Pure: samplers build descriptor fields, they run no processor and write nothing.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from taproute.routing.errors import TaprouteError
from taproute.routing.hooks import HookRegistry
from taproute.routing.plan import RoutePlan
from taproute.routing.routes import DERIVED_PREFIX, Route
from taproute.routing.trace import TraceResult

#: Characters that make a route output a glob pattern rather than a hook name.
_GLOB = re.compile(r"[*?\[]")


@attrs.frozen(kw_only=True)
class Sample:
    """One named sample record: the hook it comes from and its descriptor fields."""

    name: str
    hook: str
    key: int = 0
    step: int = 0
    seq: int = 0
    timestamp_ns: int = 0


@attrs.frozen(kw_only=True)
class SampleContext:
    """What a sampler builds from: the route, the hook names it takes (bound
    hooks, or the route's literal outputs when none is bound) and the router's
    clock (``now_ns``, wall time in ns)."""

    route: Route
    hooks: tuple[str, ...]
    now_ns: int


#: ``sampler(context) -> samples``.
Sampler = Callable[[SampleContext], Iterable[Sample]]


@runtime_checkable
class OffersSamples(Protocol):
    """A predicate object that also offers samples."""

    def samples(self, context: SampleContext) -> Iterable[Sample]: ...


@attrs.frozen
class RouteSample:
    """A sample and who offered it (``source``: ``"processor"`` or ``"predicate"``)."""

    route: str
    source: str
    sample: Sample


@attrs.frozen
class SamplerFailed:
    """A sampler that raised or returned something other than samples."""

    route: str
    source: str
    error: str


def route_samples(
    plan: RoutePlan, bound_hooks: Sequence[str] = (), *, now_ns: int | None = None
) -> tuple[list[RouteSample], list[SamplerFailed]]:
    """Every sample the plan's processors and predicates offer, in route order
    (per route: the processor's, then the predicate's), and the samplers that failed.

    ``bound_hooks``: hook names bound in the router (a sampler gets those its
    route takes; with none, the route's outputs that are plain names).
    ``now_ns``: the router's clock (default: the wall clock now).
    """
    now = time.time_ns() if now_ns is None else now_ns
    samples: list[RouteSample] = []
    failed: list[SamplerFailed] = []
    for planned in plan.routes:
        route = planned.route
        hooks = tuple(h for h in bound_hooks if planned.matches(h)) or tuple(
            o for o in route.outputs if not _GLOB.search(o)
        )
        context = SampleContext(route=route, hooks=hooks, now_ns=now)
        offers: list[tuple[str, Sampler]] = []
        if planned.processor is not None and planned.processor.samples is not None:
            offers.append(("processor", planned.processor.samples))
        if isinstance(route.predicate, OffersSamples):
            offers.append(("predicate", route.predicate.samples))
        for source, sampler in offers:
            try:
                offered = list(sampler(context))
                bad = [s for s in offered if not isinstance(s, Sample)]
                if bad:
                    raise TypeError(f"a sampler returns Sample values, got {bad[0]!r}")
            except Exception as exc:
                failed.append(SamplerFailed(route.name, source, f"{type(exc).__name__}: {exc}"))
                continue
            samples.extend(RouteSample(route.name, source, s) for s in offered)
    return samples, failed


@attrs.frozen
class SampleTrace:
    """One offered sample and its trace (``refused``: why it could not be
    traced, as submission would refuse it: an unbound hook, a bad layout)."""

    route: str
    source: str
    sample: Sample
    result: TraceResult | None
    refused: str | None = None


@attrs.frozen
class SampleTraces:
    """Every sample a configuration's routes offer, traced, and the samplers that failed."""

    samples: list[SampleTrace]
    failed: list[SamplerFailed]


def trace_samples(
    plan: RoutePlan,
    trace: Callable[..., TraceResult],
    hooks: HookRegistry,
    *,
    now_ns: int | None = None,
    bind: bool = False,
) -> SampleTraces:
    """Collect the plan's samples (:func:`route_samples`) and ``trace`` each one
    (a sink's ``trace``).  ``bind``: bind a sample's hook first when it is not
    bound (a candidate built from a file binds what its producer would); a
    sample the trace refuses is kept with the reason."""
    offered, failed = route_samples(plan, hooks.names(), now_ns=now_ns)
    traced: list[SampleTrace] = []
    for offer in offered:
        sample = offer.sample
        if bind and hooks.id_of(sample.hook) is None and not sample.hook.startswith(DERIVED_PREFIX):
            hooks.bind(sample.hook)
        try:
            result = trace(sample.hook, **trace_fields(sample))
        except (TaprouteError, LookupError, TypeError, ValueError) as exc:
            refused = f"{type(exc).__name__}: {exc}"
            traced.append(SampleTrace(offer.route, offer.source, sample, None, refused))
        else:
            traced.append(SampleTrace(offer.route, offer.source, sample, result))
    return SampleTraces(traced, failed)


def trace_fields(sample: Sample) -> dict[str, int]:
    """The descriptor fields of ``sample``, as a trace takes them."""
    return {
        "key": sample.key,
        "step": sample.step,
        "seq": sample.seq,
        "timestamp_ns": sample.timestamp_ns,
    }
