"""A config file's destinations get their spool: mode, directory, policies."""

from __future__ import annotations

import io

import pytest

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
