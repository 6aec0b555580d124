"""A ClickHouse server for tests that stop and restart one: chfacade (the
project's ClickHouse HTTP interface served by chDB) in a child process.

CI has it at ``../shared/tools/chfacade`` beside the checkout (a user's clone
does not: tests using it skip there); ``TAPROUTE_CHFACADE`` names another
folder holding it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(os.environ.get("TAPROUTE_CHFACADE", ROOT.parent / "shared" / "tools" / "chfacade"))
SERVER = FOLDER / "server.py"

#: How long chDB may take to start on a loaded machine: a hang guard only.
START_S = 120.0


def require() -> None:
    """Skip the calling test where chfacade is not beside the checkout."""
    if not SERVER.is_file():
        pytest.skip(f"no chfacade at {FOLDER} (set TAPROUTE_CHFACADE)")


class Facade:
    """One chfacade process on ``data``; :meth:`start` again after :meth:`kill`
    serves the same data on the same port."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/default"

    def start(self) -> None:
        port_file = self.data.with_name(self.data.name + ".port")
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [
                *(sys.executable, str(SERVER), str(self.data), "--host", "127.0.0.1"),
                *("--port", str(self.port), "--port-file", str(port_file)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_S
        while not port_file.exists() or not port_file.read_text().strip():
            if self.process.poll() is not None:
                raise RuntimeError(f"chfacade exited with {self.process.returncode} at start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"chfacade did not start within {START_S} s")
            time.sleep(0.05)  # polling a child's start-up, not synchronising a test
        self.port = int(port_file.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ping", timeout=60) as reply:
            assert reply.read() == b"Ok.\n"

    def kill(self) -> None:
        """SIGKILL the server and wait for it: its port refuses connections after."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=60)
        self.process = None
