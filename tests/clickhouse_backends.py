"""The ClickHouse engines the destination tests run against.

chDB always (in-process, one data directory for the whole test session, as
chDB allows one per process); a ClickHouse server too when
TAPROUTE_CLICKHOUSE_URL is set (e.g. http://default:@127.0.0.1:8123/default).
Each test gets its own table-name prefix, so tests never see each other's rows.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote_plus, urlsplit

import attrs
import pyarrow as pa

from taproute.routing import RecordSchema
from taproute.service.sinks.clickhouse import ClickHouseSink, Transport

SERVER_URL = os.environ.get("TAPROUTE_CLICKHOUSE_URL")
BACKENDS = ["chdb", *(["server"] if SERVER_URL else [])]


@attrs.define
class Backend:
    name: str
    transport: Transport
    prefix: str = attrs.field(factory=lambda: "t" + uuid.uuid4().hex[:10])

    def raw(self, layout: str) -> str:
        return f"{self.prefix}_raw_{layout}"

    def rows(self, layout: str) -> str:
        return f"{self.prefix}_{layout}"

    def sink(self, schema: RecordSchema, transport: Transport | None = None, **kwargs: Any):
        kwargs.setdefault("create_tables", True)
        return ClickHouseSink(
            transport or self.transport,
            schema,
            raw_table=f"{self.prefix}_raw_{{layout}}",
            rows_table=f"{self.prefix}_{{layout}}",
            owns_transport=False,
            **kwargs,
        )

    def query(self, sql: str) -> pa.Table:
        return self.transport.query(sql.replace("{p}", self.prefix))

    def create_raw_vec(self, engine: str) -> str:
        """Create the raw table of the tests' `vec` layout by hand, with ``engine``."""
        table = self.raw("vec")
        self.transport.execute(
            f"CREATE TABLE `{table}` (hook LowCardinality(String), output_id UInt32, key Int64, "
            "step Int64, seq Int64, timestamp DateTime64(9), values Array(Float32), "
            f"values_shape Array(UInt32)) ENGINE = {engine}"
        )
        return table


class FlakyTransport:
    """The real transport, with the first ``failures`` inserts raising *after*
    ClickHouse stored the rows (a timeout on the reply): the worst case for
    duplicates."""

    def __init__(self, inner, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.inner = inner
        self.failures = failures
        self.error = error
        self.description = inner.description
        self.tokens: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def insert(self, table, data, *, dedup_token, settings=None):
        self.inner.insert(table, data, dedup_token=dedup_token, settings=settings)
        with self._lock:
            self.tokens.append(dedup_token)
            if self.failures > 0:
                self.failures -= 1
                raise self.error("reply lost after the insert was stored")

    def is_transient(self, error):
        return isinstance(error, ConnectionError)


class FaultyProxy:
    """An HTTP proxy on 127.0.0.1 in front of a ClickHouse server that answers
    scripted faults to INSERT requests, as a load balancer or an overloaded
    server would; everything else is passed through.

    ``faults`` is consumed one per insert: ``("reply", status, code)`` answers
    without forwarding (``code`` goes in ``X-ClickHouse-Exception-Code`` when
    not None); ``("lose_reply", status)`` forwards the insert (the server
    stores it) and answers ``status`` instead of the server's reply;
    ``("hang",)`` neither forwards nor answers until :attr:`released` is set
    (or the proxy closes), then drops the connection, as a server that took
    the request and went silent would.
    """

    def __init__(
        self,
        upstream_url: str,
        faults: list[tuple[Any, ...]],
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 8123)
        self.faults = list(faults)
        self.inserts = 0
        self.authorizations: set[str] = set()  # Authorization headers seen
        self.released = threading.Event()  # ends every ("hang",)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._handle()

            def do_POST(self) -> None:
                self._handle()

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/ping":  # the sink's reachability probe sends none
                    proxy.authorizations.add(self.headers.get("Authorization", ""))
                fault = proxy._next_fault(self.path, body)
                if fault is not None and fault[0] == "hang":
                    proxy.released.wait()
                    self.close_connection = True
                    return
                if fault is not None and fault[0] == "reply":
                    self._answer(
                        fault[1],
                        {} if fault[2] is None else {"X-ClickHouse-Exception-Code": str(fault[2])},
                        f"Code: {fault[2]}. DB::Exception: injected by FaultyProxy".encode()
                        if fault[2] is not None
                        else b"<html>Bad Gateway</html>",
                    )
                    return
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                if fault is not None:  # lose_reply: stored upstream, the reply never arrives
                    self._answer(fault[1], {}, b"<html>upstream reply lost</html>")
                    return
                self._answer(status, headers, data)

            def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if tls is not None:  # terminate TLS here, as a TLS front end of a server would
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        scheme, host = ("https", "localhost") if tls is not None else ("http", "127.0.0.1")
        self.url = upstream_url.replace(f"{parts.scheme}://", f"{scheme}://").replace(
            f"{parts.hostname}:{parts.port}", f"{host}:{self._server.server_address[1]}"
        )

    def _next_fault(self, path: str, body: bytes) -> tuple[Any, ...] | None:
        query = unquote_plus(urlsplit(path).query).upper()
        if "INSERT INTO" not in query and not body[:11].upper().startswith(b"INSERT INTO"):
            return None
        with self._lock:
            self.inserts += 1
            return self.faults.pop(0) if self.faults else None

    def _forward(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            skip = {"host", "content-length", "connection"}
            conn.request(
                method,
                path,
                body=body,
                headers={k: v for k, v in headers.items() if k.lower() not in skip},
            )
            response = conn.getresponse()
            data = response.read()
            passed = {
                k: v
                for k, v in response.getheaders()
                if k.lower() not in ("content-length", "connection", "transfer-encoding")
            }
            return response.status, passed, data
        finally:
            conn.close()

    def close(self) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()
