"""A dead-letter store another process holds locked: the HTTP endpoint answers
503 naming the file and SQLite's reason, and changes nothing (before, a skip
answered 500 ``internal error: OperationalError``, naming neither).
Real SQLite locked by a real second process, real HTTP on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys

from taproute.routing import FailureCode, HookRegistry, RecordFailure
from taproute.service import CaptureSink, DeadLetterStore, HttpConfig, create_record_runtime
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.test_operator_controls import TOKEN, request

LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""


def test_a_store_locked_by_another_process_answers_503_naming_it(tmp_path):
    path = tmp_path / "dead.sqlite"
    hooks = HookRegistry()
    store = DeadLetterStore(path, hooks)
    hooks.bind("q")
    (letter_id,) = store.put(
        RecordFailure(
            route="r",
            processor=None,
            error=ValueError("bad"),
            records=vec_batch(0, 1),
            code=FailureCode.HANDLER_INVALID,
            attempts=1,
            first_failure_at=1.0,
            last_failure_at=1.0,
        )
    )
    with create_record_runtime(
        record_sink=CaptureSink(),
        schema=SCHEMA,
        http=HttpConfig(port=0, token=TOKEN),
        dead_letters=store,
    ) as runtime:
        (url,) = runtime.http_urls
        locker = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert locker.stdout is not None and locker.stdout.readline() == "locked\n"
            status, body = request(f"{url}/dead-letters/{letter_id}/skip", "POST", TOKEN)
            assert status == 503, body
            assert str(path) in body["error"] and "locked" in body["error"]
            assert "nothing was changed" in body["error"]
        finally:
            assert locker.stdin is not None
            locker.stdin.close()
            locker.wait(timeout=60)
        assert store.get(letter_id).state == "dead"  # nothing changed
        status, body = request(f"{url}/dead-letters/{letter_id}/skip", "POST", TOKEN)
        assert status == 200 and body["state"] == "skipped"
    store.close()
