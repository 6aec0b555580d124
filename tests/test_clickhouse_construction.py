"""ClickHouse sinks at construction: what a failed constructor releases,
which engines keep a deduplication window, and the config file's opt-in
to at-least-once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from taproute.service.sinks.clickhouse.deduplication import distributed_target, window_setting
from tests.clickhouse_backends import Backend


def test_a_failed_constructor_releases_its_chdb_directory(tmp_path):
    """chDB opens one directory per process: a constructor that fails must
    close it, or no other directory can be opened (a subprocess, because this
    test session's own chDB directory stays open)."""
    script = textwrap.dedent(
        """
        import sys
        from taproute.routing import Layout, RecordSchema
        from taproute.service import ClickHouseSink, SchemaMismatch
        from taproute.service.sinks.clickhouse import ChdbTransport

        schema = RecordSchema([Layout("sums", [("total", "Float64")])])
        d1, d2, d3 = sys.argv[1:]
        setup = ChdbTransport(d1)
        setup.execute("CREATE TABLE sums (total Float32) ENGINE = MergeTree ORDER BY tuple()")
        setup.close()
        try:
            ClickHouseSink.embedded(schema, d1, rows=["sums"])
        except SchemaMismatch as exc:
            print("refused:", exc)
        try:
            ClickHouseSink.embedded(schema, d2, rows=["sums"], bogus=1)
        except TypeError:
            print("refused: bad keyword")
        sink = ClickHouseSink.embedded(schema, d3, rows=["sums"])
        print("opened:", sink.transport.description)
        sink.transport.close()
        """
    )
    dirs = [str(tmp_path / d) for d in ("d1", "d2", "d3")]
    done = subprocess.run(
        [sys.executable, "-c", script, *dirs], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "refused: table 'sums': column 'total' expected Float64, found Float32",
        "refused: bad keyword",
        f"opened: chDB at {dirs[2]}",
    ]


def test_config_file_refuses_a_plain_table_unless_it_opts_into_at_least_once(
    tmp_path, chdb_transport, capsys
):
    from taproute.service.host.cli import main

    backend = Backend("chdb", chdb_transport)
    backend.create_raw_vec("MergeTree ORDER BY tuple()")
    config = textwrap.dedent(
        f"""
        [[layouts]]
        name = "vec"
        columns = [{{ name = "values", type = "Array(Float32)", shape = [4] }}]

        [[routes]]
        name = "raw"
        outputs = ["*"]
        destination = "ch"

        [routing]
        unmatched = "drop"

        [destinations.ch]
        path = "{chdb_transport.path}"
        raw = ["vec"]
        raw_table = "{backend.prefix}_raw_{{layout}}"
        """
    )
    path = tmp_path / "router.toml"
    path.write_text(config)
    assert main(["check", "--config", str(path)]) == 2  # config vs table: bad input
    assert "does not deduplicate retried inserts" in capsys.readouterr().err
    path.write_text(config + "require_deduplication = false\n")
    assert main(["check", "--config", str(path)]) == 0
    assert f"{backend.prefix}_raw_vec match the schema" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("engine_full", "target"),
    [
        ("Distributed('c', 'db', 'raw_q_local', cityHash64(key))", ("db", "raw_q_local")),
        ("Distributed('c', currentDatabase(), 'raw_q_local', rand())", ("", "raw_q_local")),
        ("Distributed(c, '', raw_q_local)", ("", "raw_q_local")),
        ("MergeTree ORDER BY tuple() SETTINGS index_granularity = 8192", None),
    ],
)
def test_distributed_tables_are_checked_through_the_local_table_they_name(engine_full, target):
    """No cluster here to create a Distributed table on: the parsing of what
    system.tables prints for one is checked, the lookup behind it is not."""
    assert distributed_target(engine_full) == target


def test_which_engines_keep_a_deduplication_window():
    assert window_setting("MergeTree") == "non_replicated_deduplication_window"
    assert window_setting("ReplacingMergeTree") == "non_replicated_deduplication_window"
    assert window_setting("ReplicatedMergeTree") == "replicated_deduplication_window"
    assert window_setting("SharedMergeTree") == "replicated_deduplication_window"
    assert window_setting("Memory") is None and window_setting("Log") is None
