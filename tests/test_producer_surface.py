"""One producer surface, two shells: the routing sink (awaited on the Trio loop)
and the runtime (any thread) share one intake, so a batch is checked once and
both refuse bad input with the same errors."""

from __future__ import annotations

import numpy as np
import pytest

from taproute.actors import RoutingSink, open_routing_sink
from taproute.native import DescriptorFieldError, make_descriptors
from taproute.routing import (
    HookRegistry,
    Route,
    RoutingConfig,
    UnboundOutputId,
    UnknownLayout,
    validation,
)
from taproute.service import RecordRuntime, create_record_runtime
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.sinks import NullSink

Q = "layers.0.attn.q"


def _sink(destination: NullSink, **kwargs) -> RoutingSink:
    routes = [
        Route("raw", "layers.*", "out"),
        Route("sums", "layers.*", "out", mode="stateful", processor="test.running_sum"),
    ]
    return RoutingSink(
        RoutingConfig(routes), SCHEMA, {"out": destination}, default_destination="out", **kwargs
    )


@pytest.fixture
def native_checks(monkeypatch) -> list[int]:
    """Count the native batch checks (each entry: the records of one checked batch)."""
    seen: list[int] = []
    check = validation.check_descriptors

    def counting(desc, *args):
        seen.append(len(desc))
        return check(desc, *args)

    monkeypatch.setattr(validation, "check_descriptors", counting)
    return seen


def test_a_batch_through_the_runtime_is_checked_once(native_checks):
    out = NullSink()
    with create_record_runtime(record_sink=_sink(out)) as runtime:
        assert runtime.intake is runtime.record_sink.intake  # one intake, shared
        q = runtime.bind_hook(Q, layout="vec")
        for n in (3, 5, 7):
            runtime.submit_batch(
                make_descriptors(q, 16, count=n, layout_ids=SCHEMA.layout_id("vec")),
                np.zeros((n, 4), np.float32),
            )
        runtime.submit(q, np.ones(4, np.float32).tobytes(), key=1)  # checked per record
        runtime.flush(timeout=60)
        routed = runtime.counters().routes["raw"].processed
    assert native_checks == [3, 5, 7]  # the sink checked none of them again
    assert routed == 16


def test_a_runtime_with_its_own_schema_does_not_share_the_sinks_intake(native_checks):
    out = NullSink()
    other = type(SCHEMA)(list(SCHEMA.layouts))  # equal, not the sink's: checked by both
    with create_record_runtime(record_sink=_sink(out), schema=other) as runtime:
        assert runtime.intake is not runtime.record_sink.intake
        q = runtime.bind_hook(Q, layout="vec")
        runtime.submit_batch(
            make_descriptors(q, 16, count=4, layout_ids=SCHEMA.layout_id("vec")),
            np.zeros((4, 4), np.float32),
        )
        runtime.flush(timeout=60)
        routed = runtime.counters().routes["raw"].processed
    assert native_checks == [4, 4]
    assert routed == 4


async def test_a_batch_given_to_the_sink_directly_is_still_checked():
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = NullSink()
    async with open_routing_sink(
        RoutingConfig([Route("raw", "layers.*", "out")]), SCHEMA, {"out": out}, "out", hooks=hooks
    ) as sink:
        bad = vec_batch(q, 2, output_ids=np.array([q, 9]))
        with pytest.raises(UnboundOutputId, match="record 1 of the batch: output_id 9"):
            await sink.submit(bad)
        await sink.submit(vec_batch(q, 3))
        await sink.flush()
    assert out.records == 3  # nothing of the refused batch was routed


async def test_both_shells_refuse_a_bad_key_with_the_same_error():
    async with open_routing_sink(
        RoutingConfig(
            [Route("sums", "layers.*", "out", mode="stateful", processor="test.running_sum")]
        ),
        SCHEMA,
        {"out": NullSink()},
        "out",
    ) as sink:
        with pytest.raises(DescriptorFieldError) as on_loop:
            await sink.complete(1, "7")
        with pytest.raises(DescriptorFieldError) as huge_on_loop:
            await sink.cancel(2**63)
    with create_record_runtime(record_sink=_sink(NullSink())) as runtime:
        with pytest.raises(DescriptorFieldError) as on_thread:
            runtime.complete(1, "7")
        with pytest.raises(DescriptorFieldError) as huge_on_thread:
            runtime.cancel(2**63)
    assert str(on_loop.value) == str(on_thread.value) == "key must be an integer, got str ('7')"
    assert str(huge_on_loop.value) == str(huge_on_thread.value)
    assert "key=9223372036854775808 is outside its range" in str(huge_on_thread.value)


async def test_both_shells_refuse_an_unknown_layout_when_binding():
    async with open_routing_sink(
        RoutingConfig([Route("raw", "layers.*", "out")]), SCHEMA, {"out": NullSink()}, "out"
    ) as sink:
        with pytest.raises(UnknownLayout) as on_loop:
            sink.bind_hook(Q, layout="nrom")
    with (
        create_record_runtime(record_sink=_sink(NullSink())) as runtime,
        pytest.raises(UnknownLayout) as on_thread,
    ):
        runtime.bind_hook(Q, layout="nrom")
    assert str(on_loop.value) == str(on_thread.value)
    assert "nrom" in str(on_thread.value)


def test_the_service_object_is_the_runtime_not_a_copy_of_its_methods():
    with create_record_runtime(record_sink=_sink(NullSink())) as service:
        assert isinstance(service, RecordRuntime)
        for name in ("submit", "submit_batch", "offer_batch", "flush", "complete", "snapshot"):
            assert getattr(type(service), name) is getattr(RecordRuntime, name), name
        assert service.counters().routes.keys() == {"raw", "sums"}


def test_what_a_producer_hands_in_wrong_is_named_with_what_was_expected():
    """A payload that is not bytes-like, a size off the layout's rule, and
    make_descriptors' arrays of the wrong length are refused by name (a str
    payload raised memoryview's TypeError; a 3-key array for count=2, numpy's
    broadcast error; a size mismatch did not say what would fit)."""
    from taproute.routing import PayloadSizeMismatch, RecordError

    with create_record_runtime(record_sink=_sink(NullSink())) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        t = runtime.bind_hook("layers.1.tokens", layout="tokens")
        with pytest.raises(RecordError, match="payload must be bytes-like .* found str"):
            runtime.submit(q, "abcd" * 4)
        with pytest.raises(RecordError, match="payload must be bytes-like .* found list"):
            runtime.submit_batch(make_descriptors(q, 16), [0.0] * 4)
        with pytest.raises(PayloadSizeMismatch, match=r"'vec' \(expected 16 bytes\)"):
            runtime.submit(q, b"x" * 12)
        with pytest.raises(
            PayloadSizeMismatch, match=r"'tokens' \(expected 4 bytes then a multiple of 4\)"
        ):
            runtime.submit(t, b"x" * 6)
        runtime.submit(q, np.ones(4, np.float32))  # what was accepted is still delivered
        runtime.flush()
        assert runtime.counters().routes["raw"].processed == 1
    with pytest.raises(DescriptorFieldError, match=r"keys has shape \(3,\), expected \(2,\)"):
        make_descriptors(0, 16, count=2, keys=np.arange(3))


def test_a_flush_that_times_out_says_so():
    """``flush(timeout=...)`` past its time raises a TimeoutError saying what
    happened (it was concurrent.futures' bare, empty one)."""
    from tests.sinks import HeldFlush

    held = HeldFlush()
    with create_record_runtime(record_sink=_sink(held)) as runtime:
        with pytest.raises(TimeoutError, match=r"flush: not done within 0.05 s"):
            runtime.flush(timeout=0.05)
        held.release.set()
        runtime.flush()
    assert held.flushes >= 1


def test_a_release_that_cannot_be_called_is_refused_at_submit():
    """``release=`` that is not callable (a typo, a pool object, the buffer
    itself) is refused where it is handed in, naming the argument, and the
    router goes on. It was taken, and the route that returned the buffer's
    last lease latched ``TypeError: 'int' object is not callable`` as the
    runtime's failure: every later submit and flush raised it."""
    from taproute.routing import RecordBatch, RecordError

    with create_record_runtime(record_sink=_sink(NullSink())) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        desc = make_descriptors(q, 16, count=2, layout_ids=SCHEMA.layout_id("vec"))
        buffer = np.ones((2, 4), np.float32)
        for call in (runtime.submit_batch, runtime.try_submit_batch):
            with pytest.raises(RecordError, match=r"release must be callable .* found int 5"):
                call(desc, buffer, release=5)  # type: ignore[arg-type]
        with pytest.raises(RecordError, match=r"release must be callable .* found ndarray"):
            RecordBatch.from_buffer(desc, buffer, release=buffer)  # type: ignore[arg-type]
        runtime.submit_batch(desc, buffer)  # nothing was latched: the router goes on
        runtime.flush()
        assert runtime.counters().routes["raw"].processed == 2
        assert runtime.failure is None


@pytest.mark.parametrize(("timeout", "error"), [("1", TypeError), (float("nan"), ValueError)])
def test_a_timeout_that_is_not_seconds_is_refused_naming_it(timeout, error):
    """flush(timeout="1") raised "'>=' not supported between instances of
    'str' and 'float'"; flush(timeout=nan) was taken as a wait already past
    (TimeoutError "not done within nan s")."""
    with create_record_runtime(record_sink=_sink(NullSink())) as runtime:
        with pytest.raises(error, match=r"timeout must be seconds \(a number\) or None, found"):
            runtime.flush(timeout=timeout)
        runtime.flush(timeout=5)
        # close(timeout=...) the same: "1" was converted by float(), and NaN
        # became a grace of 0 s; refused, the runtime is still open to close.
        with pytest.raises(error, match=r"timeout must be seconds \(a number\) or None, found"):
            runtime.close(timeout=timeout)
        runtime.flush(timeout=5)
