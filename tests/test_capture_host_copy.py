"""From a captured output to host bytes: the packed CPU copy, into a fresh
array or a pooled buffer (``cpu_outputs=True``, as the writer process's
shared pool does), and the native calls under them.

Hooks offer their batches without the intake's check (``offer_captured``):
every batch they build must pass that check anyway, whatever the output's
shape, padding, dtype or path, and hold exactly the real positions' values.
"""

from __future__ import annotations

import gc
import time
import weakref

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from taproute.native import make_descriptors
from taproute.native._capture import (
    GiveBack,
    capture_records,
    gather_address,
    gather_ranges,
    plan_records,
    stamped_copy,
    untrack_acyclic,
)
from taproute.routing import Layout, RecordSchema
from taproute.routing.validation import check_batch
from taproute.service import CaptureSink, create_record_runtime
from taproute.service.capture import HostBufferPool, bind_module, capture_context
from taproute.service.sinks.writer import SharedBufferPool

F32 = Layout("f32", [("values", "Array(Float32)")])
BF16 = Layout("bf16", [("values", "Array(BFloat16)")])
SCHEMA = RecordSchema([F32, BF16])


class Emit(nn.Module):
    """Returns the tensor it is given (the capture sees exactly that output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _mask(rows: int, positions: int, kind: str) -> torch.Tensor:
    mask = torch.ones(rows, positions, dtype=torch.long)
    if kind == "right":
        mask[::2, positions // 2 :] = 0
    elif kind == "left":
        mask[1::2, : positions // 3] = 0
    elif kind == "holes":
        mask[:, 1::3] = 0
    return mask


def _expected(x: torch.Tensor, mask: torch.Tensor | None, token_axis: bool) -> list[np.ndarray]:
    """Each row's real positions, taken independently of taproute."""
    rows = []
    for i in range(x.shape[0]):
        row = x[i]
        if token_axis and mask is not None:
            row = row[mask[i].bool()]
        rows.append(row.contiguous())
    return rows


def _capture(x, *, mask=None, layout="f32", pool=None):
    sink = CaptureSink()
    module = Emit()
    with create_record_runtime(record_sink=sink, schema=SCHEMA) as runtime:
        bind_module(
            runtime,
            module,
            "emit",
            layout=layout,
            pool=pool,
            on_error="raise",
            # dimension 1 of a 4-D output is the tokens only when said so
            token_axis=1 if x.dim() >= 4 else None,
        )
        with torch.inference_mode(), capture_context(list(range(x.shape[0])), attention_mask=mask):
            module(x)
            module(x)  # the second call takes the cached plan
        runtime.flush()
        bound = len(runtime.hooks)
    return sink, bound


CASES = [
    ("3d, every position", (4, 6, 5), None, "f32"),
    ("3d, right padding", (4, 6, 5), "right", "f32"),
    ("3d, left padding", (4, 6, 5), "left", "f32"),
    ("3d, holes (gathered)", (4, 6, 5), "holes", "f32"),
    ("4d, right padding", (4, 6, 2, 3), "right", "f32"),
    ("2d rows", (4, 7), None, "f32"),
    ("bf16, left padding", (4, 6, 5), "left", "bf16"),
]


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pooled"])
@pytest.mark.parametrize(
    ("shape", "mask_kind", "layout"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_every_captured_batch_passes_the_intake_check_and_holds_the_real_positions(
    shape, mask_kind, layout, pooled
):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if layout == "bf16" else torch.float32
    x = torch.randn(*shape).to(dtype)
    mask = None if mask_kind is None else _mask(shape[0], shape[1], mask_kind)
    pool = HostBufferPool(pin=False, cpu_outputs=True) if pooled else None
    sink, bound = _capture(x, mask=mask, layout=layout, pool=pool)
    expected = _expected(x, mask, token_axis=x.dim() >= 3)
    numpy_dtype = ml_dtypes.bfloat16 if layout == "bf16" else np.float32
    assert len(sink.record_batches) == 2
    for batch in sink.record_batches:
        covered = check_batch(
            batch.descriptors,
            len(batch.payload),
            bound_ids=bound,
            schema=SCHEMA,
            hook_name=lambda _: "emit",
        )
        assert covered == batch.nbytes == sum(e.numel() * e.element_size() for e in expected)
        # Either way a CPU output's real positions only are copied, back to back.
        assert len(batch.payload) == covered
        assert (
            batch.descriptors["offset"].tolist()
            == np.concatenate([[0], np.cumsum(batch.descriptors["length"])[:-1]]).tolist()
        )
        assert not batch.payload.flags.writeable and not batch.descriptors.flags.writeable
        for row, want in enumerate(expected):
            got = batch.payload_of(row).view(numpy_dtype)
            want_np = (
                want.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                if layout == "bf16"
                else want.numpy()
            )
            assert got.tobytes() == want_np.reshape(-1).tobytes()
    if pooled:
        assert pool.outstanding == 2  # the capture sink still holds both buffers
        sink.clear()
        assert pool.outstanding == 0


def test_cpu_outputs_land_in_the_shared_pools_segments_and_go_back_on_release():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5)
    mask = _mask(4, 6, "right")
    pool = SharedBufferPool(segment_bytes=1 << 16)
    try:
        sink, _ = _capture(x, mask=mask, pool=pool)  # type: ignore[arg-type]
        expected = _expected(x, mask, token_axis=True)
        for batch in sink.record_batches:
            assert pool.locate(batch.payload) is not None  # the writer reads it in place
            for row, want in enumerate(expected):
                assert batch.payload_of(row).tobytes() == want.numpy().tobytes()
        assert pool.outstanding == 2
        sink.clear()
        assert pool.outstanding == 0
        pool.close()  # a hook still bound to a closed pool gathers into fresh arrays
        sink, _ = _capture(x, mask=mask, pool=pool)  # type: ignore[arg-type]
        for batch in sink.record_batches:
            for row, want in enumerate(expected):
                assert batch.payload_of(row).tobytes() == want.numpy().tobytes()
    finally:
        pool.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pooled"])
def test_a_hooks_batch_is_kept_out_of_the_cyclic_gc_and_still_freed_and_released(pooled):
    """Queued batches outlive young collections; tracked, each hook call
    promoted its batch, lease and release to the oldest generation and set
    off full collections.  Untracked, they are still freed by refcount and
    a pooled buffer still goes back once."""
    pool = HostBufferPool(pin=False, cpu_outputs=True) if pooled else None
    sink, _ = _capture(torch.randn(4, 6, 5), mask=_mask(4, 6, "right"), pool=pool)
    batch = sink.record_batches[0]
    assert not gc.is_tracked(batch) and not gc.is_tracked(batch.lease)
    freed = weakref.finalize(batch.payload.base if pooled else batch.payload, lambda: None)
    if pooled:
        assert pool is not None and pool.outstanding == 2
    del batch
    sink.clear()
    if pooled:
        assert pool is not None and pool.outstanding == 0  # released once each
        assert freed.alive  # the buffer is the pool's again, not freed
    else:
        assert not freed.alive  # freed by refcount, without a collection


def test_give_back_returns_its_buffer_to_its_pool_and_is_not_gc_tracked():
    pool = HostBufferPool(pin=False)
    buffer = pool.take_host(100)
    release = GiveBack(pool, buffer)
    assert not gc.is_tracked(release) and pool.outstanding == 1
    release()
    assert pool.outstanding == 0 and pool.take_host(100) is buffer


def test_untrack_acyclic_untracks_containers_and_skips_the_rest():
    items = [[1], {"a": 1}, 3, None, np.zeros(2)]
    untrack_acyclic(*items)
    assert not any(gc.is_tracked(item) for item in items)
    assert items[0] == [1] and items[1] == {"a": 1}  # untouched otherwise


def test_a_non_contiguous_output_is_captured_in_c_order():
    torch.manual_seed(0)
    base = torch.randn(6, 4, 5)
    x = base.transpose(0, 1)  # (4, 6, 5), not contiguous
    assert not x.is_contiguous()
    mask = _mask(4, 6, "left")
    sink, _ = _capture(x, mask=mask)
    for batch in sink.record_batches:
        for row, want in enumerate(_expected(x, mask, token_axis=True)):
            assert batch.payload_of(row).tobytes() == want.numpy().tobytes()


def test_a_cast_output_covering_every_byte_is_taken_without_a_second_copy():
    x = torch.randn(3, 4, 5, dtype=torch.bfloat16)
    sink, _ = _capture(x)  # bf16 -> Float32: exact, made by the capture itself
    for batch in sink.record_batches:
        assert len(batch.payload) == x.numel() * 4
        np.testing.assert_array_equal(batch.payload.view(np.float32), x.float().numpy().reshape(-1))


# -- the native calls -----------------------------------------------------------


def test_gather_ranges_packs_the_ranges_and_refuses_what_does_not_fit():
    source = np.arange(100, dtype=np.uint8)
    out = gather_ranges(source, np.array([10, 50, 0]), np.array([3, 2, 0]), 5)
    assert out.tolist() == [10, 11, 12, 50, 51] and not out.flags.writeable
    with pytest.raises(ValueError, match=r"range 0 \[99, 99 \+ 2\) is outside the 100-byte"):
        gather_ranges(source, np.array([99]), np.array([2]), 2)
    with pytest.raises(ValueError, match="outside"):
        gather_ranges(source, np.array([-1]), np.array([2]), 2)
    with pytest.raises(ValueError, match="the ranges cover 2 bytes, not 3"):
        gather_ranges(source, np.array([0]), np.array([2]), 3)
    with pytest.raises(ValueError, match="2 offsets but 1 lengths"):
        gather_ranges(source, np.array([0, 1]), np.array([2]), 2)


def test_gather_address_packs_a_tensors_ranges_and_refuses_what_does_not_fit():
    tensor = torch.arange(100, dtype=torch.uint8)
    address, size = tensor.data_ptr(), tensor.nbytes
    offsets, lengths = np.array([10, 50, 0]), np.array([3, 2, 0])
    out = gather_address(address, size, offsets, lengths, 5)
    assert out.tolist() == [10, 11, 12, 50, 51] and not out.flags.writeable
    assert out.tolist() == gather_ranges(tensor.numpy(), offsets, lengths, 5).tolist()
    with pytest.raises(ValueError, match=r"range 0 \[99, 99 \+ 2\) is outside the 100-byte"):
        gather_address(address, size, np.array([99]), np.array([2]), 2)
    with pytest.raises(ValueError, match="outside"):
        gather_address(address, size, np.array([-1]), np.array([2]), 2)
    with pytest.raises(ValueError, match="the ranges cover 2 bytes, not 3"):
        gather_address(address, size, np.array([0]), np.array([2]), 3)
    with pytest.raises(ValueError, match="2 offsets but 1 lengths"):
        gather_address(address, size, np.array([0, 1]), np.array([2]), 2)
    with pytest.raises(ValueError, match="1-D C-contiguous int64"):
        gather_address(address, size, np.array([0], dtype=np.int32), np.array([2]), 2)
    with pytest.raises(ValueError, match="null address"):
        gather_address(0, size, np.array([0]), np.array([2]), 2)


def test_capture_records_gathers_and_stamps_in_one_call():
    tensor = torch.arange(100, dtype=torch.uint8)
    address, size = tensor.data_ptr(), tensor.nbytes
    offsets, lengths = np.array([10, 50, 0]), np.array([3, 2, 0])
    template = make_descriptors(0, [0, 3, 5], layout_ids=1)  # packed: offsets 0, 3, 5
    keys = np.array([7, -8, 2**62], dtype=np.int64)
    before = time.time_ns()
    descriptors, payload = capture_records(
        address, size, offsets, lengths, 5, None, template, 42, keys, 6
    )
    after = time.time_ns()
    assert payload.tolist() == [10, 11, 12, 50, 51] and not payload.flags.writeable
    assert not descriptors.flags.writeable
    assert (descriptors["output_id"] == 42).all() and (descriptors["step"] == 6).all()
    assert descriptors["key"].tolist() == keys.tolist()
    assert before <= descriptors["timestamp_ns"][0] <= after
    assert (descriptors["timestamp_ns"] == descriptors["timestamp_ns"][0]).all()
    for field in ("layout_id", "seq", "offset", "length"):
        assert descriptors[field].tolist() == template[field].tolist()
    assert (template["output_id"] == 0).all()  # the template is untouched
    into = np.full(8, 255, dtype=np.uint8)
    _, payload = capture_records(address, size, offsets, lengths, 5, into, template, 1, keys, 0)
    assert payload.tolist() == [10, 11, 12, 50, 51] and not payload.flags.writeable
    assert payload.base is into and into.tolist()[5:] == [255] * 3  # a view; nothing past it
    into[:] = 0
    for bad, match in [
        ((address, size, np.array([99, 0, 0]), lengths, 5, None), "outside the 100-byte"),
        ((address, size, offsets, lengths, 6, None), "cover 5 bytes, not 6"),
        ((address, size, offsets, lengths[:2], 5, None), "3 offsets but 2 lengths"),
        ((0, size, offsets, lengths, 5, None), "null address"),
        ((address, size, offsets, lengths, 5, np.zeros(4, np.uint8)), "holds 4 bytes, not 5"),
        ((address, size, offsets, lengths, 5, np.zeros(8, np.int16)), "writable 1-D"),
        ((address, size, offsets, lengths, 5, payload), "writable 1-D"),  # read-only
    ]:
        with pytest.raises(ValueError, match=match):
            capture_records(*bad, template, 1, keys, 0)
    assert into.tolist() == [0] * 8  # refused before a byte was copied
    with pytest.raises(ValueError, match="template must be 3 descriptors"):
        capture_records(address, size, offsets, lengths, 5, None, template[:2], 1, keys, 0)
    with pytest.raises(ValueError, match="needs 3 keys"):
        capture_records(address, size, offsets, lengths, 5, None, template, 1, keys[:2], 0)
    with pytest.raises(ValueError, match="needs 3 keys"):
        capture_records(
            address, size, offsets, lengths, 5, None, template, 1, keys.astype(np.int32), 0
        )


def test_stamped_copy_sets_output_id_and_time_and_keeps_the_rest():
    template = make_descriptors(3, [4, 8, 12], keys=[7, 8, 9], steps=2, layout_ids=1)
    out = stamped_copy(template, 42, 123456789)
    assert out.tolist() != template.tolist()
    assert (out["output_id"] == 42).all() and (out["timestamp_ns"] == 123456789).all()
    for field in ("layout_id", "key", "step", "seq", "offset", "length"):
        assert out[field].tolist() == template[field].tolist()
    assert (template["output_id"] == 3).all()  # the template is untouched
    assert not out.flags.writeable
    with pytest.raises(ValueError, match="needs a 1-D C-contiguous array of DESCRIPTOR_DTYPE"):
        stamped_copy(np.zeros(3), 1, 2)
    with pytest.raises(ValueError, match="needs a 1-D C-contiguous"):
        stamped_copy(template[::2], 1, 2)


def test_stamped_copy_with_keys_sets_each_records_key_and_the_step():
    template = make_descriptors(3, [4, 8, 12], layout_ids=1)  # a shared plan's: keys 0, step 0
    keys = np.array([-5, 2**62, 7], dtype=np.int64)
    out = stamped_copy(template, 42, 99, keys, 6)
    assert out["key"].tolist() == keys.tolist() and (out["step"] == 6).all()
    assert (out["output_id"] == 42).all() and (out["timestamp_ns"] == 99).all()
    for field in ("layout_id", "seq", "offset", "length"):
        assert out[field].tolist() == template[field].tolist()
    assert (template["key"] == 0).all() and (template["step"] == 0).all()  # untouched
    with pytest.raises(ValueError, match="needs 3 keys as a 1-D C-contiguous int64 array"):
        stamped_copy(template, 1, 2, keys[:2], 0)
    with pytest.raises(ValueError, match="needs 3 keys"):
        stamped_copy(template, 1, 2, keys.astype(np.int32), 0)


def test_plan_records_gives_each_rows_bytes_and_templates_as_make_descriptors_would():
    counts, starts = np.array([5, 2, 0]), np.array([0, 3, 1])
    # Runs: record i is counts[i] positions of 8 bytes from starts[i] of its 5-position row.
    offsets, lengths, covered, packed, in_source = plan_records(3, 0, 8, 5, counts, starts, True, 2)
    assert offsets.tolist() == [0, 5 * 8 + 3 * 8, 10 * 8 + 8] and lengths.tolist() == [40, 16, 0]
    assert covered == 56
    want = make_descriptors(0, lengths, offsets=offsets, layout_ids=2, timestamps_ns=0)
    assert in_source.tolist() == want.tolist()
    assert packed.tolist() == make_descriptors(0, lengths, layout_ids=2, timestamps_ns=0).tolist()
    assert not any(a.flags.writeable for a in (offsets, lengths, packed, in_source))
    # Gathered (not runs): back to back in the tensor too; whole rows without counts.
    offsets, lengths, covered, _, in_source = plan_records(3, 0, 8, 5, counts, None, False, 0)
    assert offsets.tolist() == [0, 40, 56] and in_source["offset"].tolist() == [0, 40, 56]
    offsets, lengths, covered, _, _ = plan_records(2, 16, 0, 0, None, None, True, 0)
    assert offsets.tolist() == [0, 16] and lengths.tolist() == [16, 16] and covered == 32
    with pytest.raises(ValueError, match="row 1: its real positions fall outside its 5"):
        plan_records(3, 0, 8, 5, counts, np.array([0, 4, 0]), True, 0)
    with pytest.raises(ValueError, match="row 0: its real positions fall outside its 4"):
        plan_records(3, 0, 8, 4, counts, starts, True, 0)
    with pytest.raises(ValueError, match="counts must be 3 int64 values"):
        plan_records(3, 0, 8, 5, counts.astype(np.int32), starts, True, 0)
    with pytest.raises(ValueError, match="starts must be 3 int64 values"):
        plan_records(3, 0, 8, 5, counts, None, True, 0)
    with pytest.raises(OverflowError):
        plan_records(3, 0, 8, 5, counts, starts, True, 70000)  # layout_id is 16 bits


def test_an_output_that_requires_grad_is_captured_from_a_detached_view():
    torch.manual_seed(0)
    layer = nn.Linear(5, 5)  # outside inference_mode its output requires grad
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=SCHEMA) as runtime:
        bind_module(runtime, layer, "linear", layout="f32", on_error="raise")
        x = torch.randn(3, 4, 5)
        with capture_context([0, 1, 2], lengths=[4, 2, 3]):
            y = layer(x)
        assert y.requires_grad
        runtime.flush()
    (batch,) = sink.record_batches
    for row, tokens in enumerate([4, 2, 3]):
        want = y[row, :tokens].detach().numpy()
        assert batch.payload_of(row).tobytes() == want.tobytes()


def test_a_negated_view_is_captured_with_its_values_not_its_memory():
    """A tensor with the negative bit (what ``.imag`` of a conjugated tensor
    is) may be contiguous while its memory holds the values un-negated: the
    capture must hold the values the model sees."""
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 1
    negated = torch._neg_view(base)  # the public path: complex.conj().imag
    assert negated.is_neg() and negated.is_contiguous()
    sink = CaptureSink()
    with create_record_runtime(record_sink=sink, schema=SCHEMA) as runtime:
        module = Emit()
        bind_module(runtime, module, "neg", layout="f32", on_error="raise")
        with capture_context([0, 1], lengths=[3, 2]):
            module(negated)
        runtime.flush()
    (batch,) = sink.record_batches
    for row, tokens in enumerate([3, 2]):
        want = (-base[row, :tokens]).numpy()
        assert batch.payload_of(row).tobytes() == want.tobytes()
