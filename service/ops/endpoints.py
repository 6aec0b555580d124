"""The operator endpoints: dead letters (list, show, skip, reroute) and ``/trace``.

Starlette routes over :class:`~taproute.service.ops.controls.DeadLetterControls`
and a sink's ``trace``; the host's HTTP app mounts them next to ``/metrics``.
Mutations need the configured bearer token; without one they are refused.
"""

from __future__ import annotations

import hmac
import json
import math
import sqlite3
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from typing import Any

import attrs
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from taproute.routing.errors import (
    ConfigError,
    IngressFull,
    RerouteRefused,
    RoutingFailure,
    SinkClosed,
    TaprouteError,
    problem_lines,
)
from taproute.service.ops.controls import DeadLetterControls
from taproute.service.ops.dead_letters import DeadLetter, DeadLetterNotFound

#: Request bodies past this many bytes are refused with 413 (``HttpConfig.max_body_bytes``).
DEFAULT_MAX_BODY_BYTES = 2**20

#: Dead-letter ids are SQLite rowids: positive int64.
_MAX_LETTER_ID = 2**63 - 1


def json_error(status: int, message: str) -> JSONResponse:
    """The one error shape of every endpoint: ``{"error": message}`` with ``status``."""
    return JSONResponse({"error": message}, status_code=status)


def unknown_parameters(request: Request, known: tuple[str, ...]) -> JSONResponse | None:
    """A 400 naming the query parameters ``request`` has beyond ``known``, or
    one it gives more than once, or None: a mistyped filter or option is
    refused, never silently ignored, and neither is a repeated one (which
    value was meant?)."""
    query = request.query_params
    unknown = sorted(set(query) - set(known))
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        takes = ", ".join(known) or "none"
        return json_error(
            400, f"unknown query parameter {names} for {request.url.path} (it takes: {takes})"
        )
    for name in sorted(set(query)):
        if len(given := query.getlist(name)) > 1:
            return json_error(
                400, f"query parameter {name!r} given {len(given)} times for {request.url.path}"
            )
    return None


class RouteNotTaken(ValueError):
    """A ``route=`` where the endpoint takes none."""


class BodyTooLarge(Exception):
    """A request body past the configured limit."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (:class:`BodyTooLarge`) past ``limit`` bytes.

    A declared ``Content-Length`` over the limit is refused before reading;
    otherwise the body is read in chunks and refused as soon as it passes the
    limit, so a large body never sits in memory whole.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def bearer_refusal(token: str | None, request: Request) -> JSONResponse | None:
    """Why a mutating request is refused (403: no token configured; 401: no or
    a wrong ``Authorization: Bearer`` header), or None when it may go on."""
    if token is None:
        return json_error(403, "mutating endpoints are disabled: no token is configured")
    # Compared as bytes: a header may carry any latin-1 byte, and
    # compare_digest refuses non-ASCII str.
    given = request.headers.get("authorization", "").encode("latin-1")
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        return json_error(401, "a valid 'Authorization: Bearer <token>' header is required")
    return None


class NoReloader(TaprouteError, LookupError):
    """The service has no configuration file to reload from."""


#: How long ``POST /reload`` waits for its swap by default before it answers
#: 202 (the reload stays queued): well within an HTTP client's usual timeout.
RELOAD_WAIT_S = 5.0

#: The longest ``?wait=`` a ``POST /reload`` takes (seconds).
MAX_RELOAD_WAIT_S = 3600.0


def reload_route(
    reload: Callable[[float | None], Future[int]],
    token: str | None,
    queued: Callable[[], dict[str, int]],
    *,
    wait_s: float = RELOAD_WAIT_S,
) -> Route:
    """``POST /reload[?wait=SECONDS]`` (bearer token): reload the service from
    its config file.

    ``reload(seconds)`` checks the file and queues its generation's swap
    (waiting for ingress room at most ``seconds``) behind the
    records submitted before (raising at once when the file is refused); the
    swap runs once those are handed on, which on a saturated router is what
    its ingress holds, for as long as the destinations take.  The answer
    waits for it ``wait`` seconds at most (``wait_s`` by default): 200
    ``{"generation": n}`` once the new generation routes; 202 ``{"status":
    "queued", ...}`` (with ``queued()``: the generation routing now and the
    reloads queued; ``reload_id`` when the future has one) when it is still
    queued then, and it goes on: ``/status`` shows it (``generation``,
    ``ingress.queued_reloads``), and what came of it, a refusal at the swap
    with its cause (``last_reload``, ``reloads.recent`` by ``id``).  422 with every
    problem (``{"error": ..., "problems": [...]}``) when the file, or the
    swap within the wait, refused it, the running generation going on; 503
    when ingress stayed full for the whole wait, so the swap could not even
    be queued (nothing changes; try again), or when the runtime has failed
    or is closing (it takes no reload); 404 when the service has no file.
    """

    async def endpoint(request: Request) -> JSONResponse:
        refused = bearer_refusal(token, request)
        if refused is not None:
            return refused
        unknown = unknown_parameters(request, ("wait",))
        if unknown is not None:  # an option it does not take: refused, not ignored
            return unknown
        wait = _seconds(request.query_params.get("wait"), wait_s, MAX_RELOAD_WAIT_S)
        if isinstance(wait, str):
            return json_error(400, f"wait: {wait}")
        started = trio.current_time()
        try:
            # The wait bounds the whole answer: ingress room for the swap's
            # control first (a stalled router's full ingress), then the swap.
            future = await trio.to_thread.run_sync(reload, wait)
        except NoReloader as exc:
            return json_error(404, str(exc))
        except ConfigError as exc:
            return _reload_refused(exc)
        # Which reload this is in /status (``last_reload.id``, ``reloads.recent``),
        # where what comes of it after this answer shows.
        reload_id = getattr(future, "reload_id", None)
        named = {} if reload_id is None else {"reload_id": reload_id}
        left = max(0.0, wait - (trio.current_time() - started))
        if not await _settled(future, left):
            return JSONResponse({"status": "queued", **named, **queued()}, status_code=202)
        try:
            number = future.result()
        except ConfigError as exc:  # refused at its swap (a destination that cannot open)
            return _reload_refused(exc)
        except TimeoutError as exc:  # no ingress room within the wait: never queued
            return JSONResponse(
                {
                    "error": f"reload not queued: {exc}; the running generation goes on, "
                    "try again (with a longer ?wait=)",
                    **named,
                    **queued(),
                },
                status_code=503,
            )
        except (RoutingFailure, SinkClosed) as exc:
            # The runtime has failed (its first failure latched) or is
            # closing: it takes no reload. It answered a bare 500.
            return JSONResponse(
                {
                    "error": f"reload refused: the runtime takes no reload now: {exc}",
                    **named,
                    **queued(),
                },
                status_code=503,
            )
        except Exception as exc:  # refused at its swap otherwise (a destination's factory)
            return _reload_refused(exc)
        return JSONResponse({"generation": number})

    return Route("/reload", endpoint, methods=["POST"])


def _seconds(given: str | None, default: float, most: float) -> float | str:
    """A query parameter as seconds in ``[0, most]`` (``default`` when not
    given), or why it is refused."""
    if given is None:
        return default
    try:
        value = float(given)
    except ValueError:
        value = math.nan
    if not 0 <= value <= most:  # NaN and infinities too
        return f"expected seconds in [0, {most:g}], found {given!r}"
    return value


async def _settled(future: Future[Any], wait: float) -> bool:
    """Whether ``future`` (settled in another thread) is done within ``wait`` seconds."""
    if future.done() or wait <= 0:
        return future.done()
    settled = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def wake(_: Future[Any]) -> None:
        with suppress(trio.RunFinishedError):  # the loop ended: nobody waits any more
            token.run_sync_soon(settled.set)

    future.add_done_callback(wake)
    with trio.move_on_after(wait):
        await settled.wait()
    return future.done()


def _reload_refused(exc: Exception) -> JSONResponse:
    """422 with every problem of a refused reload, at its key path, and the file."""
    problems = problem_lines(exc)
    body: dict[str, object] = {
        "error": "reload refused; the running generation goes on",
        "problems": problems,
    }
    path = getattr(exc, "path", None)
    if path is not None:  # the file the problems' key paths are in
        body["file"] = str(path)
    return JSONResponse(body, status_code=422)


def dead_letter_routes(controls: DeadLetterControls) -> list[Route]:
    """``/dead-letters`` (list, show) and its skip / reroute mutations (bearer token).

    A store SQLite cannot use now (locked by another process past its busy
    timeout, read-only, damaged) answers 503 naming the file and SQLite's
    reason: the request changed nothing and may be tried again."""
    store = controls.store

    def unavailable(exc: sqlite3.Error) -> JSONResponse:
        return json_error(
            503,
            f"dead-letter store {store.path} cannot be used now: {type(exc).__name__}: {exc} "
            "(locked by another process, read-only or damaged?); nothing was changed",
        )

    def authorized(request: Request) -> JSONResponse | None:
        return bearer_refusal(controls.token, request)

    def letter_id(request: Request) -> int | JSONResponse:
        raw = request.path_params["letter_id"]
        try:
            ident = int(raw)
        except ValueError:
            return json_error(400, f"dead letter id must be an integer, got {raw!r}")
        if not 1 <= ident <= _MAX_LETTER_ID:
            return json_error(400, f"dead letter id must be in [1, {_MAX_LETTER_ID}], got {raw}")
        return ident

    async def list_letters(request: Request) -> JSONResponse:
        query = request.query_params
        unknown = unknown_parameters(request, ("code", "older_than", "route", "state"))
        if unknown is not None:
            return unknown
        try:
            older_than = float(query["older_than"]) if "older_than" in query else None
        except ValueError:
            return json_error(400, f"older_than must be seconds, got {query['older_than']!r}")
        if older_than is not None and not 0 <= older_than < math.inf:
            return json_error(
                400, f"older_than must be a finite number of seconds >= 0, got {older_than}"
            )
        state = query.get("state", "dead")
        if state not in ("dead", "skipped", "rerouted", "all"):
            return json_error(400, f"state must be dead, skipped, rerouted or all, got {state!r}")
        try:
            letters = await trio.to_thread.run_sync(
                lambda: store.list(
                    route=query.get("route"),
                    code=query.get("code"),
                    older_than=older_than,
                    state=None if state == "all" else state,  # type: ignore[arg-type]
                )
            )
        except sqlite3.Error as exc:
            return unavailable(exc)
        return JSONResponse([letter.summary() for letter in letters])

    async def show(request: Request) -> JSONResponse:
        ident = letter_id(request)
        if isinstance(ident, JSONResponse):
            return ident
        unknown = unknown_parameters(request, ())
        if unknown is not None:
            return unknown
        try:
            letter = await trio.to_thread.run_sync(store.get, ident)
        except DeadLetterNotFound as exc:
            return json_error(404, str(exc))
        except sqlite3.Error as exc:
            return unavailable(exc)
        body = letter.summary()
        body["traceback"] = letter.traceback
        body["payload_bytes"] = len(letter.payload or b"")
        return JSONResponse(body)

    def skip(ident: int, route: str | None) -> DeadLetter:
        if route is not None:
            raise RouteNotTaken("route= applies to reroute, not skip")
        return controls.skip(ident)

    def mutation(action: Callable[[int, str | None], DeadLetter]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> JSONResponse:
            refused = authorized(request)
            if refused is not None:
                return refused
            ident = letter_id(request)
            if isinstance(ident, JSONResponse):
                return ident
            unknown = unknown_parameters(request, ("route",))
            if unknown is not None:  # a mistyped ?route= must not reroute to the old route
                return unknown
            routes = request.query_params.getlist("route")
            if routes == [""]:  # an unset variable must not reroute to the old route
                return json_error(400, "route= must name a route (leave it out for the old one)")
            route = routes[0] if routes else None
            try:
                letter = await trio.to_thread.run_sync(action, ident, route)
            except DeadLetterNotFound as exc:
                return json_error(404, str(exc))
            except (IngressFull, SinkClosed) as exc:  # full, or closing: try again later
                return json_error(503, str(exc))
            except RerouteRefused as exc:  # already rerouted / skipped / no route takes it
                return json_error(409, str(exc))
            except RouteNotTaken as exc:
                return json_error(400, str(exc))
            except sqlite3.Error as exc:
                return unavailable(exc)
            return JSONResponse(letter.summary())

        return endpoint

    return [
        Route("/dead-letters", list_letters),
        Route("/dead-letters/{letter_id}", show),
        Route("/dead-letters/{letter_id}/skip", mutation(skip), methods=["POST"]),
        # An HTTP request never waits for ingress room: a full ingress answers 503;
        # ``?route=NAME`` sends the copy to that route instead of the one that failed it.
        Route(
            "/dead-letters/{letter_id}/reroute", mutation(controls.reroute_now), methods=["POST"]
        ),
    ]


def trace_route(trace: Callable[..., Any], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Route:
    """``POST /trace``: where a record would go, and why (a dry run).

    The body is bounded (413 past ``max_body_bytes``) and parsed in a worker
    thread, so no request can hold the loop the routes run on.
    """
    return Route("/trace", _trace_endpoint(trace, max_body_bytes), methods=["POST"])


def _trace_endpoint(trace: Callable[..., Any], max_body_bytes: int) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> JSONResponse:
        unknown = unknown_parameters(request, ())  # the record is the body's
        if unknown is not None:
            return unknown
        try:
            raw = await read_body(request, max_body_bytes)
        except BodyTooLarge as exc:
            return json_error(413, str(exc))
        try:
            body = await trio.to_thread.run_sync(_parse_json, raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError included
            return json_error(400, f'the body must be JSON {{"hook": ..., "key": ...}}: {exc}')
        if not isinstance(body, dict) or not isinstance(body.get("hook"), str):
            return json_error(400, 'the body must name the hook: {"hook": "layers.0.q", ...}')
        fields = {k: v for k, v in body.items() if k != "hook"}
        try:
            result = trace(body["hook"], **fields)
        except (TypeError, ValueError, LookupError, TaprouteError) as exc:
            return json_error(400, str(exc))
        return JSONResponse(attrs.asdict(result))

    return endpoint
