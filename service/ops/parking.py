"""Parked records in the dead-letter store's SQLite file (a ``parked`` table).

:class:`ParkedRecordStore` is the service's
:class:`~taproute.routing.parking.ParkStore`: a record a route parks for a
retry (or holds behind a failing record of its key) is one row here, with
its descriptor, payload and failure history, until it is given up, discarded
or delivered.  Living in the dead-letter file, a give-up through
:meth:`ParkedRecordStore.handle` moves records from ``parked`` to
``dead_letters`` in one transaction: a crash leaves each record in exactly
one of them.  Writes are ``synchronous=FULL`` in WAL mode, like the letters.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from taproute.actors.counters import StoreCounters
from taproute.native import DESCRIPTOR_DTYPE
from taproute.routing.batch import RecordBatch
from taproute.routing.failures import RecordFailure
from taproute.routing.hooks import HookRegistry
from taproute.routing.parking import ParkIds, Parking, Restored
from taproute.service.ops.dead_letters import DeadLetterStore, DeadLetterStoreError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS parked (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run TEXT NOT NULL,
    route TEXT NOT NULL,
    grp INTEGER NOT NULL,
    code TEXT NOT NULL,
    error TEXT NOT NULL,
    failures INTEGER NOT NULL,
    first_failure_at REAL NOT NULL,
    last_failure_at REAL NOT NULL,
    parked_at REAL NOT NULL,
    descriptor BLOB NOT NULL,
    payload BLOB NOT NULL,
    hook TEXT
);
CREATE INDEX IF NOT EXISTS parked_by_route ON parked (route, id);
"""

#: Runs live in this process, per store file: restore never takes their records.
_LIVE: dict[Path, set[str]] = {}
_LIVE_LOCK = threading.Lock()

#: id, route, grp, failures, first_failure_at, last_failure_at, descriptor, payload, hook
_Row = tuple[int, str, int, int, float, float, bytes, bytes, str | None]

T = TypeVar("T")

_IN_CHUNK = 500  # ids per `IN (...)` (SQLite's variable limit is far above)


class ParkedRecordStore:
    """The park store in ``dead_letters``' file (see the module docstring).

    Hand it to the routing sink as ``park=`` and use :meth:`handle` as its
    failure handler, so give-ups of parked records are one transaction.
    """

    def __init__(self, dead_letters: DeadLetterStore) -> None:
        if not isinstance(dead_letters, DeadLetterStore):
            raise TypeError(
                "ParkedRecordStore keeps parked records in a dead-letter store's file: give "
                "the store (ParkedRecordStore(DeadLetterStore(path))), found "
                f"{type(dead_letters).__name__} {dead_letters!r:.60}"
            )
        self.dead_letters = dead_letters
        self._file = dead_letters.path.resolve()
        try:
            with dead_letters.transaction() as db:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                columns = {row[1] for row in db.execute("PRAGMA table_info(parked)")}
                if "hook" not in columns:  # a file from before hooks were named
                    db.execute("ALTER TABLE parked ADD COLUMN hook TEXT")
        except sqlite3.Error as exc:  # locked by another process, read-only, damaged
            raise DeadLetterStoreError(
                f"cannot keep parked records in {dead_letters.path}: {exc}"
            ) from None

    @property
    def hooks(self) -> HookRegistry | None:
        """The registry naming parked records' hooks (the dead-letter store's)."""
        return self.dead_letters.hooks

    def attach_hooks(self, hooks: HookRegistry) -> None:
        """Name hooks from ``hooks``, here and in the dead letters (the routing
        sink calls this): a parked record keeps its hook's name, so a restart
        that binds hooks in another order restores it under the same hook."""
        self.dead_letters.attach_hooks(hooks)

    # -- ParkStore -----------------------------------------------------------

    def park(self, run: str, parking: Parking) -> ParkIds:
        with self.dead_letters.transaction() as db:
            return self._insert(db, run, parking)

    @property
    def file(self) -> Path:
        """The SQLite file parked records (and the dead letters) are kept in."""
        return self._file

    def park_copy(
        self, run: str, parking: Parking, claim: Callable[[sqlite3.Connection], object]
    ) -> ParkIds:
        """Park a rerouted dead letter's copy in the transaction that ``claim``
        marks the letter rerouted in (``claim`` raising parks nothing): a crash
        leaves the letter dead, or rerouted with its copy parked for the next start."""
        with self.dead_letters.transaction() as db:
            claim(db)
            return self._insert(db, run, parking)

    def _insert(self, db: sqlite3.Connection, run: str, parking: Parking) -> ParkIds:
        batch = parking.records
        desc = np.ascontiguousarray(batch.descriptors)
        raw = desc.view(np.uint8).reshape(len(desc), DESCRIPTOR_DTYPE.itemsize)
        names = self.hooks.names() if self.hooks is not None else ()
        output_ids = desc["output_id"].tolist()
        now = time.time()
        first = db.execute("SELECT COALESCE(MAX(id), 0) FROM parked").fetchone()[0] + 1
        db.executemany(
            "INSERT INTO parked (id, run, route, grp, code, error, failures, "
            "first_failure_at, last_failure_at, parked_at, descriptor, payload, hook) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    first + i,
                    run,
                    parking.route,
                    first,
                    parking.code.value,
                    parking.error,
                    parking.failures,
                    parking.first_failure_at,
                    parking.last_failure_at,
                    now,
                    raw[i].tobytes(),
                    batch.payload_of(i).tobytes(),
                    names[output_ids[i]] if 0 <= output_ids[i] < len(names) else None,
                )
                for i in range(len(batch))
            ],
        )
        return np.arange(first, first + len(batch), dtype=np.int64)

    def failed_again(self, ids: ParkIds, failures: int, last_failure_at: float) -> None:
        with self.dead_letters.transaction() as db:
            for chunk in _chunks(ids):
                db.execute(
                    f"UPDATE parked SET failures = ?, last_failure_at = ? "
                    f"WHERE id IN ({_marks(chunk)})",
                    (failures, last_failure_at, *chunk),
                )

    def unpark(self, ids: Sequence[int] | ParkIds) -> None:
        with self.dead_letters.transaction() as db:
            _delete(db, ids)

    def restore(self, run: str, routes: Sequence[str]) -> list[Restored]:
        with _LIVE_LOCK:
            live = _LIVE.setdefault(self._file, set())
            others = sorted(live)
            live.add(run)
        if not routes:
            return []
        not_live = _marks(others) or "''"
        with self.dead_letters.transaction() as db:
            rows: list[_Row] = db.execute(
                "SELECT id, route, grp, failures, first_failure_at, last_failure_at, "
                f"descriptor, payload, hook FROM parked WHERE route IN ({_marks(routes)}) "
                f"AND run NOT IN ({not_live}) ORDER BY id",
                (*routes, *others),
            ).fetchall()
            for chunk in _chunks([row[0] for row in rows]):
                db.execute(
                    f"UPDATE parked SET run = ? WHERE id IN ({_marks(chunk)})", (run, *chunk)
                )
        groups: list[list[_Row]] = []
        for row in rows:
            if groups and (groups[-1][0][1], groups[-1][0][2]) == (row[1], row[2]):
                groups[-1].append(row)
            else:
                groups.append([row])
        return [_restored(group, self.hooks) for group in groups]

    def release(self, run: str) -> None:
        with _LIVE_LOCK:
            _LIVE.get(self._file, set()).discard(run)

    # -- the failure handler ------------------------------------------------------

    def handle_blocking(self, failure: RecordFailure) -> list[int]:
        """Store ``failure`` as dead letters and forget its parked ids, in one
        transaction; returns the letters' ids."""
        with self.dead_letters.transaction() as db:
            ids = self.dead_letters.insert(db, failure)
            if failure.parked:
                _delete(db, failure.parked)
        return ids

    async def handle(self, failure: RecordFailure) -> None:
        """The routing sink's failure handler (in a worker thread, waiting out a
        locked file: :meth:`DeadLetterStore.call`)."""
        await self.dead_letters.call(self.handle_blocking, failure, records=len(failure.records))

    def call(self, fn: Callable[..., T], *args: object, records: int = 0) -> Awaitable[T]:
        """The dead-letter store's :meth:`~DeadLetterStore.call` (the same
        file, the same lock): the routes' park store writes wait out a lock."""
        return self.dead_letters.call(fn, *args, records=records)

    def store_status(self) -> StoreCounters:
        """The file's status (the dead-letter store's)."""
        return self.dead_letters.store_status()

    def count(self, route: str | None = None) -> int:
        """Records parked now (on ``route``, or all)."""
        with self.dead_letters.transaction() as db:
            if route is None:
                return int(db.execute("SELECT count(*) FROM parked").fetchone()[0])
            return int(
                db.execute("SELECT count(*) FROM parked WHERE route = ?", (route,)).fetchone()[0]
            )


def _restored(group: list[_Row], hooks: HookRegistry | None) -> Restored:
    ids = np.array([row[0] for row in group], dtype=np.int64)
    descriptors = np.frombuffer(b"".join(row[6] for row in group), dtype=DESCRIPTOR_DTYPE).copy()
    if hooks is not None:  # output ids are per process: this one's for the names kept
        for i, row in enumerate(group):
            if row[8] is not None:
                now = hooks.id_of(row[8])
                descriptors["output_id"][i] = hooks.bind(row[8]) if now is None else now
    payloads = [row[7] for row in group]
    lengths = np.array([len(p) for p in payloads], dtype=np.int64)
    offsets = np.zeros(len(group), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    descriptors["offset"] = offsets
    payload = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    head = group[0]
    return Restored(
        route=str(head[1]),
        records=RecordBatch.from_buffer(descriptors, payload),
        ids=ids,
        failures=int(head[3]),
        first_failure_at=float(head[4]),
        last_failure_at=float(head[5]),
    )


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" * len(values))


def _chunks(ids: Sequence[int] | ParkIds) -> list[list[int]]:
    values = [int(i) for i in ids]
    return [values[i : i + _IN_CHUNK] for i in range(0, len(values), _IN_CHUNK)]


def _delete(db: sqlite3.Connection, ids: Sequence[int] | ParkIds) -> None:
    for chunk in _chunks(ids):
        db.execute(f"DELETE FROM parked WHERE id IN ({_marks(chunk)})", chunk)


__all__ = ["ParkedRecordStore"]
