"""A one-line progress bar on a terminal (units, rows, rows/s, ETA); silent
when stderr is not a terminal or ``CI`` is set."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    """Redraws at most ten times a second."""

    def __init__(
        self,
        total_units: int,
        total_rows: int,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        if enabled is None:
            enabled = self.stream.isatty() and not os.environ.get("CI")
        self.enabled = enabled
        self.total_units = total_units
        self.total_rows = max(total_rows, 1)
        self.units = 0
        self.rows = 0
        self.started = time.perf_counter()
        self._drawn = 0.0

    def advance(self, rows: int) -> None:
        self.units += 1
        self.rows += rows
        now = time.perf_counter()
        if self.enabled and (now - self._drawn > 0.1 or self.units == self.total_units):
            self._drawn = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.rows / elapsed
        left = max(self.total_rows - self.rows, 0)
        eta = left / rate if rate > 0 else float("inf")
        width = 24
        filled = int(width * self.units / max(self.total_units, 1))
        return (
            f"replay [{'#' * filled}{'.' * (width - filled)}] {self.units}/{self.total_units} "
            f"units  {self.rows:,} rows  {rate:,.0f} rows/s  ETA {eta:,.0f} s "
        )

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
