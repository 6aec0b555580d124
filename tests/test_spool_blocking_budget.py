"""A spool at its quota with ``when_full = "block"`` waits no longer than the
capture blocking budget where one exists: the runtime's ``max_block`` is
handed to each spooling destination as it is opened, and bounds the wait
unless the spool's own ``block_timeout`` is set."""

from __future__ import annotations

import math

import pytest
import trio

from taproute.routing import RoutingConfig
from taproute.routing.routes import Route
from taproute.service import (
    CaptureSink,
    RoutingSink,
    Spool,
    SpoolConfig,
    SpoolFull,
    SpoolingSink,
    create_record_runtime,
)
from tests.conftest import vec_batch
from tests.processors import SCHEMA


@pytest.mark.parametrize(
    ("block_timeout", "max_block", "expected"),
    [
        (None, 0.25, 0.25),  # unset: the runtime's budget
        (None, None, math.inf),  # no budget anywhere: until there is room
        (5.0, 0.25, 5.0),  # set: the spool's own
        (math.inf, 0.25, math.inf),  # explicitly until there is room
    ],
)
def test_the_runtimes_max_block_is_the_spools_default_block_timeout(
    tmp_path, block_timeout, max_block, expected
):
    made: list[SpoolingSink] = []

    def destination() -> SpoolingSink:
        spool = Spool.open(SpoolConfig(directory=tmp_path / "spool", block_timeout=block_timeout))
        made.append(SpoolingSink("ch", CaptureSink(), spool))
        return made[-1]

    sink = RoutingSink(
        RoutingConfig([Route("all", "*", "ch")]), SCHEMA, {"ch": destination}, unmatched="drop"
    )
    with create_record_runtime(record_sink=sink, max_block=max_block):
        assert made and made[0].spool is not None
        assert made[0].spool.block_timeout == expected


async def test_a_full_spool_sheds_after_the_budget_instead_of_waiting_for_room(
    tmp_path, autojump_clock
):
    spool = Spool.open(SpoolConfig(directory=tmp_path, quota_bytes=1), clock=trio.current_time)
    spool.use_blocking_budget(0.25)
    assert await spool.append(vec_batch(0, 2)) == "spooled"  # an empty spool takes any batch
    started = trio.current_time()
    with trio.fail_after(60), pytest.raises(SpoolFull, match="for 0.25 s"):
        await spool.append(vec_batch(0, 2))  # full, and nothing acknowledges
    assert trio.current_time() - started == pytest.approx(0.25)
    assert spool.snapshot().blocked_seconds == pytest.approx(0.25)
    await spool.aclose()
