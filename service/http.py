"""The HTTP face of a running router: ``/metrics``, ``/status``, ``/healthz``.

A Starlette app served by hypercorn inside the runtime's own nursery, on the
Trio loop thread, so handlers read counters without crossing threads.
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

from taproute.actors.counters import RouterSnapshot
from taproute.service.metrics import SnapshotCollector


@attrs.frozen
class HttpConfig:
    """Where the HTTP endpoint listens (port 0: any free port)."""

    host: str = "127.0.0.1"
    port: int = 9464


def snapshot_as_json(snapshot: RouterSnapshot) -> dict[str, Any]:
    """The snapshot as plain JSON-able data."""
    return attrs.asdict(snapshot)


def build_app(snapshot: Callable[[], RouterSnapshot]) -> Starlette:
    """The ASGI app over a snapshot function."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def status(request: Request) -> JSONResponse:
        return JSONResponse(snapshot_as_json(snapshot()))

    async def healthz(request: Request) -> JSONResponse:
        failure = snapshot().failure
        if failure is not None:
            return JSONResponse({"status": "failed", "failure": failure}, status_code=503)
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/status", status),
            Route("/healthz", healthz),
        ]
    )


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
