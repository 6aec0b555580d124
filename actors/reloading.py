"""The configuration generations of a routing sink: building the next one
beside the running one, swapping it in, tracing candidates and samples.

:class:`Reloading` is the part of :class:`~taproute.actors.routing_sink.RoutingSink`
that knows generations exist (``generation.py`` holds what a generation is
and how a retired route hands over); the sink's batch path only reads its
current generation, under the lock a swap takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import trio

from taproute.actors.chain import CausalGate, link_chains
from taproute.actors.counters import RouteCounters, RouterSnapshot
from taproute.actors.destination import DestinationActor
from taproute.actors.generation import Generation, link, prepare_generation, run_route
from taproute.actors.inflight import InFlight
from taproute.actors.parking import Parker
from taproute.actors.reroute import Rerouter
from taproute.actors.route_actor import RouteActor
from taproute.actors.topology import route_actors
from taproute.actors.turnstile import Turnstile
from taproute.routing.errors import ConfigError, at
from taproute.routing.failures import FailureHandler, GiveUpLog
from taproute.routing.plan import RoutePlan, Unmatched
from taproute.routing.processors import ProcessorRegistry
from taproute.routing.producer import Producer
from taproute.routing.routes import RoutingConfig
from taproute.routing.samples import SampleTraces, trace_samples
from taproute.routing.schema import RecordSchema

if TYPE_CHECKING:
    from taproute.routing.trace import TraceResult


class Reloading(Producer[RouterSnapshot]):
    """Configuration generations for a routing sink (which sets every attribute
    declared here in its constructor and ``run``)."""

    schema: RecordSchema
    causal: CausalGate
    give_up_log: GiveUpLog
    _gen: Generation
    _lock: Turnstile
    _in_flight: InFlight
    _rerouter: Rerouter
    _registry: ProcessorRegistry
    _on_failure: FailureHandler
    _parker: Parker
    _available: dict[str, DestinationActor]
    _destinations: dict[str, DestinationActor]
    _sinks_nursery: trio.Nursery | None
    _destinations_nursery: trio.Nursery | None
    _nursery: trio.Nursery | None
    _blocking_budget: float | None
    #: Routes of earlier generations still draining.
    _retiring: list[RouteActor]

    def _check_open(self) -> None:
        raise NotImplementedError

    def trace(self, hook: str, **fields: Any) -> TraceResult:
        """Where a record of ``hook`` would go under the running generation."""
        raise NotImplementedError

    @property
    def plan(self) -> RoutePlan:
        """The running generation's route plan."""
        return self._gen.plan

    @property
    def config(self) -> RoutingConfig:
        """The running generation's routes."""
        return self._gen.config

    @property
    def generation(self) -> int:
        """The number of the generation routing new records (1 until a reload)."""
        return self._gen.number

    async def _run_route(
        self, actor: RouteActor, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        await run_route(
            actor,
            current=lambda: self._gen.number,
            in_flight=self._in_flight,
            latch=self._latch,
            retiring=self._retiring,
            task_status=task_status,
        )

    def prepare(
        self,
        config: RoutingConfig,
        *,
        default_destination: str | None = None,
        unmatched: Unmatched | None = None,
        registry: ProcessorRegistry | None = None,
    ) -> Generation:
        """Build and check the next generation beside the running one (any thread;
        nothing runs): every check construction makes, all problems in one
        error, each at its location.  ``default_destination``/``unmatched``
        (None: as now) and ``registry`` (None: the sink's) as at construction;
        routes may use any destination the sink was given (one not running yet
        is started at the swap).  :meth:`swap` applies it."""
        if not isinstance(config, RoutingConfig):
            raise ConfigError(
                f"reload takes a RoutingConfig, found {type(config).__name__} {config!r:.80}"
            )
        current = self._gen.plan
        return prepare_generation(
            config,
            self.schema,
            available=self._available,
            default_destination=(
                current.default_destination if default_destination is None else default_destination
            ),
            unmatched=current.unmatched if unmatched is None else unmatched,
            registry=self._registry if registry is None else registry,
            hooks=self.hooks,
            build=self._build_routes,
        )

    def _build_routes(self, plan: RoutePlan) -> list[RouteActor]:
        """A reload's route actors, inert, with their chains under this sink's gate."""
        routes = route_actors(
            plan,
            self._available,
            latch=self._latch,
            in_flight=self._in_flight,
            on_failure=self._on_failure,
            hooks=self.hooks,
            give_up_log=self.give_up_log,
            copy_of=self._rerouter.copy_of,
            parker=self._parker,
        )
        link_chains(plan, routes, self.hooks, self.schema, self.causal)
        return routes

    async def swap(self, generation: Generation) -> int:
        """Route new batches under ``generation`` (from :meth:`prepare`), between
        two batches; returns its number.  Batches accepted before finish under
        the generation that accepted them; what its routes park is handed on
        when they have drained (see ``generation.py``)."""
        async with self._lock:
            try:
                self._check_open()
                await self._start_destinations(generation.plan.destinations_used)
            except BaseException:
                generation.detach()
                raise
            old = self._gen
            generation.number = old.number + 1
            # New roots get the new limits; roots in flight keep those pinned
            # in the ledger when their first derived record was accepted.
            self.causal.limits = generation.config.causal_limits
            link(generation, old)
            for actor in generation.routes:
                actor.generation = generation.number
            self._gen = generation
            self._rerouter.routes = generation.by_name
            old.detach()
            for actor in old.routes:
                if not actor.tasks_done:  # a forward route has no tasks: nothing to drain
                    self._in_flight.add()  # until it drained and handed over (run_route)
                    self._retiring.append(actor)
                actor.retire()
            assert self._nursery is not None
            for actor in generation.routes:
                self._nursery.start_soon(self._run_route, actor)
        return generation.number

    async def _start_destinations(self, names: list[str]) -> None:
        """Start the destinations ``names`` that are not running yet (a reload
        routes to one the first generation did not use); an owned sink is
        created now, and one that fails to open is a problem at its location."""
        for name in names:
            if name in self._destinations:
                continue
            actor = self._available[name]
            try:
                actor.open(self.hooks, self._blocking_budget)
            except ConfigError as exc:
                raise at(exc, f"destinations.{name}") from None
            assert self._sinks_nursery is not None and self._destinations_nursery is not None
            if actor.background is not None:
                await self._sinks_nursery.start(actor.run_background)
            self._destinations_nursery.start_soon(actor.run)
            self._destinations[name] = actor

    async def reload(
        self,
        config: RoutingConfig,
        *,
        default_destination: str | None = None,
        unmatched: Unmatched | None = None,
        registry: ProcessorRegistry | None = None,
    ) -> int:
        """:meth:`prepare` then :meth:`swap`: returns the new generation's number.
        A configuration that fails its checks raises them all and changes nothing."""
        generation = self.prepare(
            config, default_destination=default_destination, unmatched=unmatched, registry=registry
        )
        return await self.swap(generation)

    def trace_candidate(
        self,
        config: RoutingConfig,
        hook: str,
        *,
        default_destination: str | None = None,
        unmatched: Unmatched | None = None,
        registry: ProcessorRegistry | None = None,
        **fields: Any,
    ) -> TraceResult:
        """:meth:`trace` against ``config``, a candidate not applied: checked as a
        reload would check it (every problem raised), routed with this sink's
        hooks and destinations; the result's ``generation`` reads ``"candidate"``."""
        from taproute.routing.trace import trace_descriptor, traced_descriptor

        current = self._gen.plan
        plan = RoutePlan(
            config,
            self.schema,
            destinations=self._available,
            default_destination=(
                current.default_destination if default_destination is None else default_destination
            ),
            unmatched=current.unmatched if unmatched is None else unmatched,
            registry=self._registry if registry is None else registry,
            bound_names=self.hooks.names(),
        )
        descriptors = traced_descriptor(self.hooks, self.schema, hook, **fields)
        return trace_descriptor(plan, hook, descriptors, generation="candidate")

    def trace_samples(self, *, now_ns: int | None = None, bind: bool = False) -> SampleTraces:
        """Trace every sample the running generation's processors and predicates
        offer (see :mod:`taproute.routing.samples`), in route order; ``now_ns``:
        the clock the samplers get (default: now)."""
        return trace_samples(self._gen.plan, self.trace, self.hooks, now_ns=now_ns, bind=bind)

    def _route_snapshot(self, actor: RouteActor) -> RouteCounters:
        """``actor``'s counters; the queue depth includes what earlier generations'
        routes counting in the same counters still hold."""
        snap = actor.snapshot()
        earlier = sum(
            m.records for r in self._retiring if r.counters is actor.counters for m in r.mailboxes
        )
        return attrs.evolve(snap, queue_depth=snap.queue_depth + earlier) if earlier else snap
