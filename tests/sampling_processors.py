"""A processor and a predicate that offer sample records built from their
route's configuration (registered at import time, as a user's module would)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from taproute.routing import Records, Sample, SampleContext, stateless_processor
from tests.processors import norms


def norm_samples(context: SampleContext) -> list[Sample]:
    """One sample per hook the route takes, keyed by the route's worker count
    (a value only the configuration knows), stamped with the router's clock."""
    return [
        Sample(
            name=f"{hook}@now",
            hook=hook,
            key=context.route.workers,
            timestamp_ns=context.now_ns,
        )
        for hook in context.hooks
    ]


@stateless_processor("sampling.norms", input="vec", output="norm", samples=norm_samples)
def sampled_norms(records: Records) -> np.ndarray:
    return norms(records)


def broken_samples(context: SampleContext) -> list[Sample]:
    raise RuntimeError("the feature store is down")


@stateless_processor("sampling.broken", input="vec", output="norm", samples=broken_samples)
def broken_norms(records: Records) -> np.ndarray:
    return norms(records)


class RecentOnly:
    """A predicate taking records stamped within ``window`` seconds of the
    router's clock; it offers one fresh and one stale sample."""

    def __init__(self, window: float, clock: Callable[[], float]) -> None:
        self.window = window
        self.clock = clock

    def __call__(self, descriptors: np.ndarray) -> tuple[np.ndarray, str]:
        now_ns = int(self.clock() * 1e9)
        age = now_ns - descriptors["timestamp_ns"]
        return age <= self.window * 1e9, f"older than {self.window:g} s"

    def samples(self, context: SampleContext) -> list[Sample]:
        hook = context.hooks[0]
        stale = context.now_ns - int(2 * self.window * 1e9)
        return [
            Sample(name="fresh", hook=hook, timestamp_ns=context.now_ns),
            Sample(name="stale", hook=hook, timestamp_ns=stale),
        ]
