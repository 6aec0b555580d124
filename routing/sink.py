"""The destination contract every sink fulfils, and the optional capabilities a
sink may declare.

:class:`RecordSink` is the contract: three methods.  A sink may also offer a
few declared capabilities, each a small protocol.  Whoever holds a sink (a
destination actor, the runtime) checks them once, when it takes the sink,
keeps the typed reference, and never probes the sink again:

- :class:`RunsInBackground`: the sink needs a task on the loop (``run``) and
  says whether it is running (a leased sink must be started by its owner);
- :class:`NamesHooks`: the sink names records' hooks, so it is handed the
  hook registry the producer binds in (``use_hooks``) before its first batch;
- :class:`DescribesRecords`: the sink knows the schema and hook registry
  records are checked and bound against (a routing sink: the runtime uses
  them as its defaults);
- :class:`ReportsFailure`: the sink latches its first failure (``failure``);
- :class:`Traceable`: the sink answers dry-run ``trace`` questions;
- :class:`Spools`: the sink keeps a disk spool and reports the
  destination's health and what the spool holds (:class:`SpoolStatus`);
- :class:`EndsKeys`: the sink can complete, cancel and reopen keys;
- :class:`TakesCheckedBatches`: the sink checks what it is given with an
  :class:`~taproute.routing.intake.Intake`, and takes batches that intake
  already checked without checking them again (a runtime sharing it checks
  each batch once, where the producer hands it in);
- :class:`Reloads`: the sink's routes can be replaced by a new configuration
  generation while it runs;
- :class:`CutsShort`: the sink can stop waiting for its destinations still
  busy when a shutdown's grace runs out (a routing sink cuts them off).
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from taproute.routing.batch import Batch, RecordBatch
from taproute.routing.hooks import HookRegistry
from taproute.routing.intake import Intake
from taproute.routing.processors import ProcessorRegistry
from taproute.routing.routes import RoutingConfig
from taproute.routing.schema import RecordSchema


@runtime_checkable
class RecordSink(Protocol):
    """Where batches go: ClickHouse, a capture buffer, another routing sink.

    All three methods are awaited on the Trio loop, one at a time per sink:

    - ``submit(batch)`` takes one batch (a raw ``RecordBatch`` or processed
      ``RowBatch``).  A sink that keeps a ``RecordBatch`` past the call must
      ``batch.retain()`` it (and release later); otherwise the producer may
      reuse the buffer as soon as every holder returns.  Slow work (network,
      disk) belongs in a worker thread, not on the loop.
    - ``flush()`` returns once everything submitted before it is durable in
      the destination, or raises.  What it returns is the sink's own report
      (a routing sink's :class:`~taproute.routing.flush_report.FlushReport`);
      callers may ignore it.
    - ``close()`` flushes and frees resources; nothing may be submitted after.
    """

    async def submit(self, batch: Batch) -> None: ...

    async def flush(self) -> object: ...

    async def close(self) -> None: ...


def not_async(sink: object) -> str | None:
    """What is wrong with ``sink``'s ``submit``/``flush``/``close`` when some are
    written as plain functions (``def``, not ``async def``): the contract awaits
    them, so the first call would fail with "object NoneType can't be used in
    'await' expression".  None when none is.  A wrapper that hands on a
    coroutine (``functools.wraps``: it has ``__wrapped__``), a partial or a
    callable object is not judged."""
    plain = []
    for name in ("submit", "flush", "close"):
        method = getattr(sink, name, None)
        function = getattr(method, "__func__", method)
        if (
            inspect.isfunction(function)
            and not inspect.iscoroutinefunction(function)
            and not hasattr(function, "__wrapped__")
        ):
            plain.append(f"{type(sink).__name__}.{name}")
    if not plain:
        return None
    return (
        f"{', '.join(plain)} {'is' if len(plain) == 1 else 'are'} not async: a RecordSink's "
        "submit, flush and close are awaited on the Trio loop (write them as async def; "
        "run blocking work in a worker thread, trio.to_thread.run_sync)"
    )


@runtime_checkable
class RunsInBackground(Protocol):
    """A sink with a background task.

    ``run`` is started with ``nursery.start`` by whoever owns the sink (the
    runtime for its record sink, the routing sink for destinations it
    created) and returns after ``close``; ``running`` is True in between.
    """

    async def run(self, *, task_status: Any = ...) -> None: ...

    @property
    def running(self) -> bool: ...


@runtime_checkable
class GivesUp(Protocol):
    """A sink that can give up records it took: its ``submit`` returned, then
    a close that stopped waiting, or a shutdown's cut of its background task,
    left them not known to be delivered.

    ``given_up_records`` is how many so far (it only grows); a destination
    counts them as given up (``given_up_records``), and they stay counted as
    sent: they were handed over.
    """

    def given_up_records(self) -> int: ...


@runtime_checkable
class CountsInsertErrors(Protocol):
    """A sink that retries failed writes itself (a ClickHouse sink, in this
    process or a writer process): ``insert_errors`` is how many of its insert
    attempts failed so far, retried or not (a writer process's death counts
    as one; it only grows).  A destination exports it (``insert_errors``), so
    trouble shows while the sink still retries, before anything is latched."""

    def insert_errors(self) -> int: ...


@runtime_checkable
class ReleasesWhenCut(Protocol):
    """A sink holding something only its ``close()`` would give back (a
    connection, a client, chDB's data directory), which can let go of it
    without waiting: for a sink whose background task a shutdown's cut
    cancelled, never closed (its close may hang where its calls hung), and
    for an owned sink whose run ended without a close (its owner's nursery
    cancelled, another task failed) or never started (another destination
    failed to open first).  Its owner calls it shielded, waiting at most
    :data:`~taproute.routing.limits.RELEASE_WITHIN_S`.

    ``release_when_cut`` refuses later calls and gives the transport back now
    if no call of its runs, else once the last one returns (a call abandoned
    in a worker thread); it never waits on its destination, only on its own
    local calls still in a worker thread (a spool's file write).  Idempotent.
    """

    async def release_when_cut(self) -> None: ...


@runtime_checkable
class NamesHooks(Protocol):
    """A sink that names records' hooks (e.g. in a table column).

    ``use_hooks`` is called once, before the first batch, with the registry
    the producer binds hooks in.
    """

    def use_hooks(self, hooks: HookRegistry) -> None: ...


@runtime_checkable
class BoundsBlocking(Protocol):
    """A sink that may wait on its own (a spool at its quota, ``block``) and,
    where its own setting leaves that wait open, bounds it by the producer's
    blocking budget (the runtime's ``max_block``).

    ``use_blocking_budget`` is called before the first batch: by the runtime
    on its record sink, by a routing sink on each destination it opens.
    """

    def use_blocking_budget(self, seconds: float) -> None: ...


@runtime_checkable
class BoundsClose(Protocol):
    """A sink whose ``close()`` flushes within a bound of its own
    (``close_timeout`` seconds for what it waits on), saying what it stopped
    waiting for.  Whoever closes it need not flush it first: a plain
    ``flush()`` would wait without that bound (a silent server)."""

    @property
    def close_timeout(self) -> float: ...


@runtime_checkable
class CutsShort(Protocol):
    """A sink that, when a shutdown's grace runs out during its ``close()``,
    can cut off the destinations still busy so that its close finishes with
    the others (a routing sink).

    ``cut_short`` is called on the loop; it cancels each busy destination's
    call, gives back what was queued for it (counted as abandoned) and
    returns ``{destination: what kept it busy}`` (``"submit"``, ``"flush"``,
    ``"close"``, ``"queued"``) for those it cut now.  ``busy`` says the same
    without cutting anything (read from another thread only while the loop
    is blocked: a best effort).  ``cut_routes``, called on the loop first,
    stops waiting for the routes still processing (their work given back
    and counted), so the close goes on to flush and close the destinations;
    it returns the routes it cut.
    """

    def cut_short(self) -> dict[str, str]: ...

    def cut_routes(self) -> tuple[str, ...]: ...

    def busy(self) -> dict[str, str]: ...


@runtime_checkable
class DescribesRecords(Protocol):
    """A sink that knows the layouts and (when it has one) the hook registry."""

    @property
    def schema(self) -> RecordSchema: ...

    @property
    def hooks(self) -> HookRegistry | None: ...


@runtime_checkable
class ReportsFailure(Protocol):
    """A sink that latches its first failure and raises it from then on."""

    @property
    def failure(self) -> BaseException | None: ...


@runtime_checkable
class EndsKeys(Protocol):
    """The sink keeps per-key state and can end keys (a routing sink with stateful routes)."""

    async def complete(self, *keys: int) -> None: ...

    async def cancel(self, *keys: int) -> None: ...

    async def reopen(self, *keys: int) -> None: ...


@runtime_checkable
class TakesCheckedBatches(Protocol):
    """A sink whose ``intake`` checks what it is submitted; ``submit_checked``
    takes a batch that intake already checked (and checks nothing)."""

    @property
    def intake(self) -> Intake: ...

    async def submit_checked(self, batch: RecordBatch) -> None: ...


@runtime_checkable
class Reloads(Protocol):
    """A sink whose routes a new configuration generation can replace while it
    runs (a routing sink): ``prepare`` builds and checks one beside the running
    one (any thread, raises every problem), ``swap`` applies it between two
    batches (on the loop) and returns its number."""

    @property
    def generation(self) -> int: ...

    def prepare(
        self,
        config: RoutingConfig,
        *,
        default_destination: str | None = None,
        unmatched: Literal["default", "drop"] | None = None,
        registry: ProcessorRegistry | None = None,
    ) -> Any: ...

    async def swap(self, generation: Any) -> int: ...


@runtime_checkable
class Traceable(Protocol):
    """A sink that can say where a record would go, without sending it."""

    def trace(self, hook: str, **fields: Any) -> Any: ...


@attrs.frozen(kw_only=True)
class SpoolStatus:
    """A spooling destination now: healthy or since when (epoch seconds) and
    why not; unacknowledged bytes, segment files, the oldest unacknowledged
    batch's age; records delivered from the spool so far; records a full
    spool shed (by its policy) and records the destination refused."""

    healthy: bool
    unhealthy_since: float | None
    reason: str | None
    bytes: int
    segments: int
    oldest_unacked_age_s: float
    drained_records: int
    shed_records: int = 0
    refused_records: int = 0


@runtime_checkable
class Spools(Protocol):
    """A sink with a disk spool (see ``taproute.service.sinks.spool``)."""

    def spool_status(self) -> SpoolStatus: ...


@attrs.frozen(kw_only=True)
class Reach:
    """Whether a destination without a spool takes writes now: healthy, or
    since when (epoch seconds) and why not."""

    healthy: bool
    unhealthy_since: float | None = None
    reason: str | None = None


@runtime_checkable
class ReportsReach(Protocol):
    """A sink without a spool that knows whether its destination takes writes
    now (a ClickHouse sink: not while its inserts fail and are retried, or
    after it gave up), exported as the destination's health (``/status``,
    ``/healthz``, ``taproute_destination_healthy``)."""

    def reach(self) -> Reach: ...


@runtime_checkable
class WaitsForDelivery(Protocol):
    """A sink that can wait until everything it took is delivered (its spool
    drained), for ``flush(wait=True)``."""

    async def wait_delivered(self) -> None: ...


__all__ = [
    "BoundsBlocking",
    "BoundsClose",
    "CutsShort",
    "WaitsForDelivery",
    "SpoolStatus",
    "Spools",
    "DescribesRecords",
    "EndsKeys",
    "CountsInsertErrors",
    "GivesUp",
    "NamesHooks",
    "Reach",
    "ReleasesWhenCut",
    "RecordSink",
    "ReportsReach",
    "ReportsFailure",
    "RunsInBackground",
    "TakesCheckedBatches",
    "Traceable",
]
