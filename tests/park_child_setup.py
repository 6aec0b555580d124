"""What the park crash children (``tests/park_crash_child.py``,
``tests/park_keyed_child.py``) share: the layouts and the ClickHouse
destination of their config file, starting the service from it in a
directory, and dying by SIGKILL."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from taproute.service.host.config import load_config
from tests.processors import LAYOUTS_TOML

#: The ``vec`` layout records are captured in and the ``norm`` rows the
#: children's processors return (the layouts of ``tests.processors.SCHEMA``).
LAYOUTS = LAYOUTS_TOML

#: chDB in the run's directory, writing the ``norm`` rows; nothing else is routed.
DESTINATION = """
[destinations.ch]
path = "chdb"
rows = ["norm"]

[routing]
unmatched = "drop"
"""


def config(processors: str, route: str) -> str:
    """A child's config file: ``processors`` imported, its one ``route`` (TOML)."""
    return f'processors = ["{processors}"]\n{LAYOUTS}\n{route.strip()}\n{DESTINATION}'


def start(directory: Path, text: str) -> tuple[Any, Any]:
    """The service of config ``text`` (written to ``directory/router.toml`` on
    the first start, reused after) built and started: ``(built, runtime)``."""
    path = directory / "router.toml"
    if not path.exists():
        path.write_text(text)
    built = load_config(path).build()
    return built, built.start()


def die() -> None:
    """SIGKILL this process (what the crash tests simulate), output flushed first."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
