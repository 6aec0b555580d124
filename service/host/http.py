"""The HTTP face of a running router: ``/metrics``, ``/status``, ``/healthz``,
and, when given, the operator endpoints (dead letters, ``/trace``: they live
in :mod:`taproute.service.ops.endpoints`).

A Starlette app served by hypercorn as one of the runtime's loop tasks, on
the Trio loop thread, so handlers read counters without crossing threads.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from taproute.routing.errors import ConfigError
from taproute.service.host.counters import ServiceSnapshot
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.ops.controls import DeadLetterControls
from taproute.service.ops.endpoints import (
    DEFAULT_MAX_BODY_BYTES,
    dead_letter_routes,
    json_error,
    reload_route,
    trace_route,
)


def _host_named(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    """An empty host would listen on every interface: say 0.0.0.0 to mean it."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f'HttpConfig {attribute.name} must name an address ("127.0.0.1", or '
            f'"0.0.0.0" for every interface), got {value!r}'
        )


def _token_sendable(
    _instance: object, attribute: attrs.Attribute[str | None], value: object
) -> None:
    """None (the mutating endpoints refused), or what a header can carry: an
    empty token made every request answer 401, as if the caller's were wrong."""
    if value is None:
        return
    if (
        not isinstance(value, str)
        or not value
        or not value.isascii()
        or not value.isprintable()
        or " " in value
    ):
        raise ConfigError(
            f"HttpConfig {attribute.name}: expected None or printable ASCII without spaces "
            f"(it is sent in a header), found {type(value).__name__} of length "
            f"{len(value) if isinstance(value, str) else '?'}"
        )


def _whole(low: int, high: int) -> Callable[[object, attrs.Attribute[int], object], None]:
    """An int (not a bool, not a float) in ``[low, high]``: a port of 1.5 or
    True reached the socket (TypeError, or "Name or service not known")."""

    def check(_instance: object, attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(
                f"HttpConfig {attribute.name} must be an int in [{low}, {high}], got {value!r}"
            )

    return check


@attrs.frozen(kw_only=True)
class HttpConfig:
    """Where the HTTP endpoint listens (port 0: any free port).

    ``token``: the bearer token mutating endpoints (dead-letter skip and
    reroute) require; without one they are refused.  ``max_body_bytes``: the
    largest request body accepted (``POST /trace``); a larger one gets 413
    before it is read into memory.
    """

    host: str = attrs.field(default="127.0.0.1", validator=_host_named)
    port: int = attrs.field(default=9464, validator=_whole(0, 65_535))
    token: str | None = attrs.field(default=None, repr=False, validator=_token_sendable)
    max_body_bytes: int = attrs.field(default=DEFAULT_MAX_BODY_BYTES, validator=_whole(1, 2**30))


def snapshot_as_json(snapshot: ServiceSnapshot) -> dict[str, Any]:
    """The snapshot as plain JSON-able data, with the age of the oldest open key
    over all stateful routes (None: none open) on top, where a leak shows first,
    and ``last_reload``: the reload asked last and what came of it (None: none)."""
    data = attrs.asdict(snapshot)
    ages = [r.oldest_open_key_age_s for r in snapshot.routes.values()]
    data["oldest_open_key_age_s"] = max((a for a in ages if a is not None), default=None)
    last = snapshot.last_reload
    data["last_reload"] = None if last is None else attrs.asdict(last)
    return data


def build_app(
    snapshot: Callable[[], ServiceSnapshot],
    *,
    controls: DeadLetterControls | None = None,
    trace: Callable[..., Any] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    reload: Callable[[float | None], Future[int]] | None = None,
    token: str | None = None,
) -> Starlette:
    """The ASGI app over a snapshot function (and the operator controls, if given).

    Every refusal, Starlette's own 404 and 405 included, is a 4xx with the
    JSON body ``{"error": "..."}``; a bug answers a JSON 500.  With ``reload``
    (it queues a reload, waiting for ingress room at most the seconds it is
    given, and returns its future), ``POST /reload`` calls it
    (``token``: the bearer token it requires) and waits for it within a
    bound (see :func:`~taproute.service.ops.endpoints.reload_route`).

    ``snapshot`` is called on the loop thread, once per request: the
    handlers answer between two batches of a saturated router (the loop's
    tasks hand it over every millisecond or so, ``actors/fairness.py``).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def status(request: Request) -> JSONResponse:
        return JSONResponse(snapshot_as_json(snapshot()))

    async def healthz(request: Request) -> JSONResponse:
        snap = snapshot()
        if snap.failure is not None:
            return JSONResponse({"status": "failed", "failure": snap.failure}, status_code=503)
        down = {
            d.name: {"since": d.unhealthy_since, "reason": d.unhealthy_reason}
            for d in snap.destinations.values()
            if d.healthy == 0
        }
        if down:
            # A destination is unreachable (its batches spool, or its sink still
            # retries): degraded, not failed.
            return JSONResponse({"status": "degraded", "unhealthy_destinations": down})
        ingress = snap.ingress
        if ingress.dropped or ingress.shed:
            # Capture lost records but the model keeps serving: degraded, not down.
            return JSONResponse(
                {"status": "degraded", "dropped": ingress.dropped, "shed": ingress.shed}
            )
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/metrics", metrics),
        Route("/status", status),
        Route("/healthz", healthz),
    ]
    if controls is not None:
        routes += dead_letter_routes(controls)
    if trace is not None:
        routes.append(trace_route(trace, max_body_bytes))
    if reload is not None:

        def queued() -> dict[str, int]:
            snap = snapshot()
            return {
                "running_generation": snap.generation,
                "queued_reloads": snap.ingress.queued_reloads,
            }

        routes.append(reload_route(reload, token, queued))
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return json_error(exc.status_code, exc.detail)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return json_error(500, f"internal error: {type(exc).__name__}")


def _check_listen(config: HttpConfig) -> None:
    """Bind the address once before hypercorn does, so that failing says which
    address (hypercorn's own error is the bare ``[Errno 98] Address already in
    use``, with several services in a process no clue which endpoint)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn
            probe.bind((config.host, config.port))
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"HTTP endpoint: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
        ) from None


async def serve_http(
    app: Starlette,
    config: HttpConfig,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status`` gets the bound URLs.

    An address that cannot be listened on raises :class:`OSError` naming it
    (``cannot listen on 127.0.0.1:9464: Address already in use``)."""
    _check_listen(config)
    hypercorn_config = Config()
    hypercorn_config.bind = [f"{config.host}:{config.port}"]
    hypercorn_config.accesslog = None
    hypercorn_config.errorlog = None
    await serve(app, hypercorn_config, task_status=task_status)  # type: ignore[arg-type]
