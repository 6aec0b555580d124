"""The HTTP face of a running router: ``/metrics``, ``/status``, ``/healthz``,
and, when given, the dead-letter controls and ``/trace``.

A Starlette app served by hypercorn as one of the runtime's loop tasks, on
the Trio loop thread, so handlers read counters without crossing threads.
"""

from __future__ import annotations

import hmac
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

from taproute.routing.errors import IngressFull
from taproute.service.host.counters import ServiceSnapshot
from taproute.service.host.metrics import SnapshotCollector
from taproute.service.ops.controls import DeadLetterControls
from taproute.service.ops.dead_letters import DeadLetter, DeadLetterNotFound


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
        routes += _dead_letter_routes(controls)
    if trace is not None:
        routes.append(Route("/trace", _trace_endpoint(trace), methods=["POST"]))
    return Starlette(routes=routes)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _dead_letter_routes(controls: DeadLetterControls) -> list[Route]:
    store = controls.store

    def authorized(request: Request) -> JSONResponse | None:
        if controls.token is None:
            return _error(403, "mutating endpoints are disabled: no token is configured")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given, f"Bearer {controls.token}"):
            return _error(401, "a valid 'Authorization: Bearer <token>' header is required")
        return None

    def letter_id(request: Request) -> int | JSONResponse:
        raw = request.path_params["letter_id"]
        try:
            return int(raw)
        except ValueError:
            return _error(400, f"dead letter id must be an integer, got {raw!r}")

    async def list_letters(request: Request) -> JSONResponse:
        query = request.query_params
        try:
            older_than = float(query["older_than"]) if "older_than" in query else None
        except ValueError:
            return _error(400, f"older_than must be seconds, got {query['older_than']!r}")
        state = query.get("state", "dead")
        if state not in ("dead", "skipped", "rerouted", "all"):
            return _error(400, f"state must be dead, skipped, rerouted or all, got {state!r}")
        letters = await trio.to_thread.run_sync(
            lambda: store.list(
                route=query.get("route"),
                code=query.get("code"),
                older_than=older_than,
                state=None if state == "all" else state,  # type: ignore[arg-type]
            )
        )
        return JSONResponse([letter.summary() for letter in letters])

    async def show(request: Request) -> JSONResponse:
        ident = letter_id(request)
        if isinstance(ident, JSONResponse):
            return ident
        try:
            letter = await trio.to_thread.run_sync(store.get, ident)
        except DeadLetterNotFound as exc:
            return _error(404, str(exc))
        body = letter.summary()
        body["traceback"] = letter.traceback
        body["payload_bytes"] = len(letter.payload or b"")
        return JSONResponse(body)

    def mutation(action: Callable[[int], DeadLetter]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> JSONResponse:
            refused = authorized(request)
            if refused is not None:
                return refused
            ident = letter_id(request)
            if isinstance(ident, JSONResponse):
                return ident
            try:
                letter = await trio.to_thread.run_sync(action, ident)
            except DeadLetterNotFound as exc:
                return _error(404, str(exc))
            except IngressFull as exc:
                return _error(503, str(exc))
            return JSONResponse(letter.summary())

        return endpoint

    return [
        Route("/dead-letters", list_letters),
        Route("/dead-letters/{letter_id}", show),
        Route("/dead-letters/{letter_id}/skip", mutation(controls.skip), methods=["POST"]),
        # An HTTP request never waits for ingress room: a full ingress answers 503.
        Route(
            "/dead-letters/{letter_id}/reroute", mutation(controls.reroute_now), methods=["POST"]
        ),
    ]


def _trace_endpoint(trace: Callable[..., Any]) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, 'the body must be JSON: {"hook": ..., "key": ...}')
        if not isinstance(body, dict) or not isinstance(body.get("hook"), str):
            return _error(400, 'the body must name the hook: {"hook": "layers.0.q", ...}')
        fields = {k: v for k, v in body.items() if k != "hook"}
        try:
            result = trace(body["hook"], **fields)
        except (TypeError, ValueError) as exc:
            return _error(400, str(exc))
        return JSONResponse(attrs.asdict(result))

    return endpoint


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
