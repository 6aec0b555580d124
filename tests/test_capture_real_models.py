"""Capture from real models (tiny transformers configs, random weights; MiniLM
from its weights package): records equal what plain torch hooks take, bit for
bit, for every padding side, token-major MoE routers and decode loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from taproute.routing import Layout, Records, RecordSchema, Route, RoutingConfig, SlotSpec
from taproute.routing import stateful_processor as register_stateful
from taproute.service import CaptureSink, RoutingSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context, capture_decode
from tests.capture_models import (
    ACTS,
    VOCAB,
    Reference,
    as_float32,
    gpt2,
    mixtral,
    qwen2_moe,
    records_by_hook,
)

EXPERTS = 8
TOP_K = 2
ROUTER = Layout("router", [("logits", "Array(Float32)")])
EXPERT_COUNTS = Layout("expert_counts", [("key", "Int64"), ("counts", "Array(Int64)", (EXPERTS,))])
MOE_SCHEMA = RecordSchema([ROUTER, EXPERT_COUNTS])
KEYS = 64


@register_stateful(
    "test.expert_token_counts",
    key=lambda d: d["key"] % KEYS,
    key_range=KEYS,
    slot=SlotSpec((EXPERTS,), "int64"),
    input="router",
    output="expert_counts",
)
def expert_token_counts(records: Records, keys: np.ndarray, state) -> np.ndarray:
    """Per request: how many of its tokens each expert was routed (top-k of the logits)."""
    rows = np.empty(len(records), dtype=EXPERT_COUNTS.dtype)
    for i in range(len(records)):
        logits = records.tail(i).reshape(-1, EXPERTS)
        chosen = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]
        state.slots[keys[i]] += np.bincount(chosen.ravel(), minlength=EXPERTS)
        rows[i]["key"] = keys[i]
        rows[i]["counts"] = state.slots[keys[i]]
    return rows


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


GPT2_HOOKS = ["transformer.h.*.attn", "transformer.h.*.mlp", "transformer.h.?"]


def capture_gpt2(ids, **context):
    """Capture attention, MLP and block outputs of a 2-layer GPT-2; (records, reference)."""
    model = gpt2()
    cap = CaptureSink()
    names = [f"transformer.h.{i}{part}" for i in range(2) for part in (".attn", ".mlp", "")]
    reference = Reference(model, names, lambda out: out[0] if isinstance(out, tuple) else out)
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        for pattern in GPT2_HOOKS:
            bind_modules(runtime, model, pattern, layout="acts", on_error="raise")
        with torch.inference_mode(), capture_context([10, 11, 12], **context):
            model(ids, attention_mask=context.get("attention_mask"))
        runtime.flush()
        shapes = {name: runtime.hooks.token_shape_of(runtime.hooks.id_of(name)) for name in names}
        return records_by_hook(cap.record_batches, runtime.hooks), reference.calls, shapes


def test_gpt2_right_padding_records_equal_plain_hooks_bitwise():
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 7))
    lengths = [7, 4, 1]
    records, reference, shapes = capture_gpt2(ids, lengths=lengths)
    assert len(records) == 6  # attention, MLP and block of both layers
    for name, got in records.items():
        assert shapes[name] == (32,)
        (expected,) = reference[name]
        assert [key for key, _, _ in got] == [10, 11, 12]
        for row, (_, _, payload) in enumerate(got):
            values = as_float32(payload).reshape(-1, 32)
            assert values.shape == (lengths[row], 32)
            np.testing.assert_array_equal(bits(values), bits(expected[row, : lengths[row]]))


def test_left_padded_batches_capture_the_real_positions_not_the_padding():
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (3, 6))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    records, reference, _ = capture_gpt2(ids, attention_mask=mask)
    for name, got in records.items():
        (expected,) = reference[name]
        for row, (_, _, payload) in enumerate(got):
            real = expected[row][mask[row].bool()]
            values = as_float32(payload).reshape(-1, 32)
            assert values.shape == real.shape
            np.testing.assert_array_equal(bits(values), bits(real))


def test_a_mask_with_holes_takes_exactly_the_marked_positions():
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 5))
    mask = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    records, reference, _ = capture_gpt2(ids, attention_mask=mask)
    for name, got in records.items():
        (expected,) = reference[name]
        for row, (_, _, payload) in enumerate(got):
            np.testing.assert_array_equal(
                bits(as_float32(payload).reshape(-1, 32)), bits(expected[row][mask[row].bool()])
            )


@pytest.mark.parametrize("build", [qwen2_moe, mixtral], ids=["qwen2_moe", "mixtral"])
def test_moe_router_logits_by_binding_the_gate_give_exact_expert_counts(build):
    model = build(experts=EXPERTS, top_k=TOP_K)
    gates = [f"model.layers.{i}.mlp.gate" for i in range(2)]
    chosen = Reference(model, gates, lambda out: out[2])  # the model's own top-k experts
    logits = Reference(model, gates, lambda out: out[0])
    cap = CaptureSink()
    sink = RoutingSink(
        RoutingConfig(
            [
                Route(
                    name="experts",
                    outputs="model.layers.0.mlp.gate",
                    destination="cap",
                    mode="stateful",
                    processor="test.expert_token_counts",
                ),
                Route(name="raw", outputs="model.layers.*.mlp.gate", destination="cap"),
            ]
        ),
        MOE_SCHEMA,
        {"cap": cap},
        unmatched="drop",
    )
    torch.manual_seed(6)
    ids = torch.randint(3, VOCAB, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[3, :6] = 0
    keys = [20, 21, 22, 23]
    with create_record_runtime(record_sink=sink) as runtime:
        bind_modules(
            runtime,
            model,
            "model.layers.*.mlp.gate",
            layout="router",
            select=0,
            token_major=True,
            on_error="raise",
        )
        with torch.inference_mode(), capture_context(keys, attention_mask=mask):
            model(ids, attention_mask=mask)
        runtime.flush()
        assert runtime.hooks.token_shape_of(runtime.hooks.id_of(gates[0])) == (EXPERTS,)
    # Raw router logits: the real positions of each row, bit for bit.
    raw = records_by_hook(cap.record_batches, sink.hooks)
    for gate in gates:
        expected = logits.calls[gate][0].reshape(4, 8, EXPERTS)
        assert expected.std() > 0  # real router weights, not an all-zero init
        for row, (key, _, payload) in enumerate(raw[gate]):
            assert key == keys[row]
            np.testing.assert_array_equal(
                bits(as_float32(payload).reshape(-1, EXPERTS)), bits(expected[row][mask[row] == 1])
            )
    # Per-expert token counts from the stateful route = the model's own softmax + top-k.
    experts = chosen.calls[gates[0]][0].reshape(4, 8, TOP_K)
    rows = cap.rows("experts")
    for row, key in enumerate(keys):
        expected = np.bincount(experts[row][mask[row] == 1].numpy().ravel(), minlength=EXPERTS)
        (got,) = rows[rows["key"] == key % KEYS]["counts"]
        np.testing.assert_array_equal(got, expected)
        assert got.sum() == TOP_K * int(mask[row].sum())


def test_moe_top_k_expert_indices_go_to_an_integer_layout():
    """A router's gate returns (logits, top-k weights, top-k indices): its
    int64 expert indices fill an Array(Int64) layout exactly. bind_modules
    refused them from the gate's float parameters ("output dtype
    torch.float32 would be cast to torch.int64"), though select=2 picks no
    float at all; what a select picks is now checked at the first call."""
    model = qwen2_moe(experts=EXPERTS, top_k=TOP_K)
    gate = "model.layers.1.mlp.gate"
    chosen = Reference(model, [gate], lambda out: out[2])
    schema = RecordSchema([Layout("experts", [("index", "Array(Int64)")])])
    torch.manual_seed(9)
    ids = torch.randint(3, VOCAB, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=schema) as runtime:
        bind_modules(
            runtime, model, gate, layout="experts", select=2, token_major=True, on_error="raise"
        )
        with torch.inference_mode(), capture_context([70, 71], attention_mask=mask):
            model(ids, attention_mask=mask)
        runtime.flush()
        got = records_by_hook(cap.record_batches, runtime.hooks)[gate]
    (indices,) = chosen.calls[gate]
    assert indices.dtype == torch.int64
    expected = indices.reshape(2, 6, TOP_K)
    assert [key for key, _, _ in got] == [70, 71]
    for row, (_, _, payload) in enumerate(got):
        np.testing.assert_array_equal(
            np.asarray(payload).view(np.int64).reshape(-1, TOP_K),
            expected[row][mask[row] == 1].numpy(),
        )


def test_minilm_from_its_weights_package_equals_plain_hooks():
    from transformers import AutoModel

    from taproute.service.demo import minilm

    model = AutoModel.from_pretrained(minilm.model_dir()).eval()
    _, tokenizer = minilm.load()
    ids, mask = minilm.encode(tokenizer, ["a short one", "a somewhat longer sentence than that"])
    names = [f"encoder.layer.{i}.attention.self.query" for i in range(6)]
    names += [f"encoder.layer.{i}" for i in range(6)]
    reference = Reference(model, names, lambda out: out[0] if isinstance(out, tuple) else out)
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, "encoder.layer.*.attention.self.query", layout="acts")
        bind_modules(runtime, model, "encoder.layer.?", layout="acts", on_error="raise")
        with torch.inference_mode(), capture_context([1, 2], attention_mask=mask):
            model(input_ids=ids, attention_mask=mask)
        runtime.flush()
        records = records_by_hook(cap.record_batches, runtime.hooks)
    assert sorted(records) == sorted(names)
    for name in names:
        (expected,) = reference.calls[name]
        for row, (_, _, payload) in enumerate(records[name]):
            np.testing.assert_array_equal(
                bits(as_float32(payload).reshape(-1, 384)), bits(expected[row][mask[row] == 1])
            )


def test_gpt2_generate_captures_one_record_per_sequence_per_decode_step():
    model = gpt2()
    torch.manual_seed(7)
    prompt = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding, as generate wants
    names = ["transformer.h.0.mlp", "transformer.h.1"]
    reference = Reference(model, names, lambda out: out)
    cap = CaptureSink()
    new_tokens = 4
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, "transformer.h.0.mlp", layout="acts", on_error="raise")
        bind_modules(runtime, model, "transformer.h.1", layout="acts", on_error="raise")
        with torch.inference_mode(), capture_decode(model, [30, 31]) as decode:
            model.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        runtime.flush()
        records = records_by_hook(cap.record_batches, runtime.hooks)
    assert decode.steps == new_tokens  # prefill + one pass per further token
    for name in names:
        got = records[name]
        assert [(key, step) for key, step, _ in got] == [
            (key, step) for step in range(new_tokens) for key in (30, 31)
        ]
        calls = reference.calls[name]
        assert [tuple(c.shape[:2]) for c in calls] == [(2, 5)] + [(2, 1)] * (new_tokens - 1)
        for i, (_, step, payload) in enumerate(got):
            row = i % 2
            expected = calls[step][row]
            if step == 0:
                expected = expected[mask[row] == 1]  # the prompt's real tokens only
            np.testing.assert_array_equal(bits(as_float32(payload).reshape(-1, 32)), bits(expected))
