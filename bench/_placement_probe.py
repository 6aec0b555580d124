"""Probe: why a quick stateless processor leaves the loop under load (issue #13).

Runs latency.py's stateless route paced at RATE records/s for ROUNDS runs of
2.5 s and prints each Placement transition (to worker threads / back to the
loop: the charged seconds of the call that decided it, and the quick calls the
processor then needs to return) and how every call past INLINE_BELOW_S was
charged: (in a worker thread, the thread waited (voluntary context switch),
charged its wall time, verdict). Usage: python bench/_placement_probe.py RATE ROUNDS
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import latency

import taproute.actors.attempt as attempt

events: list[tuple[str, float, int]] = []
took = attempt.Placement.took


def noted(self: attempt.Placement, elapsed: float) -> None:
    was = self.inline
    took(self, elapsed)
    if was and not self.inline:
        events.append(("to_threads", elapsed, self.after))
    elif not was and self.inline:
        events.append(("to_loop", elapsed, self.after))


attempt.Placement.took = noted  # type: ignore[method-assign]
charged_reasons: collections.Counter[tuple[bool, bool, bool, str]] = collections.Counter()
orig = attempt.charged


def charged(wall: float, before: Any, after: Any, *, in_thread: bool = False) -> float:
    r = orig(wall, before, after, in_thread=in_thread)
    vol = after.ru_nvcsw > before.ru_nvcsw
    charged_reasons[
        (
            in_thread,
            vol,
            r == wall,
            "long"
            if r >= attempt.INLINE_WALL_S
            else ("slow" if r >= attempt.INLINE_BELOW_S else "quick"),
        )
    ] += 1
    return r


attempt.charged = charged
for rate in (float(sys.argv[1]),):
    for _ in range(int(sys.argv[2])):
        events.clear()
        charged_reasons.clear()
        r = latency.run("stateless", int(rate * 2.5 / 128), rate, "/tmp")
        p99 = latency._percentiles(r["intended"]).get("p99_ms")
        print(
            "achieved",
            round(r["achieved_records_per_s"]),
            "records/s; p99 from intended",
            p99,
            "ms",
        )
        print(
            " transitions:",
            [(k, round(e * 1e3, 2), a) for k, e, a in events][:20],
            "n=",
            len(events),
        )
        print(
            " charged (in_thread, voluntary_switch, charged_wall, verdict):", dict(charged_reasons)
        )
