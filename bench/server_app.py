"""The example inference server's HTTP endpoints (Starlette), over
:class:`bench.inference_server.InferenceServer`'s batchers and models."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from bench.inference_server import InferenceServer

MAX_INPUTS = 64


class BadRequest(Exception):
    """A request body the server cannot serve; the message says what and where."""


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, found {type(body).__name__}")
    return body


def build_app(server: InferenceServer) -> Starlette:
    """``/embed``, ``/generate``, ``/metrics``, ``/admin/flush``, ``/healthz``."""
    from bench.inference_server import EmbedRequest, GenerateRequest

    metrics = server._metrics
    models = server.models
    limit = server.config.max_new_tokens_limit
    positions = server.config.gpt2.positions

    def answered(endpoint: str, status: int, started: float) -> None:
        metrics["requests"].labels(endpoint, str(status)).inc()
        metrics["latency"].labels(endpoint).observe(time.perf_counter() - started)

    async def embed(request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await _body(request)
            texts = body.get("input")
            if isinstance(texts, str):
                texts = [texts]
            if (
                not isinstance(texts, list)
                or not texts
                or not all(isinstance(t, str) and t for t in texts)
            ):
                raise BadRequest('"input" must be a non-empty string or list of non-empty strings')
            if len(texts) > MAX_INPUTS:
                raise BadRequest(f'"input" has {len(texts)} items; at most {MAX_INPUTS}')
        except BadRequest as exc:
            answered("embed", 400, started)
            return JSONResponse({"error": str(exc)}, status_code=400)
        request_id = server.next_id()
        vectors, tokens = await server.embedder.submit(
            EmbedRequest(request_id, tuple(texts)), size=len(texts)
        )
        metrics["tokens"].labels("embed", "prompt").inc(tokens)
        answered("embed", 200, started)
        return JSONResponse(
            {
                "id": request_id,
                "object": "list",
                "model": "all-MiniLM-L6-v2",
                "data": [
                    {"object": "embedding", "index": i, "embedding": v.tolist()}
                    for i, v in enumerate(vectors)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def generate(request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await _body(request)
            prompt, new = body.get("prompt"), body.get("max_new_tokens", 16)
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest('"prompt" must be a non-empty string')
            if not isinstance(new, int) or isinstance(new, bool) or not 1 <= new <= limit:
                raise BadRequest(
                    f'"max_new_tokens" must be an integer in [1, {limit}], got {new!r}'
                )
            ids = models.tokenize(prompt)
            if len(ids) + new > positions:
                raise BadRequest(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({new}) exceeds the "
                    f"model's {positions} positions"
                )
        except BadRequest as exc:
            answered("generate", 400, started)
            return JSONResponse({"error": str(exc)}, status_code=400)
        request_id = server.next_id()
        tokens = await server.generator.submit(GenerateRequest(request_id, tuple(ids), new))
        metrics["tokens"].labels("generate", "prompt").inc(len(ids))
        metrics["tokens"].labels("generate", "generated").inc(len(tokens))
        answered("generate", 200, started)
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "model": "gpt2-random",
                "token_ids": tokens,
                "text": models.tokenizer.decode(tokens),
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(tokens),
                    "total_tokens": len(ids) + len(tokens),
                },
            }
        )

    def metrics_text(_request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    async def flush(_request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(server.flush))

    async def healthz(_request: Request) -> Response:
        failure = server.capture.runtime.failure if server.capture is not None else None
        return JSONResponse({"ok": failure is None}, status_code=200 if failure is None else 503)

    return Starlette(
        routes=[
            Route("/embed", embed, methods=["POST"]),
            Route("/generate", generate, methods=["POST"]),
            Route("/metrics", metrics_text, methods=["GET"]),
            Route("/admin/flush", flush, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )
