"""Q/K spectra: attention health from captured query and key projections.

Input (layout ``qk``, one ``Array(Float32)`` column): one record per sequence
and layer holding each token's query projection followed by its key
projection, ``[tokens, 2 * hidden]`` with the heads side by side as the model
lays them out (:func:`taproute.service.signals.taps.bind_qk` captures that).

Per record and head, from the attention logits ``A = Q_h K_hᵀ / √d``:

- ``singular_values``: the top ``top_k`` singular values of ``A`` (zeros past
  ``min(tokens, d)``);
- ``spectral_norm`` s1; ``stable_rank`` ‖A‖²_F / s1²; ``effective_rank``
  exp(entropy of s / Σs) over the singular values s (Roy & Vetterli, 2007),
  0 for an all-zero ``A``;
- attention entropy (nats) of the causal softmax of ``A`` per query position:
  ``entropy_mean`` and ``entropy_min`` over positions 1..T-1 (position 0 sees
  one key, its entropy is always 0, so it is left out; with ``causal=False``
  every position counts), ``entropy_last`` at the last position (log T for a
  uniform attention).

``signals.qk_spectra`` (stateless) writes those per record and head;
``signals.qk_summary`` (stateful, one slot per hook) aggregates them per
(hook, head) over tumbling windows of ``window`` records and writes one row
per head when a window closes (a window still open writes nothing yet).
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import numpy.typing as npt

from taproute.native import StateRegion
from taproute.routing import (
    InvalidInput,
    Layout,
    Records,
    SlotSpec,
    stateful_processor,
    stateless_processor,
)
from taproute.routing.processors import REGISTRY, ProcessorRegistry
from taproute.service.signals.common import (
    DEFAULT_KEY_RANGE,
    Registered,
    hook_key,
    hooks_and_layers,
    keys_in_order,
    positive,
    tail_layout,
    token_groups,
    window_segments,
)

#: Records are processed in chunks whose attention logits take at most this many
#: float64 elements (2 MiB): the softmax passes then run in cache, not in RAM.
_CHUNK_ELEMENTS = 1 << 18

#: Causal softmax rows are taken in blocks of this many query positions, each
#: reading only the keys it can see (long sequences skip most of the masked half).
_ROW_BLOCK = 32


@attrs.frozen(kw_only=True)
class QKConfig:
    """Shape and naming of one Q/K spectral processor pair."""

    hidden: int = attrs.field(default=384, validator=positive)  # H * d of Q (and of K)
    heads: int = attrs.field(default=12, validator=positive)
    top_k: int = attrs.field(default=8, validator=positive)
    causal: bool = True
    window: int = attrs.field(default=64, validator=positive)  # records per hook
    key_range: int = attrs.field(default=DEFAULT_KEY_RANGE, validator=positive)
    input: str = "qk"
    spectra: str = "signals.qk_spectra"
    summary: str = "signals.qk_summary"
    spectra_layout: str = "qk_spectra"
    summary_layout: str = "qk_summary"

    def __attrs_post_init__(self) -> None:
        if self.hidden % self.heads:
            from taproute.routing import ConfigError

            raise ConfigError(f"QKConfig: hidden={self.hidden} is not a multiple of heads")


@attrs.frozen
class QKStats:
    """Per record and head (arrays ``[n, heads]``; ``singular`` is ``[n, heads, top_k]``)."""

    singular: npt.NDArray[np.float64]
    spectral_norm: npt.NDArray[np.float64]
    stable_rank: npt.NDArray[np.float64]
    effective_rank: npt.NDArray[np.float64]
    entropy_mean: npt.NDArray[np.float64]
    entropy_min: npt.NDArray[np.float64]
    entropy_last: npt.NDArray[np.float64]


def _split_heads(x: npt.NDArray[np.generic], heads: int) -> npt.NDArray[np.float64]:
    n, t, hidden = x.shape
    return x.reshape(n, t, heads, hidden // heads).transpose(0, 2, 1, 3).astype(np.float64)


def qk_stats(
    q: npt.NDArray[np.generic],
    k: npt.NDArray[np.generic],
    *,
    heads: int,
    top_k: int,
    causal: bool = True,
) -> QKStats:
    """The spectral and entropy statistics of ``n`` sequences of equal length.

    ``q`` and ``k`` are ``[n, tokens, hidden]``.  Stacked numpy/LAPACK calls per
    chunk of records (no per-record Python); see :func:`singular_values` for
    how the spectrum is computed.
    """
    n, t, hidden = q.shape
    d = hidden // heads
    # The full logits are needed by the T x T Gram matrix (T <= d) and by a
    # bidirectional softmax; otherwise each causal row block computes only
    # the keys it sees, and a chunk holds at most one block of logits.
    full = t <= d or not causal
    per = max(1, _CHUNK_ELEMENTS // max(1, heads * t * (t if full else min(t, _ROW_BLOCK))))
    if n > per:
        parts = [
            qk_stats(q[i : i + per], k[i : i + per], heads=heads, top_k=top_k, causal=causal)
            for i in range(0, n, per)
        ]
        return QKStats(
            *(np.concatenate([getattr(p, f.name) for p in parts]) for f in attrs.fields(QKStats))
        )
    qh, kh = _split_heads(q, heads), _split_heads(k, heads)
    scale = 1.0 / math.sqrt(d)
    scores = None
    if full:
        scores = qh @ kh.transpose(0, 1, 3, 2)
        scores *= scale  # [n, H, T, T]
    sv = singular_values(qh, kh, scale, scores)
    total = sv.sum(-1)
    p = sv / np.where(total > 0, total, 1.0)[..., None]
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    effective = np.where(total > 0, np.exp(-plogp.sum(-1)), 0.0)
    top = sv[..., :1][..., 0]
    stable = np.where(top > 0, (sv**2).sum(-1) / np.where(top > 0, top, 1.0) ** 2, 0.0)
    singular = np.zeros((n, heads, top_k))
    m = min(top_k, sv.shape[-1])
    singular[..., :m] = sv[..., :m]

    entropy = softmax_entropy(qh, kh, scale, causal, scores)  # [n, H, T]
    rows = entropy[..., 1:] if causal and t > 1 else entropy
    return QKStats(
        singular=singular,
        spectral_norm=top,
        stable_rank=stable,
        effective_rank=effective,
        entropy_mean=rows.mean(-1),
        entropy_min=rows.min(-1),
        entropy_last=entropy[..., -1],
    )


def singular_values(
    qh: npt.NDArray[np.float64],
    kh: npt.NDArray[np.float64],
    scale: float,
    scores: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.float64]:
    """Singular values (descending, ``[..., min(T, d)]``) of ``scores = scale * qh khᵀ``
    (``scores`` may be given, else it is computed where it is needed).

    Both shapes come down to one stacked ``eigvalsh`` of the smaller side:
    T <= d, the T x T Gram matrix A Aᵀ; T > d, a d x d matrix with the same
    nonzero eigenvalues (see :func:`_key_side_gram`), built from d x d Gram
    matrices in a few stacked BLAS and LAPACK calls, where an SVD of A, or
    QR of both sides and a d x d SVD, cost several times as much.  Squaring
    costs precision only in values far below the spectral norm: each value
    is within 1e-7 x s1 of LAPACK's SVD (a float32 column's own resolution
    of s1), and eigenvalues that are rounding noise (below max(T, d) * eps *
    s1²) count as exact zeros.
    """
    t, d = qh.shape[-2], qh.shape[-1]
    if t > d:
        gram = _key_side_gram(qh, kh)
    else:
        if scores is None:
            scores = qh @ kh.transpose(0, 1, 3, 2)
            scores *= scale
        gram = scores @ scores.transpose(0, 1, 3, 2)
    eigen = np.linalg.eigvalsh(gram)[..., ::-1]  # descending
    if t > d:
        eigen = eigen * (scale * scale)
    noise = max(t, d) * np.finfo(np.float64).eps * eigen[..., :1]
    result: npt.NDArray[np.float64] = np.sqrt(np.where(eigen > noise, eigen, 0.0))
    return result


def _key_side_gram(
    qh: npt.NDArray[np.float64], kh: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """A d x d symmetric matrix whose eigenvalues are those of (Q Kᵀ)(Q Kᵀ)ᵀ,
    nonzero ones included, per head (``[..., T, d]`` inputs, T > d).

    With Kᵀ K = L Lᵀ (Cholesky), Lᵀ (Qᵀ Q) L is similar to (Qᵀ Q)(Kᵀ K),
    whose eigenvalues are those of Q Kᵀ K Qᵀ: two d x d Gram matrices, one
    d x d Cholesky and two d x d products.  Where some head's keys span
    fewer than d dimensions (Kᵀ K singular, Cholesky refuses the chunk),
    BᵀB with B = Q R_Kᵀ and K = Q_K R_K (one QR of the keys) serves instead.
    """
    kt = kh.transpose(0, 1, 3, 2)
    try:
        low = np.linalg.cholesky(kt @ kh)
    except np.linalg.LinAlgError:
        rk: npt.NDArray[np.float64] = np.linalg.qr(kh, mode="r")  # type: ignore[assignment]
        b = qh @ rk.transpose(0, 1, 3, 2)
        return b.transpose(0, 1, 3, 2) @ b
    gq = qh.transpose(0, 1, 3, 2) @ qh
    return low.transpose(0, 1, 3, 2) @ gq @ low


def softmax_entropy(
    qh: npt.NDArray[np.float64],
    kh: npt.NDArray[np.float64],
    scale: float,
    causal: bool,
    scores: npt.NDArray[np.float64] | None = None,
) -> npt.NDArray[np.float64]:
    """Entropy (nats) of the softmax of each row of ``scale * qh khᵀ`` (causal:
    keys <= query); ``scores``, if given, are those logits already computed,
    and are consumed (overwritten) here.

    Causal rows go in blocks of :data:`_ROW_BLOCK` query positions, each over
    the keys it can see, so a long sequence skips most of the masked half
    (of the exponentials and, when ``scores`` is not given, of the products).
    """
    t = qh.shape[-2]
    if not causal:
        return _row_entropy(_logits(qh, kh, scale, scores, 0, t, t), None)
    out = np.empty(qh.shape[:-1])
    for start in range(0, t, _ROW_BLOCK):
        stop = min(t, start + _ROW_BLOCK)
        future = np.arange(stop)[None, :] > np.arange(start, stop)[:, None]
        out[..., start:stop] = _row_entropy(
            _logits(qh, kh, scale, scores, start, stop, stop), future
        )
    return out


def _logits(
    qh: npt.NDArray[np.float64],
    kh: npt.NDArray[np.float64],
    scale: float,
    scores: npt.NDArray[np.float64] | None,
    start: int,
    stop: int,
    keys: int,
) -> npt.NDArray[np.float64]:
    """The logits of query rows ``start:stop`` over the first ``keys`` keys, as a
    scratch array: a view into ``scores`` if given (its rows are overwritten),
    else a fresh product."""
    if scores is not None:
        return scores[..., start:stop, :keys]
    block = qh[..., start:stop, :] @ kh[..., :keys, :].transpose(0, 1, 3, 2)
    block *= scale
    return block


def _row_entropy(
    scores: npt.NDArray[np.float64], future: npt.NDArray[np.bool_] | None
) -> npt.NDArray[np.float64]:
    """Entropy of the softmax of each row of ``scores`` (a scratch array, it is
    overwritten), ``future`` cells masked out: H = log z - Σ e·c / z with
    c = s - max over the visible cells and e = exp(c) (few passes over the
    logits).  Masked cells hold c = 0 when exponentiated and e = 0 after:
    ``np.exp`` leaves its vector path for infinities."""
    centred = scores
    if future is None:
        centred -= centred.max(-1, keepdims=True)
        exp = np.exp(centred)
    else:
        np.copyto(centred, -np.inf, where=future)
        centred -= centred.max(-1, keepdims=True)
        np.copyto(centred, 0.0, where=future)
        exp = np.exp(centred)
        exp *= ~future
    z = exp.sum(-1)
    result: npt.NDArray[np.float64] = np.log(z) - np.vecdot(exp, centred) / z
    return result


def spectra_layout(config: QKConfig) -> Layout:
    """Rows of ``signals.qk_spectra``: one per record and head."""
    return Layout(
        config.spectra_layout,
        [
            ("hook", "LowCardinality(String)"),
            ("layer", "Int16"),
            ("key", "Int64"),
            ("step", "Int64"),
            ("seq", "Int64"),
            ("head", "UInt16"),
            ("tokens", "UInt32"),
            ("singular_values", "Array(Float32)", (config.top_k,)),
            ("spectral_norm", "Float32"),
            ("stable_rank", "Float32"),
            ("effective_rank", "Float32"),
            ("entropy_mean", "Float32"),
            ("entropy_min", "Float32"),
            ("entropy_last", "Float32"),
        ],
    )


def summary_layout(config: QKConfig) -> Layout:
    """Rows of ``signals.qk_summary``: one per hook, head and closed window."""
    return Layout(
        config.summary_layout,
        [
            ("hook", "LowCardinality(String)"),
            ("layer", "Int16"),
            ("window", "UInt32"),
            ("records", "UInt32"),
            ("head", "UInt16"),
            ("effective_rank_mean", "Float32"),
            ("effective_rank_min", "Float32"),
            ("stable_rank_mean", "Float32"),
            ("spectral_norm_mean", "Float32"),
            ("spectral_norm_max", "Float32"),
            ("entropy_mean", "Float32"),
            ("entropy_min", "Float32"),
        ],
    )


def record_stats(records: Records, config: QKConfig) -> tuple[QKStats, npt.NDArray[np.int64]]:
    """:func:`qk_stats` of every record (in record order) and each record's token count."""
    n, heads = len(records), config.heads
    out = QKStats(
        singular=np.zeros((n, heads, config.top_k)),
        **{f.name: np.zeros((n, heads)) for f in attrs.fields(QKStats) if f.name != "singular"},
    )
    tokens = np.zeros(n, dtype=np.int64)
    where = f"processor {config.spectra!r}"
    for index, values in token_groups(records, 2 * config.hidden, where=where):
        q, k = values[..., : config.hidden], values[..., config.hidden :]
        try:
            stats = qk_stats(q, k, heads=heads, top_k=config.top_k, causal=config.causal)
        except np.linalg.LinAlgError:
            _refuse_non_finite(records, index, values, where)
            raise
        if not (np.isfinite(stats.spectral_norm).all() and np.isfinite(stats.entropy_mean).all()):
            _refuse_non_finite(records, index, values, where)
        for f in attrs.fields(QKStats):
            getattr(out, f.name)[index] = getattr(stats, f.name)
        tokens[index] = values.shape[1]
    return out, tokens


def _refuse_non_finite(
    records: Records, index: npt.NDArray[np.intp], values: npt.NDArray[np.generic], where: str
) -> None:
    """:class:`InvalidInput` naming the records of ``index`` (``values[n, tokens,
    width]``) that hold a NaN or an infinity, if any: their spectra are not
    defined (LAPACK refuses them, or they would be NaN), and the rest of the
    batch is fine (the route re-runs it record by record)."""
    bad = index[~np.isfinite(values).all(axis=(1, 2))]
    if not len(bad):
        return
    desc = records.descriptors

    def name(i: int) -> str:
        try:
            hook = f"hook {records.hook_name(i)!r}, "
        except LookupError:  # records without hook names (a replay's)
            hook = ""
        return f"record {i} ({hook}key {int(desc['key'][i])}, step {int(desc['step'][i])})"

    named = ", ".join(name(int(i)) for i in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise InvalidInput(
        f"{where}: NaN or infinity in the queries or keys of {named}{more}: "
        f"their spectra are not defined"
    )


def register(config: QKConfig, *, registry: ProcessorRegistry = REGISTRY) -> Registered:
    """Register ``config.spectra`` (stateless) and ``config.summary`` (stateful)."""
    spectra_rows = spectra_layout(config)
    summary_rows = summary_layout(config)
    heads = config.heads

    def qk_spectra(records: Records) -> npt.NDArray[np.void]:
        stats, tokens = record_stats(records, config)
        n = len(records)
        rows = np.empty(n * heads, dtype=spectra_rows.dtype)
        hooks, layers = hooks_and_layers(records)
        desc = records.descriptors
        rows["hook"] = np.repeat(hooks, heads)
        rows["layer"] = np.repeat(layers, heads)
        for field in ("key", "step", "seq"):
            rows[field] = np.repeat(desc[field], heads)
        rows["head"] = np.tile(np.arange(heads), n)
        rows["tokens"] = np.repeat(tokens, heads)
        rows["singular_values"] = stats.singular.reshape(n * heads, config.top_k)
        for name in ("spectral_norm", "stable_rank", "effective_rank"):
            rows[name] = getattr(stats, name).reshape(-1)
        for name in ("entropy_mean", "entropy_min", "entropy_last"):
            rows[name] = getattr(stats, name).reshape(-1)
        return rows

    # Slot: row 0 = [records in the open window, window index]; row 1 + h =
    # head h's [Σ erank, min erank, Σ stable, Σ spectral, max spectral, Σ entropy_mean,
    # min entropy_min].
    empty_head = np.array([0.0, np.inf, 0.0, 0.0, 0.0, 0.0, np.inf])

    def qk_summary(
        records: Records, keys: npt.NDArray[np.int64], state: StateRegion
    ) -> npt.NDArray[np.void] | None:
        stats, _ = record_stats(records, config)  # everything that can fail, before any state
        out: list[npt.NDArray[np.void]] = []
        for key, index in keys_in_order(keys):
            slot = state.slots[key]
            hook, layer = hooks_and_layers(records, index[:1])
            for start, stop, closes in window_segments(int(slot[0, 0]), len(index), config.window):
                part = index[start:stop]
                if slot[0, 0] == 0:
                    slot[1:] = empty_head
                acc = slot[1:]
                erank = stats.effective_rank[part]
                spectral = stats.spectral_norm[part]
                acc[:, 0] += erank.sum(0)
                acc[:, 1] = np.minimum(acc[:, 1], erank.min(0))
                acc[:, 2] += stats.stable_rank[part].sum(0)
                acc[:, 3] += spectral.sum(0)
                acc[:, 4] = np.maximum(acc[:, 4], spectral.max(0))
                acc[:, 5] += stats.entropy_mean[part].sum(0)
                acc[:, 6] = np.minimum(acc[:, 6], stats.entropy_min[part].min(0))
                slot[0, 0] += len(part)
                if closes:
                    rows = np.empty(heads, dtype=summary_rows.dtype)
                    count = slot[0, 0]
                    rows["hook"] = hook[0]
                    rows["layer"] = layer[0]
                    rows["window"] = slot[0, 1]
                    rows["records"] = count
                    rows["head"] = np.arange(heads)
                    rows["effective_rank_mean"] = acc[:, 0] / count
                    rows["effective_rank_min"] = acc[:, 1]
                    rows["stable_rank_mean"] = acc[:, 2] / count
                    rows["spectral_norm_mean"] = acc[:, 3] / count
                    rows["spectral_norm_max"] = acc[:, 4]
                    rows["entropy_mean"] = acc[:, 5] / count
                    rows["entropy_min"] = acc[:, 6]
                    out.append(rows)
                    slot[0, 1] += 1
                    slot[0, 0] = 0
        return np.concatenate(out) if out else None

    stateless_processor(
        config.spectra, input=config.input, output=spectra_rows.name, registry=registry
    )(qk_spectra)
    stateful_processor(
        config.summary,
        key=hook_key,
        key_range=config.key_range,
        slot=SlotSpec((heads + 1, 7), "float64"),
        input=config.input,
        output=summary_rows.name,
        registry=registry,
    )(qk_summary)
    return Registered(
        (config.spectra, config.summary), tail_layout(config.input), (spectra_rows, summary_rows)
    )


#: The default configuration (MiniLM / BERT-base shapes), registered on import.
DEFAULT = QKConfig()
SIGNALS = register(DEFAULT)
