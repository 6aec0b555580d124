"""Record plans shared between capture contexts (``service/capture/plans.py``):
a tiny GPT-2 (random weights) gives the same records, field for field and
byte for byte, with the shared cache as with none, across contexts whose
shapes, masks, keys and steps change; plans never cross element sizes; the
cache stays within its bound."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from taproute.routing import Layout, RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context, capture_decode, plans
from taproute.service.capture.plans import PlanCache
from tests.capture_models import ACTS, VOCAB, Reference, gpt2

HOOKS = ["transformer.h.*.attn", "transformer.h.*.mlp", "transformer.h.?"]
FIELDS = ("output_id", "layout_id", "flags", "key", "step", "seq", "offset", "length")


def _mask(rows: int, tokens: int, kind: str) -> torch.Tensor:
    mask = torch.ones(rows, tokens, dtype=torch.long)
    if kind == "right":
        mask[::2, tokens // 2 :] = 0
    elif kind == "left":
        mask[1::2, : tokens // 3] = 0
    elif kind == "holes":
        mask[:, 1::3] = 0
    elif kind == "empty_row":
        mask[1] = 0
    return mask


#: (rows, tokens, how positions are given, keys offset, step): shapes and
#: masks change, and recur with other keys and steps (where plans are shared).
CONTEXTS = [
    (3, 7, "right", 10, 0),
    (3, 7, "right", 20, 1),  # same shape and mask, other keys and step
    (3, 7, "left", 10, 2),  # same shape, other mask
    (3, 7, "holes", 30, 0),
    (3, 7, "holes", 40, 5),  # a gathered (not one run) mask, shared
    (2, 7, "right", 50, 0),  # fewer rows
    (3, 5, "right", 10, 0),  # fewer positions
    (3, 7, "lengths", 60, 3),
    (3, 7, "lengths", 70, 4),
    (3, 7, "all", 80, 0),  # every position real
    (3, 7, "empty_row", 90, 0),
    (3, 7, "right", 100, 9),  # back to the first mask
]


def _records(batches: list[Any]) -> list[tuple[Any, ...]]:
    """Every record's descriptor fields (not its capture time) and bytes, in order."""
    out = []
    for batch in batches:
        for row in range(len(batch)):
            desc = batch.descriptors[row]
            fields = tuple(int(desc[f]) for f in FIELDS)
            out.append((*fields, batch.payload_of(row).tobytes()))
    return out


def _capture_sequence(cache: PlanCache, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    monkeypatch.setattr(plans, "SHARED_PLANS", cache)
    model = gpt2()
    cap = CaptureSink()
    contexts = []
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        for pattern in HOOKS:
            bind_modules(runtime, model, pattern, layout="acts", on_error="raise")
        for rows, tokens, kind, first_key, step in CONTEXTS:
            torch.manual_seed(rows * 100 + tokens)
            ids = torch.randint(3, VOCAB, (rows, tokens))
            keys = list(range(first_key, first_key + rows))
            if kind == "lengths":
                lengths = [tokens, tokens // 2, 1][:rows]
                given: dict[str, Any] = {"lengths": lengths}
                mask = torch.zeros(rows, tokens, dtype=torch.long)
                for row, n in enumerate(lengths):
                    mask[row, :n] = 1
            else:
                mask = _mask(rows, tokens, kind)
                given = {} if kind == "all" else {"attention_mask": mask}
            with torch.inference_mode(), capture_context(keys, step=step, **given):
                model(ids, attention_mask=mask)
            contexts.append((keys, step, mask))
        runtime.flush()
    return _records(cap.record_batches), contexts


def test_records_with_shared_plans_equal_records_planned_anew(monkeypatch):
    shared = PlanCache()
    with_cache, contexts = _capture_sequence(shared, monkeypatch)
    without, _ = _capture_sequence(PlanCache(max_plans=0), monkeypatch)
    assert with_cache == without
    # The shared path was taken: contexts alike in shape and mask reused plans.
    # (contexts 2, 5, 9 and 12: one shared plan each for the 6 hooks' shape).
    assert (shared.hits, len(shared)) == (4, 8)
    # And each record carries its own context's key and step, with its real
    # positions' bytes (6 hooks x one record per row per context).
    expected_rows = [
        (key, step, int(mask[row].sum()))
        for keys, step, mask in contexts
        for _hook in range(6)
        for row, key in enumerate(keys)
    ]
    found = [(r[3], r[4], len(r[-1]) // (4 * 32)) for r in with_cache]
    assert found == expected_rows


def test_a_plan_is_not_shared_between_layouts_of_other_element_sizes(monkeypatch):
    """Layout id 0 is Float32 in one runtime's schema and BFloat16 in the
    other's: the second must not take the first's plan (offsets in bytes)."""
    monkeypatch.setattr(plans, "SHARED_PLANS", PlanCache())
    bf16 = Layout("acts16", [("values", "Array(BFloat16)")])
    model = gpt2()
    torch.manual_seed(11)
    ids = torch.randint(3, VOCAB, (3, 6))
    mask = _mask(3, 6, "right")
    reference = Reference(model, ["transformer.h.0.mlp"], lambda out: out)
    got = {}
    for layout in (ACTS, bf16):
        cap = CaptureSink()
        with create_record_runtime(record_sink=cap, schema=RecordSchema([layout])) as runtime:
            (binding,) = bind_modules(
                runtime,
                model,
                "transformer.h.0.mlp",
                layout=layout.name,
                narrow=True,
                on_error="raise",
            )
            with torch.inference_mode(), capture_context([1, 2, 3], attention_mask=mask):
                model(ids, attention_mask=mask)
            runtime.flush()
            binding.remove()
        got[layout.name] = [
            batch.payload_of(row) for batch in cap.record_batches for row in range(len(batch))
        ]
    assert len(plans.SHARED_PLANS) == 2
    f32_call, bf16_call = reference.calls["transformer.h.0.mlp"]
    for row in range(3):
        real = mask[row].bool()
        assert got["acts"][row].tobytes() == f32_call[row][real].numpy().tobytes()
        want = bf16_call[row][real].to(torch.bfloat16).view(torch.int16).numpy()
        assert got["acts16"][row].view(ml_dtypes.bfloat16).tobytes() == want.tobytes()


def test_decode_steps_share_one_plan_and_keep_their_own_step(monkeypatch):
    def generate(cache: PlanCache) -> list[tuple[Any, ...]]:
        monkeypatch.setattr(plans, "SHARED_PLANS", cache)
        model = gpt2()
        torch.manual_seed(7)
        prompt = torch.randint(3, VOCAB, (2, 5))
        mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        cap = CaptureSink()
        with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
            bind_modules(runtime, model, "transformer.h.?", layout="acts", on_error="raise")
            with torch.inference_mode(), capture_decode(model, [30, 31]):
                model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False)
            runtime.flush()
        return _records(cap.record_batches)

    shared = PlanCache()
    with_cache = generate(shared)
    assert with_cache == generate(PlanCache(max_plans=0))
    # Prefill and one decode shape, for one element size: two plans; every
    # other step of the loop took its plan from the cache.
    assert len(shared) == 2
    assert shared.hits == 3
    assert [(r[3], r[4]) for r in with_cache] == [
        (key, step) for step in range(5) for _layer in range(2) for key in (30, 31)
    ]


def test_the_cache_keeps_at_most_its_bound_least_recently_used_out():
    cache = PlanCache(max_plans=2)
    plan = (None, np.zeros(1, np.int64), np.zeros(1, np.int64), 0, np.zeros(0), np.zeros(0))
    cache.put("a", plan)  # type: ignore[arg-type]
    cache.put("b", plan)  # type: ignore[arg-type]
    assert cache.get("a") is plan  # "a" now the most recently used
    cache.put("c", plan)  # type: ignore[arg-type]
    assert len(cache) == 2
    assert cache.get("b") is None and cache.get("a") is plan and cache.get("c") is plan
    nothing = PlanCache(max_plans=0)
    nothing.put("a", plan)  # type: ignore[arg-type]
    assert len(nothing) == 0 and nothing.get("a") is None
    with pytest.raises(ValueError, match="max_plans must be >= 0, got -1"):
        PlanCache(max_plans=-1)
