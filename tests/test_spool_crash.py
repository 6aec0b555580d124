"""Real processes killed with SIGKILL while routing into chDB through a spool
(``spool="always"``): every acknowledged record ends up in ClickHouse exactly
once after a restart."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from tests.children import run_child


def child(*args: str) -> subprocess.CompletedProcess[str]:
    return run_child("spool_crash_child", *args)


def acked(out: str) -> int:
    """The highest acknowledged seq a producer printed (-1: none)."""
    acks = [int(line.split()[1]) for line in out.splitlines() if line.startswith("ack ")]
    return max(acks, default=-1)


@pytest.mark.parametrize("kill_at", ["append", "insert"])
def test_killed_mid_append_or_mid_insert_recovers_every_acknowledged_record_once(tmp_path, kill_at):
    chdb, spool = str(tmp_path / "chdb"), str(tmp_path / "spool")
    produced = child("produce", chdb, spool, kill_at, "0", "8")
    assert produced.returncode == -signal.SIGKILL, produced.stderr
    last = acked(produced.stdout)
    assert last >= 7  # at least two batches were acknowledged before the kill

    recovered = child("recover", chdb, spool, "none")
    assert recovered.returncode == 0, recovered.stderr
    counts = json.loads(recovered.stdout.splitlines()[-1])
    assert counts["n"] == counts["u"]  # no record twice
    assert counts["lo"] == 0 and counts["hi"] >= last  # every acknowledged one
    assert counts["u"] == counts["hi"] + 1  # and no gap
    if kill_at == "append":
        # The torn third frame was never acknowledged: recovery truncates it.
        assert last == 7 and counts["n"] == 8


def test_killed_mid_drain_after_an_outage_recovers_every_record_once(tmp_path):
    chdb, spool = str(tmp_path / "chdb"), str(tmp_path / "spool")
    produced = child("produce", chdb, spool, "unreachable", "0", "6")
    assert produced.returncode == -signal.SIGKILL, produced.stderr
    assert acked(produced.stdout) == 23  # all six batches durable while unreachable

    draining = child("recover", chdb, spool, "drain")
    assert draining.returncode == -signal.SIGKILL, draining.stderr

    recovered = child("recover", chdb, spool, "none")
    assert recovered.returncode == 0, recovered.stderr
    assert json.loads(recovered.stdout.splitlines()[-1]) == {"n": 24, "u": 24, "lo": 0, "hi": 23}
