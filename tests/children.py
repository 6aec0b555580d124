"""Test modules run as child processes: the crash tests kill them with SIGKILL
and start them again, as a real process would be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The repository's root: children run from it, with it on their import path.
ROOT = Path(__file__).resolve().parent.parent


def run_child(module: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tests.<module> *args`` from the repository's root to
    its end (a SIGKILL it sends itself included); its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", f"tests.{module}", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
