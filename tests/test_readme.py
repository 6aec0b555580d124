"""The README's "In one screen" example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_one_screen_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = blocks[0]
    assert "create_record_runtime" in example
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["8", "buffer back to the pool"]


def test_every_name_the_readme_imports_or_catches_is_public():
    """What the README imports from ``taproute.service`` exists there, and so do
    the errors it tells an embedding program to expect (they were only in
    ``taproute.routing.errors`` and the spool's own modules)."""
    import taproute.service as service

    text = README.read_text()
    imported: set[str] = set()
    for grouped, inline in re.findall(r"from taproute\.service import (?:\(([^)]*)\)|(.*))", text):
        names = (grouped or inline).split("#")[0] if inline else grouped
        imported |= {n.strip().strip("`") for n in names.split(",") if n.strip()}
    caught = {
        "ConfigError",
        "ConfigFileError",
        "PlanErrors",
        "RerouteRefused",
        "RoutingFailure",
        "SinkClosed",
        "SpoolLocked",
        "UnboundOutputId",
        "PayloadSizeMismatch",
        "DeadLetterNotFound",
        "BuiltService",
        "load_config",
    }
    assert imported >= {"create_record_runtime", "ClickHouseSink", "Spool"}
    missing = sorted(n for n in imported | caught if n.isidentifier() and not hasattr(service, n))
    assert missing == []
    assert caught <= set(service.__all__)
