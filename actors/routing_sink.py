"""RoutingSink: a RecordSink that routes each batch to per-route pipelines.

The nursery tree::

    RoutingSink.run                      (one nursery)
      ├─ destination actors              one per destination, mailbox each
      ├─ stateless pool workers          N per stateless route, shared mailbox
      └─ stateful owner actors           N per stateful route, mailbox each

``submit`` is the record worker's step: one native pass groups the batch by
route; forward routes hand it to their destination actor inline, the others
queue it in their mailboxes.  A full mailbox makes ``submit`` wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from taproute.actors.counters import RouterSnapshot
from taproute.actors.destination import DestinationActor
from taproute.actors.forward import ForwardRoute
from taproute.actors.inflight import InFlight
from taproute.actors.latch import FailureLatch
from taproute.actors.owners import StatefulRoute
from taproute.actors.pool import StatelessRoute
from taproute.actors.route_actor import RouteActor
from taproute.actors.turnstile import Turnstile
from taproute.native import UNMATCHED, RouteTable
from taproute.routing.batch import Batch, RecordBatch
from taproute.routing.errors import ConfigError, RoutingFailure, SinkClosed
from taproute.routing.failures import FailureHandler, log_failure
from taproute.routing.hooks import HookRegistry
from taproute.routing.plan import RoutePlan, Unmatched
from taproute.routing.processors import REGISTRY, ProcessorRegistry
from taproute.routing.routes import RouteMode, RoutingConfig
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import RecordSink
from taproute.routing.trace import TraceResult, evaluate_predicate, trace

#: A destination given as a sink is leased; given as a factory, the routing
#: sink creates it at start and closes it at close.
DestinationSpec = RecordSink | Callable[[], RecordSink]

_ROUTE_KINDS: dict[RouteMode, type[RouteActor]] = {
    RouteMode.FORWARD: ForwardRoute,
    RouteMode.STATELESS: StatelessRoute,
    RouteMode.STATEFUL: StatefulRoute,
}


def _is_sink(value: object) -> bool:
    """A sink instance (a sink *class* is a factory, though it has the methods)."""
    return not isinstance(value, type) and isinstance(value, RecordSink)


class RoutingSink:
    """Routes batches by output_id to forward, stateless and stateful routes.

    Construction checks everything (unknown processor, destination or layout,
    duplicate route names, no default destination) and raises a
    :class:`~taproute.routing.errors.ConfigError` naming it; nothing runs
    until :meth:`run` is started, by :func:`open_routing_sink` or by the
    runtime it is handed to.

    ``destinations`` maps names to sinks (leased: flushed, never closed) or to
    zero-argument factories (created at start and closed at close).
    Unmatched records go to ``default_destination``, or are dropped and
    counted when ``unmatched="drop"``.  ``destination_capacity`` and
    ``destination_capacity_bytes`` bound each destination's mailbox.
    """

    def __init__(
        self,
        config: RoutingConfig,
        schema: RecordSchema,
        destinations: Mapping[str, DestinationSpec],
        default_destination: str | None = None,
        *,
        unmatched: Unmatched = "default",
        hooks: HookRegistry | None = None,
        registry: ProcessorRegistry = REGISTRY,
        on_failure: FailureHandler = log_failure,
        destination_capacity: int = 262_144,
        destination_capacity_bytes: int = 512 * 2**20,
    ) -> None:
        self.hooks = hooks if hooks is not None else HookRegistry()
        self.schema = schema
        self.config = config
        self.plan = RoutePlan(
            config,
            schema,
            destinations=destinations,
            default_destination=default_destination,
            unmatched=unmatched,
            registry=registry,
            bound_names=self.hooks.names(),
        )
        for name, spec in destinations.items():
            if not (_is_sink(spec) or callable(spec)):
                raise ConfigError(
                    f"destination {name!r}: expected a RecordSink (submit/flush/close) or a "
                    f"factory returning one, got {type(spec).__name__}"
                )
        self._destination_specs = dict(destinations)
        self._destination_capacity = (destination_capacity, destination_capacity_bytes)
        self._on_failure = on_failure
        self._latch = FailureLatch()
        self._in_flight = InFlight()
        self._table = RouteTable(len(self.plan.routes))
        self._unsubscribe = self.hooks.subscribe(self._on_bind)
        self._destinations: dict[str, DestinationActor] = {}
        self._routes: list[RouteActor] = []
        self._default: DestinationActor | None = None
        self._unmatched_forwarded = 0
        self._unmatched_dropped = 0
        self._lock = Turnstile()
        self._has_predicates = any(p.route.predicate is not None for p in self.plan.routes)
        self._started = False
        self._closing = False
        self._stopped = trio.Event()
        self._route_actors_done = trio.Event()
        self._destination_actors_done = trio.Event()
        self._sinks_closed = trio.Event()

    # -- hook binding ------------------------------------------------------

    def _on_bind(self, name: str, output_id: int) -> None:
        """Resolve a (possibly late) hook binding into the native table."""
        self._table.assign(output_id, self.plan.routes_for(name))

    def bind_hook(self, name: str, *, layout: str | None = None) -> int:
        """Bind ``name`` in this sink's hook registry; returns its output_id."""
        return self.hooks.bind(name, layout=layout)

    # -- lifecycle ---------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Host every actor; returns after :meth:`close` has drained and closed them."""
        if self._started:
            raise RuntimeError("RoutingSink.run() can only be started once")
        self._started = True
        try:
            self._build_actors()
            async with trio.open_nursery() as sinks_nursery:
                # Background tasks of the sinks this routing sink created.
                for actor in self._destinations.values():
                    run_sink = getattr(actor.sink, "run", None)
                    if actor.owned and run_sink is not None:
                        await sinks_nursery.start(run_sink)
                async with trio.open_nursery() as destinations_nursery:
                    for actor in self._destinations.values():
                        destinations_nursery.start_soon(actor.run)
                    async with trio.open_nursery() as routes_nursery:
                        for route in self._routes:
                            await route.run(routes_nursery)
                        task_status.started()
                    # Route actors have drained and exited (close() closed their mailboxes).
                    self._route_actors_done.set()
                self._destination_actors_done.set()
                await self._sinks_closed.wait()  # close() closes the owned sinks
        finally:
            self._route_actors_done.set()
            self._destination_actors_done.set()
            self._stopped.set()
            self._unsubscribe()

    def _build_actors(self) -> None:
        capacity, capacity_bytes = self._destination_capacity
        for name in self.plan.destinations_used:
            spec = self._destination_specs[name]
            owned = not _is_sink(spec)
            made: object = spec() if owned else spec  # type: ignore[operator]
            if not isinstance(made, RecordSink) or isinstance(made, type):
                raise ConfigError(
                    f"destination {name!r}: factory returned {type(made).__name__}, "
                    "not a RecordSink"
                )
            sink: RecordSink = made
            attach_hooks = getattr(sink, "attach_hooks", None)
            if attach_hooks is not None:
                attach_hooks(self.hooks)
            if not owned and getattr(sink, "running", True) is False:
                raise ConfigError(
                    f"destination {name!r} is a leased sink whose run() task is not running; "
                    "start it first, or give a factory so the routing sink owns it"
                )
            self._destinations[name] = DestinationActor(
                name,
                sink,
                owned=owned,
                latch=self._latch,
                in_flight=self._in_flight,
                capacity_records=capacity,
                capacity_bytes=capacity_bytes,
                undeliverable=self._undeliverable,
            )
        for planned in self.plan.routes:
            kind = _ROUTE_KINDS[planned.route.mode]
            self._routes.append(
                kind(
                    planned,
                    self._destinations[planned.route.destination],
                    latch=self._latch,
                    in_flight=self._in_flight,
                    on_failure=self._on_failure,
                    hook_name=self.hooks.name_of,
                )
            )
        if self.plan.default_destination is not None:
            self._default = self._destinations[self.plan.default_destination]

    async def _undeliverable(self, route: str, batch: RecordBatch, error: BaseException) -> None:
        for actor in self._routes:
            if actor.name == route:
                await actor.undeliverable(batch, error)
                return
        self._latch.latch(error, route=route, where="destination refused records")

    def _check_open(self) -> None:
        self._latch.raise_if_failed()
        if self._closing:
            raise SinkClosed("routing sink is closed")
        if not self._started:
            raise RuntimeError(
                "routing sink is not running: use `async with open_routing_sink(...)` or hand "
                "it to create_record_runtime(record_sink=...)"
            )

    # -- RecordSink --------------------------------------------------------

    async def submit(self, batch: Batch) -> None:
        """Route one batch; waits while a route or destination mailbox is full.

        The caller keeps its own hold on the batch's buffer and releases it
        after this returns; every route and destination that takes the batch
        holds its own lease.  Raises the latched failure, if any.
        """
        self._check_open()
        if not isinstance(batch, RecordBatch):
            raise TypeError(f"RoutingSink routes RecordBatch objects, got {type(batch).__name__}")
        async with self._lock:
            groups = self._table.group(batch.descriptors)
            if self._has_predicates:
                groups = self._apply_predicates(batch, groups)
            routes = self._routes
            for index, selection in groups:
                part = batch.select(selection)
                if index == UNMATCHED:
                    await self._unmatched(part)
                else:
                    await routes[index].dispatch(part)

    def _apply_predicates(
        self, batch: RecordBatch, groups: list[tuple[int, npt.NDArray[np.intp] | None]]
    ) -> list[tuple[int, npt.NDArray[np.intp] | None]]:
        """Narrow each group by its route's predicate; what no route takes is unmatched."""
        n = len(batch)
        taken = np.zeros(n, dtype=bool)
        unmatched: list[npt.NDArray[np.intp]] = []
        narrowed: list[tuple[int, npt.NDArray[np.intp] | None]] = []
        for index, selection in groups:
            positions = np.arange(n) if selection is None else selection
            if index == UNMATCHED:
                unmatched.append(positions)
                continue
            route = self._routes[index]
            if route.planned.route.predicate is not None:
                try:
                    mask, reason = evaluate_predicate(route.planned, batch.descriptors[positions])
                except Exception as exc:  # a broken predicate is a bug: stop loudly
                    raise self._latch.latch(exc, route=route.name, where="route predicate") from exc
                declined = int(len(mask) - mask.sum())
                if declined:
                    route.counters.declined += declined
                    route.counters.last_decline = reason
                positions = positions[mask]
            if len(positions):
                taken[positions] = True
                narrowed.append((index, positions))
        routed_nowhere = np.flatnonzero(~taken)
        if len(routed_nowhere):
            narrowed.append((UNMATCHED, routed_nowhere))
        return narrowed

    def trace(self, hook: str, **fields: Any) -> TraceResult:
        """Where a record of ``hook`` with these descriptor fields would go, and why.

        A dry run: route predicates run, nothing else (no processor, no write).
        """
        layout = fields.pop("layout", None)
        if layout is not None:
            fields["layout_id"] = self.schema.layout_id(layout)
        bound = self.hooks.id_of(hook)
        return trace(self.plan, hook, output_id=bound or 0, **fields)

    async def _unmatched(self, batch: RecordBatch) -> None:
        if self._default is None:
            self._unmatched_dropped += len(batch)
            return
        self._unmatched_forwarded += len(batch)
        await self._default.deliver(None, batch)

    async def flush(self) -> None:
        """Wait until every route and pool has drained, then flush every destination.

        Returns once everything submitted before it is in the destinations;
        raises the first latched failure.
        """
        self._check_open()
        async with self._lock:
            await self._drain_and_flush()

    async def _drain_and_flush(self) -> None:
        await self._in_flight.wait_idle()
        self._latch.raise_if_failed()
        for actor in self._destinations.values():
            await actor.flush()
        self._latch.raise_if_failed()

    async def close(self) -> None:
        """Drain, flush, close the destinations this sink created, stop every actor.

        Idempotent.  Raises the latched failure, if any, after shutting down.
        """
        if self._closing:
            await self._stopped.wait()
            self._latch.raise_if_failed()
            return
        self._closing = True
        if not self._started:
            self._stopped.set()
            self._unsubscribe()
            return
        async with self._lock:
            try:
                if not self._stopped.is_set():
                    await self._in_flight.wait_idle()
                    if self._latch.failure is None:
                        for actor in self._destinations.values():
                            with suppress(RoutingFailure):  # latched; raised below
                                await actor.flush()
            finally:
                # Routes first, so what they still emit reaches open destination mailboxes.
                for route in self._routes:
                    route.close()
                await self._route_actors_done.wait()
                for actor in self._destinations.values():
                    actor.mailbox.close()
                await self._destination_actors_done.wait()
                try:
                    for actor in self._destinations.values():
                        with suppress(RoutingFailure):  # latched; raised below
                            await actor.close()
                finally:
                    self._sinks_closed.set()
                await self._stopped.wait()
        self._latch.raise_if_failed()

    # -- observation -------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The latched failure, or None."""
        return self._latch.failure

    def counters(self) -> RouterSnapshot:
        """A snapshot of every route's and destination's counters."""
        failure = self._latch.failure
        return RouterSnapshot(
            routes={r.name: r.snapshot() for r in self._routes},
            destinations={name: a.snapshot() for name, a in self._destinations.items()},
            unmatched_forwarded=self._unmatched_forwarded,
            unmatched_dropped=self._unmatched_dropped,
            failure=None if failure is None else str(failure),
        )


@asynccontextmanager
async def open_routing_sink(
    config: RoutingConfig,
    schema: RecordSchema,
    destinations: Mapping[str, DestinationSpec],
    default_destination: str | None = None,
    **kwargs: Any,
) -> AsyncIterator[RoutingSink]:
    """Run a :class:`RoutingSink` inside the calling Trio program (no thread).

    ::

        async with open_routing_sink(config, schema, {"capture": capture},
                                     default_destination="capture") as sink:
            await sink.submit(batch)
            await sink.flush()

    On normal exit the sink is closed (drained, flushed); the latched failure,
    if any, is raised.
    """
    sink = RoutingSink(config, schema, destinations, default_destination, **kwargs)
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        try:
            yield sink
        except BaseException as exc:
            # Raised below, after the nursery, so the caller sees its own
            # exception rather than an ExceptionGroup around it.
            error = exc
            nursery.cancel_scope.cancel()
        else:
            try:
                await sink.close()
            except RoutingFailure as exc:
                error = exc
    if error is not None:
        raise error
