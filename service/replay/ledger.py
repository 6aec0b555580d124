"""The run ledger: what a replay did, stored beside its outputs, and the
checkpoint a resume starts from.

``<runs>/<run id>/ledger.json`` holds the run id, the config and its hash,
the params, every finished unit with its output row counts and attempts,
failed units with their errors, per-phase timings (read, process, write:
p50/p95) and start/end times; ``state-<n>.npz`` holds a stateful processor's
K x N state as of checkpoint ``n``, the one the ledger names (``"state"``).
Each checkpoint writes a new state file (aside, then renamed), then renames
its ledger into place, and only then removes the older state files: a crash
at any point leaves the ledger naming a state file of its own checkpoint.
(Replacing one ``state.npz`` before the ledger left, after a kill between
the two, a state ahead of its ledger: a resume added the units redone into
a state that already held them.)  The driver owns the ledger, whatever the
backend.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from taproute.service.replay.errors import (
    ConfigChanged,
    MissingSource,
    ReplayConfigError,
    RunInUse,
    UnknownRun,
)

PHASES = ("read", "process", "write")


def config_hash(config: dict[str, Any]) -> str:
    """A stable hash of a JSON-able config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def _diff(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += _diff(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50/p95 (and count, total) of a phase's per-unit seconds."""
    if not samples:
        return {"count": 0, "total": 0.0, "p50": 0.0, "p95": 0.0}
    values = np.asarray(samples)
    return {
        "count": len(samples),
        "total": float(values.sum()),
        "p50": float(np.percentile(values, 50)),
        "p95": float(np.percentile(values, 95)),
    }


#: What every ledger holds (a file without them is not one this driver wrote).
_KEYS = ("run_id", "config_hash", "config", "status", "resumes", "units", "failed", "timings")


def _parse(path: Path, text: str) -> dict[str, Any]:
    """The ledger in ``text`` (read from ``path``); a damaged or foreign file is
    refused, naming it, rather than failing later on a missing key."""
    try:
        data: dict[str, Any] = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplayConfigError(f"ledger {str(path)!r} is not valid JSON ({exc})") from None
    missing = [k for k in _KEYS if k not in data] if isinstance(data, dict) else list(_KEYS)
    if missing:
        raise ReplayConfigError(
            f"ledger {str(path)!r} is not a replay ledger: it lacks {', '.join(missing)}"
        )
    return data


class RunLedger:
    """One run's ledger and checkpoint, in ``runs_dir / run_id``."""

    def __init__(self, directory: Path, data: dict[str, Any]) -> None:
        self.directory = directory
        self.data = data
        self._saved: str | None = None
        self.timings: dict[str, list[float]] = {p: list(data["timings"].get(p, [])) for p in PHASES}
        self._lock_fd: int | None = None

    def _lock(self) -> None:
        """Hold ``lock`` in the run directory until :meth:`release`: one driver
        per run.  (Two resumes of one run raced on the ledger and state files:
        one died on a rename the other had done, and could mark the run
        interrupted after the other finished it.)"""
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunInUse(
                f"run {self.directory.name} in {self.directory.parent} is being run by another "
                f"replay now (pid {holder}); wait for it to end, or stop it, then resume"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def release(self) -> None:
        """Give the run's lock back (the run may be resumed from here on)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def run_id(self) -> str:
        return str(self.data["run_id"])

    @classmethod
    def create(cls, runs_dir: Path, config: dict[str, Any], units_planned: int) -> RunLedger:
        """A new run (id: UTC time + random suffix)."""
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
        run_id = f"r{stamp}-{uuid.uuid4().hex[:6]}"
        data: dict[str, Any] = {
            "run_id": run_id,
            "config_hash": config_hash(config),
            "config": config,
            "params": config.get("params", {}),
            "status": "running",
            "started_at": _now(),
            "ended_at": None,
            "resumes": [],
            "units_planned": units_planned,
            "units": {},
            "failed": {},
            "final_written": False,
            "checkpoints": 0,
            "timings": {},
            "phases": {},
        }
        ledger = cls(runs_dir / run_id, data)
        ledger.directory.mkdir(parents=True, exist_ok=False)
        ledger._lock()
        return ledger

    @classmethod
    def resume(cls, runs_dir: Path, run_id: str, config: dict[str, Any]) -> RunLedger:
        """Reopen ``run_id``; refuse when the config differs, naming what changed."""
        path = runs_dir / run_id / "ledger.json"
        if not path.is_file():
            known = sorted(p.parent.name for p in runs_dir.glob("*/ledger.json"))
            raise UnknownRun(f"no run {run_id!r} under {runs_dir} (runs there: {known or 'none'})")
        ledger = cls(path.parent, _parse(path, path.read_text()))
        ledger._lock()
        try:
            text = path.read_text()  # as the last driver left it, now that none runs
            data = _parse(path, text)
            if data["config_hash"] != config_hash(config):
                changes = _diff(data["config"], config)
                raise ConfigChanged(
                    f"run {run_id} was started with another configuration (hash "
                    f"{data['config_hash']}, now {config_hash(config)}); changed: "
                    + "; ".join(changes)
                )
        except BaseException:
            ledger.release()
            raise
        data["resumes"].append(_now())
        data["status"] = "running"
        data["failed"] = {}  # failed units are tried again
        ledger.data = data
        ledger.timings = {p: list(data["timings"].get(p, [])) for p in PHASES}
        ledger._saved = text
        return ledger

    # -- progress -----------------------------------------------------------

    def done(self, unit_id: str) -> bool:
        return unit_id in self.data["units"]

    def record_unit(
        self,
        unit_id: str,
        *,
        records: int,
        outputs: dict[str, int],
        attempts: int,
        seconds: dict[str, float],
        stats: dict[str, float],
    ) -> None:
        self.data["units"][unit_id] = {
            "records": records,
            "outputs": outputs,
            "attempts": attempts,
            "seconds": {k: round(v, 6) for k, v in seconds.items()},
            "stats": stats,
        }
        for phase in PHASES:
            self.timings[phase].append(seconds.get(phase, 0.0))

    def record_failure(self, unit_id: str, error: str) -> None:
        self.data["failed"][unit_id] = error

    # -- checkpoint ---------------------------------------------------------

    def checkpoint(self, state: tuple[npt.NDArray[Any], npt.NDArray[np.bool_]] | None) -> None:
        """Write state (if any) to a new file, then the ledger naming it, each
        atomically; then drop the state files no ledger names any more."""
        self.data["checkpoints"] += 1
        if state is not None:
            name = f"state-{self.data['checkpoints']}.npz"
            aside = self.directory / f"state-{self.data['checkpoints']}.tmp.npz"
            np.savez(aside, slots=state[0], valid=state[1])
            os.replace(aside, self.directory / name)
            self.data["state"] = name
        self.data["timings"] = self.timings
        self.data["phases"] = {p: percentiles(v) for p, v in self.timings.items()}
        self.data["checkpointed_at"] = _now()
        self._write(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        if state is not None:
            for old in self.directory.glob("state*.npz"):
                if old.name != self.data["state"]:
                    old.unlink(missing_ok=True)
        self.write_metrics()

    def write_metrics(self) -> None:
        """``metrics.prom`` beside the ledger: the run's progress in Prometheus
        text format (for node_exporter's textfile collector or a push)."""
        from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

        registry = CollectorRegistry()
        labels = ["run_id"]
        run = self.run_id
        units = self.data["units"].values()
        Gauge(
            "taproute_replay_units_planned", "Work units in the plan", labels, registry=registry
        ).labels(run).set(self.data["units_planned"])
        Gauge("taproute_replay_units_done", "Work units written", labels, registry=registry).labels(
            run
        ).set(len(self.data["units"]))
        Gauge(
            "taproute_replay_units_failed",
            "Work units failed past their retries",
            labels,
            registry=registry,
        ).labels(run).set(len(self.data["failed"]))
        Gauge(
            "taproute_replay_records", "Records read by finished units", labels, registry=registry
        ).labels(run).set(sum(u["records"] for u in units))
        rows = Gauge(
            "taproute_replay_rows_written",
            "Rows written per lane",
            [*labels, "lane"],
            registry=registry,
        )
        per_lane: dict[str, int] = {}
        for unit in units:
            for lane, count in unit["outputs"].items():
                per_lane[lane] = per_lane.get(lane, 0) + count
        for lane, count in per_lane.items():
            rows.labels(run, lane).set(count)
        phase = Gauge(
            "taproute_replay_phase_seconds",
            "Per-unit seconds by phase",
            [*labels, "phase", "quantile"],
            registry=registry,
        )
        for name, stats in self.data["phases"].items():
            phase.labels(run, name, "0.5").set(stats["p50"])
            phase.labels(run, name, "0.95").set(stats["p95"])
        write_to_textfile(str(self.directory / "metrics.prom"), registry)

    def _write(self, text: str) -> None:
        aside = self.directory / "ledger.tmp.json"
        aside.write_text(text)
        os.replace(aside, self.directory / "ledger.json")
        self._saved = text

    def interrupt(self, error: BaseException) -> None:
        """Mark the last checkpoint interrupted (the units done since are not in
        it: their state may not be either; a resume redoes them, exactly once)."""
        saved = self._saved
        data = json.loads(saved) if saved is not None else dict(self.data, units={})
        data["status"] = "interrupted"
        data["error"] = f"{type(error).__name__}: {error}"
        data["ended_at"] = _now()
        self._write(json.dumps(data, indent=1, sort_keys=True, default=str))

    def load_state(self) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]] | None:
        name = self.data.get("state", "state.npz")  # a ledger of before state-<n>.npz
        path = self.directory / name
        if not path.is_file():
            if "state" in self.data:
                raise MissingSource(
                    f"run {self.run_id}: its ledger's checkpoint state {str(path)!r} is gone; "
                    "the run cannot be resumed (start a new run)"
                )
            return None
        with np.load(path) as saved:
            return saved["slots"], saved["valid"]

    def finish(self, state: tuple[npt.NDArray[Any], npt.NDArray[np.bool_]] | None) -> None:
        self.data["status"] = "failed" if self.data["failed"] else "finished"
        self.data["ended_at"] = _now()
        self.checkpoint(state)
