"""Replay over raw tables of BFloat16 captures: ClickHouse hands BFloat16 out
as 2-byte binary values (Arrow has no bfloat16), and those bytes are the
values the live route read, so replayed rows equal live rows exactly."""

from __future__ import annotations

import numpy as np
import torch

from taproute.routing import Layout, Records, RecordSchema, Route, RoutingConfig
from taproute.routing import stateless_processor as register_stateless
from taproute.service import (
    ClickHouseCorpus,
    ClickHouseTable,
    RoutingSink,
    create_record_runtime,
    make_descriptors,
    run_replay,
)
from taproute.service.capture import bind_modules, capture_context
from tests.capture_models import VOCAB, gpt2

HALF = Layout("half", [("values", "Array(BFloat16)")])
HALF4 = Layout("half4", [("values", "Array(BFloat16)", (4,))])
STATS = Layout(
    "half_stats", [("key", "Int64"), ("step", "Int64"), ("sum", "Float64"), ("n", "Int64")]
)
SCHEMA = RecordSchema([HALF, HALF4, STATS])


def _stats(records: Records) -> np.ndarray:
    rows = np.empty(len(records), dtype=STATS.dtype)
    rows["key"] = records.descriptors["key"]
    rows["step"] = records.descriptors["step"]
    fixed = records.layout.is_fixed
    for i in range(len(records)):
        values = records.rows()["values"][i] if fixed else records.tail(i)
        rows["sum"][i] = values.astype(np.float64).sum()
        rows["n"][i] = values.size
    return rows


register_stateless("test.half_stats", input="half", output="half_stats")(_stats)
register_stateless("test.half4_stats", input="half4", output="half_stats")(_stats)


def test_replay_of_bfloat16_captures_equals_live(clickhouse, tmp_path):
    model = gpt2().to(torch.bfloat16)
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [0] + [1] * 5])
    config = RoutingConfig(
        [
            Route("raw", "*", "ch"),
            Route("live", "h.*", "ch", mode="stateless", processor="test.half_stats"),
            Route("live4", "fixed", "ch", mode="stateless", processor="test.half4_stats"),
        ]
    )
    destinations = {
        "ch": lambda: clickhouse.sink(SCHEMA, raw=["half", "half4"], rows=["half_stats"])
    }
    fixed = np.arange(-8, 8, dtype=np.float32).reshape(4, 4) / 3
    with create_record_runtime(
        record_sink=RoutingSink(config, SCHEMA, destinations, unmatched="drop")
    ) as runtime:
        bind_modules(runtime, model, "transformer.h.*.mlp", layout="half", prefix="h.")
        with torch.inference_mode(), capture_context([5, 6, 7], attention_mask=mask):
            model(ids, attention_mask=mask)
        hook = runtime.bind_hook("fixed", layout="half4")
        halves = torch.from_numpy(fixed).to(torch.bfloat16).view(torch.int16).numpy()
        runtime.submit_batch(
            make_descriptors(hook, 8, count=4, keys=np.arange(100, 104), layout_ids=1),
            halves.view(np.uint8).reshape(-1),
        )
        runtime.flush()
    live = clickhouse.query("SELECT key, step, sum, n FROM {p}_half_stats ORDER BY key, sum")
    live = live.to_pylist()
    assert len(live) == 2 * 3 + 4

    replayed = []
    for layout, processor in (("half", "test.half_stats"), ("half4", "test.half4_stats")):
        out = f"{clickhouse.prefix}_replay_{layout}"
        run_replay(
            source=ClickHouseCorpus(clickhouse.transport, layout, table=clickhouse.raw(layout)),
            processor=processor,
            schema=SCHEMA,
            outputs={"half_stats": ClickHouseTable(out)},
            runs_dir=tmp_path / "runs",
            progress=False,
        )
        replayed += clickhouse.query(f"SELECT key, step, sum, n FROM {out}").to_pylist()
    assert sorted(replayed, key=lambda r: (r["key"], r["sum"])) == live
