"""Tracing a candidate configuration without applying it, saying which
generation was traced, and route samplers (``taproute trace --samples``)."""

from __future__ import annotations

from pathlib import Path

from taproute.routing import FailurePolicy, HookRegistry, Route, RoutingConfig
from taproute.service import CaptureSink, HttpConfig, RoutingSink, create_record_runtime
from taproute.service.host.cli import main
from tests.processors import LAYOUTS_TOML, SCHEMA
from tests.sampling_processors import RecentOnly

NOW_S = 1_000.0


def sampled_sink(*routes: Route) -> RoutingSink:
    hooks = HookRegistry()
    hooks.bind("layers.0.q", layout="vec")
    hooks.bind("layers.1.k", layout="vec")
    return RoutingSink(
        RoutingConfig(list(routes)),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        hooks=hooks,
    )


def test_samplers_offer_records_built_from_the_configuration_traced_in_route_order():
    sink = sampled_sink(
        Route("n", "layers.0.*", "out", mode="stateless", processor="sampling.norms", workers=3),
        Route(
            "recent",
            "layers.1.k",
            "out",
            predicate=RecentOnly(60, clock=lambda: NOW_S),
            failure_policy=FailurePolicy(deadline=0),
        ),
        Route("broken", "layers.1.k", "out", mode="stateless", processor="sampling.broken"),
    )
    traced = sink.trace_samples(now_ns=int(NOW_S * 1e9))
    assert [(t.route, t.source, t.sample.name) for t in traced.samples] == [
        ("n", "processor", "layers.0.q@now"),
        ("recent", "predicate", "fresh"),
        ("recent", "predicate", "stale"),
    ]
    n, fresh, stale = (t.result for t in traced.samples)
    assert n is not None and fresh is not None and stale is not None
    assert traced.samples[0].sample.key == 3  # the route's workers, from the configuration
    assert [v.verdict for v in n.verdicts] == ["match", "not_reached", "not_reached"]
    # The sampler saw the router's clock: its fresh sample is inside the window.
    assert [(v.route, v.verdict) for v in fresh.verdicts][1] == ("recent", "match")
    assert [(v.route, v.verdict, v.reason) for v in stale.verdicts][1] == (
        "recent",
        "skip",
        "older than 60 s",
    )
    assert {t.result.generation for t in traced.samples if t.result} == {1}
    [failed] = traced.failed
    assert (failed.route, failed.source) == ("broken", "processor")
    assert failed.error == "RuntimeError: the feature store is down"


async def test_a_candidate_is_traced_without_being_applied():
    out = CaptureSink()
    sink = sampled_sink(Route("r", "layers.0.q", "out"))
    candidate = RoutingConfig([Route("r2", "layers.1.k", "out")])
    result = sink.trace_candidate(candidate, "layers.1.k")
    assert result.generation == "candidate"
    assert [(v.route, v.verdict) for v in result.verdicts] == [("r2", "match")]
    running = sink.trace("layers.1.k")
    assert running.generation == 1 and running.dropped  # the running routes are unchanged
    assert out.records == 0


CONFIG = (
    """
processors = ["tests.processors", "tests.sampling_processors"]

"""
    + LAYOUTS_TOML
    + """
[[routes]]
name = "n"
outputs = ["layers.0.q"]
mode = "stateless"
processor = "sampling.norms"
workers = 2
destination = "ch"

[destinations.ch]
path = "@DATA@"
rows = ["norm"]

[routing]
unmatched = "drop"

[[producer.hooks]]
name = "layers.0.q"
layout = "vec"
"""
)


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "candidate.toml"
    path.write_text(CONFIG.replace("@DATA@", str(tmp_path / "data")))
    return path


def test_cli_traces_a_candidate_file_and_its_samples(tmp_path, capsys):
    path = write_config(tmp_path)
    assert main(["trace", "--config", str(path), "--hook", "layers.0.q", "--key", "5"]) == 0
    out = capsys.readouterr().out
    assert f"traced: candidate configuration {path} (not applied)" in out
    assert "n                    match" in out
    assert not (tmp_path / "data").exists()  # a candidate opens no destination

    assert main(["trace", "--config", str(path), "--samples"]) == 0
    out = capsys.readouterr().out
    assert "sample layers.0.q@now (route n, processor): layers.0.q key=2" in out
    assert "n                    match" in out
    assert "traced: candidate configuration" in out


def test_cli_says_which_running_generation_it_traced(tmp_path, capsys):
    sink = sampled_sink(Route("r", "layers.0.q", "out"))
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as service:
        service.reload(RoutingConfig([Route("r", "layers.*", "out")]))
        url = service.http_urls[0]
        assert main(["trace", "--url", url, "--hook", "layers.1.k"]) == 0
    out = capsys.readouterr().out
    assert f"traced: generation 2 (running at {url})" in out
    assert "r                    match" in out
