"""What came of a reload whose caller stopped waiting: a swap refused after
``POST /reload`` answered 202 (or after ``runtime.reload(timeout=)`` raised
``TimeoutError``) used to show only as ``ingress.queued_reloads`` dropping
with ``generation`` unchanged.  It now shows as ``refused``, with its cause,
in ``last_reload`` (``/status``, ``counters()``) and in
``taproute_config_reloads_refused_total`` (``/metrics``); a later good reload
shows ``applied``.  The refused swap leaves the running generation routing
and loses nothing accepted before, during or after it.

The destination that fails to open is real: a ClickHouse server destination
whose port nobody listens on (connection refused), first routed to by the
reload.  What keeps the reload queued past its caller's wait is the running
destination holding its first batch (its mailbox takes a few batches, so the
record worker and the reload's control wait behind it)."""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import trio

from taproute.native import make_descriptors
from taproute.routing import Batch, PlanErrors, Route, RoutingConfig
from taproute.routing.errors import RoutingFailure
from taproute.service import (
    CaptureSink,
    ClickHouseSink,
    HttpConfig,
    RoutingSink,
    create_record_runtime,
)
from taproute.service.host.config import load_config
from taproute.service.host.reload import ConfigReloader
from tests.processors import SCHEMA
from tests.sinks import FailingSink
from tests.test_reload_service import NORMS, RAW, config_text

Q = "layers.0.q"

#: A ClickHouse server nobody listens for: opening a destination there fails
#: at once (connection refused).
DOWN_URL = "http://127.0.0.1:1/default?connect_timeout=1"

#: Records per batch, and batches submitted before the reload: more than the
#: held destination's mailbox (DESTINATION_CAPACITY records) and its held
#: batch take, so the record worker waits and the reload queues behind.
BATCH = 256
BEFORE_BATCHES = 8
DESTINATION_CAPACITY = 1024

DOWN_DESTINATION = f"""
[destinations.down]
url = "{DOWN_URL}"
raw = ["vec"]
spool = "off"
"""

COPY_TO_DOWN = """
[[routes]]
name = "copy"
outputs = ["layers.*"]
destination = "down"
"""


class HeldCapture(CaptureSink):
    """A capture destination whose submits wait (in a worker thread) until
    ``release`` is set; ``entered`` once the first one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    async def submit(self, batch: Batch) -> None:
        if not self.release.is_set():
            self.entered.set()
            await trio.to_thread.run_sync(self.release.wait, abandon_on_cancel=True)
        await super().submit(batch)


def submit(runtime, output_id: int, seqs: range) -> None:
    """``seqs`` as records of ``output_id``, in batches of :data:`BATCH`."""
    for start in range(seqs.start, seqs.stop, BATCH):
        part = np.arange(start, min(start + BATCH, seqs.stop))
        runtime.submit_batch(
            make_descriptors(
                output_id, 16, count=len(part), layout_ids=SCHEMA.layout_id("vec"), seqs=part
            ),
            np.zeros((len(part), 4), np.float32),
        )


def down() -> ClickHouseSink:
    """The destination the refused reload routes to first: it fails to open."""
    return ClickHouseSink.server(SCHEMA, DOWN_URL, raw=["vec"])


def delivered_once(capture: CaptureSink, count: int) -> bool:
    seqs = capture.descriptors()["seq"].tolist()
    return len(seqs) == count and sorted(seqs) == list(range(count))


def test_a_swap_refused_after_the_callers_wait_shows_in_the_snapshot_and_loses_nothing():
    ch = HeldCapture()
    sink = RoutingSink(
        RoutingConfig([Route("raw", Q, "ch")]),
        SCHEMA,
        {"ch": ch, "down": down},
        unmatched="drop",
        destination_capacity=DESTINATION_CAPACITY,
    )
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        snap = runtime.counters()
        assert snap.last_reload is None and snap.reloads.last_successful
        before = range(0, BEFORE_BATCHES * BATCH)
        try:
            submit(runtime, q, before)
            assert ch.entered.wait(60)
            # Checked (the destination exists), queued behind the held
            # records; the caller stops waiting, the reload goes on.
            with pytest.raises(TimeoutError):
                runtime.reload(
                    RoutingConfig([Route("raw", Q, "ch"), Route("copy", Q, "down")]),
                    timeout=0.2,
                )
            snap = runtime.counters()
            pending = snap.last_reload
            assert pending is not None
            assert (pending.outcome, pending.routes, pending.running_generation) == (
                "pending",
                ("raw", "copy"),
                1,
            )
            assert pending.settled_at is None and pending.source is None
            assert snap.ingress.queued_reloads == 1
            during = range(before.stop, before.stop + 2 * BATCH)
            submit(runtime, q, during)  # queued behind the reload
        finally:
            ch.release.set()
        runtime.flush()  # behind the reload: it ran (and was refused) before
        snap = runtime.counters()
        refused = snap.last_reload
        assert refused is not None and refused.id == pending.id
        assert refused.outcome == "refused" and refused.generation is None
        assert refused.settled_at is not None and refused.settled_at >= refused.requested_at
        # The cause, naming the destination that failed to open and why.
        assert "cannot reach ClickHouse server at http://127.0.0.1:1/default" in refused.error
        (problem,) = refused.problems
        assert problem.startswith(
            "destinations.down: destination 'down': cannot reach ClickHouse server at "
            "http://127.0.0.1:1/default (to connect): "
        ), problem
        assert (snap.reloads.applied, snap.reloads.refused, snap.reloads.not_queued) == (0, 1, 0)
        assert not snap.reloads.last_successful
        # The running generation goes on, routing as before.
        assert (snap.generation, snap.ingress.queued_reloads, list(snap.routes)) == (1, 0, ["raw"])
        after = range(during.stop, during.stop + 2 * BATCH)
        submit(runtime, q, after)
        runtime.flush()
        assert delivered_once(ch, after.stop)

        # A configuration with problems is refused at its check, and kept too.
        with pytest.raises(PlanErrors):
            runtime.reload(
                RoutingConfig(
                    [
                        Route("x", Q, "nowhere"),
                        Route("y", Q, "ch", mode="stateless", processor="no.such"),
                    ]
                )
            )
        checked = runtime.counters().last_reload
        assert checked is not None and checked.outcome == "refused"
        assert checked.id == refused.id + 1 and checked.routes == ("x", "y")
        assert any(p.startswith("routes[0]: ") and "'nowhere'" in p for p in checked.problems)

        # A later good reload shows applied, with the generation it became.
        assert runtime.reload(RoutingConfig([Route("raw", Q, "ch")])) == 2
        submit(runtime, q, range(after.stop, after.stop + BATCH))
        runtime.flush()
        snap = runtime.counters()
        applied = snap.last_reload
        assert applied is not None
        assert (applied.id, applied.outcome, applied.generation) == (checked.id + 1, "applied", 2)
        assert applied.running_generation == 1 and applied.error is None
        assert [r.outcome for r in snap.reloads.recent] == ["refused", "refused", "applied"]
        assert (snap.reloads.applied, snap.reloads.refused) == (1, 2)
        assert snap.reloads.last_successful
    assert delivered_once(ch, after.stop + BATCH)


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.status, response.read().decode()


def _post(url: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=b"", method="POST", headers={"Authorization": "Bearer s3cret"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _metric(metrics: str, name: str) -> float:
    lines = metrics.splitlines()
    (value,) = [float(line.split()[1]) for line in lines if line.split(" ")[0] == name]
    return value


def test_post_reload_refused_after_its_202_shows_refused_with_the_cause_in_status_and_metrics(
    tmp_path,
):
    path = tmp_path / "router.toml"
    path.write_text(config_text(tmp_path, RAW) + DOWN_DESTINATION)
    config = load_config(path)
    ch = HeldCapture()
    # The file's own destination "down" (its factory: a server nobody
    # listens for, no spool); "ch" held, so the reload waits past its answer.
    sink = RoutingSink(
        config.routing_config(),
        SCHEMA,
        {"ch": ch, "down": config.destination_factories(SCHEMA)["down"]},
        unmatched="drop",
        destination_capacity=DESTINATION_CAPACITY,
    )
    http = HttpConfig(port=0, token="s3cret")
    with create_record_runtime(record_sink=sink, http=http) as runtime:
        runtime.reloader = ConfigReloader(runtime, config)
        (url,) = runtime.http_urls
        status = json.loads(_get(f"{url}/status")[1])
        assert status["last_reload"] is None
        metrics = _get(f"{url}/metrics")[1]
        assert _metric(metrics, "taproute_config_reloads_refused_total") == 0
        assert _metric(metrics, "taproute_config_last_reload_successful") == 1

        q = runtime.bind_hook(Q, layout="vec")
        before = range(0, BEFORE_BATCHES * BATCH)
        try:
            submit(runtime, q, before)
            assert ch.entered.wait(60)
            path.write_text(config_text(tmp_path, RAW + COPY_TO_DOWN) + DOWN_DESTINATION)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            code, body = _post(f"{url}/reload?wait=0")
            assert (code, body) == (
                202,
                {"status": "queued", "reload_id": 1, "running_generation": 1, "queued_reloads": 1},
            )
            last = json.loads(_get(f"{url}/status")[1])["last_reload"]
            assert {k: last[k] for k in ("id", "outcome", "source", "config_sha256", "routes")} == {
                "id": 1,
                "outcome": "pending",
                "source": str(path),
                "config_sha256": digest,
                "routes": ["raw", "copy"],
            }
            during = range(before.stop, before.stop + 2 * BATCH)
            submit(runtime, q, during)
        finally:
            ch.release.set()
        runtime.flush()  # behind the reload: its swap ran, and refused it

        status = json.loads(_get(f"{url}/status")[1])
        assert (status["generation"], status["ingress"]["queued_reloads"]) == (1, 0)
        assert list(status["routes"]) == ["raw"]
        last = status["last_reload"]
        assert (last["id"], last["outcome"], last["generation"]) == (1, "refused", None)
        assert last["config_sha256"] == digest
        (problem,) = last["problems"]
        assert problem.startswith("destinations.down.url: cannot open http://127.0.0.1:1/"), problem
        assert problem in last["error"]
        assert status["reloads"]["refused"] == 1 and not status["reloads"]["last_successful"]
        metrics = _get(f"{url}/metrics")[1]
        assert _metric(metrics, "taproute_config_reloads_refused_total") == 1
        assert _metric(metrics, "taproute_config_reloads_applied_total") == 0
        assert _metric(metrics, "taproute_config_last_reload_successful") == 0
        assert _metric(metrics, "taproute_config_generation") == 1

        after = range(during.stop, during.stop + 2 * BATCH)
        submit(runtime, q, after)
        runtime.flush()
        assert delivered_once(ch, after.stop)

        # A later good file: applied, and said so.
        path.write_text(config_text(tmp_path, RAW + NORMS) + DOWN_DESTINATION)
        assert _post(f"{url}/reload") == (200, {"generation": 2})
        status = json.loads(_get(f"{url}/status")[1])
        last = status["last_reload"]
        assert (last["id"], last["outcome"], last["generation"]) == (2, "applied", 2)
        assert last["config_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert [r["outcome"] for r in status["reloads"]["recent"]] == ["refused", "applied"]
        metrics = _get(f"{url}/metrics")[1]
        assert _metric(metrics, "taproute_config_reloads_applied_total") == 1
        assert _metric(metrics, "taproute_config_reloads_refused_total") == 1
        assert _metric(metrics, "taproute_config_last_reload_successful") == 1

        # A file refused at its check (the prompt 422) is kept the same way.
        path.write_text(config_text(tmp_path, RAW.replace('"ch"', '"nowhere"')) + DOWN_DESTINATION)
        code, body = _post(f"{url}/reload")
        assert code == 422
        last = json.loads(_get(f"{url}/status")[1])["last_reload"]
        assert (last["id"], last["outcome"], last["problems"]) == (3, "refused", body["problems"])
        assert _metric(_get(f"{url}/metrics")[1], "taproute_config_reloads_refused_total") == 2


def test_post_reload_on_a_failed_runtime_answers_503_naming_the_failure(tmp_path):
    """A runtime whose first failure is latched takes no reload: its swap's
    future raises that failure, which ``POST /reload`` answered as a bare
    500 ``internal error: RoutingFailure`` (the handler's "a bug")."""
    path = tmp_path / "router.toml"
    path.write_text(config_text(tmp_path, RAW))
    config = load_config(path)
    sink = RoutingSink(
        config.routing_config(),
        SCHEMA,
        {"ch": FailingSink(fail_on=1, message="disk full")},
        unmatched="drop",
    )
    http = HttpConfig(port=0, token="s3cret")
    runtime = create_record_runtime(record_sink=sink, http=http)
    runtime.reloader = ConfigReloader(runtime, config)
    (url,) = runtime.http_urls
    q = runtime.bind_hook(Q, layout="vec")
    runtime.submit(q, np.zeros(4, np.float32))
    with pytest.raises(RoutingFailure):
        runtime.flush()
    path.write_text(config_text(tmp_path, RAW + NORMS))
    code, body = _post(f"{url}/reload")
    assert code == 503, body
    assert body["error"].startswith("reload refused: the runtime takes no reload now: ")
    assert body["error"].endswith("submit failed: OSError: disk full")
    assert (body["reload_id"], body["running_generation"]) == (1, 1)
    last = json.loads(_get(f"{url}/status")[1])["last_reload"]
    assert (last["id"], last["outcome"], last["generation"]) == (1, "refused", None)
    assert last["error"].endswith("OSError: disk full")
    with pytest.raises(RoutingFailure):
        runtime.close()
