"""A ClickHouse server sink without a spool whose insert fails for good
(retries spent: the server is gone) counts the rows it took and lost as
given up, as the writer process sink does.

Before, the block whose retries ran out latched the failure and its rows
vanished from the counts: a probe (GPT-2 capture, chfacade SIGSTOPped, no
spool) closed with ``RoutingFailure ... insert of 1592 rows ... after 8
attempt(s) failed`` while the destination said ``given_up_records 0`` and
the table held 1592 rows fewer than the destination had taken.  Rows still
buffered when a close found the failure were dropped uncounted the same
way.  Real parts: chfacade (ClickHouse's HTTP interface on chDB) SIGKILLed
and started again on the same data to read what it holds."""

from __future__ import annotations

import pytest

from taproute.routing import Route, RoutingConfig, RoutingFailure
from taproute.service import ClickHouseSink, RoutingSink, create_record_runtime
from taproute.service.sinks.clickhouse import Batching, Retry, ServerTransport
from tests.test_latched_accounting import RECORDS, SCHEMA, _submit


@pytest.mark.parametrize("block_batches", [1, 2])
def test_rows_of_an_insert_that_failed_for_good_are_counted_given_up(facade, block_batches):
    """``block_batches=2``: the last batch waits in the buffer behind a failing
    block; whether a flush seals it first (its insert fails too) or the
    close finds the failure first (the buffer is dropped), it is counted."""
    sink = ClickHouseSink.server(
        SCHEMA,
        facade.url,
        raw=["acts"],
        create_tables=True,
        # Blocks of block_batches batches; two tries, at once: the failure latches fast.
        batching=Batching(max_rows=block_batches * RECORDS, linger=3600),
        retry=Retry(attempts=2, initial_backoff=0.01, max_backoff=0.01),
    )
    routing = RoutingSink(
        RoutingConfig([Route("to_ch", "h.*", "ch")]), SCHEMA, {"ch": lambda: sink}, unmatched="drop"
    )
    runtime = create_record_runtime(record_sink=routing)
    hook = runtime.bind_hook("h.0", layout="acts")
    _submit(runtime, hook, 1)
    runtime.flush()  # persisted
    facade.kill()
    for step in range(2, 5):
        _submit(runtime, hook, step)
    with pytest.raises(RoutingFailure, match=r"after 2 attempt\(s\)"):
        runtime.flush()
    with pytest.raises(RoutingFailure):
        runtime.close()
    ch = runtime.counters().destinations["ch"]
    assert ch.records == 4 * RECORDS  # all taken by the sink (counted sent)
    facade.start()  # same data, same port: what did the server keep?
    transport = ServerTransport(facade.url)
    try:
        (row,) = transport.query("SELECT count() AS n FROM raw_acts").to_pylist()
    finally:
        transport.close()
    assert row["n"] == RECORDS
    # Every record taken and not persisted is counted given up.
    assert ch.given_up_records == 3 * RECORDS
    assert ch.records - ch.given_up_records == row["n"]
