"""complete / cancel / reopen of a key no stateful route can hold is refused.

A request key goes through each stateful route's key function; a key outside
one route's ``[0, key_range)`` is no key of that route and is ignored by it
(another route may hold it).  But a key outside *every* stateful route's range
was ignored by all of them, silently: a ``complete`` that could never finalize
anything (a wrong id, a key function or range that does not fit the ids) went
unnoticed.  It now raises :class:`KeyNotHeld` naming the key and each route's
range, before anything is applied; through the threaded runtime the returned
future raises it, and the runtime goes on (it is the caller's error, not a
failure of the router).  With no stateful route at all a key control still
does nothing: a ``capture_context(end_keys=runtime)`` on any config keeps
working.
"""

from __future__ import annotations

import numpy as np
import pytest

from taproute.actors import open_routing_sink
from taproute.routing import (
    HookRegistry,
    KeyNotHeld,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink, RoutingSink, create_record_runtime
from tests.conftest import vec_batch
from tests.processors import SCHEMA

Q = "model.layers.0.attn.q"


def _count(records, keys: np.ndarray, state) -> None:
    np.add.at(state.slots[:, 0], keys, 1)


stateful_processor(
    "test.count_small",
    key=lambda d: d["key"],
    key_range=8,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="sum",
)(_count)
stateful_processor(
    "test.count_big",
    key=lambda d: d["key"] - 100,
    key_range=32,
    slot=SlotSpec((1,), "int64"),
    input="vec",
    output="sum",
)(_count)


def _config() -> RoutingConfig:
    return RoutingConfig(
        [
            Route("small", Q, "out", mode="stateful", processor="test.count_small"),
            Route("big", Q, "out", mode="stateful", processor="test.count_big"),
        ]
    )


async def test_a_key_no_stateful_route_holds_is_refused_naming_key_and_ranges():
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    async with open_routing_sink(
        _config(), SCHEMA, {"out": CaptureSink()}, "out", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(q, 2, keys=[3, 110]))
        await sink.complete(110)  # the big route's key 10; the small route ignores it
        await sink.complete(3)  # the small route's; big maps it to -97, not its key
        with pytest.raises(KeyNotHeld) as caught:
            await sink.complete(5, 40, 99)
        message = str(caught.value)
        assert message.startswith("complete: key(s) 40, 99 held by no stateful route")
        assert "route 'small' maps 40 to 40, outside [0, 8)" in message
        assert "route 'big' maps 40 to -60, outside [0, 32)" in message
        assert "nothing was completed" in message
        assert isinstance(caught.value, ValueError)
        with pytest.raises(KeyNotHeld, match=r"^cancel: key\(s\) 8 held by no"):
            await sink.cancel(8)
        with pytest.raises(KeyNotHeld, match=r"^reopen: key\(s\) -1 held by no"):
            await sink.reopen(-1)
        # Refused whole: key 5 (the small route's) was not completed with it.
        await sink.submit(vec_batch(q, 1, keys=[5], seq_start=10))
        await sink.flush()
        routes = sink.snapshot().routes
        assert routes["small"].completed_keys == 1 and routes["big"].completed_keys == 1
        assert routes["small"].terminal_records == 0 and routes["small"].processed == 2


def test_through_the_runtime_the_future_raises_and_the_runtime_goes_on():
    sink = RoutingSink(_config(), SCHEMA, {"out": CaptureSink()}, "out")
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        with pytest.raises(KeyNotHeld, match=r"complete: key\(s\) 64 held by no stateful route"):
            runtime.complete(64).result(timeout=60)
        runtime.submit_batch(*_batch(q, [2, 102]))
        runtime.complete(2, 102).result(timeout=60)  # not latched: later calls work
        runtime.flush()
        routes = runtime.counters().routes
        assert routes["small"].completed_keys == 1 and routes["big"].completed_keys == 1


def test_without_stateful_routes_a_key_control_does_nothing():
    sink = RoutingSink(
        RoutingConfig([Route("raw", Q, "out")]), SCHEMA, {"out": CaptureSink()}, "out"
    )
    with create_record_runtime(record_sink=sink) as runtime:
        runtime.complete(12345).result(timeout=60)
        runtime.flush()


def _batch(output_id: int, keys: list[int]):
    from taproute.native import make_descriptors

    n = len(keys)
    return make_descriptors(output_id, 16, count=n, keys=keys), np.zeros((n, 4), np.float32)


def test_a_refusal_from_capture_context_is_counted_and_logged_not_raised(caplog):
    """``capture_context(end_keys=runtime)`` dropped the future its complete or
    cancel returned: a key no stateful route holds was refused with
    ``KeyNotHeld`` and nobody saw it (no count, no log, no raise).  Now the
    runtime counts every refused key control (``ingress.refused_key_controls``,
    on /metrics too) and capture_context logs the first refusal per runtime
    and action; nothing is raised into the forward pass, and the runtime
    goes on."""
    import logging

    from taproute.service.capture import capture_context
    from taproute.service.host.metrics import SnapshotCollector

    sink = RoutingSink(_config(), SCHEMA, {"out": CaptureSink()}, "out")
    caplog.set_level(logging.WARNING, logger="taproute.capture")
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        with capture_context([2, 64], end_keys=runtime):
            runtime.submit_batch(*_batch(q, [2, 102]))
        failing = pytest.raises(RuntimeError, match="the forward pass")
        with failing, capture_context([65], end_keys=runtime):
            raise RuntimeError("the forward pass")
        with capture_context([66], end_keys=runtime):  # counted, not logged again
            pass
        # The key controls run in order before the flush: their refusals are in.
        runtime.flush()
        assert runtime.counters().ingress.refused_key_controls == 3
        assert runtime.failure is None
        routes = runtime.counters().routes
        assert routes["small"].completed_keys == 0  # refused whole: key 2 not completed
        runtime.complete(2, 102).result(timeout=60)  # the runtime goes on
        runtime.flush()
        routes = runtime.counters().routes
        assert routes["small"].completed_keys == 1 and routes["big"].completed_keys == 1
        exported = {
            sample.name: sample.value
            for family in SnapshotCollector(runtime.counters).collect()
            for sample in family.samples
        }
        assert exported["taproute_ingress_refused_key_controls_total"] == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "taproute.capture"]
    assert messages == [
        "capture_context: complete of keys (2, 64) at the end of the block was refused: "
        "complete: key(s) 64 held by no stateful route: route 'small' maps 64 to 64, "
        "outside [0, 8); route 'big' maps 64 to -36, outside [0, 32); nothing was "
        "completed (counted in ingress.refused_key_controls; later refusals of complete "
        "by this runtime are counted, not logged)",
        "capture_context: cancel of keys (65,) at the end of the block was refused: "
        "cancel: key(s) 65 held by no stateful route: route 'small' maps 65 to 65, "
        "outside [0, 8); route 'big' maps 65 to -35, outside [0, 32); nothing was "
        "cancelled (counted in ingress.refused_key_controls; later refusals of cancel "
        "by this runtime are counted, not logged)",
    ]


def _capture_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "taproute.capture"]


def test_capture_context_raises_nothing_when_the_runtime_cannot_take_the_control(caplog):
    """``end_keys.complete`` / ``.cancel`` raising at once at the end of the
    block (a runtime not started) reached the caller, i.e. the model server's
    request; a closed runtime's refusal was neither counted nor logged.  Now
    neither raises: each is counted (``ingress.failed_key_controls``), the
    first per runtime and action logged, and a block that exited by an
    exception re-raises the caller's own exception."""
    import logging

    from taproute.service.capture import capture_context
    from taproute.service.host.runtime import RecordRuntime

    caplog.set_level(logging.WARNING, logger="taproute.capture")
    idle = RecordRuntime(RoutingSink(_config(), SCHEMA, {"out": CaptureSink()}, "out"))
    with capture_context([2], end_keys=idle):  # raised SinkClosed: runtime not started
        pass
    with pytest.raises(RuntimeError, match="the forward pass"), capture_context([3], end_keys=idle):
        raise RuntimeError("the forward pass")
    assert idle.counters().ingress.failed_key_controls == 2
    assert _capture_messages(caplog) == [
        "capture_context: complete of keys (2,) at the end of the block failed: SinkClosed: "
        "runtime not started (not raised into the caller; counted in "
        "ingress.failed_key_controls by a runtime; later failures of complete by this "
        "runtime are not logged)",
        "capture_context: cancel of keys (3,) at the end of the block failed: SinkClosed: "
        "runtime not started (not raised into the caller; counted in "
        "ingress.failed_key_controls by a runtime; later failures of cancel by this "
        "runtime are not logged)",
    ]
    caplog.clear()

    sink = RoutingSink(_config(), SCHEMA, {"out": CaptureSink()}, "out")
    runtime = create_record_runtime(record_sink=sink)
    runtime.close()
    for key in (4, 5):
        with capture_context([key], end_keys=runtime):
            pass
    assert runtime.counters().ingress.failed_key_controls == 2
    assert runtime.counters().ingress.refused_key_controls == 0
    assert _capture_messages(caplog) == [
        "capture_context: complete of keys (4,) at the end of the block failed: SinkClosed: "
        "runtime is closed; complete refused (not raised into the caller; counted in "
        "ingress.failed_key_controls by a runtime; later failures of complete by this "
        "runtime are not logged)"
    ]


def test_capture_context_raises_nothing_once_the_runtime_loop_is_gone(caplog):
    """The runtime's loop died (a loop task failed): the block's complete is
    refused with the loop's error, counted and logged, never raised."""
    import logging
    import threading

    import trio

    from taproute.service.capture import capture_context
    from taproute.service.host.runtime import RecordRuntime

    caplog.set_level(logging.WARNING, logger="taproute.capture")
    runtime = RecordRuntime(RoutingSink(_config(), SCHEMA, {"out": CaptureSink()}, "out"))
    boom = threading.Event()

    async def doomed(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.to_thread.run_sync(boom.wait, 60)
        raise OSError("the loop task failed")

    runtime.host(doomed)
    runtime.start()
    boom.set()
    assert runtime._thread is not None
    runtime._thread.join(60)
    assert not runtime._thread.is_alive()
    with capture_context([6], end_keys=runtime):
        pass
    assert runtime.counters().ingress.failed_key_controls == 1
    (message,) = _capture_messages(caplog)
    assert message.startswith(
        "capture_context: complete of keys (6,) at the end of the block failed: RoutingFailure:"
    )
    assert "OSError: the loop task failed" in message
    with pytest.raises(Exception, match="the loop task failed"):
        runtime.close()
