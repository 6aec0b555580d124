"""Telemetry never harms inference: a failed destination, an output that can't
be captured or a slow destination never raise into the forward pass nor block
it past ``max_block``; what is lost is counted, warned once and reported."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
import trio
from torch import nn

from taproute.routing import RecordSchema
from taproute.service import CaptureSink, HttpConfig, create_record_runtime
from taproute.service.capture import CaptureWarning, bind_module, bind_modules, capture_context
from tests.capture_models import ACTS, VOCAB, gpt2
from tests.sinks import FailingSink, NullSink

SCHEMA = RecordSchema([ACTS])


class ThreadGateSink(CaptureSink):
    """A slow destination: each submit waits until a plain thread opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    async def submit(self, batch) -> None:
        await trio.to_thread.run_sync(self.gate.wait)
        await super().submit(batch)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_failed_destination_never_fails_the_forward_pass():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 4))
    with torch.inference_mode():
        expected = model(ids).logits
    runtime = create_record_runtime(record_sink=FailingSink(fail_on=1), schema=SCHEMA)
    (binding,) = bind_modules(runtime, model, "transformer.h.0", layout="acts")
    with torch.inference_mode(), capture_context([1, 2]):
        model(ids)
    with pytest.raises(Exception, match="disk full"):
        runtime.flush()  # the destination failed: the runtime latched it
    with torch.inference_mode(), capture_context([1, 2]):
        with pytest.warns(CaptureWarning) as warned:
            got = model(ids).logits  # submit raises the latched failure: the hooks detach
        (warning,) = warned  # once, not once per call
        assert "disk full); the hook detached" in str(warning.message)
        again = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    assert binding.detached
    dropped = runtime.counters().ingress.dropped
    assert dropped == {"transformer.h.0": {"runtime_failed": 2, "detached": 2}}
    with pytest.raises(Exception, match="disk full"):
        runtime.close()


def test_a_model_still_running_after_a_clean_close_counts_runtime_closed():
    """After a clean close() the hooks don't raise or detach: each call's
    records are counted as dropped for 'runtime_closed', warned once."""
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 4))
    with torch.inference_mode():
        expected = model(ids).logits
    runtime = create_record_runtime(record_sink=NullSink(), schema=SCHEMA)
    (binding,) = bind_modules(runtime, model, "transformer.h.0", layout="acts")
    runtime.close()
    with torch.inference_mode(), capture_context([1, 2]):
        with pytest.warns(CaptureWarning) as warned:
            got = model(ids).logits
        (warning,) = warned
        assert "runtime is closed" in str(warning.message)
        again = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    assert not binding.detached
    assert runtime.counters().ingress.dropped == {"transformer.h.0": {"runtime_closed": 4}}


def test_on_error_raise_lets_a_strict_user_see_the_failure_in_the_forward():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 4))
    runtime = create_record_runtime(record_sink=FailingSink(fail_on=1), schema=SCHEMA)
    bind_modules(runtime, model, "transformer.h.0", layout="acts", on_error="raise")
    with torch.inference_mode(), capture_context([1, 2]):
        model(ids)
    with pytest.raises(Exception, match="disk full"):
        runtime.flush()
    with (
        torch.inference_mode(),
        capture_context([1, 2]),
        pytest.raises(Exception, match="disk full"),
    ):
        model(ids)
    with pytest.raises(Exception, match="disk full"):
        runtime.close()


def test_healthz_says_degraded_while_capture_drops_records_and_metrics_count_them():
    ident = nn.Identity()
    with create_record_runtime(
        record_sink=CaptureSink(), schema=SCHEMA, http=HttpConfig(port=0)
    ) as runtime:
        (url,) = runtime.http_urls
        assert get(f"{url}/healthz") == (200, {"status": "ok"})
        bind_module(runtime, ident, "ident", layout="acts")
        with capture_context([1]), pytest.warns(CaptureWarning, match="not a tensor"):
            ident({"x": torch.ones(1, 2, 3)})  # a dict without select: the binding detaches
        with pytest.warns(CaptureWarning, match="outside a capture_context"):
            ident(torch.ones(1, 2, 3))  # skipped: counted, not degraded
        status, body = get(f"{url}/healthz")
        assert status == 200
        assert body == {"status": "degraded", "dropped": {"ident": {"bad_output": 1}}, "shed": 0}
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
            metrics = response.read().decode()
        assert 'taproute_capture_dropped_records_total{hook="ident",reason="bad_output"} 1.0' in (
            metrics
        )
        assert 'taproute_capture_skipped_calls_total{hook="ident",reason="no_context"} 1.0' in (
            metrics
        )


def test_max_block_bounds_how_long_a_slow_destination_holds_the_model():
    sink = ThreadGateSink()
    ident = nn.Identity()
    x = torch.randn(2, 3, 4)
    max_block = 0.05
    with create_record_runtime(
        record_sink=sink, schema=SCHEMA, capacity_records=2, max_block=max_block
    ) as runtime:
        assert runtime.max_block == max_block
        bind_module(runtime, ident, "ident", layout="acts")
        try:
            with capture_context([1, 2]):
                ident(x)  # queued: ingress now holds 2 of 2 records until the sink lets go
                started = time.perf_counter()
                with pytest.warns(CaptureWarning, match="longer than max_block; records shed"):
                    ident(x)  # no room: waits max_block, then sheds
                held = time.perf_counter() - started
        finally:
            sink.gate.set()  # never leave the runtime's close waiting on the gate
        assert held >= max_block
        ingress = runtime.counters().ingress
        assert ingress.shed == 2
        assert ingress.dropped == {"ident": {"max_block": 2}}
        assert ingress.blocked_seconds >= max_block
        runtime.flush()
        assert sink.records == 2  # the first call's records, delivered; nothing else


def test_max_block_is_one_budget_per_stall_not_one_per_hook():
    """A stuck destination costs a forward pass one ``max_block``: once a hook's
    wait ran out, the later hooks shed at once until ingress moves again."""
    sink = ThreadGateSink()
    hooks = 8
    model = nn.Sequential(*(nn.Identity() for _ in range(hooks)))
    x = torch.randn(2, 3, 4)
    max_block = 0.5
    with create_record_runtime(
        record_sink=sink, schema=SCHEMA, capacity_records=2, max_block=max_block
    ) as runtime:
        bind_modules(runtime, model, "*", layout="acts")
        try:
            with capture_context([1, 2]), pytest.warns(CaptureWarning, match="records shed"):
                model(x)  # the first hook fills ingress; the second waits, then sheds
        finally:
            sink.gate.set()
        ingress = runtime.counters().ingress
        assert ingress.shed == 2 * (hooks - 1)
        # One wait of max_block (however late the wake-up), never seven: the
        # old bound waited at every hook, at least 7 * max_block in all.
        assert max_block <= ingress.blocked_seconds < (hooks - 1) * max_block
        runtime.flush()  # the destination recovered and ingress moved
        assert sink.records == 2
        with capture_context([3, 4]):
            model(x)  # room again: every hook's records are taken
        runtime.flush()
        assert sink.records == 2 + 2 * hooks
        assert runtime.counters().ingress.shed == 2 * (hooks - 1)


def test_without_max_block_a_full_ingress_still_blocks_until_room():
    sink = ThreadGateSink()
    ident = nn.Identity()
    x = torch.randn(2, 3, 4)
    with create_record_runtime(record_sink=sink, schema=SCHEMA, capacity_records=2) as runtime:
        bind_module(runtime, ident, "ident", layout="acts")
        done = threading.Event()

        def second() -> None:
            with capture_context([3, 4]):
                ident(x)
            done.set()

        with capture_context([1, 2]):
            ident(x)
        thread = threading.Thread(target=second)
        thread.start()
        try:
            assert not done.wait(0.05)  # held: ingress is full and there is no bound
        finally:
            sink.gate.set()
        thread.join(60)
        assert done.is_set()
        runtime.flush()
        assert sink.records == 4 and runtime.counters().ingress.shed == 0


def test_a_rejecting_ingress_drops_that_call_only_and_the_binding_stays():
    sink = ThreadGateSink()
    ident = nn.Identity()
    x = torch.randn(2, 3, 4)
    with create_record_runtime(
        record_sink=sink, schema=SCHEMA, capacity_records=2, when_full="reject"
    ) as runtime:
        binding = bind_module(runtime, ident, "ident", layout="acts")
        with capture_context([1, 2]):
            try:
                ident(x)  # queued: ingress is full until the sink lets go
                with pytest.warns(
                    CaptureWarning, match=r"ingress full .*\(reason 'ingress_full'\)"
                ):
                    ident(x)  # refused: dropped and counted, inference goes on
            finally:
                sink.gate.set()  # never leave the runtime's close waiting on the gate
            runtime.flush()
            ident(x)  # room again: captured
        runtime.flush()
        assert not binding.detached
        assert sink.records == 4
        assert runtime.counters().ingress.dropped == {"ident": {"ingress_full": 2}}
