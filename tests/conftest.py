from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

from taproute.actors import RoutingSink, open_routing_sink
from taproute.native import make_descriptors
from taproute.routing import HookRegistry, RecordBatch, Route, RoutingConfig
from tests import chfacade
from tests.clickhouse_backends import BACKENDS
from tests.processors import SCHEMA

# No per-example deadline for property tests: speed lives in bench/, and
# Hypothesis's default (200 ms) fails a quick example that a loaded machine
# descheduled, as "Unreliable test timings" once the rerun is quick.
settings.register_profile("taproute", deadline=None)
settings.load_profile("taproute")


class ReleaseLog:
    """Counts release callbacks per buffer."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def callback(self, name: str):
        def release() -> None:
            self.calls[name] = self.calls.get(name, 0) + 1

        return release


@pytest.fixture
def release_log() -> ReleaseLog:
    return ReleaseLog()


def vec_batch(
    output_id: int,
    n: int,
    *,
    keys=None,
    seq_start: int = 0,
    release=None,
    output_ids=None,
) -> RecordBatch:
    """n records of the `vec` layout: record i holds [i, i+1, i+2, i+3] + seq_start."""
    values = (np.arange(n, dtype=np.float32)[:, None] + np.arange(4) + seq_start).astype(np.float32)
    desc = make_descriptors(
        output_id if output_ids is None else output_ids,
        16,
        count=n,
        layout_ids=SCHEMA.layout_id("vec"),
        keys=np.arange(n) if keys is None else keys,
        seqs=np.arange(seq_start, seq_start + n),
    )
    return RecordBatch.from_buffer(desc, values, release)


@pytest.fixture
def parking(tmp_path):
    """A durable park store over a dead-letter store in ``tmp_path``."""
    from taproute.service import DeadLetterStore, ParkedRecordStore

    store = DeadLetterStore(tmp_path / "dead.sqlite")
    yield ParkedRecordStore(store)
    store.close()


@pytest.fixture(scope="session")
def chdb_transport(tmp_path_factory):
    from taproute.service.sinks.clickhouse import ChdbTransport

    transport = ChdbTransport(tmp_path_factory.mktemp("chdb"))
    yield transport
    transport.close()


@pytest.fixture(scope="session")
def server_transport():
    from taproute.service.sinks.clickhouse import ServerTransport
    from tests.clickhouse_backends import SERVER_URL

    transport = ServerTransport(SERVER_URL)
    yield transport
    transport.close()


@pytest.fixture(params=BACKENDS)
def clickhouse(request):
    from tests.clickhouse_backends import Backend

    transport = request.getfixturevalue(f"{request.param}_transport")
    return Backend(request.param, transport)


@contextlib.asynccontextmanager
async def one_route_sink(
    route: Route,
    out: Any,
    *,
    hooks: HookRegistry,
    on_failure: Callable[[Any], object] | None = None,
) -> AsyncIterator[RoutingSink]:
    """A running routing sink with ``route`` alone, its destination ``out``
    (named "out"), records no route takes dropped."""
    async with open_routing_sink(
        RoutingConfig([route]),
        SCHEMA,
        {"out": out},
        unmatched="drop",
        hooks=hooks,
        on_failure=on_failure,
    ) as sink:
        yield sink


@pytest.fixture
def facade(tmp_path):
    """A chfacade server (ClickHouse's HTTP interface over chDB) on 127.0.0.1
    with its own data directory, SIGKILLed after the test (a stopped one
    too); the test skips, saying why, where chfacade is not found."""
    chfacade.require()
    server = chfacade.Facade(tmp_path / "facade-data")
    server.start()
    yield server
    server.kill()
