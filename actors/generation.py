"""Configuration generations of a routing sink.

A generation is one configuration's routes: the checked plan, a route actor
per route and the native table that sends each hook's records to them.  A
reload builds the next generation beside the running one (every check the
sink's construction makes, nothing started), then swaps it in at a batch
boundary: batches routed before the swap stay with the actors of the
generation that accepted them, which drain them and exit; later batches go
to the new actors.

What a retired route still holds when its actors exit (records parked for a
retry, records waiting behind a failing key) is handed to the route of the
same name in the next generation and tried again at once, if that route runs
the same processor; otherwise those records fail with ``handler_missing``,
and a stateful route's key controls that waited behind them take effect
then, on its own state (as at a close).
A route keeps its counters across generations while its mode and
destination stay the same, and a stateful route its state (slots, key
lifecycle) while its processor stays the same: the new owners start only
once the old ones have exited, so one key's records stay in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import trio

from taproute.actors.attempt import Attempt
from taproute.actors.destination import DestinationActor
from taproute.actors.inflight import InFlight
from taproute.actors.owners import StatefulRoute
from taproute.actors.pool import StatelessRoute
from taproute.actors.route_actor import RouteActor
from taproute.native import RouteTable
from taproute.routing.errors import ConfigError, HandlerMissing, PlanErrors, raise_collected
from taproute.routing.failures import FailureCode
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.plan import RoutePlan, Unmatched
from taproute.routing.processors import ProcessorRegistry
from taproute.routing.routes import RoutingConfig
from taproute.routing.schema import RecordSchema


class Generation:
    """One configuration's routes, built and checked, and the table feeding them.

    The table follows hook bindings from the moment the generation is built
    (it subscribes to the hook registry), so a hook bound between build and
    swap is routed by both.  ``number`` is set when the generation is swapped
    in (the first is 1).
    """

    def __init__(
        self,
        config: RoutingConfig,
        plan: RoutePlan,
        routes: list[RouteActor],
        default: DestinationActor | None,
        hooks: HookRegistry,
    ) -> None:
        self.number = 0
        self.config = config
        self.plan = plan
        self.routes = routes
        self.by_name = {route.name: route for route in routes}
        self.default = default
        self.has_predicates = any(p.route.predicate is not None for p in plan.routes)
        self.table = RouteTable(len(plan.routes))
        self._unsubscribe = hooks.subscribe(self._on_bind)

    def _on_bind(self, name: str, output_id: int) -> None:
        """Resolve a (possibly late) hook binding into the native table."""
        self.table.assign(output_id, self.plan.routes_for(name))

    def detach(self) -> None:
        """Stop following hook bindings (retired, or discarded unswapped)."""
        self._unsubscribe()


def prepare_generation(
    config: RoutingConfig,
    schema: RecordSchema,
    *,
    available: Mapping[str, DestinationActor],
    default_destination: str | None,
    unmatched: Unmatched,
    registry: ProcessorRegistry,
    hooks: HookRegistry,
    build: Callable[[RoutePlan], list[RouteActor]],
) -> Generation:
    """Check ``config`` as the sink's construction does and build its route
    actors (``build``), inert; raise every problem at once, each at its
    location.  ``available``: the sink's destination actors by name (those not
    running yet are started at the swap)."""
    errors: list[ConfigError] = []
    plan: RoutePlan | None = None
    try:
        plan = RoutePlan(
            config,
            schema,
            destinations=available,
            default_destination=default_destination,
            unmatched=unmatched,
            registry=registry,
            bound_names=hooks.names(),
        )
    except PlanErrors as exc:
        errors.extend(exc.errors)
    except ConfigError as exc:
        errors.append(exc)
    raise_collected(errors)
    assert plan is not None
    default = plan.default_destination
    return Generation(
        config, plan, build(plan), None if default is None else available[default], hooks
    )


async def run_route(
    actor: RouteActor,
    *,
    current: Callable[[], int],
    in_flight: InFlight,
    latch: FailureLatch,
    retiring: list[RouteActor],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one route's actors until its inputs close and it drained; then, if a
    reload retired it, hand what it still holds to its successor (under the
    generation ``current()`` numbers)."""
    try:
        prior = waits_for_predecessor(actor)
        if prior is not None:
            await prior.exited.wait()  # one writer of the keys' state at a time
        try:
            async with trio.open_nursery() as tasks:
                await actor.run(tasks)
                task_status.started()
        finally:
            actor.tasks_done = True
        if actor.handing_over:
            try:
                await hand_over(actor, current(), in_flight)
            except Exception as exc:
                latch.latch(exc, route=actor.name, where="reload handover")
            finally:
                in_flight.done()  # taken when the reload retired it
    finally:
        actor.exited.set()
        if actor in retiring:
            retiring.remove(actor)


def link(new: Generation, old: Generation) -> None:
    """Tie each route of ``new`` to the same-named route of ``old`` (on the
    loop, at the swap): successor and predecessor, shared counters while mode
    and destination are the same, shared state while a stateful route's
    processor and key space are the same.  What a retired route still emits
    is routed again as the new generation chains its successor (a derived
    record accepted after the swap is a new record); a route removed by the
    reload chains nothing any more."""
    for retired in old.routes:
        if retired.chain is not None:
            successor = new.by_name.get(retired.name)
            retired.chain = None if successor is None else successor.chain
    for actor in new.routes:
        prior = old.by_name.get(actor.name)
        if prior is None:
            continue
        prior.successor = actor
        actor.predecessor = prior
        same_labels = (prior.counters.mode, prior.counters.destination) == (
            actor.counters.mode,
            actor.counters.destination,
        )
        if same_labels:
            actor.counters = prior.counters
            actor.parked.counters = prior.counters
        if (
            isinstance(actor, StatefulRoute)
            and isinstance(prior, StatefulRoute)
            and _same_state(actor, prior)
        ):
            # The new owners start only once the old ones exited (see
            # waits_for_predecessor): one state, one writer at a time.
            actor.state.slots = prior.state.slots
            actor.state.valid = prior.state.valid
            actor.keys = prior.keys


def _same_state(actor: StatefulRoute, prior: StatefulRoute) -> bool:
    spec, old = actor.planned.processor, prior.planned.processor
    return (
        spec is not None
        and old is not None
        and spec.name == old.name
        and spec.key_range == old.key_range
        and spec.slot == old.slot
    )


def waits_for_predecessor(actor: RouteActor) -> RouteActor | None:
    """The route ``actor`` must wait for before it runs: a stateful route's
    stateful predecessor (same keys, maybe the same state, held records to
    take over in order); None otherwise."""
    prior = actor.predecessor
    if isinstance(actor, StatefulRoute) and isinstance(prior, StatefulRoute):
        return prior
    return None


def _takes_over(target: RouteActor | None, old: RouteActor) -> bool:
    """Whether ``target`` can retry ``old``'s parked records: same kind, same processor."""
    if target is None or type(target) is not type(old):
        return False
    spec, prior = target.planned.processor, old.planned.processor
    if spec is None or prior is None or spec.name != prior.name:
        return False
    if isinstance(target, StatefulRoute):
        assert isinstance(old, StatefulRoute)
        return _same_state(target, old)
    return True


def _receiver(old: RouteActor) -> RouteActor | None:
    """The route that takes over ``old``'s parked records: its successor, or,
    when that one already finished (a quicker later reload), the next one."""
    target = old.successor
    while target is not None and target.tasks_done:
        target = target.successor
    return target


async def hand_over(old: RouteActor, current: int, in_flight: InFlight) -> None:
    """``old`` was retired and its tasks exited: give what it still holds to
    the route that replaces it (tried at once), or fail it ``handler_missing``
    under generation ``current``."""
    target = _receiver(old)
    if isinstance(old, StatefulRoute):
        await _hand_over_keys(old, target, current, in_flight)
    elif isinstance(old, StatelessRoute):
        await _hand_over_parked(old, target, current)


async def _hand_over_parked(old: StatelessRoute, target: RouteActor | None, current: int) -> None:
    parked = [item for item in old.parked.drain() if isinstance(item, Attempt)]
    if not _takes_over(target, old):
        for attempt in parked:
            await _missing(old, attempt, target, current)
        return
    assert isinstance(target, StatelessRoute)
    for attempt in parked:
        target.parked.adopt(attempt, old.parked)
        if target.handing_over:  # retired too, not finished: it passes them on
            target.parked.schedule(trio.current_time(), attempt)
        elif target.parked.closing:  # the sink is closing: given up, as at close
            await target._give_up(attempt)
        else:
            target.counters.retries += 1
            await target._retry(attempt)  # at once, under the new generation


async def _hand_over_keys(
    old: StatefulRoute, target: RouteActor | None, current: int, in_flight: InFlight
) -> None:
    old.parked.drain()  # keys due for a retry: their queues are in `held`
    queues: list[tuple[int, deque[Any]]] = [
        (key, queue) for held in old.held for key, queue in held.items() if queue
    ]
    for held in old.held:
        held.clear()
    if not _takes_over(target, old):
        # In queue order, as at a close: the records fail handler_missing, and
        # a complete, cancel or reopen that waited behind them takes effect
        # then, on this route's state (a complete finalizes what the key
        # processed here; the target's state is not this one).
        for key, queue in queues:
            for item in queue:
                if isinstance(item, Attempt):
                    await _missing(old, item, target, current)
                else:
                    await old._apply({}, item, key, 0, queued=True)
        return
    assert isinstance(target, StatefulRoute)
    # The target has not started (it waits for this route to exit): it takes
    # the queues as its own, ahead of anything it was sent since.
    for key, queue in queues:
        for item in queue:
            if isinstance(item, Attempt):
                target.parked.adopt(item, old.parked)
        target.held[target._owner_of(key)][key] = queue
        target.retry_first.append(key)
        in_flight.add()  # a flush waits until the target has sent the retry (its run())


async def _missing(
    old: RouteActor, attempt: Attempt, target: RouteActor | None, current: int
) -> None:
    processor = old.planned.route.processor
    if target is None:
        why = "the route is not in it"
    else:
        now = target.planned.route.processor
        why = f"the route now runs {now!r}" if now else "the route now forwards"
    attempt.failed(
        FailureCode.HANDLER_MISSING,
        HandlerMissing(
            f"route {old.name!r}: processor {processor!r} is not in configuration "
            f"generation {current} ({why}); the record was parked for a retry"
        ),
        None,
    )
    old._count_failure(attempt)
    await old._give_up(attempt, generation=current)
