"""`taproute report`: charts of every signal table, an index page, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from taproute.service.host.cli import main
from taproute.service.signals import experts, pathways, qk, twonn
from taproute.service.signals.common import tail_layout
from taproute.service.signals.report import signal_table, write_report
from taproute.service.sinks.clickhouse.columns import rows_table
from taproute.service.sinks.clickhouse.tables import rows_table_spec
from tests.signal_records import Stateful, records_of, stateless

PREFIX = "rep_"


def store(transport, rows, layout):
    spec = rows_table_spec(layout, PREFIX + layout.name)
    transport.execute(f"DROP TABLE IF EXISTS `{spec.name}`")
    transport.execute(spec.create_sql())
    transport.insert(spec.name, rows_table(rows, layout, spec), dedup_token=spec.name)


def signal_rows():
    """Rows of the four default processors over synthetic inputs with known structure."""
    rng = np.random.default_rng(0)
    out = {}
    arrays = [rng.normal(size=(12, 768)).astype(np.float32) for _ in range(4)]
    out[qk.SIGNALS.outputs[0]] = np.concatenate(
        [
            stateless(
                "signals.qk_spectra",
                records_of(arrays, tail_layout("qk"), hooks=f"encoder.layer.{layer}.qk"),
            )
            for layer in range(3)
        ]
    )
    health = Stateful("signals.expert_health")
    rows = []
    for layer in range(2):
        bias = np.zeros(8)
        bias[layer] = 2.0  # layer 0 favours expert 0, layer 1 expert 1
        logits = [rng.normal(size=(20, 8)) + bias for _ in range(128)]
        names = [f"model.layers.{i}.mlp.gate" for i in range(2)]
        rows.append(health(records_of(logits, tail_layout("r"), hooks=names, output_ids=layer)))
    out[experts.SIGNALS.outputs[0]] = np.concatenate(rows)
    paths = Stateful("signals.pathways")
    logits = [rng.normal(size=(20, 32)) for _ in range(64)]
    out[pathways.SIGNALS.outputs[0]] = paths(records_of(logits, tail_layout("p")))
    dims = Stateful("signals.intrinsic_dimension")
    rows = []
    for layer in range(2):
        names = [f"encoder.layer.{i}.output" for i in range(2)]
        points = [
            (rng.normal(size=(30, 3 + 3 * layer)) @ rng.normal(size=(3 + 3 * layer, 384)))
            for _ in range(64)
        ]
        rows.append(dims(records_of(points, tail_layout("h"), hooks=names, output_ids=layer)))
    out[twonn.SIGNALS.outputs[0]] = np.concatenate(rows)
    return out


def test_report_draws_every_signal_table_and_links_it(chdb_transport, tmp_path):
    for layout, rows in signal_rows().items():
        store(chdb_transport, rows, layout)
    written = write_report(chdb_transport, tmp_path, prefix=PREFIX)
    names = sorted(p.name for p in written)
    assert names == sorted(
        ["qk_by_layer.png", "expert_load.png", "pathway_transitions.png",
         "intrinsic_dimension.png", "index.html"]
    )  # fmt: skip
    for path in written:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    index = (tmp_path / "index.html").read_text()
    for name in names[:-1] if names[-1] == "index.html" else names:
        if name.endswith(".png"):
            assert f"src='{name}'" in index
    assert "rep_expert_health" in index
    lines = signal_table(chdb_transport, prefix=PREFIX)
    assert lines[0].split() == ["layer", "effective", "rank", "attn", "entropy", "intrinsic", "dim"]
    by_layer = {int(line.split()[0]): line.split()[1:] for line in lines[1:]}
    assert sorted(by_layer) == [0, 1, 2]
    assert by_layer[2][2] == "n/a"  # no hidden states captured for layer 2
    # 3- and 6-dimensional data: the table shows their TwoNN estimates, in order.
    assert float(by_layer[0][2]) < float(by_layer[1][2])


def test_report_command_writes_charts_and_fails_clearly_without_tables(
    chdb_transport, tmp_path, capsys
):
    for layout, rows in signal_rows().items():
        store(chdb_transport, rows, layout)
    args = ["report", "--data", str(chdb_transport.path), "--out", str(tmp_path / "out")]
    assert main([*args, "--prefix", PREFIX]) == 0
    assert (tmp_path / "out" / "index.html").exists()
    assert "index.html" in capsys.readouterr().out
    # No signal table there: not a ConfigError (exit 1) but bad input (exit
    # 2), one line naming what is missing and what writes it.
    assert main([*args, "--prefix", "nothing_here_"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ConfigError" not in err
    assert err.startswith(
        f"taproute: report: no signal table with rows in chDB at {chdb_transport.path} "
        "(missing nothing_here_qk_spectra, nothing_here_expert_health, "
        "nothing_here_pathways, nothing_here_intrinsic_dimension):"
    )
    assert "signals.* processors" in err and "signals.toml" in err
    # One there but empty: named as such, the others as missing.
    spec = rows_table_spec(qk.SIGNALS.outputs[0], "hollow_" + qk.SIGNALS.outputs[0].name)
    chdb_transport.execute(f"DROP TABLE IF EXISTS `{spec.name}`")
    chdb_transport.execute(spec.create_sql())
    assert main([*args, "--prefix", "hollow_"]) == 2
    err = capsys.readouterr().err
    assert (
        "(missing hollow_expert_health, hollow_pathways, hollow_intrinsic_dimension; "
        "empty hollow_qk_spectra)" in err
    )


def test_a_report_that_fails_before_writing_creates_no_out_folder(chdb_transport, tmp_path, capsys):
    """No signal table with rows (none there, or one there but empty): the
    command exits 2 and leaves nothing behind, not an empty ``--out`` folder
    (nor the parents it would have made)."""
    spec = rows_table_spec(qk.SIGNALS.outputs[0], "unfilled_" + qk.SIGNALS.outputs[0].name)
    chdb_transport.execute(f"DROP TABLE IF EXISTS `{spec.name}`")
    chdb_transport.execute(spec.create_sql())
    out = tmp_path / "reports" / "out"
    for prefix in ("nothing_here_", "unfilled_"):
        args = ["report", "--data", str(chdb_transport.path), "--out", str(out)]
        assert main([*args, "--prefix", prefix]) == 2
        assert "no signal table with rows" in capsys.readouterr().err
        assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["report", "--data", "{typo}", "--out", "{out}"],
        [
            "replay",
            "--chdb",
            "{typo}",
            "--schema",
            "tests.processors:SCHEMA",
            "--layout",
            "vec",
            "--processor",
            "test.norms",
            "--dry-run",
        ],
    ],
)
def test_a_mistyped_chdb_directory_is_bad_input_and_not_created(tmp_path, capsys, command):
    """``report --data`` / ``replay --chdb`` name a directory to read: a path
    with nothing there is refused as bad input (exit 2, naming it), and left
    absent (chDB created it, and the command then failed on the empty store)."""
    typo = tmp_path / "taproute-dtaa"
    args = [a.format(typo=typo, out=tmp_path / "out") for a in command]
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert f"--{args[1].lstrip('-')} {typo}: no chDB directory there" in capsys.readouterr().err
    assert not typo.exists()
    assert not (tmp_path / "out").exists()
