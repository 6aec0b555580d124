"""Captures in ClickHouse (chDB): raw tables keep each record's real shape, and
bf16 activations are stored as ClickHouse BFloat16, exactly."""

from __future__ import annotations

import numpy as np
import torch

from taproute.routing import Layout, RecordSchema
from taproute.service import ClickHouseSink, create_record_runtime, load_captures, load_rows
from taproute.service.capture import bind_modules, capture_context
from tests.capture_models import ACTS, VOCAB, Reference, gpt2, llama

HALF = Layout("half", [("values", "Array(BFloat16)")])
SCHEMA = RecordSchema([ACTS, HALF])


def test_raw_tables_keep_token_shape_and_bfloat16_values_exactly(chdb_transport):
    model = gpt2()
    half = gpt2().to(torch.bfloat16)
    torch.manual_seed(8)
    ids = torch.randint(3, VOCAB, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    reference = Reference(model, ["transformer.h.0.mlp"], lambda out: out)
    half_reference = Reference(half, ["transformer.h.1"], lambda out: out)
    sink = ClickHouseSink(
        chdb_transport,
        SCHEMA,
        raw=["acts", "half"],
        create_tables=True,
        raw_table="capture_{layout}",
        owns_transport=False,
    )
    with create_record_runtime(record_sink=sink) as runtime:
        bind_modules(runtime, model, "transformer.h.0.mlp", layout="acts", on_error="raise")
        bind_modules(runtime, half, "transformer.h.1", layout="half", on_error="raise")
        with torch.inference_mode(), capture_context([40, 41], attention_mask=mask):
            model(ids, attention_mask=mask)
            half(ids, attention_mask=mask)
        runtime.flush()
        acts = sink.query(
            "SELECT key, values, values_shape FROM capture_acts ORDER BY key"
        ).to_pylist()
        halves = sink.query(
            # Arrow has no bfloat16: read the values widened (exact) to Float32.
            "SELECT key, CAST(values, 'Array(Float32)') AS values, values_shape, "
            "toTypeName(capture_half.values) AS type, byteSize(capture_half.values) AS bytes "
            "FROM capture_half ORDER BY key"
        ).to_pylist()
    (mlp,) = reference.calls["transformer.h.0.mlp"]
    (block,) = half_reference.calls["transformer.h.1"]
    assert [row["key"] for row in acts] == [40, 41]
    for row, got in enumerate(acts):
        real = mlp[row][mask[row] == 1].numpy()
        assert got["values_shape"] == [int(mask[row].sum()), 32]
        restored = np.asarray(got["values"], dtype=np.float32).reshape(got["values_shape"])
        np.testing.assert_array_equal(restored, real)
    for row, got in enumerate(halves):
        assert got["type"] == "Array(BFloat16)"
        assert got["bytes"] == 8 + 2 * len(got["values"])  # two bytes a value, not four
        assert got["values_shape"] == [int(mask[row].sum()), 32]
        real = block[row][mask[row] == 1].float().numpy()
        restored = np.asarray(got["values"], dtype=np.float32).reshape(got["values_shape"])
        np.testing.assert_array_equal(restored, real)  # bf16 -> Float32 -> BFloat16: exact


def test_load_captures_and_load_rows_give_bfloat16_values_back_exactly(chdb_transport):
    """ClickHouse hands BFloat16 to Arrow as two-byte binary strings.
    load_captures returned them as an object array of bytes (b'\\xd7=' for a
    value) where a bf16 array belonged, as_torch=True raised TypeError, and
    load_rows held the same bytes: a bf16 model's captures could only be read
    with hand-written SQL. Both now give the stored bfloat16 values (torch
    bfloat16 with as_torch), bit for bit."""
    model = llama().to(torch.bfloat16)
    hook = "model.layers.0.self_attn.q_proj"
    reference = Reference(model, [hook], lambda out: out)
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    sink = ClickHouseSink(
        chdb_transport,
        RecordSchema([HALF]),
        raw=["half"],
        create_tables=True,
        raw_table="readback_{layout}",
        owns_transport=False,
    )
    with create_record_runtime(record_sink=sink) as runtime:
        bind_modules(runtime, model, hook, layout="half", on_error="raise")
        with torch.inference_mode(), capture_context([60, 61], attention_mask=mask):
            model(ids, attention_mask=mask)
        runtime.flush()
    (output,) = reference.calls[hook]
    expected = [output[row][mask[row] == 1] for row in range(2)]
    captures = load_captures(chdb_transport, "readback_half", hook=hook)
    tensors = load_captures(chdb_transport, "readback_half", hook=hook, as_torch=True)
    rows = load_rows(chdb_transport, "readback_half", HALF)
    assert [c.key for c in captures] == [60, 61]
    for row, (capture, tensor) in enumerate(zip(captures, tensors, strict=True)):
        assert capture.values.dtype == np.dtype("bfloat16")
        assert capture.values.shape == (int(mask[row].sum()), 32)
        np.testing.assert_array_equal(
            capture.values.view(np.uint16), expected[row].view(torch.int16).numpy().view(np.uint16)
        )
        assert tensor.values.dtype == torch.bfloat16
        assert torch.equal(tensor.values, expected[row])
        np.testing.assert_array_equal(
            rows["values"][row].view(np.uint16),
            expected[row].reshape(-1).view(torch.int16).numpy().view(np.uint16),
        )
