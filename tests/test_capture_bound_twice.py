"""Binding a module a second time under the same hook name, to the same
runtime, would capture every record twice (two torch hooks, one hook name):
doubled rows in every destination, silently.  It is refused, naming the hook,
until the first binding is removed; nothing of ``bind_modules`` is half-bound."""

from __future__ import annotations

import pytest
import torch

from taproute.routing import RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import CaptureError, bind_module, bind_modules, capture_context
from tests.capture_models import ACTS, VOCAB, gpt2

SCHEMA = RecordSchema([ACTS])


def _records(model, rt) -> int:
    with torch.inference_mode(), capture_context(range(2)):
        model(torch.randint(3, VOCAB, (2, 5)))
    rt.flush()
    return rt.record_sink.records


def test_binding_the_same_modules_again_is_refused_and_nothing_is_captured_twice():
    model = gpt2()
    with create_record_runtime(record_sink=CaptureSink(), schema=SCHEMA) as rt:
        first = bind_modules(rt, model, "transformer.h.[01]", layout="acts")
        with pytest.raises(CaptureError, match=r"hook 'transformer.h.0' .*already bound"):
            bind_modules(rt, model, "transformer.h.[01]", layout="acts", prefix="")
        with pytest.raises(CaptureError, match=r"hook 'transformer.h.1' .*already bound"):
            bind_module(rt, model.transformer.h[1], "transformer.h.1", layout="acts")
        assert _records(model, rt) == 2 * 2  # two hooks, two rows: once each
        rt.record_sink.clear()
        for binding in first:
            binding.remove()
        again = bind_modules(rt, model, "transformer.h.[01]", layout="acts")  # after remove()
        assert _records(model, rt) == 2 * 2
        rt.record_sink.clear()
        for binding in again:
            binding.remove()


def test_bind_modules_binds_nothing_when_one_of_its_matches_is_already_bound():
    model = gpt2()
    with create_record_runtime(record_sink=CaptureSink(), schema=SCHEMA) as rt:
        bind_module(rt, model.transformer.h[1], "transformer.h.1", layout="acts")
        with pytest.raises(CaptureError, match=r"hook 'transformer.h.1'"):
            bind_modules(rt, model, "transformer.h.[01]", layout="acts")
        assert _records(model, rt) == 2  # h.1 once; h.0 was not bound
        rt.record_sink.clear()


def test_the_same_module_may_be_bound_under_another_name_or_to_another_runtime():
    model = gpt2()
    with (
        create_record_runtime(record_sink=CaptureSink(), schema=SCHEMA) as a,
        create_record_runtime(record_sink=CaptureSink(), schema=SCHEMA) as b,
    ):
        bind_module(a, model.transformer.h[0], "h0", layout="acts")
        bind_module(a, model.transformer.h[0], "h0.copy", layout="acts")
        bind_module(b, model.transformer.h[0], "h0", layout="acts")
        with torch.inference_mode(), capture_context(range(2)):
            model(torch.randint(3, VOCAB, (2, 5)))
        a.flush()
        b.flush()
        assert (a.record_sink.records, b.record_sink.records) == (4, 2)
        a.record_sink.clear()
        b.record_sink.clear()
