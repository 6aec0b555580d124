"""A destination that does not keep the sink contract is named where it is
taken: a sink whose methods are plain functions (the contract awaits them) is
refused before anything runs, and a factory that raises says which
destination's factory it was."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import trio

from taproute.native import make_descriptors
from taproute.routing import ConfigError, Route, RoutingConfig
from taproute.service import RoutingSink, create_record_runtime
from tests.processors import SCHEMA
from tests.sinks import NullSink


class PlainMethods:
    """submit/flush/close written without ``async``: they look like a sink."""

    def __init__(self) -> None:
        self.records = 0

    def submit(self, batch) -> None:
        self.records += len(batch)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class PlainFlush(NullSink):
    def flush(self) -> None:  # type: ignore[override]
        pass


def _routing_sink(destination) -> RoutingSink:
    return RoutingSink(
        RoutingConfig([Route("raw", "layers.*", "db")]),
        SCHEMA,
        {"db": destination},
        unmatched="drop",
    )


def test_a_sink_whose_methods_are_not_async_is_refused_naming_the_destination():
    """It was taken, and its first submit latched "submit failed: TypeError:
    object NoneType can't be used in 'await' expression" as the router's
    failure: the records were lost and the message did not say why."""
    with pytest.raises(
        ConfigError,
        match=r"destination 'db': PlainMethods\.submit, "
        r"PlainMethods\.flush, PlainMethods\.close are not async",
    ) as caught:
        _routing_sink(PlainMethods())
    assert caught.value.where == "destinations.db"
    with pytest.raises(ConfigError, match=r"destination 'db': PlainFlush\.flush is not async"):
        _routing_sink(PlainFlush())


def test_a_factory_whose_sink_is_not_async_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"destination 'db': PlainMethods\.submit.* async def"):
        create_record_runtime(record_sink=_routing_sink(PlainMethods))


def test_the_runtime_refuses_a_record_sink_whose_methods_are_not_async():
    with pytest.raises(TypeError, match=r"record_sink: PlainMethods\.submit, .* not async"):
        create_record_runtime(record_sink=PlainMethods(), schema=SCHEMA)


def test_a_wrapped_async_method_is_still_taken():
    """A decorator that hands on the coroutine (functools.wraps) keeps a sink a
    sink: only a method written as a plain function is refused."""

    def traced(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            return method(*args, **kwargs)

        return call

    class Traced(NullSink):
        submit = traced(NullSink.submit)

    out = Traced()
    with create_record_runtime(record_sink=_routing_sink(out)) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="vec")
        runtime.submit_batch(
            make_descriptors(q, 16, count=2, layout_ids=SCHEMA.layout_id("vec")),
            np.zeros((2, 4), np.float32),
        )
        runtime.flush()
    assert out.records == 2


def test_a_factory_that_raises_names_its_destination():
    """Its exception went through bare (a ZeroDivisionError, an OSError from a
    client library): nothing said which destination's factory raised. It keeps
    its type (callers catch it) and gains a note naming the destination."""

    def broken() -> NullSink:
        raise OSError(13, "Permission denied", "/data/ch")

    with pytest.raises(OSError, match="Permission denied") as caught:
        create_record_runtime(record_sink=_routing_sink(broken))
    assert "opening destination 'db' (its factory raised)" in caught.value.__notes__


class LosesItsConnection(NullSink):
    """A background sink whose run() task fails: at start, or once its first
    batch arrives (a connection lost while running)."""

    def __init__(self, *, at_start: bool) -> None:
        super().__init__()
        self.at_start = at_start
        self.running = False
        self._first = trio.Event()
        self._lost = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.at_start:
            raise OSError(111, "Connection refused")
        self.running = True
        task_status.started()
        await self._first.wait()
        self._lost.set()
        raise ConnectionResetError(104, "Connection reset by peer")

    async def submit(self, batch) -> None:
        await super().submit(batch)
        self._first.set()

    async def flush(self) -> None:
        await self._lost.wait()  # a flush that meets the lost connection


def test_a_destinations_run_task_that_fails_names_the_destination():
    """A run() task failing once running was latched as "runtime loop failed:
    ConnectionResetError: ..." and one failing at start went out of
    create_record_runtime bare: neither said which destination. The running
    one is now latched as a RoutingFailure naming the destination and its
    task; the one at start keeps its type, with a note naming the destination."""
    from taproute.service import RoutingFailure

    with pytest.raises(OSError, match="Connection refused") as caught:
        create_record_runtime(record_sink=_routing_sink(lambda: LosesItsConnection(at_start=True)))
    assert "starting destination 'db' (its run() task)" in caught.value.__notes__

    runtime = create_record_runtime(
        record_sink=_routing_sink(lambda: LosesItsConnection(at_start=False))
    )
    q = runtime.bind_hook("layers.0.q", layout="vec")
    runtime.submit_batch(
        make_descriptors(q, 16, count=2, layout_ids=SCHEMA.layout_id("vec")),
        np.zeros((2, 4), np.float32),
    )
    message = r"destination 'db', its run\(\) task failed: ConnectionResetError: .*reset by peer"
    with pytest.raises(RoutingFailure, match=message) as failed:
        runtime.close()  # the batch reaches the sink, whose task then fails
    assert failed.value.destination == "db"
    assert runtime.failure is failed.value
