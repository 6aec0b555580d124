"""A call that waits for the runtime's loop, made on that loop's own thread
(a release callback, a sink, a processor running on the loop), would wait for
itself forever: ``flush()`` and ``close()`` hung the whole service (with a
timeout, timed out), as does a submit that must wait for ingress room. They
raise at once instead, saying why."""

from __future__ import annotations

import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import Records, Route, RoutingConfig, stateless_processor
from taproute.service import RoutingSink, create_record_runtime
from tests.processors import NORM, SCHEMA
from tests.sinks import NullSink

VEC = SCHEMA.layout_id("vec")


@pytest.mark.parametrize("call", ["flush", "close", "submit_batch"])
def test_a_waiting_call_on_the_loop_thread_raises_instead_of_hanging(call):
    sink = RoutingSink(
        RoutingConfig([Route("raw", "h.*", "out")]), SCHEMA, {"out": NullSink()}, unmatched="drop"
    )
    runtime = create_record_runtime(record_sink=sink, capacity_records=4)
    seen: list[BaseException | None] = []
    try:
        hook = runtime.bind_hook("h.0", layout="vec")

        def on_release() -> None:  # runs on the loop thread
            try:
                if call == "flush":
                    runtime.flush(timeout=5)
                elif call == "close":
                    runtime.close(timeout=5)
                else:  # full: queued behind a batch the loop has not taken
                    for _ in range(2):
                        runtime.submit_batch(
                            make_descriptors(hook, 16, count=4, layout_ids=VEC),
                            np.zeros((4, 4), np.float32),
                        )
            except BaseException as exc:
                seen.append(exc)
            else:
                seen.append(None)

        runtime.submit_batch(
            make_descriptors(hook, 16, count=4, layout_ids=VEC),
            np.zeros((4, 4), np.float32),
            release=on_release,
        )
        runtime.flush(timeout=30)
        (error,) = seen
        assert isinstance(error, RuntimeError), error
        assert "loop thread" in str(error) and "would wait for" in str(error)
    finally:
        runtime.close(timeout=30)


RUNTIMES: list = []
SEEN_IN_PROCESSOR: list[BaseException | None] = []


@stateless_processor("loopcalls.flushes", input="vec", output="norm", needs_thread=True)
def flushes_from_inside(records: Records) -> np.ndarray:
    """Calls its own runtime's flush (or close) from its worker thread."""
    runtime, call = RUNTIMES[-1]
    try:
        getattr(runtime, call)(timeout=5)
    except BaseException as exc:
        SEEN_IN_PROCESSOR.append(exc)
    else:
        SEEN_IN_PROCESSOR.append(None)
    rows = np.zeros(len(records), dtype=NORM.dtype)
    rows["seq"] = records.descriptors["seq"]
    return rows


@pytest.mark.parametrize("call", ["flush", "close"])
def test_a_waiting_call_from_a_processor_in_a_worker_thread_raises_instead_of_hanging(call):
    """A processor in a worker thread that flushes (or closes) its own runtime
    waited for its own call to return: the route never drained, and the
    runtime's flush hung (timed out) with it.  It raises at once now, and
    the processor's rows still arrive."""
    out = NullSink()
    sink = RoutingSink(
        RoutingConfig([Route("r", "h.*", "out", mode="stateless", processor="loopcalls.flushes")]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
    )
    SEEN_IN_PROCESSOR.clear()
    runtime = create_record_runtime(record_sink=sink)
    RUNTIMES.append((runtime, call))
    try:
        hook = runtime.bind_hook("h.0", layout="vec")
        runtime.submit_batch(
            make_descriptors(hook, 16, count=4, layout_ids=VEC), np.zeros((4, 4), np.float32)
        )
        runtime.flush(timeout=30)
        (error,) = SEEN_IN_PROCESSOR
        assert isinstance(error, RuntimeError), error
        assert "from inside a processor or predicate" in str(error)
        assert out.records == 4
    finally:
        runtime.close(timeout=30)
