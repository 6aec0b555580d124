"""The signal processors' example config: one line per route, layouts equal to
the registered ones, every route's processor reading and writing them."""

from __future__ import annotations

from pathlib import Path

from taproute.routing.processors import REGISTRY
from taproute.service.host.config import load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "service" / "signals" / "signals.toml"


def test_example_config_routes_are_one_line_and_layouts_match_the_processors():
    text = EXAMPLE.read_text()
    config = load_config(EXAMPLE)
    config.import_processors()
    from taproute.service.signals import experts, pathways, qk, twonn

    schema = config.schema()
    registered = {
        layout.name: layout
        for signals in (qk.SIGNALS, experts.SIGNALS, pathways.SIGNALS, twonn.SIGNALS)
        for layout in signals.layouts
    }
    assert {name: schema.layout(name) for name in registered} == registered
    routes = config.routing_config().routes
    assert len(routes) == 5
    for route in routes:
        line = next(line for line in text.splitlines() if f'name = "{route.name}"' in line)
        assert f'processor = "{route.processor}"' in line  # the whole route on one line
        spec = REGISTRY.get(route.processor)
        assert spec.input in registered and spec.output in registered
