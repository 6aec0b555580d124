"""Config files: every problem reported with file and key path; check and run commands."""

from __future__ import annotations

import io
import re
import uuid
from pathlib import Path

import pytest

from taproute.service.host.cli import main
from taproute.service.host.config import ConfigFileError, load_config
from taproute.service.host.loadgen import run_load

BASE = """
processors = ["tests.processors"]

[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[layouts]]
name = "norm"
columns = [
  { name = "key", type = "Int64" },
  { name = "seq", type = "Int64" },
  { name = "norm", type = "Float32" },
]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[[routes]]
name = "norms"
outputs = ["layers.*"]
mode = "stateless"
processor = "test.norms"
destination = "ch"

[destinations.ch]
path = "@PATH@"
raw = ["vec"]
rows = ["norm"]
raw_table = "@PREFIX@_raw_{layout}"
rows_table = "@PREFIX@_{layout}"

[routing]
unmatched = "drop"

[http]
port = 0

[[producer.hooks]]
name = "layers.0"
layout = "vec"
batch = 16
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return path


def base(chdb_transport, prefix: str) -> str:
    return BASE.replace("@PATH@", str(chdb_transport.path)).replace("@PREFIX@", prefix)


def unique(name: str) -> str:
    return f"{name}{uuid.uuid4().hex[:8]}"


def test_structure_errors_name_file_and_key_path(tmp_path):
    path = write(
        tmp_path,
        """
layouts = []
[[routes]]
name = "r"
outputs = ["x"]
destination = "d"
workers = "many"
colour = "blue"
[destinations.d]
path = "x"
raw = "vec"
""",
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "invalid value for type, expected int @ routes[0].workers",
        "extra fields found (colour) @ routes[0]",
        "invalid value for type, expected list @ destinations['d'].raw",
    ]
    assert str(caught.value).startswith(f"{path}: 3 problem(s)")


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigFileError, match="not valid TOML"):
        load_config(write(tmp_path, "routes = [ oops"))


def test_semantic_errors_name_where(tmp_path, chdb_transport):
    text = base(chdb_transport, unique("sem"))
    cases = {
        'processor = "test.norms"': ('processor = "nope"', "unknown processor 'nope'"),
        'rows = ["norm"]': ('rows = ["nrom"]', "unknown layout 'nrom' @ destinations.ch.rows[0]"),
        '{ name = "norm", type = "Float32" }': (
            '{ name = "norm", type = "Float33" }',
            "ClickHouse type 'Float33' does not map",
        ),
        'processors = ["tests.processors"]': (
            'processors = ["tests.nowhere"]',
            "cannot import processor module 'tests.nowhere'",
        ),
    }
    for original, (replacement, message) in cases.items():
        config_path = write(tmp_path, text.replace(original, replacement))
        with pytest.raises(ConfigFileError, match=re.escape(message)):
            load_config(config_path).build()
    both = text.replace("[destinations.ch]\n", '[destinations.ch]\nurl = "http://x:8123"\n')
    with pytest.raises(ConfigFileError, match="exactly one of path"):
        load_config(write(tmp_path, both)).build()


def test_check_command_validates_tables(tmp_path, chdb_transport, capsys):
    prefix = unique("chk")
    path = write(tmp_path, base(chdb_transport, prefix))
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 route(s), 2 layout(s) OK" in out and "match the schema" in out
    # Now break one table: the check names table, column, expected and found.
    table = f"{prefix}_norm"
    chdb_transport.execute(f"DROP TABLE `{table}`")
    chdb_transport.execute(
        f"CREATE TABLE `{table}` (key Int64, seq Int64, norm Float64) "
        "ENGINE = MergeTree ORDER BY tuple()"
    )
    assert main(["check", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"table '{table}': column 'norm' expected Float32, found Float64" in err


def test_run_drives_the_router_at_a_rate_and_serves_http(tmp_path, chdb_transport):
    prefix = unique("run")
    path = write(tmp_path, base(chdb_transport, prefix))
    out = io.StringIO()
    counters = run_load(load_config(path), rate=4000, duration=0.5, out=out)
    submitted = counters.ingress.submitted
    assert submitted >= 16
    assert counters.routes["raw"].processed == submitted
    assert counters.routes["norms"].emitted == submitted
    assert counters.failure is None
    text = out.getvalue()
    assert "serving http://127.0.0.1:" in text and "100%" in text
    table = f"{prefix}_raw_vec"
    rows = chdb_transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
    assert rows == submitted


def test_the_shipped_load_test_config_is_valid(tmp_path):
    shipped = Path(__file__).resolve().parent.parent / "bench" / "synthetic.toml"
    copy = tmp_path / "synthetic.toml"  # relative paths then resolve under tmp_path
    copy.write_text(shipped.read_text())
    config = load_config(copy)
    sink, runtime_kwargs = config.build()
    assert [r.name for r in config.routes] == ["raw", "head_norms"]
    assert sink.trace("encoder.layer.3.attention.self.query").destinations == ["clickhouse"]
    runtime_kwargs["dead_letters"].close()
