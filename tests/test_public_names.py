"""The errors the README tells a user to expect are importable from the public
face, ``taproute.service`` (``DirectoryInUse`` was only in a private module)."""

from __future__ import annotations

import builtins
import re
from pathlib import Path

import taproute.service
from taproute.routing.errors import TaprouteError

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_error_the_readme_names_is_exported_from_taproute_service():
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", README.read_text()))
    # Not taproute's: Python's own, clickhouse-connect's; the capture errors
    # live in taproute.service.capture (it needs torch).
    elsewhere = {"OperationalError", "ProgrammingError", "CaptureError", "ContextMismatch"}
    errors = {
        name
        for name in named - elsewhere
        if (
            not hasattr(builtins, name)
            and name.endswith(
                ("Error", "Full", "Locked", "InUse", "Crashed", "Refused", "Mismatch")
            )
        )
        or name in {"NoDeduplication", "MissingTable", "UnboundOutputId", "SinkClosed"}
    }
    assert "DirectoryInUse" in errors  # the README's own words, found by the pattern
    missing = sorted(n for n in errors if not hasattr(taproute.service, n))
    assert missing == [], f"named in the README but not in taproute.service: {missing}"
    for name in errors:
        assert issubclass(getattr(taproute.service, name), Exception)
    assert issubclass(taproute.service.DirectoryInUse, TaprouteError)
