"""Route chaining under the causal limits (issue #15): a route's output routed
again, roots and depths, depth 32 and 128 per root per minute (MockClock,
minute rollover), limits pinned per root, redacted dead letters, exact
accounting."""

from __future__ import annotations

import uuid
from pathlib import Path

import attrs
import numpy as np
import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

import tests.chain_processors  # noqa: F401 - registers chain.double, chain.spray
from taproute.actors import open_routing_sink
from taproute.routing import FailurePolicy, HookRegistry, RecordBatch, Route, RoutingConfig
from taproute.routing.causal import CausalLimits, root_hex, root_ids
from taproute.routing.errors import RerouteRefused
from taproute.service import CaptureSink, DeadLetterStore
from taproute.service.host.config import ConfigFileError, load_config
from taproute.service.host.counters import ServiceSnapshot
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.ops.controls import DeadLetterControls
from tests.chain_processors import SPRAY_ROWS
from tests.conftest import vec_batch
from tests.processors import LAYOUTS_TOML, NORM, SCHEMA

Q = "layers.0.q"
NO_DEADLINE = FailurePolicy(deadline=0)  # a frozen MockClock never reaches a deadline anyway


def hooks_with_q() -> tuple[HookRegistry, int]:
    hooks = HookRegistry()
    return hooks, hooks.bind(Q, layout="vec")


def stateless(name: str, outputs, processor: str, **kw) -> Route:
    return Route(
        name,
        outputs,
        "rows",
        mode="stateless",
        processor=processor,
        failure_policy=NO_DEADLINE,
        **kw,
    )


async def test_a_routes_rows_are_routed_again_as_derived_records_without_a_copy():
    hooks, q = hooks_with_q()
    rows, raw = CaptureSink(), CaptureSink()
    config = RoutingConfig(
        [
            stateless("norms", Q, "test.norms", then=("double",)),
            stateless("double", "route:norms", "chain.double"),
            Route("raw_norms", "route:norm*", "raw"),
        ]
    )
    batch = vec_batch(q, 4, keys=[5, 6, 7, 8])
    async with open_routing_sink(
        config, SCHEMA, {"rows": rows, "raw": raw}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(batch)
        await sink.flush()
        snap = sink.snapshot()
    norms = rows.rows("norms")
    assert rows.rows("double")["norm"].tolist() == (norms["norm"] * 2).tolist()
    assert rows.rows("double")["key"].tolist() == [5, 6, 7, 8]
    (derived,) = raw.record_batches
    assert hooks.name_of(int(derived.descriptors["output_id"][0])) == "route:norms"
    assert derived.descriptors["layout_id"].tolist() == [SCHEMA.layout_id("norm")] * 4
    assert derived.descriptors["key"].tolist() == [5, 6, 7, 8]
    # The rows are the payload: the destination got the processor's array, not a copy.
    assert np.shares_memory(derived.payload, rows.row_batches("norms")[0].rows)
    assert derived.payload.view(NORM.dtype).tolist() == norms.tolist()
    # Row i comes from record i: its root is that captured record, at depth 1.
    assert derived.lineage is not None
    assert derived.lineage.roots.tolist() == root_ids(batch.descriptors).tolist()
    assert derived.lineage.depths.tolist() == [1, 1, 1, 1]
    assert snap.routes["norms"].derived == 4 and snap.causal.derived == 4
    assert snap.routes["double"].processed == 4 and snap.routes["raw_norms"].processed == 4
    assert snap.causal.refused_depth == snap.causal.refused_rate == 0
    rows.clear()
    raw.clear()


async def test_a_cycle_stops_at_depth_32_refused_counted_and_dead_lettered(tmp_path):
    hooks, q = hooks_with_q()
    rows = CaptureSink()
    store = DeadLetterStore(tmp_path / "dead.sqlite", hooks=hooks)
    config = RoutingConfig(
        [
            stateless("norms", Q, "test.norms", then=("again",)),
            stateless("again", "route:again", "chain.double"),  # its own output: a cycle
        ],
        allow_cycles=True,
    )
    batch = vec_batch(q, 1, keys=[3])
    async with open_routing_sink(
        config, SCHEMA, {"rows": rows}, unmatched="drop", hooks=hooks, on_failure=store.handle
    ) as sink:
        await sink.submit(batch)
        await sink.flush()
        snap = sink.snapshot()
    root = int(root_ids(batch.descriptors)[0])
    # Depths 1 (from norms) .. 32 are processed; again's output at depth 33 is refused.
    again = snap.routes["again"]
    assert again.processed == 32 and again.derived == 31 and snap.routes["norms"].derived == 1
    assert snap.causal.derived == 32 and snap.causal.refused_depth == 1
    assert snap.causal.refused_rate == 0
    norm0 = float(rows.rows("norms")["norm"][0])
    assert rows.rows("again")["norm"].tolist() == [norm0 * 2**k for k in range(1, 33)]
    (refusal,) = snap.causal.recent_refusals
    assert (refusal.route, refusal.targets, refusal.depth) == ("again", ("again",), 33)
    assert (refusal.limit, refusal.bound, refusal.records) == ("depth", 32, 1)
    assert refusal.root == root_hex(root)
    (letter,) = store.list()
    assert letter.code == "causal_limit" and letter.route == "again"
    assert "depth 33 exceeds max_depth 32" in letter.error and root_hex(root) in letter.error
    assert store.get(letter.id).payload == b""  # redacted by default
    with pytest.raises(RerouteRefused, match="kept no payload"):
        DeadLetterControls(store, intake=None).reroute(letter.id)  # type: ignore[arg-type]
    store.close()
    rows.clear()


async def test_128_derived_records_per_root_per_utc_minute_under_mock_clock(mock_clock):
    hooks, q = hooks_with_q()
    fanout = CaptureSink()
    refused: list = []
    config = RoutingConfig(
        [
            stateless("spray", Q, "chain.spray"),
            Route("fanout", "route:spray", "fanout"),
        ]
    )
    first = vec_batch(q, 1, keys=[1])
    other = vec_batch(q, 1, keys=[2])
    mock_clock.jump(30)  # inside minute 0: UTC 00:00:30
    async with open_routing_sink(
        config,
        SCHEMA,
        {"rows": CaptureSink(), "fanout": fanout},
        unmatched="drop",
        hooks=hooks,
        on_failure=refused.append,
        causal_clock=trio.current_time,
    ) as sink:

        async def send(batch: RecordBatch) -> int:
            before = fanout.records
            await sink.submit(RecordBatch.from_buffer(batch.descriptors, batch.payload))
            await sink.flush()
            return fanout.records - before

        assert await send(first) == 128  # 200 rows of one root: 128 taken, 72 refused
        assert sink.snapshot().causal.refused_rate == SPRAY_ROWS - 128
        assert await send(first) == 0  # the same root, the same minute: no token left
        assert await send(other) == 128  # another root has its own 128
        mock_clock.jump(29.75)  # 00:00:59.75, still minute 0
        assert await send(first) == 0
        mock_clock.jump(0.25)  # 00:01:00: the next minute restores the rate capacity
        assert await send(first) == 128
        snap = sink.snapshot()
    assert snap.causal.derived == 3 * 128
    assert snap.causal.refused_rate == 5 * SPRAY_ROWS - 3 * 128
    assert snap.causal.refused_depth == 0
    assert sum(len(f.records) for f in refused) == snap.causal.refused_rate
    assert {f.code.value for f in refused} == {"causal_limit"}
    assert all(len(f.records.payload) == 0 for f in refused)  # redacted
    last = snap.causal.recent_refusals[-1]
    assert (last.limit, last.bound, last.route, last.targets) == ("rate", 128, "spray", ("fanout",))
    # Exact accounting: every derived record is accepted or refused, once.
    assert snap.routes["spray"].emitted == 5 * SPRAY_ROWS
    assert snap.causal.derived + snap.causal.refused_rate == 5 * SPRAY_ROWS
    assert snap.routes["fanout"].processed == fanout.records == snap.causal.derived
    fanout.clear()


async def test_limits_stay_pinned_per_root_when_the_next_configuration_changes_them(mock_clock):
    hooks, q = hooks_with_q()
    fanout = CaptureSink()

    def config(per_minute: int) -> RoutingConfig:
        return RoutingConfig(
            [stateless("spray", Q, "chain.spray"), Route("fanout", "route:spray", "fanout")],
            causal_limits=CausalLimits(per_root_per_minute=per_minute),
        )

    pinned = vec_batch(q, 1, keys=[1])
    fresh = vec_batch(q, 1, keys=[2])
    destinations = {"rows": CaptureSink(), "fanout": fanout}
    common = {"unmatched": "drop", "hooks": hooks, "causal_clock": trio.current_time}
    async with open_routing_sink(config(10), SCHEMA, destinations, **common) as old:
        await old.submit(RecordBatch.from_buffer(pinned.descriptors, pinned.payload))
        await old.flush()
        ledger = old.causal_ledger
    root = int(root_ids(pinned.descriptors)[0])
    assert ledger.pinned(root) == CausalLimits(per_root_per_minute=10)
    assert fanout.records == 10
    mock_clock.jump(60)
    async with open_routing_sink(
        config(50), SCHEMA, destinations, causal_ledger=ledger, **common
    ) as new:
        await new.submit(RecordBatch.from_buffer(pinned.descriptors, pinned.payload))
        await new.flush()
        assert fanout.records == 10 + 10  # the root in flight keeps its 10 per minute
        await new.submit(RecordBatch.from_buffer(fresh.descriptors, fresh.payload))
        await new.flush()
        assert fanout.records == 10 + 10 + 50  # a new root gets the new limits
        assert new.snapshot().causal.pinned_roots == 2
    fanout.clear()


async def test_a_full_causal_ledger_evicts_roots_counts_them_and_exports_the_count(mock_clock):
    """``max_roots`` bounds the ledger: 100 roots deriving at once leave at most
    16 pinned; the rest are evicted (never refused for want of room), counted
    in the snapshot and on ``/metrics``."""
    hooks, q = hooks_with_q()
    copies = CaptureSink()
    config = RoutingConfig(
        [stateless("norms", Q, "test.norms"), Route("copies", "route:norms", "copies")],
        causal_limits=CausalLimits(max_roots=16),
    )
    async with open_routing_sink(
        config,
        SCHEMA,
        {"rows": CaptureSink(), "copies": copies},
        unmatched="drop",
        hooks=hooks,
        causal_clock=trio.current_time,
    ) as sink:
        batch = vec_batch(q, 100, keys=list(range(100)))  # one norm row, one root, per record
        await sink.submit(RecordBatch.from_buffer(batch.descriptors, batch.payload))
        await sink.flush()
        snap = sink.snapshot()
        assert len(sink.causal_ledger) == snap.causal.pinned_roots
    assert copies.records == snap.causal.derived == 100
    assert 0 < snap.causal.pinned_roots <= 16
    assert snap.causal.evicted_roots == 100 - snap.causal.pinned_roots
    registry = CollectorRegistry()
    service = ServiceSnapshot(**attrs.asdict(snap, recurse=False))
    registry.register(SnapshotCollector(lambda: service))
    scraped = generate_latest(registry).decode()
    assert f"taproute_causal_roots_evicted_total {float(snap.causal.evicted_roots)}" in scraped
    copies.clear()


CONFIG = (
    """
processors = ["tests.processors", "tests.chain_processors"]

"""
    + LAYOUTS_TOML
    + """
[[routes]]
name = "norms"
outputs = ["layers.*"]
mode = "stateless"
processor = "test.norms"
destination = "ch"
then = ["doubled"]

[[routes]]
name = "doubled"
outputs = [@DOUBLED@]
mode = "stateless"
processor = "chain.double"
destination = "ch"

[destinations.ch]
path = "@PATH@"
rows = ["norm"]
rows_table = "@PREFIX@_{layout}"

[routing]
unmatched = "drop"
@ROUTING@
"""
)


def chain_config(tmp_path, chdb_transport, doubled: str, routing: str = "") -> Path:
    prefix = "ch" + uuid.uuid4().hex[:8]
    text = (
        CONFIG.replace("@PATH@", str(chdb_transport.path))
        .replace("@PREFIX@", prefix)
        .replace("@DOUBLED@", doubled)
        .replace("@ROUTING@", routing)
    )
    path = tmp_path / "chain.toml"
    path.write_text(text)
    return path


def test_a_chain_from_a_config_file_runs_and_its_limits_come_from_the_file(
    tmp_path, chdb_transport
):
    path = chain_config(
        tmp_path, chdb_transport, '"route:norms"', "[routing.causal_limits]\nmax_depth = 4"
    )
    config = load_config(path)
    assert config.routing_config().causal_limits == CausalLimits(max_depth=4)
    with config.build() as built, built.start() as runtime:
        q = runtime.bind_hook("layers.0", layout="vec")
        batch = vec_batch(q, 5)
        runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush()
        snap = runtime.counters()
        table = f"{built.config.destinations['ch'].rows_table.format(layout='norm')}"
    rows = chdb_transport.query(f"SELECT key, norm FROM `{table}` ORDER BY norm").to_pylist()
    norms = sorted(float(np.linalg.norm(v)) for v in batch.payload.view("<f4").reshape(5, 4))
    assert len(rows) == 10  # 5 norms, then the same 5 doubled, in one table
    assert sorted(r["norm"] for r in rows) == pytest.approx(sorted(norms + [2 * n for n in norms]))
    assert snap.causal.derived == 5 and snap.routes["doubled"].processed == 5
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snap))
    scraped = generate_latest(registry).decode()
    assert 'taproute_causal_records_total{verdict="accepted"} 5.0' in scraped
    assert 'taproute_causal_records_total{verdict="refused_depth"} 0.0' in scraped
    assert (
        'taproute_route_derived_records_total{destination="ch",mode="stateless",route="norms"} 5.0'
        in scraped
    )


def test_a_cycle_in_a_config_file_is_refused_unless_allowed(tmp_path, chdb_transport):
    path = chain_config(tmp_path, chdb_transport, '"route:norms", "route:doubled"')
    with pytest.raises(ConfigFileError) as refused:
        load_config(path).build()
    assert str(refused.value) == (
        f"{path}: routes: routes doubled -> doubled form a cycle (their output comes back to "
        "them); refused unless allow_cycles=True, which bounds it by the causal limits"
    )
    allowed = chain_config(
        tmp_path, chdb_transport, '"route:norms", "route:doubled"', "allow_cycles = true"
    )
    with load_config(allowed).build() as built:
        assert built.sink.plan.chains.cycles == (("doubled",),)
    bounded = chain_config(
        tmp_path, chdb_transport, '"route:norms"', "[routing.causal_limits]\nmax_roots = 4096"
    )
    assert load_config(bounded).routing_config().causal_limits.max_roots == 4096
    too_small = chain_config(
        tmp_path, chdb_transport, '"route:norms"', "[routing.causal_limits]\nmax_roots = 8"
    )
    with pytest.raises(ConfigFileError, match=r"routing.causal_limits.max_roots: must be in"):
        load_config(too_small)
    bad = chain_config(
        tmp_path, chdb_transport, '"route:norms"', "[routing.causal_limits]\nmax_depth = 0"
    )
    with pytest.raises(
        ConfigFileError, match=r"routing.causal_limits.max_depth: must be in \[1, 1024\], found 0"
    ):
        load_config(bad)


async def test_exact_accounting_with_chains_failures_and_refusals(tmp_path):
    """in = delivered + dead-lettered, at every hop: what a chain derives is
    accepted or refused once; what a chained route accepts it processes or
    gives up once."""
    hooks, q = hooks_with_q()
    rows, raw = CaptureSink(), CaptureSink()
    store = DeadLetterStore(tmp_path / "dead.sqlite", hooks=hooks)
    config = RoutingConfig(
        [
            stateless("spray", Q, "chain.spray", then=("picky", "raw")),
            stateless("picky", "route:spray", "chain.picky_odd"),
            Route("raw", "route:spray", "raw"),
        ]
    )
    async with open_routing_sink(
        config,
        SCHEMA,
        {"rows": rows, "raw": raw},
        unmatched="drop",
        hooks=hooks,
        on_failure=store.handle,
    ) as sink:
        for key in (1, 2):  # two calls: two roots, 128 + 128 accepted of 2 x 200
            await sink.submit(vec_batch(q, 1, keys=[key]))
        await sink.flush()
        snap = sink.snapshot()
    spray, picky, fwd = (snap.routes[n] for n in ("spray", "picky", "raw"))
    emitted = 2 * SPRAY_ROWS
    assert spray.emitted == emitted and spray.derived == snap.causal.derived == 256
    assert snap.causal.refused_rate == emitted - 256
    # Each accepted derived record reached both chained routes, once.
    assert picky.processed + picky.failed == 256 and fwd.processed == raw.records == 256
    assert picky.failed == 128  # odd seq rows: handler_invalid, dead-lettered one by one
    assert len(rows.rows("picky")) == 128
    letters = store.list()
    by_code: dict[str, int] = {}
    for letter in letters:
        by_code[letter.code] = by_code.get(letter.code, 0) + 1
    assert by_code == {"handler_invalid": 128, "causal_limit": emitted - 256}
    store.close()
    rows.clear()
    raw.clear()


async def test_a_stateful_route_keys_derived_records_by_request_and_its_finals_chain_on():
    hooks, q = hooks_with_q()
    rows, finals = CaptureSink(), CaptureSink()
    config = RoutingConfig(
        [
            stateless("norms", Q, "test.norms", then=("totals",)),
            Route(
                "totals",
                "route:norms",
                "rows",
                mode="stateful",
                processor="chain.norm_total",
                then=("finals",),
            ),
            Route("finals", "route:totals", "finals"),
        ]
    )
    async with open_routing_sink(
        config, SCHEMA, {"rows": rows, "finals": finals}, unmatched="drop", hooks=hooks
    ) as sink:
        await sink.submit(vec_batch(q, 3, keys=[1, 1, 2]))
        await sink.complete(1, 2)
        await sink.flush()
        snap = sink.snapshot()
        traced = sink.trace("route:totals")
    norms = rows.rows("norms")
    batches = finals.record_batches  # one per completed key
    got = np.concatenate([b.payload.view(NORM.dtype) for b in batches])
    assert got["key"].tolist() == [1, 2]
    assert got["norm"].tolist() == pytest.approx(
        [float(norms["norm"][0] + norms["norm"][1]), float(norms["norm"][2])]
    )
    # A completion's final rows are a new root (the completion), depth 1.
    assert all(b.lineage is not None for b in batches)
    assert [d for b in batches for d in b.lineage.depths.tolist()] == [1, 1]
    assert len({r for b in batches for r in b.lineage.roots.tolist()}) == 2
    assert snap.routes["totals"].processed == 3 and snap.routes["totals"].derived == 2
    assert snap.causal.derived == 3 + 2
    assert [(v.route, v.verdict) for v in traced.verdicts] == [
        ("norms", "not_reached"),
        ("totals", "not_reached"),
        ("finals", "match"),
    ]
    rows.clear()
    finals.clear()
