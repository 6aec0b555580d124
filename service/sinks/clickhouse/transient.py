"""Which insert failures a retry of the same block can get past.

A failed insert is classified by the most specific thing it carries, in this
order:

0. **The storage's own error** (:data:`STORAGE_ERRORS`: a read-only file
   system, no space left, a quota, an I/O error, permission denied), under
   whatever code carries it: retried, the disk is at fault, not the block.
1. **The ClickHouse error code** (``X-ClickHouse-Exception-Code`` on HTTP,
   ``Code: N.`` in chDB's message).  Codes in :data:`RETRYABLE_CODES` say the
   server is busy, short of memory or parts, or lost a replica or the
   network: retried.  Every other code says the block, the table or the
   credentials are wrong (:data:`PERMANENT_CODES` lists the usual ones):
   sending the same block again gets the same answer, so it is not retried.
2. **The HTTP status**, when there is no code (a proxy or load balancer
   answered): :data:`RETRYABLE_STATUSES` (408, 429, 500, 502, 503, 504) are
   retried, every other status is not.
3. **The exception type**, when there is neither: a connection that failed
   or timed out (``OSError``, ``TimeoutError``, clickhouse-connect's
   ``OperationalError``, which wraps urllib3's connection errors and the
   429/503/504 replies it already retried) is retried; anything else (a
   ``ProgrammingError``, bad Arrow data, a bug) is not.

Retrying is safe for any of these because every retry of a block carries
the same ``insert_deduplication_token``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

#: ClickHouse error codes a retry may get past (names from src/Common/ErrorCodes.cpp).
RETRYABLE_CODES: Mapping[int, str] = {
    159: "TIMEOUT_EXCEEDED",
    160: "TOO_SLOW",
    173: "CANNOT_ALLOCATE_MEMORY",
    198: "DNS_ERROR",
    202: "TOO_MANY_SIMULTANEOUS_QUERIES",
    203: "NO_FREE_CONNECTION",
    209: "SOCKET_TIMEOUT",
    210: "NETWORK_ERROR",
    225: "NO_ZOOKEEPER",
    236: "ABORTED",
    241: "MEMORY_LIMIT_EXCEEDED",
    242: "TABLE_IS_READ_ONLY",
    243: "NOT_ENOUGH_SPACE",
    252: "TOO_MANY_PARTS",
    279: "ALL_CONNECTION_TRIES_FAILED",
    285: "TOO_FEW_LIVE_REPLICAS",
    286: "UNSATISFIED_QUORUM_FOR_PREVIOUS_WRITE",
    289: "REPLICA_IS_NOT_IN_QUORUM",
    319: "UNKNOWN_STATUS_OF_INSERT",
    369: "ALL_REPLICAS_ARE_STALE",
    373: "SESSION_IS_LOCKED",
    416: "REPLICA_STATUS_CHANGED",
    439: "CANNOT_SCHEDULE_TASK",
    733: "TABLE_IS_BEING_RESTARTED",
    745: "SERVER_OVERLOADED",
    999: "KEEPER_EXCEPTION",
}

#: The usual codes of bad data, a bad schema or bad credentials; not retried
#: (nor is any other code missing from :data:`RETRYABLE_CODES`).
PERMANENT_CODES: Mapping[int, str] = {
    6: "CANNOT_PARSE_TEXT",
    8: "THERE_IS_NO_COLUMN",
    10: "NOT_FOUND_COLUMN_IN_BLOCK",
    16: "NO_SUCH_COLUMN_IN_TABLE",
    27: "CANNOT_PARSE_INPUT_ASSERTION_FAILED",
    44: "ILLEGAL_COLUMN",
    47: "UNKNOWN_IDENTIFIER",
    53: "TYPE_MISMATCH",
    60: "UNKNOWN_TABLE",
    62: "SYNTAX_ERROR",
    70: "CANNOT_CONVERT_TYPE",
    81: "UNKNOWN_DATABASE",
    117: "INCORRECT_DATA",
    164: "READONLY",
    192: "UNKNOWN_USER",
    193: "WRONG_PASSWORD",
    194: "REQUIRED_PASSWORD",
    321: "VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE",
    497: "ACCESS_DENIED",
    516: "AUTHENTICATION_FAILED",
}

#: HTTP statuses retried when no ClickHouse code came with them (a proxy answered).
RETRYABLE_STATUSES: frozenset[int] = frozenset({408, 429, 500, 502, 503, 504})

#: What the storage under a table says when it cannot take a write (the
#: C library's texts of EROFS, ENOSPC, EDQUOT, EIO, EACCES), whatever code
#: carries it (chDB wraps a C++ filesystem_error as STD_EXCEPTION, 1001):
#: the disk is at fault, not the block, and the same block goes in once it is
#: fixed.  Retried; taken for bad data, a spool split such blocks down to
#: single records and dead-lettered every one while the destination read
#: healthy.
STORAGE_ERRORS: tuple[str, ...] = (
    "Read-only file system",
    "No space left on device",
    "Disk quota exceeded",
    "Input/output error",
    "Permission denied",
)

_CODE_IN_TEXT = re.compile(r"\bCode:\s*(\d+)\.")
_STATUS_IN_TEXT = re.compile(r"\bHTTP status (\d{3})\b")


@attrs.frozen
class Verdict:
    """Whether to retry, and why (for messages and tests)."""

    retry: bool
    reason: str


def error_code(error: BaseException) -> int | None:
    """The ClickHouse error code an exception carries: clickhouse-connect's
    ``code`` attribute (from the response header), else ``Code: N.`` in its text."""
    code = getattr(error, "code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    match = _CODE_IN_TEXT.search(str(error))
    return int(match.group(1)) if match else None


def http_status(error: BaseException) -> int | None:
    """The HTTP status of a reply without a ClickHouse code, as clickhouse-connect
    reports it ("HTTP driver received HTTP status 502")."""
    match = _STATUS_IN_TEXT.search(str(error))
    return int(match.group(1)) if match else None


def _connection_error(error: BaseException) -> bool:
    if isinstance(error, (OSError, TimeoutError)):
        return True
    try:
        from clickhouse_connect.driver.exceptions import OperationalError
    except ImportError:  # pragma: no cover - clickhouse-connect is a dependency
        return False
    return isinstance(error, OperationalError)


def classify(error: BaseException) -> Verdict:
    """Classify a failed insert (see the module docstring for the rules)."""
    code = error_code(error)
    text = str(error)
    storage = next((e for e in STORAGE_ERRORS if e in text), None)
    if storage is not None:
        return Verdict(True, f"storage error ({storage})")
    if code is not None:
        if code in RETRYABLE_CODES:
            return Verdict(True, f"ClickHouse code {code} {RETRYABLE_CODES[code]}")
        name = PERMANENT_CODES.get(code) or getattr(error, "name", None) or "not retryable"
        return Verdict(False, f"ClickHouse code {code} {name}")
    status = http_status(error)
    if status is not None:
        return Verdict(status in RETRYABLE_STATUSES, f"HTTP status {status}")
    if _connection_error(error):
        return Verdict(True, f"connection error {type(error).__name__}")
    return Verdict(False, f"{type(error).__name__} is not a connection error")
