"""The producer-facing runtime: a Trio loop in its own thread behind a
thread-safe ``submit``.

::

    with create_record_runtime(record_sink=routing_sink) as runtime:
        q = runtime.bind_hook("layers.0.attn.q", layout="qk")
        runtime.submit_batch(descriptors, pinned_buffer, release=pool.give_back)
        runtime.flush()

Crossing into Trio costs one ``run_sync_soon`` per wake-up, never one per
record.  ``submit_batch`` never copies the payload; ``submit`` copies its
(small) payload into the batch it is coalesced into.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from types import TracebackType
from typing import Any

import attrs
import trio

from taproute.actors.counters import RouterSnapshot
from taproute.actors.latch import FailureLatch
from taproute.native import BufferLease, make_descriptors
from taproute.routing.batch import RecordBatch, readonly_bytes, readonly_descriptors
from taproute.routing.errors import (
    ConfigError,
    IngressFull,
    PayloadSizeMismatch,
    SinkClosed,
    UnboundOutputId,
)
from taproute.routing.hooks import HookRegistry
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import RecordSink
from taproute.routing.validation import check_batch
from taproute.service.host.http import Controls, HttpConfig, build_app, serve_http
from taproute.service.host.ingress import Control, Ingress, WhenFull
from taproute.service.ops.dead_letters import DeadLetter, DeadLetterStore


class RecordRuntime:
    """Hosts a record sink on a Trio loop in a dedicated thread.

    Thread-safe: ``submit``/``submit_batch``/``bind_hook``/``flush`` may be
    called from any thread.  Create with :func:`create_record_runtime`.
    """

    def __init__(
        self,
        record_sink: RecordSink,
        *,
        schema: RecordSchema | None = None,
        hooks: HookRegistry | None = None,
        capacity_records: int = 65_536,
        capacity_bytes: int = 256 * 2**20,
        when_full: WhenFull = "block",
        coalesce_records: int = 4096,
        name: str = "taproute",
        http: HttpConfig | None = None,
        dead_letters: DeadLetterStore | None = None,
    ) -> None:
        self.record_sink = record_sink
        self.http = http
        #: Where the routing sink's given-up records are kept (for the controls).
        self.dead_letters = dead_letters
        #: The URLs the HTTP endpoint listens on, once started (empty without one).
        self.http_urls: list[str] = []
        self.schema: RecordSchema | None = (
            schema if schema is not None else getattr(record_sink, "schema", None)
        )
        sink_hooks = getattr(record_sink, "hooks", None)
        if hooks is not None and sink_hooks is not None and hooks is not sink_hooks:
            raise ValueError("hooks given twice: the record sink already has a HookRegistry")
        if hooks is None:
            hooks = sink_hooks if sink_hooks is not None else HookRegistry()
        self.hooks: HookRegistry = hooks
        attach_hooks = getattr(record_sink, "attach_hooks", None)
        if attach_hooks is not None:
            attach_hooks(hooks)
        self.name = name
        self._ingress = Ingress(
            capacity_records=capacity_records,
            capacity_bytes=capacity_bytes,
            when_full=when_full,
            coalesce_records=coalesce_records,
        )
        self._latch = FailureLatch()
        self._seq = itertools.count()
        self._record_rules: dict[int, tuple[int, int, int, int]] = {}
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._wakeup = trio.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> RecordRuntime:
        """Start the loop thread and the sink; returns once both are running."""
        if self._thread is not None:
            raise RuntimeError("runtime already started")
        self._thread = threading.Thread(target=self._thread_main, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        return self

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # the loop died: refuse producers, fail waiters
            error = exc if isinstance(exc, Exception) else RuntimeError(f"loop stopped: {exc!r}")
            if not self._ready.is_set():
                self._start_error = error
            failure = self._latch.latch(error, where="runtime loop")
            for item in self._ingress.fail(failure, loop_gone=True):
                if isinstance(item, Control) and not item.future.done():
                    item.future.set_exception(failure)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._wakeup = trio.Event()
        self._ingress.connect(self._schedule_wake)
        async with trio.open_nursery() as nursery:
            run = getattr(self.record_sink, "run", None)
            if run is not None:
                await nursery.start(run)
            if self.http is not None:
                app = build_app(
                    self._snapshot_in_loop,
                    controls=self._controls(),
                    trace=getattr(self.record_sink, "trace", None),
                )
                self.http_urls = await nursery.start(serve_http, app, self.http)
            self._ready.set()
            await self._record_worker()
            nursery.cancel_scope.cancel()  # the sink is closed; stop the HTTP server

    def _schedule_wake(self) -> None:
        # Called by producers with the ingress lock held.
        assert self._token is not None
        self._token.run_sync_soon(self._wake)

    def _wake(self) -> None:
        # A run_sync_soon callback: must never raise.
        self._wakeup.set()

    async def _record_worker(self) -> None:
        sink = self.record_sink
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            # Ingress capacity is given back once per wake-up, not per batch:
            # one lock round trip and one producer wake-up for the lot.
            records = nbytes = 0
            try:
                for item in self._ingress.take():
                    if isinstance(item, Control):
                        if await self._control(item):
                            return
                        continue
                    try:
                        if self._latch.failure is None:
                            await sink.submit(item)
                    except Exception as exc:
                        self._ingress.fail(self._latch.latch(exc, where="record sink submit"))
                    finally:
                        item.lease.release()
                        records += len(item)
                        nbytes += item.payload.nbytes
            finally:
                self._ingress.done(records, nbytes)

    async def _control(self, control: Control) -> bool:
        """Run a flush or close; returns True when the worker should stop."""
        try:
            self._latch.raise_if_failed()
            if control.kind == "flush":
                await self.record_sink.flush()
            else:
                await self.record_sink.close()
        except Exception as exc:
            failure = self._latch.latch(exc, where=f"record sink {control.kind}")
            self._ingress.fail(failure)
            if control.kind == "close":
                with suppress(Exception):  # already failing; the first error stands
                    await self.record_sink.close()
            control.future.set_exception(failure)
        else:
            control.future.set_result(None)
        return control.kind == "close"

    # -- operator controls -------------------------------------------------

    def reroute(self, letter_id: int) -> DeadLetter:
        """Feed dead letter ``letter_id`` through routing again, as new input (any thread
        but the loop's; blocks while ingress is full).  A skipped or already rerouted
        letter goes again as a copy."""
        store, batch = self._letter_batch(letter_id)
        self._ingress.put_batch(batch)
        return store.mark_rerouted(letter_id)

    def _letter_batch(self, letter_id: int) -> tuple[DeadLetterStore, RecordBatch]:
        store = self.dead_letters
        if store is None:
            raise ConfigError("this runtime has no dead-letter store (dead_letters=...)")
        letter = store.get(letter_id)
        assert letter.payload is not None
        output_id = self.hooks.bind(letter.hook)
        descriptors = make_descriptors(
            output_id,
            len(letter.payload),
            layout_ids=letter.layout_id,
            keys=letter.key,
            steps=letter.step,
            seqs=letter.seq,
            timestamps_ns=letter.timestamp_ns,
        )
        return store, self._checked_batch(descriptors, letter.payload, None)

    def _controls(self) -> Controls | None:
        store = self.dead_letters
        if store is None:
            return None
        assert self.http is not None

        def reroute_now(letter_id: int) -> DeadLetter:
            # Called from the loop thread: never wait for ingress room there.
            _, batch = self._letter_batch(letter_id)
            if not self._ingress.try_put_batch(batch):
                raise IngressFull("ingress is full; reroute refused, try again")
            return store.mark_rerouted(letter_id)

        return Controls(store, reroute_now, self.http.token)

    def stop(self, timeout: float | None = None) -> None:
        """Same as :meth:`close` (the service-object spelling)."""
        self.close(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drain, flush and close the sink, stop the loop and join its thread.

        Idempotent.  Raises the latched failure, if any.
        """
        if self._thread is None:
            return
        future = self._ingress.put_control("close")
        try:
            future.result(timeout)
        finally:
            self._thread.join(timeout)
        self._latch.raise_if_failed()

    def __enter__(self) -> RecordRuntime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            with suppress(Exception):  # already failing; the first error stands
                self.close()

    # -- producer API ------------------------------------------------------

    def bind_hook(self, name: str, *, layout: str | None = None) -> int:
        """The output_id for hook ``name`` (routes are matched by name)."""
        if layout is not None and self.schema is not None:
            self.schema.layout_id(layout)  # unknown layout: raise now
        return self.hooks.bind(name, layout=layout)

    def submit_batch(
        self,
        descriptors: Any,
        payload: Any,
        release: Callable[[], object] | None = None,
    ) -> None:
        """Submit many records sharing one payload buffer, without copying it.

        ``release`` runs once, on the loop thread, after the last route and
        destination are done with the buffer.  A batch that fails validation
        is refused whole (and ``release`` is not called: the buffer is still
        the caller's); blocks while ingress is full.
        """
        self._ingress.put_batch(self._checked_batch(descriptors, payload, release))

    async def asubmit_batch(
        self,
        descriptors: Any,
        payload: Any,
        release: Callable[[], object] | None = None,
    ) -> None:
        """``submit_batch`` for asyncio servers: never blocks the event loop.

        When ingress has room the batch is queued at once; when it is full,
        the wait happens in a worker thread while the event loop runs on.
        """
        import asyncio

        batch = self._checked_batch(descriptors, payload, release)
        if not self._ingress.try_put_batch(batch):
            await asyncio.get_running_loop().run_in_executor(None, self._ingress.put_batch, batch)

    def _checked_batch(
        self, descriptors: Any, payload: Any, release: Callable[[], object] | None
    ) -> RecordBatch:
        desc = readonly_descriptors(descriptors)
        data = readonly_bytes(payload)
        nbytes = check_batch(
            desc,
            len(data),
            bound_ids=len(self.hooks),
            schema=self.schema,
            hook_name=self.hooks.name_of,
        )
        return RecordBatch(desc, data, BufferLease(release), nbytes)

    def submit(
        self,
        output_id: int,
        payload: Any,
        *,
        key: int = 0,
        step: int = 0,
        seq: int | None = None,
        timestamp_ns: int | None = None,
    ) -> None:
        """Submit one record; its payload bytes are copied into a coalesced batch.

        The layout is the one its hook was bound with (layout 0 otherwise).
        """
        layout_id, fixed, prefix, element = self._rule(output_id)
        data = payload if isinstance(payload, bytes) else readonly_bytes(payload).tobytes()
        size = len(data)
        if (fixed and size != fixed) or (element and (size < prefix or (size - prefix) % element)):
            raise PayloadSizeMismatch(
                f"hook {self.hooks.name_of(output_id)!r}: payload of {size} bytes does not fit "
                f"layout {self.schema.by_id(layout_id).name!r}"  # type: ignore[union-attr]
            )
        row = (
            output_id,
            layout_id,
            0,
            key,
            step,
            next(self._seq) if seq is None else seq,
            time.time_ns() if timestamp_ns is None else timestamp_ns,
        )
        self._ingress.put_record(row, data)

    def _rule(self, output_id: int) -> tuple[int, int, int, int]:
        """(layout_id, fixed size or 0, tail prefix, tail element size or 0), cached."""
        rule = self._record_rules.get(output_id)
        if rule is not None:
            return rule
        if not 0 <= output_id < len(self.hooks):
            raise UnboundOutputId(
                f"output_id {output_id} was never bound with bind_hook ({len(self.hooks)} bound)"
            )
        layout_name = self.hooks.layout_of(output_id)
        if self.schema is None:
            rule = (0, 0, 0, 0)
        else:
            layout_id = 0 if layout_name is None else self.schema.layout_id(layout_name)
            layout = self.schema.by_id(layout_id)
            tail = layout.tail
            if tail is None:
                rule = (layout_id, layout.dtype.itemsize, 0, 0)
            else:
                rule = (layout_id, 0, layout.prefix_size, tail.element_dtype.itemsize)
        self._record_rules[output_id] = rule
        return rule

    def flush(self, timeout: float | None = None) -> None:
        """Return once everything submitted before is in the destinations.

        Raises the first latched failure.
        """
        if self._thread is None:
            raise SinkClosed("runtime not started")
        self._ingress.put_control("flush").result(timeout)

    # -- observation -------------------------------------------------------

    @property
    def failure(self) -> BaseException | None:
        """The latched failure, or None."""
        return self._latch.failure

    def counters(self) -> RouterSnapshot:
        """Ingress counters plus the record sink's (when it keeps any); any thread."""
        loop_running = self._thread is not None and self._thread.is_alive()
        if not loop_running or threading.current_thread() is self._thread:
            return self._snapshot_in_loop()
        try:
            return trio.from_thread.run_sync(self._snapshot_in_loop, trio_token=self._token)
        except trio.RunFinishedError:
            return self._snapshot_in_loop()

    def _snapshot_in_loop(self) -> RouterSnapshot:
        ingress = self._ingress.snapshot()
        sink_counters = getattr(self.record_sink, "counters", None)
        snapshot = sink_counters() if callable(sink_counters) else RouterSnapshot({}, {}, 0, 0)
        failure = self._latch.failure or getattr(self.record_sink, "failure", None)
        return attrs.evolve(
            snapshot,
            ingress=ingress,
            failure=None if failure is None else str(failure),
        )


def create_record_runtime(
    record_sink: RecordSink,
    *,
    schema: RecordSchema | None = None,
    hooks: HookRegistry | None = None,
    capacity_records: int = 65_536,
    capacity_bytes: int = 256 * 2**20,
    when_full: WhenFull = "block",
    coalesce_records: int = 4096,
    name: str = "taproute",
    http: HttpConfig | None = None,
    dead_letters: DeadLetterStore | None = None,
) -> RecordRuntime:
    """Start a :class:`RecordRuntime` around ``record_sink`` and return it.

    ``capacity_records``/``capacity_bytes`` bound ingress; when full,
    ``submit`` blocks (``when_full="block"``, the default) or raises
    :class:`~taproute.routing.errors.IngressFull` (``"reject"``).  The schema
    and hook registry default to the sink's own (a ``RoutingSink`` has both).
    With ``http``, ``/metrics``, ``/status`` and ``/healthz`` are served from
    the same loop (see ``runtime.http_urls``); with ``dead_letters`` (the
    store the routing sink's ``on_failure`` writes to) also the dead-letter
    controls.
    """
    return RecordRuntime(
        record_sink,
        schema=schema,
        hooks=hooks,
        capacity_records=capacity_records,
        capacity_bytes=capacity_bytes,
        when_full=when_full,
        coalesce_records=coalesce_records,
        name=name,
        http=http,
        dead_letters=dead_letters,
    ).start()


__all__ = ["RecordRuntime", "create_record_runtime"]
