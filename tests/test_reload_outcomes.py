"""What came of a reload whose caller stopped waiting: a swap refused after
``runtime.reload(timeout=)`` raised ``TimeoutError`` used to show only as
``ingress.queued_reloads`` dropping with ``generation`` unchanged.  It now
shows as ``refused``, with its cause, in ``last_reload`` (``counters()``,
``/status``) and in ``taproute_config_reloads_refused_total``
(``/metrics``); a later good reload shows ``applied``.  The refused swap
leaves the running generation routing and loses nothing accepted before,
during or after it.

The destination that fails to open is real: a ClickHouse server destination
whose port nobody listens on (connection refused), first routed to by the
reload.  What keeps the reload queued past its caller's wait is the running
destination holding its first batch (its mailbox takes a few batches, so the
record worker and the reload's control wait behind it)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import trio

from taproute.native import make_descriptors
from taproute.routing import Batch, PlanErrors, Route, RoutingConfig
from taproute.service import (
    CaptureSink,
    ClickHouseSink,
    RoutingSink,
    create_record_runtime,
)
from tests.processors import SCHEMA

Q = "layers.0.q"

#: A ClickHouse server nobody listens for: opening a destination there fails
#: at once (connection refused).
DOWN_URL = "http://127.0.0.1:1/default?connect_timeout=1"

#: Records per batch, and batches submitted before the reload: more than the
#: held destination's mailbox (DESTINATION_CAPACITY records) and its held
#: batch take, so the record worker waits and the reload queues behind.
BATCH = 256
BEFORE_BATCHES = 8
DESTINATION_CAPACITY = 1024


class HeldCapture(CaptureSink):
    """A capture destination whose submits wait (in a worker thread) until
    ``release`` is set; ``entered`` once the first one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    async def submit(self, batch: Batch) -> None:
        if not self.release.is_set():
            self.entered.set()
            await trio.to_thread.run_sync(self.release.wait, abandon_on_cancel=True)
        await super().submit(batch)


def submit(runtime, output_id: int, seqs: range) -> None:
    """``seqs`` as records of ``output_id``, in batches of :data:`BATCH`."""
    for start in range(seqs.start, seqs.stop, BATCH):
        part = np.arange(start, min(start + BATCH, seqs.stop))
        runtime.submit_batch(
            make_descriptors(
                output_id, 16, count=len(part), layout_ids=SCHEMA.layout_id("vec"), seqs=part
            ),
            np.zeros((len(part), 4), np.float32),
        )


def down() -> ClickHouseSink:
    """The destination the refused reload routes to first: it fails to open."""
    return ClickHouseSink.server(SCHEMA, DOWN_URL, raw=["vec"])


def delivered_once(capture: CaptureSink, count: int) -> bool:
    seqs = capture.descriptors()["seq"].tolist()
    return len(seqs) == count and sorted(seqs) == list(range(count))


def test_a_swap_refused_after_the_callers_wait_shows_in_the_snapshot_and_loses_nothing():
    ch = HeldCapture()
    sink = RoutingSink(
        RoutingConfig([Route("raw", Q, "ch")]),
        SCHEMA,
        {"ch": ch, "down": down},
        unmatched="drop",
        destination_capacity=DESTINATION_CAPACITY,
    )
    with create_record_runtime(record_sink=sink) as runtime:
        q = runtime.bind_hook(Q, layout="vec")
        snap = runtime.counters()
        assert snap.last_reload is None and snap.reloads.last_successful
        before = range(0, BEFORE_BATCHES * BATCH)
        try:
            submit(runtime, q, before)
            assert ch.entered.wait(60)
            # Checked (the destination exists), queued behind the held
            # records; the caller stops waiting, the reload goes on.
            with pytest.raises(TimeoutError):
                runtime.reload(
                    RoutingConfig([Route("raw", Q, "ch"), Route("copy", Q, "down")]),
                    timeout=0.2,
                )
            snap = runtime.counters()
            pending = snap.last_reload
            assert pending is not None
            assert (pending.outcome, pending.routes, pending.running_generation) == (
                "pending",
                ("raw", "copy"),
                1,
            )
            assert pending.settled_at is None and pending.source is None
            assert snap.ingress.queued_reloads == 1
            during = range(before.stop, before.stop + 2 * BATCH)
            submit(runtime, q, during)  # queued behind the reload
        finally:
            ch.release.set()
        runtime.flush()  # behind the reload: it ran (and was refused) before
        snap = runtime.counters()
        refused = snap.last_reload
        assert refused is not None and refused.id == pending.id
        assert refused.outcome == "refused" and refused.generation is None
        assert refused.settled_at is not None and refused.settled_at >= refused.requested_at
        # The cause, naming the destination that failed to open and why.
        assert "cannot reach ClickHouse server at http://127.0.0.1:1/default" in refused.error
        (problem,) = refused.problems
        assert problem.startswith(
            "destinations.down: destination 'down': cannot reach ClickHouse server at "
            "http://127.0.0.1:1/default (to connect): "
        ), problem
        assert (snap.reloads.applied, snap.reloads.refused, snap.reloads.not_queued) == (0, 1, 0)
        assert not snap.reloads.last_successful
        # The running generation goes on, routing as before.
        assert (snap.generation, snap.ingress.queued_reloads, list(snap.routes)) == (1, 0, ["raw"])
        after = range(during.stop, during.stop + 2 * BATCH)
        submit(runtime, q, after)
        runtime.flush()
        assert delivered_once(ch, after.stop)

        # A configuration with problems is refused at its check, and kept too.
        with pytest.raises(PlanErrors):
            runtime.reload(
                RoutingConfig(
                    [
                        Route("x", Q, "nowhere"),
                        Route("y", Q, "ch", mode="stateless", processor="no.such"),
                    ]
                )
            )
        checked = runtime.counters().last_reload
        assert checked is not None and checked.outcome == "refused"
        assert checked.id == refused.id + 1 and checked.routes == ("x", "y")
        assert any(p.startswith("routes[0]: ") and "'nowhere'" in p for p in checked.problems)

        # A later good reload shows applied, with the generation it became.
        assert runtime.reload(RoutingConfig([Route("raw", Q, "ch")])) == 2
        submit(runtime, q, range(after.stop, after.stop + BATCH))
        runtime.flush()
        snap = runtime.counters()
        applied = snap.last_reload
        assert applied is not None
        assert (applied.id, applied.outcome, applied.generation) == (checked.id + 1, "applied", 2)
        assert applied.running_generation == 1 and applied.error is None
        assert [r.outcome for r in snap.reloads.recent] == ["refused", "refused", "applied"]
        assert (snap.reloads.applied, snap.reloads.refused) == (1, 2)
        assert snap.reloads.last_successful
    assert delivered_once(ch, after.stop + BATCH)
