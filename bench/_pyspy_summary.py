"""Summarise a ``py-spy record --threads -f raw`` profile per thread: where
the busy samples go (idle waits left out), by function (inclusive) and by
leaf line (own).

    py-spy record --threads -r 500 -f raw -o prof.txt -- python drive.py
    python bench/_pyspy_summary.py prof.txt [--top 25] [--only SUBSTRING]

Threads are grouped by role, not id: the producer (``MainThread``), the
runtime's Trio loop (a stack through ``RecordRuntime._thread_main``), Trio's
worker threads (``trio/_core/_thread_cache``: processor calls, inserts), and
anything else by its name.  A sample counts as idle when its leaf waits:
epoll, a condition or lock, a worker waiting for a job.  ``--only`` keeps
the samples whose stack contains SUBSTRING (e.g. one benchmark's function).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

IDLE_LEAVES = (
    "get_events (trio/_core/_io_epoll.py",
    "Condition.wait (threading.py",
    "_work (trio/_core/_thread_cache.py:211)",
    "WorkerThread._work (trio/_core/_thread_cache.py:211)",
    "lock.acquire",
    "Event.wait (threading.py",
    "select (selectors.py",
    "Thread.join",
    "Thread._wait_for_tstate_lock",
    "sleep (",
)


def role(stack: list[str]) -> str:
    """Which thread a sample came from, by what its stack runs."""
    joined = ";".join(stack)
    if "RecordRuntime._thread_main" in joined:
        return "runtime loop (Trio)"
    if "trio/_core/_thread_cache.py" in joined:
        return "Trio worker threads"
    head = stack[0]
    if "MainThread" in head:
        return "main (producer)"
    name = head.split(": ", 1)[1] if ": " in head else head
    return name or "other"


def frame_name(frame: str) -> str:
    """``function (file)`` without the line number."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rstrip(')')})"


def summarise(path: Path, top: int, only: str | None) -> str:
    busy: collections.Counter[str] = collections.Counter()
    idle: collections.Counter[str] = collections.Counter()
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or (only and only not in stack_text):
            continue
        count = int(count_text)
        stack = stack_text.split(";")
        who = role(stack)
        if any(mark in stack[-1] for mark in IDLE_LEAVES):
            idle[who] += count
            continue
        busy[who] += count
        for name in {frame_name(f) for f in stack[1:]}:
            inclusive[who][name] += count
        own[who][stack[-1]] += count
    out = [f"# {path.name}: busy / idle samples per thread role"]
    for who in sorted(busy, key=busy.__getitem__, reverse=True):
        out.append(f"{who}: {busy[who]} busy, {idle[who]} idle")
    for who in sorted(busy, key=busy.__getitem__, reverse=True):
        total = busy[who]
        out.append(f"\n## {who}: {total} busy samples")
        out.append("inclusive (function, share of this thread's busy samples):")
        shown = 0
        for name, n in inclusive[who].most_common():
            if name.startswith(("Thread.", "Thread._bootstrap", "<module>", "run (trio")):
                continue
            out.append(f"  {n:7d} {100 * n / total:5.1f}%  {name}")
            shown += 1
            if shown >= top:
                break
        out.append("own (leaf line):")
        for frame, n in own[who].most_common(top // 2):
            out.append(f"  {n:7d} {100 * n / total:5.1f}%  {frame}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--only")
    args = parser.parse_args()
    print(summarise(args.profile, args.top, args.only), end="")


if __name__ == "__main__":
    main()
