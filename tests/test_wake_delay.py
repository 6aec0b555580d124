"""``create_record_runtime(wake_delay=)``: how often the record worker takes
what capture hooks queued while they keep queueing (they do not wake it)."""

from __future__ import annotations

import math

import pytest

from taproute.service import create_record_runtime
from taproute.service.host.ingress import WAKE_DELAY_S
from taproute.service.host.runtime import RecordRuntime
from taproute.service.sinks.capture import CaptureSink


def test_the_runtime_polls_at_the_wake_delay_it_was_given_and_the_default_otherwise():
    runtime = create_record_runtime(record_sink=CaptureSink(), wake_delay=0.25)
    try:
        assert runtime._ingress.wake_delay == 0.25
    finally:
        runtime.close(timeout=60)
    assert RecordRuntime(CaptureSink())._ingress.wake_delay == WAKE_DELAY_S


@pytest.mark.parametrize("bad", [-0.01, math.inf, math.nan])
def test_a_wake_delay_that_is_not_finite_seconds_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="wake_delay"):
        RecordRuntime(CaptureSink(), wake_delay=bad)
