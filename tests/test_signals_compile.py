"""The signal taps (``bind_qk``, ``bind_router``, ``bind_router_path``) bound
and removed again and again on a model compiled with ``fullgraph=True``.

Each bind made a new tap module and new hooks feeding it, and each remove
unhooked them: a compile per bind and per remove, and past Dynamo's
recompile_limit (8) every forward pass raised FailOnRecompileLimitHit
(Llama, bind_qk: in the 4th round). The tap and its feeding hooks are now
made once and kept where torch.compile traced them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from taproute.routing import Layout, RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import capture_context
from taproute.service.signals import taps
from tests.capture_models import VOCAB, Reference, as_float32, llama, qwen2_moe, records_by_hook

QK = Layout("qk", [("values", "Array(Float32)")])
ROUTER = Layout("router_logits", [("values", "Array(Float32)")])
PATH = Layout("router_path", [("values", "Array(Float32)")])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo counts compiles of transformers' forward wrapper across models."""
    torch.compiler.reset()
    yield


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _rounds(compiled, bind, rounds, ids):
    """Bind, a pass keyed 100*r + row, remove, a pass keyed 100*r + 50 + row."""
    for r in range(rounds):
        bindings = bind()
        with torch.inference_mode(), capture_context([100 * r, 100 * r + 1]):
            compiled(ids)
        for binding in bindings:
            binding.remove()
        with torch.inference_mode(), capture_context([100 * r + 50, 100 * r + 51]):
            compiled(ids)


def test_bind_qk_churn_on_a_fullgraph_llama_compiles_twice_and_captures_q_and_k():
    model = llama()
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([QK])) as runtime:
        with torch.inference_mode():
            compiled(ids)

        def bind():
            return taps.bind_qk(
                runtime, compiled, "model.layers.*.self_attn", query="q_proj", key="k_proj"
            )

        _rounds(compiled, bind, 10, ids)
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        assert runtime.counters().ingress.skipped == {}
        records = records_by_hook(sink.record_batches, runtime.hooks)
    assert counter.frame_count == 2  # the warm-up, the first bind
    names = [f"model.layers.{layer}.self_attn" for layer in (0, 1)]
    projections = [f"{name}.{proj}" for name in names for proj in ("q_proj", "k_proj")]
    reference = Reference(model, projections, _first)
    with torch.inference_mode():
        model(ids)
    reference.remove()
    for name in names:
        (q,), (k,) = reference.calls[f"{name}.q_proj"], reference.calls[f"{name}.k_proj"]
        want = torch.cat([q, k], dim=-1)
        got = records[f"{name}.qk"]
        assert [key for key, _, _ in got] == [100 * r + row for r in range(10) for row in (0, 1)]
        for i, (_, _, payload) in enumerate(got):
            np.testing.assert_array_equal(as_float32(payload).reshape(5, -1), want[i % 2].numpy())


def test_router_taps_churn_on_a_fullgraph_moe_compiles_a_bounded_number_of_times():
    model = qwen2_moe()
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    schema = RecordSchema([ROUTER, PATH])
    with create_record_runtime(record_sink=sink, schema=schema) as runtime:
        with torch.inference_mode():
            compiled(ids)

        def bind():
            return [
                *taps.bind_router(runtime, compiled, "model.layers.*.mlp"),
                taps.bind_router_path(runtime, compiled, "model.layers.*.mlp"),
            ]

        _rounds(compiled, bind, 3, ids)
        settled = counter.frame_count
        _rounds(compiled, bind, 6, ids)
        assert counter.frame_count == settled <= 3
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        records = records_by_hook(sink.record_batches, runtime.hooks)
    gates = [f"model.layers.{layer}.mlp.gate" for layer in (0, 1)]
    reference = Reference(model, gates, _first)
    with torch.inference_mode():
        model(ids)
    reference.remove()
    keys = [100 * r + row for rounds in (3, 6) for r in range(rounds) for row in (0, 1)]
    logits = [reference.calls[gate][0].reshape(2, 5, -1) for gate in gates]
    for gate, want in zip(gates, logits, strict=True):
        assert [key for key, _, _ in records[gate]] == keys
        for i, (_, _, payload) in enumerate(records[gate]):
            np.testing.assert_array_equal(as_float32(payload).reshape(5, -1), want[i % 2].numpy())
    path = torch.cat(logits, dim=-1)
    assert [key for key, _, _ in records["router_path"]] == keys
    for i, (_, _, payload) in enumerate(records["router_path"]):
        np.testing.assert_array_equal(as_float32(payload).reshape(5, -1), path[i % 2].numpy())


def test_removed_taps_of_an_eager_model_leave_no_hook():
    """No compiled code traced them: remove() unhooks the tap and what fed it."""
    model = qwen2_moe()
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    with create_record_runtime(
        record_sink=sink, schema=RecordSchema([QK, ROUTER, PATH])
    ) as runtime:
        for keys in ([1, 2], [3, 4]):
            bindings = [
                *taps.bind_qk(
                    runtime, model, "model.layers.*.self_attn", query="q_proj", key="k_proj"
                ),
                *taps.bind_router(runtime, model, "model.layers.*.mlp"),
                taps.bind_router_path(runtime, model, "model.layers.*.mlp"),
            ]
            with torch.inference_mode(), capture_context(keys):
                model(ids)
            for binding in bindings:
                binding.remove()
            for name, module in model.named_modules():
                assert not module._forward_hooks, name
                assert not module._forward_pre_hooks, name
        runtime.flush()
        assert sink.records == 2 * 2 * (2 + 2 + 1)
