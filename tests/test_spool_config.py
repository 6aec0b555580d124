"""A config file's destinations get their spool: mode, directory, policies."""

from __future__ import annotations

import io

import numpy as np
import pytest
import trio

from taproute.service.host.config import ConfigFileError, load_config
from taproute.service.host.loadgen import run_load
from taproute.service.sinks.spool import Spool, SpoolConfig
from tests.test_config_file import base, unique, write


def with_spool(text: str, lines: str) -> str:
    return text.replace('raw = ["vec"]\n', 'raw = ["vec"]\n' + lines, 1)


@pytest.mark.parametrize("mode", ["always", "outage"])
def test_a_config_destination_goes_through_its_spool(tmp_path, chdb_transport, mode):
    prefix = unique("sp")
    spool_dir = tmp_path / "spools" / "ch"
    text = with_spool(
        base(chdb_transport, prefix), f'spool = "{mode}"\nspool_dir = "{spool_dir}"\n'
    )
    counters = run_load(
        load_config(write(tmp_path, text)), rate=4000, duration=0.3, out=io.StringIO()
    )
    submitted = counters.ingress.submitted
    assert submitted >= 16 and counters.failure is None
    n = chdb_transport.query(f"SELECT count() AS n FROM `{prefix}_raw_vec`").column("n")[0]
    assert n.as_py() == submitted  # every record, once
    assert (spool_dir / "spool.id").exists()
    # Everything is acknowledged: a reopen finds nothing left to deliver.
    again = Spool.open(SpoolConfig(directory=spool_dir))
    assert len(again) == 0 and again.damage == []
    appended_any = (spool_dir / "ack").exists()
    assert appended_any == (mode == "always")  # outage mode never needed the disk


def test_the_default_spool_directory_is_beside_the_chdb_directory(tmp_path, chdb_transport):
    config = load_config(write(tmp_path, base(chdb_transport, unique("d"))))
    dest = config.destinations["ch"]
    assert dest.spool == "outage"
    assert (
        dest.spool_directory(tmp_path, "ch")
        == chdb_transport.path.with_name(chdb_transport.path.name + "-spool") / "ch"
    )


def test_a_bad_spool_key_names_the_file_and_key(tmp_path, chdb_transport):
    text = with_spool(base(chdb_transport, unique("b")), 'spool = "sometimes"\n')
    with pytest.raises(ConfigFileError) as caught:
        load_config(write(tmp_path, text))
    assert any("destinations.ch.spool" in p for p in caught.value.problems), caught.value.problems


class Refused(Exception):
    """What chDB raises for a block of bad data (not transient)."""


def faulty_chdb(monkeypatch, *, refuse_seq=None, down=False):
    """Make every chDB insert into a raw table refuse a block holding
    ``refuse_seq`` (bad data), or fail as unreachable while ``down``."""
    from taproute.service.sinks.clickhouse import ChdbTransport

    real = ChdbTransport.insert
    state = {"down": down}

    def insert(self, table, data, *, dedup_token, settings=None):
        if "_raw_" in table:
            if state["down"]:
                raise ConnectionRefusedError("ClickHouse unreachable (injected)")
            if refuse_seq is not None and refuse_seq in data.column("seq").to_pylist():
                raise Refused("Code: 53. DB::Exception: TYPE_MISMATCH (injected)")
        real(self, table, data, dedup_token=dedup_token, settings=settings)

    monkeypatch.setattr(ChdbTransport, "insert", insert)
    return state


def with_dead_letters(text: str, path) -> str:
    return text + f'\n[dead_letters]\npath = "{path}"\n'


def test_a_config_destination_dead_letters_only_the_records_it_refuses(
    tmp_path, chdb_transport, monkeypatch
):
    prefix = unique("dl")
    letters = tmp_path / "letters.sqlite"
    spool = f'spool_dir = "{tmp_path / "spool"}"\n'
    text = with_dead_letters(with_spool(base(chdb_transport, prefix), spool), letters)
    faulty_chdb(monkeypatch, refuse_seq=21)
    with load_config(write(tmp_path, text)).build() as built:
        with built.start() as runtime:
            q = runtime.bind_hook("layers.0", layout="vec")
            for seq in range(40):
                runtime.submit(q, np.full(4, seq, np.float32), seq=seq)
            runtime.flush()  # the refused block is durable in the spool, nothing latched
            assert runtime.failure is None
            report = runtime.flush(wait=True)  # drained: the refused block split
            assert report is not None and report.refused_records == {"ch": 1}
            assert report.shed_records == {"ch": 0}
        # Closing delivered what the spool held (the destination is healthy):
        # the refused group was split and only record 21 dead-lettered.
        store = built.dead_letters
        assert store is not None
        (letter,) = store.list()
        assert (letter.seq, letter.code, letter.route) == (
            21,
            "destination_refused",
            "destination:ch",
        )
        assert "TYPE_MISMATCH" in letter.error
    rows = chdb_transport.query(f"SELECT count() AS n, uniqExact(seq) AS u FROM `{prefix}_raw_vec`")
    assert rows.to_pylist() == [{"n": 39, "u": 39}]


@pytest.mark.parametrize("policy", ["drop_newest", "dead_letter", "block"])
def test_a_full_spool_sheds_by_the_configured_policy_and_counts_it(
    tmp_path, chdb_transport, monkeypatch, policy
):
    prefix = unique("q")
    letters = tmp_path / "letters.sqlite"
    lines = f'spool_dir = "{tmp_path / "spool"}"\n'
    lines += f'spool_quota_bytes = 600\nspool_when_full = "{policy}"\n'
    if policy == "block":
        lines += "spool_block_timeout = 0.05\n"  # then shed, counted
    text = with_dead_letters(with_spool(base(chdb_transport, prefix), lines), letters)
    faulty_chdb(monkeypatch, down=True)
    with load_config(write(tmp_path, text)).build() as built, built.start() as runtime:
        q = runtime.bind_hook("layers.0", layout="vec")
        for seq in range(30):
            runtime.submit(q, np.full(4, seq, np.float32), seq=seq)
            report = runtime.flush()  # one batch (one frame) per record
        assert runtime.failure is None  # a full spool never latches the router
        status = runtime.snapshot().destinations["ch"]
        # 30 raw records and their 30 norm rows, all to the one destination
        assert status.healthy == 0 and status.records == 60
        shed = status.spool_shed_records
        assert shed is not None and 0 < shed < 60
        # The routes handed every record over ("delivered" for them); the
        # flush report also says how many the destination shed after that.
        assert report is not None and report.routes["raw"].delivered == 30
        assert report.shed_records == {"ch": shed}
        assert built.dead_letters is not None
        letters_kept = built.dead_letters.list()
    if policy == "dead_letter":
        # raw records are letters; processed rows have no place there (dropped, counted)
        assert 0 < len(letters_kept) < shed
        assert {letter.code for letter in letters_kept} == {"spool_full"}
    else:
        assert letters_kept == []


def test_the_files_ingress_max_block_bounds_a_full_spools_wait(
    tmp_path, chdb_transport, monkeypatch
):
    """``[ingress] max_block`` is the built service's capture budget, and so the
    default ``spool_block_timeout``: a spool at its quota on a destination that
    is down sheds (counted) instead of holding ``submit`` until there is room.
    (A config-built service had no way to set a budget: the file refused the
    key and ``start()`` passed none, so this blocked for good.)"""
    prefix = unique("mb")
    lines = f'spool_dir = "{tmp_path / "spool"}"\nspool_quota_bytes = 600\n'
    text = with_spool(base(chdb_transport, prefix), lines)
    text = text.replace("[http]", "[ingress]\nmax_block = 0.05\n\n[http]", 1)
    faulty_chdb(monkeypatch, down=True)
    with load_config(write(tmp_path, text)).build() as built, built.start() as runtime:
        assert runtime.max_block == 0.05
        q = runtime.bind_hook("layers.0", layout="vec")
        for seq in range(30):
            runtime.submit(q, np.full(4, seq, np.float32), seq=seq)
            runtime.flush()  # one batch (one frame) per record
        assert runtime.failure is None
        status = runtime.snapshot().destinations["ch"]
        shed = status.spool_shed_records
        assert shed is not None and 0 < shed < 60


def test_dead_letter_when_full_needs_a_dead_letter_store(tmp_path):
    text = """
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
url = "http://127.0.0.1:1/"
raw = ["vec"]
spool_when_full = "dead_letter"
spool_block_timeout = -1
"""
    with pytest.raises(ConfigFileError) as caught:
        load_config(write(tmp_path, text))
    problems = caught.value.problems
    assert any(
        p.startswith("destinations.ch.spool_when_full: 'dead_letter' needs a dead-letter store")
        for p in problems
    ), problems
    assert "destinations.ch.spool_block_timeout: must be in [0, 86400], found -1" in problems


def test_spool_numbers_are_refused_when_the_file_is_loaded(tmp_path):
    """A spool quota or fsync interval <= 0 was refused only when the service
    started (a ConfigError naming neither file nor key), and ``taproute
    check`` passed the file; now loading it names both."""
    text = """
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
url = "http://127.0.0.1:1/"
raw = ["vec"]
spool_quota_bytes = 0
spool_fsync_interval = -1.0
"""
    with pytest.raises(ConfigFileError) as caught:
        load_config(write(tmp_path, text))
    problems = caught.value.problems
    assert "destinations.ch.spool_quota_bytes: must be in [1, 2**50], found 0" in problems
    assert "destinations.ch.spool_fsync_interval: must be in [0.001, 3600], found -1" in problems


def test_spool_bounds_are_reported_beside_a_bad_key_of_the_same_destination(tmp_path):
    """The spool's and close's bounds were checked only once every key of the
    file had its type, so a mistyped key beside them hid them: the report
    named `spool_fsync` and not the negative quota, and fixing one showed the
    next.  Now one report holds all of them."""
    text = """
[[layouts]]
name = "vec"
columns = [{ name = "values", type = "Array(Float32)", shape = [4] }]

[[routes]]
name = "raw"
outputs = ["layers.*"]
destination = "ch"

[destinations.ch]
url = "http://127.0.0.1:1/"
raw = ["vec"]
spool_fsync = "never"
spool_quota_bytes = -5
spool_fsync_interval = 0
spool_block_timeout = -1
close_timeout = -1

[routing]
unmatched = "drop"
"""
    with pytest.raises(ConfigFileError) as caught:
        load_config(write(tmp_path, text))
    assert sorted(caught.value.problems) == [
        "destinations.ch.close_timeout: must be in [0, 86400], found -1",
        "destinations.ch.spool_block_timeout: must be in [0, 86400], found -1",
        "destinations.ch.spool_fsync: expected one of 'flush', 'interval', 'batch', "
        "found string 'never'",
        "destinations.ch.spool_fsync_interval: must be in [0.001, 3600], found 0",
        "destinations.ch.spool_quota_bytes: must be in [1, 2**50], found -5",
    ]


def test_check_refuses_a_spool_directory_the_run_could_not_open(tmp_path, chdb_transport):
    """``taproute check`` opened each destination but not its spool: a
    ``spool_dir`` naming a regular file, or a spool another sink holds, passed
    check ("tables ... match the schema") and then refused ``taproute run``,
    though what check accepts, run can start. Both are now refused by check,
    with the key and the reason run gives; a spool the running service holds
    (``check --url``) is left alone."""
    prefix = unique("cs")
    regular = tmp_path / "regular"
    regular.write_text("")
    text = with_spool(base(chdb_transport, prefix), f'spool_dir = "{regular}"\n')
    config = load_config(write(tmp_path, text))
    with pytest.raises(ConfigFileError) as caught:
        config.check_destinations()
    assert caught.value.problems == [
        f"destinations.ch.spool_dir: cannot create directory {regular}: "
        "exists and is not a directory"
    ]
    with pytest.raises(ConfigFileError) as ran:  # what run says about it
        run_load(config, rate=100, duration=0.1, out=io.StringIO())
    assert ran.value.problems == caught.value.problems

    spool_dir = tmp_path / "held"
    text = with_spool(base(chdb_transport, prefix), f'spool_dir = "{spool_dir}"\n')
    config = load_config(write(tmp_path, text))
    held = Spool.open(SpoolConfig(directory=spool_dir))
    try:
        with pytest.raises(ConfigFileError) as caught:
            config.check_destinations()
        (problem,) = caught.value.problems
        assert problem.startswith(f"destinations.ch.spool_dir: cannot open spool {spool_dir}: ")
        assert "in use by another sink or process" in problem
        assert len(config.check_destinations(running=True)) == 1  # the service's own
    finally:
        trio.run(held.aclose)
    (line,) = config.check_destinations()
    assert "match the schema" in line
