"""What a replay did: :class:`ReplayReport` and its human-readable summary."""

from __future__ import annotations

from pathlib import Path

import attrs

from taproute.service.replay.units import WorkUnit


@attrs.frozen(kw_only=True)
class ReplayReport:
    """What a run did (or, for a dry run, would do)."""

    run_id: str | None
    ledger: Path | None
    plan: list[WorkUnit]
    lanes: dict[str, str]
    units_run: int = 0
    units_skipped: int = 0
    records: int = 0
    rows_written: dict[str, int] = attrs.field(factory=dict)
    failed: dict[str, str] = attrs.field(factory=dict)
    seconds: float = 0.0
    dry_run: bool = False

    def describe(self) -> str:
        """Human-readable summary (what the CLI prints)."""
        rows = sum(u.rows for u in self.plan)
        head = f"plan: {len(self.plan)} work unit(s), ~{rows:,} records; lanes: " + ", ".join(
            f"{k} -> {v}" for k, v in self.lanes.items()
        )
        if self.dry_run:
            return "\n".join(
                [head, *(f"  {u.describe()}" for u in self.plan), "dry run: nothing written"]
            )
        written = ", ".join(f"{k}: {v:,}" for k, v in self.rows_written.items()) or "none"
        return (
            f"{head}\nrun {self.run_id}: {self.units_run} unit(s) run, {self.units_skipped} "
            f"already done, {len(self.failed)} failed; {self.records:,} records in "
            f"{self.seconds:.2f} s; rows written: {written}\nledger: {self.ledger}"
        )
