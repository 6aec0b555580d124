"""A chDB directory removed under a running service (an operator's ``rm -rf``,
a cleanup job): real chDB in child processes (one directory per process).

chDB goes on inserting into part directories it makes again, with no table
metadata beside them, so every row after the removal landed where no later
start finds it, while the destination read healthy and ``flush()`` called
it delivered.  An insert now refuses such a directory, as an outage: a
spool keeps the batches and the next start delivers them; without one the
failure is latched, naming the directory."""

from __future__ import annotations

import json
from pathlib import Path

from tests.children import run_child

CONFIG = """
[[layouts]]
name = "vec"
columns = [{{ name = "values", type = "Array(Float32)", shape = [4] }}]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
path = "data"
raw = ["vec"]
spool = "{spool}"
retry = {{ attempts = {attempts}, initial_backoff = 0.01, max_backoff = 0.01 }}
close_timeout = 0.5

[routing]
unmatched = "drop"
"""


def child(action: str, config: Path) -> dict[str, object]:
    done = run_child("chdb_removed_child", action, str(config))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_rows_after_the_directory_was_removed_wait_in_the_spool_for_the_next_start(tmp_path):
    config = tmp_path / "router.toml"
    config.write_text(CONFIG.format(spool="outage", attempts=1))
    ran = child("run", config)
    assert ran["healthy"] is False, ran
    assert "was removed or replaced" in str(ran["reason"]), ran
    assert ran["failure"] is None and ran["spooled_bytes"], ran
    # The 64 records before the removal went with the directory; the 64 after
    # it are delivered once, by the next start, into the directory made again.
    recovered = child("recover", config)
    assert recovered == {"n": 64, "distinct": 64, "low": 64, "high": 127}


def test_without_a_spool_the_removed_directory_is_a_latched_failure_naming_it(tmp_path):
    config = tmp_path / "router.toml"
    config.write_text(CONFIG.format(spool="off", attempts=1))
    ran = child("run", config)
    data = tmp_path / "data"
    assert f"the chDB directory {data} was removed or replaced" in str(ran["failure"]), ran
    assert "flush_raised" in ran and "close_raised" in ran, ran


def test_a_sink_retrying_without_a_spool_shows_its_failed_attempts(tmp_path):
    """Without a spool a ClickHouse sink retries a failed insert within its
    Retry budget (25 s by default) before anything is latched; meanwhile
    /status and /metrics showed a destination with no error at all (healthy
    is null without a spool, errors counts only calls that raised).  Its
    failed attempts are now counted as they happen (insert_errors,
    taproute_destination_insert_errors_total)."""
    config = tmp_path / "router.toml"
    config.write_text(CONFIG.format(spool="off", attempts=1000))
    ran = child("retrying", config)
    assert ran["insert_errors_while_retrying"] >= 3 and ran["failure"] is None, ran
