"""Capture hooks on a model run through ``torch.compile``.

Dynamo traces forward hooks with the module.  It used to trace the capture
hook's own Python too and fail inside it (``AssertionError: expected
WrapperDescriptorType`` in an attrs class's ``__init__``): with the default
``on_error="detach"`` every compiled model's bindings detached on the first
call and captured nothing, with ``"raise"`` the forward pass raised.  The
hook now runs eagerly (a graph break at it), and captures what eager does.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from taproute.routing import Layout, RecordSchema
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import bind_module, capture_context

SCHEMA = RecordSchema([Layout("f32", [("values", "Array(Float32)")])])


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
