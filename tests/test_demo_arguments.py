"""``taproute demo``'s arguments are checked like every other command's: a port
out of range was a traceback (attrs' ValueError from HttpConfig, exit 1),
``--sentences 0`` or ``-3`` ran a demo of nothing, and a ``--data`` that is a
regular file was a traceback (FileExistsError) after the model loaded; each is
now one line, exit 2, before anything loads.  (A ``--data`` another process
holds: ``tests/test_check_running.py``.)"""

from __future__ import annotations

import pytest

from tests.test_cli import one_line_error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--port", "70000", "--serve"], "argument --port: a port is in [0, 65535], got 70000"),
        (["--port", "-1"], "argument --port: a port is in [0, 65535], got -1"),
        (["--sentences", "0"], "argument --sentences: must be in [1, 1e9], got 0"),
        (["--sentences", "-3"], "argument --sentences: must be in [1, 1e9], got -3"),
        (["--sentences", "abc"], "argument --sentences: not an integer: 'abc'"),
    ],
)
def test_bad_demo_arguments_are_one_line_exit_2(capsys, tmp_path, argv, expected):
    line = one_line_error(capsys, ["demo", "--data", str(tmp_path / "d"), *argv], 2)
    assert expected in line
    assert not (tmp_path / "d").exists()  # refused before anything was made


def test_a_data_path_that_is_not_a_directory_is_one_line_exit_2(capsys, tmp_path):
    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    line = one_line_error(capsys, ["demo", "--data", str(regular)], 2)
    assert f"--data {regular}: cannot create the directory: exists and is not a directory" in line
    line = one_line_error(capsys, ["demo", "--data", str(regular / "under")], 2)
    assert f"--data {regular / 'under'}: cannot create the directory" in line
    assert regular.read_text() == "not a directory"
