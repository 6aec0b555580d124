"""Rerouting a dead letter to a named route, the same from every face: Python
(``reroute(id, route=...)``), HTTP (``POST .../reroute?route=...``) and the
command (``taproute dead-letters reroute ID --route ...``); each says the copy's id."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid

import pytest

from taproute.actors import RoutingSink
from taproute.routing import FailureCode, HookRegistry, RecordFailure, Route, RoutingConfig
from taproute.service import CaptureSink, DeadLetterStore, HttpConfig, create_record_runtime
from taproute.service.host.cli import main
from tests.conftest import vec_batch
from tests.failing_processors import SCRIPT
from tests.processors import SCHEMA
from tests.test_operator_controls import config_text

TOKEN = "s3cret-token"


@pytest.fixture(autouse=True)
def fresh_script():
    SCRIPT.reset()


def post(url: str, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_http_reroute_takes_a_route_and_answers_the_copys_id(tmp_path, capsys):
    hooks = HookRegistry()
    store = DeadLetterStore(tmp_path / "dead.sqlite", hooks=hooks)
    out, side = CaptureSink(), CaptureSink()
    sink = RoutingSink(
        RoutingConfig(
            [
                Route("r", "*", "out", mode="stateless", processor="fail.invalid_when_broken"),
                Route("side", "layers.*", "side"),
                Route("elsewhere", "mlp.*", "side"),
            ]
        ),
        SCHEMA,
        {"out": out, "side": side},
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
        batch = vec_batch(q, 4)
        runtime.submit_batch(batch.descriptors, batch.payload)
        runtime.flush()
        first, second, third, fourth = (d.id for d in store.list())
        assert len(side.batches) == 1  # the originals, fanned out

        status, body = post(f"{url}/dead-letters/{first}/reroute?route=side")
        assert status == 200 and body["state"] == "rerouted" and body["rerouted_to"] == "side"
        assert body["reroute_id"] == store.get(first).reroute_id is not None
        status, body = post(f"{url}/dead-letters/{second}/reroute?route=elsewhere")
        assert status == 409 and "does not take hook 'layers.0.q'" in body["error"]
        status, body = post(f"{url}/dead-letters/{second}/skip?route=side")
        assert status == 400 and "route= applies to reroute" in body["error"]
        assert store.get(second).state == "dead"  # refused: unchanged
        status, body = post(f"{url}/dead-letters/{third}/reroute")  # no route: the failed one
        assert status == 200 and body["rerouted_to"] == "r"
        # The command through the service's HTTP: the same route, the same answer.
        remote = ["--url", url, "--token", TOKEN, "--route", "side"]
        assert main(["dead-letters", "reroute", str(fourth), *remote]) == 0
        line = capsys.readouterr().out.strip()
        copy = store.get(fourth).reroute_id
        assert line == f"dead letter {fourth} rerouted to route side as copy {copy}"
        runtime.flush()
    assert sum(len(b) for b in side.batches) == 6  # 4 originals + 2 rerouted copies
    store.close()


def _old_letters(dead, count: int) -> None:
    store = DeadLetterStore(dead, hooks=HookRegistry())
    store.hooks.bind("layers.0.q")
    long_ago = time.time() - 1200
    store.put(
        RecordFailure(
            route="checked",
            processor="fail.invalid_when_broken",
            error=ValueError("values out of range"),
            records=vec_batch(0, count),
            code=FailureCode.HANDLER_INVALID,
            attempts=1,
            first_failure_at=long_ago,
            last_failure_at=long_ago,
        )
    )
    store.close()


def test_cli_reroute_takes_a_route_and_prints_the_copys_id(tmp_path, chdb_transport, capsys):
    dead = tmp_path / "dead.sqlite"
    prefix = "rr" + uuid.uuid4().hex[:8]
    path = tmp_path / "router.toml"
    path.write_text(config_text(chdb_transport.path, dead, prefix))
    _old_letters(dead, 3)
    config = ["--config", str(path)]

    assert main(["dead-letters", "reroute", "1", "--route", "raw", *config]) == 0
    line = capsys.readouterr().out.strip()
    match = re.fullmatch(r"dead letter 1 rerouted to route raw as copy (\d+)", line)
    assert match is not None, line
    store = DeadLetterStore(dead, create=False)
    try:
        assert store.get(1).reroute_id == int(match.group(1))
        assert store.get(1).rerouted_to == "raw"
    finally:
        store.close()
    rows = chdb_transport.query(f"SELECT seq FROM `{prefix}_raw_vec`").to_pylist()
    assert rows == [{"seq": 0}]  # the copy went to the forward route, nowhere else

    # A route that is not running is refused (exit 1), and the letter stays dead.
    assert main(["dead-letters", "reroute", "2", "--route", "gone", *config]) == 1
    assert "route 'gone' is not in the running configuration" in capsys.readouterr().err
    # Without --route: the route that gave it up.
    assert main(["dead-letters", "reroute", "2", *config]) == 0
    assert re.fullmatch(
        r"dead letter 2 rerouted to route checked as copy \d+", capsys.readouterr().out.strip()
    )
    # --route means nothing to show or skip: refused as bad input.
    with pytest.raises(SystemExit) as exited:
        main(["dead-letters", "skip", "3", "--route", "raw", *config])
    assert exited.value.code == 2
    assert "skip takes no --route" in capsys.readouterr().err
    assert main(["dead-letters", "skip", "3", *config]) == 0
    assert capsys.readouterr().out.strip() == "dead letter 3 skipped"
