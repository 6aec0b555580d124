"""Config files: every problem reported with file and key path; check and run commands."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import sys
import uuid
from pathlib import Path

import attrs
import pytest

from taproute.routing import FailurePolicy, Route
from taproute.service.host.cli import main
from taproute.service.host.config import ConfigFileError, load_config
from taproute.service.host.loadgen import run_load
from taproute.service.ops.dead_letters import DeadLetterStore
from taproute.service.ops.parking import ParkedRecordStore
from tests.processors import LAYOUTS_TOML

BASE = (
    """
processors = ["tests.processors"]

"""
    + LAYOUTS_TOML
    + """
[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[[routes]]
name = "norms"
outputs = ["layers.*"]
mode = "stateless"
processor = "test.norms"
destination = "ch"

[destinations.ch]
path = "@PATH@"
raw = ["vec"]
rows = ["norm"]
raw_table = "@PREFIX@_raw_{layout}"
rows_table = "@PREFIX@_{layout}"

[routing]
unmatched = "drop"

[http]
port = 0

[[producer.hooks]]
name = "layers.0"
layout = "vec"
batch = 16
"""
)


#: What a [[routes]] entry may set: Route's fields but the predicate (code, not data).
ROUTE_KEYS = ", ".join(f.name for f in attrs.fields(Route) if f.name != "predicate")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return path


def base(chdb_transport, prefix: str) -> str:
    return BASE.replace("@PATH@", str(chdb_transport.path)).replace("@PREFIX@", prefix)


def unique(name: str) -> str:
    return f"{name}{uuid.uuid4().hex[:8]}"


def test_structure_errors_name_file_and_key_path(tmp_path):
    path = write(
        tmp_path,
        """
layouts = []
[[routes]]
name = "r"
outputs = ["x"]
destination = "d"
workers = "many"
colour = "blue"
[destinations.d]
path = "x"
raw = "vec"
[routing]
unmatched = "drop"
""",
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "routes[0].workers: expected an integer, found string 'many'",
        f"routes[0]: unknown key(s) 'colour'; expected keys: {ROUTE_KEYS}",
        "destinations.d.raw: expected an array, found string 'vec'",
    ]
    assert str(caught.value).splitlines() == [f"{path}: {p}" for p in caught.value.problems]


def test_choices_and_bounds_name_what_was_expected_and_every_problem(tmp_path):
    """A misspelt choice names the choices (not cattrs' "invalid value"), and a
    value past its bounds does not hide its neighbours' problems."""
    path = write(
        tmp_path,
        """
layouts = []
[[routes]]
name = "r"
outputs = ["x"]
destination = "d"
mode = "statless"
processor = "p"
failure_policy = { deadline = nan, multiplier = 0.5 }
[destinations.d]
path = "x"
spool = "never"
[routing]
unmatched = "dorp"
[ingress]
when_full = true
""",
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "routes[0].mode: expected one of 'forward', 'stateless', 'stateful', "
        "found string 'statless'",
        "routes[0].failure_policy.multiplier: must be in [1, 10], found 0.5",
        "routes[0].failure_policy.deadline: expected a finite number, found nan",
        "destinations.d.spool: expected one of 'outage', 'always', 'off', found string 'never'",
        "routing.unmatched: expected one of 'default', 'drop', found string 'dorp'",
        "ingress.when_full: expected one of 'block', 'reject', found boolean True",
    ]


def test_reference_problems_are_reported_with_the_type_and_bound_problems(tmp_path):
    """A route naming an unknown destination, a hook or destination naming an
    unknown layout, a chain naming no route: such references were reported
    only once every type and bound was fixed (the next round, or the one
    after, at build), so fixing a file one report at a time took several.
    Each is now checked wherever both its ends can be read, beside a bad
    sibling value, and listed with the rest."""
    path = write(
        tmp_path,
        """
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]
[[routes]]
name = "r"
outputs = ["x", "route:nothing*"]
destination = "nowhere"
workers = 0
then = ["later", "r"]
[[routes]]
name = "s"
outputs = ["y"]
destination = 7
[destinations.d]
path = "x"
raw = ["vec", "vek"]
batching = { linger = 0.0 }
[routing]
default_destination = "dd"
[[producer.hooks]]
name = "h"
layout = "vecc"
batch = 0
""",
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "routes[0].workers: must be in [1, 1024], found 0",
        "routes[1].destination: expected a string, found integer 7",
        "destinations.d.batching.linger: must be in [0.001, 3600], found 0",
        "producer.hooks[0].batch: must be in [1, 2**20], found 0",
        "routes[0]: route 'r': unknown destination 'nowhere'; given ['d']",
        "routes[0].outputs[1]: route 'r': output 'route:nothing*' names no route (routes: r, s)",
        "routes[0].then[0]: route 'r': then names 'later', which is not a route (routes: r, s)",
        "routing.default_destination: default_destination 'dd' is not among the destinations ['d']",
        "destinations.d.raw[1]: unknown layout 'vek'",
        "producer.hooks[0].layout: unknown layout 'vecc' (have ['vec'])",
    ]


def test_reference_problems_join_the_checks_made_after_structuring(tmp_path):
    """Types fine but another problem found on the structured file (here a
    token with a space): the route's unknown destination is listed with it,
    not left for the build; a file with reference problems only is still
    loaded and they are reported at build with the processors' (see
    test_build_then_run)."""
    path = write(
        tmp_path,
        """
layouts = []
[[routes]]
name = "r"
outputs = ["x"]
destination = "nowhere"
[destinations.d]
path = "x"
[routing]
unmatched = "drop"
[http]
token = "a b"
""",
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "http: HttpConfig token: expected None or printable ASCII without spaces (it is sent "
        "in a header), found str of length 3",
        "routes[0]: route 'r': unknown destination 'nowhere'; given ['d']",
    ]
    path.write_text(path.read_text().replace('token = "a b"', 'token = "ab"'))
    config = load_config(path)  # only a reference problem: reported where it is resolved
    with pytest.raises(ConfigFileError) as built:
        config.candidate_sink()
    assert built.value.problems == [
        "routes[0]: route 'r': unknown destination 'nowhere'; given ['d']"
    ]


NARROW_AND_NO_DEFAULT = """
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]
[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "d"
narrow = { vec = "vec16", vek = "vec" }
[destinations.d]
path = "x"
raw = ["vec"]
"""


def test_narrow_layouts_and_a_missing_default_destination_are_listed_with_type_problems(
    tmp_path,
):
    """A route's ``narrow`` naming an unknown layout and a missing
    ``routing.default_destination`` (unmatched records go to the default
    destination unless ``unmatched = "drop"``) were found only at build, after
    every type problem had been fixed: a round more for a file said to list
    every problem. They are now read from the file with the other references,
    in the build's words."""
    path = write(tmp_path, NARROW_AND_NO_DEFAULT + '[ingress]\ncapacity_records = "x"\n')
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "ingress.capacity_records: expected an integer, found string 'x'",
        "routing.default_destination: no default_destination for unmatched records; name one, "
        "or pass unmatched='drop' to drop (and count) records no route takes",
        "routes[0]: route 'raw', narrow: unknown layout 'vec16'; the schema defines ['vec']",
        "routes[0]: route 'raw', narrow: unknown layout 'vek'; the schema defines ['vec']",
    ]


def test_narrow_layouts_are_checked_as_the_other_layout_references(tmp_path):
    """Types fine: an unknown narrow layout is refused when the file is read,
    as a destination's ``raw`` layout is, with the missing default destination
    beside it; with ``unmatched = "drop"`` and the narrow layout defined the
    file loads."""
    path = write(tmp_path, NARROW_AND_NO_DEFAULT)
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    assert caught.value.problems == [
        "routes[0]: route 'raw', narrow: unknown layout 'vec16'; the schema defines ['vec']",
        "routes[0]: route 'raw', narrow: unknown layout 'vek'; the schema defines ['vec']",
        "routing.default_destination: no default_destination for unmatched records; name one, "
        "or pass unmatched='drop' to drop (and count) records no route takes",
    ]
    text = NARROW_AND_NO_DEFAULT.replace(', vek = "vec"', "") + '[routing]\nunmatched = "drop"\n'
    text += (
        '[[layouts]]\nname = "vec16"\n'
        'columns = [{ name = "values", type = "Array(BFloat16)", shape = [4] }]\n'
    )
    assert load_config(write(tmp_path, text)).routes[0].narrow == {"vec": "vec16"}


def test_a_module_failing_to_import_is_listed_with_the_route_problems(tmp_path, chdb_transport):
    """The build stopped at the first processor module it could not import;
    the routes' problems (found without opening anything) came a round later."""
    text = base(chdb_transport, unique("imp")).replace(
        'processors = ["tests.processors"]', 'processors = ["tests.nowhere", "tests.processors"]'
    )
    text = text.replace('destination = "ch"', 'destination = "zz"', 1)
    for make in (lambda c: c.build(), lambda c: c.candidate_sink()):
        with pytest.raises(ConfigFileError) as caught:
            make(load_config(write(tmp_path, text)))
        assert caught.value.problems == [
            "processors[0]: cannot import processor module 'tests.nowhere': "
            "ModuleNotFoundError: No module named 'tests.nowhere'",
            "routes[0]: route 'raw': unknown destination 'zz'; given ['ch']",
        ]


def test_a_value_past_its_bounds_does_not_hide_an_unknown_key_beside_it(tmp_path):
    """A bound refused in a table used to drop that table's unknown keys from
    the report: a second round of fixes for a file said to list every problem."""
    path = write(
        tmp_path,
        """
layouts = []
[[routes]]
name = "r"
outputs = ["x"]
destination = "d"
workers = 0
colour = "blue"
[destinations.d]
path = "x"
batching = { linger = 0.0, lingr = 1.0 }
[routing]
unmatched = "drop"
[ingress]
capacity_records = 0
max_blok = 0.01
""",
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(path)
    problems = caught.value.problems
    assert "routes[0].workers: must be in [1, 1024], found 0" in problems
    assert f"routes[0]: unknown key(s) 'colour'; expected keys: {ROUTE_KEYS}" in problems
    assert "destinations.d.batching.linger: must be in [0.001, 3600], found 0" in problems
    assert any(p.startswith("destinations.d.batching: unknown key(s) 'lingr'") for p in problems)
    assert "ingress.capacity_records: must be in [1, 2**32], found 0" in problems
    assert any(p.startswith("ingress: unknown key(s) 'max_blok'") for p in problems)
    assert len(problems) == 6


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigFileError, match="not valid TOML"):
        load_config(write(tmp_path, "routes = [ oops"))


def test_semantic_errors_name_where(tmp_path, chdb_transport):
    text = base(chdb_transport, unique("sem"))
    cases = {
        'processor = "test.norms"': (
            'processor = "nope"',
            "routes[1]: route 'norms': unknown processor 'nope'",
        ),
        'rows = ["norm"]': ('rows = ["nrom"]', "destinations.ch.rows[0]: unknown layout 'nrom'"),
        '{ name = "norm", type = "Float32" }': (
            '{ name = "norm", type = "Float33" }',
            "ClickHouse type 'Float33' does not map",
        ),
        'processors = ["tests.processors"]': (
            'processors = ["tests.nowhere"]',
            "processors[0]: cannot import processor module 'tests.nowhere'",
        ),
    }
    for original, (replacement, message) in cases.items():
        config_path = write(tmp_path, text.replace(original, replacement))
        with pytest.raises(ConfigFileError, match=re.escape(message)):
            load_config(config_path).build().close()
    both = text.replace("[destinations.ch]\n", '[destinations.ch]\nurl = "http://x:8123"\n')
    with pytest.raises(ConfigFileError, match="destinations.ch: give exactly one of path"):
        load_config(write(tmp_path, both))


def test_check_command_validates_tables(tmp_path, chdb_transport, capsys):
    prefix = unique("chk")
    path = write(tmp_path, base(chdb_transport, prefix))
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 route(s), 2 layout(s) OK" in out and "match the schema" in out
    # Now break one table: the check names table, column, expected and found.
    table = f"{prefix}_norm"
    chdb_transport.execute(f"DROP TABLE `{table}`")
    chdb_transport.execute(
        f"CREATE TABLE `{table}` (key Int64, seq Int64, norm Float64) "
        "ENGINE = MergeTree ORDER BY tuple()"
    )
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert main(["doctor", "--config", str(path)]) == 2  # the same command
    assert capsys.readouterr().err == err
    assert err.startswith(f"{path}: destinations.ch: ")
    assert f"table '{table}': column 'norm' expected Float32, found Float64" in err


def test_run_drives_the_router_at_a_rate_and_serves_http(tmp_path, chdb_transport):
    prefix = unique("run")
    path = write(tmp_path, base(chdb_transport, prefix))
    out = io.StringIO()
    counters = run_load(load_config(path), rate=4000, duration=0.5, out=out)
    submitted = counters.ingress.submitted
    assert submitted >= 16
    assert counters.routes["raw"].processed == submitted
    assert counters.routes["norms"].emitted == submitted
    assert counters.failure is None
    text = out.getvalue()
    assert "serving http://127.0.0.1:" in text and "100%" in text
    table = f"{prefix}_raw_vec"
    rows = chdb_transport.query(f"SELECT count() AS n FROM `{table}`").column("n")[0].as_py()
    assert rows == submitted


def test_run_progress_counts_records_once_and_labels_rows_per_destination(
    tmp_path, chdb_transport, capsys
):
    """Two routes take every record: the progress line says how many records
    were submitted, and the destination's rows as rows (one per route), never
    a summed "delivered" figure twice the records."""
    path = write(tmp_path, base(chdb_transport, unique("progress")))
    assert main(["run", "--config", str(path), "--rate", "2000", "--duration", "0.3"]) == 0
    out = capsys.readouterr().out
    redraws = re.findall(r"([\d,]+) records submitted .* rows sent: ch ([\d,]+), failed 0,", out)
    assert redraws, out
    found = redraws[-1]  # the last redraw, after the final flush
    submitted, rows = (int(g.replace(",", "")) for g in found)
    assert submitted >= 16
    assert rows == 2 * submitted  # raw and norms each send one row per record
    assert "delivered" not in out
    assert (
        f"destination ch: {rows:,} rows sent (from routes raw {submitted:,}, "
        f"norms {submitted:,})" in out
    )


def test_run_prints_its_summary_when_the_shutdown_grace_runs_out(tmp_path, chdb_transport, capsys):
    """A close cut off by the grace raised ShutdownAbandoned through the
    command before anything was printed: the operator got the error line and
    no word of what the routes and destinations did.  The summary comes
    first now; the error line and exit code 1 still follow."""
    from tests.failing_processors import SCRIPT

    text = base(chdb_transport, unique("grace")).replace(
        'processors = ["tests.processors"]',
        'processors = ["tests.processors", "tests.failing_processors"]',
    )
    text = text.replace('processor = "test.norms"', 'processor = "fail.hangs"\nworkers = 1')
    text = text.replace(
        'destination = "ch"\n\n[destinations.ch]',
        'destination = "ch"\nfailure_policy = { deadline = 600.0 }\n\n[destinations.ch]',
    )
    path = write(tmp_path, text + "\n[shutdown]\ngrace = 0.5\n")
    SCRIPT.release_hang.clear()
    try:
        code = main(["run", "--config", str(path), "--rate", "2000", "--duration", "0.2"])
    finally:
        SCRIPT.release_hang.set()  # the abandoned call's thread may end now
    captured = capsys.readouterr()
    assert code == 1
    assert "ShutdownAbandoned: close: the shutdown grace of 0.5 s ran out" in captured.err
    assert "route 'norms' (processing) still busy" in captured.err
    submitted = int(re.findall(r"([\d,]+) records submitted", captured.out)[-1].replace(",", ""))
    assert f"route raw: processed {submitted:,}, emitted {submitted:,}, failed 0" in captured.out
    assert "route norms: processed 0, emitted 0, failed 0" in captured.out
    assert f"destination ch: {submitted:,} rows sent (from routes raw {submitted:,}, norms 0)" in (
        captured.out
    )


class _HangUpOnServing(io.StringIO):
    """Output that sends this process SIGHUP the moment the ``serving`` line is
    written, as a supervisor (or a test) that read the line may do."""

    def write(self, text: str) -> int:
        written = super().write(text)
        if text.startswith("serving "):
            os.kill(os.getpid(), signal.SIGHUP)
        return written


def test_run_takes_a_sighup_sent_as_soon_as_serving_shows(tmp_path, chdb_transport):
    # The handlers were installed after the line was printed: a SIGHUP read
    # off it went to the process's previous handler (by default: the end of
    # the process), which made the subprocess SIGHUP test depend on timing.
    path = write(tmp_path, base(chdb_transport, unique("hup")))
    missed: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: missed.append(signum))
    try:
        out = _HangUpOnServing()
        run_load(load_config(path), rate=1000, duration=0.2, out=out)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert missed == []
    assert f"reloaded {path}: generation 2" in out.getvalue()


def test_the_shipped_load_test_config_is_valid(tmp_path):
    shipped = Path(__file__).resolve().parent.parent / "bench" / "synthetic.toml"
    copy = tmp_path / "synthetic.toml"  # relative paths then resolve under tmp_path
    copy.write_text(shipped.read_text())
    config = load_config(copy)
    with config.build() as built:
        assert [r.name for r in config.routes] == ["raw", "head_norms"]
        built.sink.bind_hook("encoder.layer.3.attention.self.query")  # as a producer would
        trace = built.sink.trace("encoder.layer.3.attention.self.query")
        assert trace.destinations == ["clickhouse"]
        assert built.dead_letters is not None


# -- what passed `check` but broke `run`, coercions, tracebacks (#10.16-18) ----

VALID = """
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
url = "http://127.0.0.1:8123/db"
raw = ["vec"]

[routing]
unmatched = "drop"

[http]
port = 0
"""


def refused(capsys, tmp_path, text: str) -> str:
    """Run `taproute check` on ``text``; assert exit 2 and one line; return that line."""
    path = write(tmp_path, text)
    assert main(["check", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{path}: ")
    return lines[0].removeprefix(f"{path}: ")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        # 10.16: values `run` cannot survive, refused with their bounds.
        (
            ("[http]", "[destinations.ch.batching]\nlinger = nan\n[http]"),
            "destinations.ch.batching.linger: expected a finite number, found nan",
        ),
        (
            ("[http]", "[destinations.ch.batching]\nlinger = inf\n[http]"),
            "destinations.ch.batching.linger: expected a finite number, found inf",
        ),
        (
            ("[http]", "[destinations.ch.batching]\nearly_bytes = 0\n[http]"),
            "destinations.ch.batching.early_bytes: must be in [1, 2**40], found 0",
        ),
        (
            ('destination = "ch"\n', 'destination = "ch"\nworkers = 1000000000\n'),
            "routes[0].workers: must be in [1, 1024], found 1000000000",
        ),
        (
            ("[http]", "[ingress]\ncapacity_records = -5\n[http]"),
            "ingress.capacity_records: must be in [1, 2**32], found -5",
        ),
        (
            ("[http]", "[ingress]\nmax_block = -1\n[http]"),
            "ingress.max_block: must be in [0, 3600], found -1",
        ),
        (("port = 0", "port = 70000"), "http.port: must be in [0, 65535], found 70000"),
        (("port = 0", "port = -1"), "http.port: must be in [0, 65535], found -1"),
        # 10.18: no silent coercion.
        (
            ('destination = "ch"\n', 'destination = "ch"\ncapacity = 1.5\n'),
            "routes[0].capacity: expected an integer, found float 1.5",
        ),
        (
            ('destination = "ch"\n', 'destination = "ch"\nworkers = true\n'),
            "routes[0].workers: expected an integer, found boolean True",
        ),
        (
            ("[http]", "[destinations.ch.retry]\nattempts = 2.0\n[http]"),
            "destinations.ch.retry.attempts: expected an integer, found float 2.0",
        ),
        # 10.17: what raised a traceback.
        (("shape = [4]", "shape = [-1]"), "layouts[0].columns[0].shape: must be in [1, 2**31]"),
        (
            ('raw = ["vec"]', 'raw = ["vec"]\nraw_table = "raw_{bogus}"'),
            "destinations.ch.raw_table: 'raw_{bogus}': unknown field {bogus}",
        ),
        (
            ('raw = ["vec"]', 'raw = ["vec"]\nraw_table = "raw`{layout}"'),
            "destinations.ch.raw_table: table name 'raw`vec' (for layout 'vec') must be letters",
        ),
        (
            ('url = "http://127.0.0.1:8123/db"', 'url = "ftp://127.0.0.1:8123/db"'),
            "destinations.ch.url: expected http(s)://host[:port][/database]",
        ),
        (
            ("port = 0", 'port = 0\ntoken = "sécret"'),
            "http: HttpConfig token: expected None or printable ASCII without spaces",
        ),
    ],
)
def test_check_refuses_what_run_would_fail_on(capsys, tmp_path, edit, expected):
    original, replacement = edit
    assert original in VALID
    problem = refused(capsys, tmp_path, VALID.replace(original, replacement, 1))
    assert problem.startswith(expected), problem


def test_a_config_that_is_not_utf8_is_one_line(capsys, tmp_path):
    text = VALID.replace('name = "raw"', 'name = "r\xe9"').encode("latin-1")
    path = tmp_path / "router.toml"
    path.write_bytes(text)
    assert main(["check", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    offset = text.index(b"\xe9")
    line = text[:offset].count(b"\n") + 1
    assert err == f"{path}: not UTF-8: byte 0xe9 at offset {offset} (line {line})"


def test_a_processor_module_failing_at_import_is_one_line(capsys, tmp_path, monkeypatch):
    module = f"broken_taps_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("raise RuntimeError('GPU 7 not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problem = refused(capsys, tmp_path, f'processors = ["{module}"]\n' + VALID)
    assert problem == (
        f"processors[0]: cannot import processor module {module!r}: RuntimeError: GPU 7 not found"
    )


def test_unusable_destination_and_dead_letter_paths_are_one_line(capsys, tmp_path):
    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    chdb = VALID.replace('url = "http://127.0.0.1:8123/db"', f'path = "{regular}/data"')
    problem = refused(capsys, tmp_path, chdb)
    assert (
        problem == f"destinations.ch.path: cannot create directory {regular}/data: Not a directory"
    )

    in_proc = VALID.replace('url = "http://127.0.0.1:8123/db"', 'path = "/proc/taproute-data"')
    problem = refused(capsys, tmp_path, in_proc)
    assert problem.startswith("destinations.ch.path: cannot create directory /proc/taproute-data")

    dead = VALID + f'[dead_letters]\npath = "{regular}/dead.sqlite"\n'
    problem = refused(capsys, tmp_path, dead)
    assert (
        problem
        == f"dead_letters.path: cannot create directory {regular}: exists and is not a directory"
    )
    assert regular.read_text() == "not a directory"

    problem = refused(capsys, tmp_path, VALID + '[dead_letters]\npath = "/proc/dead.sqlite"\n')
    assert problem.startswith("dead_letters.path: cannot open /proc/dead.sqlite: ")


def test_an_unreachable_url_is_one_line(capsys, tmp_path):
    # A port bound but never listened on: refused, and no other process can
    # take it meanwhile (a port freed again could be, by a busy machine).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        text = VALID.replace("127.0.0.1:8123", f"127.0.0.1:{port}")
        problem = refused(capsys, tmp_path, text)
    assert problem.startswith(f"destinations.ch.url: cannot open http://127.0.0.1:{port}/db: ")


# -- one set of classes: the file is the library's own values (#9.5) -----------


def test_a_route_failure_policy_comes_from_the_file(tmp_path, chdb_transport):
    prefix = unique("pol")
    text = base(chdb_transport, prefix).replace(
        'processor = "test.norms"\n',
        'processor = "fail.always_transient"\n'
        "failure_policy = { deadline = 2.5, max_failures = 2, failure_window = 0, "
        "initial_backoff = 0, multiplier = 1.5, max_backoff = 0 }\n",
    )
    text = text.replace(
        'processors = ["tests.processors"]', 'processors = ["tests.failing_processors"]'
    )
    text += f'[dead_letters]\npath = "{tmp_path / "dead.sqlite"}"\n'
    config = load_config(write(tmp_path, text))
    policy = config.routes[1].failure_policy
    assert policy == FailurePolicy(
        deadline=2.5,
        max_failures=2,
        failure_window=0,
        initial_backoff=0,
        multiplier=1.5,
        max_backoff=0,
    )
    assert config.routes[0].failure_policy == FailurePolicy()
    # And it is what the running route applies: each record given up after
    # exactly 2 tries of its batch, then, in a batch of several records, one
    # last try on its own (flush() does not wait for retries, even due ones: the
    # give-ups finish while the run stops), or, the service having a park
    # store, still parked for its second try when it stopped (kept for the
    # next start, not given up early).
    counters = run_load(config, rate=2000, duration=0.2, out=io.StringIO())
    submitted = counters.ingress.submitted
    store = DeadLetterStore(config.dead_letter_path(), create=False)
    try:
        parked = ParkedRecordStore(store).count("norms")
        letters = store.list(route="norms", limit=10**6)
        assert submitted >= 16 and len(letters) + parked == submitted
        assert {d.attempts for d in letters} <= {2, 3}  # not the default 5 and more
    finally:
        store.close()


def test_call_timeout_sets_every_route_deadline(tmp_path, chdb_transport, capsys):
    config = load_config(write(tmp_path, base(chdb_transport, unique("ct"))))
    timed = config.with_call_timeout(0.25)
    assert [r.failure_policy.deadline for r in timed.routes] == [0.25, 0.25]
    assert [r.failure_policy.deadline for r in config.routes] == [5.0, 5.0]  # a copy
    path = str(config.source)
    with pytest.raises(SystemExit) as exited:
        main(["run", "--config", path, "--call-timeout", "nan"])
    assert exited.value.code == 2
    assert "--call-timeout: must be in [0, 86400] seconds" in capsys.readouterr().err


def test_run_refuses_an_http_port_in_use_and_a_hook_of_no_payload_layout(
    capsys, tmp_path, chdb_transport
):
    text = base(chdb_transport, unique("busy"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = write(tmp_path, text.replace("port = 0", f"port = {port}"))
        assert main(["run", "--config", str(path), "--duration", "0.1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"{path}: http.port: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    rows_layout = text.replace('layout = "vec"\nbatch = 16', 'layout = "norm"\nbatch = 16')
    with_string = rows_layout.replace(
        '{ name = "norm", type = "Float32" }', '{ name = "norm", type = "String" }'
    )
    problem = refused(capsys, tmp_path, with_string)
    assert problem.startswith("producer.hooks[0].layout: layout 'norm', column 'norm': type String")


def test_what_is_not_data_cannot_be_set_from_a_file(tmp_path):
    text = 'source = "elsewhere.toml"\n' + VALID.replace(
        'destination = "ch"\n', 'destination = "ch"\npredicate = "lambda d: True"\n'
    )
    with pytest.raises(ConfigFileError) as caught:
        load_config(write(tmp_path, text))
    assert caught.value.problems == [
        f"routes[0]: unknown key(s) 'predicate'; expected keys: {ROUTE_KEYS}",
        "unknown key(s) 'source'; expected keys: layouts, routes, destinations, processors, "
        "routing, ingress, shutdown, http, dead_letters, producer",
    ]


def test_call_timeout_is_the_deadline_the_running_routes_apply(tmp_path, chdb_transport, capsys):
    # Each call takes 1 s from its own start (a timer from the test's start
    # made a call that began late, on a loaded machine, return within 0.2 s).
    text = base(chdb_transport, unique("slow")).replace(
        'processor = "test.norms"\n',
        'processor = "fail.takes_a_second"\n'
        "failure_policy = { max_failures = 1, failure_window = 0 }\n",
    )
    text = text.replace(
        'processors = ["tests.processors"]', 'processors = ["tests.failing_processors"]'
    )
    path = write(tmp_path, text + f'[dead_letters]\npath = "{tmp_path / "dead.sqlite"}"\n')
    argv = ["run", "--config", str(path), "--rate", "100", "--duration", "0.1"]
    results = {}
    for label, extra in (("file's 5 s", []), ("--call-timeout 0.2", ["--call-timeout", "0.2"])):
        assert main(argv + extra) == 0
        out = capsys.readouterr().out
        results[label] = re.search(r"route norms: processed (\S+), emitted \S+, failed (\S+)", out)
    processed, failed = results["file's 5 s"].groups()
    assert failed == "0" and processed != "0"  # 1 s is within the default deadline
    processed, failed = results["--call-timeout 0.2"].groups()
    assert processed == "0" and failed != "0"  # given up at 0.2 s: handler_timeout
    store = DeadLetterStore(tmp_path / "dead.sqlite", create=False)
    try:
        assert {d.code for d in store.list(route="norms")} == {"handler_timeout"}
    finally:
        store.close()


def test_two_destinations_on_one_spool_directory_are_refused_when_loaded(tmp_path):
    """`taproute check` passed such a file and `run` then failed with 'spool sp
    is in use by another sink or process' (found by the user-side probe)."""
    destinations = "".join(
        f'\n[destinations.{name}]\npath = "data"\nraw = ["vec"]\nraw_table = "{name}_{{layout}}"\n'
        f'spool_dir = "{spool}"\n'
        for name, spool in (("one", "sp"), ("two", "./sp/"), ("off", "sp"))
    )
    routes = "".join(
        f'\n[[routes]]\nname = "{name}"\noutputs = ["layers.*"]\ndestination = "{name}"\n'
        for name in ("one", "two", "off")
    )
    text = LAYOUTS_TOML + routes + destinations + '\n[routing]\nunmatched = "drop"\n'
    path = write(
        tmp_path,
        text.replace(
            'spool_dir = "sp"\n\n[routing]', 'spool = "off"\nspool_dir = "sp"\n\n[routing]'
        ),
    )
    with pytest.raises(ConfigFileError) as refused:
        load_config(path)
    assert refused.value.problems == [
        f"destinations.two.spool_dir: {tmp_path / 'sp'} is also the spool of destinations.one "
        "(a spool has one writer: give each destination its own)"
    ]


def test_an_empty_producer_hook_and_a_bad_terminal_policy_are_named_when_read(
    capsys, tmp_path, chdb_transport
):
    """A [[producer.hooks]] entry with name = "" passed check ("OK") and then
    refused taproute run (HookBindingError, exit 1); terminal_records = "keep"
    in a failure_policy was "routes[1].failure_policy: invalid value", naming
    neither the key nor what it takes."""
    text = base(chdb_transport, unique("np"))
    nameless = text.replace('name = "layers.0"', 'name = ""')
    assert refused(capsys, tmp_path, nameless) == (
        "producer.hooks[0].name: must be a non-empty hook name"
    )
    keep = text.replace(
        'processor = "test.norms"\n',
        'processor = "test.norms"\nfailure_policy = { terminal_records = "keep" }\n',
    )
    assert refused(capsys, tmp_path, keep) == (
        "routes[1].failure_policy: failure policy: terminal_records must be 'drop' or "
        "'dead_letter', got 'keep'"
    )


def test_processor_modules_beside_the_config_file_are_found(tmp_path, monkeypatch):
    """``processors = ["my_taps"]`` with ``my_taps.py`` beside the file: under
    the installed ``taproute`` command the current folder is not on the import
    path, so this failed with "No module named" unless PYTHONPATH was set.
    The file's folder is searched first, as a script's is."""
    import uuid

    monkeypatch.setattr(sys, "path", list(sys.path))  # undo what the load puts there
    monkeypatch.chdir(tmp_path.parent)  # not the config's folder
    module = f"my_taps_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from taproute.routing import stateless_processor\n"
        f"@stateless_processor('{module}.norms', input='vec', output='norm')\n"
        "def norms(records):\n"
        "    return None\n"
    )
    text = BASE.replace('"tests.processors"', f'"tests.processors", "{module}"').replace(
        '"test.norms"', f'"{module}.norms"'
    )
    path = tmp_path / "router.toml"
    path.write_text(text.replace("@PATH@", str(tmp_path / "ch")).replace("@PREFIX@", "beside"))
    config = load_config(path)
    config.import_processors()
    assert module in sys.modules
    assert sys.path[0] == str(tmp_path.resolve())
    config.import_processors()  # again: the folder is on the path once
    assert sys.path.count(str(tmp_path.resolve())) == 1


def test_run_takes_a_sighup_sent_while_it_starts(tmp_path, chdb_transport, monkeypatch):
    # A reload sent while the service was still being built (a config
    # manager reloading every instance) found no handler yet: SIGHUP's
    # default action ended the process (exit 129). The handlers are in
    # place from the start now; the reload is applied once it serves.
    from taproute.service.host import loadgen

    path = write(tmp_path, base(chdb_transport, unique("hup_start")))
    starting = loadgen._serving

    def hang_up_while_starting(built: object) -> object:
        os.kill(os.getpid(), signal.SIGHUP)
        return starting(built)

    monkeypatch.setattr(loadgen, "_serving", hang_up_while_starting)
    missed: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: missed.append(signum))
    try:
        out = io.StringIO()
        run_load(load_config(path), rate=1000, duration=0.2, out=out)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert missed == []
    assert f"reloaded {path}: generation 2" in out.getvalue()
