"""A dead-letter store another process holds locked: the HTTP endpoint answers
503 naming the file and SQLite's reason, and changes nothing (before, a skip
answered 500 ``internal error: OperationalError``, naming neither); a service
built from a config file, and the offline ``taproute dead-letters reroute``,
refuse it naming the file (before: a raw ``sqlite3.OperationalError``
traceback out of ``build()``).  Real SQLite locked by a real second process,
real HTTP on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from taproute.routing import FailureCode, HookRegistry, RecordFailure
from taproute.service import CaptureSink, DeadLetterStore, HttpConfig, create_record_runtime
from taproute.service.host.cli import main
from taproute.service.host.config import load_config
from taproute.service.host.config_rules import ConfigFileError
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.test_operator_controls import TOKEN, config_text, request

LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""


def one_letter(store: DeadLetterStore) -> int:
    """A letter of route ``checked`` (hook ``layers.0.q``) put in ``store``."""
    assert store.hooks is not None
    store.hooks.bind("layers.0.q")
    (letter_id,) = store.put(
        RecordFailure(
            route="checked",
            processor=None,
            error=ValueError("bad"),
            records=vec_batch(0, 1),
            code=FailureCode.HANDLER_INVALID,
            attempts=1,
            first_failure_at=1.0,
            last_failure_at=1.0,
        )
    )
    return letter_id


def test_a_store_locked_by_another_process_answers_503_naming_it(tmp_path):
    path = tmp_path / "dead.sqlite"
    store = DeadLetterStore(path, HookRegistry())
    letter_id = one_letter(store)
    with create_record_runtime(
        record_sink=CaptureSink(),
        schema=SCHEMA,
        http=HttpConfig(port=0, token=TOKEN),
        dead_letters=store,
    ) as runtime:
        (url,) = runtime.http_urls
        with locked(path):
            status, body = request(f"{url}/dead-letters/{letter_id}/skip", "POST", TOKEN)
            assert status == 503, body
            assert str(path) in body["error"] and "locked" in body["error"]
            assert "nothing was changed" in body["error"]
        assert store.get(letter_id).state == "dead"  # nothing changed
        status, body = request(f"{url}/dead-letters/{letter_id}/skip", "POST", TOKEN)
        assert status == 200 and body["state"] == "skipped"
    store.close()


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """``path`` held by another process (``BEGIN EXCLUSIVE``) until the block ends."""
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert locker.stdout is not None and locker.stdout.readline() == "locked\n"
        yield
    finally:
        assert locker.stdin is not None
        locker.stdin.close()
        locker.wait(timeout=60)


def test_a_config_file_service_on_a_locked_store_is_refused_naming_it(
    tmp_path, chdb_transport, capsys
):
    dead = tmp_path / "dead.sqlite"
    store = DeadLetterStore(dead, HookRegistry())  # a store without the parked table yet
    letter_id = one_letter(store)
    store.close()
    path = tmp_path / "router.toml"
    path.write_text(config_text(chdb_transport.path, dead, "lk" + uuid.uuid4().hex[:8]))
    with locked(dead):
        with pytest.raises(ConfigFileError, match="locked") as raised:
            load_config(path).build()
        assert str(dead) in str(raised.value) and "dead_letters.path" in str(raised.value)
        assert main(["dead-letters", "reroute", str(letter_id), "--config", str(path)]) != 0
        err = capsys.readouterr().err
        assert str(dead) in err and "locked" in err and "Traceback" not in err
