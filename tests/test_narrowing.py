"""A forward route narrowing Float32 records to BFloat16 for its destination.

Values are compared bitwise with a round-to-nearest-even conversion written
here from the IEEE 754 bit patterns (independent of ml_dtypes and torch).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from taproute.actors import RoutingSink, open_routing_sink
from taproute.native import make_descriptors
from taproute.routing import ConfigError, HookRegistry, Layout, RecordSchema, Route, RoutingConfig
from taproute.routing.batch import RecordBatch
from taproute.routing.narrowing import narrow_batch
from taproute.service import CaptureSink, ClickHouseSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context
from taproute.service.host.config import ConfigFileError, load_config
from tests.capture_models import VOCAB, gpt2

ACTS = Layout("acts", [("values", "Array(Float32)")])
ACTS16 = Layout("acts16", [("values", "Array(BFloat16)")])
PAIR = Layout("pair", [("scale", "Float32"), ("values", "Array(Float32)", (2, 3))])
PAIR16 = Layout("pair16", [("scale", "BFloat16"), ("values", "Array(BFloat16)", (2, 3))])
INTS = Layout("ints", [("values", "Array(Int32)")])
SCHEMA = RecordSchema([ACTS, ACTS16, PAIR, PAIR16, INTS])


def rne_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns of float32 ``values``, rounded to nearest, ties to
    even, from the bits (NaNs handled by the caller)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounding = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + rounding) >> 16).astype(np.uint16)


def assert_narrowed(got: np.ndarray, source: np.ndarray) -> None:
    """``got`` (bfloat16 bits) is ``source`` rounded to nearest even, bit for bit
    (NaN: still NaN, sign kept)."""
    got_bits = got.view(np.uint16)
    nan = np.isnan(source)
    np.testing.assert_array_equal(got_bits[~nan], rne_bfloat16_bits(source[~nan]))
    assert np.isnan(got_bits[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert ((got_bits[nan] >> 15) == (source[nan].view(np.uint32) >> 31)).all()


def hard_values(n: int) -> np.ndarray:
    """Random float32 bit patterns (every class: normals, subnormals, NaNs,
    infinities) plus exact ties, the largest finite values and signed zeros."""
    rng = np.random.default_rng(7)
    random = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, size=64, dtype=np.uint32) << 16) | 0x8000
    special = np.array(
        [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
         0xFF800000, 0x7FC00000, 0xFF800001, 0x3F808000, 0x3F818000, 0x7F7F8000],
        dtype=np.uint32,
    )  # fmt: skip
    return np.concatenate([random, ties, special]).view(np.float32)


def acts_batch(values_per_record: list[np.ndarray], layout: str = "acts", output_id: int = 0):
    payload = np.concatenate(values_per_record).astype(np.float32)
    lengths = [4 * len(v) for v in values_per_record]
    desc = make_descriptors(
        output_id,
        lengths,
        layout_ids=SCHEMA.layout_id(layout),
        keys=np.arange(len(lengths)) + 100,
        steps=3,
    )
    return RecordBatch.from_buffer(desc, payload)


# -- the values -------------------------------------------------------------------


def test_narrowed_values_equal_an_independent_round_to_nearest_even_bitwise():
    values = hard_values(20_000)
    split = [values[:5000], values[5000:5001], values[5001:]]
    batch = acts_batch(split)
    narrowed = narrow_batch(batch.descriptors, batch.payload, SCHEMA.layout_id("acts16"))
    assert narrowed.descriptors["layout_id"].tolist() == [SCHEMA.layout_id("acts16")] * 3
    assert narrowed.descriptors["length"].tolist() == [2 * len(v) for v in split]
    assert narrowed.descriptors["offset"].tolist() == [0, 10000, 10002]
    for field in ("output_id", "key", "step", "seq", "timestamp_ns"):
        assert narrowed.descriptors[field].tolist() == batch.descriptors[field].tolist()
    assert len(narrowed.payload) == 2 * len(values)
    assert_narrowed(narrowed.payload.view(np.uint16), values)
    for row, source in enumerate(split):  # record by record, too
        assert_narrowed(narrowed.payload_of(row).view(np.uint16), source)


def test_records_not_back_to_back_are_gathered_in_record_order():
    values = hard_values(3000)
    batch = acts_batch([values[:1000], values[1000:1500], values[1500:]])
    part = batch.select(np.array([2, 0]))  # out of order, with a hole
    narrowed = narrow_batch(part.descriptors, part.payload, SCHEMA.layout_id("acts16"))
    assert narrowed.descriptors["key"].tolist() == [102, 100]
    assert_narrowed(narrowed.payload_of(0).view(np.uint16), values[1500:])
    assert_narrowed(narrowed.payload_of(1).view(np.uint16), values[:1000])


def test_a_fixed_layout_of_float32_columns_narrows_column_for_column():
    rows = np.zeros(3, dtype=PAIR.dtype)
    rows["scale"] = [1.0 / 3, -2.5, 1e-40]
    rows["values"] = np.arange(18, dtype=np.float32).reshape(3, 2, 3) / 7
    desc = make_descriptors(0, PAIR.dtype.itemsize, count=3, layout_ids=SCHEMA.layout_id("pair"))
    batch = RecordBatch.from_buffer(desc, rows)
    narrowed = narrow_batch(batch.descriptors, batch.payload, SCHEMA.layout_id("pair16"))
    got = narrowed.payload.view(PAIR16.dtype)
    assert_narrowed(got["scale"].view(np.uint16), rows["scale"])
    assert_narrowed(got["values"].reshape(-1).view(np.uint16), rows["values"].reshape(-1))


# -- on a route -------------------------------------------------------------------


async def test_a_narrowing_route_hands_on_bfloat16_and_a_plain_forward_route_still_shares():
    hooks = HookRegistry()
    acts_id = hooks.bind("h.acts", layout="acts")
    ints_id = hooks.bind("h.ints", layout="ints")
    narrow_cap, plain_cap = CaptureSink(), CaptureSink()
    config = RoutingConfig(
        [
            Route("narrow", "h.*", "narrow", narrow={"acts": "acts16"}),
            Route("plain", "h.*", "plain"),
        ]
    )
    values = hard_values(64)[-64:]  # ties and specials among them
    released: list[str] = []
    payload = np.concatenate([values, np.arange(8, dtype=np.int32).view(np.float32)])
    desc = make_descriptors(
        [acts_id, acts_id, ints_id],
        [128, 128, 32],
        layout_ids=[SCHEMA.layout_id("acts"), SCHEMA.layout_id("acts"), SCHEMA.layout_id("ints")],
        keys=[1, 2, 3],
    )
    # Two layouts' values in one buffer: handed in as its bytes.
    raw = payload.view(np.uint8)
    batch = RecordBatch.from_buffer(desc, raw, lambda: released.append("buffer"))
    async with open_routing_sink(
        config, SCHEMA, {"narrow": narrow_cap, "plain": plain_cap}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(batch)
        await sink.flush()
        counters = sink.counters()
    # The plain forward route: the very batch, the producer's memory, no copy.
    assert plain_cap.batches == [batch]
    assert np.shares_memory(plain_cap.batches[0].payload, payload)
    # The narrowing route: the Int32 record goes on as it is (sharing the
    # buffer), the Float32 ones as a new BFloat16 batch.
    kept, narrowed = narrow_cap.record_batches
    assert kept.descriptors["key"].tolist() == [3]
    assert np.shares_memory(kept.payload, payload)
    assert narrowed.descriptors["key"].tolist() == [1, 2]
    assert (narrowed.descriptors["layout_id"] == SCHEMA.layout_id("acts16")).all()
    assert not np.shares_memory(narrowed.payload, payload)
    assert_narrowed(narrowed.payload.view(np.uint16), values)
    assert counters.routes["narrow"].emitted == 3 and counters.routes["plain"].emitted == 3
    assert counters.destinations["narrow"].bytes == 32 + 128
    batch.lease.release()  # the submitter's hold
    narrow_cap.clear()
    assert released == []  # the plain route's destination still holds it
    plain_cap.clear()
    assert released == ["buffer"]  # once, after the last holder


@pytest.mark.parametrize(
    ("route", "message"),
    [
        (Route("r", "h", "d", narrow={"nope": "acts16"}), r"route 'r', narrow: .*'nope'"),
        (
            Route("r", "h", "d", narrow={"ints": "acts16"}),
            "column 'values' of 'ints' is Array\\(Int32\\); narrowing takes layouts whose "
            "every column is Float32",
        ),
        (
            Route("r", "h", "d", narrow={"acts": "acts"}),
            "layout 'acts' column 'values' Array\\(Float32\\) \\(shape \\[\\]\\): expected "
            "'values' Array\\(BFloat16\\)",
        ),
        (
            Route("r", "h", "d", narrow={"pair": "acts16"}),
            "layout 'acts16' has 1 columns, 'pair' has 2",
        ),
    ],
    ids=["unknown layout", "not float32", "not bfloat16", "other columns"],
)
async def test_a_narrowing_that_cannot_work_is_refused_when_the_sink_is_built(route, message):
    with pytest.raises(ConfigError, match=message):
        async with open_routing_sink(
            RoutingConfig([route]), SCHEMA, {"d": CaptureSink()}, unmatched="drop"
        ):
            pass


def test_narrow_on_a_non_forward_route_is_refused_at_construction():
    with pytest.raises(ConfigError, match="narrow applies to the raw records a forward route"):
        Route("r", "h", "d", mode="stateless", processor="x", narrow={"acts": "acts16"})
    with pytest.raises(ConfigError, match="narrow maps layout names to layout names"):
        Route("r", "h", "d", narrow={"acts": 3})


# -- from a config file, into ClickHouse -------------------------------------------

CONFIG = """
[[layouts]]
name = "acts"
columns = [{ name = "values", type = "Array(Float32)" }]

[[layouts]]
name = "acts16"
columns = [{ name = "values", type = "Array(BFloat16)" }]

[[routes]]
name = "raw"
outputs = ["gpt2.*"]
destination = "ch"
narrow = { acts = "acts16" }

[destinations.ch]
path = "x"
raw = ["acts16"]
"""


def test_a_config_file_route_takes_narrow_as_a_table(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(CONFIG)
    (route,) = load_config(path).routes
    assert dict(route.narrow) == {"acts": "acts16"}
    path.write_text(CONFIG.replace('narrow = { acts = "acts16" }', 'narrow = "acts16"'))
    with pytest.raises(ConfigFileError, match=r"routes\[0\]\.narrow: expected a mapping"):
        load_config(path)


def test_gpt2_captures_reach_clickhouse_as_bfloat16_rounded_to_nearest_even(chdb_transport):
    model = gpt2()
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 5))
    schema = RecordSchema([ACTS, ACTS16])
    sink = ClickHouseSink(
        chdb_transport,
        schema,
        raw=["acts16"],
        create_tables=True,
        raw_table="narrowed_{layout}",
        owns_transport=False,
    )
    routing = RoutingSink(
        RoutingConfig([Route("raw", "gpt2.*", "ch", narrow={"acts": "acts16"})]),
        schema,
        {"ch": lambda: sink},  # owned: the routing sink runs it
        unmatched="drop",
    )
    seen: list[np.ndarray] = []
    model.transformer.h[0].mlp.register_forward_hook(
        lambda _m, _i, out: seen.append(out.detach().numpy().copy())
    )
    with create_record_runtime(record_sink=routing) as runtime:
        bind_modules(runtime, model, "transformer.h.0.mlp", layout="acts", prefix="gpt2.")
        with torch.inference_mode(), capture_context([7, 8]):
            model(ids)
        runtime.flush()
        rows = sink.query(
            "SELECT key, CAST(values, 'Array(Float32)') AS values, values_shape, "
            "byteSize(narrowed_acts16.values) AS bytes FROM narrowed_acts16 ORDER BY key"
        ).to_pylist()
    (output,) = seen
    assert [row["key"] for row in rows] == [7, 8]
    for row, got in zip(output, rows, strict=True):
        assert got["values_shape"] == [5, 32]
        assert got["bytes"] == 8 + 2 * row.size  # two bytes a value
        widened = np.asarray(got["values"], dtype=np.float32)
        assert_narrowed(rne_from_widened(widened), row.reshape(-1))


def rne_from_widened(widened: np.ndarray) -> np.ndarray:
    """bfloat16 bits of values ClickHouse widened back to Float32 (exact)."""
    return (widened.view(np.uint32) >> 16).astype(np.uint16)
