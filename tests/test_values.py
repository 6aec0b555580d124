"""Config values: keyword-only where many fields, validated by attrs' own
validators into ConfigError, one home per default and per formula."""

from __future__ import annotations

import inspect

import pytest

from taproute.actors import RoutingSink
from taproute.routing import (
    ConfigError,
    FailureCode,
    FailurePolicy,
    RecordFailure,
    Route,
    limits,
)
from taproute.routing.routes import ROUTE_LIMITS
from taproute.service import Batching, Retry, create_record_runtime
from taproute.service.host.config_rules import LIMITS
from taproute.service.host.runtime import RecordRuntime
from taproute.service.sinks.clickhouse.batching import BATCHING_LIMITS, RETRY_LIMITS
from tests.conftest import vec_batch


def test_how_a_route_runs_is_keyword_only():
    Route("r", "a", "d", mode="stateless", processor="p")  # what it is may be positional
    with pytest.raises(TypeError):
        Route("r", "a", "d", "stateless", "p")  # type: ignore[misc]


def test_a_record_failure_is_built_by_keyword_only():
    with pytest.raises(TypeError):
        RecordFailure("r", None, ValueError("x"), vec_batch(0, 1))  # type: ignore[misc]
    failure = RecordFailure(
        route="r", processor=None, error=ValueError("x"), records=vec_batch(0, 1)
    )
    assert failure.code is FailureCode.HANDLER_PANIC and failure.attempts == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": ""}, "route: name must be a non-empty string, got ''"),
        ({"outputs": []}, "route 'r': outputs must be non-empty names, got ()"),
        ({"outputs": ["a", ""]}, "route 'r': outputs must be non-empty names"),
        ({"destination": 3}, "route 'r': destination must be a non-empty string, got 3"),
        ({"workers": 0}, "route 'r': workers must be a positive int <= 1024, got 0"),
        (
            {"workers": 10**9},
            "route 'r': workers must be a positive int <= 1024, got 1000000000",
        ),
        (
            {"capacity": "many"},
            "route 'r': capacity must be a positive int <= 2**32, got 'many'",
        ),
        # Taken until now: a dict failed the build with AttributeError ('dict'
        # object has no attribute 'max_parked_records'), a predicate of 5 was
        # built and failed every record, a processor of 5 was "unknown".
        (
            {"failure_policy": {"deadline": 2.0}},
            "route 'r': failure_policy must be a FailurePolicy (FailurePolicy(deadline=2.0, "
            "...)), got {'deadline': 2.0}",
        ),
        ({"predicate": 5}, "route 'r': predicate must be callable as predicate(descriptors)"),
        (
            {"mode": "stateless", "processor": 5},
            "route 'r': processor must be a registered processor's name (a str), got 5",
        ),
    ],
)
def test_route_fields_are_checked_into_config_errors(fields, message):
    given = {"name": "r", "outputs": "a", "destination": "d", **fields}
    with pytest.raises(ConfigError) as caught:
        Route(**given)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("value", [-1, float("nan"), "soon", 10**6])
def test_failure_policy_fields_are_checked_into_config_errors(value):
    with pytest.raises(ConfigError, match=r"failure policy: deadline must be a finite number in "):
        FailurePolicy(deadline=value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"multiplier": 0.5},
            "failure policy: multiplier must be a finite number in [1, 10], got 0.5",
        ),
        (
            {"max_failures": 1.5},
            "failure policy: max_failures must be an int in [0, 1000], got 1.5",
        ),
        (
            {"failure_window": float("inf")},
            "failure policy: failure_window must be a finite number in [0, 2592000], got inf",
        ),
    ],
)
def test_failure_policy_holds_the_bounds_a_config_file_states(fields, message):
    """In Python as in a file (``LIMITS`` takes them from the class's module):
    a multiplier under 1 would shrink the backoff; a fractional failure count
    means nothing."""
    with pytest.raises(ConfigError) as caught:
        FailurePolicy(**fields)
    assert str(caught.value) == message


@pytest.mark.parametrize("make", [FailurePolicy, Batching, Retry])
def test_many_field_settings_are_keyword_only(make):
    with pytest.raises(TypeError, match="positional"):
        make(1.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Batching(linger=float("nan")),
            "Batching: linger must be a finite number in [0.001, 3600], got nan",
        ),
        (
            lambda: Batching(linger=float("inf")),
            "Batching: linger must be a finite number in [0.001, 3600], got inf",
        ),
        (
            lambda: Batching(inserts_in_flight=10_000),
            "Batching: inserts_in_flight must be a positive int <= 64, got 10000",
        ),
        (
            lambda: Retry(multiplier=0.5),
            "Retry: multiplier must be a finite number in [1, 10], got 0.5",
        ),
    ],
)
def test_sink_settings_refuse_non_finite_and_absurd_values(make, message):
    """The classes themselves hold the bounds a config file states (a NaN
    linger would spin the linger timer)."""
    with pytest.raises(ConfigError) as caught:
        make()
    assert str(caught.value) == message


def test_config_file_limits_are_the_classes_own():
    assert LIMITS[Route] == ROUTE_LIMITS
    assert LIMITS[Batching] == BATCHING_LIMITS
    assert LIMITS[Retry] == RETRY_LIMITS


def default(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_queue_bounds_have_one_home():
    route = Route("r", "a", "d")
    assert (route.capacity, route.capacity_bytes) == (limits.QUEUE_RECORDS, limits.QUEUE_BYTES)
    for function in (RecordRuntime.__init__, create_record_runtime):
        assert default(function, "capacity_records") == limits.QUEUE_RECORDS
        assert default(function, "capacity_bytes") == limits.QUEUE_BYTES
        assert default(function, "coalesce_records") == limits.COALESCE_RECORDS
    assert default(RoutingSink.__init__, "destination_capacity") == limits.DESTINATION_QUEUE_RECORDS
    assert (
        default(RoutingSink.__init__, "destination_capacity_bytes")
        == limits.DESTINATION_QUEUE_BYTES
    )


def test_route_and_insert_retries_back_off_by_the_one_formula():
    policy = FailurePolicy(initial_backoff=0.5, multiplier=3.0, max_backoff=10.0)
    retry = Retry(initial_backoff=0.5, multiplier=3.0, max_backoff=10.0)
    expected = [0.5, 1.5, 4.5, 10.0, 10.0]
    assert [policy.backoff(n) for n in range(1, 6)] == expected
    assert [retry.backoff(n) for n in range(1, 6)] == expected
    assert [limits.capped_backoff(0.5, 3.0, 10.0, n) for n in range(1, 6)] == expected


def test_capped_backoff_is_defined_for_any_number_of_failures():
    from taproute.routing.limits import capped_backoff

    assert [capped_backoff(2.0, 2.0, 300.0, n) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert capped_backoff(2.0, 2.0, 300.0, 9) == 300.0
    # Past ~1,000 failures the power overflows a float: the cap still answers.
    assert capped_backoff(0.001, 2.0, 0.001, 1_100) == 0.001
    assert capped_backoff(2.0, 2.0, 300.0, 10**6) == 300.0


def test_a_misspelt_mode_or_outputs_of_the_wrong_type_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"route mode: expected one of 'forward', 'stateless', "
        r"'stateful', found 'statless'",
    ):
        Route("r", "x", "d", mode="statless", processor="p")
    with pytest.raises(
        ConfigError, match="route outputs: expected a name or an iterable of names, found 5"
    ):
        Route("r", 5, "d")  # type: ignore[arg-type]
