"""Who held the GIL: a summary of ``py-spy record --gil --threads --format raw``
output from ``bench/gil_probe.py``, one line per role with its share of the
GIL-held samples (imports excluded), and the insert threads' leaf frames.

    .venv/bin/python bench/gil_summary.py gil.txt [more.txt ...]

Several files (repeated runs) are summed.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def role(stack: str) -> str | None:
    """The role of one sampled stack (None: an import, not counted).

    py-spy names a thread by its Python name when it has one: the probe's
    model thread is ``model`` (``MainThread`` before the probe renames it),
    the runtime's loop thread ``taproute``, Trio worker threads by the
    function they run (the in-process sink's ``_insert_blocking``).
    """
    if "_find_and_load" in stack:
        return None
    thread, _, frames = stack.partition(";")
    if thread.endswith(": model") or thread.endswith(": MainThread") or "(" not in stack:
        if not frames:
            return "model thread: torch native code (no Python frame)"
        if "service/capture/" in frames or "binding.py" in frames:
            return "model thread: inside the taproute hook"
        if any(f in frames for f in ("flush (", "close (", "embedded (", "__exit__ (", "gpt2 (")):
            return "model thread: setup/flush/close"
        return "model thread: forward, outside taproute"
    if "_insert_blocking" in thread or "sqlitelike" in frames:
        return "ClickHouse insert threads (Arrow build + chDB query)"
    if thread.endswith(": taproute"):
        return "Trio loop thread (routing, ingress, writer messages)"
    return "other threads (unnamed: thread start/exit, workers)"


def summarize(paths: list[Path]) -> str:
    roles: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for path in paths:
        for line in path.read_text().splitlines():
            match = _LINE.match(line)
            if match is None:
                continue
            stack, count = match["stack"], int(match["count"])
            found = role(stack)
            if found is None:
                continue
            roles[found] += count
            if found.startswith("ClickHouse"):
                leaf = stack.rsplit(";", 1)[-1]
                leaves[leaf.rsplit("/", 1)[-1]] += count
    total = sum(roles.values())
    out = [f"{total} samples of threads holding the GIL (imports excluded)."]
    for name, count in roles.most_common():
        out.append(f"  {name:<58} {count:6d} {100 * count / max(total, 1):5.1f}%")
    if leaves:
        out.append("ClickHouse insert threads, leaf frames while holding the GIL:")
        out.extend(f"  {leaf:<60} {count:6d}" for leaf, count in leaves.most_common(8))
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize([Path(p) for p in sys.argv[1:]]))
