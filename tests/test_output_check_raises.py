"""An output the check cannot even read is a bad output: dead-lettered, not a
failure of the runtime.

A processor building rows of an ``Array`` column from a model's tensors can
return a list of torch tensors that require grad; ``np.asarray`` of that
raises RuntimeError, which the output check did not expect (it took only
the ValueError of a ragged list): the exception escaped the processor call,
reached the route's catch-all, latched the first failure and failed the whole
runtime (and, through a stateful route's one-hop call, left the state the
call had written in place).  DESIGN: "Per-record failures (a processor
raising, a timeout, a bad output) follow the route failure policy".  Now such
an output is refused as ``handler_invalid``, naming column, row and value;
isolation dead-letters only its record, and the route goes on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taproute.actors import open_routing_sink
from taproute.routing import (
    FailureCode,
    HookRegistry,
    Layout,
    RecordFailure,
    Records,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.routing.errors import OutputLayoutMismatch
from taproute.routing.validation import check_rows
from taproute.service import CaptureSink
from tests.conftest import vec_batch
from tests.processors import SCHEMA, TOKENS

Q = "layers.0.q"
KEYS = 16
GRAD_SEQ = 2  # the record whose row holds tensors that require grad


def _rows(records: Records) -> np.ndarray:
    seqs = records.descriptors["seq"]
    rows = np.zeros(len(records), dtype=TOKENS.dtype)
    rows["position"] = seqs
    for i, seq in enumerate(seqs.tolist()):  # a test processor: one object per row
        values = torch.ones(2, requires_grad=seq == GRAD_SEQ)
        rows["hidden"][i] = list(values) if seq == GRAD_SEQ else values.numpy()
    return rows


@stateless_processor("output_check.tokens", input="vec", output="tokens")
def tokens(records: Records) -> np.ndarray:
    return _rows(records)


@stateful_processor(
    "output_check.keyed_tokens",
    key=lambda d: d["key"] % KEYS,
    key_range=KEYS,
    slot=SlotSpec((1,), "float64"),
    input="vec",
    output="tokens",
)
def keyed_tokens(records: Records, keys: np.ndarray, state) -> np.ndarray:
    np.add.at(state.slots[:, 0], keys, 1)
    return _rows(records)


@pytest.mark.parametrize("mode", ["stateless", "stateful"])
async def test_an_output_the_check_cannot_read_is_dead_lettered_and_the_route_goes_on(mode):
    processor = "output_check.tokens" if mode == "stateless" else "output_check.keyed_tokens"
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    out = CaptureSink()
    dead: list[RecordFailure] = []
    config = RoutingConfig([Route("r", Q, "out", mode=mode, processor=processor)])
    async with open_routing_sink(
        config, SCHEMA, {"out": out}, "out", hooks=hooks, on_failure=dead.append
    ) as sink:
        # A key per record: a stateful route re-runs each key of a failed call
        # on its own, so only the bad record's key fails again.
        keys = np.arange(4, dtype=np.int64)
        await sink.submit(vec_batch(q, 4, keys=keys))  # seqs 0..3
        await sink.submit(vec_batch(q, 4, keys=keys, seq_start=4))
        await sink.flush()  # before: raised the latched RuntimeError
        r = sink.snapshot().routes["r"]
        state = sink._gen.routes[0].state if mode == "stateful" else None
    assert (r.accepted, r.processed, r.failed, r.given_up) == (8, 7, 1, 0)
    assert sorted(out.rows("r")["position"].tolist()) == [0, 1, 3, 4, 5, 6, 7]
    (failure,) = dead
    assert failure.code is FailureCode.HANDLER_INVALID
    assert failure.records.descriptors["seq"].tolist() == [GRAD_SEQ]
    assert "column 'hidden'" in str(failure.error) and "grad_fn" in str(failure.error)
    if state is not None:  # each good record applied once: the refused calls rolled back
        assert state.slots[:4, 0].tolist() == [2.0, 2.0, 1.0, 2.0]


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr of a half-built object")


def test_a_value_whose_repr_raises_is_still_named_in_the_refusal():
    layout = Layout("label", [("key", "Int64"), ("name", "String")])
    rows = np.zeros(1, dtype=layout.dtype)
    rows["name"][0] = BrokenRepr()
    with pytest.raises(OutputLayoutMismatch, match="found BrokenRepr \\(its repr raised"):
        check_rows(rows, layout, route="r", processor="p")


async def test_any_error_of_the_output_check_is_the_outputs_failure(monkeypatch):
    """Fault injection (no known output reaches it now): the check itself
    raising anything is still a bad output, dead-lettered, never latched."""

    def check_breaks(*args, **kwargs):
        raise KeyError("an invariant of the check")

    monkeypatch.setattr("taproute.actors.attempt.check_rows", check_breaks)
    hooks = HookRegistry()
    q = hooks.bind(Q, layout="vec")
    dead: list[RecordFailure] = []
    config = RoutingConfig(
        [Route("r", Q, "out", mode="stateless", processor="output_check.tokens")]
    )
    async with open_routing_sink(
        config, SCHEMA, {"out": CaptureSink()}, "out", hooks=hooks, on_failure=dead.append
    ) as sink:
        await sink.submit(vec_batch(q, 1))
        await sink.flush()
        r = sink.snapshot().routes["r"]
    assert (r.accepted, r.failed, r.given_up) == (1, 1, 0)
    (failure,) = dead
    assert failure.code is FailureCode.HANDLER_INVALID
    assert "could not be checked: KeyError" in str(failure.error)
