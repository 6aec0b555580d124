"""The HTTP face of a running router: ``/metrics``, ``/status``, ``/healthz``,
and, when given, the operator endpoints (dead letters, ``/trace``: they live
in :mod:`taproute.service.ops.endpoints`).

A Starlette app served by hypercorn as one of the runtime's loop tasks, on
the Trio loop thread, so handlers read counters without crossing threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from taproute.service.host.counters import ServiceSnapshot
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.ops.controls import DeadLetterControls
from taproute.service.ops.endpoints import dead_letter_routes, trace_route


@attrs.frozen
class HttpConfig:
    """Where the HTTP endpoint listens (port 0: any free port).

    ``token``: the bearer token mutating endpoints (dead-letter skip and
    reroute) require; without one they are refused.
    """

    host: str = "127.0.0.1"
    port: int = 9464
    token: str | None = attrs.field(default=None, repr=False)


def snapshot_as_json(snapshot: ServiceSnapshot) -> dict[str, Any]:
    """The snapshot as plain JSON-able data."""
    return attrs.asdict(snapshot)


def build_app(
    snapshot: Callable[[], ServiceSnapshot],
    *,
    controls: DeadLetterControls | None = None,
    trace: Callable[..., Any] | None = None,
) -> Starlette:
    """The ASGI app over a snapshot function (and the operator controls, if given)."""
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
        routes.append(trace_route(trace))
    return Starlette(routes=routes)


async def serve_http(
    app: Starlette,
    config: HttpConfig,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status`` gets the bound URLs."""
    hypercorn_config = Config()
    hypercorn_config.bind = [f"{config.host}:{config.port}"]
    hypercorn_config.accesslog = None
    hypercorn_config.errorlog = None
    await serve(app, hypercorn_config, task_status=task_status)  # type: ignore[arg-type]
