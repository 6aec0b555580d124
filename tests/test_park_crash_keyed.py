"""Keyed records parked for a retry survive SIGKILL in their order (issue #12):
a stateful route's failing key holds its later records behind the failing one;
all of them are in the park store when ``flush()`` returns; after a SIGKILL and
a restart they are processed once each, in arrival order per key."""

from __future__ import annotations

import json
import signal
import subprocess

from tests.children import run_child


def child(*args: str) -> subprocess.CompletedProcess[str]:
    return run_child("park_keyed_child", *args)


def test_a_failing_keys_parked_records_survive_sigkill_in_key_order(tmp_path):
    produced = child("produce", str(tmp_path))
    assert produced.returncode == -signal.SIGKILL, produced.stderr
    # Every record acknowledged; key 3's 64 records parked (1 failing, 63 behind it).
    assert "ack 1023 parked 64" in produced.stdout.splitlines()

    recovered = child("recover", str(tmp_path))
    assert recovered.returncode == 0, recovered.stderr
    rows = json.loads(recovered.stdout.splitlines()[-1])
    seqs = sorted(seq for _, seq, _ in rows)
    assert seqs == list(range(1024))  # every record once
    # Key 3's records were processed after the restart, in arrival order: the
    # n-th of them (by seq) is its key's n-th record.
    key3 = sorted((seq, count) for key, seq, count in rows if key == 3)
    assert [count for _, count in key3] == list(range(1, 65))
