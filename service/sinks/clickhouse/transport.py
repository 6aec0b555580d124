"""The two ways to reach ClickHouse: chDB in-process, or a server through
clickhouse-connect.  Everything above this (batching, schema checks,
retries, counters) is shared; only these few calls differ.

Transport methods block; the sink calls them from worker threads, never on
the Trio loop.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol
from urllib.parse import parse_qs, urlsplit

import attrs
import pyarrow as pa

from taproute.routing.errors import ConfigError
from taproute.service.sinks.clickhouse.reach import NotReached, probe
from taproute.service.sinks.clickhouse.scratch import (
    SCRATCH_READ_SETTINGS,
    ArrowScratch,
    scratch_files_work,
)
from taproute.service.sinks.clickhouse.transient import classify, error_code, http_status

#: Seconds a server has to answer before it counts as unreachable (TCP
#: connect, TLS handshake and the first byte of an answer, all together), and
#: clickhouse-connect's ``connect_timeout`` for each connection its client
#: opens, unless the URL sets ``?connect_timeout=``.  clickhouse-connect's own
#: default is 10 s per try, two tries.
DEFAULT_CONNECT_TIMEOUT = 5


class Transport(Protocol):
    """What a ClickHouse sink needs from a connection."""

    #: Where the data lives, for messages ("chDB at ./taproute-data", a URL).
    description: str

    @property
    def table_settings(self) -> Mapping[str, int]:
        """MergeTree settings a table created here gets besides its
        deduplication window (``TableSpec.create_sql``)."""
        ...

    def describe(self, table: str) -> list[tuple[str, str]] | None:
        """``(name, type)`` of each column of ``table``, or None if it does not exist."""
        ...

    def execute(self, sql: str) -> None:
        """Run a statement (DDL)."""
        ...

    def insert(
        self,
        table: str,
        data: pa.Table,
        *,
        dedup_token: str,
        settings: Mapping[str, int] | None = None,
    ) -> None:
        """Insert ``data`` into ``table``; a repeat with the same token is not written
        twice.  ``settings``: more query-level settings for this insert."""
        ...

    def query(self, sql: str) -> pa.Table:
        """Run a query and return its result as an Arrow table."""
        ...

    def is_transient(self, error: BaseException) -> bool:
        """True when retrying the same call may succeed."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


class ServerUnreachable(ConfigError):
    """A ClickHouse server that did not answer while a sink was being built
    (connection refused, no answer within the URL's ``connect_timeout``, DNS
    failure, TLS handshake failure).

    Known within ``connect_timeout`` seconds (default
    :data:`DEFAULT_CONNECT_TIMEOUT`; see :mod:`.reach`), not after the
    driver's own retries.  A sink checks (or creates) its tables when it is
    built, and by default cannot without the server; one built with
    ``when_unreachable="check_later"`` (a spooling destination's) keeps this
    as the reason its tables wait.  Once built, an unreachable server is an
    outage: a spooling destination spools and retries, a plain sink retries
    within its ``Retry`` budget, then fails.  ``target`` is the server's
    description (its URL without credentials), ``reason`` the reason in a
    few words; the socket's or driver's exception is ``__cause__``.
    """

    def __init__(self, target: str, reason: str, *, doing: str = "connect") -> None:
        self.target = target
        self.reason = reason
        self.doing = doing
        super().__init__(f"cannot reach {target} (to {doing}): {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses from a writer process intact (not as a RuntimeError's text).
        return (_unreachable, (self.target, self.reason, self.doing, self.where))


def _unreachable(target: str, reason: str, doing: str, where: str | None) -> ServerUnreachable:
    error = ServerUnreachable(target, reason, doing=doing)
    error.where = where
    return error


#: urllib3 buries the reason in a long line; ``[Errno 111] Connection refused``
#: (or a resolver's ``[Errno -2] Name or service not known``) says it.
_ERRNO_REASON = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def connection_failure(error: BaseException) -> str | None:
    """The reason in a few words when ``error`` says the server could not be
    reached (a connection error, not an answer from ClickHouse), else None."""
    if error_code(error) is not None or http_status(error) is not None:
        return None  # the server (or a proxy before it) answered
    connection = isinstance(error, OSError)
    try:
        from clickhouse_connect.driver.exceptions import OperationalError

        connection = connection or isinstance(error, OperationalError)
    except ImportError:  # pragma: no cover - clickhouse-connect is a dependency
        pass
    if not connection:
        return None
    if isinstance(error, NotReached):
        return str(error)
    text = str(error)
    match = _ERRNO_REASON.search(text)
    if match:
        return match.group(1).strip()
    return (text.strip().splitlines() or [type(error).__name__])[0][:200]


def _is_unknown_table(error: BaseException) -> bool:
    text = str(error)
    return "UNKNOWN_TABLE" in text or "Code: 60." in text


class DirectoryGone(FileNotFoundError):
    """The chDB directory a transport opened was removed or replaced while it
    was open.  chDB goes on writing parts into directories it recreates, with
    no table metadata beside them: no later start finds those rows, so an
    insert is refused instead (an ``OSError``: transient, so a spool keeps
    the batches, and delivers them at the next start, into the directory
    opened again)."""


def _identity(path: Path) -> tuple[tuple[int, int], ...]:
    """The directory and its ``status`` file (the lock chDB holds while the
    directory is open, never made again by it until it opens the directory
    again): their device and inode numbers.  Raises ``OSError`` if the
    directory is gone."""
    found = [os.stat(path)]
    with contextlib.suppress(FileNotFoundError):
        found.append(os.stat(path / "status"))
    return tuple((stat.st_dev, stat.st_ino) for stat in found)


class _SharedSession:
    """chDB runs one embedded server per process, on one data directory at a
    time: transports on the same directory share one session (and its lock)."""

    lock = threading.Lock()
    path: Path | None = None
    session: Any = None
    users = 0
    query_lock = threading.Lock()

    @classmethod
    def acquire(cls, path: Path) -> Any:
        from chdb import session

        with cls.lock:
            if cls.session is not None and cls.path != path:
                raise ConfigError(
                    f"chDB already has {cls.path} open in this process and allows one data "
                    f"directory at a time; close every sink on it before opening {path}"
                )
            if cls.session is None:
                cls.session = session.Session(str(path))
                cls.path = path
            cls.users += 1
            return cls.session

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0 and cls.session is not None:
                cls.session.close()
                cls.session = None
                cls.path = None


#: What every insert into chDB runs with: its source (one Arrow table through
#: ``Python()``) is one stream, so a pipeline of one thread does the same work
#: without starting pool threads for each insert (about 1 ms of CPU an insert).
CHDB_INSERT_SETTINGS = "max_threads = 1"

#: Tables created on chDB merge parts less eagerly than ClickHouse's default
#: (``merge_selector_base`` 5): raw activation tables take large inserts
#: continuously, and each merge rewrites (decompresses, compresses, writes)
#: every byte of the parts it joins.  Measured over 60 inserts of 10 MB:
#: merge CPU down by about two thirds (by half over GPT-2 captures), at the
#: price of more parts waiting to merge (a dozen rather than a handful), far
#: below ``parts_to_delay_insert``.
CHDB_TABLE_SETTINGS: Mapping[str, int] = MappingProxyType({"merge_selector_base": 20})


class ChdbTransport:
    """The ClickHouse engine in this process (chDB), persisted to ``path``.

    Transports on one directory share its session for DDL and queries, whose
    calls are serialised (a chDB session serves one thread at a time).
    Inserts run on connections of their own to the same directory (chDB runs
    queries on separate connections in parallel), one per insert in flight,
    kept for the next insert: two blocks of a flush are written at once, not
    one after the other.

    An insert hands chDB its Arrow table through ``Python()`` (no copy
    before chDB's own), which holds the GIL for part of the read: about 1-2
    ms of a 10 MB insert, time a model's Python thread in this process may
    wait.  ``scratch_inserts=True`` hands it over as an Arrow IPC stream in
    an in-memory file instead (:mod:`.scratch`, Linux only), which chDB
    reads without the GIL, at the price of one more copy of each block
    (about 6 ms of CPU per 10 MB, outside the GIL).  Measured on a loaded
    2-core machine it halved the model thread's GIL waits but not its
    forward time (README, "Performance"), so it is not the default.
    ``scratch_inserts=None`` (the default) and False mean ``Python()``.
    """

    table_settings: ClassVar[Mapping[str, int]] = CHDB_TABLE_SETTINGS

    def __init__(
        self, path: str | Path = "taproute-data", *, scratch_inserts: bool | None = None
    ) -> None:
        self.path = Path(path).resolve()
        self.path.mkdir(parents=True, exist_ok=True)
        self.description = f"chDB at {self.path}"
        self._session = _SharedSession.acquire(self.path)
        self._identity = _identity(self.path)  # the directory opened (see DirectoryGone)
        self._lock = _SharedSession.query_lock
        self._closed = False
        self._idle: list[_InsertLane] = []  # insert connections not in use now
        self._opened: list[_InsertLane] = []  # every one, closed with the transport
        self._connections_lock = threading.Lock()
        if scratch_inserts:
            with self._lock:
                why_not = scratch_files_work(self._session)
            if why_not is not None:
                _SharedSession.release()
                raise ConfigError(
                    f"scratch_inserts=True, but chDB in this process cannot read an in-memory "
                    f"file (memfd_create and /proc/self/fd, Linux only) for "
                    f"{self.description}: {why_not}"
                )
        #: Whether inserts go through an in-memory Arrow IPC file (else ``Python()``).
        self.scratch_inserts = bool(scratch_inserts)

    def _connection(self) -> _InsertLane:
        """An insert connection nobody uses now (a new one if all are busy)."""
        with self._connections_lock:
            if self._closed:
                raise RuntimeError(f"{self.description} is closed")
            if self._idle:
                return self._idle.pop()
            from chdb import session

            lane = _InsertLane(
                session.Session(str(self.path)), ArrowScratch() if self.scratch_inserts else None
            )
            self._opened.append(lane)
            return lane

    def _give_back(self, lane: _InsertLane) -> None:
        with self._connections_lock:
            self._idle.append(lane)

    def describe(self, table: str) -> list[tuple[str, str]] | None:
        try:
            result = self.query(f"DESCRIBE TABLE `{table}`")
        except Exception as exc:
            if _is_unknown_table(exc):
                return None
            raise
        names = result.column("name").to_pylist()
        return list(zip(names, result.column("type").to_pylist(), strict=True))

    def execute(self, sql: str) -> None:
        with self._lock:
            self._session.query(sql)

    def insert(
        self,
        table: str,
        data: pa.Table,
        *,
        dedup_token: str,
        settings: Mapping[str, int] | None = None,
    ) -> None:
        columns = ", ".join(f"`{name}`" for name in data.column_names)
        extra = "".join(f", {name} = {int(value)}" for name, value in (settings or {}).items())
        query_settings = (
            f"SETTINGS insert_deduplicate = 1, insert_deduplication_token = '{dedup_token}', "
            f"{CHDB_INSERT_SETTINGS}{extra}"
        )
        self._check_directory()
        lane = self._connection()
        try:
            scratch = lane.scratch
            if scratch is None:
                # chDB's Python() table function reads the Arrow table named
                # here from this frame's locals: no serialisation, no per-row
                # work, but part of the read holds the GIL.
                arrow_input = data  # noqa: F841 - referenced by name in the SQL below
                lane.connection.query(
                    f"INSERT INTO `{table}` ({columns}) {query_settings} "
                    f"SELECT {columns} FROM Python(arrow_input)"
                )
                return
            scratch.write(data)
            try:
                lane.connection.query(
                    f"INSERT INTO `{table}` ({columns}) {query_settings}, {SCRATCH_READ_SETTINGS} "
                    f"SELECT {columns} FROM {scratch.source()}"
                )
            finally:
                scratch.clear()
        finally:
            self._give_back(lane)

    def _check_directory(self) -> None:
        """Raise :class:`DirectoryGone` unless the directory opened is still there."""
        try:
            same = _identity(self.path) == self._identity
        except OSError:
            same = False
        if not same:
            raise DirectoryGone(
                f"the chDB directory {self.path} was removed or replaced while this "
                "process had it open (rows inserted now would land where no start finds "
                "them); restart to open it again"
            )

    def query(self, sql: str) -> pa.Table:
        with self._lock:
            result = self._session.query(sql, "Arrow")
        payload = result.bytes()
        if not payload:
            return pa.table({})
        return pa.ipc.open_file(pa.BufferReader(payload)).read_all()

    def is_transient(self, error: BaseException) -> bool:
        # The same table of codes as a server (MEMORY_LIMIT_EXCEEDED,
        # TOO_MANY_PARTS may happen in-process too), plus OS-level trouble.
        return classify(error).retry

    def close(self) -> None:
        with self._connections_lock:
            if self._closed:
                return
            self._closed = True
            opened, self._opened, self._idle = self._opened, [], []
        try:
            for lane in opened:
                lane.close()
        finally:
            _SharedSession.release()


@attrs.frozen
class _InsertLane:
    """An insert connection, and the in-memory file its inserts are read
    from (None: inserts through ``Python()``)."""

    connection: Any
    scratch: ArrowScratch | None

    def close(self) -> None:
        try:
            self.connection.close()
        finally:
            if self.scratch is not None:
                self.scratch.close()


class ServerTransport:
    """A ClickHouse server through clickhouse-connect.

    Give a URL (``http://host:8123/db``, ``https://host:8443/db``) or a
    clickhouse-connect client.  With a URL, credentials not in it come from
    the ``CLICKHOUSE_USER`` and ``CLICKHOUSE_PASSWORD`` environment variables
    (as ``clickhouse-client`` reads them), so secrets stay out of config files;
    the URL's query parameters go to clickhouse-connect (``?verify=false``,
    ``?ca_cert=/path/ca.pem``, ``?connect_timeout=5``).

    One client serves every insert thread, without an HTTP session: a
    ClickHouse session runs one query at a time (SESSION_IS_LOCKED), and
    nothing this transport sends depends on session state (its settings go
    with each query).  A session-less client is thread-safe and shares one
    connection pool, where a client per thread would repeat the start-up
    queries and open a pool each.  A given client with a session is refused.

    Inserts send Arrow straight through (``insert_arrow``): columnar, no
    per-row Python.  Tables it creates get no settings beyond the
    deduplication window (the server's version, hence the settings it knows,
    is the user's).
    """

    table_settings: ClassVar[Mapping[str, int]] = MappingProxyType({})

    def __init__(self, client_or_url: Any, *, connect: bool = True) -> None:
        self._closed = False
        self._url: str | None = None
        self._client: Any = None
        self._connecting = threading.Lock()
        #: The last insert found no server (a connection error or no answer):
        #: the next asks first whether one answers (:func:`.reach.probe`).
        self._unanswered = False
        #: Seconds the server has to answer (see :data:`DEFAULT_CONNECT_TIMEOUT`).
        self.connect_timeout = DEFAULT_CONNECT_TIMEOUT
        if isinstance(client_or_url, str):
            self.description = f"ClickHouse server at {without_credentials(client_or_url)}"
            _check_scheme(client_or_url)
            self.connect_timeout = connect_timeout_of(client_or_url)
            self._url = client_or_url
            if not connect:  # see client: the first call that needs the server connects
                return
            try:  # clickhouse-connect's client asks the server for its settings now
                self._client = self._connect(client_or_url)
            except Exception as exc:
                reason = connection_failure(exc)
                if reason is None:
                    raise
                raise ServerUnreachable(self.description, reason) from exc
        else:
            self._client = client_or_url
            self.description = "ClickHouse server (clickhouse-connect client)"
            self._refuse_session(self._client, owned=False)

    @property
    def connected(self) -> bool:
        """Whether the client exists (always, unless built with ``connect=False``
        and no call has reached the server yet)."""
        return self._client is not None

    @property
    def client(self) -> Any:
        """The clickhouse-connect client.  Built with ``connect=False``, the first
        call connects (thread-safe); while the server can't be reached that
        raises the driver's error, which :meth:`is_transient` calls transient."""
        client = self._client
        if client is None:
            with self._connecting:
                if self._client is None:
                    assert self._url is not None
                    if self._closed:
                        raise ConfigError(f"the transport to {self.description} is closed")
                    self._client = self._connect(self._url)
                client = self._client
        return client

    def _connect(self, url: str) -> Any:
        # One bounded try first: the client's own start-up queries would wait
        # out its timeouts (two connection tries, or 300 s for an answer).
        probe(url, self.connect_timeout)
        client = _client_from_url(url)
        self._refuse_session(client, owned=True)
        return client

    def _refuse_session(self, client: Any, *, owned: bool) -> None:
        session = client.get_client_setting("session_id")
        if session:
            if owned:
                client.close()
            raise ConfigError(
                f"the clickhouse-connect client for {self.description} has an HTTP session "
                f"(session_id={session}), which runs one query at a time, and this sink "
                "inserts from several threads: create the client with "
                "autogenerate_session_id=False and no session_id, or give a URL"
            )

    def describe(self, table: str) -> list[tuple[str, str]] | None:
        try:
            result = self.client.query(f"DESCRIBE TABLE `{table}`")
        except Exception as exc:
            if _is_unknown_table(exc):
                return None
            raise
        return [(str(row[0]), str(row[1])) for row in result.result_rows]

    def execute(self, sql: str) -> None:
        self.client.command(sql)

    def insert(
        self,
        table: str,
        data: pa.Table,
        *,
        dedup_token: str,
        settings: Mapping[str, int] | None = None,
    ) -> None:
        query_settings: dict[str, Any] = {
            "insert_deduplicate": 1,
            "insert_deduplication_token": dedup_token,
            **(settings or {}),
        }
        if self._unanswered and self._url is not None:
            # The last call found no server: ask first, within connect_timeout,
            # rather than send the block to wait out send_receive_timeout again.
            probe(self._url, self.connect_timeout)
        try:
            self.client.insert_arrow(table, data, settings=query_settings)
        except Exception as exc:
            self._unanswered = connection_failure(exc) is not None
            raise
        self._unanswered = False

    @property
    def liveness_timeout(self) -> float | None:
        """``connect_timeout``: how long a call may go unanswered before
        :meth:`check_alive` asks whether the server is there at all (see
        :mod:`.liveness`); None for a given client (its URL is its own)."""
        return None if self._url is None else float(self.connect_timeout)

    def check_alive(self) -> None:
        """``GET /ping``, answered within ``connect_timeout`` (see :func:`.reach.probe`),
        or ``OSError``."""
        assert self._url is not None
        try:
            probe(self._url, self.connect_timeout)
        except OSError:
            self._unanswered = True  # the call it watched is abandoned: the next asks first
            raise

    def query(self, sql: str) -> pa.Table:
        result: pa.Table = self.client.query_arrow(sql)
        return result

    def is_transient(self, error: BaseException) -> bool:
        return classify(error).retry

    def close(self) -> None:
        with self._connecting:
            if not self._closed:
                self._closed = True
                if self._client is not None:
                    self._client.close()


def without_credentials(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def connect_timeout_of(url: str) -> int:
    """The URL's ``connect_timeout`` parameter (whole seconds >= 1, as
    clickhouse-connect takes it), else :data:`DEFAULT_CONNECT_TIMEOUT`;
    :class:`ConfigError` naming the value if it is not one."""
    values = parse_qs(urlsplit(url).query).get("connect_timeout")
    if not values:
        return DEFAULT_CONNECT_TIMEOUT
    value = values[-1]
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"connect_timeout in the ClickHouse URL must be whole seconds >= 1, found {value!r}"
        )
    return int(value)


def _check_scheme(url: str) -> None:
    if urlsplit(url).scheme not in ("http", "https"):
        raise ConfigError(f"ClickHouse server URL must start with http:// or https://, got {url!r}")


def _client_from_url(url: str) -> Any:
    """A session-less clickhouse-connect client for ``url``; credentials missing
    from the URL come from CLICKHOUSE_USER / CLICKHOUSE_PASSWORD."""
    import clickhouse_connect

    parts = urlsplit(url)
    _check_scheme(url)
    username = None if parts.username is not None else os.environ.get("CLICKHOUSE_USER")
    password = None if parts.password is not None else os.environ.get("CLICKHOUSE_PASSWORD")
    # The scheme is passed on explicitly: clickhouse-connect infers TLS from the
    # port alone (443/8443), so https://host:9440 would otherwise speak plain HTTP.
    return clickhouse_connect.get_client(
        dsn=url,
        interface=parts.scheme,
        username=username,
        password=password or "",
        autogenerate_session_id=False,
        connect_timeout=DEFAULT_CONNECT_TIMEOUT,  # the URL's own wins
    )
