"""Which insert failures are retried: one case per class of the table in
``taproute.service.sinks.clickhouse.transient``.

HTTP errors are built by clickhouse-connect's own response-to-exception code
(what its client raises for that status, header and body); connection
failures are real ones against a closed port.  The server cases in
test_clickhouse.py drive the same classes end to end through a proxy.
"""

from __future__ import annotations

import socket

import pytest
from clickhouse_connect.driver._backend.httpcommon import build_http_error
from clickhouse_connect.driver.exceptions import OperationalError, ProgrammingError

from taproute.service.sinks.clickhouse import ChdbTransport, ServerTransport, ServerUnreachable
from taproute.service.sinks.clickhouse.transient import (
    PERMANENT_CODES,
    RETRYABLE_CODES,
    RETRYABLE_STATUSES,
    classify,
)


def http_error(status: int, code: int | None) -> Exception:
    """What clickhouse-connect raises for a reply with ``status`` and exception ``code``
    (an OperationalError for the statuses it retries itself first, 429/503/504)."""
    body = f"Code: {code}. DB::Exception: simulated. (SOME_NAME)" if code else "<html>502</html>"
    header = None if code is None else str(code)
    retried = status in (429, 503, 504)
    return build_http_error(status, header, body, True, "http://127.0.0.1:8123", retried)


@pytest.mark.parametrize(
    ("status", "code", "name"),
    [
        (500, 252, "TOO_MANY_PARTS"),
        (500, 241, "MEMORY_LIMIT_EXCEEDED"),
        (500, 159, "TIMEOUT_EXCEEDED"),
        (500, 210, "NETWORK_ERROR"),
        (500, 242, "TABLE_IS_READ_ONLY"),
        (503, 209, "SOCKET_TIMEOUT"),
        (500, 373, "SESSION_IS_LOCKED"),
    ],
)
def test_retryable_clickhouse_codes_are_retried(status, code, name):
    verdict = classify(http_error(status, code))
    assert verdict.retry and verdict.reason == f"ClickHouse code {code} {name}"


@pytest.mark.parametrize(
    ("status", "code", "name"),
    [
        (400, 27, "CANNOT_PARSE_INPUT_ASSERTION_FAILED"),
        (400, 53, "TYPE_MISMATCH"),
        (404, 60, "UNKNOWN_TABLE"),
        (404, 16, "NO_SUCH_COLUMN_IN_TABLE"),
        (403, 497, "ACCESS_DENIED"),
        (403, 516, "AUTHENTICATION_FAILED"),
        (500, 164, "READONLY"),
    ],
)
def test_bad_data_schema_and_access_codes_are_not_retried(status, code, name):
    verdict = classify(http_error(status, code))
    assert not verdict.retry and verdict.reason == f"ClickHouse code {code} {name}"


def test_a_code_outside_the_table_is_not_retried_even_with_a_5xx():
    """The server said what went wrong; only the listed codes are worth a retry."""
    assert not classify(http_error(500, 49)).retry  # LOGICAL_ERROR
    after_retries = http_error(503, 76)  # CANNOT_OPEN_FILE
    assert isinstance(after_retries, OperationalError) and not classify(after_retries).retry


@pytest.mark.parametrize("status", sorted(RETRYABLE_STATUSES))
def test_gateway_and_overload_statuses_without_a_code_are_retried(status):
    verdict = classify(http_error(status, None))
    assert verdict.retry and verdict.reason == f"HTTP status {status}"


@pytest.mark.parametrize("status", [400, 401, 404, 413, 501])
def test_other_statuses_without_a_code_are_not_retried(status):
    assert not classify(http_error(status, None)).retry


def test_connection_failures_are_retried():
    # A port bound but never listened on: refused, and no other process can
    # take it meanwhile (a port freed again could be, by a busy machine).  The
    # driver's error is the cause of taproute's.
    with socket.socket() as probe, pytest.raises(ServerUnreachable) as refused:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        ServerTransport(f"http://default:@127.0.0.1:{port}/default")
    assert isinstance(refused.value.__cause__, ConnectionRefusedError)
    assert classify(refused.value.__cause__).retry
    for error in (ConnectionResetError("reset"), TimeoutError("timed out"), OSError(28, "full")):
        assert classify(error).retry, error


def test_programming_errors_and_bugs_are_not_retried():
    session = ProgrammingError("Attempt to execute concurrent queries within the same session.")
    for error in (session, ValueError("bad arrow"), KeyError("x"), RuntimeError("boom")):
        verdict = classify(error)
        assert not verdict.retry and type(error).__name__ in verdict.reason


def test_chdb_errors_are_classified_by_the_code_in_their_text(chdb_transport):
    with pytest.raises(Exception) as unknown:
        chdb_transport.execute("INSERT INTO no_such_table_anywhere VALUES (1)")
    assert "Code: 60." in str(unknown.value)
    assert not ChdbTransport.is_transient(chdb_transport, unknown.value)
    overload = RuntimeError("Code: 252. DB::Exception: Too many parts (300). (TOO_MANY_PARTS)")
    assert ChdbTransport.is_transient(chdb_transport, overload)


def test_the_two_code_tables_do_not_overlap():
    assert not set(RETRYABLE_CODES) & set(PERMANENT_CODES)


@pytest.mark.parametrize(
    "message",
    [
        # What chDB raised inserting into a directory remounted read-only
        # (a read-only bind mount, found probing a running service).
        "Code: 1001. DB::Exception: std::__1::filesystem::filesystem_error: filesystem "
        'error: in create_directories: Read-only file system ["/data/store/84e/84e998c7-'
        'dc4f-408a-aa77-8ae1627117b0/tmp_insert_all_16_16_0"]. (STD_EXCEPTION)',
        "Code: 1001. DB::Exception: std::__1::filesystem::filesystem_error: filesystem "
        'error: in create_directories: Permission denied ["/data/store/x/tmp_insert_1"]. '
        "(STD_EXCEPTION)",
        "Code: 75. DB::Exception: Cannot write to file /data/store/x/data.bin: "
        "Input/output error. (CANNOT_WRITE_TO_FILE_DESCRIPTOR)",
        "Code: 1001. DB::Exception: std::__1::filesystem::filesystem_error: No space left "
        "on device. (STD_EXCEPTION)",
    ],
)
def test_the_storage_refusing_a_write_is_retried_whatever_its_code(message):
    """Taken for bad data (code 1001 is in neither table), a spool split each
    such block down to single records and dead-lettered every one as
    'destination_refused' while the destination read healthy; a read-only or
    failing disk is an outage: retried, spooled, delivered once it is fixed."""
    from chdb import ChdbError

    verdict = classify(ChdbError(message))
    assert verdict.retry and verdict.reason.startswith("storage error ("), verdict
    # Bad data stays refused.
    assert not classify(ChdbError("Code: 53. DB::Exception: Type mismatch. (TYPE_MISMATCH)")).retry
