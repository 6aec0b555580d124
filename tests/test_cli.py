"""`taproute demo`: the README's main job, end to end."""

from __future__ import annotations

from taproute.service.cli import main


def test_demo_routes_every_record_through_every_route(capsys):
    assert main(["demo", "--requests", "20"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for route, mode in (
        ("raw_query", "forward"),
        ("head_norms", "stateless"),
        ("unit_stats", "stateful"),
    ):
        _, got_mode, processed, emitted, failed = lines[route]
        assert int(emitted) > 0
        assert got_mode == mode
        assert int(processed) == 120 and int(failed) == 0
    assert "layer 5:" in out and "over 320 tokens" in out
