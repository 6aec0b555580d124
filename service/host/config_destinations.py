"""A config file's ClickHouse destinations: what ``[destinations.NAME]`` holds,
what can be checked without touching anything, and opening one with every
failure reported against its key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import string
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import attrs

from taproute.routing.checks import Limit
from taproute.routing.errors import TaprouteError
from taproute.routing.schema import RecordSchema
from taproute.routing.sink import RecordSink
from taproute.service.host.config_rules import ConfigFileError, add_limits
from taproute.service.ops.dead_letters import DeadLetterStore
from taproute.service.sinks.clickhouse import Batching, ClickHouseSink, Retry, ServerUnreachable
from taproute.service.sinks.clickhouse.transport import connect_timeout_of, without_credentials
from taproute.service.sinks.spool import Spool, SpoolConfig
from taproute.service.sinks.spool.dead_letters import destination_dead_letters
from taproute.service.sinks.spool.log import check_free
from taproute.service.sinks.spool.spooling import SpoolingSink
from taproute.service.sinks.writer import WriterProcessSink

#: What a table template must format to: a plain identifier (it is quoted with
#: backticks in SQL, so a backtick or an unknown ``{field}`` would break it).
_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@attrs.frozen(kw_only=True)
class DestinationConfig:
    """A ClickHouse destination: ``path`` (chDB directory) or ``url`` (server),
    the layouts it stores raw and as processed rows, table name templates
    (``{layout}`` is the layout's name), the sink's batching and retry, and
    ``require_deduplication`` (false: opt into at-least-once on tables
    without a deduplication window).

    ``spool`` (``"outage"``, default; ``"always"``; ``"off"``) and the
    ``spool_*`` keys set the destination's disk spool (see the README, "When
    a destination is down"); a batch the destination refuses, or the
    ``dead_letter`` quota policy sheds, goes to the config's dead-letter
    store; ``spool_dir`` defaults to ``<path>-spool/<name>``
    beside a chDB directory, ``taproute-spool/<name>`` beside the file for a
    server.

    ``writer = "process"`` runs the destination's inserts in a writer process
    (:class:`~taproute.service.sinks.writer.WriterProcessSink`), with the same
    spool modes: the spool stays in this process and drains into the writer."""

    path: str | None = None
    url: str | None = None
    raw: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    create_tables: bool | None = None
    require_deduplication: bool = True
    raw_table: str = "raw_{layout}"
    rows_table: str = "{layout}"
    batching: Batching = attrs.Factory(Batching)
    retry: Retry = attrs.Factory(Retry)
    spool: Literal["outage", "always", "off"] = "outage"
    spool_dir: str | None = None
    spool_quota_bytes: int = 1 << 30
    spool_fsync: Literal["flush", "interval", "batch"] = "flush"
    spool_fsync_interval: float = 1.0
    spool_when_full: Literal["block", "drop_newest", "dead_letter"] = "block"
    spool_block_timeout: float | None = None
    writer: Literal["thread", "process"] = "thread"
    #: Seconds close() waits for the inserts in flight (``ClickHouseSink``'s
    #: ``close_timeout``); with a writer process, its ``flush_timeout``: how
    #: long a spool's flush waits for the writer's inserts before it takes
    #: them over.
    close_timeout: float = 10.0

    def spool_directory(self, base: Path, name: str) -> Path:
        """Where this destination's spool lives (relative paths are relative to ``base``)."""
        if self.spool_dir is not None:
            path = Path(self.spool_dir)
            return path if path.is_absolute() else base / path
        data = self.path_under(base)
        if data is not None:
            return data.with_name(data.name + "-spool") / name
        return base / "taproute-spool" / name

    def path_under(self, base: Path) -> Path | None:
        """``path``, relative to ``base`` unless absolute."""
        if self.path is None:
            return None
        path = Path(self.path)
        return path if path.is_absolute() else base / path


# Bounds of the destination's numbers, checked while the file is read, so
# they are reported beside every other problem of the same table (checked
# afterwards, a bad key next to them hid them).
add_limits(
    DestinationConfig,
    {
        "spool_quota_bytes": Limit(1, 2**50),
        "spool_fsync_interval": Limit(0.001, 3600),
        "spool_block_timeout": Limit(0, 86_400),
        "close_timeout": Limit(0, 86_400),
    },
)


def _template_problem(template: str) -> str | None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"not a valid template ({exc})"
    unknown = [f for f in fields if f != "layout"]
    if unknown:
        return f"unknown field {{{unknown[0]}}} (the only field is {{layout}})"
    return None


def destination_problems(name: str, dest: DestinationConfig, layouts: set[str]) -> Iterator[str]:
    """Problems of ``[destinations.NAME]`` found without opening anything."""
    where = f"destinations.{name}"
    if (dest.path is None) == (dest.url is None):
        yield f"{where}: give exactly one of path (chDB) or url (server)"
    if dest.url is not None:
        try:
            url = urllib.parse.urlsplit(dest.url)
            url.port  # noqa: B018 - raises on a port outside 0..65535
        except ValueError as exc:
            yield f"{where}.url: not a valid URL: {exc}"
        else:
            if url.scheme not in ("http", "https") or not url.hostname:
                shown = without_credentials(dest.url)
                yield f"{where}.url: expected http(s)://host[:port][/database], found {shown!r}"
            try:
                connect_timeout_of(dest.url)
            except TaprouteError as exc:
                yield f"{where}.url: {exc}"
    if dest.path == "":
        yield f"{where}.path: empty"
    for key, names in (("raw", dest.raw), ("rows", dest.rows)):
        for i, layout in enumerate(names):
            if layout not in layouts:
                yield f"{where}.{key}[{i}]: unknown layout {layout!r}"
    for key, template, names in (
        ("raw_table", dest.raw_table, dest.raw),
        ("rows_table", dest.rows_table, dest.rows),
    ):
        problem = _template_problem(template)
        if problem is not None:
            yield f"{where}.{key}: {template!r}: {problem}"
            continue
        for layout in names:
            table = template.format(layout=layout)
            if not _TABLE_NAME.match(table):
                yield (
                    f"{where}.{key}: table name {table!r} (for layout {layout!r}) must be "
                    "letters, digits and underscores, not starting with a digit"
                )
                break


def prepare_directory(source: Path, path: Path, where: str) -> None:
    """Create directory ``path`` if missing; raise :class:`ConfigFileError` naming
    ``where`` if it can't be (under a regular file, in /proc, not writable)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if isinstance(exc, FileExistsError):
            reason = "exists and is not a directory"
        raise ConfigFileError(
            source, [f"{where}: cannot create directory {path}: {reason}"]
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigFileError(source, [f"{where}: directory {path} is not writable"])


def check_spool(source: Path, name: str, dest: DestinationConfig, *, running: bool) -> None:
    """Refuse, as :func:`spooled` would at start, a spool directory that cannot
    be made (a regular file, not writable) or, unless the file's service runs
    now (``running``: the spool is its own), one another sink holds."""
    if dest.spool == "off":
        return
    directory = dest.spool_directory(source.parent, name)
    where = f"destinations.{name}.spool_dir"
    prepare_directory(source, directory, where)
    if not running:
        try:
            check_free(directory)
        except OSError as exc:
            raise ConfigFileError(
                source, [f"{where}: cannot open spool {directory}: {exc}"]
            ) from None


def spooled(
    source: Path,
    name: str,
    dest: DestinationConfig,
    inner: ClickHouseSink | WriterProcessSink,
    dead_letters: DeadLetterStore | None = None,
) -> RecordSink:
    """``inner`` with its spool, per ``dest.spool`` (``"off"``: ``inner`` itself),
    refusals and quota dead letters going to ``dead_letters``.

    Opening the spool recovers it: unacknowledged batches a previous run left
    are delivered first, in order, once the sink runs; damage found (a torn
    last frame) is truncated and logged, never raised.
    """
    if dest.spool == "off":
        return inner
    directory = dest.spool_directory(source.parent, name)
    where = f"destinations.{name}.spool_dir"
    dead_letter = (
        None if dead_letters is None else destination_dead_letters(dead_letters.handle, name)
    )
    try:
        prepare_directory(source, directory, where)
        spool = Spool.open(
            SpoolConfig(
                directory=directory,
                quota_bytes=dest.spool_quota_bytes,
                fsync=dest.spool_fsync,
                fsync_interval=dest.spool_fsync_interval,
                when_full=dest.spool_when_full,
                block_timeout=dest.spool_block_timeout,
            ),
            dead_letter=dead_letter,
        )
    except OSError as exc:  # unwritable, or held by another sink or process
        _close_unstarted(inner)
        raise ConfigFileError(source, [f"{where}: cannot open spool {directory}: {exc}"]) from None
    except BaseException:
        _close_unstarted(inner)
        raise
    for damage in spool.damage:
        logging.getLogger("taproute.spool").warning("destination %r: %s", name, damage)
    return SpoolingSink(
        name,
        inner,
        spool,
        mode=dest.spool,
        dead_letter=dead_letter,
        group_bytes=dest.batching.max_bytes,
    )


def _close_unstarted(sink: ClickHouseSink | WriterProcessSink) -> None:
    """Release a destination opened but never run (its writer process, or its transport)."""
    if isinstance(sink, WriterProcessSink):
        sink.close_unstarted()
    else:
        sink.transport.close()


def chdb_holder(data: Path) -> int | None:
    """The pid of another process holding chDB directory ``data`` (its ``status``
    file's lock, as listed in Linux's /proc/locks), or None."""
    try:
        status = (data / "status").stat()
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    for line in locks:
        fields = line.split()
        if len(fields) >= 6 and fields[5] == device and fields[4].isdigit():
            pid = int(fields[4])
            if pid != os.getpid():
                return pid
    return None


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def open_destination(
    source: Path,
    name: str,
    dest: DestinationConfig,
    schema: RecordSchema,
    path: Path | None,
    *,
    check_later: bool = False,
) -> ClickHouseSink | WriterProcessSink:
    """Open the sink of ``[destinations.NAME]`` (its tables checked, or created).

    Every failure (an unreachable server, a chDB directory another process
    holds, a table that doesn't match the schema) is a :class:`ConfigFileError`
    naming the file and the key.  With ``check_later`` (a spooled server
    destination of a starting service), an unreachable server is not a
    failure: its tables are checked when it is first reached.
    """
    where = f"destinations.{name}"
    options: dict[str, object] = {
        "raw": list(dest.raw),
        "rows": list(dest.rows),
        "raw_table": dest.raw_table,
        "rows_table": dest.rows_table,
        "batching": dest.batching,
        "retry": dest.retry,
        "require_deduplication": dest.require_deduplication,
    }
    if dest.create_tables is not None:
        options["create_tables"] = dest.create_tables
    try:
        if path is not None:
            prepare_directory(source, path, f"{where}.path")
            holder = chdb_holder(path)
            if holder is not None:  # chDB would print to stderr, then fail
                raise ConfigFileError(
                    source,
                    [f"{where}.path: cannot open chDB at {path}: in use by process {holder}"],
                )
            if dest.writer == "process":
                return WriterProcessSink.embedded(
                    schema, path, flush_timeout=dest.close_timeout, **options
                )
            return ClickHouseSink.embedded(
                schema, path, close_timeout=dest.close_timeout, **options
            )
        if dest.writer == "process":
            assert dest.url is not None
            return WriterProcessSink.server(
                schema, dest.url, flush_timeout=dest.close_timeout, **options
            )
        options["close_timeout"] = dest.close_timeout
        if check_later:
            options["when_unreachable"] = "check_later"
        with _quiet("clickhouse_connect"):  # its log line would repeat our one-line error
            return ClickHouseSink.server(schema, dest.url, **options)
    except ConfigFileError:
        raise
    except ServerUnreachable as exc:
        assert dest.url is not None
        raise ConfigFileError(
            source, [f"{where}.url: cannot open {without_credentials(dest.url)}: {exc.reason}"]
        ) from None
    except TaprouteError as exc:
        raise ConfigFileError(source, [f"{where}: {exc}"]) from None
    except Exception as exc:  # a driver's error: say where, in one line
        key, target = (
            ("path", f"chDB at {path}")
            if path is not None
            else ("url", without_credentials(dest.url or ""))
        )
        detail = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConfigFileError(
            source, [f"{where}.{key}: cannot open {target}: {type(exc).__name__}: {detail}"]
        ) from None
