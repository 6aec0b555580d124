"""Refusals of unmatched records (issue #15): each route that declined, in
order, with its reason cut to one line of at most 500 bytes, for a bounded
sample of recent unmatched records per hook; in /status, /metrics and by
`taproute trace` (which first refuses what submission would refuse)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from taproute.routing import (
    HookRegistry,
    PayloadSizeMismatch,
    RecordBatch,
    Route,
    RoutingConfig,
    UnboundOutputId,
)
from taproute.service import CaptureSink, HttpConfig, RoutingSink, create_record_runtime
from taproute.service.host.cli import main
from tests.conftest import vec_batch
from tests.processors import SCHEMA

Q, K = "layers.0.q", "layers.0.k"
LONG = "odd step: " + "é" * 400 + "\nsecond line of the reason"


def routing_sink(hooks: HookRegistry, out: CaptureSink) -> RoutingSink:
    hooks.bind("mlp.0")
    return RoutingSink(
        RoutingConfig(
            [
                Route("evens", Q, "out", predicate=lambda d: (d["step"] % 2 == 0, LONG)),
                Route("small_keys", "layers.*.q", "out", predicate=lambda d: (d["key"] < 3, "big")),
                Route("other", "mlp.*", "out"),
            ]
        ),
        SCHEMA,
        {"out": out, "rest": CaptureSink()},
        "rest",
        hooks=hooks,
    )


def batch_of(output_id: int, n: int, seq_start: int = 0) -> RecordBatch:
    batch = vec_batch(output_id, n, seq_start=seq_start)
    desc = batch.descriptors.copy()
    desc["step"] = np.arange(seq_start, seq_start + n)
    desc["key"] = np.arange(seq_start, seq_start + n)
    return RecordBatch.from_buffer(desc, batch.payload)


def test_refusals_are_kept_bounded_truncated_and_shown_in_status_and_trace():
    hooks = HookRegistry()
    q, k = hooks.bind(Q, layout="vec"), hooks.bind(K, layout="vec")
    out = CaptureSink()
    sink = routing_sink(hooks, out)
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        (url,) = runtime.http_urls
        for start in (0, 20):  # the second batch pushes the first one's samples out
            b = batch_of(q, 20, start)
            runtime.submit_batch(b.descriptors, b.payload)
        kb = batch_of(k, 3)
        runtime.submit_batch(kb.descriptors, kb.payload)
        runtime.flush()
        snap = runtime.counters()
        with urllib.request.urlopen(f"{url}/status", timeout=60) as response:
            status = json.loads(response.read())
        traced = sink.trace(Q, key=7, step=3)
    # Unmatched: odd steps with key >= 3 (evens declines odd steps, small_keys keys >= 3).
    samples = snap.unmatched_samples[Q]
    assert [s.seq for s in samples] == [25, 27, 29, 31, 33, 35, 37, 39]  # the last 8
    reason = samples[0].refusals[0].reason
    assert reason.startswith("odd step: éé") and "\n" not in reason
    assert len(reason.encode()) <= 500 and len(reason.encode()) >= 499
    reason.encode().decode()  # cut on a character boundary
    assert [(r.route, r.reason) for r in samples[0].refusals] == [
        ("evens", reason),
        ("small_keys", "big"),
    ]
    # A hook no route's outputs match: sampled, with no route to have declined it.
    assert [(s.seq, s.refusals) for s in snap.unmatched_samples[K]] == [(0, ()), (1, ()), (2, ())]
    assert status["unmatched_samples"][Q][0]["refusals"][1] == {
        "route": "small_keys",
        "reason": "big",
    }
    assert status["causal"]["derived"] == 0 and status["causal"]["limits"]["max_depth"] == 32
    # The trace says the same for one record, with the recent sample of its hook.
    assert [(v.route, v.verdict) for v in traced.verdicts] == [
        ("evens", "skip"),
        ("small_keys", "skip"),
        ("other", "bypassed"),
    ]
    assert [(r.route, r.reason) for r in traced.refusals] == [
        ("evens", reason),
        ("small_keys", "big"),
    ]
    assert traced.recent_unmatched == samples
    assert snap.unmatched_forwarded == 19 + 3 and snap.routes["evens"].declined == 20
    out.clear()


def test_trace_refuses_what_submission_would_refuse():
    hooks = HookRegistry()
    hooks.bind(Q, layout="vec")
    sink = routing_sink(hooks, CaptureSink())
    with pytest.raises(UnboundOutputId, match="hook 'mlp.1' was never bound"):
        sink.trace("mlp.1")
    assert hooks.id_of("mlp.1") is None  # refused, and nothing bound by asking
    with pytest.raises(
        PayloadSizeMismatch, match=r"payload of 12 bytes does not fit layout 'vec' \(16 bytes\)"
    ):
        sink.trace(Q, length=12)
    assert [v.verdict for v in sink.trace(Q, length=16, step=2).verdicts][:1] == ["match"]
    with pytest.raises(PayloadSizeMismatch, match="layout 'norm'"):
        sink.trace(Q, layout="norm", length=16)
    # A negative length was refused as "payload_size must be >= 0", a field
    # the trace's caller never gave.
    for bad in (-5, 1.5, True):
        with pytest.raises(PayloadSizeMismatch, match=r"trace: length must be payload bytes >= 0"):
            sink.trace(Q, length=bad)


def test_cli_trace_against_a_running_service_prints_refusals_and_recent_unmatched(capsys):
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    with create_record_runtime(record_sink=routing_sink(hooks, out), http=HttpConfig(port=0)) as rt:
        (url,) = rt.http_urls
        b = batch_of(q, 6)
        rt.submit_batch(b.descriptors, b.payload)
        rt.flush()
        assert main(["trace", "--url", url, "--hook", Q, "--key", "9", "--step", "1"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert main(["trace", "--url", url, "--hook", "mlp.9"]) == 2
        err = capsys.readouterr().err
    assert lines[0] == "trace layers.0.q key=9 step=1"
    assert lines[4].strip() == "=> rest"
    assert lines[5].startswith("  refused by: evens (odd step: é") and lines[5].endswith(
        "; small_keys (big)"
    )
    assert lines[6] == "  recent unmatched records of layers.0.q (2, oldest first):"
    assert lines[7].startswith("    key=3 step=3 seq=3: evens (odd step")
    assert "trace refused (400)" in err and "'mlp.9' was never bound" in err
    out.clear()


def test_the_refusal_sample_is_bounded_per_hook_and_in_hooks():
    from taproute.native import make_descriptors
    from taproute.routing.refusals import RefusalLog

    log = RefusalLog(per_hook=2, max_hooks=2)
    names = {0: "a", 1: "b", 2: "c"}.__getitem__
    for hook in (0, 1, 0, 2):  # "b" is the hook noted longest ago when "c" arrives
        d = make_descriptors(hook, 0, count=3, seqs=[10 * hook, 10 * hook + 1, 10 * hook + 2])
        log.note(d, np.arange(3), [("r", np.array([1]), "why\nnot")], names)
    samples = log.by_hook()
    assert sorted(samples) == ["a", "c"]
    assert [s.seq for s in samples["a"]] == [1, 2]
    assert [[(r.route, r.reason) for r in s.refusals] for s in samples["c"]] == [[("r", "why")], []]
