"""The destination contract every sink fulfils."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from taproute.routing.batch import Batch


@runtime_checkable
class RecordSink(Protocol):
    """Where batches go: ClickHouse, a capture buffer, another routing sink.

    All three methods are awaited on the Trio loop, one at a time per sink:

    - ``submit(batch)`` takes one batch (a raw ``RecordBatch`` or processed
      ``RowBatch``).  A sink that keeps a ``RecordBatch`` past the call must
      ``batch.retain()`` it (and release later); otherwise the producer may
      reuse the buffer as soon as every holder returns.  Slow work (network,
      disk) belongs in a worker thread, not on the loop.
    - ``flush()`` returns once everything submitted before it is durable in
      the destination, or raises.
    - ``close()`` flushes and frees resources; nothing may be submitted after.
    """

    async def submit(self, batch: Batch) -> None: ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...
