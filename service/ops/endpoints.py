"""The operator endpoints: dead letters (list, show, skip, reroute) and ``/trace``.

Starlette routes over :class:`~taproute.service.ops.controls.DeadLetterControls`
and a sink's ``trace``; the host's HTTP app mounts them next to ``/metrics``.
Mutations need the configured bearer token; without one they are refused.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import attrs
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from taproute.routing.errors import IngressFull
from taproute.service.ops.controls import DeadLetterControls
from taproute.service.ops.dead_letters import DeadLetter, DeadLetterNotFound


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def dead_letter_routes(controls: DeadLetterControls) -> list[Route]:
    """``/dead-letters`` (list, show) and its skip / reroute mutations (bearer token)."""
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


def trace_route(trace: Callable[..., Any]) -> Route:
    """``POST /trace``: where a record would go, and why (a dry run)."""
    return Route("/trace", _trace_endpoint(trace), methods=["POST"])


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
