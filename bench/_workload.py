"""Record shapes and batches the bench scripts share, and the peers a
competent user would write instead of taproute (bench: not a script).

Shapes are real captures, not only blobs: a MiniLM hidden state per token
(384 float32), a GPT-2 one (768 float32), a MiniLM layer's activations for a
whole 64-token sequence (384 x 64 float32), and the 1 KiB blob of earlier
benches for comparison.

Every peer does the same work as taproute's route into a :class:`CopySink`:
group the batch's records by output_id with one numpy pass, and hand each
group to its destinations, which copy the records' bytes once.
"""
# bench: not a script

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from taproute.service import Layout, RecordSchema, Route, RoutingConfig, RoutingSink
from taproute.service import make_descriptors as _make_descriptors

#: name -> (float32 per record, description)
SHAPES: dict[str, tuple[int, str]] = {
    "blob_1KiB": (256, "1 KiB blob (256 float32)"),
    "minilm_token": (384, "MiniLM hidden state, one token (384 float32, 1.5 KiB)"),
    "gpt2_token": (768, "GPT-2 hidden state, one token (768 float32, 3 KiB)"),
    "minilm_seq64": (384 * 64, "MiniLM layer output, one 64-token sequence (96 KiB)"),
}


def layout_for(shape: str) -> Layout:
    floats = SHAPES[shape][0]
    return Layout(shape, [("values", "Array(Float32)", (floats,))])


def schema_for(*shapes: str) -> RecordSchema:
    return RecordSchema([layout_for(s) for s in shapes])


def payloads(shape: str, per_batch: int, distinct: int = 4, seed: int = 0) -> list[np.ndarray]:
    """``distinct`` payload buffers of ``per_batch`` records each (reused
    round-robin, so the data set is not all in cache but the run does not
    allocate)."""
    floats = SHAPES[shape][0]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(per_batch * floats, dtype=np.float32) for _ in range(distinct)]


def descriptors(
    output_ids: int | np.ndarray,
    shape: str,
    count: int,
    *,
    keys: np.ndarray | None = None,
    timestamps_ns: Any = None,
) -> np.ndarray:
    record = SHAPES[shape][0] * 4
    kwargs: dict[str, Any] = {"count": count, "layout_ids": 0}
    if keys is not None:
        kwargs["keys"] = keys
    if timestamps_ns is not None:
        kwargs["timestamps_ns"] = timestamps_ns
    return _make_descriptors(output_ids, record, **kwargs)


# -- the destination's work, shared by taproute's CopySink and every peer ----


class Copier:
    """Copies records' bytes into its own buffer once (the work of any
    destination that serializes or persists)."""

    def __init__(self) -> None:
        self.records = 0
        self.bytes = 0
        self.scratch: np.ndarray | None = None

    def __call__(self, desc: np.ndarray, payload: Any) -> None:
        self.records += len(desc)
        self.bytes += copy_records(desc, payload, self)


def copy_records(desc: np.ndarray, payload: Any, into: Any) -> int:
    """Copy the bytes of the records ``desc`` describes in ``payload`` into
    ``into.scratch`` (grown as needed); returns bytes copied.  One copy when
    the records cover the buffer in order, a numpy gather otherwise."""
    data = np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
    if len(desc) == 0:
        return 0
    offsets = desc["offset"]
    lengths = desc["length"]
    total = int(lengths.sum())
    if int(offsets[0]) == 0 and total == data.nbytes:
        source = data
    else:
        width = int(lengths[0])
        rows = data[: (data.nbytes // width) * width].reshape(-1, width)
        if np.all(offsets % width == 0):
            source = rows[offsets // width]  # fixed-size records: one fancy-index gather
        else:
            index = offsets.astype(np.int64)[:, None] + np.arange(width)
            source = data[index]
        source = source.reshape(-1)
    return copy_into(into, source)


def copy_into(into: Any, source: np.ndarray) -> int:
    """One ``np.copyto`` of ``source`` (bytes) into ``into.scratch``."""
    scratch = into.scratch
    if scratch is None or scratch.nbytes < source.nbytes:
        scratch = into.scratch = np.empty(max(source.nbytes, 1), dtype=np.uint8)
    np.copyto(scratch[: source.nbytes], source)
    return int(source.nbytes)


class CopySink:
    """taproute destination doing a :class:`Copier`'s work on every batch it
    gets (raw records: their payload bytes; processed rows: the rows)."""

    def __init__(self) -> None:
        self.copier = Copier()

    @property
    def records(self) -> int:
        return self.copier.records

    async def submit(self, batch: Any) -> None:
        rows = getattr(batch, "rows", None)
        if rows is not None:  # processed rows: the destination copies them
            self.copier.records += len(rows)
            self.copier.bytes += copy_into(self.copier, rows.view(np.uint8).reshape(-1))
            return
        self.copier(batch.descriptors, batch.payload)

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


# -- taproute ---------------------------------------------------------------


def routing_sink(
    schema: RecordSchema,
    table: Mapping[str, Sequence[str]],
    destinations: Mapping[str, Any],
    **routes_kwargs: Any,
) -> RoutingSink:
    """Forward routes: ``{hook pattern: [destination, ...]}`` (one route per pair)."""
    routes = [
        Route(f"r{i}_{j}", pattern, dest, **routes_kwargs)
        for i, (pattern, dests) in enumerate(table.items())
        for j, dest in enumerate(dests)
    ]
    return RoutingSink(RoutingConfig(routes), schema, dict(destinations), unmatched="drop")


# -- peers --------------------------------------------------------------------


class Dispatch:
    """What a numpy user writes: a table output_id -> destinations, and per
    batch one grouping pass (the whole batch when it has one output_id)."""

    def __init__(self, table: Mapping[int, Sequence[Callable[[np.ndarray, Any], None]]]) -> None:
        self.table = {k: list(v) for k, v in table.items()}

    def __call__(self, desc: np.ndarray, payload: Any) -> None:
        ids = desc["output_id"]
        first = int(ids[0])
        if bool(np.all(ids == first)):
            for dest in self.table.get(first, ()):
                dest(desc, payload)
            return
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        uniq, starts = np.unique(sorted_ids, return_index=True)
        ends = [*starts[1:].tolist(), len(ids)]
        for oid, start, end in zip(uniq.tolist(), starts.tolist(), ends, strict=True):
            dests = self.table.get(oid)
            if dests:
                part = desc[order[start:end]]
                for dest in dests:
                    dest(part, payload)


def run_inline(dispatch: Callable[[np.ndarray, Any], None], batches: Sequence[tuple]) -> None:
    """Peer: dispatch each batch in the producer's own thread."""
    for desc, payload in batches:
        dispatch(desc, payload)


def run_thread_queue(
    dispatch: Callable[[np.ndarray, Any], None], batches: Sequence[tuple], depth: int = 64
) -> None:
    """Peer: a consumer thread fed a bounded ``queue.Queue`` of batches;
    returns once the consumer has handled everything (its "flush")."""
    q: queue.Queue[tuple | None] = queue.Queue(maxsize=depth)

    def consume() -> None:
        while (item := q.get()) is not None:
            dispatch(*item)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    for batch in batches:
        q.put(batch)
    q.put(None)
    thread.join()


def run_asyncio(
    dispatch: Callable[[np.ndarray, Any], None], batches: Sequence[tuple], depth: int = 64
) -> None:
    """Peer: asyncio, a consumer task fed a bounded ``asyncio.Queue`` of
    batches by a producer coroutine on the same loop."""

    async def main() -> None:
        q: asyncio.Queue[tuple | None] = asyncio.Queue(maxsize=depth)

        async def consume() -> None:
            while (item := await q.get()) is not None:
                dispatch(*item)

        task = asyncio.create_task(consume())
        for batch in batches:
            await q.put(batch)
        await q.put(None)
        await task

    asyncio.run(main())


PEERS: dict[str, Callable[..., None]] = {
    "numpy dispatch (inline)": run_inline,
    "thread + queue.Queue of batches": run_thread_queue,
    "asyncio + Queue of batches": run_asyncio,
}
