"""Operator controls over HTTP (real socket, bearer token) and the CLI, and the doctor."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid

import pytest

from taproute.actors import RoutingSink
from taproute.routing import (
    FailureCode,
    HookRegistry,
    RecordFailure,
    Route,
    RoutingConfig,
)
from taproute.service import CaptureSink, DeadLetterStore, HttpConfig, create_record_runtime
from taproute.service.host.cli import main
from taproute.service.ops.parking import ParkedRecordStore
from tests.conftest import vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA

TOKEN = "s3cret-token"


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()


def request(url: str, method: str = "GET", token: str | None = None) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("given_to", ["on_failure", "runtime"])
def test_a_store_made_as_the_readme_shows_names_hooks_and_reroutes(tmp_path, given_to):
    """``DeadLetterStore(path)`` (no ``hooks=``) as ``on_failure=store.handle``, or
    as the runtime's ``dead_letters``, names its letters' hooks, so a reroute
    finds the route again (the letter said ``#0`` and every reroute was refused)."""
    store = DeadLetterStore(tmp_path / "dead.sqlite")

    async def keep(failure: RecordFailure) -> None:  # not the store's bound method
        await store.handle(failure)

    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig(
            [Route("r", "*", "out", mode="stateless", processor="fail.invalid_when_broken")]
        ),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        on_failure=store.handle if given_to == "on_failure" else keep,
    )
    SCRIPT.broken = True
    with create_record_runtime(
        record_sink=sink, http=HttpConfig(port=0), dead_letters=store
    ) as runtime:
        (url,) = runtime.http_urls
        q = runtime.bind_hook("layers.0.q", layout="vec")
        batch = vec_batch(q, 1)
        runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush()
        status, letters = request(f"{url}/dead-letters")
        assert status == 200 and [d["hook"] for d in letters] == ["layers.0.q"]
        for bad in ("nan", "inf", "-5"):  # refused, not an empty or a full list
            status, body = request(f"{url}/dead-letters?older_than={bad}")
            assert status == 400 and "finite number of seconds" in body["error"]
        SCRIPT.broken = False
        assert runtime.reroute(letters[0]["id"]).state == "rerouted"
        runtime.flush()
    assert store.get(letters[0]["id"]).state == "rerouted"
    assert len(out.rows("r")) == 1


def test_dead_letter_controls_over_http_need_the_token(tmp_path):
    hooks = HookRegistry()
    store = DeadLetterStore(tmp_path / "dead.sqlite", hooks=hooks)
    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig(
            [Route("r", "*", "out", mode="stateless", processor="fail.invalid_when_broken")]
        ),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=store.handle,
    )
    SCRIPT.broken = True
    with create_record_runtime(
        record_sink=sink, http=HttpConfig(port=0, token=TOKEN), dead_letters=store
    ) as runtime:
        (url,) = runtime.http_urls
        q = runtime.bind_hook("layers.0.q", layout="vec")
        batch = vec_batch(q, 3)
        runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush()

        status, letters = request(f"{url}/dead-letters")
        assert status == 200 and [d["seq"] for d in letters] == [0, 1, 2]
        assert {d["code"] for d in letters} == {"handler_invalid"}
        first, second = letters[0]["id"], letters[1]["id"]
        status, shown = request(f"{url}/dead-letters/{first}")
        assert status == 200 and shown["payload_bytes"] == 16 and shown["route"] == "r"
        assert request(f"{url}/dead-letters?route=other")[1] == []
        assert request(f"{url}/dead-letters/999")[0] == 404

        # Mutations need the bearer token.
        assert request(f"{url}/dead-letters/{first}/skip", "POST")[0] == 401
        assert request(f"{url}/dead-letters/{first}/skip", "POST", token="wrong")[0] == 401
        status, body = request(f"{url}/dead-letters/{first}/skip", "POST", token=TOKEN)
        assert status == 200 and body["state"] == "skipped"

        # A mistyped option is refused and changes nothing: '?rout=' rerouted
        # to the old route, for good (a letter is rerouted once).
        typo = f"{url}/dead-letters/{second}/reroute?rout=other"
        status, body = request(typo, "POST", token=TOKEN)
        assert (status, body["error"]) == (
            400,
            f"unknown query parameter 'rout' for /dead-letters/{second}/reroute (it takes: route)",
        )
        status, body = request(f"{url}/dead-letters?stat=all")
        assert status == 400 and body["error"].startswith("unknown query parameter 'stat'")
        # So is an empty or repeated '?route=': '?route=' (a shell's unset
        # variable) rerouted to the old route, for good; a repeated one took
        # whichever Starlette kept.
        for ambiguous, says in (
            ("route=", "route= must name a route"),
            ("route=r&route=other", "query parameter 'route' given 2 times"),
        ):
            where = f"{url}/dead-letters/{second}/reroute?{ambiguous}"
            status, body = request(where, "POST", token=TOKEN)
            assert status == 400 and says in body["error"], (ambiguous, status, body)
        status, body = request(f"{url}/dead-letters/{first}/skip?route=", "POST", token=TOKEN)
        assert status == 400 and "route= must name a route" in body["error"]
        # Options an endpoint does not take, or takes once, were ignored by
        # showing a letter and by listing (older_than=1&older_than=2 took one).
        status, body = request(f"{url}/dead-letters/{first}?verbose=1")
        assert (status, body["error"]) == (
            400,
            f"unknown query parameter 'verbose' for /dead-letters/{first} (it takes: none)",
        )
        status, body = request(f"{url}/dead-letters?older_than=1&older_than=2")
        assert (status, body["error"]) == (
            400,
            "query parameter 'older_than' given 2 times for /dead-letters",
        )
        assert request(f"{url}/trace?hook=layers.0.q", "POST")[0] == 400

        SCRIPT.broken = False  # fixed: reroute goes through routing again
        status, body = request(f"{url}/dead-letters/{second}/reroute", "POST", token=TOKEN)
        assert status == 200 and body["state"] == "rerouted"
        runtime.flush()
        assert [d["seq"] for d in request(f"{url}/dead-letters")[1]] == [2]

        assert request(f"{url}/trace", "POST")[0] == 400  # no body: refused, not crashed
        unbound = urllib.request.Request(
            f"{url}/trace",
            method="POST",
            data=json.dumps({"hook": "mlp.0", "key": 3}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(unbound, timeout=60)
        assert refused.value.code == 400
        assert "'mlp.0' was never bound" in json.loads(refused.value.read())["error"]
        traced = urllib.request.Request(
            f"{url}/trace",
            method="POST",
            data=json.dumps({"hook": "layers.0.q", "key": 3}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(traced, timeout=60) as response:
            verdicts = json.loads(response.read())
        assert verdicts["verdicts"] == [
            {"route": "r", "verdict": "match", "destination": "out", "reason": None}
        ]
        assert verdicts["destinations"] == ["out"] and verdicts["dropped"] is False
    assert out.rows("r")["seq"].tolist() == [1]
    store.close()


def test_mutations_are_refused_when_no_token_is_configured(tmp_path):
    store = DeadLetterStore(tmp_path / "dead.sqlite")
    with create_record_runtime(
        record_sink=CaptureSink(), schema=SCHEMA, http=HttpConfig(port=0), dead_letters=store
    ) as runtime:
        (url,) = runtime.http_urls
        status, body = request(f"{url}/dead-letters/1/skip", "POST", token="anything")
        assert status == 403 and "no token is configured" in body["error"]
    store.close()


def config_text(chdb_path, dead_path, prefix: str) -> str:
    return f"""
processors = ["tests.failing_processors"]

[[layouts]]
name = "vec"
columns = [{{ name = "values", type = "Array(Float32)", shape = [4] }}]

[[layouts]]
name = "norm"
columns = [
  {{ name = "key", type = "Int64" }},
  {{ name = "seq", type = "Int64" }},
  {{ name = "norm", type = "Float32" }},
]

[[routes]]
name = "checked"
outputs = ["layers.*"]
mode = "stateless"
processor = "fail.invalid_when_broken"
destination = "ch"

[[routes]]
name = "raw"
outputs = ["layers.0.*"]
destination = "ch"

[destinations.ch]
path = "{chdb_path}"
raw = ["vec"]
rows = ["norm"]
raw_table = "{prefix}_raw_{{layout}}"
rows_table = "{prefix}_{{layout}}"

[routing]
unmatched = "drop"

[dead_letters]
path = "{dead_path}"
"""


def test_cli_lists_shows_skips_and_reroutes_and_doctor_warns(tmp_path, chdb_transport, capsys):
    dead = tmp_path / "dead.sqlite"
    prefix = "cli" + uuid.uuid4().hex[:8]
    path = tmp_path / "router.toml"
    path.write_text(config_text(chdb_transport.path, dead, prefix))
    # Two records given up a while ago (as a crashed run would have left them).
    store = DeadLetterStore(dead, hooks=HookRegistry())
    store.hooks.bind("layers.0.q")
    long_ago = time.time() - 1200
    store.put(
        RecordFailure(
            route="checked",
            processor="fail.invalid_when_broken",
            error=ValueError("values out of range"),
            records=vec_batch(0, 2),
            code=FailureCode.HANDLER_INVALID,
            attempts=1,
            first_failure_at=long_ago,
            last_failure_at=long_ago,
        )
    )
    store.close()

    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "WARNING: 2 dead letter(s) older than 10 minutes" in out
    assert "route checked, handler_invalid: 2" in out

    assert main(["dead-letters", "list", "--config", str(path)]) == 0
    listing = capsys.readouterr().out
    assert "2 dead letter(s)" in listing and "ValueError: values out of range" in listing
    assert main(["dead-letters", "show", "1", "--config", str(path)]) == 0
    assert "payload: 16 bytes" in capsys.readouterr().out
    assert main(["dead-letters", "skip", "1", "--config", str(path)]) == 0
    assert main(["dead-letters", "reroute", "2", "--config", str(path)]) == 0
    assert "dead letter 2 rerouted" in capsys.readouterr().out
    rows = chdb_transport.query(f"SELECT seq FROM `{prefix}_norm`").to_pylist()
    assert rows == [{"seq": 1}]
    # The copy was parked with its claim; delivered, it is no longer parked
    # (a next start must not deliver it again).
    assert ParkedRecordStore(DeadLetterStore(dead, create=False)).count() == 0
    assert main(["dead-letters", "list", "--config", str(path), "--state", "all"]) == 0
    assert "2 dead letter(s)" in capsys.readouterr().out
    assert main(["check", "--config", str(path)]) == 0
    assert "WARNING" not in capsys.readouterr().out  # nothing unhandled is left
    assert main(["dead-letters", "show", "9", "--config", str(path)]) == 1
    assert "no dead letter with id 9" in capsys.readouterr().err


def test_cli_trace_prints_verdicts(tmp_path, chdb_transport, capsys):
    path = tmp_path / "router.toml"
    path.write_text(
        config_text(chdb_transport.path, tmp_path / "d.sqlite", "tr" + uuid.uuid4().hex[:6])
    )
    assert main(["trace", "--config", str(path), "--hook", "layers.1.k", "--key", "7"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "trace layers.1.k key=7"
    assert out[1].split() == ["checked", "match", "->", "ch"]
    assert out[2].split() == ["raw", "not_reached", "->", "ch"]
    assert out[3].strip() == "=> ch"
    assert main(["trace", "--config", str(path), "--hook", "mlp.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].strip() == "=> dropped"
    assert lines[-1] == f"  traced: candidate configuration {path} (not applied)"


def test_cli_trace_of_a_layout_or_record_the_file_refuses_is_bad_input(
    tmp_path, chdb_transport, capsys
):
    """A --layout the file does not have exited 1 with UnknownLayout's repr,
    where the README's exit codes (and the same trace asked of a running
    service, HTTP 400) say bad input: 2, one line."""
    path = tmp_path / "router.toml"
    path.write_text(
        config_text(chdb_transport.path, tmp_path / "d.sqlite", "tr" + uuid.uuid4().hex[:6])
    )
    argv = ["trace", "--config", str(path), "--hook", "layers.1.k"]
    assert main([*argv, "--layout", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("taproute: trace refused: ") and "nope" in err[0]
    assert main([*argv, "--length", "3"]) == 2  # no layout holds 3 bytes of float32
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("taproute: trace refused: ")


def test_reroute_goes_only_to_the_failed_route_once_and_refuses_what_it_cannot_do(tmp_path):
    from taproute.routing.errors import RerouteRefused

    hooks = HookRegistry()
    store = DeadLetterStore(tmp_path / "dead.sqlite", hooks=hooks)
    out, raw = CaptureSink(), CaptureSink()
    sink = RoutingSink(
        RoutingConfig(
            [
                Route("r", "*", "out", mode="stateless", processor="fail.invalid_when_broken"),
                Route("fwd", "*", "raw"),  # takes the same records, and does not fail
            ]
        ),
        SCHEMA,
        {"out": out, "raw": raw},
        unmatched="drop",
        hooks=hooks,
        on_failure=store.handle,
    )
    SCRIPT.broken = True
    with create_record_runtime(record_sink=sink, dead_letters=store) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="vec")
        batch = vec_batch(q, 5)
        runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush()
        letters = store.list()
        assert len(letters) == 5 and {d.route for d in letters} == {"r"}
        ids = [d.id for d in letters]
        assert len(raw.batches) == 1 and len(raw.batches[0]) == 5

        # Skip one; it stays skipped whatever is asked next.
        store.skip(ids[0])
        with pytest.raises(RerouteRefused, match="is skipped"):
            runtime.reroute(ids[0])
        assert store.get(ids[0]).state == "skipped"

        # A route that is not running: refused, the letter stays dead.
        with pytest.raises(RerouteRefused, match="'gone' is not in the running configuration"):
            runtime.reroute(ids[1], route="gone")
        assert store.get(ids[1]).state == "dead"

        # Still broken: the copy fails again on "r" and is linked to its original.
        copy = runtime.reroute(ids[1])
        runtime.flush()
        assert copy.state == "rerouted" and copy.reroute_id is not None
        assert copy.rerouted_to == "r"
        (again,) = store.list(state="dead", route="r")[-1:]
        assert again.reroute_of == ids[1] and again.id not in ids

        SCRIPT.broken = False
        for letter_id in ids[2:]:
            runtime.reroute(letter_id)
        runtime.flush()
        with pytest.raises(RerouteRefused, match="rerouted at most once"):
            runtime.reroute(ids[2])
        with pytest.raises(RerouteRefused, match="cannot be skipped"):
            store.skip(ids[2])
    # The copies went to "r" only: "fwd" did not get them a second time.
    assert sum(len(b) for b in raw.batches) == 5
    assert sorted(out.rows("r")["seq"].tolist()) == [2, 3, 4]
    assert len({store.get(i).reroute_id for i in ids[1:]}) == 4  # each copy its own id
    store.close()


def test_reroute_over_http_while_the_service_is_closed_answers_503_and_keeps_the_letter(
    tmp_path,
):
    """A reroute that reaches a closing (here: closed) runtime is refused with
    503 and the SinkClosed message, not a 500; the letter stays dead, so the
    operator can reroute it on the next start."""
    import trio

    from taproute.service.host.http import build_app, serve_http
    from taproute.service.ops.controls import DeadLetterControls

    store = DeadLetterStore(tmp_path / "dead.sqlite")
    sink = RoutingSink(
        RoutingConfig(
            [Route("r", "*", "out", mode="stateless", processor="fail.invalid_when_broken")]
        ),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        on_failure=store.handle,
    )
    SCRIPT.broken = True
    with create_record_runtime(record_sink=sink, dead_letters=store) as runtime:
        q = runtime.bind_hook("layers.0.q", layout="vec")
        batch = vec_batch(q, 1)
        runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush()
    (letter,) = store.list()
    app = build_app(lambda: None, controls=DeadLetterControls(store, runtime, token=TOKEN))

    async def main() -> tuple[int, object]:
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(serve_http, app, HttpConfig(port=0))
            answer = await trio.to_thread.run_sync(
                lambda: request(f"{url}/dead-letters/{letter.id}/reroute", "POST", TOKEN)
            )
            nursery.cancel_scope.cancel()
        return answer

    status, body = trio.run(main)
    assert status == 503, body
    assert "closed" in body["error"]
    assert store.get(letter.id).state == "dead"
    assert store.get(letter.id).state == "dead"
    store.close()


def test_a_store_that_cannot_be_opened_names_its_path(tmp_path):
    """DeadLetterStore(path) on a directory, a file that is not SQLite, or a
    path under a regular file raised sqlite3's bare "unable to open database
    file" / "file is not a database" (or FileExistsError on the parent): none
    said which path. Each is now a TaprouteError naming the path and why, and
    a config file's key keeps its one-line problem."""
    from taproute.routing.errors import TaprouteError
    from taproute.service.host.config import ConfigFileError, load_config

    not_sqlite = tmp_path / "notes.sqlite"
    not_sqlite.write_text("these are my notes, not a database " * 8)
    regular = tmp_path / "regular"
    regular.write_text("")
    for path, reason in [
        (tmp_path, "unable to open database file"),
        (not_sqlite, "file is not a database"),
        (regular / "letters.sqlite", "its directory cannot be made"),
    ]:
        with pytest.raises(TaprouteError, match=f"cannot open {re.escape(str(path))}: .*{reason}"):
            DeadLetterStore(path)
    assert not_sqlite.read_text().startswith("these are my notes")  # left as it was

    config = tmp_path / "router.toml"
    config.write_text(
        '[[layouts]]\nname = "vec"\ncolumns = [{ name = "v", type = "Array(Float32)" }]\n'
        '[[routes]]\nname = "raw"\noutputs = ["*"]\ndestination = "cap"\n'
        f'[destinations.cap]\npath = "{tmp_path / "data"}"\nraw = ["vec"]\n'
        f'[dead_letters]\npath = "{not_sqlite}"\n'
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(config).open_dead_letters()
    assert caught.value.problems == [
        f"dead_letters.path: cannot open {not_sqlite}: file is not a database"
    ]
