"""Which dimension of a captured tensor holds the tokens.

Attention weights are ``(batch, heads, queries, keys)``: dimension 1 is the
heads. Every output of 3 or more dimensions used to be cut at dimension 1,
so with ``lengths`` a record of attention weights kept the first
``lengths[i]`` heads (all queries, padding included) and nothing said so.
``token_axis=2`` now captures the real query positions of each row; a 4-D
output bound without a token axis is refused (``bad_output``) as soon as a
context says which positions are real, instead of being cut at the heads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taproute.routing import RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import (
    CaptureError,
    CaptureWarning,
    bind_modules,
    capture_context,
    capture_decode,
)
from tests.capture_models import ACTS, VOCAB, Reference, as_float32, gpt2, records_by_hook

HEADS, HIDDEN = 4, 32
ATTN = ["transformer.h.0.attn", "transformer.h.1.attn"]


def attention_weights(output):
    return output[1]  # GPT2Attention returns (attn_output, attn_weights)


def capture_attention(ids, mask, context, **bind):
    """Run an eager-attention GPT-2 with output_attentions under ``context``:
    (records by hook, the weights plain torch hooks saw, dropped counts)."""
    model = gpt2(attention="eager")
    reference = Reference(model, ATTN, attention_weights)
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        bindings = bind_modules(
            runtime, model, "transformer.h.*.attn", layout="acts", select=1, **bind
        )
        with torch.inference_mode(), capture_context([10, 11, 12], **context):
            model(ids, attention_mask=mask, output_attentions=True)
        runtime.flush()
        dropped = runtime.counters().ingress.dropped
        records = records_by_hook(sink.record_batches, runtime.hooks)
        shapes = {name: runtime.hooks.token_shape_of(runtime.hooks.id_of(name)) for name in ATTN}
    for binding in bindings:
        binding.remove()
    return records, reference.calls, dropped, shapes, bindings


def test_attention_weights_with_lengths_keep_each_rows_real_queries():
    torch.manual_seed(7)
    width = 6  # wider than the 4 heads, so cutting at the heads raised nothing
    ids = torch.randint(3, VOCAB, (3, width))
    lengths = [6, 3, 1]
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    records, reference, dropped, shapes, _ = capture_attention(
        ids, mask, {"lengths": lengths}, token_axis=2
    )
    assert dropped == {}
    for name in ATTN:
        (weights,) = reference[name]
        assert weights.shape == (3, HEADS, width, width)
        assert shapes[name] == (HEADS, width)  # a record is [queries, heads, keys]
        assert [key for key, _, _ in records[name]] == [10, 11, 12]
        for row, (_, _, payload) in enumerate(records[name]):
            values = as_float32(payload).reshape(-1, HEADS, width)
            want = weights[row, :, : lengths[row]].permute(1, 0, 2).numpy()
            assert values.shape == (lengths[row], HEADS, width)
            np.testing.assert_array_equal(values, want)
            # each real query's weights over the keys sum to 1, padding keys get none
            np.testing.assert_allclose(values.sum(-1), 1.0, rtol=1e-5)
            assert not values[..., lengths[row] :].any()


def test_attention_weights_with_a_left_padded_mask_keep_the_real_queries():
    torch.manual_seed(8)
    ids = torch.randint(3, VOCAB, (3, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    records, reference, dropped, _, _ = capture_attention(
        ids, mask, {"attention_mask": mask}, token_axis=2
    )
    assert dropped == {}
    for name in ATTN:
        (weights,) = reference[name]
        for row, (_, _, payload) in enumerate(records[name]):
            real = mask[row].bool()
            want = weights[row][:, real].permute(1, 0, 2).numpy()
            np.testing.assert_array_equal(as_float32(payload).reshape(want.shape), want)


def test_a_4d_output_bound_without_a_token_axis_is_refused_not_cut_at_its_heads():
    """Without token_axis the records used to hold the first lengths[i] heads:
    silently wrong. Now nothing is captured, the loss is counted and the
    binding says why; the model's outputs are untouched."""
    torch.manual_seed(9)
    ids = torch.randint(3, VOCAB, (3, 6))
    lengths = [6, 3, 1]
    mask = (torch.arange(6) < torch.tensor(lengths)[:, None]).long()
    with pytest.warns(CaptureWarning, match="token_axis"):
        records, _, dropped, _, bindings = capture_attention(ids, mask, {"lengths": lengths})
    assert records == {}
    assert dropped == {name: {"bad_output": 3} for name in ATTN}
    assert all(binding.detached for binding in bindings)
    assert all("token_axis=" in str(binding.error) for binding in bindings)
    model = gpt2(attention="eager")
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, ATTN[0], layout="acts", select=1, on_error="raise")
        with (
            torch.inference_mode(),
            capture_context([1, 2, 3], lengths=lengths),
            pytest.raises(CaptureError, match=r"4-D .* token_axis="),
        ):
            model(ids, attention_mask=mask, output_attentions=True)


def test_a_4d_output_without_positions_is_captured_whole_rows():
    """A context with neither lengths nor a mask: every position is real, so
    the row is captured whole, as before (no token axis needed)."""
    torch.manual_seed(10)
    ids = torch.randint(3, VOCAB, (3, 5))
    records, reference, dropped, _, _ = capture_attention(ids, None, {})
    assert dropped == {}
    for name in ATTN:
        (weights,) = reference[name]
        for row, (_, _, payload) in enumerate(records[name]):
            np.testing.assert_array_equal(as_float32(payload), weights[row].numpy().ravel())


def test_token_axis_1_of_a_2d_output_takes_each_rows_real_positions():
    """A per-token scalar (batch, tokens) is a whole row by default; with
    token_axis=1 the record holds its real positions."""
    model = torch.nn.Identity()
    sink = CaptureSink()
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, torch.nn.Sequential(model), "0", layout="acts", token_axis=1)
        with capture_context([1, 2, 3], lengths=[4, 2, 0]):
            model(values)
        runtime.flush()
        got = [b.payload_of(i).view(np.float32) for b in sink.record_batches for i in range(len(b))]
    assert [list(g) for g in got] == [[0, 1, 2, 3], [4, 5], []]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"token_axis": 0}, "int >= 1"),
        ({"token_axis": True}, "int >= 1"),
        ({"token_axis": "2"}, "int >= 1"),
        ({"token_axis": 2, "token_major": True}, "exclude each other"),
    ],
)
def test_a_token_axis_that_cannot_be_one_is_refused_at_bind_time(options, message):
    model = gpt2()
    with (
        create_record_runtime(record_sink=CaptureSink(), schema=RecordSchema([ACTS])) as runtime,
        pytest.raises(CaptureError, match=message),
    ):
        bind_modules(runtime, model, "transformer.h.0.attn", layout="acts", **options)
    assert not model.transformer.h[0].attn._forward_hooks


def test_a_token_axis_past_the_outputs_dimensions_detaches_the_binding():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 4))
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        (binding,) = bind_modules(
            runtime, model, "transformer.h.0.mlp", layout="acts", token_axis=3
        )
        with (
            pytest.warns(CaptureWarning, match="token_axis=3 but the output has 3 dimensions"),
            torch.inference_mode(),
            capture_context([1, 2], lengths=[4, 2]),
        ):
            model(ids)
        runtime.flush()
        assert binding.detached
        assert runtime.counters().ingress.dropped == {"transformer.h.0.mlp": {"bad_output": 2}}
    assert sink.records == 0


def test_attention_weights_under_capture_decode_keep_each_steps_real_queries():
    """generate's passes: the prefill's real queries (left padding left out)
    over its keys, then one query per step over the grown cache."""
    model = gpt2(attention="eager")
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    reference = Reference(model, [ATTN[0]], attention_weights)
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, ATTN[0], layout="acts", select=1, token_axis=2)
        with torch.inference_mode(), capture_decode(model, [7, 8]):
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=3,
                do_sample=False,
                output_attentions=True,
                return_dict_in_generate=True,
            )
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        records = records_by_hook(sink.record_batches, runtime.hooks)[ATTN[0]]
    assert [(key, step) for key, step, _ in records] == [
        (key, step) for step in range(3) for key in (7, 8)
    ]
    for i, (_, step, payload) in enumerate(records):
        row = i % 2
        weights = reference.calls[ATTN[0]][step][row]  # (heads, queries, keys)
        real = mask[row].bool() if step == 0 else torch.ones(1, dtype=torch.bool)
        want = weights[:, real].permute(1, 0, 2).numpy()
        np.testing.assert_array_equal(as_float32(payload).reshape(want.shape), want)
