"""Every bad HTTP request gets a 4xx with a JSON error body, and request bodies
are bounded: real sockets on 127.0.0.1 (issue #10, items 14 and 15)."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse

import pytest

from taproute.actors import RoutingSink
from taproute.routing import ConfigError, HookRegistry, Route, RoutingConfig
from taproute.service import CaptureSink, DeadLetterStore, HttpConfig, create_record_runtime
from tests.processors import SCHEMA

TOKEN = "s3cret-token"


@pytest.fixture
def served(tmp_path):
    """A runtime serving the dead-letter controls and /trace (1 KiB body limit)."""
    hooks = HookRegistry()
    store = DeadLetterStore(tmp_path / "dead.sqlite", hooks=hooks)
    sink = RoutingSink(
        RoutingConfig([Route("r", "layers.*", "out")]),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
        hooks=hooks,
        on_failure=store.handle,
    )
    http = HttpConfig(port=0, token=TOKEN, max_body_bytes=1024)
    with create_record_runtime(record_sink=sink, http=http, dead_letters=store) as runtime:
        runtime.bind_hook("layers.0.q", layout="vec")
        (url,) = runtime.http_urls
        yield urllib.parse.urlsplit(url), runtime
    store.close()


def call(
    where: urllib.parse.SplitResult,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    raw_headers: list[tuple[bytes, bytes]] = (),
) -> tuple[int, object]:
    """One request on a fresh connection; the reply as (status, parsed JSON)."""
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        connection.putrequest(method, path)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        for name, value in raw_headers:
            connection.putheader(name.decode(), value)  # bytes go out as they are
        if body is not None and "Content-Length" not in (headers or {}):
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_non_ascii_bearer_header_is_401_not_500(served):
    where, _ = served
    header = (b"Authorization", "Bearer é✓".encode())
    status, body = call(where, "POST", "/dead-letters/1/skip", raw_headers=[header])
    assert status == 401 and "Bearer" in body["error"]


def test_a_non_ascii_token_is_refused_when_configured_not_at_each_request():
    """A token no header can carry ("tökén") used to be accepted and made
    every mutating request answer 401; it is refused where it is given, as
    the config file refuses it."""
    with pytest.raises(ConfigError, match="HttpConfig token: expected None or printable ASCII"):
        HttpConfig(port=0, token="tökén")
    with pytest.raises(ValueError, match="port"):
        HttpConfig(port=70_000)


@pytest.mark.parametrize("ident", ["99999999999999999999999", "0", "-3"])
def test_letter_ids_outside_sqlite_range_are_400(served, ident):
    where, _ = served
    status, body = call(where, "GET", f"/dead-letters/{ident}")
    assert status == 400 and "dead letter id" in body["error"]
    status, body = call(
        where, "POST", f"/dead-letters/{ident}/skip", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert status == 400


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        ({"hook": "layers.0.q", "key": 2**70}, "key"),
        ({"hook": "layers.0.q", "step": 1.5}, "step"),
        ({"hook": "layers.0.q", "bogus": 1}, "bogus"),
        ({"hook": "layers.0.q", "layout": "nope"}, "nope"),
    ],
)
def test_trace_fields_out_of_range_or_unknown_are_400(served, payload, names):
    where, _ = served
    status, body = call(where, "POST", "/trace", body=json.dumps(payload).encode())
    assert status == 400 and names in body["error"]


def test_deeply_nested_or_invalid_json_is_400(served):
    where, _ = served
    assert HttpConfig().max_body_bytes == 2**20  # the default bound is 1 MiB
    status, body = call(where, "POST", "/trace", body=b"\xff\xfe not json")
    assert status == 400 and "JSON" in body["error"]


def test_deep_nesting_under_the_limit_is_400(tmp_path):
    sink = RoutingSink(
        RoutingConfig([Route("r", "layers.*", "out")]),
        SCHEMA,
        {"out": CaptureSink()},
        unmatched="drop",
    )
    with create_record_runtime(
        record_sink=sink, http=HttpConfig(port=0, max_body_bytes=1_000_000)
    ) as runtime:
        where = urllib.parse.urlsplit(runtime.http_urls[0])
        status, body = call(where, "POST", "/trace", body=b"[" * 200_000 + b"]" * 200_000)
        assert status == 400 and "nested" in body["error"]


def test_bodies_over_the_limit_are_413_declared_or_streamed(served):
    where, runtime = served
    # Declared too large: refused from the header, before any of it is read.
    status, body = call(
        where,
        "POST",
        "/trace",
        body=b"{}",
        headers={"Content-Length": str(100 * 2**20)},
    )
    assert status == 413 and "1024-byte limit" in body["error"]
    # Not declared (chunked): refused once the stream passes the limit.  The
    # request goes out in one write: sent chunk by chunk (http.client), a client
    # descheduled between two chunks could find the connection already closed
    # behind the 413 and fail its next send (BrokenPipeError) before reading it.
    chunks = [b'{"hook": "', b"x" * 4096, b'"}']
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = b"POST /trace HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % (
        where.netloc.encode()
    )
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(head + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413
        assert "limit" in json.loads(response.read())["error"]
    # The router is untouched by either.
    assert runtime.snapshot().failure is None


def test_unknown_paths_and_methods_answer_json(served):
    where, _ = served
    status, body = call(where, "GET", "/nope")
    assert status == 404 and body == {"error": "Not Found"}
    status, body = call(where, "GET", "/trace")
    assert status == 405 and "error" in body
