"""PyTorch forward hooks feeding the runtime, on a real (small) torch model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from taproute.actors import RoutingSink
from taproute.routing import ConfigError, Layout, RecordSchema, Route, RoutingConfig
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import CaptureWarning, HostBufferPool, bind_modules, capture_context

ACTS = Layout("acts", [("values", "Array(Float32)")])
SCHEMA = RecordSchema([ACTS])


def small_encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def test_hooks_capture_each_sequence_as_a_record_and_return_buffers():
    """Through a host buffer pool (the path CUDA outputs take; here on CPU
    with ``cpu_outputs=True``): buffers go back to the pool when released."""
    model = small_encoder()
    cap = CaptureSink()
    sink = RoutingSink(
        RoutingConfig([Route("raw", "layers.*.linear2", "cap")]),
        SCHEMA,
        {"cap": cap},
        unmatched="drop",
    )
    pool = HostBufferPool(pin=False, cpu_outputs=True)
    outputs: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        layer.linear2.register_forward_hook(
            lambda _m, _i, out, i=i: outputs.__setitem__(f"layers.{i}.linear2", out.clone())
        )
    x = torch.randn(3, 5, 32)
    with create_record_runtime(record_sink=sink) as runtime:
        bindings = bind_modules(runtime, model, "layers.*.linear2", layout="acts", pool=pool)
        assert [b.name for b in bindings] == ["layers.0.linear2", "layers.1.linear2"]
        with torch.inference_mode():
            with pytest.warns(CaptureWarning, match="outside a capture_context"):
                model(x)  # outside a capture context: nothing captured, counted
            with capture_context([101, 102, 103], lengths=[5, 2, 4], step=7):
                model(x)
        runtime.flush()
        for binding in bindings:
            binding.remove()
        with torch.inference_mode(), capture_context([1, 2, 3]):
            model(x)  # removed: nothing captured
        runtime.flush()
    assert cap.records == 6
    assert runtime.counters().ingress.skipped == {
        "layers.0.linear2": {"no_context": 1},
        "layers.1.linear2": {"no_context": 1},
    }
    for batch in cap.record_batches:
        name = runtime.hooks.name_of(int(batch.descriptors["output_id"][0]))
        assert batch.descriptors["key"].tolist() == [101, 102, 103]
        assert (batch.descriptors["step"] == 7).all()
        assert (batch.descriptors["length"] // (32 * 4)).tolist() == [5, 2, 4]
        for row, real in enumerate([5, 2, 4]):
            got = batch.payload_of(row).view(np.float32).reshape(real, 32)
            np.testing.assert_array_equal(got, outputs[name][row, :real].numpy())
    assert pool.outstanding == 2  # the capture sink still holds both buffers
    cap.clear()
    assert pool.outstanding == 0 and pool.allocated == 2


def test_cpu_outputs_are_copied_into_fresh_arrays_not_the_pool():
    """By default a CPU output is copied into a fresh array (no pool buffer):
    the record owns its bytes, the module's output tensor is not aliased."""
    model = small_encoder()
    cap = CaptureSink()
    pool = HostBufferPool(pin=False)
    outputs: list[torch.Tensor] = []
    model.layers[0].linear2.register_forward_hook(lambda _m, _i, out: outputs.append(out))
    with create_record_runtime(record_sink=cap, schema=SCHEMA) as runtime:
        bind_modules(runtime, model, "layers.0.linear2", layout="acts", pool=pool)
        with torch.inference_mode(), capture_context([1, 2, 3]):
            model(torch.randn(3, 5, 32))
        runtime.flush()
    (batch,) = cap.record_batches
    (output,) = outputs
    assert pool.allocated == 0 and pool.outstanding == 0
    assert not np.shares_memory(batch.payload, output.numpy())
    assert not batch.payload.flags.writeable
    np.testing.assert_array_equal(batch.payload.view(np.float32), output.numpy().reshape(-1))


def test_binding_needs_a_variable_array_layout_and_matching_modules():
    model = small_encoder()
    schema = RecordSchema([ACTS, Layout("fixed", [("x", "Float32")])])
    with create_record_runtime(record_sink=CaptureSink(), schema=schema) as runtime:
        with pytest.raises(ConfigError, match="layout 'fixed' must be a single variable-length"):
            bind_modules(runtime, model, "layers.*.linear2", layout="fixed")
        with pytest.raises(ConfigError, match="no submodule of the model matches 'nope.*'"):
            bind_modules(runtime, model, "nope.*", layout="acts")
