"""Key lifecycle through the threaded runtime and as the end of a capture_context,
on a real (small) torch model."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch

from taproute.actors import RoutingSink
from taproute.routing import (
    Layout,
    RecordSchema,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
)
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import HostBufferPool, bind_modules, capture_context
from tests.test_torch_hooks import small_encoder

ACTS = Layout("acts", [("values", "Array(Float32)")])
SUMMARY = Layout("summary", [("key", "Int64"), ("records", "UInt32"), ("bytes", "Int64")])
SCHEMA = RecordSchema([ACTS, SUMMARY])
KEY_RANGE = 64


def _summary(state, key: int) -> np.ndarray:
    rows = np.zeros(1, dtype=SUMMARY.dtype)
    rows["key"] = key
    rows["records"] = state.slots[key, 0]
    rows["bytes"] = state.slots[key, 1]
    return rows


@stateful_processor(
    "test.request_summary",
    key=lambda d: d["key"] % KEY_RANGE,
    key_range=KEY_RANGE,
    slot=SlotSpec((2,), "int64"),
    input=None,
    output="summary",
    finalize=_summary,
)
def request_summary(records, keys: np.ndarray, state) -> None:
    """Per request: how many records and payload bytes were captured."""
    np.add.at(state.slots[:, 0], keys, 1)
    np.add.at(state.slots[:, 1], keys, records.descriptors["length"])


def _runtime(out: CaptureSink):
    sink = RoutingSink(
        RoutingConfig(
            [
                Route(
                    "summary",
                    "layers.*.linear2",
                    "out",
                    mode="stateful",
                    processor="test.request_summary",
                    workers=2,
                )
            ]
        ),
        SCHEMA,
        {"out": out},
        unmatched="drop",
    )
    return create_record_runtime(record_sink=sink)


def _rows(out: CaptureSink) -> list[tuple[int, int, int]]:
    rows = np.concatenate([b.rows for b in out.batches])
    return sorted((int(r["key"]), int(r["records"]), int(r["bytes"])) for r in rows)


def test_capture_context_completes_its_keys_after_their_records():
    model = small_encoder()
    out = CaptureSink()
    x = torch.randn(3, 5, 32)
    with _runtime(out) as runtime:
        bind_modules(runtime, model, "layers.*.linear2", layout="acts", pool=HostBufferPool())
        with torch.inference_mode():
            for step in range(3):  # decode steps; the last one ends the requests
                last = step == 2
                with capture_context(
                    [1, 2, 3], lengths=[5, 2, 4], step=step, end_keys=runtime if last else None
                ):
                    model(x)
        runtime.flush()
        route = runtime.snapshot().routes["summary"]
        assert route.completed_keys == 3 and route.finalize_rows == 3
        assert route.open_keys == 0 and route.valid_slots == 0
        # a late record for an ended request is terminal, not a new summary
        with torch.inference_mode(), capture_context([1, 2, 3], lengths=[1, 1, 1]):
            model(x)
        runtime.flush()
        assert runtime.snapshot().routes["summary"].terminal_records == 2 * 3
    # 2 layers x 3 steps = 6 records per request; bytes = real positions x 32 floats x 4 B x 6
    assert _rows(out) == [(1, 6, 6 * 5 * 128), (2, 6, 6 * 2 * 128), (3, 6, 6 * 4 * 128)]


def test_capture_context_cancels_its_keys_when_the_pass_raises():
    model = small_encoder()
    out = CaptureSink()
    x = torch.randn(2, 5, 32)
    with _runtime(out) as runtime:
        bind_modules(runtime, model, "layers.*.linear2", layout="acts", pool=HostBufferPool())
        with (
            pytest.raises(RuntimeError, match="client went away"),
            torch.inference_mode(),
            capture_context([7, 8], end_keys=runtime),
        ):
            model(x)
            raise RuntimeError("client went away")
        runtime.reopen(7).result(5)
        with torch.inference_mode(), capture_context([7], end_keys=runtime):
            model(x[:1])
        runtime.flush()
        route = runtime.snapshot().routes["summary"]
        assert route.cancelled_keys == 2 and route.completed_keys == 1
        assert route.processed + route.cancelled_records == 2 * 2 + 2
    assert _rows(out) == [(7, 2, 2 * 5 * 128)]  # only the reopened request's summary


def test_key_control_needs_a_sink_that_keeps_keys():
    with (
        create_record_runtime(record_sink=CaptureSink()) as runtime,
        pytest.raises(TypeError, match="keeps no keys"),
    ):
        runtime.complete(1)


def test_status_shows_the_oldest_open_key_and_check_warns_about_it(
    tmp_path, chdb_transport, capsys
):
    from taproute.service import HttpConfig
    from taproute.service.host.cli import main
    from tests.test_config_file import base, unique, write

    model = small_encoder()
    out = CaptureSink()
    sink = RoutingSink(
        RoutingConfig(
            [
                Route(
                    "summary",
                    "layers.*.linear2",
                    "out",
                    mode="stateful",
                    processor="test.request_summary",
                )
            ]
        ),
        SCHEMA,
        {"out": out},
        unmatched="drop",
    )
    config = write(tmp_path, base(chdb_transport, unique("keys")))
    with create_record_runtime(record_sink=sink, http=HttpConfig(port=0)) as runtime:
        bind_modules(runtime, model, "layers.*.linear2", layout="acts", pool=HostBufferPool())
        with torch.inference_mode(), capture_context([5]):  # never completed: a leak
            model(torch.randn(1, 3, 32))
        runtime.flush()
        url = runtime.http_urls[0]
        with urllib.request.urlopen(f"{url}/status", timeout=60) as response:
            status = json.load(response)
        assert status["routes"]["summary"]["open_keys"] == 1
        assert status["routes"]["summary"]["oldest_open_key_age_s"] > 0
        assert (
            status["oldest_open_key_age_s"] == status["routes"]["summary"]["oldest_open_key_age_s"]
        )
        capsys.readouterr()
        assert main(["check", "--config", str(config), "--url", url, "--open-key-age", "0"]) == 0
        assert "WARNING: route summary: 1 key(s) open, the oldest for" in capsys.readouterr().out
        assert main(["check", "--config", str(config), "--url", url]) == 0  # under 600 s
        assert "WARNING" not in capsys.readouterr().out
        # `doctor` is the same command under the name operators reach for.
        assert main(["doctor", "--config", str(config), "--url", url, "--open-key-age", "0"]) == 0
        assert "WARNING: route summary: 1 key(s) open, the oldest for" in capsys.readouterr().out
        runtime.complete(5)
        runtime.flush()
        with urllib.request.urlopen(f"{url}/status", timeout=60) as response:
            status = json.load(response)
        assert status["oldest_open_key_age_s"] is None
    assert _rows(out) == [(5, 2, 2 * 3 * 128)]
