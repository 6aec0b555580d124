"""A child process for tests/test_spool_crash.py: routes into chDB through a
spool (``spool="always"``), and kills itself with SIGKILL at a chosen point.

    python -m tests.spool_crash_child produce CHDB SPOOL KILL_AT FIRST_SEQ BATCHES
    python -m tests.spool_crash_child recover CHDB SPOOL KILL_AT

``produce`` prints ``ack N`` after each ``flush()`` (records with seq <= N
are acknowledged: durable in the spool).  ``recover`` delivers what the spool
holds, then prints the table's count, distinct seqs and seq range as JSON.
KILL_AT: ``append`` (half-way through writing the 3rd frame), ``insert``
(right after the 3rd insert, of a group of one or two frames, is stored,
before it is acknowledged),
``drain`` (after the 1st insert of a recovery is stored, before it is
acknowledged: how the spool's frames were grouped depends on when the
outage's first try recorded its group, so a recovery may have one insert
only), ``unreachable`` (ClickHouse
refuses every insert; killed after the last ack), or ``none``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import trio

from taproute.routing import HookRegistry
from taproute.service.sinks.clickhouse import ChdbTransport, ClickHouseSink
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool import log as spool_log
from taproute.service.sinks.spool.files import write_all
from taproute.service.sinks.spool.spooling import Backoff, SpoolingSink
from tests.conftest import vec_batch
from tests.processors import SCHEMA


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill_at: str) -> None:
    if kill_at == "append":
        real_frame = spool_log.write_frame
        frames = {"n": 0}

        def write_frame(fd: int, buffers: list[memoryview]) -> None:
            frames["n"] += 1
            if frames["n"] == 3:  # half of the third frame reaches the file
                data = b"".join(bytes(b) for b in buffers)
                write_all(fd, data[: len(data) // 2])
                die()
            real_frame(fd, buffers)

        spool_log.write_frame = write_frame  # type: ignore[assignment]
    real_insert = ChdbTransport.insert
    inserts = {"n": 0}

    def insert(self, table, data, *, dedup_token, settings=None):  # type: ignore[no-untyped-def]
        if kill_at == "unreachable":
            raise ConnectionRefusedError("ClickHouse unreachable (injected)")
        real_insert(self, table, data, dedup_token=dedup_token, settings=settings)
        inserts["n"] += 1
        if (kill_at == "insert" and inserts["n"] == 3) or (
            kill_at == "drain" and inserts["n"] == 1
        ):
            die()

    ChdbTransport.insert = insert  # type: ignore[method-assign]


def open_sink(chdb: str, spool: str) -> SpoolingSink:
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    inner = ClickHouseSink.embedded(SCHEMA, chdb, raw=["vec"], hooks=hooks)
    return SpoolingSink(
        "ch",
        inner,
        Spool.open(SpoolConfig(directory=spool)),
        mode="always",
        backoff=Backoff(initial=0.01, maximum=0.05),
    )


async def produce(sink: SpoolingSink, first: int, batches: int, kill_at: str) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(batches):
            start = first + i * 4
            await sink.submit(vec_batch(0, 4, seq_start=start))
            await sink.flush()
            print(f"ack {start + 3}", flush=True)
            if kill_at == "insert" and i % 2:
                # Drain groups what queued; waiting every other batch makes
                # groups of one or two frames, so a third insert comes.
                await sink.wait_delivered()
        if kill_at == "unreachable":
            die()
        await sink.close()


async def recover(sink: SpoolingSink) -> dict[str, int]:
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await sink.wait_delivered()
        inner = sink.inner
        assert isinstance(inner, ClickHouseSink)
        row = inner.query(
            "SELECT count() AS n, uniqExact(seq) AS u, min(seq) AS lo, max(seq) AS hi FROM raw_vec"
        ).to_pylist()[0]
        await sink.close()
    return {k: int(v) for k, v in row.items()}


def main() -> None:
    command, chdb, spool, kill_at, *rest = sys.argv[1:]
    arm(kill_at)
    sink = open_sink(chdb, spool)
    if command == "produce":
        trio.run(produce, sink, int(rest[0]), int(rest[1]), kill_at)
        return
    print(json.dumps(trio.run(recover, sink)), flush=True)


if __name__ == "__main__":
    main()
