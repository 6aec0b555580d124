"""A destination that survives outages: any sink, wrapped with its spool.

:class:`SpoolingSink` is a :class:`~taproute.routing.sink.RecordSink` around
another one (the *inner* sink, e.g. a ClickHouse sink).  Its ``submit`` never
fails because the inner sink can't be reached: a batch the inner sink can't
take now goes to the destination's :class:`~.spool.Spool` and is delivered
later, in order, by this sink's own task, retried with capped backoff for as
long as the outage lasts.  Meanwhile :attr:`SpoolingSink.health` says the
destination is unhealthy, since when and why.

Modes (``mode``):

- ``"outage"`` (default): while the destination keeps up, batches are held in
  memory (bounded) and inserted from there; the first transient failure moves
  every held batch, in order, to the spool, and new batches follow them there
  until the spool has drained.
- ``"always"``: every batch is appended to the spool before ``submit``
  returns (the crash-safe mode), and delivered from there.
- ``"off"``: no spool; ``submit``/``flush`` go straight to the inner sink.

Exactly once: an inner sink offering ``insert_now(batch, token)`` and
``is_transient(error)`` (:class:`InsertsWithToken`, as the ClickHouse sink
does) gets every batch with a deduplication token fixed before its first
try and kept through the spool and restarts, so a retry after a lost reply,
or a replay after a crash, writes nothing twice.  Another sink gets
``submit`` + ``flush`` per batch and ``OSError``/``TimeoutError`` count as
transient (at-least-once).

A batch the inner sink *refuses* (a non-transient error: bad data, a bad
table) is not retried: it goes to ``dead_letter`` (or, without one, latches
this sink's failure).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import trio

from taproute.routing.batch import Batch, RecordBatch, Retained
from taproute.routing.errors import SinkClosed
from taproute.routing.hooks import HookRegistry
from taproute.routing.latch import FailureLatch
from taproute.routing.limits import capped_backoff
from taproute.routing.sink import NamesHooks, RecordSink, RunsInBackground, SpoolStatus
from taproute.service.sinks.spool.spool import DeadLetter, Spool, SpoolCounters

Mode = Literal["outage", "always", "off"]
MODES: tuple[str, ...] = ("outage", "always", "off")


@runtime_checkable
class InsertsWithToken(Protocol):
    """An inner sink that inserts one batch now, idempotently per token."""

    async def insert_now(self, batches: Sequence[Batch], token: str) -> None: ...

    def is_transient(self, error: BaseException) -> bool: ...


@attrs.frozen(kw_only=True)
class Backoff:
    """Waits between retries of an unreachable destination (capped exponential)."""

    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 30.0

    def after(self, failures: int) -> float:
        return capped_backoff(self.initial, self.multiplier, self.maximum, failures)


@attrs.frozen
class Health:
    """Whether the destination takes batches now; since when (clock seconds) and why not."""

    healthy: bool
    since: float
    reason: str | None
    consecutive_failures: int


@attrs.define
class SpoolingCounters:
    """Records through a spooling destination: in = delivered + refused + shed + held."""

    accepted_records: int = 0
    delivered_records: int = 0
    delivered_batches: int = 0
    refused_records: int = 0
    retries: int = 0
    memory_records: int = 0
    spool: SpoolCounters = attrs.field(factory=SpoolCounters)


@attrs.define
class _Held:
    batch: Batch
    token: str
    hold: Retained | None


def _default_transient(error: BaseException) -> bool:
    return isinstance(error, (OSError, TimeoutError))


class SpoolingSink:
    """One destination with its spool (see the module docstring)."""

    def __init__(
        self,
        name: str,
        inner: RecordSink,
        spool: Spool | None,
        *,
        mode: Mode = "outage",
        backoff: Backoff | None = None,
        memory_records: int = 65_536,
        drain_on_close: float = 30.0,
        dead_letter: DeadLetter | None = None,
        clock: Callable[[], float] = time.time,
        owns_inner: bool = True,
    ) -> None:
        if mode not in MODES:
            from taproute.routing.errors import ConfigError

            raise ConfigError(f"destination {name!r}: spool must be one of {MODES}, got {mode!r}")
        if mode != "off" and spool is None:
            raise ValueError(f"destination {name!r}: spool={mode!r} needs a Spool")
        self.name = name
        self.inner = inner
        self.spool = spool
        self.mode = mode
        self.backoff = backoff or Backoff()
        self.memory_records = memory_records
        self.drain_on_close = drain_on_close
        self._dead_letter = dead_letter
        self._clock = clock
        self._owns_inner = owns_inner
        self._direct = inner if isinstance(inner, InsertsWithToken) else None
        self._latch = FailureLatch()
        self._memory: deque[_Held] = deque()
        self._single = 0  # held batches to try one by one (after a refused group)
        self._memory_in = 0  # batches ever put in memory
        self._memory_out = 0  # batches that left memory (delivered, refused, spooled)
        self._order = trio.Lock()  # one decision "memory or spool" at a time
        self._wake = trio.Event()
        self._moved = trio.Event()
        self._token_prefix = f"mem-{uuid.uuid4().hex}"
        self._health = Health(True, clock(), None, 0)
        self.counters = SpoolingCounters()
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._stopped = trio.Event()

    # -- lifecycle ---------------------------------------------------------
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the inner sink's task (when owned) and the delivery loop until ``close``."""
        if self._nursery is not None:
            raise RuntimeError(f"SpoolingSink {self.name!r}: run() can only be started once")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._owns_inner and isinstance(self.inner, RunsInBackground):
                    await nursery.start(self.inner.run)
                if self.mode != "off":
                    nursery.start_soon(self._deliver_loop)
                task_status.started()
                await self._stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._stopped.set()

    @property
    def running(self) -> bool:
        return self._nursery is not None and not self._stopped.is_set()

    @property
    def failure(self) -> BaseException | None:
        """The latched failure (a refused batch with no dead-letter store), or None."""
        return self._latch.failure

    @property
    def health(self) -> Health:
        return self._health

    def use_hooks(self, hooks: HookRegistry) -> None:
        """Hand the producer's hook registry to the inner sink, if it names hooks."""
        if isinstance(self.inner, NamesHooks):
            self.inner.use_hooks(hooks)

    # -- RecordSink ----------------------------------------------------------
    async def submit(self, batch: Batch) -> None:
        """Accept ``batch``: into memory while healthy (``outage``), else into the spool."""
        self._latch.raise_if_failed()
        if self._closing:
            raise SinkClosed(f"destination {self.name!r} is closed")
        if self.mode == "off":
            await self.inner.submit(batch)
            return
        self.counters.accepted_records += len(batch)
        assert self.spool is not None
        while (
            self._memory_path()
            and len(self._memory)
            and self._held_records() >= (self.memory_records)
        ):
            await self._moved.wait()  # the destination is behind: back-pressure
        async with self._order:
            if self._memory_path():
                token = f"{self._token_prefix}-{self._memory_in}"
                hold = batch.retain() if isinstance(batch, RecordBatch) else None
                self._memory.append(_Held(batch, token, hold))
                self._memory_in += 1
            else:
                await self.spool.append(batch)
        self._poke()

    def _memory_path(self) -> bool:
        assert self.spool is not None
        return self.mode == "outage" and self._health.healthy and len(self.spool) == 0

    def _held_records(self) -> int:
        return sum(len(h.batch) for h in self._memory)

    def _poke(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    def _left_memory(self) -> None:
        self._memory_out += 1
        self._moved.set()
        self._moved = trio.Event()

    async def flush(self) -> None:
        """Return once every batch submitted before is delivered, dead-lettered,
        or durable in the spool (fsynced); raise a latched failure."""
        self._latch.raise_if_failed()
        if self.mode == "off":
            await self.inner.flush()
            return
        target = self._memory_in
        while self._memory_out < target:
            await self._moved.wait()
        assert self.spool is not None
        await self.spool.sync()
        self._latch.raise_if_failed()

    async def wait_delivered(self) -> None:
        """Return once nothing is held in memory or the spool: everything
        accepted so far is delivered (or dead-lettered / shed, and counted)."""
        assert self.spool is not None or self.mode == "off"
        if self.mode == "off":
            await self.inner.flush()
            return
        assert self.spool is not None
        while self._memory or len(self.spool):
            self._latch.raise_if_failed()
            await self._moved.wait() if self._memory else await self._spool_changed()

    async def _drain_while_healthy(self) -> None:
        assert self.spool is not None
        while self._health.healthy and (self._memory or len(self.spool)):
            if self._latch.failure is not None:
                return
            await self._moved.wait() if self._memory else await self._spool_changed()

    async def _spool_changed(self) -> None:
        assert self.spool is not None
        await self.spool.wait_changed()

    async def close(self) -> None:
        """Flush; while the destination is healthy, deliver what is held for up to
        ``drain_on_close`` seconds; then stop (the spool keeps the rest for the
        next start) and close."""
        if self._closing:
            await self._stopped.wait()
            return
        try:
            if self.running:
                await self.flush()
                if self.mode != "off":
                    with trio.move_on_after(self.drain_on_close):
                        await self._drain_while_healthy()
        finally:
            self._closing = True
            self._stopped.set()
            for held in self._memory:  # only left after a failure
                if held.hold is not None:
                    held.hold.release()
            self._memory.clear()
            try:
                if self._owns_inner:
                    await self.inner.close()
            finally:
                if self.spool is not None:
                    await self.spool.aclose()

    # -- delivery --------------------------------------------------------------
    async def _insert(self, batches: Sequence[Batch], token: str) -> None:
        if self._direct is not None:
            await self._direct.insert_now(batches, token)
        else:
            for batch in batches:
                await self.inner.submit(batch)
            await self.inner.flush()

    def _transient(self, error: BaseException) -> bool:
        if self._direct is not None:
            return self._direct.is_transient(error)
        return _default_transient(error)

    def _unhealthy(self, error: BaseException) -> None:
        failures = self._health.consecutive_failures + 1
        since = self._health.since if not self._health.healthy else self._clock()
        reason = f"{type(error).__name__}: {error}"
        self._health = Health(False, since, reason, failures)
        self.counters.retries += 1

    def _healthy(self) -> None:
        if not self._health.healthy:
            self._health = Health(True, self._clock(), None, 0)

    async def _refused(self, batch: Batch, error: BaseException) -> None:
        self.counters.refused_records += len(batch)
        if self._dead_letter is None:
            self._latch.latch(error, destination=self.name, where="insert (refused)")
            return
        await self._dead_letter(batch, f"refused by destination {self.name!r}: {error}")

    async def _deliver_loop(self) -> None:
        assert self.spool is not None
        while True:
            if self._memory:
                await self._deliver_memory()
                continue
            entry = self.spool.first()
            if entry is None:
                await self._wake.wait()
                continue
            if not self._health.healthy:
                await trio.sleep(self.backoff.after(self._health.consecutive_failures))
            spooled = await self.spool.read(entry)
            try:
                await self._insert(spooled.batches, spooled.token)
            except Exception as exc:
                if self._transient(exc):
                    self._unhealthy(exc)
                    continue
                for batch in spooled.batches:
                    await self._refused(batch, exc)
            else:
                self._healthy()
                self.counters.delivered_records += spooled.records
                self.counters.delivered_batches += len(spooled.batches)
            await self.spool.ack(spooled.seq)

    async def _deliver_memory(self) -> None:
        """Insert everything held now as one group (batches that queued behind
        an insert go together in the next one: inserts stay large under load)."""
        assert self.spool is not None
        group = [self._memory[0]] if self._single else list(self._memory)
        self._single = max(0, self._single - 1)
        batches = [held.batch for held in group]
        token = group[0].token
        try:
            await self._insert(batches, token)
        except Exception as exc:
            if self._transient(exc):
                # Unreachable: this group, as one frame keeping the token it
                # was tried with, and every batch behind it go to the spool,
                # in order.
                async with self._order:
                    self._unhealthy(exc)
                    await self.spool.append(batches, token)
                    for _ in group:
                        self._release(self._memory.popleft())
                    while self._memory:
                        moved = self._memory.popleft()
                        await self.spool.append(moved.batch, moved.token)
                        self._release(moved)
                return
            if len(group) == 1:
                await self._refused(group[0].batch, exc)
                self._release(self._memory.popleft())
                return
            # Refused: find which batch is bad by trying them one by one
            # (the next loop turn tries the head alone).
            for _ in group:
                self._memory.popleft()
            self._memory.extendleft(
                reversed([attrs.evolve(h, token=f"{token}.{i}") for i, h in enumerate(group)])
            )
            self._single = len(group)
            return
        self._healthy()
        for held in group:
            self.counters.delivered_records += len(held.batch)
            self.counters.delivered_batches += 1
            self._release(self._memory.popleft())

    def _release(self, held: _Held) -> None:
        if held.hold is not None:
            held.hold.release()
        self._left_memory()

    def spool_status(self) -> SpoolStatus:
        """Health and holdings, for the destination's counters (``/status``, ``/metrics``)."""
        spool = self.spool.snapshot() if self.spool is not None else SpoolCounters()
        health = self._health
        return SpoolStatus(
            healthy=health.healthy,
            unhealthy_since=None if health.healthy else health.since,
            reason=health.reason,
            bytes=spool.bytes,
            segments=spool.segments,
            oldest_unacked_age_s=spool.oldest_unacked_age_s,
            drained_records=spool.acked_records,
        )

    def snapshot(self) -> SpoolingCounters:
        """A detached copy of the counters, with the spool's."""
        return attrs.evolve(
            self.counters,
            memory_records=self._held_records(),
            spool=self.spool.snapshot() if self.spool is not None else SpoolCounters(),
        )


__all__ = [
    "MODES",
    "Backoff",
    "Health",
    "InsertsWithToken",
    "Mode",
    "SpoolingCounters",
    "SpoolingSink",
]
