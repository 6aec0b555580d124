"""``taproute run``: drive a configured router from a synthetic producer at a
given rate for a given time, serving HTTP, with a progress line."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import make_descriptors
from taproute.routing.errors import ShutdownAbandoned
from taproute.routing.layout import Layout
from taproute.service.host.config import (
    BuiltService,
    ConfigFileError,
    ProducerHook,
    ServiceConfig,
)
from taproute.service.host.counters import ServiceSnapshot
from taproute.service.host.http import HttpConfig
from taproute.service.host.reload import ConfigReloader
from taproute.service.host.service import RecordService


def synthetic_payload(
    layout: Layout, hook: ProducerHook, rng: np.random.Generator
) -> tuple[npt.NDArray[np.uint8], int]:
    """``hook.batch`` records of ``layout`` with random values; (buffer, record bytes)."""
    if layout.tail is None:
        rows = np.zeros(hook.batch, dtype=layout.dtype)
        for column in layout.columns:
            field = rows[column.name]
            if field.dtype.kind in "fiu":
                field[...] = rng.standard_normal(field.shape) * 10
        return rows.view(np.uint8).reshape(-1), layout.dtype.itemsize
    element = layout.tail.element_dtype
    record = layout.prefix_size + hook.elements * element.itemsize
    buffer = np.zeros(hook.batch * record, dtype=np.uint8)
    for i in range(hook.batch):
        start = i * record + layout.prefix_size
        values = rng.standard_normal(hook.elements).astype(element)
        buffer[start : start + values.nbytes] = values.view(np.uint8)
    return buffer, record


def run_load(
    config: ServiceConfig,
    *,
    rate: float,
    duration: float,
    seed: int = 0,
    out: TextIO | None = None,
    call_timeout: float | None = None,
    summary: bool = False,
) -> ServiceSnapshot:
    """Submit ``rate`` records/s for ``duration`` seconds; return the final counters.

    SIGHUP reloads the config file (``call_timeout``: the ``--call-timeout``
    to apply to it again); the outcome is printed on its own line. SIGINT or
    SIGTERM stops the producer between two submissions, then closes (drains,
    flushes, closes, within the config's ``[shutdown] grace``) as at the end
    of ``duration`` (a second SIGINT interrupts at once).  ``summary``: also
    print a line per route and per destination at the end, also when the
    close was cut off by the grace (then :class:`ShutdownAbandoned` follows)."""
    out = sys.stdout if out is None else out  # the one in place now, not at import
    if not config.producer.hooks:
        raise ConfigFileError(
            config.source, ["producer.hooks: [[producer.hooks]] names no hook to generate for"]
        )
    rng = np.random.default_rng(seed)
    runtime: RecordService | None = None
    submitted, elapsed = 0, 0.0
    # From the start to the end of the close: a SIGHUP sent while the
    # service is built (a config manager reloading every instance) or while
    # it closes would otherwise take SIGHUP's default action, the end of the
    # process. One sent before it serves is applied once it does.
    signals = _Signals()
    restore = _on_signals(signals)
    try:
        with config.build() as built, _serving(built).start() as runtime:
            submitted, elapsed = _drive(
                config, built, runtime, rate, duration, rng, out, call_timeout, signals
            )
    except ShutdownAbandoned:
        # Closing was cut off by the grace: what the routes and destinations
        # did is still what the operator needs first; the error follows.
        if runtime is not None:
            _end(runtime, out, elapsed, duration, submitted, summary)
        raise
    finally:
        restore()
    # Closed (leaving the block): drained, flushed and closed within the
    # shutdown grace.
    assert runtime is not None
    return _end(runtime, out, elapsed, duration, submitted, summary)


def _end(
    runtime: RecordService,
    out: TextIO,
    elapsed: float,
    duration: float,
    submitted: int,
    summary: bool,
) -> ServiceSnapshot:
    """The last progress line (and the summary), from the closed runtime's counters."""
    counters = runtime.counters()
    _progress(out, elapsed, duration, submitted, counters)
    print(file=out)
    if summary:
        print_summary(counters, out)
    return counters


def _drive(
    config: ServiceConfig,
    built: BuiltService,
    runtime: RecordService,
    rate: float,
    duration: float,
    rng: np.random.Generator,
    out: TextIO,
    call_timeout: float | None,
    signals: _Signals,
) -> tuple[int, float]:
    """Submit at ``rate`` until ``duration`` or a stop signal (``signals``,
    whose handlers are in place); (records submitted, seconds it took)."""
    schema = built.sink.schema
    feeds = []
    for hook in config.producer.hooks:
        output_id = runtime.bind_hook(hook.name, layout=hook.layout)
        payload, record = synthetic_payload(schema.layout(hook.layout), hook, rng)
        feeds.append((output_id, schema.layout_id(hook.layout), hook.batch, payload, record))
    reloader = ConfigReloader(runtime, config, call_timeout=call_timeout)
    runtime.reloader = reloader
    hangup, stop = signals.hangup, signals.stop
    # The handlers are in place (run_load): whoever reads this line may signal at once.
    urls = ", ".join(f"{u}/metrics" for u in runtime.http_urls)
    print(f"serving {urls}", file=out, flush=True)
    started = time.monotonic()
    submitted = 0
    seq = 0
    next_report = started + 0.5
    while (now := time.monotonic()) - started < duration and not stop.is_set():
        if hangup.is_set():
            hangup.clear()
            _reload(reloader, runtime, out)
        due = rate * (now - started)
        if submitted >= due:
            time.sleep(min(0.01, (submitted - due) / rate))  # pacing, not synchronisation
            continue
        output_id, layout_id, batch, payload, record = feeds[seq % len(feeds)]
        descriptors = make_descriptors(
            output_id,
            record,
            count=batch,
            layout_ids=layout_id,
            keys=np.arange(seq * batch, (seq + 1) * batch) % 4096,
            seqs=np.arange(seq * batch, (seq + 1) * batch),
        )
        runtime.submit_batch(descriptors, payload)
        submitted += batch
        seq += 1
        if now >= next_report:
            _progress(out, now - started, duration, submitted, runtime.counters())
            next_report = now + 0.5
    return submitted, min(time.monotonic() - started, duration)  # less when stopped early


def print_summary(counters: ServiceSnapshot, out: TextIO) -> None:
    """One line per route (processed, emitted, failed) and per destination
    (rows sent, from which routes, rows abandoned, and what its spool still
    holds), from the counters of the runtime after its close."""
    for route in counters.routes.values():
        print(
            f"route {route.name}: processed {route.processed:,}, emitted {route.emitted:,}, "
            f"failed {route.failed:,}",
            file=out,
        )
    for name, destination in counters.destinations.items():
        feeding = [r for r in counters.routes.values() if r.destination == name]
        sources = ", ".join(f"{r.name} {r.emitted:,}" for r in feeding)
        held = ""  # sent to a spooling destination is not delivered: say what is not
        if destination.given_up_records:
            held += (
                f", {destination.given_up_records:,} of them given up by the sink (a shutdown "
                "whose grace ran out, or a close that stopped waiting: not delivered)"
            )
        if destination.abandoned_records:
            held += (
                f"; {destination.abandoned_records:,} rows abandoned before reaching it "
                "(a shutdown whose grace ran out)"
            )
        if destination.healthy is False:
            held += f"; unhealthy: {destination.unhealthy_reason}"
        if destination.spool_bytes:  # the runtime is closed: no later this run
            held += (
                f"; {destination.spool_bytes:,} bytes held in its spool, "
                "delivered at the next start, once it is reachable"
            )
        print(
            f"destination {name}: {destination.records:,} rows sent"
            + (f" (from routes {sources})" if sources else "")
            + held,
            file=out,
        )


@attrs.frozen
class _Signals:
    """What the signal handlers of a run set: ``hangup`` (SIGHUP: reload the
    file) and ``stop`` (SIGINT, SIGTERM: stop submitting, then close)."""

    hangup: threading.Event = attrs.Factory(threading.Event)
    stop: threading.Event = attrs.Factory(threading.Event)


def _on_signals(signals: _Signals) -> Callable[[], None]:
    """Set ``signals.hangup`` on SIGHUP and ``signals.stop`` on SIGINT/SIGTERM
    (main thread only); returns what puts the old handlers back.

    Why a flag for SIGINT: a KeyboardInterrupt raised in the middle of a
    submission (inside the ingress lock, or between a buffer's hand-over and
    its accounting) can leave the runtime unable to drain, and the process
    then never exits. Stopping between submissions drains and closes as a
    normal end does. A second SIGINT is the escape hatch: it interrupts."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Any] = {}

    hangup, stop = signals.hangup, signals.stop

    def on_stop(signum: int, frame: object) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    wanted = {signal.SIGINT: on_stop, signal.SIGTERM: on_stop}
    if hasattr(signal, "SIGHUP"):
        wanted[signal.SIGHUP] = lambda signum, frame: hangup.set()
    for signum, handler in wanted.items():
        previous[signum] = signal.signal(signum, handler)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def _reload(reloader: ConfigReloader, service: RecordService, out: TextIO) -> None:
    """Reload from the file; say what happened on a line of its own."""
    try:
        number = reloader()
    except ConfigFileError as exc:
        print(f"\nreload refused (generation {service.generation} goes on):\n{exc}", file=out)
    else:
        print(f"\nreloaded {reloader.config.source}: generation {number}", file=out)
    out.flush()


def _serving(built: BuiltService) -> BuiltService:
    """``built``, serving HTTP on the default port if its config names none."""
    return built if built.http is not None else attrs.evolve(built, http=HttpConfig())


#: Destinations named one by one on the progress line; past this many their
#: rows show as one total (the per-destination lines follow at the end).
PROGRESS_DESTINATIONS = 3


def progress_line(
    elapsed: float, duration: float, submitted: int, counters: ServiceSnapshot
) -> str:
    """The ``taproute run`` progress line: records the producer submitted and,
    per destination, the rows handed to it.

    Rows, not records: a record two routes take is two rows (one per route),
    and a processor may emit any number of rows per record, so the rows are
    never summed into one "delivered" figure beside the records submitted.
    """
    width = 30
    done = min(1.0, elapsed / duration)
    bar = "#" * int(done * width) + "." * (width - int(done * width))
    blocked = counters.ingress.blocked_seconds
    failed = sum(r.failed for r in counters.routes.values())
    rate = submitted / elapsed if elapsed > 0 else 0.0
    destinations = counters.destinations
    if len(destinations) <= PROGRESS_DESTINATIONS:
        sent = ", ".join(f"{name} {d.records:,}" for name, d in destinations.items()) or "none"
    else:
        total = sum(d.records for d in destinations.values())
        sent = f"{total:,} to {len(destinations)} destinations"
    return (
        f"[{bar}] {done:4.0%} {submitted:>10,} records submitted {rate:>10,.0f}/s, "
        f"rows sent: {sent}, failed {failed:,}, blocked {blocked:.2f}s"
    )


def _progress(
    out: TextIO, elapsed: float, duration: float, submitted: int, counters: ServiceSnapshot
) -> None:
    out.write("\r" + progress_line(elapsed, duration, submitted, counters))
    out.flush()
