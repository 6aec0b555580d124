"""When a task that runs work on the loop itself hands the loop to others.

A processor call made on the loop (:func:`~taproute.actors.attempt.call_processor`
inline) is followed by a schedule point, as a thread hop would be, so a task
calling in a loop does not starve the others.  The record worker is woken
once per batch when batches come paced; it has just passed a schedule point
(its wake-up) and a second one per batch costs a trip through the scheduler
and an I/O poll (about a tenth of its loop time per lone batch,
bench/profiles/latency80_stateless_47c07af.txt).  So a task that marks where
it was last scheduled (:func:`scheduled_now`) yields only once it has run
:data:`YIELD_AFTER_S` since; any other task yields at every call.

The tasks that hand on many batches in a row keep the same budget: the record
worker between the batches of one ingress take, a destination actor between
the submits it drains from its mailbox.  Every other task on the loop (the
HTTP endpoint's, whose one request takes about ten trips through the
scheduler; timers; other actors) then waits about that long per trip, plus
one batch's work, not for a whole ingress or 64 submits (a /healthz took
seconds at saturation that way).
"""

from __future__ import annotations

import contextvars
import math
import time

import trio

#: How long a task that marks its schedule points may run on the loop
#: before a processor call made in it yields.
YIELD_AFTER_S = 0.001

# Per Trio task (each task runs in its own context copy): when it last came
# back from a schedule point; -inf for tasks that never mark it.
_resumed_at: contextvars.ContextVar[float] = contextvars.ContextVar(
    "taproute_resumed_at", default=-math.inf
)


def scheduled_now() -> None:
    """Note that the calling task has just come back from a schedule point."""
    _resumed_at.set(time.perf_counter())


async def yield_if_due() -> None:
    """A schedule point (shielded: not a cancellation point) unless the calling
    task marked one less than :data:`YIELD_AFTER_S` ago."""
    if time.perf_counter() - _resumed_at.get() < YIELD_AFTER_S:
        return
    await trio.lowlevel.cancel_shielded_checkpoint()
    if _resumed_at.get() != -math.inf:
        scheduled_now()
