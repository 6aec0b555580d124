"""What the example inference server captures, and where it goes (issue #17).

Three routes over the hooks :mod:`bench.inference_server` binds:

- ``raw``: the hidden states of a few layers (MiniLM layers 0 and 5, every
  GPT-2 block) forwarded untouched to ClickHouse -> ``raw_activations``;
- ``head_norms`` (stateless): per attention head, the mean L2 norm of the
  query vectors over a record's tokens -> ``head_norms``, one row per record
  (both models have ``HEADS`` heads, so one fixed-shape column serves both);
- ``request_summary`` (stateful, keyed by request id): token count and mean /
  max token-norm of the last layer's hidden states over every forward pass
  of a request, emitted once when the request is done -> ``request_summary``.

Request completion is the key lifecycle: the server runs a request's
forward passes inside ``capture_context(..., end_keys=runtime)`` (around the
embedding pass; around the whole decode of a generate batch), so on exit
the request ids are completed: after every record of theirs, the
processor's ``finalize`` emits the summary row and the slot is cleared.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
from taproute.service import (
    Layout,
    Records,
    RecordSchema,
    Route,
    RoutingConfig,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)

HEADS = 12
ACTIVATIONS = Layout("activations", [("values", "Array(Float32)")])
HEAD_NORMS = Layout(
    "head_norms",
    [
        ("request", "Int64"),
        ("step", "UInt32"),
        ("hook", "LowCardinality(String)"),
        ("tokens", "UInt32"),
        ("norms", "Array(Float32)", (HEADS,)),
    ],
)
REQUEST_SUMMARY = Layout(
    "request_summary",
    [
        ("request", "Int64"),
        ("model", "LowCardinality(String)"),
        ("records", "UInt32"),
        ("tokens", "UInt32"),
        ("norm_mean", "Float64"),
        ("norm_max", "Float64"),
    ],
)
SCHEMA = RecordSchema([ACTIVATIONS, HEAD_NORMS, REQUEST_SUMMARY])
TABLES = {"raw": "raw_activations", "head_norms": "head_norms", "summary": "request_summary"}

#: Request-summary slots: request ids map to ``id % SUMMARY_SLOTS``; a slot is
#: reused once its request is done (the server reopens it for the next id that
#: maps there), so this bounds requests in flight, not served.
SUMMARY_SLOTS = 65_536


@attrs.frozen
class ModelHooks:
    """Which of one model's modules are captured, and how to read them.

    ``hidden`` (glob) goes raw; ``summary`` (one name, among ``hidden``) feeds
    the per-request summary; ``query`` (glob) feeds the per-head statistic,
    whose first ``width`` elements per token are the query vector of ``heads``
    heads (GPT-2's fused ``c_attn`` output is ``[q | k | v]``).
    """

    prefix: str
    hidden: str
    summary: str
    query: str
    width: int
    heads: int
    query_stride: int


#: prefix -> hooks of the models a server has bound (filled by :func:`register_model`).
MODELS: dict[str, ModelHooks] = {}


def register_model(hooks: ModelHooks) -> None:
    """Make a model's geometry known to the processors (at server start)."""
    if hooks.heads != HEADS or hooks.width % HEADS:
        raise ValueError(
            f"model {hooks.prefix!r}: head_norms stores {HEADS} heads per row; the model has "
            f"{hooks.heads} heads over width {hooks.width}"
        )
    MODELS[hooks.prefix] = hooks


def _model_of(hook: str) -> ModelHooks:
    return MODELS[hook.split(".", 1)[0]]


def _token_rows(
    records: Records, index: npt.NDArray[np.intp], stride: int, width: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The first ``width`` float32 of every token (``stride`` float32 apart)
    of records ``index``, stacked into one ``(tokens, width)`` array (one
    gather for all of them, no per-record Python), and each record's token
    count (its rows in the array follow each other, in ``index`` order)."""
    desc = records.descriptors
    counts = (desc["length"][index] // (4 * stride)).astype(np.int64)
    total = int(counts.sum())
    payload = np.frombuffer(records.batch.payload, dtype=np.uint8)
    if total == 0:
        return np.empty((0, width), dtype=np.float32), counts
    offsets = desc["offset"][index].astype(np.int64)
    step = 4 * stride
    lengths = counts * step
    if (
        offsets[0] % 4 == 0
        and np.all(desc["length"][index] == lengths)
        and np.all(offsets[1:] == offsets[:-1] + lengths[:-1])
    ):
        # Records back to back (as one hook call lays them out): every token
        # is ``step`` bytes after the last, so one strided view covers them.
        view = np.lib.stride_tricks.as_strided(
            payload[int(offsets[0]) :].view(np.uint8),
            shape=(total, width * 4),
            strides=(step, 1),
            writeable=False,
        )
        return view.view(np.float32), counts
    owner = np.repeat(np.arange(len(index)), counts)
    first = np.cumsum(counts) - counts
    starts = offsets[owner] + step * (np.arange(total) - first[owner])
    # A view with a token row starting at every byte (rows overlap; only the
    # indexed ones are read): one copy of exactly the bytes wanted, aligned
    # or not.
    row = np.dtype((np.float32, (width,)))
    rows = np.ndarray(
        shape=(len(payload) - row.itemsize + 1,), dtype=row, buffer=payload, strides=(1,)
    )
    return rows[starts], counts


def _per_record(
    values: npt.NDArray[np.floating], counts: npt.NDArray[np.int64], reduce: np.ufunc, empty: float
) -> npt.NDArray[np.float64]:
    """``reduce`` over each record's consecutive rows of ``values`` (``empty``
    for a record without tokens)."""
    out = np.full((len(counts), *values.shape[1:]), empty, dtype=np.float64)
    some = counts > 0
    if some.any():
        first = (np.cumsum(counts) - counts)[some]
        out[some] = reduce.reduceat(values, first, axis=0)
    return out


def _hooks_of(records: Records) -> tuple[list[str], npt.NDArray[np.intp]]:
    """The distinct hook names of ``records`` and each record's index among them."""
    _, first, inverse = np.unique(
        records.descriptors["output_id"], return_index=True, return_inverse=True
    )
    return [records.hook_name(int(i)) for i in first], inverse.reshape(-1)


@stateless_processor("server.head_norms", input="activations", output="head_norms")
def head_norms(records: Records) -> npt.NDArray[np.void]:
    """Mean L2 norm of each head's query vectors over a record's tokens
    (one pass over all tokens of each hook in the batch)."""
    rows = np.empty(len(records), dtype=HEAD_NORMS.dtype)
    desc = records.descriptors
    rows["request"] = desc["key"]
    rows["step"] = desc["step"]
    names, which = _hooks_of(records)
    rows["hook"] = np.asarray(names, dtype=object)[which]
    for k, hook in enumerate(names):  # one pass per hook, not per record
        model = _model_of(hook)
        index = np.flatnonzero(which == k)
        tokens, counts = _token_rows(records, index, model.query_stride, model.width)
        per_head = tokens.reshape(len(tokens), HEADS, model.width // HEADS)
        norms = np.sqrt(np.einsum("thd,thd->th", per_head, per_head))
        rows["tokens"][index] = counts
        rows["norms"][index] = (
            _per_record(norms, counts, np.add, np.nan) / np.maximum(counts, 1)[:, None]
        )
    return rows


def summary_slot(descriptors: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """The summary slot of each record: its request id modulo the slot count."""
    slots: npt.NDArray[np.int64] = descriptors["key"] % SUMMARY_SLOTS
    return slots


def _summary_row(state: StateRegion, slot_index: int) -> npt.NDArray[np.void]:
    """The finished request's summary row, from its slot."""
    request, model, records, tokens, total, peak = state.slots[slot_index].tolist()
    row = np.empty(1, dtype=REQUEST_SUMMARY.dtype)
    row[0] = (
        int(request),
        list(MODELS)[int(model)],
        int(records),
        int(tokens),
        total / max(tokens, 1),
        peak,
    )
    return row


@stateful_processor(
    "server.request_summary",
    key=summary_slot,
    key_range=SUMMARY_SLOTS,
    # request id, model index, records, tokens, sum of norms, max norm
    slot=SlotSpec((6,), "float64"),
    input="activations",
    output="request_summary",
    finalize=_summary_row,
)
def request_summary(records: Records, keys: npt.NDArray[np.int64], state: StateRegion) -> None:
    """Fold each forward pass's last-layer token norms into its request's slot
    (the row is emitted by ``finalize`` when the request is completed); one
    pass over all tokens of each hook in the batch, slots updated with
    ``ufunc.at`` (a request may have several records in a batch)."""
    n = len(records)
    names, which = _hooks_of(records)
    model_index = np.array([list(MODELS).index(h.partition(".")[0]) for h in names])[which]
    tokens = np.zeros(n, dtype=np.int64)
    sums = np.zeros(n)
    peaks = np.zeros(n)
    for k, hook in enumerate(names):
        width = _model_of(hook).width
        index = np.flatnonzero(which == k)
        vectors, counts = _token_rows(records, index, width, width)
        wide = vectors.astype(np.float64)
        norms = np.sqrt(np.einsum("ij,ij->i", wide, wide))
        tokens[index] = counts
        sums[index] = _per_record(norms, counts, np.add, 0.0)
        peaks[index] = _per_record(norms, counts, np.maximum, 0.0)
    slots = np.asarray(keys, dtype=np.intp)
    region = state.slots
    fresh = region[slots, 2] == 0  # the request's first record in this slot
    region[slots[fresh], :2] = np.stack(
        [records.descriptors["key"][fresh], model_index[fresh]], axis=1
    )
    region[slots[fresh], 2:] = 0.0
    np.add.at(region[:, 2], slots, 1.0)
    np.add.at(region[:, 3], slots, tokens)
    np.add.at(region[:, 4], slots, sums)
    np.maximum.at(region[:, 5], slots, np.maximum(peaks, 0.0))


def routes(models: list[ModelHooks], destination: str = "clickhouse") -> RoutingConfig:
    """Raw hidden states, per-head query norms, per-request summaries."""
    return RoutingConfig(
        [
            Route("raw", [m.prefix + "." + m.hidden for m in models], destination),
            Route(
                "head_norms",
                [m.prefix + "." + m.query for m in models],
                destination,
                mode="stateless",
                processor="server.head_norms",
                workers=2,
            ),
            Route(
                "request_summary",
                [f"{m.prefix}.{m.summary}" for m in models],
                destination,
                mode="stateful",
                processor="server.request_summary",
                workers=2,
            ),
        ]
    )


def summaries_from_raw(
    values: list[npt.NDArray[np.float32]], width: int
) -> tuple[int, int, float, float]:
    """(records, tokens, norm_mean, norm_max) of one request from its raw
    last-layer captures: what ``request_summary`` must have emitted."""
    norms = [
        np.sqrt(np.einsum("ij,ij->i", v, v))
        for v in (np.asarray(x, dtype=np.float64).reshape(-1, width) for x in values)
    ]
    tokens = sum(len(n) for n in norms)
    total = sum(float(n.sum()) for n in norms)
    peak = max((float(n.max(initial=0.0)) for n in norms), default=0.0)
    return len(values), tokens, total / max(tokens, 1), peak
