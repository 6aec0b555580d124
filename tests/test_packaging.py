"""The install lays the four folders out as one `taproute` namespace."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_subpackages_import_under_taproute_only(tmp_path):
    ok = run_python(
        "import taproute.routing, taproute.actors, taproute.native, taproute.service;"
        "import taproute.native._matcher as m; print(m.__file__)",
        tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().endswith(".so")  # compiled by the install, not a .py fallback
    for bare in ("routing", "actors", "native", "service"):
        bare_import = run_python(f"import {bare}", tmp_path)
        assert bare_import.returncode != 0
        assert "ModuleNotFoundError" in bare_import.stderr


def test_routing_layer_does_not_import_trio(tmp_path):
    result = run_python("import sys, taproute.routing; print('trio' in sys.modules)", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
