"""A route's predicate, run by its route actor: the verdict on a batch under
the route's deadline (in a worker thread, or on the loop once it has been
quick), and a failed predicate's records given up as the route's failure.

:class:`RouteScreening` is that part of
:class:`~taproute.actors.route_actor.RouteActor`, which sets every attribute
declared here in its constructor and defines the failure path used here.
"""

from __future__ import annotations

import math
import time
import traceback

import numpy as np
import trio

from taproute.actors.attempt import Attempt, HeldWhileRunning, Placement, timed_call_in_thread
from taproute.actors.counters import RouteCounters
from taproute.routing.batch import RecordBatch
from taproute.routing.failures import FailureCode, FailurePolicy, classify
from taproute.routing.plan import PlannedRoute
from taproute.routing.predicates import PredicateFailed, Verdict, evaluate_predicate


class RouteScreening:
    """Route predicates of a route actor."""

    planned: PlannedRoute
    name: str
    policy: FailurePolicy
    counters: RouteCounters
    predicate_placement: Placement
    _threads: trio.CapacityLimiter

    def _abandoned_call(self, delta: int) -> None:
        raise NotImplementedError

    def _count_failure(self, attempt: Attempt) -> None:
        raise NotImplementedError

    async def _give_up(self, attempt: Attempt, *, generation: int | None = None) -> None:
        raise NotImplementedError

    async def screen(self, batch: RecordBatch) -> Verdict:
        """Run the route's predicate on ``batch`` under the route's deadline: in
        a worker thread, or on the loop once it has been quick (the rule of
        :class:`~taproute.actors.attempt.Placement`).  If it fails (raises,
        returns a wrong shape, runs past the deadline) the records are this
        route's failure, classified like a processor's and given up at once;
        returns None then."""
        deadline = self.policy.deadline or math.inf
        tb: str | None = None
        place = self.predicate_placement
        if place.inline:
            started = time.perf_counter()
            try:
                verdict: Verdict = evaluate_predicate(self.planned, batch.descriptors)
            except Exception as exc:
                place.took(math.inf)
                code, tb = classify(exc), traceback.format_exc()
                error = PredicateFailed(self.name, exc)
            else:
                place.took(time.perf_counter() - started)
                await trio.lowlevel.cancel_shielded_checkpoint()
                return verdict
        else:
            held = HeldWhileRunning(batch, self._abandoned_call)
            elapsed = math.inf
            try:
                with trio.move_on_after(deadline) as scope:
                    verdict, elapsed = await trio.to_thread.run_sync(
                        held.run,
                        timed_call_in_thread,
                        evaluate_predicate,
                        self.planned,
                        batch.descriptors,
                        limiter=held.limiter(self._threads),
                        abandon_on_cancel=True,
                    )
            except Exception as exc:
                code, tb = classify(exc), traceback.format_exc()
                error = PredicateFailed(self.name, exc)
            else:
                if not scope.cancelled_caught:
                    return verdict
                code = FailureCode.HANDLER_TIMEOUT
                error = PredicateFailed(
                    self.name,
                    TimeoutError(f"no verdict within the route's {deadline:g} s deadline"),
                )
            finally:
                held.leave()
                place.took(elapsed)
        attempt = Attempt(batch)
        attempt.failed(code, error, tb)
        self._count_failure(attempt)
        self.counters.accepted += len(batch)  # the route's, though never dispatched
        await self._give_up(attempt)
        return None

    async def screen_derived(self, batch: RecordBatch) -> RecordBatch | None:
        """The derived records of ``batch`` this route's predicate takes (declines
        counted); None when the predicate failed (the records were given up)."""
        verdict = await self.screen(batch)
        if verdict is None:
            return None
        mask, reason = verdict
        if mask.all():
            return batch
        self.counters.declined += int(len(mask) - np.count_nonzero(mask))
        self.counters.last_decline = reason
        return batch.select(np.flatnonzero(mask))
