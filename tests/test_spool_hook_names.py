"""Spooled records keep the names of their hooks across a restart.

A spool frame stored each record's output_id alone, and output_ids are
handed out per process in binding order: a restart that bound its hooks in
another order (a route added to the chain, hooks bound as models load)
replayed the previous run's records under whichever hook now had that id,
so ClickHouse got them with another hook's name (or none).  Frames now
carry the names of the hooks their records came from, and a replay maps
them to the ids this process bound.
"""

from __future__ import annotations

import trio

from taproute.routing import HookRegistry
from taproute.service import ClickHouseSink, Spool, SpoolConfig, SpoolingSink
from tests.conftest import vec_batch
from tests.processors import SCHEMA

#: A hang guard, never a bound a slow machine could miss.
GUARD_S = 60


def _sink(transport, spool_dir, hooks: HookRegistry) -> SpoolingSink:
    inner = ClickHouseSink(
        transport,
        SCHEMA,
        raw=["vec"],
        raw_table="spool_names_raw_{layout}",
        hooks=hooks,
        create_tables=True,
        owns_transport=False,
    )
    sink = SpoolingSink("ch", inner, Spool.open(SpoolConfig(directory=spool_dir)), mode="always")
    sink.use_hooks(hooks)
    return sink


async def test_a_restart_that_binds_hooks_in_another_order_replays_under_their_names(
    tmp_path, chdb_transport
):
    spool_dir = tmp_path / "spool"
    first = HookRegistry()
    first.bind("layers.0", layout="vec")
    one = first.bind("layers.1", layout="vec")
    before = _sink(chdb_transport, spool_dir, first)
    # The first run spools records of "layers.1" (output_id 1) and dies
    # before delivering them: nothing but the spool's files is left.
    with trio.fail_after(GUARD_S):
        await before.submit(vec_batch(one, 8))
        assert before.spool is not None
        await before.spool.sync()
        await before.spool.aclose()

    second = HookRegistry()  # binds the same hooks the other way round
    assert second.bind("layers.1", layout="vec") == 0
    assert second.bind("layers.0", layout="vec") == 1  # the id "layers.1" had
    after = _sink(chdb_transport, spool_dir, second)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(after.run)
            await after.wait_delivered()
            await after.close()
    rows = chdb_transport.query(
        "SELECT hook, count() AS n, any(values_shape) AS shape"
        " FROM spool_names_raw_vec GROUP BY hook"
    ).to_pylist()
    assert rows == [{"hook": "layers.1", "n": 8, "shape": [4]}]
