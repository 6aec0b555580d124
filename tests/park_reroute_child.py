"""A child process for tests/test_reroute_crash.py: the service of
``tests/park_crash_child.py`` (chDB destination, dead-letter store beside it)
gives up 192 of its 1,728 records as malformed, then an operator reroutes one
dead letter and the process is SIGKILLed while the route processes the copy.

    python -m tests.park_reroute_child produce DIR
    python -m tests.park_reroute_child recover DIR

``produce`` prints ``letters N``, then ``rerouting ID SEQ`` before the
reroute; the processor kills the process inside the copy's call.
``recover`` is ``tests.park_crash_child``'s (processor healed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.park_child_setup import start
from tests.park_crash_child import CONFIG, recover, submit_batches


def produce(directory: Path) -> None:
    os.environ["TAPROUTE_PARK_MODE"] = "invalid"
    _, runtime = start(directory, CONFIG)
    submit_batches(runtime)
    runtime.flush()
    letters = runtime.controls.store.list(limit=10**6)
    print(f"letters {len(letters)}", flush=True)
    letter = letters[0]
    print(f"rerouting {letter.id} {letter.seq}", flush=True)
    os.environ["TAPROUTE_PARK_MODE"] = "kill"  # the copy's call kills the process
    runtime.reroute(letter.id)
    print("rerouted", flush=True)
    runtime.flush()
    sys.exit(3)  # the processor should have killed us


def main() -> None:
    command, directory = sys.argv[1:3]
    if command == "produce":
        produce(Path(directory))
    else:
        recover(Path(directory), "ok")


if __name__ == "__main__":
    main()
