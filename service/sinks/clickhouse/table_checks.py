"""A ClickHouse sink's tables checked against its schema (or created), before
anything is written to them.

At construction, by default: a server that can't be reached then raises
:class:`~taproute.service.sinks.clickhouse.transport.ServerUnreachable`.  A
sink built with ``when_unreachable="check_later"`` (a spooling destination's
inner sink: its batches spool meanwhile) keeps the tables it could not check
and checks them when the server is first reached: by its owner
(:meth:`TableChecks.when_reached`), and again before every insert, so no
block is written into a table that was not checked.  A table that doesn't
fit then (missing, a column of another type, no deduplication window) is a
failure kept for good: every later check and insert raises it again.

Exactly once: the sink repeats an insert whose outcome is unknown under the
same token, and ClickHouse drops the repeat only while the table's window
still remembers every block of the first try: one per partition the insert
touched.  Between a first try and its last repeat at most ``inserts`` of the
sink's inserts into the table land, the one repeated included (see
:class:`~.blocks.TableOrder`), so a table whose window is shorter than
``inserts`` is refused, and each insert is written as one block
per partition and may touch at most ``window // inserts`` partitions
(:func:`~.deduplication.partition_allowance`, :attr:`TableChecks.allowance`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from taproute.service.sinks.clickhouse.deduplication import (
    DeduplicationWindow,
    PartitionAllowance,
    check_deduplication,
    partition_allowance,
)
from taproute.service.sinks.clickhouse.tables import MissingTable, TableSpec, check_table
from taproute.service.sinks.clickhouse.transport import (
    ServerUnreachable,
    Transport,
    connection_failure,
)


class TableChecks:
    """The checks of one sink's tables: done, pending (the server was not
    reached yet), or failed for good."""

    def __init__(
        self,
        transport: Transport,
        tables: Iterable[TableSpec],
        *,
        create: bool,
        require_deduplication: bool,
        inserts: int = 1,
    ) -> None:
        self.transport = transport
        self.create = create
        self.require_deduplication = require_deduplication
        #: The sink's inserts into one table that may land between a first try
        #: and its last repeat, that one included (``2 x inserts_in_flight - 1``).
        self.inserts = max(1, inserts)
        #: Per table checked (with ``require_deduplication``): its window, and
        #: the partitions one insert may touch with the settings enforcing it.
        self.windows: dict[str, DeduplicationWindow] = {}
        self.allowance: dict[str, PartitionAllowance] = {}
        self._pending = list(tables)
        self._lock = threading.Lock()
        #: Why the tables were left unchecked at construction (None: they were not).
        self.unreached: ServerUnreachable | None = None
        #: A check that failed when the server was reached (kept: raised again).
        self.failure: Exception | None = None

    @property
    def waiting_reason(self) -> str | None:
        """Why the tables are not checked yet (the server not reached since
        construction), in one line; None once they are (or if they were at once)."""
        unreached = self.unreached
        if unreached is None or not self._pending:
            return None
        return f"unreachable: {unreached.target}: {unreached.reason} (tables not checked yet)"

    @property
    def done(self) -> bool:
        """Every table was checked (and fits)."""
        return not self._pending and self.failure is None

    def at_construction(self, *, later: bool) -> None:
        """Check every table now; with ``later``, a server that can't be reached
        leaves the rest pending (:attr:`unreached` says why) instead of raising."""
        try:
            self._run(wrap_unreachable=True)
        except ServerUnreachable as exc:
            if not later:
                raise
            self.unreached = exc

    def when_reached(self) -> None:
        """Check the pending tables (blocking; any thread).  While the server
        can't be reached this raises the driver's error (transient for the
        transport); a table that doesn't fit raises its error, now and on
        every later call."""
        if self.done:
            return
        with self._lock:
            if self.failure is not None:
                raise self.failure
            try:
                self._run(wrap_unreachable=False)
            except Exception as exc:
                if not self.transport.is_transient(exc):
                    self.failure = exc
                raise

    def _run(self, *, wrap_unreachable: bool) -> None:
        while self._pending:
            self._prepare(self._pending[0], wrap_unreachable)
            self._pending.pop(0)

    def _prepare(self, spec: TableSpec, wrap_unreachable: bool) -> None:
        try:
            found = self.transport.describe(spec.name)
        except Exception as exc:  # the first contact with the server
            reason = connection_failure(exc)
            if reason is None or not wrap_unreachable:
                raise
            raise ServerUnreachable(
                self.transport.description, reason, doing=f"check table {spec.name!r}"
            ) from exc
        if found is None:
            if not self.create:
                raise MissingTable(
                    f"table {spec.name!r} does not exist in {self.transport.description}; "
                    "create it, or pass create_tables=True"
                )
            self.transport.execute(spec.create_sql(self.transport.table_settings))
            found = self.transport.describe(spec.name)
            assert found is not None
        check_table(spec, found)
        if self.require_deduplication:
            inserts = self.inserts
            window = check_deduplication(
                self.transport,
                spec.name,
                blocks=inserts,
                why=(
                    f"a retried insert and the {inserts - 1} other(s) that may land between its "
                    f"first try and its repeat with inserts_in_flight = {(inserts + 1) // 2}; "
                    "each at least one block, one per partition it touches"
                    if inserts > 1
                    else "each insert is at least one block, one per partition it touches"
                ),
            )
            self.allowance[spec.name] = partition_allowance(self.transport, window.size, inserts)
            self.windows[spec.name] = window


__all__ = ["TableChecks"]
