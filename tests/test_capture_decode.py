"""capture_decode around generate loops that change the batch: beams and
return sequences expand each prompt into several rows, and a pass that does
not fit the keys is counted, never raised into the model."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from taproute.routing import RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import ContextMismatch, bind_modules, capture_decode, carry_context
from tests.capture_models import (
    ACTS,
    VOCAB,
    Reference,
    as_float32,
    gpt2,
    llama,
    qwen2_moe,
    records_by_hook,
)

HOOK = "transformer.h.0.mlp"


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize(
    "options",
    [
        {"num_return_sequences": 2, "do_sample": True},
        {"num_beams": 2, "num_return_sequences": 2},
    ],
)
def test_expanded_generate_keys_each_row_by_its_prompt(options):
    model = gpt2()
    torch.manual_seed(11)
    prompt = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    reference = Reference(model, [HOOK], lambda out: out)
    cap = CaptureSink()
    new_tokens = 3
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, HOOK, layout="acts", on_error="raise")
        with torch.inference_mode(), capture_decode(model, [30, 31]) as decode:
            model.generate(prompt, attention_mask=mask, max_new_tokens=new_tokens, **options)
        runtime.flush()
        records = records_by_hook(cap.record_batches, runtime.hooks)[HOOK]
        assert not runtime.counters().ingress.dropped
    assert decode.steps == new_tokens
    # Two rows per prompt, next to each other, each keyed by its prompt.
    assert [(key, step) for key, step, _ in records] == [
        (key, step) for step in range(new_tokens) for key in (30, 30, 31, 31)
    ]
    calls = reference.calls[HOOK]
    for i, (_, step, payload) in enumerate(records):
        row = i % 4
        expected = calls[step][row]
        if step == 0:
            expected = expected[mask[row // 2] == 1]
        np.testing.assert_array_equal(bits(as_float32(payload).reshape(-1, 32)), bits(expected))


def test_a_pass_whose_rows_do_not_fit_the_keys_is_counted_not_raised():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (3, 4))
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, HOOK, layout="acts")
        with (
            pytest.warns(UserWarning, match="3 rows"),
            torch.inference_mode(),
            capture_decode(model, [1, 2]) as decode,
        ):
            model(ids, attention_mask=torch.ones(3, 4, dtype=torch.long))  # 3 rows, 2 keys
            model(inputs_embeds=model.transformer.wte(ids[:2]))  # fits: captured
        runtime.flush()
        assert runtime.counters().ingress.dropped == {HOOK: {"invalid_context": 2}}
        records = records_by_hook(cap.record_batches, runtime.hooks)[HOOK]
    assert decode.steps == 2
    assert [(key, step) for key, step, _ in records] == [(1, 1), (2, 1)]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_static_cache_generate_captures_the_prompts_real_tokens_not_its_padding(attention):
    """With a static cache generate hands the model a 4-D mask of its own
    ((batch, 1, pass, cache): boolean for sdpa, additive floats for eager
    attention), not the 2-D one it was given.  Its last columns are the
    cache's unused end: read as a 2-D mask's, every prompt position of a
    left-padded row was taken as real and its padding captured."""
    model = llama(attention)
    torch.manual_seed(12)
    prompt = torch.randint(3, VOCAB, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    hooks = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    reference = Reference(model, hooks, lambda out: out)
    cap = CaptureSink()
    new_tokens = 3
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, "model.layers.*.self_attn.[qk]_proj", layout="acts")
        with torch.inference_mode(), capture_decode(model, [50, 51]) as decode:
            model.generate(
                prompt,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                cache_implementation="static",
            )
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        records = records_by_hook(cap.record_batches, runtime.hooks)
    assert decode.steps == new_tokens
    for hook in hooks:
        got = records[hook]
        assert [(key, step) for key, step, _ in got] == [
            (key, step) for step in range(new_tokens) for key in (50, 51)
        ]
        calls = reference.calls[hook]
        width = calls[0].shape[-1]
        for i, (_, step, payload) in enumerate(got):
            row = i % 2
            expected = calls[step][row]
            if step == 0:
                expected = expected[mask[row] == 1]  # 4 and 6 tokens, not 6 and 6
            np.testing.assert_array_equal(
                bits(as_float32(payload).reshape(-1, width)), bits(expected)
            )


def test_a_token_major_router_in_a_pass_that_does_not_fit_the_keys_is_dropped_too():
    """A pass of 3 rows x 4 tokens under 2 keys: the MLP's records were dropped
    (invalid_context), but the router's 12 token-major rows divide by 2 keys,
    so they were split into 2 records of 6 tokens each, mixing the rows'
    tokens, and stored. The pass's context now carries its width, and the
    router's rows are checked against keys x width like every other hook's."""
    model = qwen2_moe()
    gate, mlp = "model.layers.0.mlp.gate", "model.layers.0.mlp"
    ids = torch.randint(3, VOCAB, (3, 4))
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, gate, layout="acts", select=0, token_major=True)
        bind_modules(runtime, model, mlp, layout="acts")
        with (
            pytest.warns(UserWarning, match="token-major output has 12 rows"),
            torch.inference_mode(),
            capture_decode(model, [1, 2]),
        ):
            model(ids)  # no mask: all positions real
            model(ids, attention_mask=torch.ones(3, 4, dtype=torch.long))  # a mask of 3 rows
            model(ids[:2])  # fits: captured
        runtime.flush()
        assert runtime.counters().ingress.dropped == {
            gate: {"invalid_context": 4},
            mlp: {"invalid_context": 4},
        }
        records = records_by_hook(cap.record_batches, runtime.hooks)
    for hook in (gate, mlp):
        assert [(key, step) for key, step, _ in records[hook]] == [(1, 2), (2, 2)]
    assert [as_float32(payload).size for _, _, payload in records[gate]] == [4 * 8, 4 * 8]


def test_capture_decode_keys_are_integers_not_truncated():
    model = gpt2()
    refused = r"capture_decode: keys\[0\] = 30.7 is not an integer"
    with pytest.raises(ContextMismatch, match=refused), capture_decode(model, [30.7, 31]):
        pass


def test_concurrent_generate_calls_on_one_model_keep_their_own_keys_and_steps():
    """Two server threads decoding on one model: each block's steps and keys
    are its own passes', never the other thread's (the pre-hook is the model's)."""
    model = gpt2()
    new_tokens = 4
    both_inside = threading.Barrier(2)
    steps: dict[int, int] = {}
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, HOOK, layout="acts", on_error="raise")

        def decode(keys: list[int]) -> None:
            prompt = torch.randint(3, VOCAB, (2, 5))
            with torch.inference_mode(), capture_decode(model, keys) as state:
                both_inside.wait()  # both blocks' hooks are on the model from here
                model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
            steps[keys[0]] = state.steps

        threads = [threading.Thread(target=decode, args=(keys,)) for keys in ([1, 2], [3, 4])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        runtime.flush()
        records = records_by_hook(cap.record_batches, runtime.hooks)[HOOK]
    assert steps == {1: new_tokens, 3: new_tokens}
    assert sorted((key, step) for key, step, _ in records) == sorted(
        (key, step) for key in (1, 2, 3, 4) for step in range(new_tokens)
    )


def test_generate_carried_into_a_worker_thread_is_captured_step_by_step():
    model = gpt2()
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, HOOK, layout="acts", on_error="raise")
        with (
            ThreadPoolExecutor(1) as pool,
            torch.inference_mode(),
            capture_decode(model, [7, 8]) as state,
        ):
            prompt = torch.randint(3, VOCAB, (2, 5))
            pool.submit(carry_context(model.generate), prompt, max_new_tokens=3).result()
        runtime.flush()
        records = records_by_hook(cap.record_batches, runtime.hooks)[HOOK]
    assert state.steps == 3
    assert [(key, step) for key, step, _ in records] == [
        (key, step) for step in range(3) for key in (7, 8)
    ]


def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(4)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config).eval()


ENCODER = "encoder.block.0.layer.1"
DECODER = "decoder.block.0.layer.2"


def test_an_encoder_decoder_captures_its_encoder_as_the_prefill_and_decoder_steps():
    """generate runs a T5's encoder once, outside the model's forward: its
    records are step 0 with the source's real positions, not skipped as
    outside any context; the decoder's are one per sequence per step."""
    model = t5()
    source = torch.randint(3, VOCAB, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    reference = Reference(model, [ENCODER, DECODER], lambda out: out)
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, ENCODER, layout="acts", on_error="raise")
        bind_modules(runtime, model, DECODER, layout="acts", on_error="raise")
        with torch.inference_mode(), capture_decode(model, [40, 41]) as state:
            model.generate(
                source, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False
            )
            # The model called directly: the encoder's records are this pass's step.
            model(input_ids=source, attention_mask=mask, decoder_input_ids=source[:, :2])
        runtime.flush()
        assert runtime.counters().ingress.skipped == {}
        records = records_by_hook(cap.record_batches, runtime.hooks)
    assert state.steps == 3 + 1
    encoded = records[ENCODER]
    assert [(key, step) for key, step, _ in encoded] == [(40, 0), (41, 0), (40, 3), (41, 3)]
    for i, (_, _, payload) in enumerate(encoded):
        expected = reference.calls[ENCODER][i // 2][i % 2][mask[i % 2] == 1]
        np.testing.assert_array_equal(bits(as_float32(payload).reshape(-1, 32)), bits(expected))
    decoded = records[DECODER]
    assert [(key, step) for key, step, _ in decoded] == [
        (key, step) for step in range(4) for key in (40, 41)
    ]
    assert [as_float32(payload).size // 32 for _, _, payload in decoded] == [1] * 6 + [2] * 2


def test_a_compiled_model_binds_by_its_eager_names_and_decodes_step_by_step():
    """torch.compile(model) names its submodules _orig_mod.<name>, and its
    generate runs the wrapped model: both are seen through."""
    model = gpt2()
    compiled = torch.compile(model)
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        (binding,) = bind_modules(runtime, compiled, HOOK, layout="acts", on_error="raise")
        assert binding.name == HOOK
        with torch.inference_mode(), capture_decode(compiled, [5, 6]) as state:
            prompt = torch.randint(3, VOCAB, (2, 5))
            compiled.generate(prompt, max_new_tokens=3, do_sample=False)
        runtime.flush()
        assert runtime.counters().ingress.skipped == {}
        records = records_by_hook(cap.record_batches, runtime.hooks)[HOOK]
    assert state.steps == 3
    assert [(key, step) for key, step, _ in records] == [
        (key, step) for step in range(3) for key in (5, 6)
    ]


def test_capture_decode_on_a_compiled_model_sees_the_passes_of_its_generate():
    model = gpt2()
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, HOOK, layout="acts", on_error="raise")
        compiled = torch.compile(model)
        with torch.inference_mode(), capture_decode(compiled, [5, 6]) as state:
            compiled.generate(torch.randint(3, VOCAB, (2, 5)), max_new_tokens=2, do_sample=False)
        runtime.flush()
        assert runtime.counters().ingress.skipped == {}
    assert state.steps == 2


def test_decode_steps_through_a_fullgraph_compiled_step_warmed_up_before_any_block():
    """A server compiles its step function with fullgraph=True and warms it
    up, then runs one capture_decode block per request, calling the model
    directly. The block's hooks were disabled for Dynamo (graph breaks that
    fullgraph refuses: every pass raised); traced, hooks added per block
    were never called by code compiled before them (Dynamo does not watch a
    module's hooks), so every pass counted no_context. The model's decode
    hooks now stay registered from its first block, which makes compiled
    code trace again once; each block's passes get their keys and steps."""
    torch.compiler.reset()  # a fresh recompile budget (see test_capture_compile.py)
    model = gpt2()
    prompt = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    cap = CaptureSink()

    @torch.compile(fullgraph=True, backend="eager")
    def step(ids, attention_mask, past=None):
        out = model(ids, attention_mask=attention_mask, past_key_values=past, use_cache=True)
        return out.logits, out.past_key_values

    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, HOOK, layout="acts")
        with torch.inference_mode():
            step(prompt, mask)  # the warm-up, outside any block
        states = []
        for keys in ([5, 6], [7, 8], [9, 10]):
            with torch.inference_mode(), capture_decode(model, keys) as state:
                logits, past = step(prompt, mask)
                longer = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
                step(logits[:, -1:].argmax(-1), longer, past)
            states.append(state.steps)
        runtime.flush()
        assert runtime.counters().ingress.skipped == {HOOK: {"no_context": 1}}  # the warm-up
        assert runtime.counters().ingress.dropped == {}
        records = records_by_hook(cap.record_batches, runtime.hooks)[HOOK]
    assert states == [2, 2, 2]
    assert [(key, step) for key, step, _ in records] == [
        (key, step) for keys in ([5, 6], [7, 8], [9, 10]) for step in (0, 1) for key in keys
    ]
    # the prefill's real positions (row 0 is left-padded), then one token each
    sizes = [as_float32(payload).size // 32 for _, _, payload in records]
    assert sizes == [4, 5, 1, 1] * 3


def test_an_encoder_decoder_compiled_with_fullgraph_captures_its_encoder_and_decoder():
    """Called directly, a compiled T5 runs its encoder inside the graph: the
    encoder's decode hooks, disabled for Dynamo, raised under fullgraph."""
    torch.compiler.reset()
    model = t5()
    source = torch.randint(3, VOCAB, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    cap = CaptureSink()
    with create_record_runtime(record_sink=cap, schema=RecordSchema([ACTS])) as runtime:
        bind_modules(runtime, model, ENCODER, layout="acts", on_error="raise")
        bind_modules(runtime, model, DECODER, layout="acts", on_error="raise")
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.inference_mode(), capture_decode(compiled, [40, 41]) as state:
            compiled(input_ids=source, attention_mask=mask, decoder_input_ids=source[:, :2])
        runtime.flush()
        assert runtime.counters().ingress.skipped == {}
        records = records_by_hook(cap.record_batches, runtime.hooks)
    assert state.steps == 1
    encoded = [(key, step, as_float32(p).size // 32) for key, step, p in records[ENCODER]]
    assert encoded == [(40, 0, 6), (41, 0, 4)]
    decoded = [(key, step, as_float32(p).size // 32) for key, step, p in records[DECODER]]
    assert decoded == [(40, 0, 2), (41, 0, 2)]
