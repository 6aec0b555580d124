"""The example server's processors (bench/server_capture.py), one pass per
hook over a batch's tokens, against the per-record computation they
replaced: records of both models mixed in one batch, token counts that
differ (and one record without tokens), records not back to back and at
offsets that are not float-aligned, one request with several records."""

from __future__ import annotations

import numpy as np
import pytest

from bench.inference_server import MINILM, Gpt2Size
from bench.server_capture import (
    ACTIVATIONS,
    HEADS,
    MODELS,
    SUMMARY_SLOTS,
    _summary_row,
    head_norms,
    register_model,
    request_summary,
    summaries_from_raw,
)
from taproute.native import StateRegion, make_descriptors
from taproute.routing.batch import RecordBatch
from taproute.routing.records import Records

GPT2 = Gpt2Size(layers=2, hidden=48, heads=12).hooks()


def _batch(parts: list[tuple[int, int, np.ndarray]], gap: int = 3):
    """(output_id, key, float32 values) per record, laid with ``gap`` junk
    bytes before each (so offsets are neither packed nor 4-aligned)."""
    payload, offsets, lengths = bytearray(), [], []
    for _, _, values in parts:
        payload += b"\x7f" * gap
        offsets.append(len(payload))
        lengths.append(values.nbytes)
        payload += values.tobytes()
    desc = make_descriptors(
        [p[0] for p in parts],
        lengths,
        offsets=offsets,
        keys=[p[1] for p in parts],
        steps=np.arange(len(parts)) % 3,
    )
    return RecordBatch.from_buffer(desc, np.frombuffer(bytes(payload), dtype=np.uint8))


@pytest.fixture
def hooks():
    register_model(MINILM)
    register_model(GPT2)
    names = {
        0: "minilm.encoder.layer.0.attention.self.query",
        1: "gpt2.transformer.h.1.attn.c_attn",
        2: "minilm.encoder.layer.5.output",
        3: "gpt2.transformer.h.1",
    }
    yield names
    MODELS.pop("minilm", None)
    MODELS.pop("gpt2", None)


MIXED = [(0, 5, 3), (1, 6, 1), (0, 7, 0), (1, 8, 4), (0, 5, 2)]
ONE_HOOK = [(1, 5, 3), (1, 6, 1), (1, 7, 0), (1, 8, 4), (1, 5, 2)]


@pytest.mark.parametrize(
    ("spec", "gap"),
    [(MIXED, 3), (MIXED, 0), (ONE_HOOK, 0), (ONE_HOOK, 2)],
    ids=["mixed-gaps", "mixed-packed", "one-hook-packed", "one-hook-gaps"],
)
def test_head_norms_equal_the_per_record_computation(hooks, spec, gap):
    rng = np.random.default_rng(7)
    strides = {0: MINILM.query_stride, 1: GPT2.query_stride}
    widths = {0: MINILM.width, 1: GPT2.width}
    parts = [
        (oid, key, rng.standard_normal(tokens * strides[oid]).astype(np.float32))
        for oid, key, tokens in spec
    ]
    records = Records(_batch(parts, gap), ACTIVATIONS, hooks.__getitem__)
    rows = head_norms(records)
    only_empty = Records(_batch(parts[2:3]), ACTIVATIONS, hooks.__getitem__)
    assert np.isnan(head_norms(only_empty)["norms"]).all()
    assert rows["request"].tolist() == [5, 6, 7, 8, 5]
    assert rows["hook"].tolist() == [hooks[oid] for oid, _, _ in parts]
    assert rows["tokens"].tolist() == [t for _, _, t in spec]
    for row, (oid, _, values) in zip(rows, parts, strict=True):
        tokens = values.reshape(-1, strides[oid])[:, : widths[oid]]
        if len(tokens) == 0:
            assert np.isnan(row["norms"]).all()
            continue
        per_head = tokens.reshape(len(tokens), HEADS, -1)
        expected = np.sqrt(np.einsum("thd,thd->th", per_head, per_head)).mean(axis=0)
        np.testing.assert_allclose(row["norms"], expected, rtol=1e-5)


def test_request_summary_equals_the_summary_of_its_records(hooks):
    rng = np.random.default_rng(11)
    widths = {2: MINILM.width, 3: GPT2.width}
    # Request 70000 shares slot 70000 % SUMMARY_SLOTS with no one else here;
    # request 9 has three records, two of them in the first batch.
    first = [(2, 9, 4), (3, 70000, 2), (2, 9, 1), (2, 12, 0)]
    second = [(3, 70000, 1), (2, 9, 5)]
    state = StateRegion(SUMMARY_SLOTS, (6,), "float64", 1)
    seen: dict[int, list[np.ndarray]] = {}
    for spec in (first, second):
        parts = [
            (oid, key, rng.standard_normal(tokens * widths[oid]).astype(np.float32))
            for oid, key, tokens in spec
        ]
        records = Records(_batch(parts, gap=1), ACTIVATIONS, hooks.__getitem__)
        keys = records.descriptors["key"] % SUMMARY_SLOTS
        request_summary(records, keys, state)
        for _, key, values in parts:
            seen.setdefault(key, []).append(values)
    for request, model, width in [(9, "minilm", MINILM.width), (70000, "gpt2", GPT2.width)]:
        row = _summary_row(state, request % SUMMARY_SLOTS)[0]
        records, tokens, mean, peak = summaries_from_raw(seen[request], width)
        assert (row["request"], row["model"], row["records"], row["tokens"]) == (
            request,
            model,
            records,
            tokens,
        )
        assert row["norm_mean"] == pytest.approx(mean, rel=1e-9)
        assert row["norm_max"] == pytest.approx(peak, rel=1e-9)
    row = _summary_row(state, 12)[0]
    assert (row["request"], row["records"], row["tokens"], row["norm_max"]) == (12, 1, 0, 0.0)
