"""Is a ClickHouse server there at all?  One bounded try before a client is built.

clickhouse-connect's client queries the server as it is built, with the
client's own timeouts: against a host that drops the connection that took
two connection tries of ``connect_timeout`` (10 s each by default), and
against one that takes the connection and never answers, the read timeout
(``send_receive_timeout``, 300 s).  :func:`probe` asks first, once, within
``timeout`` seconds for everything (connect, TLS handshake, the first byte of
an answer to ``GET /ping``), so a server that is not there is known as such
within that bound, whatever the client's timeouts are.

Any answer counts: an HTTP status of any kind (a proxy's 401 too), or a TLS
handshake the server broke off (it is there; the client reports why later,
certificate checks included, which the probe does not make).  Not
answering, refusing, or an unknown host is :class:`NotReached` or the
socket's own ``OSError`` (both transient for the sink, see
``transient.py``).
"""

from __future__ import annotations

import math
import socket
import ssl
import time
import urllib.request
from urllib.parse import parse_qs, urlsplit


class NotReached(OSError):
    """The server did not answer in time, or closed the connection without a
    word; the message is the reason in a few words."""


def probe(url: str, timeout: float) -> None:
    """Return once the server of ``url`` answered; raise ``OSError`` (the
    socket's, or :class:`NotReached`) if it did not within ``timeout`` seconds.

    Skipped (returns at once) where the client would go through an HTTP
    proxy (the URL's or the environment's): it does not connect to the host.
    """
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    secure = parts.scheme == "https"
    port = parts.port or (8443 if secure else 8123)
    if _proxied(url, parts.scheme, host):
        return
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise NotReached(
            f"no answer within {_seconds(timeout)} (connect_timeout): "
            "the connection was not accepted"
        ) from None
    try:
        if secure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # reachability only: the client verifies
            sock.settimeout(_left(deadline))
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except ssl.SSLError:
                return  # the server took part in a handshake: it is there
        host_header = f"[{host}]" if ":" in host else host
        request = f"GET /ping HTTP/1.1\r\nHost: {host_header}:{port}\r\nConnection: close\r\n\r\n"
        sock.settimeout(_left(deadline))
        sock.sendall(request.encode("ascii"))
        sock.settimeout(_left(deadline))
        if not sock.recv(1):
            raise NotReached("the connection was closed without an answer")
    except TimeoutError:
        raise NotReached(
            f"connected, but no answer within {_seconds(timeout)} (connect_timeout)"
        ) from None
    finally:
        sock.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _seconds(timeout: float) -> str:
    return f"{timeout:g} s" if not math.isinf(timeout) else "any time"


def _proxied(url: str, scheme: str, host: str) -> bool:
    """Whether the client would go through a proxy (the URL's ``http_proxy`` /
    ``https_proxy`` parameter, or the environment's, as clickhouse-connect reads them)."""
    query = parse_qs(urlsplit(url).query)
    if "http_proxy" in query or "https_proxy" in query:
        return True
    proxies = urllib.request.getproxies()
    return scheme in proxies and not urllib.request.proxy_bypass(host)


__all__ = ["NotReached", "probe"]
