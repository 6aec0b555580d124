"""Replay: the registered processors over a corpus captured by the live path
give what live routing gave; every bad input is refused with a clear error."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

import tests.replay_processors as rp
from taproute.actors import RoutingSink
from taproute.native import make_descriptors
from taproute.routing import Route, RoutingConfig, UnknownProcessor
from taproute.service import SchemaMismatch, create_record_runtime
from taproute.service.replay import (
    ClickHouseCorpus,
    ClickHouseTable,
    ConfigChanged,
    Filters,
    LayoutMismatch,
    MergeRequired,
    MissingSource,
    NotExactlyOnce,
    ParquetDir,
    ReplayConfigError,
    UnitsFailed,
    UnknownRun,
    run_replay,
)
from taproute.service.replay.corpus import timestamp_within_ties
from taproute.service.sinks.clickhouse.tables import raw_table_spec
from tests.clickhouse_backends import SERVER_URL
from tests.processors import SCHEMA

HOOKS = ("layers.0.attn.q", "layers.1.attn.q")

try:
    import ray  # noqa: F401 - the optional taproute[ray] extra (in the dev extra, so CI has it)

    HAVE_RAY = True
except ImportError:  # pragma: no cover - a bare install without the extra
    HAVE_RAY = False


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray with 2 CPUs for the module (it takes seconds to start)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


KEYS = 48
STEPS = 3


def capture(clickhouse, *, keys: int = KEYS) -> None:
    """The live path: a runtime routes `vec` records raw, through test.norms and
    through replay.running_sum, into ClickHouse tables {p}_raw_vec, {p}_norm, {p}_sum."""
    config = RoutingConfig(
        [
            Route("raw", "layers.*", "ch"),
            Route("norms", "layers.*", "ch", mode="stateless", processor="test.norms", workers=2),
            Route(
                "sums", "layers.*", "ch", mode="stateful", processor="replay.running_sum", workers=2
            ),
        ]
    )
    sink = RoutingSink(
        config,
        SCHEMA,
        {"ch": lambda: clickhouse.sink(SCHEMA, raw=["vec"], rows=["norm", "sum"])},
        unmatched="drop",
    )
    rng = np.random.default_rng(7)
    with create_record_runtime(record_sink=sink) as runtime:
        ids = [runtime.bind_hook(h, layout="vec") for h in HOOKS]
        seq = 0
        for step in range(STEPS):
            for hook_id in ids:
                n = keys
                values = rng.integers(-50, 50, size=(n, 4)).astype(np.float32)
                desc = make_descriptors(
                    hook_id,
                    16,
                    count=n,
                    layout_ids=SCHEMA.layout_id("vec"),
                    keys=np.arange(n),
                    steps=step,
                    seqs=np.arange(seq, seq + n),
                )
                seq += n
                runtime.submit_batch(desc, values)
        runtime.flush(timeout=60)


@pytest.fixture
def corpus(clickhouse, tmp_path):
    capture(clickhouse)
    return clickhouse


def source(ch, **kwargs) -> ClickHouseCorpus:
    return ClickHouseCorpus(ch.transport, "vec", table=f"{ch.prefix}_raw_vec", **kwargs)


def settings(ch, tmp_path, **kwargs):
    base = dict(
        source=source(ch),
        schema=SCHEMA,
        modules=("tests.replay_processors",),
        runs_dir=tmp_path / "runs",
        unit_rows=40,
        progress=False,
    )
    base.update(kwargs)
    return base


def rows(ch, table: str, order: str) -> list[dict]:
    return ch.query(f"SELECT * FROM {table} ORDER BY {order}").to_pylist()


def test_stateless_replay_equals_live_exactly(corpus, tmp_path):
    ch = corpus
    report = run_replay(
        **settings(ch, tmp_path, processor="test.norms"),
        outputs={"norm": ClickHouseTable(f"{ch.prefix}_replay_norm")},
    )
    assert report.units_run == len(report.plan) > 4  # several units per hook
    assert report.rows_written == {"norm": KEYS * STEPS * len(HOOKS)}
    live = rows(ch, f"{ch.prefix}_norm", "seq")
    replayed = rows(ch, f"{ch.prefix}_replay_norm", "seq")
    assert len(live) == KEYS * STEPS * len(HOOKS)
    assert replayed == live  # same input bytes, same function: bit for bit


def test_stateful_replay_final_state_equals_live_last_rows(corpus, tmp_path):
    ch = corpus
    report = run_replay(
        **settings(ch, tmp_path, processor="replay.running_sum"),
        outputs={"sum": ClickHouseTable(f"{ch.prefix}_replay_sum")},
    )
    # Live writes a running row per record; its final state per key is the
    # row with the largest count.  Replay (stateful_output auto -> final,
    # since the processor registered finish) writes the final state once.
    live = rows(
        ch,
        f"(SELECT key AS key, argMax(total, count) AS total, max(count) AS n "
        f"FROM {ch.prefix}_sum GROUP BY key)",
        "key",
    )
    replayed = rows(ch, f"{ch.prefix}_replay_sum", "key")
    assert report.rows_written == {"sum": 16}
    assert [r["key"] for r in replayed] == [r["key"] for r in live] == list(range(16))
    assert [r["count"] for r in replayed] == [r["n"] for r in live]  # integers: exact
    # Sums of integer-valued float32 inputs are exact in float64 in any order.
    assert [r["total"] for r in replayed] == [r["total"] for r in live]


def test_units_mode_writes_running_rows_like_live(corpus, tmp_path):
    ch = corpus
    run_replay(
        **settings(ch, tmp_path, processor="replay.running_sum", stateful_output="units"),
        outputs={"sum": ClickHouseTable(f"{ch.prefix}_replay_sum")},
    )
    replayed = ch.query(f"SELECT count() AS n, max(count) AS c FROM {ch.prefix}_replay_sum")
    assert replayed.to_pylist() == [{"n": KEYS * STEPS * len(HOOKS), "c": KEYS // 16 * STEPS * 2}]


def test_filters_select_hooks_keys_and_steps(corpus, tmp_path):
    ch = corpus
    filters = Filters(hooks=["layers.1.*"], keys=(10, 20), steps=(1, 3))
    report = run_replay(
        **settings(ch, tmp_path, processor="test.norms", source=source(ch, filters=filters)),
        outputs={"norm": ClickHouseTable(f"{ch.prefix}_replay_norm")},
    )
    got = ch.query(
        f"SELECT min(key) AS lo, max(key) AS hi, count() AS n FROM {ch.prefix}_replay_norm"
    ).to_pylist()
    assert got == [{"lo": 10, "hi": 19, "n": 10 * 2}]
    assert report.records == 20
    assert all(u.hook == "layers.1.attn.q" for u in report.plan)


def test_time_range_filter(corpus, tmp_path):
    ch = corpus
    (start,) = (
        ch.query(
            f"SELECT toUnixTimestamp64Nano(min(timestamp)) AS t FROM {ch.prefix}_raw_vec "
            "WHERE step = 1"
        )
        .column("t")
        .to_pylist()
    )
    expected = (
        ch.query(
            f"SELECT count() AS n FROM {ch.prefix}_raw_vec "
            f"WHERE toUnixTimestamp64Nano(timestamp) >= {start}"
        )
        .column("n")
        .to_pylist()[0]
    )
    report = run_replay(
        **settings(
            ch,
            tmp_path,
            processor="test.norms",
            source=source(ch, filters=Filters(time_ns=(start, 2**62))),
        ),
        outputs={"norm": ClickHouseTable(f"{ch.prefix}_t")},
    )
    assert 0 < report.records == expected < 288


def test_bad_backend_settings_are_refused_before_a_run_exists(corpus, tmp_path):
    for kwargs, message in (
        ({"backend": "inprocess", "workers": 2}, "'inprocess' has one worker, got workers=2"),
        ({"backend": "dask"}, "unknown backend 'dask'"),
        ({"schedule": "random"}, "unknown schedule 'random'"),
    ):
        with pytest.raises(ReplayConfigError, match=message):
            run_replay(**settings(corpus, tmp_path, processor="test.norms", **kwargs))
    assert not (tmp_path / "runs").exists()


def test_dry_run_creates_no_parquet_directory(corpus, tmp_path):
    report = run_replay(
        **settings(corpus, tmp_path, processor="test.norms"),
        outputs={"norm": ParquetDir(str(tmp_path / "out"))},
        dry_run=True,
    )
    assert report.dry_run and not (tmp_path / "out").exists()


def test_plan_is_deterministic_with_stable_unit_ids(corpus, tmp_path):
    ch = corpus
    a = run_replay(**settings(ch, tmp_path, processor="test.norms"), dry_run=True)
    b = run_replay(**settings(ch, tmp_path, processor="test.norms"), dry_run=True)
    assert [u.id for u in a.plan] == [u.id for u in b.plan]
    assert len({u.id for u in a.plan}) == len(a.plan)
    assert sum(u.rows for u in a.plan) == KEYS * STEPS * len(HOOKS)


def test_a_unit_read_is_the_units_stored_rows_hook_column_included(corpus):
    ch = corpus
    corpus_ = source(ch)
    corpus_.check(SCHEMA)
    plan = corpus_.plan(40)
    assert {u.hook for u in plan} == set(HOOKS)
    names = ", ".join(f"`{c}`" for c in corpus_.columns())
    total = 0
    for unit in plan:
        got = corpus_.read(unit)
        want = ch.transport.query(
            f"SELECT {names} FROM {ch.prefix}_raw_vec WHERE hook = '{unit.hook}' "
            f"AND key >= {unit.key_first} AND key <= {unit.key_last} "
            "ORDER BY key, step, seq, timestamp"
        )
        assert got.schema.names == corpus_.columns() == want.schema.names
        assert got.column("hook").type == want.column("hook").type
        assert got.to_pylist() == want.to_pylist()
        assert got.num_rows == unit.rows
        total += got.num_rows
    assert total == KEYS * STEPS * len(HOOKS)


def test_a_unit_read_orders_rows_equal_in_key_step_seq_by_timestamp(clickhouse):
    """The server sorts by (key, step, seq) only; rows equal in all three
    (written out of time order, in one insert and across inserts) still come
    back oldest first, as ORDER BY key, step, seq, timestamp gives them."""
    ch = clickhouse
    table = ch.raw("vec")
    ch.transport.execute(raw_table_spec(SCHEMA.layout("vec"), table).create_sql())
    # (key, step, seq, timestamp ns): five ties on (1, 0, 5), out of time order
    # within an insert and across inserts
    rows_ = [
        [(1, 0, 5, 3_000), (0, 0, 1, 9_000), (1, 0, 5, 1_000), (1, 0, 5, 5_000)],
        [(1, 0, 5, 2_000), (2, 1, 0, 0), (1, 0, 5, 4_000)],
    ]
    for i, part in enumerate(rows_):
        key, step, seq, ts = (list(c) for c in zip(*part, strict=True))
        data = pa.table(
            {
                "hook": ["h"] * len(part),
                "output_id": pa.array([0] * len(part), pa.uint32()),
                "key": pa.array(key, pa.int64()),
                "step": pa.array(step, pa.int64()),
                "seq": pa.array(seq, pa.int64()),
                "timestamp": pa.array(ts, pa.timestamp("ns")),
                "values": [[float(t), 0.0, 0.0, 0.0] for t in ts],
                "values_shape": [[4]] * len(part),
            }
        )
        ch.transport.insert(table, data, dedup_token=f"ties-{i}")
    corpus_ = ClickHouseCorpus(ch.transport, "vec", table=table)
    corpus_.check(SCHEMA)
    (unit,) = corpus_.plan(100)
    got = corpus_.read(unit)
    order = [(r["key"], r["step"], r["seq"], r["values"][0]) for r in got.to_pylist()]
    ties = [(1, 0, 5, float(t)) for t in (1000, 2000, 3000, 4000, 5000)]
    assert order == [(0, 0, 1, 9000), *ties, (2, 1, 0, 0)]
    rest = got.slice(5)  # one tie left: nothing to reorder, the same rows back
    assert timestamp_within_ties(rest).to_pylist() == rest.to_pylist()


def test_dry_run_validates_and_writes_nothing(corpus, tmp_path):
    ch = corpus
    report = run_replay(
        **settings(ch, tmp_path, processor="test.norms"),
        outputs={"norm": ClickHouseTable(f"{ch.prefix}_dry")},
        dry_run=True,
    )
    text = report.describe()
    assert f"~{KEYS * STEPS * len(HOOKS):,} records" in text and "dry run" in text
    assert ch.transport.describe(f"{ch.prefix}_dry") is None
    assert not (tmp_path / "runs").exists()


def test_ledger_records_run_units_counts_and_phase_timings(corpus, tmp_path):
    ch = corpus
    report = run_replay(
        **settings(ch, tmp_path, processor="test.norms", params={"note": "x"}),
        outputs={"norm": ClickHouseTable(f"{ch.prefix}_replay_norm")},
    )
    ledger = json.loads(report.ledger.read_text())
    assert ledger["run_id"] == report.run_id
    assert ledger["status"] == "finished" and ledger["params"] == {"note": "x"}
    assert len(ledger["config_hash"]) == 16
    assert ledger["started_at"] <= ledger["ended_at"]
    assert set(ledger["units"]) == {u.id for u in report.plan}
    assert sum(u["outputs"]["norm"] for u in ledger["units"].values()) == 288
    assert {u["records"] for u in ledger["units"].values()} == {u.rows for u in report.plan}
    for phase in ("read", "process", "write"):
        stats = ledger["phases"][phase]
        assert stats["count"] == len(report.plan)
        assert 0 < stats["p50"] <= stats["p95"]
    # The same progress in Prometheus text format, beside the ledger.
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, s.labels.get("lane"), s.labels.get("phase"), s.labels.get("quantile")): s.value
        for family in text_string_to_metric_families(
            (report.ledger.parent / "metrics.prom").read_text()
        )
        for s in family.samples
        if s.labels["run_id"] == report.run_id
    }
    assert samples["taproute_replay_units_done", None, None, None] == len(report.plan)
    assert samples["taproute_replay_units_failed", None, None, None] == 0
    assert samples["taproute_replay_rows_written", "norm", None, None] == 288
    assert samples["taproute_replay_phase_seconds", None, "process", "0.95"] == pytest.approx(
        ledger["phases"]["process"]["p95"]
    )


def test_checkpoint_cadence_by_units_and_by_seconds(corpus, tmp_path):
    ch = corpus
    counts = []
    for units, seconds in ((3, 3600.0), (1000, 1e-9)):
        report = run_replay(
            **settings(
                ch,
                tmp_path,
                processor="test.norms",
                checkpoint_units=units,
                checkpoint_seconds=seconds,
            ),
            outputs={"norm": ParquetDir(str(tmp_path / f"c{units}"))},
        )
        ledger = json.loads(report.ledger.read_text())
        counts.append((len(report.plan), ledger["checkpoints"]))
    (planned, by_units), (_, by_seconds) = counts
    # One when the run starts, one per cadence point, one at the end.
    assert by_units == 1 + planned // 3 + 1
    assert by_seconds == 1 + planned + 1


def test_batch_processor_contract_two_lanes_init_and_stats(corpus, tmp_path):
    ch = corpus
    rp.INIT_CALLS.clear()
    report = run_replay(
        **settings(ch, tmp_path, processor="replay.batch_norms", params={"scale": 2.0}),
        outputs={"norms": ParquetDir(str(tmp_path / "norms")), "sums": f"clickhouse:{ch.prefix}_s"},
    )
    assert [{"run_id": report.run_id, "params": {"scale": 2.0}, "resume": False}] == rp.INIT_CALLS
    import pyarrow.parquet as pq

    norms = pq.read_table(tmp_path / "norms").sort_by("seq")
    live = ch.query(f"SELECT norm FROM {ch.prefix}_norm ORDER BY seq").column("norm")
    np.testing.assert_allclose(norms.column("norm").to_numpy(), live.to_numpy() * 2, rtol=1e-6)
    sums = ch.query(f"SELECT sum(count) AS n FROM {ch.prefix}_s").to_pylist()
    assert sums == [{"n": 288}]
    ledger = json.loads(report.ledger.read_text())
    assert sum(u["stats"]["records"] for u in ledger["units"].values()) == 288


# -- bad input -----------------------------------------------------------------


def test_unknown_processor_is_refused(corpus, tmp_path):
    with pytest.raises(UnknownProcessor, match="nope"):
        run_replay(**settings(corpus, tmp_path, processor="nope"))


def test_layout_mismatch_between_corpus_and_processor(corpus, tmp_path):
    with pytest.raises(LayoutMismatch, match="reads layout 'tokens'.*holds layout 'vec'"):
        from taproute.routing import stateless_processor

        @stateless_processor("replay.reads_tokens", input="tokens", output="norm")
        def reads_tokens(records):  # pragma: no cover - never called
            return None

        run_replay(**settings(corpus, tmp_path, processor="replay.reads_tokens"))


def test_missing_corpus_table(clickhouse, tmp_path):
    with pytest.raises(MissingSource, match="corpus table 'nope_raw_vec' does not exist"):
        run_replay(
            **settings(
                clickhouse,
                tmp_path,
                processor="test.norms",
                source=ClickHouseCorpus(clickhouse.transport, "vec", table="nope_raw_vec"),
            )
        )


def test_output_table_with_another_schema(corpus, tmp_path):
    ch = corpus
    ch.transport.execute(
        f"CREATE TABLE {ch.prefix}_bad (key Int64, seq Int64, norm Float64) ENGINE = MergeTree "
        "ORDER BY tuple() SETTINGS non_replicated_deduplication_window = 100"
    )
    with pytest.raises(SchemaMismatch, match="column 'norm' expected Float32, found Float64"):
        run_replay(
            **settings(ch, tmp_path, processor="test.norms"),
            outputs={"norm": ClickHouseTable(f"{ch.prefix}_bad")},
        )


@pytest.mark.parametrize(
    ("settings_sql", "message"),
    [
        ("", "no deduplication window"),
        # The setting named with a window of 0 deduplicates nothing: the check
        # is the sink's (one home), which reads the value, not the name.
        (
            " SETTINGS non_replicated_deduplication_window = 0",
            "non_replicated_deduplication_window is 0",
        ),
        # A window shorter than what a resume redoes (16 units since the last
        # checkpoint; a stateless processor has no final rows) let the older
        # redone units through twice: a probe killed a run 6 units past a
        # checkpoint into a table with a window of 2 and found 4 units' rows
        # doubled after the resume.
        (
            " SETTINGS non_replicated_deduplication_window = 4",
            r"window covering the 16 insert\(s\) a resume may redo \(checkpoint_units=16 "
            r"units.*only its last 4 block",
        ),
    ],
    ids=["no-window", "zero-window", "short-window"],
)
def test_output_table_without_dedup_window_is_refused(corpus, tmp_path, settings_sql, message):
    ch = corpus
    ch.transport.execute(
        f"CREATE TABLE {ch.prefix}_nodedup (key Int64, seq Int64, norm Float32) "
        f"ENGINE = MergeTree ORDER BY tuple(){settings_sql}"
    )
    with pytest.raises(NotExactlyOnce, match=message):
        run_replay(
            **settings(ch, tmp_path, processor="test.norms"),
            outputs={"norm": ClickHouseTable(f"{ch.prefix}_nodedup")},
        )


class Stopped(Exception):
    """What the test raises to stop a run where a crash would."""


@pytest.mark.parametrize("window", [12, 11])
def test_a_resume_into_a_partitioned_table_writes_no_row_twice(
    corpus, tmp_path, monkeypatch, window
):
    """ClickHouse deduplicates per block, and an insert into a partitioned table
    is one block per partition it touches: each unit here touches 4, so a
    resume redoing 3 units (checkpoint_units) repeats 12 blocks.  The check
    counted one block per insert (3 + 1 <= 11) and let a window of 11 through;
    the redone units' oldest block had left the window, was written again, and
    pushed the next one out: every redone row came out twice.  Now a window of
    12 holds the redo (no row twice after the resume), and one of 11 is refused
    at the first insert, nothing written, naming table, window and the limit."""
    from taproute.service.replay.ledger import RunLedger

    ch = corpus
    table = f"{ch.prefix}_parts"
    ch.transport.execute(
        f"CREATE TABLE {table} (key Int64, seq Int64, norm Float32) ENGINE = MergeTree "
        f"PARTITION BY seq % 4 ORDER BY (key, seq) "
        f"SETTINGS non_replicated_deduplication_window = {window}"
    )
    kwargs = settings(ch, tmp_path, processor="test.norms", checkpoint_units=3)
    checkpoint = RunLedger.checkpoint
    calls = []

    def crash_at_third_checkpoint(ledger, state):
        # The run's first checkpoint is at its start, the second after unit 3:
        # the third (after unit 6) never lands, so units 4-6 are written and
        # not in the ledger, as when the process dies there.
        calls.append(1)
        if len(calls) == 3:
            raise Stopped("the driver died here")
        checkpoint(ledger, state)

    monkeypatch.setattr(RunLedger, "checkpoint", crash_at_third_checkpoint)
    outputs = {"norm": ClickHouseTable(table)}
    if window < 12:
        with pytest.raises(NotExactlyOnce) as refused:
            run_replay(**kwargs, outputs=outputs)
        message = str(refused.value)
        assert f"output table {table!r}" in message
        assert f"non_replicated_deduplication_window = {window}" in message
        assert "more than 3 partition" in message  # 11 // 3 inserts a resume redoes
        assert "at least 12" in message  # 3 inserts x 4 partitions, at the least
        (run_dir,) = (tmp_path / "runs").iterdir()
        assert f"--resume {run_dir.name}" in message
        assert ch.query(f"SELECT count() AS n FROM {table}").to_pylist() == [{"n": 0}]
        return
    with pytest.raises(Stopped):
        run_replay(**kwargs, outputs=outputs)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert len(json.loads((run_dir / "ledger.json").read_text())["units"]) == 3
    monkeypatch.setattr(RunLedger, "checkpoint", checkpoint)
    parts = ch.query(
        f"SELECT count(DISTINCT _partition_id) AS n FROM {table} WHERE seq IN "
        f"(SELECT seq FROM {table} ORDER BY key, seq LIMIT 40)"
    ).to_pylist()
    assert parts == [{"n": 4}]  # a unit's rows (the first 40) touch every partition
    report = run_replay(**kwargs, outputs=outputs, resume=run_dir.name)
    assert report.units_skipped == 3
    got = ch.query(f"SELECT count() AS n, uniqExact(seq) AS u FROM {table}").to_pylist()
    assert got == [{"n": 288, "u": 288}]


def test_a_unit_of_more_rows_than_a_clickhouse_block_is_deduplicated_whole(clickhouse):
    """ClickHouse cut an insert of more than min_insert_block_size_rows (1,048,449)
    rows into blocks of that size, each remembered on its own: two units of 1.1M
    rows were 4 blocks, and a table whose window held the 2 inserts a resume
    redoes wrote both units again on the redo.  A lane's insert is written as
    one block: the redo of both units leaves each row once."""
    from taproute.service.replay.lanes import Redo, open_lane

    ch = clickhouse
    table = f"{ch.prefix}_big"
    ch.transport.execute(
        f"CREATE TABLE {table} (key Int64, seq Int64, norm Float32) ENGINE = MergeTree "
        "ORDER BY (key, seq) SETTINGS non_replicated_deduplication_window = 2"
    )
    lane = open_lane(
        "norm", ClickHouseTable(table), SCHEMA.layout("norm"), ch.transport, redo=Redo(2)
    )
    lane.prepare(create=False)
    n = 1_100_000
    units = {
        f"u{u}": pa.table(
            {
                "key": np.full(n, u, dtype=np.int64),
                "seq": np.arange(u * n, (u + 1) * n, dtype=np.int64),
                "norm": np.ones(n, dtype=np.float32),
            }
        )
        for u in range(2)
    }
    for _ in range(2):  # the run, then a resume redoing both units
        for part, data in units.items():
            lane.write(data, run_id="r", part=part)
    got = ch.query(f"SELECT count() AS n, uniqExact(seq) AS u FROM {table}").to_pylist()
    assert got == [{"n": 2 * n, "u": 2 * n}]


def test_unknown_lane_is_refused(corpus, tmp_path):
    with pytest.raises(ReplayConfigError, match=r"lane\(s\) \['nrom'\].*lanes: \['norm'\]"):
        run_replay(
            **settings(corpus, tmp_path, processor="test.norms"), outputs={"nrom": "parquet:x"}
        )


def test_stateful_on_several_workers_without_merge_is_refused(corpus, tmp_path):
    with pytest.raises(MergeRequired, match="needs a registered merge and finish.*merge, finish"):
        run_replay(
            **settings(corpus, tmp_path, processor="test.running_sum"),
            backend="processes",
            workers=2,
        )


def test_failing_unit_is_retried_then_recorded_and_others_finish(corpus, tmp_path):
    ch = corpus
    with pytest.raises(UnitsFailed, match="2 work unit") as caught:
        run_replay(
            **settings(ch, tmp_path, processor="replay.fails_on_key", retries=1),
            outputs={"norm": ClickHouseTable(f"{ch.prefix}_f")},
        )
    report = caught.value.report
    assert len(report.failed) == 2  # key 13 of each hook
    assert all("cannot handle key(s) [13]" in e for e in report.failed.values())
    assert report.units_run == len(report.plan) - 2
    ledger = json.loads(report.ledger.read_text())
    assert ledger["status"] == "failed" and set(ledger["failed"]) == set(report.failed)
    assert f"--resume {report.run_id}" in str(caught.value)
    written = ch.query(f"SELECT count() AS n FROM {ch.prefix}_f").to_pylist()[0]["n"]
    bad_rows = sum(u.rows for u in report.plan if u.id in report.failed)
    assert written == 288 - bad_rows


def test_a_stateful_unit_failing_stops_the_units_after_it_and_resume_equals_a_clean_run(
    corpus, tmp_path
):
    """A stateful processor carries its state from unit to unit in plan order.
    When one unit failed and the others went on, they missed its records, and
    the failed unit, retried on resume after them, saw theirs: the running
    sums written differed from an uninterrupted run's.  Now the run stops at
    the failed unit (saying so), and the resume, from it, writes what an
    uninterrupted run writes."""
    ch = corpus
    clean, failing = f"{ch.prefix}_sum_clean", f"{ch.prefix}_sum_failing"
    base = dict(processor="replay.sum_fails_on_key", stateful_output="units", retries=0)
    run_replay(**settings(ch, tmp_path, **base), outputs={"sum": ClickHouseTable(clean)})
    rp.STATEFUL_POISON_KEYS.add(13)
    try:
        with pytest.raises(UnitsFailed) as caught:
            run_replay(**settings(ch, tmp_path, **base), outputs={"sum": ClickHouseTable(failing)})
    finally:
        rp.STATEFUL_POISON_KEYS.clear()
    report = caught.value.report
    (unit,) = report.failed  # the first unit holding key 13; none after it ran
    after = len(report.plan) - 1 - [u.id for u in report.plan].index(unit)
    assert "processor 'replay.sum_fails_on_key'" in str(caught.value)
    assert f"the {after} unit(s) after it were not run" in str(caught.value)
    assert report.units_run == len(report.plan) - 1 - after
    resumed = run_replay(
        **settings(ch, tmp_path, **base),
        outputs={"sum": ClickHouseTable(failing)},
        resume=report.run_id,
    )
    assert resumed.units_run == after + 1 and not resumed.failed
    assert rows(ch, failing, "ALL") == rows(ch, clean, "ALL")


def test_transient_failure_is_retried(corpus, tmp_path):
    ch = corpus
    rp.FLAKY_CALLS[0] = 0
    report = run_replay(
        **settings(ch, tmp_path, processor="replay.flaky"),
        outputs={"norm": ClickHouseTable(f"{ch.prefix}_fl")},
    )
    assert not report.failed and report.rows_written == {"norm": 288}
    ledger = json.loads(report.ledger.read_text())
    assert sorted(u["attempts"] for u in ledger["units"].values())[-1] == 2


def test_resume_with_another_config_is_refused_naming_the_change(corpus, tmp_path):
    ch = corpus
    first = run_replay(
        **settings(ch, tmp_path, processor="test.norms"),
        outputs={"norm": ClickHouseTable(f"{ch.prefix}_r")},
    )
    with pytest.raises(ConfigChanged, match=r"unit_rows: 40 -> 50"):
        run_replay(
            **settings(ch, tmp_path, processor="test.norms", unit_rows=50),
            outputs={"norm": ClickHouseTable(f"{ch.prefix}_r")},
            resume=first.run_id,
        )


def _register_resized(key_range: int) -> None:
    """``test.resized``, a per-key sum over ``key_range`` keys (registered again
    with another range, as a changed module would be: same function, same name)."""
    from taproute.routing import SlotSpec, stateful_processor
    from tests.processors import SUM

    def finish(state, keys):
        rows = np.zeros(len(keys), dtype=SUM.dtype)
        rows["key"] = keys
        rows["count"] = state.slots[keys, 0]
        return rows

    @stateful_processor(
        "test.resized",
        key=lambda d: d["key"] % key_range,
        key_range=key_range,
        slot=SlotSpec((1,), "float64"),
        input="vec",
        output="sum",
        finish=finish,
    )
    def resized(records, keys, state):
        np.add.at(state.slots[:, 0], keys, 1)

    del resized


def test_resume_with_a_checkpoint_of_another_state_shape_is_refused(corpus, tmp_path):
    """The processor's key range changed under the same name (the config hash
    does not see it): the checkpoint's 16 x 1 state went into a 32 x 1 region
    and the resume died on a numpy broadcast ValueError; now it is refused,
    naming the run and both shapes, and the ledger is left as it was."""
    ch = corpus
    _register_resized(16)
    out = {"sum": ParquetDir(str(tmp_path / "resized"))}
    first = run_replay(**settings(ch, tmp_path, processor="test.resized"), outputs=out)
    before = first.ledger.read_text()
    _register_resized(32)
    try:
        with pytest.raises(ConfigChanged) as refused:
            run_replay(
                **settings(ch, tmp_path, processor="test.resized"),
                outputs=out,
                resume=first.run_id,
            )
    finally:
        _register_resized(16)
    assert first.run_id in str(refused.value)
    assert "holds 16 keys x slot (1,) float64" in str(refused.value)
    assert "now has key_range=32, slot (1,) float64" in str(refused.value)
    assert first.ledger.read_text() == before


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda text: text[:300], r"is not valid JSON \(Unterminated string"),
        (lambda text: '{"run_id": "x"}', r"is not a replay ledger: it lacks config_hash, config"),
    ],
    ids=["truncated", "foreign"],
)
def test_resume_of_a_damaged_ledger_is_refused_naming_it(corpus, tmp_path, damage, message):
    """A ledger cut short or not a ledger at all died in the resume with a
    JSONDecodeError or a KeyError traceback; now it is refused, naming the file."""
    ch = corpus
    out = {"norm": ParquetDir(str(tmp_path / "damaged"))}
    first = run_replay(**settings(ch, tmp_path, processor="test.norms"), outputs=out)
    first.ledger.write_text(damage(first.ledger.read_text()))
    with pytest.raises(ReplayConfigError, match=message) as refused:
        run_replay(
            **settings(ch, tmp_path, processor="test.norms"), outputs=out, resume=first.run_id
        )
    assert str(first.ledger) in str(refused.value)


def test_resume_of_an_unknown_run(corpus, tmp_path):
    with pytest.raises(UnknownRun, match="no run 'r-missing'"):
        run_replay(**settings(corpus, tmp_path, processor="test.norms"), resume="r-missing")


# -- the command -----------------------------------------------------------------


def cli(ch, tmp_path, *extra: str) -> list[str]:
    """The replay command on ``ch``'s ClickHouse: its chDB directory, or the
    server's URL (a server has no path: ``ch.transport.path`` failed there)."""
    where = ["--chdb", str(ch.transport.path)] if ch.name == "chdb" else ["--url", SERVER_URL]
    return [
        "replay",
        "--schema",
        "tests.processors:SCHEMA",
        "--import",
        "tests.replay_processors",
        *where,
        "--layout",
        "vec",
        "--table",
        f"{ch.prefix}_raw_vec",
        "--unit-rows",
        "40",
        "--runs",
        str(tmp_path / "runs"),
        *extra,
    ]


def test_cli_dry_run_then_run_then_failing_run(corpus, tmp_path, capsys):
    from taproute.service.host.cli import main

    ch = corpus
    out = f"norm=clickhouse:{ch.prefix}_cli"
    assert main(cli(ch, tmp_path, "--processor", "test.norms", "--output", out, "--dry-run")) == 0
    printed = capsys.readouterr().out
    assert "work unit(s), ~288 records" in printed and "config hash: " in printed
    assert "hook=layers.0.attn.q  keys 0..13" in printed
    assert main(cli(ch, tmp_path, "--processor", "test.norms", "--output", out)) == 0
    assert "rows written: norm: 288" in capsys.readouterr().out
    assert ch.query(f"SELECT count() AS n FROM {ch.prefix}_cli").to_pylist() == [{"n": 288}]
    bad = f"norm=clickhouse:{ch.prefix}_cli_bad"
    code = main(cli(ch, tmp_path, "--processor", "replay.fails_on_key", "--output", bad))
    captured = capsys.readouterr()
    assert code == 1
    assert "2 work unit(s) failed" in captured.err and "cannot handle key(s) [13]" in captured.err
    # Bad input exits 2, as the README's exit codes say (it exited 1, as failed work).
    assert main(cli(ch, tmp_path, "--processor", "test.norms", "--keys", "9")) == 2
    assert "--keys '9': expected LO:HI" in capsys.readouterr().err
    assert main(cli(ch, tmp_path, "--processor", "test.nope", "--output", out)) == 2
    assert "unknown processor 'test.nope'" in capsys.readouterr().err
    assert main(cli(ch, tmp_path, "--processor", "test.norms", "--output", "norm=nowhere")) == 2
    assert "expected clickhouse:TABLE or parquet:DIRECTORY" in capsys.readouterr().err


# -- backends ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "workers", "schedule"),
    [("processes", 2, "static"), ("processes", 2, "pull")],
)
def test_backends_give_the_inprocess_outputs(corpus, tmp_path, backend, workers, schedule):
    same_outputs_as_inprocess(corpus, tmp_path, backend, workers, schedule)


@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'taproute[ray]')")
@pytest.mark.parametrize("schedule", ["static", "pull"])
def test_ray_gives_the_inprocess_outputs(local_ray, corpus, tmp_path, schedule):
    same_outputs_as_inprocess(corpus, tmp_path, "ray", 2, schedule)


def same_outputs_as_inprocess(ch, tmp_path, backend, workers, schedule):
    outputs = {}
    for name, kwargs in (
        ("inprocess", {}),
        (backend, {"backend": backend, "workers": workers, "schedule": schedule}),
    ):
        for processor, lane in (("test.norms", "norm"), ("replay.running_sum", "sum")):
            table = f"{ch.prefix}_{name}_{lane}"
            run_replay(
                **settings(ch, tmp_path, processor=processor, **kwargs),
                outputs={lane: ClickHouseTable(table)},
            )
            outputs[name, lane] = ch.query(
                f"SELECT * FROM {table} ORDER BY key, {'seq' if lane == 'norm' else 'count'}"
            )
    assert outputs["inprocess", "norm"].num_rows == 288
    assert outputs[backend, "norm"].equals(outputs["inprocess", "norm"])
    # Stateful via merge: partial sums per unit, merged by the driver.
    assert outputs["inprocess", "sum"].num_rows == 16
    assert outputs[backend, "sum"].to_pylist() == outputs["inprocess", "sum"].to_pylist()


# -- Parquet corpora -----------------------------------------------------------------


@pytest.fixture
def parquet_corpus(corpus, tmp_path):
    """The captured raw table exported to two Parquet files of 48-row row groups."""
    import pyarrow.parquet as pq

    ch = corpus
    files = []
    for i, hook in enumerate(HOOKS):
        table = ch.query(f"SELECT * FROM {{p}}_raw_vec WHERE hook = '{hook}' ORDER BY seq")
        path = tmp_path / "corpus" / f"part-{i}.parquet"
        path.parent.mkdir(exist_ok=True)
        pq.write_table(table, path, row_group_size=48)
        files.append(path)
    return ch, files


def test_parquet_corpus_replays_like_the_table(parquet_corpus, tmp_path):
    from taproute.service.replay import ParquetCorpus

    ch, _ = parquet_corpus
    report = run_replay(
        **settings(
            ch,
            tmp_path,
            processor="test.norms",
            source=ParquetCorpus([str(tmp_path / "corpus" / "*.parquet")], "vec"),
            runs_dir=None,
        ),
        outputs={"norm": ParquetDir(str(tmp_path / "from_parquet"))},
    )
    assert len(report.plan) == 2 * (KEYS * STEPS // 48)  # one unit per row group
    assert ch.query(f"SELECT count() AS n FROM {ch.prefix}_norm").to_pylist() == [{"n": 288}]
    live = ch.query(f"SELECT * FROM {ch.prefix}_norm ORDER BY seq")
    import pyarrow.parquet as pq

    replayed = pq.read_table(tmp_path / "from_parquet").sort_by("seq")
    assert replayed.to_pylist() == live.to_pylist()
    # By default the ledger lies beside the Parquet outputs.
    assert report.ledger.parent.parent == tmp_path / "_replay_runs"


def test_parquet_corpus_filters_and_bad_files(parquet_corpus, tmp_path):
    from taproute.service.replay import ParquetCorpus

    ch, files = parquet_corpus
    filtered = ParquetCorpus(files, "vec", filters=Filters(hooks=["layers.0.*"], keys=(0, 8)))
    report = run_replay(
        **settings(ch, tmp_path, processor="test.norms", source=filtered),
        outputs={"norm": ParquetDir(str(tmp_path / "f"))},
    )
    assert report.records == 8 * STEPS
    with pytest.raises(MissingSource, match="no such file"):
        run_replay(
            **settings(
                ch, tmp_path, processor="test.norms", source=ParquetCorpus(["nope.parquet"], "vec")
            ),
            outputs={"norm": ParquetDir(str(tmp_path / "g"))},
        )
    import pyarrow as pa
    import pyarrow.parquet as pq

    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"hook": ["x"], "key": [1]}), odd)
    with pytest.raises(LayoutMismatch, match=r"missing column\(s\) \['output_id'"):
        run_replay(
            **settings(ch, tmp_path, processor="test.norms", source=ParquetCorpus([odd], "vec")),
            outputs={"norm": ParquetDir(str(tmp_path / "g"))},
        )


def test_a_parquet_corpus_named_by_its_directory_says_so(tmp_path):
    """`--parquet out/export` (the directory, not its files) was refused as
    "no such file", though the directory is right there."""
    from taproute.service.replay import ParquetCorpus

    (tmp_path / "export").mkdir()
    with pytest.raises(
        MissingSource, match=r"is a directory; name its files, e\.g\. '.*\*\.parquet'"
    ):
        run_replay(
            source=ParquetCorpus([tmp_path / "export"], "vec"),
            processor="test.norms",
            schema=SCHEMA,
            outputs={"norm": ParquetDir(str(tmp_path / "out"))},
            runs_dir=tmp_path / "runs",
        )
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_a_killed_worker_stops_the_run_and_resume_finishes_it(corpus, tmp_path, monkeypatch):
    import os

    from taproute.service.replay import WorkerLost

    ch = corpus
    monkeypatch.setenv("TAPROUTE_TEST_DRIVER_PID", str(os.getpid()))
    table = f"{ch.prefix}_killed"
    kwargs = settings(ch, tmp_path, processor="replay.dies_in_a_worker", checkpoint_units=1)
    with pytest.raises(WorkerLost, match=r"replay worker \d \(pid \d+\) exited with code -9"):
        run_replay(
            **kwargs, outputs={"norm": ClickHouseTable(table)}, backend="processes", workers=2
        )
    (run_dir,) = (tmp_path / "runs").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["status"] == "interrupted" and "WorkerLost" in ledger["error"]
    assert len(ledger["units"]) < 8
    # Resume in-process (where the processor does not kill itself): every unit, once.
    report = run_replay(**kwargs, outputs={"norm": ClickHouseTable(table)}, resume=run_dir.name)
    assert report.units_skipped == len(ledger["units"])
    got = ch.query(f"SELECT count() AS n, uniqExact(seq) AS u FROM {table}").to_pylist()
    assert got == [{"n": 288, "u": 288}]


# -- decoding stored rows ------------------------------------------------------------


@pytest.mark.parametrize("layout_name", ["vec", "tokens", "pair"])
def test_stored_rows_decode_to_the_records_that_were_captured(layout_name):
    """raw_table (what the sink stores) then decode_records gives back the same
    descriptors and payload values, for one fixed array, a fixed prefix + a
    variable tail, and several fixed columns."""
    from taproute.routing import Layout, RecordBatch, Records, RecordSchema
    from taproute.service.replay.decode import decode_records
    from taproute.service.sinks.clickhouse.columns import raw_table
    from taproute.service.sinks.clickhouse.tables import raw_table_spec

    pair = Layout("pair", [("a", "Int32"), ("b", "Array(Float64)", (2, 3))])
    schema = RecordSchema([*SCHEMA.layouts, pair])
    layout = schema.layout(layout_name)
    rng = np.random.default_rng(1)
    n = 5
    if layout_name == "tokens":
        counts = rng.integers(1, 6, size=n)
        parts = [
            np.concatenate(
                [np.array([i], np.uint32).view(np.uint8), rng.random(c, np.float32).view(np.uint8)]
            )
            for i, c in enumerate(counts)
        ]
        payload = np.concatenate(parts)
        lengths = [len(p) for p in parts]
    else:
        payload = rng.random(n * layout.dtype.itemsize).astype(np.float32).view(np.uint8)
        payload = payload[: n * layout.dtype.itemsize]
        lengths = layout.dtype.itemsize
    desc = make_descriptors(
        np.arange(n) % 2,
        lengths,
        count=n,
        layout_ids=schema.layout_id(layout_name),
        keys=np.arange(n) * 3,
        steps=7,
        seqs=np.arange(n) + 100,
    )
    batch = RecordBatch.from_buffer(desc, payload)
    names = ["h.a", "h.b"]
    table = raw_table(batch, layout, raw_table_spec(layout, "t"), names)
    table = table.select([c for c in table.column_names if not c.endswith("_shape")])
    back = decode_records(table, layout, schema.layout_id(layout_name), names, where="test")
    for field in ("output_id", "layout_id", "key", "step", "seq", "timestamp_ns", "length"):
        assert back.descriptors[field].tolist() == desc[field].tolist(), field
    before, after = Records(batch, layout), Records(back, layout)
    if layout.is_fixed:
        assert after.rows().tobytes() == before.rows().tobytes()
    else:
        for i in range(n):
            assert after.tail(i).tolist() == before.tail(i).tolist()
            assert back.payload_of(i).tobytes() == batch.payload_of(i).tobytes()


def test_progress_bar_draws_on_a_terminal_and_stays_quiet_in_ci(monkeypatch):
    import io

    from taproute.service.replay.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("CI", raising=False)
    tty = Terminal()
    bar = Progress(2, 100, stream=tty)
    bar.advance(40)
    bar.advance(60)
    bar.close()
    last = tty.getvalue().strip().split("\r")[-1]
    assert "2/2 units" in last and "100 rows" in last and "rows/s" in last and "ETA 0 s" in last
    monkeypatch.setenv("CI", "true")
    quiet = Terminal()
    bar = Progress(2, 100, stream=quiet)
    bar.advance(100)
    bar.close()
    assert quiet.getvalue() == ""
    piped = io.StringIO()  # not a terminal
    monkeypatch.delenv("CI")
    Progress(1, 1, stream=piped).advance(1)
    assert piped.getvalue() == ""
