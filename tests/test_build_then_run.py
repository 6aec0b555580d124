"""Build, then run: a routing sink is checked and built whole at construction,
problems are reported together at their location, sinks' optional capabilities
are checked once, and shutdown cascades from the routes' inputs."""

from __future__ import annotations

import pytest
import trio

from taproute.actors import RoutingSink, open_routing_sink
from taproute.routing import (
    ConfigError,
    HookRegistry,
    PlanErrors,
    Route,
    RoutingConfig,
    UnknownDestination,
    UnknownProcessor,
)
from taproute.service.host.config import ConfigFileError, load_config
from tests.conftest import vec_batch
from tests.processors import SCHEMA
from tests.sinks import NullSink
from tests.test_config_file import base, unique, write


def test_every_plan_problem_is_reported_together_at_its_location():
    config = RoutingConfig(
        [
            Route("ok", "a", "out"),
            Route("lost", "b", "nowhere"),
            Route("typo", "c", "out", mode="stateless", processor="no.such"),
        ]
    )
    with pytest.raises(PlanErrors) as caught:
        RoutingSink(config, SCHEMA, {"out": NullSink(), "bad": 42}, unmatched="drop")
    errors = caught.value.errors
    assert [(type(e), e.where) for e in errors] == [
        (UnknownDestination, "routes[1]"),
        (UnknownProcessor, "routes[2]"),
        (ConfigError, "destinations.bad"),
    ]
    message = str(caught.value)
    assert message.startswith("3 configuration problems")
    assert "route 'lost': unknown destination 'nowhere'" in message
    assert "route 'typo': unknown processor 'no.such'" in message
    assert "destination 'bad': expected a RecordSink" in message


def test_a_route_wrong_twice_gets_both_problems_reported():
    """A route with an unknown destination *and* an unknown processor: both
    are reported (only the destination was; fixing it then showed the next)."""
    config = RoutingConfig([Route("twice", "a", "nowhere", mode="stateless", processor="no.such")])
    with pytest.raises(PlanErrors) as caught:
        RoutingSink(config, SCHEMA, {"out": NullSink()}, unmatched="drop")
    assert [(type(e), e.where) for e in caught.value.errors] == [
        (UnknownDestination, "routes[0]"),
        (UnknownProcessor, "routes[0]"),
    ]
    assert "route 'twice': unknown destination 'nowhere'; given ['out']" in str(caught.value)
    assert "route 'twice': unknown processor 'no.such'" in str(caught.value)


def test_one_problem_still_raises_its_own_class_with_its_location():
    with pytest.raises(UnknownDestination, match="route 'r': unknown destination") as caught:
        RoutingSink(RoutingConfig([Route("r", "a", "x")]), SCHEMA, {"out": NullSink()}, "out")
    assert caught.value.where == "routes[0]"


def test_a_config_file_reports_each_route_problem_at_its_key_path(tmp_path, chdb_transport):
    text = base(chdb_transport, unique("plan"))
    text = text.replace('destination = "ch"', 'destination = "zz"', 1)
    text = text.replace('processor = "test.norms"', 'processor = "nope"')
    with pytest.raises(ConfigFileError) as caught:
        load_config(write(tmp_path, text)).build()
    problems = caught.value.problems
    assert len(problems) == 2
    assert problems[0].startswith("routes[0]: route 'raw': unknown destination 'zz'")
    assert problems[1].startswith("routes[1]: route 'norms': unknown processor 'nope'")


def test_actors_are_built_at_construction_and_inert_until_run():
    made = []

    def factory() -> NullSink:
        made.append(NullSink())
        return made[-1]

    sink = RoutingSink(
        RoutingConfig(
            [
                Route("raw", "a", "out"),
                Route("n", "a", "out", mode="stateless", processor="test.norms"),
            ]
        ),
        SCHEMA,
        {"out": factory},
        unmatched="drop",
    )
    snapshot = sink.snapshot()
    assert sorted(snapshot.routes) == ["n", "raw"]  # built, counted, not running
    assert list(snapshot.destinations) == ["out"]
    assert made == [] and not sink.running  # an owned sink is created when run starts


class HookNamingSink(NullSink):
    """Declares NamesHooks: must get the registry once, before its first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.given: list[HookRegistry] = []

    def use_hooks(self, hooks: HookRegistry) -> None:
        assert self.batches == 0, "registry handed over after a batch arrived"
        self.given.append(hooks)


async def test_a_hook_naming_destination_gets_the_registry_once_at_start():
    hooks = HookRegistry()
    q = hooks.bind("layers.0.q", layout="vec")
    named = HookNamingSink()
    async with open_routing_sink(
        RoutingConfig([Route("raw", "layers.*", "out")]),
        SCHEMA,
        {"out": named},
        unmatched="drop",
        hooks=hooks,
    ) as sink:
        for _ in range(3):
            await sink.submit(vec_batch(q, 2))
        await sink.flush()
    assert named.given == [hooks] and named.records == 6


class BackgroundSink(NullSink):
    """Declares RunsInBackground."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped = trio.Event()
        self.started = False

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.started = True
        task_status.started()
        await self.stopped.wait()

    @property
    def running(self) -> bool:
        return self.started and not self.stopped.is_set()

    async def close(self) -> None:
        await super().close()
        self.stopped.set()


async def test_background_sinks_owned_are_run_and_leased_must_be_running():
    config = RoutingConfig([Route("raw", "layers.*", "out")])
    owned: list[BackgroundSink] = []

    def factory() -> BackgroundSink:
        owned.append(BackgroundSink())
        return owned[-1]

    async with open_routing_sink(config, SCHEMA, {"out": factory}, unmatched="drop") as sink:
        q = sink.bind_hook("layers.0.q", layout="vec")
        await sink.submit(vec_batch(q, 4))
        assert owned[0].running
    # The cascade closed the owned sink after its actor drained; its run task ended.
    assert owned[0].records == 4 and owned[0].closed and not owned[0].running

    leased = BackgroundSink()  # nobody started its run()
    refused = pytest.RaisesExc(ConfigError, match=r"leased sink whose run\(\) task is not running")
    with pytest.RaisesGroup(refused):  # raised through open_routing_sink's nursery
        async with open_routing_sink(config, SCHEMA, {"out": leased}, unmatched="drop"):
            pass


def test_hook_names_are_a_view_rebuilt_only_when_a_hook_is_bound():
    hooks = HookRegistry()
    hooks.bind("a")
    first = hooks.names()
    assert hooks.names() is first  # no copy per read
    hooks.bind("a")  # already bound: nothing new
    assert hooks.names() is first
    hooks.bind("b")
    assert hooks.names() == ("a", "b") and first == ("a",)


async def test_a_broken_predicate_fails_its_route_only_naming_it():
    def broken(descriptors):
        return descriptors["step"][:1] > 0  # wrong shape: a bug in the predicate

    config = RoutingConfig(
        [Route("fine", "layers.*", "out"), Route("odd", "layers.*", "out", predicate=broken)]
    )
    out = NullSink()
    failures: list = []
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, unmatched="drop", on_failure=failures.append
    ) as sink:
        q = sink.bind_hook("layers.0.q", layout="vec")
        await sink.submit(vec_batch(q, 3))
        await sink.flush()
        assert sink.failure is None  # the router keeps going
        assert out.records == 3  # the other route took the batch
    (failure,) = failures
    assert failure.route == "odd" and len(failure.records) == 3
    assert "predicate returned shape (1,), expected (3,)" in str(failure.error)


class _NotStarted(NullSink):
    """A background sink handed over as is, its ``run()`` never started."""

    running = False

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()


def test_a_sink_that_cannot_start_raises_its_own_error_not_a_nursery_group():
    from taproute.routing import ConfigError
    from taproute.service import create_record_runtime

    sink = RoutingSink(
        RoutingConfig([Route("raw", "*", "ch")]), SCHEMA, {"ch": _NotStarted()}, unmatched="drop"
    )
    with pytest.raises(ConfigError, match="destination 'ch' is a leased sink") as caught:
        create_record_runtime(record_sink=sink)
    assert not isinstance(caught.value, BaseExceptionGroup)
