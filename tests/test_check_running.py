"""``taproute check --config FILE --url URL`` beside the service running that file.

The README's way to look for keys left open on a running service.  With a
chDB destination the running service holds the directory (chDB allows one
process per directory), and check refused the file ("in use by process N",
exit 2) before it ever asked the service: the command could not be used for
what it is documented for.  Now, with ``--url``, a held directory is reported
as the running service's and not opened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from taproute.service.host.cli import main
from tests.test_reload_service import RAW, ROOT, Output, config_text


def test_check_with_url_beside_the_running_service(tmp_path, capsys):
    path = tmp_path / "router.toml"
    path.write_text(config_text(tmp_path, RAW))
    child = subprocess.Popen(
        [sys.executable, "-m", "taproute.service.host.cli", "run", "--config", str(path),
         "--rate", "200", "--duration", "600"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out = Output(child.stdout)
        url = out.wait_for(r"serving (http://\S+)/metrics").group(1)
        capsys.readouterr()
        assert main(["check", "--config", str(path), "--url", url]) == 0
        printed = capsys.readouterr()
        assert f"is open in process {child.pid} (the running service)" in printed.out
        assert "in use" not in printed.err

        # Without --url the file is checked as before starting it: refused.
        assert main(["check", "--config", str(path)]) == 2
        assert f"in use by process {child.pid}" in capsys.readouterr().err

        # The demo refuses the directory at once too (it loaded the model first).
        assert main(["demo", "--data", str(tmp_path / "data")]) == 2
        assert f"chDB directory in use by process {child.pid}" in capsys.readouterr().err

        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=120) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=120)
