"""The dead-letter store: records a route gave up on, durable in SQLite.

Each record is one row: its descriptor and payload (so it can be fed through
routing again), the route, failure code, error text, traceback, attempts and
first/last failure time.  Operators list and show them, *skip* them (handled,
never retried) or *reroute* them (a copy, with its own id, goes to the
route(s) that failed it; at most once per letter; a skipped letter stays
skipped).  The file survives
restarts; writes happen in worker threads, never on the Trio loop.

A store another holder keeps locked (an operator's ``sqlite3`` session in a
transaction, a ``taproute dead-letters`` command, a backup) is transient:
each attempt waits SQLite's busy timeout (``busy_timeout``, 5 s) in its
worker thread, and a write that found the file locked is tried again with
bounded backoff (:meth:`DeadLetterStore.call`) while its records wait in
their route; the store reports itself unavailable meanwhile
(:meth:`DeadLetterStore.store_status`).  Only a lock that outlasts
``lock_bound`` (300 s by default) fails the write.
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, TypeVar

import attrs
import trio

from taproute.actors.counters import StoreCounters
from taproute.routing.errors import RerouteRefused, TaprouteError
from taproute.routing.failures import RecordFailure
from taproute.routing.hooks import HookRegistry

State = Literal["dead", "skipped", "rerouted"]

T = TypeVar("T")

#: Seconds one attempt waits for a lock another connection holds (SQLite's
#: busy timeout), in its worker thread.
BUSY_TIMEOUT_S = 5.0

#: Seconds a write waits out a locked store (attempt after attempt) before it
#: fails; the failure handler's error is then latched.
LOCK_BOUND_S = 300.0

#: Backoff between attempts on a locked store: from this, doubling, capped.
_LOCK_BACKOFF_S = 0.05
_LOCK_BACKOFF_MAX_S = 2.0


def is_locked(exc: BaseException) -> bool:
    """True for SQLite's "another connection holds the lock" errors
    (``SQLITE_BUSY``, ``SQLITE_LOCKED``): transient, unlike a damaged,
    read-only or full file."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)  # pragma: no cover - old sqlite3


_SCHEMA = """
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    route TEXT NOT NULL,
    processor TEXT,
    code TEXT NOT NULL,
    error TEXT NOT NULL,
    traceback TEXT,
    attempts INTEGER NOT NULL,
    first_failure_at REAL NOT NULL,
    last_failure_at REAL NOT NULL,
    hook TEXT NOT NULL,
    layout_id INTEGER NOT NULL,
    key INTEGER NOT NULL,
    step INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    timestamp_ns INTEGER NOT NULL,
    payload BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'dead',
    handled_at REAL,
    generation INTEGER
);
CREATE INDEX IF NOT EXISTS dead_letters_by_route ON dead_letters (route, code, state);
"""

#: Reroutes: each letter is rerouted at most once (``letter_id`` is unique);
#: the copy's own id is the row's ``id``.  A copy that failed again is a new
#: letter, linked to the original in ``copy_letters``.
_LINKS = """
CREATE TABLE IF NOT EXISTS reroutes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    letter_id INTEGER NOT NULL UNIQUE,
    routes TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS copy_letters (
    letter_id INTEGER PRIMARY KEY,
    reroute_of INTEGER NOT NULL
);
"""

_COLUMNS = (
    "id, route, processor, code, error, traceback, attempts, first_failure_at, "
    "last_failure_at, hook, layout_id, key, step, seq, timestamp_ns, state, handled_at"
)


_SELECT = (
    ", ".join(f"d.{name}" for name in _COLUMNS.split(", "))
    + ", r.id, r.routes, c.reroute_of, d.generation FROM dead_letters d"
    " LEFT JOIN reroutes r ON r.letter_id = d.id"
    " LEFT JOIN copy_letters c ON c.letter_id = d.id"
)


class DeadLetterNotFound(TaprouteError, LookupError):
    """No dead letter with that id."""


class DeadLetterStoreError(TaprouteError):
    """A dead-letter store is missing, unreadable, or not a dead-letter store."""


@attrs.frozen
class DeadLetter:
    """One given-up record and why (``payload`` only when asked for)."""

    id: int
    route: str
    processor: str | None
    code: str
    error: str
    traceback: str | None
    attempts: int
    first_failure_at: float
    last_failure_at: float
    hook: str
    layout_id: int
    key: int
    step: int
    seq: int
    timestamp_ns: int
    state: State
    handled_at: float | None
    #: The id of this letter's rerouted copy, and the route(s) it went to.
    reroute_id: int | None = None
    rerouted_to: str | None = None
    #: Set on a letter that is a rerouted copy which failed again: the original's id.
    reroute_of: int | None = None
    #: The configuration generation the record was last tried under (None: a
    #: letter written before generations were recorded, or by a plain sink).
    generation: int | None = None
    payload: bytes | None = None

    def summary(self) -> dict[str, object]:
        """JSON-able fields, without payload and traceback."""
        return {k: v for k, v in attrs.asdict(self).items() if k not in ("payload", "traceback")}


class DeadLetterStore:
    """Dead letters in one SQLite file (thread-safe; one connection, one lock).

    ``hooks`` names the hooks of the records it stores (the routing sink
    attaches its registry).  With ``create=False`` the file must already be a
    dead-letter store (operators' tools: a mistyped path is refused, not
    created); a missing, unreadable or foreign file raises
    :class:`DeadLetterStoreError` and is left as it was.

    ``busy_timeout``: seconds one attempt waits for a lock another connection
    holds; ``lock_bound``: seconds a write of the routes (:meth:`call`) keeps
    trying a locked store before it fails (``math.inf``: it never does).
    """

    def __init__(
        self,
        path: str | Path,
        hooks: HookRegistry | None = None,
        *,
        create: bool = True,
        busy_timeout: float = BUSY_TIMEOUT_S,
        lock_bound: float = LOCK_BOUND_S,
    ) -> None:
        for name, value in (("busy_timeout", busy_timeout), ("lock_bound", lock_bound)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or math.isnan(value)
                or value < 0
            ):
                raise ValueError(
                    f"DeadLetterStore {name}: expected seconds >= 0, found "
                    f"{type(value).__name__} {value!r}"
                )
        if math.isinf(busy_timeout):
            raise ValueError("DeadLetterStore busy_timeout: expected finite seconds, found inf")
        self.path = Path(path)
        self.hooks = hooks
        self.busy_timeout = float(busy_timeout)
        self.lock_bound = float(lock_bound)
        self._lock = threading.Lock()
        self._status = StoreCounters(str(self.path))
        if create:
            self._create()
            return
        if not self.path.is_file():
            raise DeadLetterStoreError(f"no dead-letter store at {self.path}")
        uri = f"{self.path.resolve().as_uri()}?mode=rw"
        try:
            self._db = sqlite3.connect(
                uri,
                uri=True,
                check_same_thread=False,
                isolation_level=None,
                timeout=self.busy_timeout,
            )
        except sqlite3.Error as exc:
            raise DeadLetterStoreError(f"{self.path}: unreadable store: {exc}") from None
        try:
            found = self._db.execute(
                "SELECT name FROM pragma_table_info('dead_letters')"
            ).fetchall()
        except sqlite3.Error as exc:
            self._db.close()
            raise DeadLetterStoreError(f"{self.path}: unreadable store: {exc}") from None
        missing = set(_COLUMNS.split(", ")) - {name for (name,) in found}
        if missing:
            self._db.close()
            raise DeadLetterStoreError(
                f"{self.path}: not a dead-letter store (no dead_letters table with "
                f"columns {', '.join(sorted(missing))})"
            )
        self._db.executescript(_LINKS)  # a store written before reroute links existed
        self._add_generation_column()
        self._identity = _identity(self.path)

    def _create(self) -> None:
        """Open the store, creating it (and its directory) if missing; a path that
        cannot be one (a directory, a file that is not SQLite, under a regular
        file) is refused naming it (sqlite3 alone said "unable to open database
        file"), and a file that is not SQLite is left as it was."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise DeadLetterStoreError(
                f"cannot open {self.path}: its directory cannot be made ({reason})"
            ) from None
        try:
            self._db = sqlite3.connect(
                str(self.path),
                check_same_thread=False,
                isolation_level=None,
                timeout=self.busy_timeout,
            )
        except sqlite3.Error as exc:
            raise DeadLetterStoreError(f"cannot open {self.path}: {exc}") from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._db.executescript(_LINKS)
            self._add_generation_column()
        except sqlite3.Error as exc:
            self._db.close()
            raise DeadLetterStoreError(f"cannot open {self.path}: {exc}") from None
        self._identity = _identity(self.path)

    def _add_generation_column(self) -> None:
        """A store written before generations were recorded gets the column (NULL there)."""
        found = self._db.execute("SELECT name FROM pragma_table_info('dead_letters')").fetchall()
        if "generation" not in {name for (name,) in found}:
            self._db.execute("ALTER TABLE dead_letters ADD COLUMN generation INTEGER")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._check_file()
                yield self._db
                # A COMMIT that fails (busy) leaves the transaction open:
                # rolled back below, so the next BEGIN (a retry) can start.
                self._db.execute("COMMIT")
            except BaseException:
                # SQLite rolls back by itself on some errors (SQLITE_FULL): a
                # second ROLLBACK would raise and hide the first error.
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _check_file(self) -> None:
        """Refuse to write once the file at ``path`` is not the one opened: a
        deleted (or replaced) file would take the writes into an unlinked
        inode and lose them when the process ends, while every count said
        they were kept."""
        if _identity(self.path) != self._identity:
            raise DeadLetterStoreError(
                f"dead-letter store {self.path} was deleted or replaced while open: "
                "nothing more is written to it (what is written would be lost with "
                "the process); restart to open a new store"
            )

    def attach_hooks(self, hooks: HookRegistry) -> None:
        """Name hooks from ``hooks`` (the routing sink calls this)."""
        self.hooks = hooks

    def put(self, failure: RecordFailure) -> list[int]:
        """Store every record of ``failure`` durably (one transaction); returns the ids.

        Records of a rerouted copy that failed again are linked to the
        original letter (``reroute_of``)."""
        with self._transaction() as db:
            return self.insert(db, failure)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The store's connection inside one ``BEGIN IMMEDIATE`` transaction, for
        a companion table kept in the same file (retry parking) to change
        together with the letters."""
        with self._transaction() as db:
            yield db

    def insert(self, db: sqlite3.Connection, failure: RecordFailure) -> list[int]:
        """:meth:`put`'s rows, inside the caller's :meth:`transaction`."""
        batch = failure.records
        desc = batch.descriptors
        names = self.hooks.names() if self.hooks is not None else []
        rows = []
        for i in range(len(batch)):
            output_id = int(desc["output_id"][i])
            rows.append(
                (
                    failure.route,
                    failure.processor,
                    failure.code.value,
                    f"{type(failure.error).__name__}: {failure.error}",
                    failure.traceback,
                    failure.attempts,
                    failure.first_failure_at,
                    failure.last_failure_at,
                    names[output_id] if output_id < len(names) else f"#{output_id}",
                    int(desc["layout_id"][i]),
                    int(desc["key"][i]),
                    int(desc["step"][i]),
                    int(desc["seq"][i]),
                    int(desc["timestamp_ns"][i]),
                    batch.payload_of(i).tobytes(),
                    failure.generation,
                )
            )
        first = db.execute("SELECT COALESCE(MAX(id), 0) FROM dead_letters").fetchone()[0]
        db.executemany(
            "INSERT INTO dead_letters (route, processor, code, error, traceback, attempts, "
            "first_failure_at, last_failure_at, hook, layout_id, key, step, seq, "
            "timestamp_ns, payload, generation) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        ids = list(range(first + 1, first + 1 + len(rows)))
        if failure.reroute_of is not None:
            db.executemany(
                "INSERT INTO copy_letters (letter_id, reroute_of) VALUES (?, ?)",
                [(i, failure.reroute_of) for i in ids],
            )
        return ids

    async def handle(self, failure: RecordFailure) -> None:
        """The routing sink's failure handler: store, in a worker thread,
        waiting out a locked store (:meth:`call`)."""
        await self.call(self.put, failure, records=len(failure.records))

    async def call(self, fn: Callable[..., T], *args: object, records: int = 0) -> T:
        """``fn(*args)``, a write to this store, in a worker thread; while the
        file is locked by another holder (each attempt waits ``busy_timeout``)
        it is tried again with backoff, and the store reports itself
        unavailable (:meth:`store_status`; ``records``: how many records wait
        in this write).  A lock that outlasts ``lock_bound`` raises
        :class:`DeadLetterStoreError` naming the file; any other error is raised
        at once."""
        started: float | None = None
        delay = _LOCK_BACKOFF_S
        status = self._status
        try:
            while True:
                try:
                    result = await trio.to_thread.run_sync(fn, *args)
                except sqlite3.OperationalError as exc:
                    if not is_locked(exc):
                        raise
                    now = trio.current_time()
                    status.locked_attempts += 1
                    if started is None:
                        started = now
                        status.locked_writes += 1
                        status.waiting_writes += 1
                        status.waiting_records += records
                    if status.available:
                        status.available = False
                        status.unavailable_since = time.time()
                    status.unavailable_reason = f"{type(exc).__name__}: {exc}"
                    waited = now - started
                    if waited >= self.lock_bound:
                        raise DeadLetterStoreError(
                            f"dead-letter store {self.path} stayed locked for {waited:.1f} s, "
                            f"past its lock_bound of {self.lock_bound:g} s ({exc}); "
                            f"{records} record(s) not written"
                        ) from None
                    await trio.sleep(min(delay, self.lock_bound - waited))
                    delay = min(2 * delay, _LOCK_BACKOFF_MAX_S)
                    continue
                if not status.available:  # it took a write: locked no more
                    status.available = True
                    status.unavailable_since = status.unavailable_reason = None
                return result
        finally:
            if started is not None:
                status.waiting_writes -= 1
                status.waiting_records -= records

    def store_status(self) -> StoreCounters:
        """Whether the store takes writes now, and what waited for it (a detached copy)."""
        return attrs.evolve(self._status)

    def list(
        self,
        *,
        route: str | None = None,
        code: str | None = None,
        older_than: float | None = None,
        state: State | None = "dead",
        limit: int = 1000,
    ) -> list[DeadLetter]:
        """Dead letters, oldest first, filtered by route, code, age (seconds) and state."""
        where: list[str] = []
        args: list[object] = []
        if route is not None:
            where.append("route = ?")
            args.append(route)
        if code is not None:
            where.append("code = ?")
            args.append(code)
        if older_than is not None:
            where.append("last_failure_at <= ?")
            args.append(time.time() - older_than)
        if state is not None:
            where.append("state = ?")
            args.append(state)
        sql = f"SELECT {_SELECT}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY d.id LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit)).fetchall()
        return [DeadLetter(*row) for row in rows]

    def get(self, letter_id: int) -> DeadLetter:
        """One dead letter, with its payload."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_SELECT.replace(' FROM', ', d.payload FROM', 1)} WHERE d.id = ?",
                (letter_id,),
            ).fetchone()
        if row is None:
            raise DeadLetterNotFound(f"no dead letter with id {letter_id} in {self.path}")
        return DeadLetter(*row)

    def skip(self, letter_id: int) -> DeadLetter:
        """Mark handled: it is never retried.  Only a dead letter can be skipped
        (a rerouted one was handled already); skipping twice changes nothing."""
        with self._transaction() as db:
            row = db.execute("SELECT state FROM dead_letters WHERE id = ?", (letter_id,)).fetchone()
            if row is None:
                raise DeadLetterNotFound(f"no dead letter with id {letter_id} in {self.path}")
            if row[0] == "rerouted":
                raise RerouteRefused(
                    f"dead letter {letter_id} was already rerouted; it cannot be skipped"
                )
            if row[0] == "dead":
                db.execute(
                    "UPDATE dead_letters SET state = 'skipped', handled_at = ? WHERE id = ?",
                    (time.time(), letter_id),
                )
        return self.get(letter_id)

    def claim_reroute(self, letter_id: int, routes: str) -> int:
        """Mark a *dead* letter rerouted to ``routes`` and give its copy an id (one
        transaction); a second reroute, or a reroute of a skipped letter, is refused."""
        with self._transaction() as db:
            return self.claim_reroute_in(db, letter_id, routes)

    def claim_reroute_in(self, db: sqlite3.Connection, letter_id: int, routes: str) -> int:
        """:meth:`claim_reroute` inside the caller's transaction on this file
        (the park store keeps the copy in the same one: a crash leaves the
        letter dead, or rerouted with its copy parked)."""
        row = db.execute("SELECT state FROM dead_letters WHERE id = ?", (letter_id,)).fetchone()
        if row is None:
            raise DeadLetterNotFound(f"no dead letter with id {letter_id} in {self.path}")
        if row[0] != "dead":
            done = db.execute(
                "SELECT id, routes FROM reroutes WHERE letter_id = ?", (letter_id,)
            ).fetchone()
            how = f" as copy {done[0]} to route(s) {done[1]}" if done else ""
            raise RerouteRefused(
                f"dead letter {letter_id} is {row[0]}{how}; a letter is rerouted at most "
                "once and a skipped one stays skipped: refused"
            )
        db.execute(
            "UPDATE dead_letters SET state = 'rerouted', handled_at = ? WHERE id = ?",
            (time.time(), letter_id),
        )
        cursor = db.execute(
            "INSERT INTO reroutes (letter_id, routes, at) VALUES (?, ?, ?)",
            (letter_id, routes, time.time()),
        )
        copy_id = cursor.lastrowid
        assert copy_id is not None
        return copy_id

    def unclaim_reroute(self, letter_id: int) -> None:
        """Undo :meth:`claim_reroute` when the copy could not be sent: the letter stays dead."""
        with self._transaction() as db:
            db.execute("DELETE FROM reroutes WHERE letter_id = ?", (letter_id,))
            db.execute(
                "UPDATE dead_letters SET state = 'dead', handled_at = NULL WHERE id = ?",
                (letter_id,),
            )

    def counts(self, *, older_than: float | None = None) -> dict[tuple[str, str], int]:
        """Dead (unhandled) letters per (route, code), optionally only the older ones."""
        sql = "SELECT route, code, count(*) FROM dead_letters WHERE state = 'dead'"
        args: tuple[float, ...] = ()
        if older_than is not None:
            sql += " AND last_failure_at <= ?"
            args = (time.time() - older_than,)
        with self._lock:
            rows = self._db.execute(sql + " GROUP BY route, code ORDER BY route, code", args)
            return {(route, code): n for route, code, n in rows.fetchall()}

    def close(self) -> None:
        """Close the database file."""
        with self._lock:
            self._db.close()


def _identity(path: Path) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode), or None when there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino
