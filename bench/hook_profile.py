"""Profile: where a capture hook's time goes inside GPT-2's forward (py-spy).

# bench: not a script

GPT-2 from a config (4 layers x 256, batch 8 x 64, half the rows padded to
half length), 12 taproute hooks into a null destination, torch on one
thread.  Run it under py-spy, then summarize the samples taken inside the
hooks (one line per leaf frame with its source line, then per function)::

    py-spy record --threads --idle -r 500 -f raw -o hook.raw -- \\
        python bench/hook_profile.py --passes 60
    python bench/hook_profile.py --summarize hook.raw > bench/profiles/hook_pyspy_<commit>.txt
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HOOK_FRAME = "bind_module.<locals>.hook"


def drive(passes: int) -> None:
    import torch
    from inference_cost import SCHEMA, NullSink, probe_gpt2

    from taproute.service import create_record_runtime
    from taproute.service.capture import bind_modules, capture_context

    model, patterns, forward, ids, mask = probe_gpt2()
    with create_record_runtime(record_sink=NullSink(), schema=SCHEMA) as runtime:
        for pattern in patterns:
            bind_modules(runtime, model, pattern, layout="acts")
        with torch.inference_mode(), capture_context(list(range(8)), attention_mask=mask):
            for _ in range(passes):
                forward(ids, mask)
        runtime.flush()


def _source(frame: str) -> str:
    match = re.search(r"\((.*):(\d+)\)$", frame)
    if match is None:
        return ""
    path, line = match.group(1), int(match.group(2))
    for candidate in (REPO / path, Path(path)):
        if candidate.exists():
            return linecache.getline(str(candidate), line).strip()
    return ""


def summarize(raw: Path) -> str:
    leaves: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    main = inside = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if "MainThread" not in frames[0]:
            continue
        n = int(count)
        main += n
        start = next((i for i, f in enumerate(frames) if f.startswith(HOOK_FRAME)), None)
        if start is None:
            continue
        inside += n
        leaves[frames[-1]] += n
        for name in {re.sub(r":\d+\)$", ")", f) for f in frames[start:]}:
            functions[name] += n
    out = [f"model-thread samples {main}, inside capture hooks {inside}"]
    out.append("leaf frame under the hook: samples, share of hook samples")
    for frame, n in leaves.most_common(25):
        source = _source(frame)
        out.append(
            f"{n:6d} {100 * n / max(inside, 1):5.1f}%  {frame}"
            + (f"  | {source}" if source else "")
        )
    out.append("functions under the hook (inclusive): samples, share")
    for frame, n in functions.most_common(20):
        out.append(f"{n:6d} {100 * n / max(inside, 1):5.1f}%  {frame}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=60)
    parser.add_argument("--summarize", type=Path, help="a py-spy raw file to summarize")
    args = parser.parse_args()
    if args.summarize is not None:
        print(f"# load average now {os.getloadavg()}")
        print(summarize(args.summarize), end="")
    else:
        drive(args.passes)


if __name__ == "__main__":
    main()
