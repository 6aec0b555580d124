"""Build, then run: a routing sink's actors, built and checked from its
configuration before anything runs.

:func:`build_topology` checks the route plan and every destination binding,
collects every problem into one error (each with its location), and builds
the destination actors and the route actors, inert.  The routing sink runs
what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from taproute.actors.destination import DestinationActor, DestinationSpec
from taproute.actors.forward import ForwardRoute
from taproute.actors.inflight import InFlight
from taproute.actors.owners import StatefulRoute
from taproute.actors.parking import Parker
from taproute.actors.pool import StatelessRoute
from taproute.actors.route_actor import RouteActor
from taproute.routing.batch import RecordBatch
from taproute.routing.errors import ConfigError, PlanErrors, at, raise_collected
from taproute.routing.failures import FailureHandler, GiveUpLog
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.plan import RoutePlan, Unmatched
from taproute.routing.processors import ProcessorRegistry
from taproute.routing.routes import RouteMode, RoutingConfig
from taproute.routing.schema import RecordSchema

_ROUTE_KINDS: dict[RouteMode, type[RouteActor]] = {
    RouteMode.FORWARD: ForwardRoute,
    RouteMode.STATELESS: StatelessRoute,
    RouteMode.STATEFUL: StatefulRoute,
}


@attrs.frozen(kw_only=True)
class Topology:
    """What a routing sink runs: its plan, the destination actors something
    routes to, the route actors (in plan order, and by name), the default
    destination's actor (None: unmatched records are dropped); ``available``:
    an actor for every destination given (a reload may start the others)."""

    plan: RoutePlan
    destinations: dict[str, DestinationActor]
    available: dict[str, DestinationActor]
    routes: list[RouteActor]
    by_name: dict[str, RouteActor]
    default: DestinationActor | None


def build_topology(
    config: RoutingConfig,
    schema: RecordSchema,
    destinations: Mapping[str, DestinationSpec],
    default_destination: str | None,
    *,
    unmatched: Unmatched,
    hooks: HookRegistry,
    registry: ProcessorRegistry,
    on_failure: FailureHandler,
    destination_capacity: int,
    destination_capacity_bytes: int,
    latch: FailureLatch,
    in_flight: InFlight,
    give_up_log: GiveUpLog,
    copy_of: Callable[[RecordBatch], int | None],
    parker: Parker | None = None,
) -> Topology:
    """Check everything and build every actor, inert; raise every problem at once
    (:class:`~taproute.routing.errors.PlanErrors` when there are several)."""
    errors: list[ConfigError] = []
    actors: dict[str, DestinationActor] = {}
    for name, spec in destinations.items():
        try:
            actors[name] = DestinationActor(
                name,
                spec,
                latch=latch,
                in_flight=in_flight,
                capacity_records=destination_capacity,
                capacity_bytes=destination_capacity_bytes,
            )
        except ConfigError as exc:
            errors.append(at(exc, f"destinations.{name}"))
    plan: RoutePlan | None = None
    try:
        plan = RoutePlan(
            config,
            schema,
            destinations=destinations,
            default_destination=default_destination,
            unmatched=unmatched,
            registry=registry,
            bound_names=hooks.names(),
        )
    except PlanErrors as exc:
        errors[:0] = exc.errors
    except ConfigError as exc:
        errors.insert(0, exc)
    raise_collected(errors)
    assert plan is not None
    # Only the destinations something routes to are run.
    available, actors = actors, {name: actors[name] for name in plan.destinations_used}
    routes = route_actors(
        plan,
        actors,
        latch=latch,
        in_flight=in_flight,
        on_failure=on_failure,
        hooks=hooks,
        give_up_log=give_up_log,
        copy_of=copy_of,
        parker=parker,
    )
    default = plan.default_destination
    return Topology(
        plan=plan,
        destinations=actors,
        available=available,
        routes=routes,
        by_name={route.name: route for route in routes},
        default=None if default is None else actors[default],
    )


def route_actors(
    plan: RoutePlan,
    destinations: Mapping[str, DestinationActor],
    *,
    latch: FailureLatch,
    in_flight: InFlight,
    on_failure: FailureHandler,
    hooks: HookRegistry,
    give_up_log: GiveUpLog,
    copy_of: Callable[[RecordBatch], int | None],
    parker: Parker | None = None,
) -> list[RouteActor]:
    """One inert route actor per planned route, in plan order, each feeding its
    destination's actor (at construction and at every reload)."""
    return [
        _ROUTE_KINDS[planned.route.mode](
            planned,
            destinations[planned.route.destination],
            latch=latch,
            in_flight=in_flight,
            on_failure=on_failure,
            hook_name=hooks.name_of,
            give_up_log=give_up_log,
            copy_of=copy_of,
            parker=parker,
        )
        for planned in plan.routes
    ]
