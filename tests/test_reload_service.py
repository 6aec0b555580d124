"""Reloading a service from its config file: SIGHUP on a real ``taproute run``
process, the authenticated ``POST /reload``, and what a reload refuses."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from taproute.routing import RoutingConfig
from taproute.service import CaptureSink, HttpConfig, RoutingSink, create_record_runtime
from taproute.service.host.config import ConfigFileError, load_config
from taproute.service.host.reload import ConfigReloader
from tests.processors import LAYOUTS_TOML, SCHEMA

ROOT = Path(__file__).resolve().parent.parent

LAYOUTS = (
    """
processors = ["tests.processors"]

"""
    + LAYOUTS_TOML
)

TAIL = """
[destinations.ch]
path = "@DATA@"
raw = ["vec"]
rows = ["norm"]
raw_table = "@PREFIX@_raw_{layout}"
rows_table = "@PREFIX@_{layout}"

[routing]
unmatched = "drop"

[http]
port = @PORT@
token = "s3cret"

[[producer.hooks]]
name = "layers.0.q"
layout = "vec"
batch = 8
"""

RAW = """
[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"
"""

NORMS = """
[[routes]]
name = "norms"
outputs = ["layers.*"]
mode = "stateless"
processor = "test.norms"
destination = "ch"
"""

BROKEN = """
[[routes]]
name = "norms"
outputs = ["layers.*"]
mode = "stateless"
processor = "no.such.processor"
destination = "ch"

[[routes]]
name = "elsewhere"
outputs = ["layers.*"]
destination = "nowhere"
"""


def config_text(tmp_path: Path, routes: str, *, port: int = 0, data: Path | None = None) -> str:
    """The file; ``data``: the chDB directory (in this process: the session's one,
    chDB holds one per process; tables are prefixed by the test's directory name)."""
    tail = (
        TAIL.replace("@DATA@", str(data or tmp_path / "data"))
        .replace("@PORT@", str(port))
        .replace("@PREFIX@", re.sub(r"\W", "_", tmp_path.name))
    )
    return LAYOUTS + routes + tail


class Output:
    """A child's stdout, read as it comes; ``wait_for`` blocks until a pattern shows."""

    def __init__(self, stream) -> None:
        self.text = ""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            with self._cond:
                self.text += chunk.decode(errors="replace")
                self._cond.notify_all()
        with self._cond:
            self.text += "\n<EOF>"
            self._cond.notify_all()

    def wait_for(self, pattern: str, start: int = 0) -> re.Match[str]:
        regex = re.compile(pattern)
        with self._cond:
            found = self._cond.wait_for(
                lambda: regex.search(self.text, start) or "<EOF>" in self.text, timeout=120
            )
            match = regex.search(self.text, start)
        assert found and match, f"{pattern!r} never showed; output:\n{self.text}"
        return match


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def post(url: str, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_sighup_reloads_a_running_taproute_run(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(config_text(tmp_path, RAW))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "taproute.service.host.cli", "run", "--config", str(path),
         "--rate", "400", "--duration", "600"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out = Output(child.stdout)
        url = out.wait_for(r"serving (http://\S+)/metrics").group(1)
        status = get_json(f"{url}/status")
        assert status["generation"] == 1 and list(status["routes"]) == ["raw"]

        path.write_text(config_text(tmp_path, RAW + NORMS))
        child.send_signal(signal.SIGHUP)
        done = out.wait_for(r"reloaded \S+: generation (\d+)")
        assert done.group(1) == "2"
        status = get_json(f"{url}/status")
        assert status["generation"] == 2 and list(status["routes"]) == ["raw", "norms"]

        # A file with problems: every one listed, the running generation goes on.
        path.write_text(config_text(tmp_path, RAW + BROKEN, port=1))
        child.send_signal(signal.SIGHUP)
        refused = out.wait_for(r"reload refused[^\n]*\n((?:.*\n){3})", done.end())
        lines = refused.group(1)
        assert "http: differs from the running configuration" in lines
        assert "routes[1]: route 'norms': unknown processor 'no.such.processor'" in lines
        assert "routes[2]: route 'elsewhere': unknown destination 'nowhere'" in lines
        assert get_json(f"{url}/status")["generation"] == 2

        # The same over HTTP: refused without the token, then applied with it.
        path.write_text(config_text(tmp_path, NORMS))
        assert post(f"{url}/reload", None)[0] == 401
        assert post(f"{url}/reload", "wrong")[0] == 401
        assert get_json(f"{url}/status")["generation"] == 2
        # A reload takes no options: one given (a dry run?) is refused, not
        # ignored while the file is applied.
        assert post(f"{url}/reload?dry_run=1", "s3cret")[0] == 400
        assert get_json(f"{url}/status")["generation"] == 2
        code, body = post(f"{url}/reload", "s3cret")
        assert (code, body) == (200, {"generation": 3})
        status = get_json(f"{url}/status")
        assert status["generation"] == 3 and list(status["routes"]) == ["norms"]
        path.write_text(config_text(tmp_path, BROKEN))
        code, body = post(f"{url}/reload", "s3cret")
        assert code == 422 and body["file"] == str(path)  # where the key paths are
        assert any("unknown processor 'no.such.processor'" in p for p in body["problems"])
        assert get_json(f"{url}/status")["generation"] == 3

        # Ctrl-C stops the producer between submissions, flushes and exits
        # cleanly (a KeyboardInterrupt inside a submission once left it hung).
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=120) == 0
        assert out.wait_for(r"route norms: processed [\d,]+")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=120)


def test_reload_endpoint_is_refused_without_a_configured_token(tmp_path):
    sink = RoutingSink(
        RoutingConfig([]),
        SCHEMA,
        {"out": CaptureSink()},
        "out",
    )
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as service:
        service.reloader = lambda: 99  # would answer, were the call allowed
        code, body = post(f"{service.http_urls[0]}/reload", "anything")
        assert code == 403 and "no token is configured" in body["error"]
        assert service.counters().generation == 1


@contextlib.contextmanager
def _service_from_file(path, text: str):
    """A service built and started from ``text`` written to ``path``, with
    the reloader of that file: ``(service, reloader)``."""
    path.write_text(text)
    config = load_config(path)
    with config.build() as built, built.start() as service:
        yield service, ConfigReloader(service, config)


def test_a_reload_refuses_changed_fixed_sections_and_lists_every_problem(tmp_path, chdb_transport):
    data = chdb_transport.path
    path = tmp_path / "router.toml"
    with _service_from_file(path, config_text(tmp_path, RAW, data=data)) as (service, reloader):
        text = config_text(tmp_path, BROKEN, port=9999, data=data)
        text = text.replace("batch = 8", "batch = 4").replace(
            '"tests.processors"]', '"tests.processors", "tests.no_such_module"]'
        )
        path.write_text(text)
        with pytest.raises(ConfigFileError) as caught:
            reloader()
        assert caught.value.problems == [
            "http: differs from the running configuration; a reload applies routes, "
            "[routing] and processors only (restart to apply http)",
            "producer: differs from the running configuration; a reload applies routes, "
            "[routing] and processors only (restart to apply producer)",
            "processors[1]: cannot import processor module 'tests.no_such_module': "
            "ModuleNotFoundError: No module named 'tests.no_such_module'",
            "routes[0]: route 'norms': unknown processor 'no.such.processor'; registered: "
            + caught.value.problems[3].split("registered: ", 1)[1],
            "routes[1]: route 'elsewhere': unknown destination 'nowhere'; given ['ch']",
        ]
        assert service.counters().generation == 1
        path.write_text(config_text(tmp_path, RAW + NORMS, data=data))
        assert reloader() == 2
        assert list(service.counters().routes) == ["raw", "norms"]


def test_a_file_with_a_bad_value_still_names_the_fixed_sections_it_changes(
    tmp_path, chdb_transport
):
    """The README: a file that changes layouts, destinations, ... "is refused,
    naming each, with the routes' own problems". A route's bad value (one the
    file's reading refuses, ``workers = 0``) hid the changed sections: the
    refusal listed only the bad value, and the operator learnt of the changed
    ``[http]`` only after fixing it."""
    data = chdb_transport.path
    path = tmp_path / "router.toml"
    with _service_from_file(path, config_text(tmp_path, RAW, data=data)) as (service, reloader):
        bad_route = NORMS.replace('mode = "stateless"', 'mode = "stateless"\nworkers = 0')
        path.write_text(config_text(tmp_path, RAW + bad_route, port=9999, data=data))
        with pytest.raises(ConfigFileError) as caught:
            reloader()
        assert caught.value.problems == [
            "http: differs from the running configuration; a reload applies routes, "
            "[routing] and processors only (restart to apply http)",
            "routes[1].workers: must be in [1, 1024], found 0",
        ]
        # A section with a bad value of its own is listed by its problem alone.
        path.write_text(
            config_text(tmp_path, RAW + bad_route, data=data).replace("batch = 8", "batch = 0")
        )
        with pytest.raises(ConfigFileError) as caught:
            reloader()
        assert [p.split(":")[0] for p in caught.value.problems] == [
            "routes[1].workers",
            "producer.hooks[0].batch",
        ]
        assert service.counters().generation == 1


def test_a_reload_applies_the_call_timeout_the_service_started_with(tmp_path, chdb_transport):
    """``taproute run --call-timeout`` overrides every route's deadline; a file
    reloaded under SIGHUP gets the same override (its routes' own deadlines
    otherwise come from their failure_policy)."""
    path = tmp_path / "router.toml"
    data = chdb_transport.path
    path.write_text(config_text(tmp_path, RAW, data=data))
    config = load_config(path).with_call_timeout(0.25)
    with config.build() as built, built.start() as service:
        reloader = ConfigReloader(service, config, call_timeout=0.25)
        path.write_text(
            config_text(tmp_path, RAW + NORMS + "failure_policy = { deadline = 9.0 }\n", data=data)
        )
        assert reloader() == 2
        deadlines = {p.name: p.route.failure_policy.deadline for p in built.sink.plan.routes}
        assert deadlines == {"raw": 0.25, "norms": 0.25}
        path.write_text(
            config_text(tmp_path, RAW + NORMS + "failure_policy = { deadline = 9.0 }\n", data=data)
        )
        assert ConfigReloader(service, config)() == 3  # no override: the file's own
        deadlines = {p.name: p.route.failure_policy.deadline for p in built.sink.plan.routes}
        assert deadlines["norms"] == 9.0
