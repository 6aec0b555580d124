"""A ClickHouse server that does not answer at all (a host that drops the
connection, or takes it and never replies) is known as unreachable within the
URL's ``connect_timeout``, not after clickhouse-connect's own tries (two
connection tries of 10 s, or a 300 s read timeout): a destination without a
spool refuses the start naming the URL and the reason; a spooled one starts
degraded, spools, and checks its tables once a server answers on that port.

Real loopback sockets play the silent host: a listening socket whose backlog
is full (the kernel drops new connection requests) or one that takes
connections and never reads them."""

from __future__ import annotations

import contextlib
import pickle
import socket
import time
from collections.abc import Iterator

import pytest

from taproute.routing.errors import ConfigError
from taproute.service import ClickHouseSink, ServerUnreachable
from taproute.service.host.config import ConfigFileError, load_config
from taproute.service.sinks.clickhouse import ServerTransport
from tests import chfacade
from tests.conftest import vec_batch
from tests.processors import LAYOUTS_TOML, SCHEMA
from tests.test_clickhouse_unreachable import GUARD_S, count

#: Well below what clickhouse-connect alone takes (20 s, or 300 s), well above
#: a 1 s connect_timeout on a loaded machine.
BOUND_S = 15.0


class SilentPort:
    """A loopback port that does not answer: ``drops`` has a listening socket
    with a full backlog (connection requests are dropped), ``never_answers``
    takes connections into its backlog and never reads them."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        listener = socket.socket()
        self._held = [listener]
        listener.bind(("127.0.0.1", 0))
        self.port = int(listener.getsockname()[1])
        if kind == "drops":
            listener.listen(0)
            for _ in range(4):  # fill the accept queue; later SYNs are dropped
                filler = socket.socket()
                self._held.append(filler)
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(listener.getsockname())
        else:
            listener.listen(64)

    def close(self) -> None:
        """Free the port (connections queued on it are reset)."""
        for sock in self._held:
            sock.close()


@pytest.fixture(params=["drops", "never_answers"])
def silent_port(request) -> Iterator[SilentPort]:
    silent = SilentPort(request.param)
    try:
        yield silent
    finally:
        silent.close()


def expected_reason(kind: str) -> str:
    if kind == "drops":
        return "no answer within 1 s (connect_timeout): the connection was not accepted"
    return "connected, but no answer within 1 s (connect_timeout)"


def test_a_silent_server_is_refused_within_connect_timeout(silent_port):
    kind, port = silent_port.kind, silent_port.port
    url = f"http://127.0.0.1:{port}/default?connect_timeout=1"
    started = time.monotonic()
    with pytest.raises(ServerUnreachable) as caught:
        ClickHouseSink.server(SCHEMA, url, raw=["vec"])
    took = time.monotonic() - started
    assert 1.0 <= took < BOUND_S
    assert caught.value.reason == expected_reason(kind)
    assert str(caught.value) == (
        f"cannot reach ClickHouse server at http://127.0.0.1:{port}/default (to connect): "
        + expected_reason(kind)
    )


def test_connect_timeout_must_be_whole_seconds():
    for bad in ("0", "0.5", "-1", "soon"):
        with pytest.raises(ConfigError, match="whole seconds >= 1, found"):
            ServerTransport(f"http://127.0.0.1:1/default?connect_timeout={bad}")


CONFIG = (
    LAYOUTS_TOML
    + """
[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
url = "@URL@"
raw = ["vec"]
create_tables = true
spool = "@SPOOL@"
spool_dir = "@DIR@"

[routing]
unmatched = "drop"
"""
)


def write_config(tmp_path, url: str, spool: str):
    path = tmp_path / "router.toml"
    text = CONFIG.replace("@URL@", url).replace("@SPOOL@", spool)
    path.write_text(text.replace("@DIR@", str(tmp_path / "spool")))
    return path


def test_without_a_spool_the_start_fails_within_connect_timeout_naming_url_and_cause(
    silent_port, tmp_path
):
    kind, port = silent_port.kind, silent_port.port
    url = f"http://ops:s3cret@127.0.0.1:{port}/default?connect_timeout=1"
    config = load_config(write_config(tmp_path, url, "off"))
    started = time.monotonic()
    with pytest.raises(ConfigFileError) as refused, config.build() as built, built.start():
        pass
    assert time.monotonic() - started < BOUND_S
    message = str(refused.value)
    assert message == (
        f"{tmp_path / 'router.toml'}: destinations.ch.url: cannot open "
        f"http://127.0.0.1:{port}/default: {expected_reason(kind)}"
    )
    assert "s3cret" not in message


def test_a_bad_connect_timeout_is_refused_when_the_file_is_loaded(tmp_path):
    path = write_config(tmp_path, "http://127.0.0.1:8123/default?connect_timeout=0.5", "off")
    with pytest.raises(ConfigFileError) as refused:
        load_config(path)
    assert (
        "destinations.ch.url: connect_timeout in the ClickHouse URL must be whole seconds "
        ">= 1, found '0.5'"
    ) in str(refused.value)


@pytest.mark.parametrize("spool", ["outage", "always"])
def test_with_a_spool_it_starts_within_connect_timeout_and_delivers_once_a_server_answers(
    silent_port, tmp_path, spool
):
    chfacade.require()
    kind, port = silent_port.kind, silent_port.port
    url = f"http://127.0.0.1:{port}/default?connect_timeout=1"
    config = load_config(write_config(tmp_path, url, spool))
    facade = chfacade.Facade(tmp_path / "facade-data")
    try:
        started = time.monotonic()
        with config.build() as built, built.start() as service:
            assert time.monotonic() - started < BOUND_S
            destination = service.snapshot().destinations["ch"]
            assert destination.healthy == 0
            assert destination.unhealthy_reason == (
                f"unreachable: ClickHouse server at http://127.0.0.1:{port}/default: "
                f"{expected_reason(kind)} (tables not checked yet)"
            )
            q = service.bind_hook("layers.0", layout="vec")
            batch = vec_batch(q, 8)
            service.submit_batch(batch.descriptors, batch.payload)
            service.flush(timeout=GUARD_S)  # durable in the spool
            assert service.snapshot().destinations["ch"].spool_bytes > 0
            # The silent host goes; a server answers on the same port.
            silent_port.close()
            facade.port = port
            facade.start()
            service.flush(wait=True, timeout=GUARD_S)
            assert service.snapshot().destinations["ch"].healthy == 1
        assert count(f"http://127.0.0.1:{port}/default") == (8, 8)
    finally:
        facade.kill()


def test_a_writer_process_reports_a_silent_server_the_same_way(tmp_path):
    """The child's ServerUnreachable crosses the process boundary intact
    (it came back as 'RuntimeError: ServerUnreachable: ...')."""
    silent = SilentPort("never_answers")
    try:
        url = f"http://127.0.0.1:{silent.port}/default?connect_timeout=1"
        path = write_config(tmp_path, url, "outage")
        path.write_text(path.read_text().replace('spool = "outage"', 'writer = "process"'))
        config = load_config(path)
        with pytest.raises(ConfigFileError) as refused, config.build() as built, built.start():
            pass
    finally:
        silent.close()
    assert str(refused.value).endswith(
        f"destinations.ch.url: cannot open http://127.0.0.1:{silent.port}/default: "
        + expected_reason("never_answers")
    )


def test_server_unreachable_survives_pickling():
    error = ServerUnreachable("ClickHouse server at http://h:1/db", "Connection refused")
    error.where = "destinations.ch"
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ServerUnreachable and str(again) == str(error)
    assert (again.target, again.reason, again.where) == (error.target, error.reason, error.where)


def test_taproute_run_says_what_an_unreachable_destination_holds(tmp_path, capsys):
    """'608 rows sent' with the server down all along read as delivered: the
    summary line now says the destination is unhealthy and what its spool holds
    (found by the user-side probe of `taproute run`)."""
    from taproute.service.host.cli.main import main

    with socket.socket() as refusing:
        refusing.bind(("127.0.0.1", 0))  # bound, never listening: refused
        port = refusing.getsockname()[1]
        url = f"http://127.0.0.1:{port}/default"
        path = write_config(tmp_path, url, "outage")
        path.write_text(
            path.read_text()
            + '\n[http]\nport = 0\n\n[[producer.hooks]]\nname = "layers.0"\nlayout = "vec"\n'
            "batch = 16\n"
        )
        assert main(["run", "--config", str(path), "--rate", "2000", "--duration", "0.3"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("destination ch: ")
    assert f"; unhealthy: unreachable: ClickHouse server at {url}: Connection refused" in line
    # Printed after the close: what the spool holds can only go at the next start.
    assert line.endswith(
        " bytes held in its spool, delivered at the next start, once it is reachable"
    )
