"""A dead-letter store whose file is deleted while the service runs: give-ups
are refused loudly (the failure handler's error is latched and ``flush()``
raises it, naming the file) instead of being written into the unlinked file.
Before, ``flush()`` reported the records ``dead_lettered`` and the letters
vanished with the process.  A real service from a config file (chDB, the
default store beside it), the file really deleted."""

from __future__ import annotations

import uuid

import pytest

from taproute.routing.errors import RoutingFailure
from taproute.service.host.config import load_config
from taproute.service.ops.dead_letters import DeadLetterStore, DeadLetterStoreError
from tests.conftest import vec_batch
from tests.failing_processors import SCRIPT
from tests.test_operator_controls import config_text


def test_give_ups_into_a_deleted_store_are_refused_naming_it(tmp_path, chdb_transport):
    store = tmp_path / "dead.sqlite"
    path = tmp_path / "router.toml"
    path.write_text(config_text(chdb_transport.path, store, "del" + uuid.uuid4().hex[:8]))
    SCRIPT.reset()
    SCRIPT.broken = True  # route "checked" gives every record up as malformed
    try:
        built = load_config(path).build()
        runtime = built.start()
        with built:
            q = runtime.bind_hook("layers.0.q", layout="vec")
            for file in tmp_path.glob("dead.sqlite*"):
                file.unlink()
            batch = vec_batch(q, 4)
            runtime.submit_batch(batch.descriptors.copy(), bytes(batch.payload))
            with pytest.raises(RoutingFailure, match="deleted or replaced") as raised:
                runtime.flush()
            assert str(store) in str(raised.value)
            with pytest.raises(RoutingFailure):
                runtime.stop()
    finally:
        SCRIPT.reset()
    assert not store.exists()


def test_a_store_refuses_writes_once_its_file_is_replaced(tmp_path):
    path = tmp_path / "dead.sqlite"
    store = DeadLetterStore(path)
    path.unlink()
    DeadLetterStore(path).close()  # another store made at the same path
    with pytest.raises(DeadLetterStoreError, match="deleted or replaced"):
        store.skip(1)
    store.close()
