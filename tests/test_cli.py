"""`taproute demo`: the README's main job, end to end into chDB."""

from __future__ import annotations

from taproute.service.cli import main


def test_demo_routes_every_record_into_chdb_and_queries_it(capsys, chdb_transport):
    # chDB allows one data directory per process: the demo shares the test session's.
    assert main(["demo", "--requests", "20", "--data", str(chdb_transport.path)]) == 0
    out = capsys.readouterr().out
    text = out.splitlines()
    route_section = text[text.index(next(t for t in text if t.startswith("route"))) + 1 :]
    routes = {t.split()[0]: t.split() for t in route_section[:3]}
    lines = {t.split()[0]: t.split() for t in text if t.strip()}
    for route, mode in (
        ("raw_query", "forward"),
        ("head_norms", "stateless"),
        ("unit_stats", "stateful"),
    ):
        _, got_mode, processed, emitted, failed = routes[route]
        assert got_mode == mode
        assert int(processed) == 120 and int(emitted) == 120 and int(failed) == 0
    # Tables: every raw capture, one norm row per capture.
    assert "raw_query" in out and lines["layers.5.attn.q"][1] == "20"
    counts = chdb_transport.query(
        "SELECT (SELECT count() FROM raw_query) AS raw, (SELECT count() FROM head_norms) AS norms"
    ).to_pylist()
    assert counts == [{"raw": 120, "norms": 120}]
    # The synthetic model scales layer L's activations by 1 + L/6: variance grows with depth.
    variances = [float(lines[f"layers.{i}.attn.q"][3]) for i in range(6)]
    assert variances == sorted(variances) and 0.8 < variances[0] < 1.2
