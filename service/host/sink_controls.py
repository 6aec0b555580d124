"""Operator controls of the runtime that run in the record order: flush and
close, key lifecycle (complete/cancel/reopen) and configuration generations
(reload/swap).

Each is queued on the ingress behind the records submitted before it and run
by the record worker at its place (:meth:`SinkControls._control`), so a
producer's records and its controls never overtake one another.  A mixin of
:class:`~taproute.service.host.runtime.RecordRuntime`, which sets the state
declared here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextlib import suppress
from typing import Any

import trio

from taproute.actors.routing_sink import RoutingSink
from taproute.routing.errors import FlushCutOff, KeyNotHeld, SinkClosed
from taproute.routing.flush_report import FlushReport
from taproute.routing.keys import KeyAction, request_keys
from taproute.routing.latch import FailureLatch
from taproute.routing.plan import Unmatched
from taproute.routing.processors import ProcessorRegistry
from taproute.routing.routes import RoutingConfig
from taproute.routing.sink import RecordSink, Reloads, WaitsForDelivery
from taproute.service.host.ingress import Ingress, NotQueued, thread_wait
from taproute.service.host.ingress_control import Control
from taproute.service.host.reload_outcomes import ReloadLedger


class SinkControls:
    """Flush/close, key and generation controls, ordered with the records:
    the thread-safe calls and what the loop runs for each."""

    # Set by RecordRuntime (and Producer, for the latch).
    record_sink: RecordSink
    _latch: FailureLatch
    _ingress: Ingress
    _thread: threading.Thread | None
    _keys: dict[KeyAction, Callable[..., Awaitable[None]]] | None
    _reloads: Reloads | None
    #: How long a capture hook (or a capture block's key control) waits for room.
    max_block: float | None
    #: The record sink call the record worker is in (for a shutdown's report).
    _sink_call: str | None
    #: A close reached the record sink (its close lets go of its transport).
    _sink_close_started: bool = False
    #: Swaps queued and not yet run (``ingress.queued_reloads``).
    _queued_swaps: set[Future[int]]
    #: What came of each reload asked (``counters().reloads``, ``last_reload``).
    reload_ledger: ReloadLedger

    async def _control(self, control: Control) -> bool:
        """Run a flush or close; returns True when the worker should stop.

        The control's ingress room is given back once, before its future
        settles (whatever the outcome): a caller that saw its flush, reload
        or key control return finds no control of its own still counted as
        queued, and its room free."""
        returned = False

        def give_back_room() -> None:
            nonlocal returned
            if not returned:
                returned = True
                keyed = isinstance(control.kind, KeyAction)
                self._ingress.done(
                    0,
                    0,
                    controls=1 if keyed else 0,
                    sink_controls=1 if not keyed and control.kind != "close" else 0,
                )

        try:
            return await self._run_control(control, give_back_room)
        finally:
            give_back_room()

    async def _run_control(self, control: Control, give_back_room: Callable[[], None]) -> bool:
        """:meth:`_control`'s body; ``give_back_room`` runs before a future settles."""
        result: object = None
        self._sink_call = "flush" if control.kind == "deliver" else str(control.kind)
        try:
            self._latch.raise_if_failed()
            if control.kind == "reload":
                return await self._reload(control, give_back_room)
            if control.kind == "flush":
                result = await self.record_sink.flush()
            elif control.kind == "deliver":
                result = await self._flush_delivered()
            elif isinstance(control.kind, KeyAction):
                assert self._keys is not None
                await self._keys[control.kind](*control.keys)
            else:
                self._sink_close_started = True
                await self.record_sink.close()
        except KeyNotHeld as exc:  # the caller's mistake, refused whole: not a failure
            self._ingress.count_refused_key_control()  # seen even if the future is not
            give_back_room()
            control.future.set_exception(exc)
        except FlushCutOff as exc:  # the closing shutdown's grace overtook it: its failure
            give_back_room()
            control.future.set_exception(exc)
        except Exception as exc:
            if isinstance(control.kind, KeyAction):  # a failed runtime's, or its failure
                self._ingress.count_failed_key_control()
            failure = self._latch.latch(exc, where=f"record sink {control.kind}")
            self._ingress.fail(failure)
            if control.kind == "close":
                self._sink_close_started = True
                with suppress(Exception):  # already failing; the first error stands
                    await self.record_sink.close()
            give_back_room()
            control.future.set_exception(failure)
        except BaseException as exc:  # cancelled (a shutdown's grace ran out), or the loop dies
            if not control.future.done():
                if isinstance(control.kind, KeyAction):
                    self._ingress.count_failed_key_control()
                give_back_room()
                control.future.set_exception(
                    SinkClosed(f"runtime stopped: the shutdown grace ran out during {control.kind}")
                    if isinstance(exc, trio.Cancelled)
                    else SinkClosed(f"runtime loop stopped during {control.kind}: {exc!r}")
                )
            raise
        else:
            give_back_room()
            control.future.set_result(result if isinstance(result, FlushReport) else None)
        finally:
            self._sink_call = None
        return control.kind == "close"

    async def _flush_delivered(self) -> object:
        """``flush(wait=True)``: a routing sink waits for its retries and spools;
        another sink is flushed, then waited for if it can tell delivery."""
        sink = self.record_sink
        if isinstance(sink, RoutingSink):
            return await sink.flush(wait=True)
        result = await sink.flush()
        if isinstance(sink, WaitsForDelivery):
            await sink.wait_delivered()
        return result

    async def _reload(self, control: Control, give_back_room: Callable[[], None]) -> bool:
        """Swap in a prepared generation; a refusal is the caller's, not a failure."""
        assert self._reloads is not None
        try:
            number = await self._reloads.swap(control.payload)
        except Exception as exc:
            give_back_room()
            control.future.set_exception(exc)
        else:
            give_back_room()
            control.future.set_result(number)
        return False

    def flush(self, timeout: float | None = None, *, wait: bool = False) -> FlushReport | None:
        """Return once every record submitted before is delivered, dead-lettered,
        dropped by a counted policy, or parked for a retry (durably, with a park
        store); a routing sink's :class:`FlushReport` says how many are in which
        state (another sink reports nothing: None).  ``wait=True`` also waits
        for every retry and spool: full delivery.

        Raises the first latched failure.

        The flush's control takes one record's ingress room until it ran, so
        repeated flushes against a stalled router stay bounded: with ingress
        full it waits for room within ``timeout`` (a :class:`TimeoutError`
        past it, nothing queued, nothing left behind), and a flush finding
        the one queued last with nothing after it shares it (it covers every
        record submitted before both): a loop of timed-out flushes leaves one
        flush queued, which still runs once the router moves.
        """
        if self._thread is None:
            raise SinkClosed("runtime not started")
        self._ingress.refuse_on_loop("flush()")
        wait_s = thread_wait(timeout)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        try:
            report: FlushReport | None = self._ingress.put_control(
                "deliver" if wait else "flush", timeout=wait_s
            ).result(_left(deadline))
        except NotQueued:
            raise
        except TimeoutError:
            raise TimeoutError(
                f"flush: not done within {timeout} s; what was submitted is still being "
                "delivered (call flush again to wait for it)"
            ) from None
        return report

    # -- key lifecycle (thread-safe; ordered with the records submitted before) --

    def complete(self, *keys: int) -> Future[None]:
        """Complete ``keys`` after every record of theirs submitted before (see
        :meth:`RoutingSink.complete`).  Returns a future done once the
        completion ran in order; :meth:`flush` waits for its rows.

        A key control takes one record's ingress room until it ran, so memory
        stays bounded: while ingress is full it waits for room, as ``submit``
        does (``when_full="block"``, from any thread but the loop's), or its
        future fails at once with :class:`IngressFull`, counted
        (``ingress.rejected_key_controls``; ``"reject"``), and the keys stay
        open.  The same for :meth:`cancel` and :meth:`reopen`."""
        return self._key_control(KeyAction.COMPLETE, keys)

    def cancel(self, *keys: int) -> Future[None]:
        """Cancel ``keys``: their queued records discarded, slots cleared, no finalize."""
        return self._key_control(KeyAction.CANCEL, keys)

    def reopen(self, *keys: int) -> Future[None]:
        """Let completed or cancelled ``keys`` take records again."""
        return self._key_control(KeyAction.REOPEN, keys)

    @property
    def ends_keys(self) -> bool:
        """Whether ``complete``/``cancel``/``reopen`` can be asked of this runtime
        (its record sink keeps keys: a routing sink does)."""
        return self._keys is not None

    def end_capture_keys(self, action: str, keys: tuple[int, ...]) -> Future[None]:
        """``complete`` or ``cancel`` of ``keys`` at the end of a
        ``capture_context(end_keys=...)`` block: waits for ingress room no
        longer than ``max_block``, as a capture hook does (and not at all while
        an earlier bounded wait ran out and nothing moved since).  Past it the
        control is shed: counted (``ingress.shed_key_controls``), its future
        fails with :class:`IngressFull`, and the keys stay open."""
        kind = {"complete": KeyAction.COMPLETE, "cancel": KeyAction.CANCEL}[action]
        return self._key_control(kind, keys, bounded=True)

    def _key_control(
        self, kind: KeyAction, keys: tuple[int, ...], *, bounded: bool = False
    ) -> Future[None]:
        if self._keys is None:
            raise TypeError(
                f"{kind}: the record sink {type(self.record_sink).__name__} keeps no keys "
                "(a RoutingSink does)"
            )
        checked = request_keys(keys)
        if self._thread is None:
            self._ingress.count_failed_key_control()  # seen even if the raise is not
            raise SinkClosed("runtime not started")
        return self._ingress.put_control(kind, checked, bounded=bounded, max_block=self.max_block)

    # -- configuration generations -------------------------------------------

    def reload(
        self,
        config: RoutingConfig,
        *,
        default_destination: str | None = None,
        unmatched: Unmatched | None = None,
        registry: ProcessorRegistry | None = None,
        timeout: float | None = None,
    ) -> int:
        """Replace the routes by ``config``, a new configuration generation;
        returns its number.  Any thread but the loop's.

        The generation is built and checked here, beside the running one (every
        check the sink's construction makes); a configuration with problems
        raises them all (:class:`~taproute.routing.errors.PlanErrors`, each at
        its location) and the running generation goes on.  Otherwise it is
        swapped in in submission order: records submitted before this call
        finish under the generation that accepted them, later ones route under
        the new one; records parked for a retry are tried again at once under
        it (see :meth:`RoutingSink.swap`).  Options as :meth:`RoutingSink.prepare`.

        Its control takes one record's ingress room until it ran: with
        ingress full it waits for room within ``timeout``; past it a
        :class:`TimeoutError` says it was not queued, and the running
        generation goes on (a timeout after it was queued: it may yet be
        swapped in).
        """
        if self._reloads is None:
            raise TypeError(
                f"reload: the record sink {type(self.record_sink).__name__} has no "
                "configuration generations (a RoutingSink does)"
            )
        wait_s = thread_wait(timeout)
        routes = (
            [route.name for route in config.routes] if isinstance(config, RoutingConfig) else []
        )
        reload_id = self.reload_ledger.asked(running_generation=self.generation, routes=routes)
        try:
            generation = self._reloads.prepare(
                config,
                default_destination=default_destination,
                unmatched=unmatched,
                registry=registry,
            )
        except Exception as exc:
            self.reload_ledger.refused(reload_id, exc)
            raise
        return self._swap(generation, wait_s, reload_id)

    def swap(self, generation: Any, *, timeout: float | None = None) -> int:
        """Apply a generation the sink prepared (``record_sink.prepare(...)``), in
        submission order; returns its number (see :meth:`reload`).

        ``timeout`` (seconds) bounds the whole wait, for ingress room (past it
        :class:`NotQueued`, a :class:`TimeoutError`: never queued) and for the
        swap (past it :class:`TimeoutError` and the swap stays queued: it may
        yet be swapped in; ``counters().ingress.queued_reloads`` counts it
        until then, and ``counters().last_reload`` says what came of it)."""
        try:
            wait_s = thread_wait(timeout)
        except (TypeError, ValueError):
            generation.detach()
            raise
        return self._swap(generation, wait_s, None)

    def _swap(self, generation: Any, wait_s: float | None, reload_id: int | None) -> int:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        future = self.queue_swap(generation, timeout=wait_s, reload_id=reload_id)
        try:
            number: int = future.result(_left(deadline))
        except TimeoutError:
            raise  # never queued (NotQueued, detached as it settled), or still queued
        except BaseException:
            generation.detach()  # never swapped in (idempotent if it was refused there)
            raise
        return number

    def queue_swap(
        self, generation: Any, *, timeout: float | None = None, reload_id: int | None = None
    ) -> Future[int]:
        """Queue the swap of a prepared generation behind the records submitted
        before, without waiting for it: the future gives its number once it
        routes, or raises why it was refused (it is then detached).  Until it
        is done, it counts in ``counters().ingress.queued_reloads``; what came
        of it is kept in ``counters().reloads`` (``last_reload``), also when
        nobody waits for the future any more.  ``reload_id``: its record in
        :attr:`reload_ledger`, opened by the caller (None: opened here).

        Its control takes one record's ingress room until it ran: with
        ingress full it waits for room within ``timeout`` (seconds; None: as
        long as it takes); past it the future raises :class:`NotQueued` and
        nothing was queued."""
        if self._reloads is None:
            raise TypeError("swap: the record sink has no configuration generations")
        if reload_id is None:
            config = getattr(generation, "config", None)
            routes = [r.name for r in config.routes] if isinstance(config, RoutingConfig) else []
            reload_id = self.reload_ledger.asked(running_generation=self.generation, routes=routes)
        try:
            if self._thread is None:
                raise SinkClosed("runtime not started")
            self._ingress.refuse_on_loop("reload()")
        except BaseException as exc:
            generation.detach()
            self.reload_ledger.refused(reload_id, exc)
            raise
        future: Future[int] = self._ingress.put_control(
            "reload", payload=generation, timeout=timeout
        )
        self._queued_swaps.add(future)
        ledger = self.reload_ledger

        def settled(done: Future[int]) -> None:
            # Run where the future is settled (the loop thread, at the swap),
            # or here if it already was: must never raise.  The outcome is
            # recorded before any later callback (the caller's) runs, so a
            # snapshot taken once the caller learnt it shows it.
            self._queued_swaps.discard(done)
            ledger.settle(reload_id, done)
            if not done.cancelled() and done.exception() is not None:
                generation.detach()  # never swapped in (idempotent if refused there)

        future.add_done_callback(settled)
        return future

    @property
    def generation(self) -> int:
        """The configuration generation routing new records (0: a sink without any)."""
        return 0 if self._reloads is None else self._reloads.generation


def _left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic``; None: no bound)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


__all__ = ["SinkControls"]
