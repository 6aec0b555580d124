"""Switch how taproute judges a processor call made in a worker thread, for
A/B runs (``serve_load.py --compare-judging``, ``_latency_profile.py
judging``): ``"cpu"``, the library's own (a call that waited under
``THREAD_WAIT_S`` is charged its CPU time; the back-off up to
``INLINE_AFTER_MAX``), or ``"wall"``, the judgement before it (charged its
wall time whenever its thread waited; no back-off)."""

from __future__ import annotations

from typing import Any

import taproute.actors.attempt as attempt

_CHARGED = attempt.charged
_AFTER_MAX = attempt.INLINE_AFTER_MAX


def _wall_when_waited(wall: float, before: Any, after: Any, *, in_thread: bool = False) -> float:
    return _CHARGED(wall, before, after, in_thread=False)


def judge_thread_calls(by: str) -> None:
    """Judge worker-thread calls ``by`` ``"cpu"`` or ``"wall"`` from now on."""
    if by not in ("cpu", "wall"):
        raise ValueError(f"judge_thread_calls: 'cpu' or 'wall', not {by!r}")
    attempt.charged = _wall_when_waited if by == "wall" else _CHARGED  # type: ignore[assignment]
    attempt.INLINE_AFTER_MAX = attempt.INLINE_AFTER if by == "wall" else _AFTER_MAX
