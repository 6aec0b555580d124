"""Reload through the runtime (the service object): ordered with the records
submitted around it, refused whole when the new configuration has problems,
and the generation on every counter snapshot, in /metrics and on dead letters."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from taproute.native import make_descriptors
from taproute.routing import ConfigError, FailurePolicy, PlanErrors, Route, RoutingConfig
from taproute.service import (
    CaptureSink,
    DeadLetterStore,
    HttpConfig,
    RoutingSink,
    create_record_runtime,
)
from tests.processors import SCHEMA

Q = "layers.0.q"


def submit(runtime, output_id: int, seqs: range) -> None:
    values = np.zeros((len(seqs), 4), np.float32)
    runtime.submit_batch(
        make_descriptors(
            output_id,
            16,
            count=len(seqs),
            layout_ids=SCHEMA.layout_id("vec"),
            keys=np.arange(len(seqs)),
            seqs=np.array(seqs),
        ),
        values,
    )


def test_runtime_reload_is_ordered_with_submissions(tmp_path):
    a, b = CaptureSink(), CaptureSink()
    store = DeadLetterStore(tmp_path / "dead.sqlite")
    sink = RoutingSink(
        RoutingConfig([Route("r", Q, "a")]),
        SCHEMA,
        {"a": a, "b": b},
        unmatched="drop",
        on_failure=store.handle,
    )
    store.attach_hooks(sink.hooks)
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        assert runtime.counters().generation == 1
        submit(runtime, q, range(0, 3))
        # No flush in between: the reload is queued behind those records.
        panics = Route(
            "p",
            Q,
            "b",
            mode="stateless",
            processor="test.raises",
            failure_policy=FailurePolicy(deadline=0),
        )
        assert runtime.reload(RoutingConfig([Route("r", Q, "b"), panics])) == 2
        submit(runtime, q, range(10, 12))
        runtime.flush()
        snap = runtime.counters()
        with pytest.raises(PlanErrors) as caught:
            runtime.reload(
                RoutingConfig(
                    [
                        Route("x", Q, "nowhere"),
                        Route("y", Q, "a", mode="stateless", processor="no.such"),
                    ]
                )
            )
        assert [where for _, where in caught.value.located()] == ["routes[0]", "routes[1]"]
        assert runtime.counters().generation == 2
        with urllib.request.urlopen(f"{runtime.http_urls[0]}/metrics") as response:
            metrics = response.read().decode()
    assert a.descriptors()["seq"].tolist() == [0, 1, 2]
    assert b.descriptors()["seq"].tolist() == [10, 11]
    assert snap.generation == 2
    assert "taproute_config_generation 2.0" in metrics
    letters = store.list()
    store.close()
    assert sorted(letter.seq for letter in letters) == [10, 11]
    assert {letter.generation for letter in letters} == {2}
    assert {letter.code for letter in letters} == {"handler_panic"}


def test_reload_of_something_not_a_routing_config_is_refused_by_name():
    """A path or a list of routes is refused naming what reload takes (a path
    was an AttributeError from inside the generation build); the running
    generation goes on."""
    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig([Route("raw", "*", "out")]), SCHEMA, {"out": out}, unmatched="drop"
    )
    with create_record_runtime(record_sink=sink) as runtime:
        for wrong in ("router.toml", [Route("raw", "*", "out")]):
            with pytest.raises(ConfigError, match="reload takes a RoutingConfig, found"):
                runtime.reload(wrong)  # type: ignore[arg-type]
        q = runtime.bind_hook(Q, layout="vec")
        submit(runtime, q, range(2))
        runtime.flush()
        assert runtime.counters().generation == 1
        assert runtime.counters().routes["raw"].processed == 2
