"""The ``taproute`` command: the demo end to end (the README's main job, CI's smoke
test), and operators' commands failing in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from taproute.routing import FailureCode, HookRegistry, RecordFailure
from taproute.service.demo import minilm, processors, run
from taproute.service.host.cli import main
from taproute.service.ops.dead_letters import DeadLetterStore
from tests.conftest import vec_batch

SENTENCES = 24


def test_demo_captures_minilm_and_lands_every_route_in_chdb(capsys, chdb_transport):
    # chDB allows one data directory per process: the demo shares the test session's.
    assert main(["demo", "--sentences", str(SENTENCES), "--data", str(chdb_transport.path)]) == 0
    out = capsys.readouterr().out
    text = out.splitlines()
    header = next(i for i, line in enumerate(text) if line.startswith("route"))
    routes = {line.split()[0]: line.split() for line in text[header + 1 : header + 4]}
    hooks_per_sentence = processors.LAYERS * 3  # query, key and hidden state of each layer
    assert routes["raw"][1:] == ["forward", *[str(SENTENCES * hooks_per_sentence)] * 2, "0"]
    assert routes["head_norms"][1:] == ["stateless", *[str(SENTENCES * 12)] * 2, "0"]
    assert routes["unit_stats"][1:3] == ["stateful", str(SENTENCES * 6)]
    assert "layer 5  query" in out
    # The table of row counts lines up (a 19-letter table name pushed its count out).
    first = text.index(next(line for line in text if line.startswith("table ")))
    table = text[first : first + 6]
    assert len({len(line) for line in table}) == 1, table  # counts right-aligned

    query = chdb_transport.query
    counts = query(
        "SELECT (SELECT count() FROM raw_activations) AS raw, "
        "(SELECT count() FROM head_norms) AS norms, "
        "(SELECT uniqExact(layer) FROM unit_stats) AS layers"
    ).to_pylist()
    assert counts == [{"raw": SENTENCES * 18, "norms": SENTENCES * 12, "layers": 6}]

    # The raw capture is exactly what the module computed, padding cut off.
    model, tokenizer = minilm.load()
    ids, mask = minilm.encode(tokenizer, run.sentences(SENTENCES)[:16])
    captured: dict[str, torch.Tensor] = {}
    handle = model.encoder.layer[2].attention.self.query.register_forward_hook(
        lambda _m, _i, out: captured.setdefault("q", out.detach().clone())
    )
    with torch.inference_mode():
        model(ids, mask)
    handle.remove()
    real_tokens = int(mask[3].sum())
    expected = captured["q"][3, :real_tokens].numpy().ravel()
    row = query(
        "SELECT values, values_shape FROM raw_activations "
        "WHERE hook = 'encoder.layer.2.attention.self.query' AND key = 3"
    ).to_pylist()
    assert len(row) == 1 and row[0]["values_shape"] == [real_tokens, 384]  # the real shape
    np.testing.assert_allclose(
        np.array(row[0]["values"], np.float32), expected, rtol=1e-5, atol=1e-5
    )

    # Welford over every real token of a layer equals the plain mean/variance.
    stats = query(
        "SELECT count, mean, variance FROM unit_stats WHERE layer = 0 ORDER BY count DESC LIMIT 1"
    ).to_pylist()[0]
    total_tokens = sum(
        int(m.sum())
        for start in range(0, SENTENCES, 16)
        for m in [minilm.encode(tokenizer, run.sentences(SENTENCES)[start : start + 16])[1]]
    )
    assert stats["count"] == total_tokens


# -- operators' commands end in one line, never a traceback (#10.19) -----------

REPO = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "taproute.service.host.cli"]


def letters_store(path: Path, count: int = 2) -> Path:
    """A real dead-letter store holding ``count`` letters (ids 1..count)."""
    hooks = HookRegistry()
    hooks.bind("layers.0")
    store = DeadLetterStore(path, hooks=hooks)
    store.put(
        RecordFailure(
            route="raw",
            processor=None,
            error=ValueError("bad"),
            records=vec_batch(0, count),
            code=FailureCode.HANDLER_INVALID,
        )
    )
    store.close()
    return path


def one_line_error(capsys, argv: list[str], code: int) -> str:
    try:
        returned = main(argv)
    except SystemExit as exited:  # argparse's refusals
        returned = exited.code
    assert returned == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_second_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch, tmp_path):
    """A second SIGINT to ``taproute run`` (its escape hatch past the graceful
    stop) raised KeyboardInterrupt out of the command: a traceback, where the
    README says errors are one line and never one."""
    from taproute.service.host.cli import run as run_command

    def interrupted(*_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_command, "run", interrupted)
    line = one_line_error(capsys, ["run", "--config", str(tmp_path / "x.toml")], 130)
    assert line.startswith("taproute: interrupted")


def test_listing_a_missing_store_refuses_and_creates_nothing(capsys, tmp_path):
    typo = tmp_path / "typo.sqlite"
    line = one_line_error(capsys, ["dead-letters", "list", "--store", str(typo)], 2)
    assert line == f"taproute: no dead-letter store at {typo}"
    assert not typo.exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_store_is_one_line_and_left_as_it_was(capsys, tmp_path, damage):
    path = tmp_path / "dead.sqlite"
    if damage == "garbage":
        path.write_bytes(b"this is not sqlite " * 300)
    else:
        letters_store(path, count=400)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = path.read_bytes()
    for argv in (["list"], ["show", "1"], ["skip", "1"]):
        line = one_line_error(capsys, ["dead-letters", *argv, "--store", str(path)], 2)
        assert line.startswith(f"taproute: {path}: ")
        assert "unreadable store" in line or "not a dead-letter store" in line
    assert path.read_bytes() == before
    sidecars = {"dead.sqlite-wal", "dead.sqlite-shm"}  # SQLite's own, for a WAL-mode file
    assert {p.name for p in tmp_path.iterdir()} - sidecars == {"dead.sqlite"}


def test_bad_ids_tokens_and_unreachable_services_are_one_line(capsys, tmp_path):
    store = letters_store(tmp_path / "dead.sqlite")
    before = store.read_bytes()
    line = one_line_error(
        capsys, ["dead-letters", "show", "99999999999999999999999", "--store", str(store)], 2
    )
    assert "dead letter ids are in [1, 2**63 - 1]" in line
    huge = "9" * 23
    line = one_line_error(capsys, ["trace", "--config", "x", "--hook", "h", "--key", huge], 2)
    assert line.endswith(f"--key: must be a 64-bit integer, got {huge} (see --help)")
    # A port bound but never listened on: refused, and no other process can
    # take it meanwhile (a port freed again could be, by a busy machine).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        line = one_line_error(
            capsys, ["dead-letters", "skip", "1", "--url", url, "--token", "t"], 1
        )
    assert line.startswith(f"taproute: cannot reach {url}: ") and "refused" in line
    line = one_line_error(
        capsys, ["dead-letters", "skip", "1", "--url", url, "--token", "jéton"], 2
    )
    assert "--token: a token is printable ASCII without spaces" in line
    assert store.read_bytes() == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "-5"], "--rate: must be in (0, 1e9] records per second, got -5"),
        (["--rate", "nan"], "--rate: must be in (0, 1e9] records per second, got nan"),
        (["--duration", "-1"], "--duration: must be in [0, 86400] seconds, got -1"),
    ],
)
def test_run_refuses_a_rate_or_duration_it_cannot_pace(capsys, tmp_path, argv, message):
    """A negative rate reached time.sleep and ended in a traceback."""
    config = tmp_path / "router.toml"
    config.write_text("")
    line = one_line_error(capsys, ["run", "--config", str(config), *argv], 2)
    assert line.endswith(f"{message} (see --help)")


@contextmanager
def _chdb_held(data: Path) -> Iterator[int]:
    """chDB directory ``data`` opened by another process until the block
    ends (chDB lets one process open a directory); yields that process's pid."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, chdb.session as s; x = s.Session(sys.argv[1]); "
            "print('ready', flush=True); sys.stdin.read()",
            str(data),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        yield holder.pid
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)


def test_offline_reroute_while_the_service_holds_chdb_is_one_line(tmp_path):
    data = tmp_path / "data"
    store = letters_store(tmp_path / "dead.sqlite")
    config = tmp_path / "router.toml"
    config.write_text(
        f"""
processors = ["tests.processors"]
[[layouts]]
name = "vec"
columns = [{{ name = "values", type = "Array(Float32)", shape = [4] }}]
[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"
[destinations.ch]
path = "{data}"
raw = ["vec"]
[dead_letters]
path = "{store}"
[routing]
unmatched = "drop"
"""
    )
    with _chdb_held(data) as holder_pid:
        child = subprocess.run(
            [*COMMAND, "dead-letters", "reroute", "1", "--config", str(config)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
    assert child.returncode == 2, child.stderr
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1, child.stderr
    assert lines[0] == (
        f"{config}: destinations.ch.path: cannot open chDB at {data}: "
        f"in use by process {holder_pid}"
    )
    reopened = DeadLetterStore(store, create=False)
    try:
        assert [(d.id, d.state) for d in reopened.list(state=None)] == [(1, "dead"), (2, "dead")]
    finally:
        reopened.close()


def test_an_unknown_dead_letter_id_is_one_line_exit_1_and_the_store_is_untouched(capsys, tmp_path):
    """An id the store does not hold is a refused control (exit 1, as a
    running service's 404 over --url is), named with the store."""
    store = letters_store(tmp_path / "dead.sqlite")
    before = store.read_bytes()
    for action in ("show", "skip"):
        line = one_line_error(capsys, ["dead-letters", action, "424242", "--store", str(store)], 1)
        assert f"no dead letter with id 424242 in {store}" in line
    assert store.read_bytes() == before


def test_output_into_a_closed_pipe_is_one_line_not_a_traceback(tmp_path):
    """``taproute dead-letters list --store F | head -1`` (the reader leaves
    before the listing ends) printed a BrokenPipeError traceback, and Python
    another at exit, where the README promises one line per problem, never a
    traceback. The pipe's reader is closed before the command starts, so its
    first write fails, as a ``head`` that has read enough makes it fail."""
    store = letters_store(tmp_path / "dead.sqlite", count=3)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [*COMMAND, "dead-letters", "list", "--store", str(store)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == ["taproute: output closed early (broken pipe)"]
    assert done.returncode == 1


def test_replay_of_a_chdb_directory_another_process_holds_is_one_line_exit_2(tmp_path):
    """Two replays of one chDB corpus at once (or a replay beside a running
    service): chDB lets one process open a directory, and the second replay
    died with a traceback ending in "Error initializing EmbeddedServer: .",
    exit 1, naming neither the directory nor who held it."""
    data = tmp_path / "chdb"
    data.mkdir()
    with _chdb_held(data) as holder_pid:
        child = subprocess.run(
            [
                *COMMAND,
                "replay",
                "--schema",
                "tests.processors:SCHEMA",
                "--processor",
                "test.norms",
                "--layout",
                "vec",
                "--chdb",
                str(data),
                "--output",
                f"norm=parquet:{tmp_path / 'out'}",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
    assert child.returncode == 2, child.stderr
    assert child.stderr.strip().splitlines() == [
        f"taproute: replay --chdb {data}: chDB directory in use by process {holder_pid} "
        "(chDB allows one process per directory)"
    ]
    assert not (tmp_path / "out").exists()
