"""A rerouted dead letter survives SIGKILL: the copy of a letter an operator
rerouted is on disk (parked, in the same transaction that marks the letter
rerouted) before the route takes it, so a process killed while the route
processes the copy delivers it after the restart, exactly once.  Before, the
letter was marked ``rerouted`` and the copy lived only in memory: a crash
lost the record while the letter said it had been handled."""

from __future__ import annotations

import json
import signal
import subprocess

from taproute.service.ops.dead_letters import DeadLetterStore
from tests.children import run_child

RECORDS, FAILING = 1728, 192  # tests/park_crash_child.py's records and the malformed ones


def child(*args: str) -> subprocess.CompletedProcess[str]:
    return run_child("park_reroute_child", *args)


def test_a_copy_killed_in_its_route_is_delivered_once_after_restart(tmp_path):
    produced = child("produce", str(tmp_path))
    assert produced.returncode == -signal.SIGKILL, produced.stderr
    lines = produced.stdout.splitlines()
    assert f"letters {FAILING}" in lines
    _, letter_id, seq = next(line for line in lines if line.startswith("rerouting ")).split()
    recovered = child("recover", str(tmp_path))
    assert recovered.returncode == 0, recovered.stderr
    found = json.loads(recovered.stdout.splitlines()[-1])
    store = DeadLetterStore(tmp_path / "chdb-dead-letters.sqlite", create=False)
    letter = store.get(int(letter_id))
    assert letter.state == "rerouted" and letter.reroute_id is not None
    # The copy was delivered after the restart: its row is in ClickHouse once,
    # every other record is in ClickHouse or still a dead letter, none twice.
    assert found["twice"] == [] and found["in_both"] == 0
    assert found["covered"] == RECORDS
    assert (found["rows"], found["letters"]) == (RECORDS - FAILING + 1, FAILING - 1)
    assert int(seq) not in {x.seq for x in store.list(limit=10**6)}
    assert found["parked_left"] == 0
    assert found["report"]["routes"]["norms"]["restored"] == 1
