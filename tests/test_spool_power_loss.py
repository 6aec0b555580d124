"""What a spool promises across a power loss (not only a process crash).

A power loss keeps only what was fsynced.  The ``intent`` (the group being
inserted now) is fsynced with its directory entry before the insert, so a
restart inserts the same group under the same token; an ``ack`` the fsync
policy had not synced yet is implied by the intent after it; a group whose
later frames never reached the disk replays what is left under the intended
group's token.  The files are set to the states a power loss can leave (an
older ``ack``, a segment cut after its last synced frame), then the spool is
reopened and its replay inserted into real chDB: nothing is written twice.
"""

from __future__ import annotations

import os
from pathlib import Path

from taproute.routing import HookRegistry
from taproute.service.sinks.spool import Spool, SpoolConfig
from tests.clickhouse_backends import Backend
from tests.conftest import vec_batch
from tests.processors import SCHEMA


async def fill(spool: Spool, frames: range) -> None:
    for i in frames:
        await spool.append(vec_batch(0, 2, seq_start=2 * i))


def clickhouse(chdb_transport):
    backend = Backend("chdb", chdb_transport)
    hooks = HookRegistry()
    hooks.bind("q", layout="vec")
    return backend, backend.sink(SCHEMA, raw=["vec"], hooks=hooks)


def stored(backend) -> tuple[int, int]:
    row = backend.query("SELECT count() AS n, uniqExact(seq) AS u FROM {p}_raw_vec").to_pylist()
    return int(row[0]["n"]), int(row[0]["u"])


def spy_fsync(monkeypatch) -> list[Path]:
    """Record the path of every file or directory fsynced from now on."""
    synced: list[Path] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


async def test_a_group_and_its_intent_are_durable_before_the_group_is_returned(
    tmp_path, monkeypatch
):
    spool = Spool.open(SpoolConfig(directory=tmp_path, fsync="flush"))
    await fill(spool, range(3))  # not synced: the flush policy syncs at flush()
    segment = spool.first().segment
    synced = spy_fsync(monkeypatch)
    group = await spool.read_group(1 << 20)
    monkeypatch.undo()
    # The frames, the segment's name; then the intent's bytes (written as
    # intent.tmp, then renamed) and the rename.
    assert synced == [segment, tmp_path, tmp_path / "intent.tmp", tmp_path]
    assert (group.first, group.seq) == (1, 3)
    await spool.aclose()


async def test_a_lost_ack_replays_only_the_intended_group_under_its_token(tmp_path, chdb_transport):
    backend, sink = clickhouse(chdb_transport)
    config = SpoolConfig(directory=tmp_path, fsync="flush")
    spool = Spool.open(config)
    await fill(spool, range(3))
    first = await spool.read_group(1 << 20)
    await sink.insert_now(first.batches, first.token)
    await spool.ack(first.seq)  # not synced yet: the flush policy syncs at flush()
    await fill(spool, range(3, 5))
    second = await spool.read_group(1 << 20)
    await sink.insert_now(second.batches, second.token)
    await spool.aclose()
    (tmp_path / "ack").unlink()  # the power went before the ack file was synced

    again = Spool.open(config)
    replay = await again.read_group(1 << 20)
    assert (replay.first, replay.seq, replay.token) == (4, 5, second.token)
    await sink.insert_now(replay.batches, replay.token)
    await again.ack(replay.seq)
    assert again.first() is None
    await again.aclose()
    assert stored(backend) == (10, 10)  # frames 1..5, two records each, once


async def test_every_ack_rename_is_made_durable_by_the_next_sync(tmp_path, monkeypatch):
    spool = Spool.open(SpoolConfig(directory=tmp_path, fsync="flush"))
    await fill(spool, range(2))
    await spool.sync()  # the new segment's name is durable: nothing else to sync
    group = await spool.read_group(1 << 20)
    await spool.ack(group.seq)
    synced = spy_fsync(monkeypatch)
    await spool.sync()  # what flush() does
    monkeypatch.undo()
    assert tmp_path / "ack" in synced and tmp_path in synced  # the file and its rename
    await spool.aclose()
