"""Capture hooks on a model run through ``torch.compile``.

Dynamo traces forward hooks with the module.  It used to trace the capture
hook's own Python too and fail inside it (``AssertionError: expected
WrapperDescriptorType`` in an attrs class's ``__init__``): with the default
``on_error="detach"`` every compiled model's bindings detached on the first
call and captured nothing, with ``"raise"`` the forward pass raised.  The
hook now runs eagerly (a graph break at it), and captures what eager does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from taproute.routing import Layout, RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import CaptureWarning, bind_module, bind_modules, capture_context
from tests.capture_models import ACTS, VOCAB, Reference, as_float32, gpt2, records_by_hook

SCHEMA = RecordSchema([Layout("f32", [("values", "Array(Float32)")])])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Forget what earlier tests compiled: Dynamo counts the compiles of one
    code object (transformers' forward wrapper) across every model instance
    of the process, and past its recompile_limit (8) a fullgraph=True
    compile fails hard. A server compiles its one model; these tests many."""
    torch.compiler.reset()
    yield


def test_a_compiled_model_captures_the_real_positions_of_each_row():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
    sink = CaptureSink()
    x = torch.randn(3, 5, 8)
    lengths = [5, 2, 4]
    with create_record_runtime(record_sink=sink, schema=SCHEMA) as runtime:
        binding = bind_module(runtime, model[0], "first", layout="f32", on_error="raise")
        compiled = torch.compile(model)
        with torch.no_grad(), capture_context([10, 11, 12], lengths=lengths):
            compiled(x)
        runtime.flush()
        assert not binding.detached
        descriptors = sink.descriptors()
        batches = sink.record_batches
        got = [b.payload_of(i).view(np.float32) for b in batches for i in range(len(b))]
    assert list(descriptors["key"]) == [10, 11, 12]
    assert len(seen) == 1  # the model ran once, and the hook saw its real output
    for row, (length, values) in enumerate(zip(lengths, got, strict=True)):
        want = seen[0][row, :length].numpy().ravel()
        np.testing.assert_array_equal(values, want)


def test_a_module_bound_after_its_compiled_model_ran_is_captured():
    """Dynamo does not guard on a module's hooks while it has none: a model
    compiled and run before one of its modules was bound kept running the
    code compiled without the hook, which never fired. Nothing was captured
    and nothing counted, a module bound beside an already-bound one
    included. Binding now makes the compiled model trace again."""
    model = gpt2()
    compiled = torch.compile(model, backend="eager")
    first, later = "transformer.h.0.mlp", "transformer.h.1.mlp"
    ids = torch.randint(3, VOCAB, (2, 5))
    lengths = [5, 3]
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        with torch.inference_mode():
            compiled(ids)  # the server's warm-up: compiled with no hook at all
        bindings = bind_modules(runtime, compiled, first, layout="acts", on_error="raise")
        with torch.inference_mode(), capture_context([10, 11], lengths=lengths):
            compiled(ids)  # compiled again, with the first hook
        bindings += bind_modules(runtime, compiled, later, layout="acts", on_error="raise")
        with torch.inference_mode(), capture_context([20, 21], lengths=lengths):
            compiled(ids)
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        records = records_by_hook(sink.record_batches, runtime.hooks)
    for binding in bindings:
        binding.remove()
    assert [(key, step) for key, step, _ in records[first]] == [(10, 0), (11, 0), (20, 0), (21, 0)]
    assert [(key, step) for key, step, _ in records[later]] == [(20, 0), (21, 0)]
    # Plain hooks only now: a hook of theirs bound before the warm-up would
    # have made Dynamo guard on the modules' hooks, hiding what is tested.
    reference = Reference(model, [first, later], lambda out: out)
    with torch.inference_mode():
        model(ids)
    for name in (first, later):
        (expected,) = reference.calls[name]
        for row, (_, _, payload) in enumerate(records[name][-2:]):
            np.testing.assert_array_equal(
                as_float32(payload).reshape(-1, 32), expected[row, : lengths[row]].numpy()
            )


def _gpt2_reference(model, names, ids, **call):
    """What plain torch hooks see of ``names`` in one eager run of ``model``."""
    reference = Reference(model, names, lambda out: out)
    with torch.inference_mode():
        model(ids, **call)
    reference.remove()
    return {name: calls[0] for name, calls in reference.calls.items()}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_model_bound_then_compiled_with_fullgraph_runs_and_captures(backend):
    """Binding the eager model and compiling it with fullgraph=True afterwards
    made every forward pass raise Dynamo's Unsupported (the hook, disabled for
    Dynamo, was a graph break), whatever on_error said. Traced, the hook now
    calls the capture operator: no graph break, the model runs, and its
    records are the real positions of each row. Under inductor this also
    proves the operator, which returns nothing, is not dead code."""
    model = gpt2()
    names = ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        bindings = bind_modules(runtime, model, "transformer.h.*.mlp", layout="acts")
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        for keys in ([10, 11], [20, 21]):
            with torch.inference_mode(), capture_context(keys, attention_mask=mask):
                logits = compiled(ids, attention_mask=mask).logits
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        assert runtime.counters().ingress.skipped == {}
        records = records_by_hook(sink.record_batches, runtime.hooks)
    assert not any(binding.detached for binding in bindings)
    for binding in bindings:
        binding.remove()
    expected = _gpt2_reference(model, names, ids, attention_mask=mask)
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(ids, attention_mask=mask).logits)
    for name in names:
        assert [(key, step) for key, step, _ in records[name]] == [
            (10, 0),
            (11, 0),
            (20, 0),
            (21, 0),
        ]
        for row, (_, _, payload) in enumerate(records[name]):
            want = expected[name][row % 2][mask[row % 2].bool()].numpy()
            got = as_float32(payload).reshape(-1, 32)
            assert got.shape == want.shape
            if backend == "eager":
                np.testing.assert_array_equal(got, want)
            else:  # inductor fuses differently: equal to float rounding
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_binding_a_model_compiled_with_fullgraph_captures_and_the_model_still_runs():
    """A model compiled with fullgraph=True was refused at bind time (its hook
    would have raised out of every pass); it binds and captures now."""
    model = gpt2()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        (binding,) = bind_modules(runtime, compiled, "transformer.h.0.mlp", layout="acts")
        with torch.inference_mode(), capture_context([1, 2]):
            logits = compiled(ids).logits
        runtime.flush()
        assert sink.records == 2
        assert list(sink.descriptors()["key"]) == [1, 2]
    binding.remove()
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(ids).logits)


def test_a_fullgraph_hook_whose_select_is_not_a_tensor_is_counted_not_raised():
    """Under tracing nothing of the hook may raise into the graph: a select
    that picks no tensor (sdpa attention returns no weights) reaches the
    capture as an output it cannot capture: bad_output, detached, as eagerly."""
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        (binding,) = bind_modules(runtime, model, "transformer.h.0.attn", layout="acts", select=1)
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with (
            pytest.warns(CaptureWarning, match="under torch.compile, select=1 gave no tensor"),
            torch.inference_mode(),
            capture_context([1, 2]),
        ):
            compiled(ids)
        runtime.flush()
        assert binding.detached
        assert runtime.counters().ingress.dropped == {"transformer.h.0.attn": {"bad_output": 2}}
    assert sink.records == 0


def test_a_removed_binding_of_a_compiled_model_captures_nothing_more():
    """Compiled code calls the capture operator until it is traced again
    (Dynamo does not watch hooks): after remove() that call captures nothing."""
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        (binding,) = bind_modules(runtime, model, "transformer.h.0.mlp", layout="acts")
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.inference_mode(), capture_context([1, 2]):
            compiled(ids)
        binding.remove()
        with torch.inference_mode(), capture_context([3, 4]):
            compiled(ids)
        runtime.flush()
        assert list(sink.descriptors()["key"]) == [1, 2]
        assert runtime.counters().ingress.skipped == {}


BIND_WHILE_RUNNING = """
import threading
import torch
from taproute.routing import RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import bind_modules, capture_context
from tests.capture_models import ACTS, VOCAB, gpt2

torch.set_num_threads(1)
from torch._dynamo.testing import CompileCounter

compiles = CompileCounter()  # the eager backend, counting frame compiles
compiled = torch.compile(gpt2(), backend=compiles, fullgraph=FULLGRAPH)
ids = torch.randint(3, VOCAB, (2, 5))
passed = threading.Condition()
passes = 0
stop = threading.Event()
failed = []


def serve():
    global passes
    try:
        while not stop.is_set():
            with torch.inference_mode(), capture_context([1, 2]):
                compiled(ids)
            with passed:
                passes += 1
                passed.notify_all()
    except BaseException as exc:  # what the server would have raised: said, not hung on
        with passed:
            failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            passed.notify_all()


sink = CaptureSink()
with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
    server = threading.Thread(target=serve)
    server.start()
    for _ in range(ROUNDS):
        bindings = bind_modules(runtime, compiled, "transformer.h.*.mlp", layout="acts")
        with passed:
            seen = passes
            passed.wait_for(lambda: failed or passes >= seen + 2)  # passes with the hooks bound
        for binding in bindings:
            binding.remove()
        with passed:
            seen = passes
            passed.wait_for(lambda: failed or passes >= seen + 2)  # passes with them removed
    stop.set()
    server.join()
    runtime.flush()
    print("failed", repr(failed))
    print("compiles", compiles.frame_count)
    print("records", sink.records)
"""


def _bind_while_running(rounds: int, *, fullgraph: bool) -> dict[str, str]:
    """Run BIND_WHILE_RUNNING in a process of its own; what it printed, by line."""
    script = BIND_WHILE_RUNNING.replace("ROUNDS", str(rounds)).replace("FULLGRAPH", str(fullgraph))
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def test_binding_while_another_thread_runs_the_compiled_model_does_not_crash_it():
    """Binding makes compiled code trace again. Dropping Dynamo's code caches
    for that (reset_code_caches) while another thread ran the compiled model
    freed the cache entries under it: the process died (SIGSEGV, SIGFPE),
    in 3 runs of 3 with 15 bindings. The entries are invalidated instead,
    as Dynamo itself does when an object its guards hold is freed: the
    server thread's passes go on, and the bound hooks capture."""
    said = _bind_while_running(8, fullgraph=False)
    assert said["failed"] == "[]"
    assert int(said["records"]) > 0


def test_bind_remove_churn_while_a_server_thread_runs_a_fullgraph_model_never_breaks_it():
    """A server thread runs a GPT-2 compiled with fullgraph=True while the
    main thread binds and removes its MLPs twelve times, each state held
    for two passes (capture toggled while serving). Every bind and remove
    used to cost a compile, and past recompile_limit every pass raised
    FailOnRecompileLimitHit in the server thread. Now no pass raises, the
    bound passes capture, and the compiles stay few, whatever the threads'
    interleaving."""
    said = _bind_while_running(12, fullgraph=True)
    assert said["failed"] == "[]"
    assert int(said["records"]) > 0
    assert int(said["compiles"]) <= 4  # warm-up and first bind: 2 unless they raced


def _churn(compiled, runtime, rounds, pattern, ids, mask, *, select=None):
    """``rounds`` bind/remove rounds on a warmed-up compiled model: each
    round binds ``pattern`` (a list: one per round, in turn), runs a pass
    keyed 100*r + row, removes, and runs a pass keyed 100*r + 50 + row."""
    patterns = pattern if isinstance(pattern, list) else [pattern]
    selects = select if isinstance(select, list) else [select]
    logits = []
    for r in range(rounds):
        bindings = bind_modules(
            runtime,
            compiled,
            patterns[r % len(patterns)],
            layout="acts",
            select=selects[r % len(selects)],
            on_error="raise",
        )
        with torch.inference_mode(), capture_context([100 * r, 100 * r + 1], attention_mask=mask):
            logits.append(compiled(ids, attention_mask=mask).logits)
        for binding in bindings:
            binding.remove()
        with torch.inference_mode(), capture_context([100 * r + 50, 100 * r + 51]):
            logits.append(compiled(ids, attention_mask=mask).logits)
    return logits


@pytest.mark.parametrize("backend", ["counter", "inductor"])
def test_bind_remove_churn_on_a_fullgraph_model_compiles_a_bounded_number_of_times(backend):
    """Each bind of an unhooked module invalidated the compiled code and each
    remove() failed Dynamo's guard on the module's hook count, and Dynamo
    counts every compile of a code object against recompile_limit (8): about
    four bind/remove rounds on a warmed-up GPT-2 compiled with fullgraph=True
    made every later forward pass raise FailOnRecompileLimitHit. A server
    toggling capture for a debugging session broke inference. Now a module's
    traced hook keeps its place when removed: twelve rounds compile twice
    (the warm-up, the first bind), every pass runs, records come only from
    bound passes, and they are the real positions of each row."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter() if backend == "counter" else None
    model = gpt2()
    names = ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    compiled = torch.compile(model, fullgraph=True, backend=counter or backend)
    rounds = 12
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        with torch.inference_mode():
            compiled(ids, attention_mask=mask)  # the server's warm-up
        logits = _churn(compiled, runtime, rounds, "transformer.h.*.mlp", ids, mask)
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        assert runtime.counters().ingress.skipped == {}  # removed hooks count nothing
        records = records_by_hook(sink.record_batches, runtime.hooks)
    if counter is not None:
        assert counter.frame_count == 2  # the warm-up, and once with the hooks
    expected = _gpt2_reference(model, names, ids, attention_mask=mask)
    with torch.inference_mode():
        eager = model(ids, attention_mask=mask).logits
    for got in logits:
        torch.testing.assert_close(got, eager)
    for name in names:
        keys = [key for key, _, _ in records[name]]
        assert keys == [100 * r + row for r in range(rounds) for row in (0, 1)]
        for i, (_, _, payload) in enumerate(records[name]):
            want = expected[name][i % 2][mask[i % 2].bool()].numpy()
            got = as_float32(payload).reshape(-1, 32)
            if backend == "counter":  # the graph run eagerly: bitwise
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_removed_binding_of_a_compiled_model_leaves_its_eager_module_inert():
    """The place a traced hook keeps after remove() holds a hook that does
    nothing eagerly: the eager model run under a capture context, and
    outside one, captures and counts nothing; binding again captures."""
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    module = model.transformer.h[0].mlp
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        (binding,) = bind_modules(runtime, compiled, "transformer.h.0.mlp", layout="acts")
        with torch.inference_mode(), capture_context([1, 2]):
            compiled(ids)
        binding.remove()
        assert binding.removed
        assert len(module._forward_hooks) == 1  # the place is kept, inert
        with torch.inference_mode():
            model(ids)  # outside any context: not even counted as skipped
            with capture_context([3, 4]):
                model(ids)
                compiled(ids)
        (again,) = bind_modules(runtime, compiled, "transformer.h.0.mlp", layout="acts")
        assert len(module._forward_hooks) == 1  # the same place, taken again
        with torch.inference_mode(), capture_context([5, 6]):
            model(ids)
            compiled(ids)
        runtime.flush()
        assert list(sink.descriptors()["key"]) == [1, 2, 5, 6, 5, 6]
        assert runtime.counters().ingress.skipped == {}
        assert runtime.counters().ingress.dropped == {}
    again.remove()


def test_a_removed_binding_of_an_eager_model_unhooks_its_module():
    """No compiled code traced the hook: remove() unhooks the module as
    torch's handles do, so an eager model keeps no hook of a binding gone."""
    model = gpt2()
    module = model.transformer.h[0].mlp
    ids = torch.randint(3, VOCAB, (2, 5))
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        for keys in ([1, 2], [3, 4], [5, 6]):
            (binding,) = bind_modules(runtime, model, "transformer.h.0.mlp", layout="acts")
            with torch.inference_mode(), capture_context(keys):
                model(ids)
            binding.remove()
            assert not module._forward_hooks
            with torch.inference_mode(), capture_context([9, 9]):
                model(ids)
        runtime.flush()
        assert list(sink.descriptors()["key"]) == [1, 2, 3, 4, 5, 6]


def _first_block_of_attention(output):
    return output[0]


@pytest.mark.parametrize(
    ("pattern", "select"),
    [
        ("transformer.h.0.attn", 0),
        ("transformer", "last_hidden_state"),
        ("transformer.h.0.attn", _first_block_of_attention),
    ],
)
def test_a_select_binding_of_a_fullgraph_model_captures_what_it_captures_eagerly(pattern, select):
    """The traced hook picked its tensor and the operator's kernel ran the
    eager capture, which applied select again to that tensor: an index or
    a callable took its first row (ContextMismatch: 5 rows for 2 keys, or
    a detached binding), a key or attribute failed on it (bad_output). The
    kernel hands over what was picked as picked: the compiled model's
    records equal the eager model's, bitwise under the eager backend."""
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        (binding,) = bind_modules(
            runtime, compiled, pattern, layout="acts", select=select, on_error="raise"
        )
        with torch.inference_mode():
            with capture_context([1, 2], attention_mask=mask):
                model(ids, attention_mask=mask)
            with capture_context([3, 4], attention_mask=mask):
                compiled(ids, attention_mask=mask)
        runtime.flush()
        records = records_by_hook(sink.record_batches, runtime.hooks)[pattern]
    binding.remove()
    assert [key for key, _, _ in records] == [1, 2, 3, 4]
    for row in (0, 1):
        eager, traced = as_float32(records[row][2]), as_float32(records[row + 2][2])
        assert eager.size == int(mask[row].sum()) * 32
        np.testing.assert_array_equal(traced, eager)


def test_churn_over_different_modules_and_selects_compiles_once_per_new_place():
    """Rounds binding one layer, the other, both, and an attention module
    with select=None and select=0 in turn: each module's first bind and each
    select a place has not had yet compile once (Dynamo keeps the entries),
    and later rounds compile nothing, whichever subset and select they bind."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    model = gpt2()
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    patterns = ["transformer.h.0.mlp", "transformer.h.1.mlp", "transformer.h.*.mlp"]
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=RecordSchema([ACTS])) as runtime:
        with torch.inference_mode():
            compiled(ids, attention_mask=mask)
        _churn(compiled, runtime, 9, patterns, ids, mask)
        assert counter.frame_count == 3  # the warm-up, the first bind of h.0, of h.1
        _churn(compiled, runtime, 6, "transformer.h.0.attn", ids, mask, select=[None, 0])
        assert counter.frame_count == 5  # attn's first bind, its first select=0
        runtime.flush()
        assert runtime.counters().ingress.dropped == {}
        assert runtime.counters().ingress.skipped == {}
        records = records_by_hook(sink.record_batches, runtime.hooks)
    bound = {
        name: [r for r in range(9) if name.endswith(f"h.{r % 3}.mlp") or r % 3 == 2]
        for name in ("transformer.h.0.mlp", "transformer.h.1.mlp")
    }
    for name, rounds in bound.items():
        assert [key for key, _, _ in records[name]] == [
            100 * r + row for r in rounds for row in (0, 1)
        ]
    reference = Reference(model, ["transformer.h.0.attn"], lambda out: out[0])
    with torch.inference_mode():
        model(ids, attention_mask=mask)
    reference.remove()
    attn = records["transformer.h.0.attn"]
    assert [key for key, _, _ in attn] == [100 * r + row for r in range(6) for row in (0, 1)]
    for i, (_, _, payload) in enumerate(attn):  # select None and 0: the same tensor
        want = reference.calls["transformer.h.0.attn"][0][i % 2][mask[i % 2].bool()].numpy()
        np.testing.assert_array_equal(as_float32(payload).reshape(-1, 32), want)
