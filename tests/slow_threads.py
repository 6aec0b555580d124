"""A pytest plugin that finds tests whose pass depends on how fast the machine is.

Every ``trio.to_thread.run_sync`` call first sleeps a random 0 to
``TAPROUTE_SLOW_THREADS`` seconds (default 0.06) in its worker thread, as a
loaded machine delays a thread's start; with ``TAPROUTE_SLOW_THREADS_NOINLINE=1``
processors and predicates never move onto the loop, so every call takes that
path (leave out tests/test_inline_placement.py then: it tests the loop path).
A test that fails under it bounds thread work by mock time or by a tight
real-time bound.  Not loaded by default:

    TAPROUTE_SLOW_THREADS=0.06 .venv/bin/pytest -p tests.slow_threads tests/test_spool_outage.py
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import trio

MAX_DELAY = float(os.environ.get("TAPROUTE_SLOW_THREADS", "0.06"))
_original = trio.to_thread.run_sync


async def _delayed_run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
    def delayed(*inner: Any) -> Any:
        time.sleep(random.uniform(0, MAX_DELAY))  # the delay is the point here
        return fn(*inner)

    return await _original(delayed, *args, **kwargs)


trio.to_thread.run_sync = _delayed_run_sync  # type: ignore[assignment]

if os.environ.get("TAPROUTE_SLOW_THREADS_NOINLINE"):
    import taproute.actors.attempt as attempt

    attempt.INLINE_AFTER = 10**9
