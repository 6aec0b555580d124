"""The service object: a runtime plus what serves around it on the same loop.

:class:`RecordService` is a :class:`~taproute.service.host.runtime.RecordRuntime`
(thread + ingress + record worker; the producer API is the runtime's,
inherited, never restated) with two independent pieces composed around it:

- optionally :class:`~taproute.service.ops.controls.DeadLetterControls`
  over a dead-letter store, fed back into that runtime;
- optionally the HTTP endpoint (``/metrics``, ``/status``, ``/healthz``,
  the controls, ``/trace``), hosted as one of the runtime's loop tasks.

::

    with create_record_runtime(record_sink=routing_sink) as runtime:
        q = runtime.bind_hook("layers.0.attn.q", layout="qk")
        runtime.submit_batch(descriptors, pinned_buffer, release=pool.give_back)
        runtime.flush()
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import trio

from taproute.routing.errors import ConfigError
from taproute.routing.hooks import HookRegistry
from taproute.routing.limits import (
    COALESCE_RECORDS,
    QUEUE_BYTES,
    QUEUE_RECORDS,
    SHUTDOWN_GRACE_S,
)
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import RecordSink, Traceable
from taproute.service.host.batch_merge import SpansPayloads
from taproute.service.host.http import HttpConfig, build_app, serve_http
from taproute.service.host.ingress import WAKE_DELAY_S, WhenFull
from taproute.service.host.runtime import RecordRuntime
from taproute.service.host.runtime_options import check_service_options
from taproute.service.ops.controls import DeadLetterControls
from taproute.service.ops.dead_letters import DeadLetter, DeadLetterStore
from taproute.service.ops.endpoints import NoReloader


class RecordService(RecordRuntime):
    """A :class:`RecordRuntime` serving its HTTP endpoint and operator controls.

    Everything a producer calls (``bind_hook``, ``submit``, ``submit_batch``,
    ``try_submit_batch``, ``offer_batch``, ``asubmit_batch``, ``flush``,
    ``complete``, ``cancel``, ``reopen``, ``snapshot``) is the runtime's own
    method, inherited, not restated; closing the service closes the runtime
    (and with it the HTTP endpoint, a task on its loop).  Create with
    :func:`create_record_runtime`; ``options`` are :class:`RecordRuntime`'s.
    """

    def __init__(
        self,
        record_sink: RecordSink,
        *,
        http: HttpConfig | None = None,
        dead_letters: DeadLetterStore | None = None,
        **options: Any,
    ) -> None:
        check_service_options(http, dead_letters)
        super().__init__(record_sink, **options)
        self.http = http
        #: The URLs the HTTP endpoint listens on, once started (empty without one).
        self.http_urls: list[str] = []
        #: Where the routing sink's given-up records are kept (for the controls).
        self.dead_letters = dead_letters
        if dead_letters is not None and dead_letters.hooks is None:
            dead_letters.attach_hooks(self.hooks)  # letters name their hook, reroutes find it
        if dead_letters is not None:
            self._stores.append(dead_letters)  # whether it takes writes, in the snapshot
        # Checked once: a sink that can trace gets the /trace endpoint.
        self._trace = record_sink.trace if isinstance(record_sink, Traceable) else None
        if http is not None:
            self.host(self._serve_http)
        self.controls: DeadLetterControls | None = (
            None
            if dead_letters is None
            else DeadLetterControls(dead_letters, self, None if http is None else http.token)
        )
        #: What ``POST /reload`` runs: re-reads the service's config file and
        #: reloads from it, returning the new generation (a service built from
        #: a config file has one; see ``taproute.service.host.reload``).  One
        #: with a ``queue()`` method (a ``ConfigReloader``) is queued instead,
        #: so that the answer need not wait for a saturated router's ingress.
        self.reloader: Callable[[], int] | None = None

    async def _serve_http(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """A loop task: serve the endpoint until the runtime stops its loop."""
        assert self.http is not None
        app = build_app(
            self.snapshot,  # on the loop thread: read directly, no crossing
            controls=self.controls,
            trace=self._trace,
            max_body_bytes=self.http.max_body_bytes,
            reload=self._reload_from_source,
            token=self.http.token,
        )
        async with trio.open_nursery() as nursery:
            self.http_urls = await nursery.start(serve_http, app, self.http)
            task_status.started()

    def _reload_from_source(self, timeout: float | None = None) -> Future[int]:
        """What ``POST /reload`` runs (in a worker thread): the reload queued
        (a :class:`ConfigReloader` checks the file and queues its swap without
        waiting for it, but for ingress room at most ``timeout`` seconds), or,
        for another reloader, its call made and done."""
        reloader = self.reloader
        if reloader is None:
            raise NoReloader(
                "this service was not started from a config file: reload it from Python "
                "with service.reload(config)"
            )
        queue = getattr(reloader, "queue", None)
        if callable(queue):
            queued: Future[int] = queue(timeout)
            return queued
        done: Future[int] = Future()
        done.set_result(reloader())
        return done

    # -- operator controls ---------------------------------------------------

    def reroute(self, letter_id: int, route: str | None = None) -> DeadLetter:
        """Send a copy of dead letter ``letter_id`` to the route that failed it (or
        to ``route``), once; any thread but the loop's.  See
        :meth:`DeadLetterControls.reroute` for what is refused."""
        if self.controls is None:
            raise ConfigError("this runtime has no dead-letter store (dead_letters=...)")
        return self.controls.reroute(letter_id, route)


def create_record_runtime(
    record_sink: RecordSink,
    *,
    schema: RecordSchema | None = None,
    hooks: HookRegistry | None = None,
    capacity_records: int = QUEUE_RECORDS,
    capacity_bytes: int = QUEUE_BYTES,
    when_full: WhenFull = "block",
    coalesce_records: int = COALESCE_RECORDS,
    name: str = "taproute",
    http: HttpConfig | None = None,
    dead_letters: DeadLetterStore | None = None,
    max_block: float | None = None,
    arena: SpansPayloads | None = None,
    wake_delay: float = WAKE_DELAY_S,
    shutdown_grace: float = SHUTDOWN_GRACE_S,
) -> RecordService:
    """Start a :class:`RecordService` around ``record_sink`` and return it.

    ``capacity_records``/``capacity_bytes`` bound ingress; when full,
    ``submit`` blocks (``when_full="block"``, the default) or raises
    :class:`~taproute.routing.errors.IngressFull` (``"reject"``).  The schema
    and hook registry default to the sink's own (a ``RoutingSink`` has both).
    With ``http``, ``/metrics``, ``/status`` and ``/healthz`` are served from
    the same loop (see ``runtime.http_urls``); with ``dead_letters`` (the
    store the routing sink's ``on_failure`` writes to) also the dead-letter
    controls.  ``max_block`` (seconds) bounds how long a capture hook may
    block the model waiting for ingress room; past it, records are shed and
    counted (``offer_batch``).  With ``arena`` (where the capture hooks copy
    payloads: a writer sink's ``buffer_pool``), the batches taken at one
    wake-up are handed on merged into one, without a copy.  ``wake_delay``
    (seconds) is how often the loop takes what capture hooks queued while
    they keep queueing (they do not wake it; half-full ingress does): a
    longer one means fewer, larger wake-ups (each pays the loop's fixed cost
    once, on the GIL the model shares) and records that reach their
    destinations up to that much later.  ``shutdown_grace`` (seconds, 30 by
    default; ``math.inf``: no bound) bounds ``close()``/``stop()``/leaving the
    ``with`` block: past it what still runs is cut off and
    :class:`~taproute.routing.errors.ShutdownAbandoned` says what was lost
    (see :meth:`RecordRuntime.close`).
    """
    return RecordService(
        record_sink,
        http=http,
        dead_letters=dead_letters,
        schema=schema,
        hooks=hooks,
        capacity_records=capacity_records,
        capacity_bytes=capacity_bytes,
        when_full=when_full,
        coalesce_records=coalesce_records,
        name=name,
        max_block=max_block,
        arena=arena,
        wake_delay=wake_delay,
        shutdown_grace=shutdown_grace,
    ).start()


__all__ = ["RecordService", "create_record_runtime"]
