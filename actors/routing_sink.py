"""RoutingSink: a RecordSink that routes each batch to per-route pipelines.

Build, then run.  Construction builds and checks everything (the plan, every
route actor and destination actor, inert: ``topology.py``);
:meth:`RoutingSink.run` only runs them, in three nested nurseries::

    sinks       background tasks of the destination sinks it created
      destinations  one actor per destination, mailbox each
        routes      stateless pool workers and stateful owners, mailboxes each

Shutdown is one cascade: :meth:`RoutingSink.close` drains, flushes the
destinations (together) and closes the routes' inputs; when the route actors
have exited, ``run`` closes the destinations' mailboxes; when the
destination actors have exited, it closes the sinks it created.  A
destination that does not finish holds the cascade until its owner's
shutdown grace runs out: :meth:`RoutingSink.cut_short` then cuts it off
(:meth:`DestinationActor.cut`) and the cascade goes on with the others.

``submit`` is the record worker's step: one native pass groups the batch by
route; forward routes hand it to their destination actor inline, the others
queue it in their mailboxes.  A full mailbox makes ``submit`` wait.

The routes belong to a configuration *generation* (``generation.py``):
:meth:`RoutingSink.reload` (``reloading.py``) builds the next one beside the
running one and swaps it in between two batches.

Flush (and waiting for parked records) and restoring what a previous run
parked are :class:`~taproute.actors.sink_flushing.SinkFlushing`; key
controls, dead letters' reroutes (their own path: ``reroute.py``) and
tracing are :class:`~taproute.actors.sink_operations.SinkOperations`; a Trio program
runs the sink with :func:`~taproute.actors.open_sink.open_routing_sink`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from taproute.actors.chain import CausalGate, link_chains
from taproute.actors.counters import ReportsStore, RouterSnapshot, StoreCounters
from taproute.actors.destination import DestinationActor, DestinationSpec
from taproute.actors.generation import Generation
from taproute.actors.inflight import InFlight
from taproute.actors.parking import Parker
from taproute.actors.reroute import Rerouter
from taproute.actors.route_actor import RouteActor
from taproute.actors.sink_flushing import SinkFlushing
from taproute.actors.topology import build_topology
from taproute.actors.turnstile import Turnstile
from taproute.native import UNMATCHED
from taproute.routing.batch import Batch, RecordBatch
from taproute.routing.errors import BatchCutShort, RoutingFailure, SinkClosed
from taproute.routing.failures import FailureHandler, GiveUpLog, log_failure
from taproute.routing.hooks import HookRegistry
from taproute.routing.intake import Intake
from taproute.routing.limits import DESTINATION_QUEUE_BYTES, DESTINATION_QUEUE_RECORDS
from taproute.routing.parking import ParkStore
from taproute.routing.plan import Unmatched
from taproute.routing.predicates import Groups, Verdict, narrow, positions_of
from taproute.routing.processors import REGISTRY, ProcessorRegistry
from taproute.routing.refusals import Decline, RefusalLog
from taproute.routing.root_ledger import RootLedger
from taproute.routing.routes import RoutingConfig
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import BoundsClose


def _name_hooks_of(store: object, hooks: HookRegistry) -> None:
    """A store (the park store, or the owner of a bound ``handle`` given as
    ``on_failure``: ``DeadLetterStore(p).handle``, ``ParkedRecordStore.handle``)
    names its records' hooks from this sink's registry, unless it already has
    one: without names, a letter shows ``#<output_id>`` and no route takes its
    reroute, and a parked record restored by a run that bound its hooks in
    another order would be read as another hook's."""
    attach = getattr(store, "attach_hooks", None)
    if callable(attach) and getattr(store, "hooks", hooks) is None:
        attach(hooks)


def _untaken(records: int, handed_on: Groups) -> int:
    """Of a batch of ``records``, how many no group in ``handed_on`` holds."""
    taken = np.zeros(records, dtype=bool)
    for _, selection in handed_on:
        if selection is None:
            return 0  # the whole batch
        taken[selection] = True
    return records - int(np.count_nonzero(taken))


def _check_kinds(config: object, schema: object, destinations: object) -> None:
    """Refuse, naming it, a positional argument of the wrong kind (a list of
    routes for the config, config and schema swapped, destinations as a list):
    they raised AttributeError deep inside, or (a schema) were taken."""
    for name, value, kind, hint in (
        ("config", config, RoutingConfig, "RoutingConfig([Route(...), ...])"),
        ("schema", schema, RecordSchema, "RecordSchema([Layout(...), ...])"),
        ("destinations", destinations, Mapping, "{name: sink or factory}"),
    ):
        if not isinstance(value, kind):
            what = "a mapping" if kind is Mapping else f"a {kind.__name__}"
            raise TypeError(
                f"RoutingSink: {name} must be {what} ({hint}), found "
                f"{type(value).__name__} {value!r:.80}"
            )


class RoutingSink(SinkFlushing):
    """Routes batches by output_id to forward, stateless and stateful routes.

    Construction checks everything (unknown processor, destination or layout,
    duplicate route names, no default destination, a destination that is
    neither sink nor factory) and builds every actor, inert.  All problems
    are reported together: one raises its
    :class:`~taproute.routing.errors.ConfigError`, several a
    :class:`~taproute.routing.errors.PlanErrors`; each error's ``where`` is
    its location (``routes[2]``, ``destinations.db``).  Nothing runs until
    :meth:`run` is started, by :func:`open_routing_sink` or by the runtime
    it is handed to.

    ``destinations`` maps names to sinks (leased: flushed, never closed) or to
    zero-argument factories (created at start and closed at close).
    Unmatched records go to ``default_destination``, or are dropped and
    counted when ``unmatched="drop"``.  ``destination_capacity`` and
    ``destination_capacity_bytes`` bound each destination's mailbox.
    ``park`` keeps records parked for a retry durably
    (:class:`~taproute.routing.parking.ParkStore`); at start, what a
    previous run left there is tried again.
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
        destination_capacity: int = DESTINATION_QUEUE_RECORDS,
        destination_capacity_bytes: int = DESTINATION_QUEUE_BYTES,
        causal_clock: Callable[[], float] = time.time,
        causal_ledger: RootLedger | None = None,
        park: ParkStore | None = None,
    ) -> None:
        _check_kinds(config, schema, destinations)
        super().__init__(Intake(hooks if hooks is not None else HookRegistry(), schema))
        self._parker = Parker(park)
        self.schema = schema
        self._on_failure = on_failure
        self._registry = registry
        _name_hooks_of(getattr(on_failure, "__self__", None), self.hooks)
        _name_hooks_of(park, self.hooks)
        #: The stores give-ups and parked records go to that say whether they
        #: take writes (a dead-letter file another process holds locked).
        self._stores = [
            owner
            for owner in (getattr(on_failure, "__self__", None), park)
            if isinstance(owner, ReportsStore)
        ]
        #: Every give-up of every route is logged here (rate-limited per route).
        self.give_up_log = GiveUpLog()
        self._in_flight = InFlight()
        self._lock = Turnstile()
        self._rerouter = Rerouter(
            lock=self._lock,
            check_open=self._check_open,
            check=self.intake.check,
            parker=self._parker,
        )
        topology = build_topology(
            config,
            schema,
            destinations,
            default_destination,
            unmatched=unmatched,
            hooks=self.hooks,
            registry=registry,
            on_failure=on_failure,
            destination_capacity=destination_capacity,
            destination_capacity_bytes=destination_capacity_bytes,
            latch=self._latch,
            in_flight=self._in_flight,
            give_up_log=self.give_up_log,
            copy_of=self._rerouter.copy_of,
            parker=self._parker,
        )
        self._destinations = topology.destinations
        self._available = topology.available
        self._sinks_nursery: trio.Nursery | None = None
        self._destinations_nursery: trio.Nursery | None = None
        self._gen = Generation(config, topology.plan, topology.routes, topology.default, self.hooks)
        self._gen.number = 1
        self._rerouter.routes = topology.by_name
        #: Admits derived records under the causal limits (chains); one for
        #: every generation, so roots in flight keep their pinned limits.
        self.causal = CausalGate(
            config.causal_limits,
            ledger=causal_ledger,
            clock=causal_clock,
            on_failure=on_failure,
            give_up_log=self.give_up_log,
            latch=self._latch,
        )
        link_chains(self.plan, self._gen.routes, self.hooks, self.schema, self.causal)
        #: Recent records no route took, per hook, with each route's refusal.
        self.refusals = RefusalLog()
        #: Routes of earlier generations still draining.
        self._retiring: list[RouteActor] = []
        self._unmatched_forwarded = 0
        self._unmatched_dropped = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._started = False
        self._blocking_budget: float | None = None
        self._closing = False
        #: A shutdown's grace ran out with routes still processing: close
        #: stops waiting for them (see :meth:`cut_routes`).
        self._routes_cut = False
        self._idle_scope: trio.CancelScope | None = None
        self._close_inputs = trio.Event()
        self._stopped = trio.Event()

    def use_blocking_budget(self, seconds: float) -> None:
        """Hand the runtime's ``max_block`` to each destination that bounds its
        own waits, as it is opened (:class:`~taproute.routing.sink.BoundsBlocking`)."""
        if self._started:
            raise RuntimeError("use_blocking_budget() must be called before run()")
        self._blocking_budget = seconds

    # -- lifecycle ---------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run every actor built at construction; returns once :meth:`close` has
        closed the routes' inputs and the cascade has closed everything behind them."""
        if self._started:
            raise RuntimeError("RoutingSink.run() can only be started once")
        self._started = True
        self._token = trio.lowlevel.current_trio_token()
        try:
            for destination in self._destinations.values():
                destination.open(self.hooks, self._blocking_budget)  # owned: created now
            async with trio.open_nursery() as sinks:
                for destination in self._destinations.values():
                    if destination.background is not None:
                        await sinks.start(destination.run_background)
                async with trio.open_nursery() as destinations:
                    for destination in self._destinations.values():
                        destinations.start_soon(destination.run)
                    # A reload may start more destinations in these.
                    self._sinks_nursery, self._destinations_nursery = sinks, destinations
                    async with trio.open_nursery() as routes:
                        for route in self._gen.routes:
                            await routes.start(self._run_route, route)
                        routes.start_soon(self._close_inputs_when_asked)
                        self._nursery = routes  # rerouted copies are sent from here
                        await self._restore_parked()
                        task_status.started()
                    # Cut (cut_routes) before close() came: the destinations
                    # still serve a flush until close() asks for the rest.
                    await self._close_inputs.wait()
                    # The routes' inputs were closed and they drained: so do the destinations.
                    for destination in self._destinations.values():
                        destination.mailbox.close()
                # Nothing more reaches the sinks: close those created here.
                for destination in self._destinations.values():
                    with suppress(RoutingFailure):  # latched; close() raises it
                        await destination.close()
        finally:
            # On a normal exit everything has drained; when the run was
            # cancelled or raised, what is still queued or parked is let go
            # here, so every accepted batch's release runs exactly once.
            for route in [*self._gen.routes, *self._retiring]:
                route.abandon()
            for destination in self._destinations.values():
                destination.abandon()
            self._parker.release()
            self._stopped.set()
            self._gen.detach()
            for destination in self._destinations.values():
                await destination.release_if_unclosed()  # not closed, not released yet

    async def _close_inputs_when_asked(self) -> None:
        await self._close_inputs.wait()
        for route in self._gen.routes:
            route.close()

    @property
    def running(self) -> bool:
        """True between the start of :meth:`run` and the end of the shutdown cascade."""
        return self._started and not self._stopped.is_set()

    def _closed_reason(self) -> str | None:
        return "routing sink is closed" if self._closing else None

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
        holds its own lease.  Raises the latched failure, if any.  A batch
        that cannot be routed (an unbound output_id, a record range outside
        the buffer, an unknown layout_id, a payload length its layout does
        not allow) is refused whole, as the runtime's ``submit_batch`` does
        (:meth:`Intake.check <taproute.routing.intake.Intake.check>`).
        """
        self._check_open()
        if not isinstance(batch, RecordBatch):
            raise TypeError(f"RoutingSink routes RecordBatch objects, got {type(batch).__name__}")
        # The runtime's check, the same native pass: a batch that cannot be
        # routed is refused whole, before any record of it is accepted.
        self.intake.check(batch)
        await self.submit_checked(batch)

    async def submit_checked(self, batch: RecordBatch) -> None:
        """Route a batch :attr:`intake` already checked (a runtime hosting this
        sink checked it where the producer handed it in): :meth:`submit` without
        the check, which a batch passes once.

        An unexpected failure after routes took their part of the batch is
        latched and raised as :class:`BatchCutShort`, which says how many of
        its records nothing took (the others are counted where they went).
        """
        self._check_open()
        async with self._lock:
            gen = self._gen  # swapped only under the lock: one generation per batch
            groups = gen.table.group(batch.descriptors)
            declines: list[Decline] = []
            if gen.has_predicates:
                groups = await self._apply_predicates(batch, groups, declines)
            routes = gen.routes
            done = 0  # groups handed on (a route's dispatch raises before it takes any)
            try:
                for index, selection in groups:
                    part = batch.select(selection)
                    if index == UNMATCHED:
                        self.refusals.note(
                            batch.descriptors,
                            positions_of(selection, len(batch)),
                            declines,
                            self.hooks.name_of,
                        )
                        await self._unmatched(part)
                    else:
                        await routes[index].dispatch_here(part)
                    done += 1
            except Exception as exc:
                if not done:
                    raise  # nothing taken: the caller's to count, whole
                route = None if index == UNMATCHED else routes[index].name
                latched = self._latch.latch(exc, route=route, where="routing sink submit")
                untaken = _untaken(len(batch), groups[:done])
                raise BatchCutShort(latched, untaken=untaken) from exc

    async def _apply_predicates(
        self, batch: RecordBatch, groups: Groups, declines: list[Decline]
    ) -> Groups:
        """Each route's predicate on its group, under the route's deadline; a
        route whose predicate failed has given those records up (not the router).
        What each predicate declined is counted and noted in ``declines``."""
        n = len(batch)
        gen = self._gen
        verdicts: dict[int, Verdict] = {}
        for index, selection in groups:
            if index != UNMATCHED and gen.plan.routes[index].route.predicate is not None:
                part = batch.select(selection)
                verdicts[index] = await gen.routes[index].screen(part)

        def declined(index: int, positions: npt.NDArray[np.intp], reason: str) -> None:
            counters = gen.routes[index].counters
            counters.declined += len(positions)
            counters.last_decline = reason
            declines.append((gen.routes[index].name, positions, reason))

        return narrow(groups, n, verdicts, declined)

    async def _unmatched(self, batch: RecordBatch) -> None:
        default = self._gen.default
        if default is None:
            self._unmatched_dropped += len(batch)
            return
        await default.deliver(None, batch)
        self._unmatched_forwarded += len(batch)  # taken (a deliver that raised took none)

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
            self._gen.detach()
            return
        async with self._lock:
            try:
                if not self._stopped.is_set():
                    with trio.CancelScope() as self._idle_scope:
                        if not self._routes_cut:
                            await self._in_flight.wait_idle()
                    if self._latch.failure is None:
                        # Together: one destination whose flush does not
                        # return holds up none of the others.
                        async with trio.open_nursery() as flushes:
                            for actor in self._destinations.values():
                                if actor.owned and isinstance(actor.sink, BoundsClose):
                                    # Its close() below flushes within its own
                                    # bound (a ClickHouse sink's close_timeout); a
                                    # plain flush here would wait out a silent
                                    # server (300 s).
                                    continue
                                flushes.start_soon(self._flush_for_close, actor)
            finally:
                self._close_inputs.set()  # run() cascades the rest
                await self._stopped.wait()
        self._latch.raise_if_failed()

    @staticmethod
    async def _flush_for_close(actor: DestinationActor) -> None:
        with suppress(RoutingFailure):  # latched; close() raises it
            await actor.flush()

    def cut_short(self) -> dict[str, str]:
        """Cut off every destination still busy (its call under way, or batches
        queued for it); returns ``{destination: what kept it busy}`` for those
        cut now.  For the runtime, when its shutdown grace ran out during
        :meth:`close`: the cascade then finishes with the other destinations,
        which are flushed and closed as usual (see :meth:`DestinationActor.cut`)."""
        cut = self.busy()
        for name in cut:
            self._destinations[name].cut()
        return cut

    def cut_routes(self) -> tuple[str, ...]:
        """Stop waiting for the routes still processing (a processor that
        outlives a shutdown's grace): their actors are cancelled (a call in a
        worker thread is abandoned), what they held is given back and counted
        as abandoned once they are gone, and :meth:`close` goes on to flush and
        close the destinations with what the routes had delivered, instead of
        leaving them unflushed when the loop is cancelled (a flush waiting for
        them raises :class:`FlushCutOff`).  For a closing runtime whose grace
        runs out; returns the routes that were busy (none: nothing cut)."""
        if self._routes_cut or self._nursery is None:
            return ()
        busy = tuple(r.name for r in [*self._gen.routes, *self._retiring] if r.counters.backlog > 0)
        if not busy:
            return ()
        self._routes_cut = True
        if self._idle_scope is not None:
            self._idle_scope.cancel()
        self._nursery.cancel_scope.cancel()
        # Their queued batches go back now, not when the run ends: a flush
        # waiting for them (holding the sink's lock) then lets the close on.
        for route in [*self._gen.routes, *self._retiring]:
            route.abandon()
        return busy

    def busy(self) -> dict[str, str]:
        """``{destination: what keeps it busy}`` for every destination not cut
        off that has a call under way or batches queued (see :meth:`cut_short`)."""
        busy = {}
        for name, actor in list(self._destinations.items()):
            what = None if actor.is_cut else actor.busy
            if what is not None:
                busy[name] = what
        return busy

    # -- observation -------------------------------------------------------

    def snapshot(self) -> RouterSnapshot:
        """Every route's and destination's counters and live state, at one moment."""
        failure = self._latch.failure
        return RouterSnapshot(
            routes={r.name: self._route_snapshot(r) for r in self._gen.routes},
            destinations={name: a.snapshot() for name, a in self._destinations.items()},
            unmatched_forwarded=self._unmatched_forwarded,
            unmatched_dropped=self._unmatched_dropped,
            failure=None if failure is None else str(failure),
            causal=self.causal.snapshot(),
            unmatched_samples=self.refusals.by_hook(),
            generation=self._gen.number,
            stores=self.store_status(),
        )

    def store_status(self) -> dict[str, StoreCounters]:
        """Each store give-ups and parked records are written to, by name (one
        file shared by the dead letters and the park store is one store)."""
        return {status.name: status for status in (s.store_status() for s in self._stores)}
