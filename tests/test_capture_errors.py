"""Capture gives exact data or a clear error: lengths, lossy casts, outputs that
are not one tensor, token-major outputs, captures nothing said about."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from taproute.routing import ConfigError, Layout, RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import (
    CaptureError,
    CaptureWarning,
    ContextMismatch,
    bind_module,
    bind_modules,
    capture_context,
    capture_decode,
    carry_context,
)
from tests.capture_models import ACTS, VOCAB, Reference, as_float32, gpt2, llama, qwen2_moe

INTS = Layout("ints", [("values", "Array(Int32)")])
SCHEMA = RecordSchema([ACTS, INTS])


class Returns(nn.Module):
    """A module whose forward returns whatever ``make(x)`` builds (tuples, dicts, ...)."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor):
        return self.make(x)


def runtime(**kwargs):
    return create_record_runtime(record_sink=CaptureSink(), schema=SCHEMA, **kwargs)


# -- 1. lengths are checked against the tensor ----------------------------------


def test_a_length_longer_than_the_output_is_an_error_naming_hook_row_and_numbers():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (4, 6))
    with runtime() as rt:
        bind_module(rt, model.transformer.h[0], "block0", layout="acts", on_error="raise")
        with (
            torch.inference_mode(),
            capture_context(range(4), lengths=[6 + 5, 6, 6, 6]),
            pytest.raises(
                ContextMismatch,
                match=r"hook 'block0': lengths\[0\] = 11 but the "
                r"output has only 6 positions per row",
            ),
        ):
            model(ids)
        rt.flush()
        assert rt.record_sink.records == 0  # nothing half-captured


def test_by_default_a_bad_length_drops_that_call_counts_and_warns_and_inference_goes_on():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (4, 6))
    with torch.inference_mode():
        expected = model(ids).logits
    with runtime() as rt:
        bind_module(rt, model.transformer.h[0], "block0", layout="acts")
        with torch.inference_mode():
            with (
                capture_context(range(4), lengths=[6, 6, 6, 9]),
                pytest.warns(CaptureWarning, match=r"lengths\[3\] = 9 but the output has only 6"),
            ):
                got = model(ids).logits
            with capture_context(range(4), lengths=[6, 2, 3, 4]):
                model(ids)  # the binding stays: a good context captures again
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        rt.flush()
        assert rt.record_sink.records == 4
        assert rt.counters().ingress.dropped == {"block0": {"invalid_context": 4}}


def test_lengths_and_mask_must_have_one_row_per_key():
    with pytest.raises(ContextMismatch, match="1 lengths for 4 keys"):
        capture_context(range(4), lengths=[3]).__enter__()
    with pytest.raises(ContextMismatch, match="with 4 rows .* got shape \\(3, 5\\)"):
        capture_context(range(4), attention_mask=torch.ones(3, 5)).__enter__()
    with pytest.raises(CaptureError, match=r"lengths\[1\] = -1 is negative"):
        capture_context(range(2), lengths=[1, -1]).__enter__()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keys": ["a", "b"]}, r"keys\[0\] = 'a' is not an integer \(str\)"),
        ({"keys": [1.5, 2]}, r"keys\[0\] = 1.5 is not an integer \(float\)"),
        ({"keys": [1, 2**64]}, r"keys\[1\] = 18446744073709551616 is outside int64"),
        ({"keys": 7}, "keys must be a sequence of integers, found int"),
        ({"keys": [1, 2], "lengths": [3, 2.5]}, r"lengths\[1\] = 2.5 is not an integer"),
        ({"keys": [1], "step": 1.0}, r"step = 1.0 is not an integer"),
    ],
)
def test_keys_lengths_and_step_must_be_integers_not_truncated_or_parsed(kwargs, message):
    with pytest.raises(ContextMismatch, match=message):
        capture_context(**kwargs).__enter__()


def test_numpy_and_torch_integer_keys_are_taken():
    with capture_context(np.arange(3), lengths=torch.tensor([1, 2, 3]), step=np.int64(4)):
        pass


def test_a_mask_narrower_than_the_output_is_an_error():
    model = gpt2()
    with runtime() as rt:
        bind_module(rt, model.transformer.h[0], "block0", layout="acts", on_error="raise")
        with (
            torch.inference_mode(),
            capture_context([1, 2], attention_mask=torch.ones(2, 4)),
            pytest.raises(
                ContextMismatch, match="attention mask has 4 positions but the output has 6"
            ),
        ):
            model(torch.randint(3, VOCAB, (2, 6)))


# -- 3. a lossy cast is refused ---------------------------------------------------


def test_a_float_module_bound_to_an_integer_layout_is_refused_at_bind_time():
    model = gpt2()
    with (
        runtime() as rt,
        pytest.raises(
            CaptureError,
            match=r"hook 'transformer.h.0.mlp': output dtype torch.float32 would be cast to "
            r"torch.int32 for layout 'ints', which changes values",
        ),
    ):
        bind_modules(rt, model, "transformer.h.0.mlp", layout="ints")


def test_a_lossy_cast_found_at_the_first_call_is_refused_not_truncated():
    act = nn.GELU()  # no parameters: only the first call shows the output dtype
    x = torch.tensor([[[-0.07, 0.004, 0.019, 0.096]]])
    with runtime() as rt:
        binding = bind_module(rt, act, "gelu", layout="ints", on_error="raise")
        with (
            capture_context([1]),
            pytest.raises(CaptureError, match="float32 would be cast to torch.int32"),
        ):
            act(x)
        binding.remove()
    with runtime() as rt:
        binding = bind_module(rt, act, "gelu", layout="ints")
        with capture_context([1]), pytest.warns(CaptureWarning, match="the hook detached"):
            out = act(x)
        torch.testing.assert_close(out, nn.functional.gelu(x))
        with capture_context([1]):
            act(x)
        rt.flush()
        assert binding.detached and rt.record_sink.records == 0
        assert rt.counters().ingress.dropped == {"gelu": {"bad_output": 1, "detached": 1}}


def test_a_widening_cast_is_exact_and_narrowing_needs_narrow():
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    ident = nn.Identity()  # each block binds a fresh one: hooks outlive their runtime
    with runtime() as rt:
        bind_module(rt, ident, "bf16", layout="acts", on_error="raise")
        with capture_context([1, 2]):
            ident(x)
        rt.flush()
        got = as_float32(rt.record_sink.record_batches[0].payload).reshape(2, 3, 4)
        np.testing.assert_array_equal(got, x.float().numpy())
    bf16 = RecordSchema([Layout("half", [("values", "Array(BFloat16)")])])
    ident = nn.Identity()
    with create_record_runtime(record_sink=CaptureSink(), schema=bf16) as rt:
        bind_module(rt, ident, "f32", layout="half", on_error="raise")
        with capture_context([1]), pytest.raises(CaptureError, match="pass narrow=True"):
            ident(torch.randn(1, 2, 3))
    ident = nn.Identity()
    with create_record_runtime(record_sink=CaptureSink(), schema=bf16) as rt:
        bind_module(rt, ident, "f32", layout="half", narrow=True, on_error="raise")
        y = torch.randn(1, 2, 3)
        with capture_context([1]):
            ident(y)
        rt.flush()
        payload = np.asarray(rt.record_sink.record_batches[0].payload).view(np.dtype("bfloat16"))
        np.testing.assert_array_equal(
            payload.astype(np.float32), y.bfloat16().float().numpy().ravel()
        )


def test_a_float32_model_under_autocast_fills_a_bfloat16_layout_exactly():
    """Under torch.autocast a float32 Llama's projections return bf16, which a
    BFloat16 layout holds exactly. Binding them was refused at bind time from
    the parameters' dtype ("output dtype torch.float32 would be cast to
    torch.bfloat16"), an output the model never produced: the only way in
    was narrow=True, which would then also round float32 outputs silently.
    The output's own dtype decides now; without autocast the first call
    still refuses."""
    model = llama()
    hook = "model.layers.0.self_attn.q_proj"
    half = RecordSchema([Layout("half", [("values", "Array(BFloat16)")])])
    reference = Reference(model, [hook], lambda out: out)
    ids = torch.randint(3, VOCAB, (2, 5))
    with create_record_runtime(record_sink=CaptureSink(), schema=half) as rt:
        bind_modules(rt, model, hook, layout="half", on_error="raise")
        with (
            torch.inference_mode(),
            torch.autocast("cpu", dtype=torch.bfloat16),
            capture_context([1, 2]),
        ):
            model(ids)
        rt.flush()
        (batch,) = rt.record_sink.record_batches
        assert list(batch.descriptors["key"]) == [1, 2]
        (expected,) = reference.calls[hook]
        assert expected.dtype == torch.bfloat16
        np.testing.assert_array_equal(
            np.asarray(batch.payload).view(np.uint16),
            expected.view(torch.int16).numpy().view(np.uint16).ravel(),
        )
        refused = r"output dtype torch.float32 would be cast to torch.bfloat16.*narrow=True"
        with (
            torch.inference_mode(),
            capture_context([1, 2]),
            pytest.raises(CaptureError, match=refused),
        ):
            model(ids)


def test_fp16_outputs_go_to_float32_exactly_or_to_bfloat16_only_when_narrowed():
    """ClickHouse has no Float16 column: an fp16 output is stored as Float32
    (exact) or, by the layout's choice and with narrow=True, as BFloat16."""
    x = torch.randn(2, 3, 4).half()
    ident = nn.Identity()
    with runtime() as rt:
        bind_module(rt, ident, "fp16", layout="acts", on_error="raise")
        with capture_context([1, 2]):
            ident(x)
        rt.flush()
        got = as_float32(rt.record_sink.record_batches[0].payload).reshape(2, 3, 4)
        np.testing.assert_array_equal(got, x.float().numpy())
    bf16 = RecordSchema([Layout("half", [("values", "Array(BFloat16)")])])
    ident = nn.Identity()
    with create_record_runtime(record_sink=CaptureSink(), schema=bf16) as rt:
        bind_module(rt, ident, "fp16", layout="half", on_error="raise")
        with (
            capture_context([1, 2]),
            pytest.raises(CaptureError, match=r"torch.float16 would be cast to torch.bfloat16"),
        ):
            ident(x)
    ident = nn.Identity()
    with create_record_runtime(record_sink=CaptureSink(), schema=bf16) as rt:
        bind_module(rt, ident, "fp16", layout="half", narrow=True, on_error="raise")
        with capture_context([1, 2]):
            ident(x)
        rt.flush()
        payload = np.asarray(rt.record_sink.record_batches[0].payload).view(np.uint16)
        expected = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).ravel()
        np.testing.assert_array_equal(payload, expected)


# -- 4. outputs that are not one tensor ---------------------------------------


@pytest.mark.parametrize(
    ("make", "select", "picked"),
    [
        (lambda x: (x * 2, x * 3), 1, lambda x: x * 3),
        (lambda x: (None, x + 1), 1, lambda x: x + 1),
        (lambda x: {"hidden": x - 1, "other": x}, "hidden", lambda x: x - 1),
        (lambda x: BaseModelOutput(last_hidden_state=x * 5), "last_hidden_state", lambda x: x * 5),
        (lambda x: BaseModelOutput(last_hidden_state=x * 5), 0, lambda x: x * 5),
        (lambda x: [x, x * 7], lambda out: out[1], lambda x: x * 7),
    ],
    ids=[
        "tuple-index",
        "none-first",
        "dict-key",
        "modeloutput-key",
        "modeloutput-index",
        "callable",
    ],
)
def test_select_takes_an_index_key_or_callable(make, select, picked):
    module = Returns(make)
    x = torch.randn(2, 3, 4)
    with runtime() as rt:
        bind_module(rt, module, "m", layout="acts", select=select, on_error="raise")
        with capture_context([1, 2]):
            module(x)
        rt.flush()
        got = as_float32(rt.record_sink.record_batches[0].payload).reshape(2, 3, 4)
        np.testing.assert_array_equal(got, picked(x).numpy())


@pytest.mark.parametrize(
    ("make", "select", "message"),
    [
        (
            lambda x: {"hidden": x},
            None,
            r"the module returned a dict with keys \['hidden'\], not a tensor; "
            "say what to capture with select=",
        ),
        (
            lambda x: (None, x),
            None,
            r"the module returned a tuple of \(NoneType, Tensor\), not a tensor",
        ),
        (
            lambda x: BaseModelOutput(last_hidden_state=x),
            None,
            r"the module returned a transformers.modeling_outputs.BaseModelOutput with keys",
        ),
        (lambda x: (x, x), 5, r"select=5 does not apply to a tuple of \(Tensor, Tensor\)"),
        (lambda x: {"a": x}, "b", r"select='b' does not apply to a dict with keys \['a'\]"),
        (lambda x: (None, x), 0, r"select=0 picked None out of a tuple"),
    ],
    ids=["dict", "none-first", "modeloutput", "bad-index", "bad-key", "picked-none"],
)
def test_an_output_that_cannot_be_captured_names_the_hook_and_its_type(make, select, message):
    module = Returns(make)
    with runtime() as rt:
        bind_module(rt, module, "m", layout="acts", select=select, on_error="raise")
        with capture_context([1, 2]), pytest.raises(CaptureError, match=r"hook 'm': " + message):
            module(torch.randn(2, 3, 4))


def test_select_of_the_wrong_kind_and_patterns_matching_nothing_fail_at_bind_time():
    model = gpt2()
    with runtime() as rt:
        with pytest.raises(CaptureError, match="select must be an index, a key or a callable"):
            bind_modules(rt, model, "transformer.h.*.attn", layout="acts", select=1.5)
        with pytest.raises(ConfigError, match="no submodule of the model matches 'nope.*'"):
            bind_modules(rt, model, "nope.*", layout="acts")
        with pytest.raises(CaptureError, match="on_error must be 'detach' or 'raise'"):
            bind_modules(rt, model, "transformer.h.0", layout="acts", on_error="ignore")


# -- 5. token-major outputs -------------------------------------------------------


def test_a_token_major_router_without_token_major_is_a_clear_error():
    model = qwen2_moe()
    ids = torch.randint(3, VOCAB, (8, 64))
    with runtime() as rt:
        bind_modules(
            rt, model, "model.layers.0.mlp.gate", layout="acts", select=0, on_error="raise"
        )
        with (
            torch.inference_mode(),
            capture_context(range(8)),
            pytest.raises(
                ContextMismatch,
                match=r"output has 512 rows \(shape \(512, 8\)\) but the capture context has 8 "
                r"keys; a token-major output \(batch \* tokens, ...\) needs token_major=True",
            ),
        ):
            model(ids)


def test_token_major_outputs_are_reshaped_with_the_context_lengths():
    module = Returns(lambda x: x.reshape(-1, x.shape[-1]))  # (batch * tokens, features)
    x = torch.randn(3, 4, 5)
    with runtime() as rt:
        bind_module(rt, module, "router", layout="acts", token_major=True, on_error="raise")
        with capture_context([1, 2, 3], lengths=[4, 1, 2]):
            module(x)
        with (
            capture_context(range(5)),
            pytest.raises(
                ContextMismatch,
                match="token-major output has 12 rows, not a multiple of the capture context's 5",
            ),
        ):
            module(x)
        rt.flush()
        batch = rt.record_sink.record_batches[0]
        for row, n in enumerate([4, 1, 2]):
            np.testing.assert_array_equal(
                as_float32(batch.payload_of(row)).reshape(n, 5), x[row, :n].numpy()
            )


# -- 6. nothing captured is counted and said ---------------------------------------


def test_hooks_outside_a_context_count_skips_and_warn_once_per_hook():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 4))
    with runtime() as rt:
        bind_modules(rt, model, "transformer.h.?", layout="acts")
        with torch.inference_mode(), pytest.warns(CaptureWarning) as warned:
            model(ids)
            model(ids)
        messages = [str(w.message) for w in warned]
        assert len(messages) == 2  # once per hook, not once per call
        assert all("ran outside a capture_context" in m and "carry_context" in m for m in messages)
        assert rt.counters().ingress.skipped == {
            "transformer.h.0": {"no_context": 2},
            "transformer.h.1": {"no_context": 2},
        }


def test_carry_context_takes_the_capture_context_into_a_worker_thread():
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 4))
    with runtime() as rt, ThreadPoolExecutor(2) as pool:
        bind_modules(rt, model, "transformer.h.0", layout="acts")
        with torch.inference_mode(), capture_context([5, 6], lengths=[4, 2]):
            with pytest.warns(CaptureWarning, match="outside a capture_context"):
                pool.submit(model, ids).result()  # the context does not follow on its own
            futures = [pool.submit(carry_context(model), ids) for _ in range(4)]
            for future in futures:
                future.result()
        rt.flush()
        assert rt.record_sink.records == 8
        assert rt.record_sink.descriptors()["key"].tolist() == [5, 6] * 4
        assert rt.counters().ingress.skipped == {"transformer.h.0": {"no_context": 1}}


def test_a_hook_whose_per_position_shape_varies_reports_flat_shapes():
    ident = nn.Identity()
    with runtime() as rt:
        binding = bind_module(rt, ident, "scores", layout="acts", on_error="raise")
        with capture_context([1]):
            ident(torch.zeros(1, 2, 3, 3))
            assert rt.hooks.token_shape_of(binding.output_id) == (3, 3)
            ident(torch.zeros(1, 2, 5, 5))  # one shape no longer fits every record
            assert rt.hooks.token_shape_of(binding.output_id) is None
            ident(torch.zeros(1, 2, 3, 3))
            assert rt.hooks.token_shape_of(binding.output_id) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pool": 5}, r"pool must be a HostBufferPool .*found int"),
        ({"token_major": "yes"}, r"token_major must be True or False, found str 'yes'"),
        ({"narrow": "no"}, r"narrow must be True or False, found str 'no'"),
    ],
)
def test_bind_options_of_the_wrong_kind_are_refused_at_bind_time(options, message):
    """pool=5 was taken and the first forward pass detached the hook with
    "capture failed (AttributeError: 'int' object has no attribute
    'cpu_outputs')", counted as runtime_failed; narrow="no" meant narrow (a
    truthy string). Each is refused at bind, naming the option."""
    model = gpt2()
    with runtime() as rt:
        with pytest.raises(CaptureError, match=message):
            bind_modules(rt, model, "transformer.h.*.mlp", layout="acts", **options)
        assert rt.hooks.names() == ()  # nothing bound


def test_what_is_bound_and_to_what_is_checked_at_bind_time():
    """A runtime that is not one (a sink), a model given by name, a prefix that
    is not a str: AttributeError 'CaptureSink' object has no attribute
    'schema', 'str' object has no attribute 'named_modules', and "unsupported
    operand type(s) for +: 'int' and 'str'"."""
    model = gpt2()
    with runtime() as rt:
        with pytest.raises(
            CaptureError, match=r"runtime must be .*create_record_runtime.*found CaptureSink"
        ):
            bind_module(CaptureSink(), model.transformer.h[0], "h0", layout="acts")  # type: ignore[arg-type]
        with pytest.raises(
            CaptureError, match=r"bind_modules: model must be a torch.nn.Module, found str"
        ):
            bind_modules(rt, "gpt2", "transformer.h.*", layout="acts")  # type: ignore[arg-type]
        with pytest.raises(
            CaptureError, match=r"bind_module\('h0'\): module must be a torch.nn.Module"
        ):
            bind_module(rt, model.transformer.h[0].mlp.c_fc.weight, "h0", layout="acts")  # type: ignore[arg-type]
        with pytest.raises(CaptureError, match=r"bind_modules: prefix must be a str, found int 5"):
            bind_modules(rt, model, "transformer.h.*.mlp", layout="acts", prefix=5)  # type: ignore[arg-type]
        assert rt.hooks.names() == ()


def test_a_select_callable_that_raises_is_a_bad_output_not_a_failed_runtime():
    """Its exception (anything but IndexError/KeyError/AttributeError/TypeError)
    went to the catch-all: counted as runtime_failed, so /metrics said the
    runtime failed when the user's select did."""
    module = Returns(lambda x: (x, x))
    with runtime() as rt:
        bind_module(rt, module, "m", layout="acts", select=lambda out: 1 / 0)
        with (
            capture_context([1, 2]),
            pytest.warns(CaptureWarning, match=r"select=.* raised ZeroDivisionError"),
        ):
            module(torch.randn(2, 3, 4))
        assert rt.counters().ingress.dropped == {"m": {"bad_output": 2}}
        assert rt.failure is None


def test_what_the_capture_blocks_take_is_checked_when_they_are_entered():
    """end_keys that is not a runtime raised AttributeError on the way out of
    the block, after the forward pass ran (and, when the pass raised, was
    swallowed: the keys were never cancelled); capture_decode of a model given
    by name raised AttributeError; carry_context(5) was taken and failed only
    in the worker thread."""
    entered = []
    refused = pytest.raises(CaptureError, match=r"end_keys must be the runtime .*found str")
    with refused, capture_context([1], end_keys="runtime"):  # type: ignore[arg-type]
        entered.append(1)
    assert entered == []  # refused before the pass
    refused = pytest.raises(CaptureError, match=r"capture_decode: model must be a torch.nn.Module")
    with refused, capture_decode("gpt2", [1]):  # type: ignore[arg-type]
        pass
    with pytest.raises(CaptureError, match=r"carry_context: fn must be callable .*found int"):
        carry_context(5)  # type: ignore[arg-type]
    with runtime() as plain:  # a CaptureSink keeps no keys: complete() raised after the pass
        refused = pytest.raises(CaptureError, match=r"end_keys is a runtime whose record sink")
        with refused, capture_context([1], end_keys=plain):
            entered.append(2)
        assert entered == [] and plain.ends_keys is False

    ended: list[tuple[int, ...]] = []

    class Ends:  # what end_keys needs: complete and cancel
        def complete(self, *keys: int) -> None:
            ended.append(keys)

        cancel = complete

    with capture_context([1, 2], end_keys=Ends()):
        pass
    assert ended == [(1, 2)]
