"""The model process SIGKILLed mid-stream while its chDB destination runs in a
writer process under ``spool = "always"`` (the README listed this test as
not yet written): every record a returned ``flush()`` acknowledged is in
ClickHouse exactly once after a restart, and no record twice.  Real
processes, killed from outside, at whatever point the stream is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
path = "data"
raw = ["vec"]
writer = "process"
spool = "always"

[routing]
unmatched = "drop"
"""


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.writer_spool_crash_child", *args]


def produce_and_kill(config: Path, first: int, acks: int) -> int:
    """Run a producer until it has printed ``acks`` acknowledgements, SIGKILL
    it (it goes on submitting meanwhile); the last seq it acknowledged."""
    child = subprocess.Popen(
        command("produce", str(config), str(first)),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked = -1
    try:
        assert child.stdout is not None
        seen = 0
        for line in child.stdout:  # blocks until the child prints (no sleeping)
            if line.startswith("ack "):
                acked, seen = int(line.split()[1]), seen + 1
                if seen == acks:
                    break
        os.kill(child.pid, signal.SIGKILL)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL, err[-3000:]
    acked = max([acked] + [int(x.split()[1]) for x in out.splitlines() if x.startswith("ack ")])
    assert acked >= first, err[-3000:]
    return acked


def test_killed_model_process_with_a_writer_and_an_always_spool_delivers_every_ack_once(
    tmp_path,
):
    config = tmp_path / "router.toml"
    config.write_text(CONFIG)
    acked = [(0, produce_and_kill(config, 0, acks=3))]
    acked.append((100_000, produce_and_kill(config, 100_000, acks=5)))  # restarted, killed again
    done = subprocess.run(
        command("recover", str(config)),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(done.stdout.splitlines()[-1])
    assert table["count"] == table["distinct"]  # nothing written twice
    seqs = set(table["seqs"])
    for first, last in acked:
        missing = sorted(set(range(first, last + 1)) - seqs)
        assert not missing, (first, last, missing[:10])
