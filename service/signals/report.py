"""``taproute report``: PNG charts of the signal tables, and an index page.

Reads whichever of the signal processors' tables exist (default names:
``qk_spectra``, ``expert_health``, ``pathways``, ``intrinsic_dimension``,
each optionally prefixed) through the read-back helpers, and writes

- ``qk_by_layer.png``: mean effective rank and attention entropy per layer
  (one point per head, the line is the layer mean);
- ``expert_load.png``: expert load fraction per window, one heatmap per MoE layer;
- ``pathway_transitions.png``: expert-to-expert transition counts summed over
  windows, one heatmap per consecutive layer pair;
- ``intrinsic_dimension.png``: TwoNN intrinsic dimension per layer (one point
  per window, the line is the mean);

plus ``index.html`` linking them with the numbers behind each.  matplotlib
is needed (``pip install matplotlib``); it is imported only here.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from taproute.routing import ConfigError, Layout
from taproute.routing.errors import TaprouteError
from taproute.service.signals import experts, pathways, qk, twonn
from taproute.service.sinks.clickhouse.readback import load_rows
from taproute.service.sinks.clickhouse.transport import Transport


class NoSignalTables(TaprouteError):
    """Nothing to draw: no signal table (``prefix`` + default name) holds rows
    in the store.  ``missing``: the tables that do not exist; ``empty``:
    those that exist without rows.  Not a configuration problem: the store
    was read, it just holds no signals yet."""

    def __init__(self, where: str, missing: list[str], empty: list[str]) -> None:
        self.where = where
        self.missing = missing
        self.empty = empty
        found = []
        if missing:
            found.append(f"missing {', '.join(missing)}")
        if empty:
            found.append(f"empty {', '.join(empty)}")
        super().__init__(
            f"no signal table with rows in {where} ({'; '.join(found)}): they are written "
            "by the signals.* processors (README, Signals: service/signals/signals.toml "
            "routes captures to all four; `taproute demo` writes qk_spectra and "
            "intrinsic_dimension)"
        )


def _exists(transport: Transport, table: str) -> bool:
    return transport.describe(table) is not None


def per_layer_means(
    rows: npt.NDArray[np.void], column: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Layers present in ``rows`` and the mean of ``column`` over each."""
    layers = np.unique(rows["layer"]).astype(np.int64)
    means = np.array([float(np.mean(rows[column][rows["layer"] == layer])) for layer in layers])
    return layers, means


def signal_table(transport: Transport, *, prefix: str = "") -> list[str]:
    """Lines of a per-layer table: mean effective rank and attention entropy
    (from ``qk_spectra``) and mean intrinsic dimension (``intrinsic_dimension``)."""
    columns: dict[str, dict[int, float]] = {}
    spectra_table = prefix + qk.DEFAULT.spectra_layout
    if _exists(transport, spectra_table):
        spectra = load_rows(transport, spectra_table, qk.SIGNALS.outputs[0])
        for column in ("effective_rank", "entropy_mean"):
            layers, means = per_layer_means(spectra, column)
            columns[column] = dict(zip(layers.tolist(), means.tolist(), strict=True))
    dims_table = prefix + twonn.DEFAULT.output
    if _exists(transport, dims_table):
        dims = load_rows(transport, dims_table, twonn.SIGNALS.outputs[0])
        layers, means = per_layer_means(dims, "dimension")
        columns["dimension"] = dict(zip(layers.tolist(), means.tolist(), strict=True))
    layers_seen = sorted({layer for values in columns.values() for layer in values})
    lines = [f"{'layer':>5} {'effective rank':>15} {'attn entropy':>13} {'intrinsic dim':>14}"]
    for layer in layers_seen:
        cells = [
            columns.get(name, {}).get(layer)
            for name in ("effective_rank", "entropy_mean", "dimension")
        ]
        text = [f"{c:.2f}" if c is not None else "n/a" for c in cells]
        lines.append(f"{layer:>5} {text[0]:>15} {text[1]:>13} {text[2]:>14}")
    return lines


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError("taproute report needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _qk_chart(plt: Any, rows: npt.NDArray[np.void], path: Path) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, column, label in (
        (axes[0], "effective_rank", "effective rank of QKᵀ/√d"),
        (axes[1], "entropy_mean", "attention entropy (nats, causal)"),
    ):
        head_means = {}
        for layer in np.unique(rows["layer"]):
            for head in np.unique(rows["head"]):
                mask = (rows["layer"] == layer) & (rows["head"] == head)
                head_means[(int(layer), int(head))] = float(np.mean(rows[column][mask]))
        xs = [k[0] for k in head_means]
        ax.scatter(xs, list(head_means.values()), s=12, alpha=0.5, label="head")
        layers, means = per_layer_means(rows, column)
        ax.plot(layers, means, "o-", color="black", label="layer mean")
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
        ax.set_xticks(layers)
        ax.legend()
    fig.suptitle(f"Q/K spectra over {len(np.unique(rows['key']))} sequences")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    layers, erank = per_layer_means(rows, "effective_rank")
    _, entropy = per_layer_means(rows, "entropy_mean")
    return "".join(
        f"<tr><td>{layer}</td><td>{r:.2f}</td><td>{e:.3f}</td></tr>"
        for layer, r, e in zip(layers, erank, entropy, strict=True)
    ).join(["<table><tr><th>layer</th><th>effective rank</th><th>entropy</th></tr>", "</table>"])


def _load_chart(plt: Any, rows: npt.NDArray[np.void], path: Path) -> str:
    layers = np.unique(rows["layer"])
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3.6), squeeze=False)
    for ax, layer in zip(axes[0], layers, strict=True):
        mine = np.sort(rows[rows["layer"] == layer], order="window")
        image = ax.imshow(mine["load"].T, aspect="auto", cmap="viridis", vmin=0)
        ax.set_xticks(range(len(mine)), [str(w) for w in mine["window"]])
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("window")
        ax.set_ylabel("expert")
        fig.colorbar(image, ax=ax, label="load fraction")
    fig.suptitle("Expert load over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    layers_, loss = per_layer_means(rows, "balance_loss")
    _, dead = per_layer_means(rows, "dead_experts")
    return "".join(
        f"<tr><td>{layer}</td><td>{b:.3f}</td><td>{d:.2f}</td></tr>"
        for layer, b, d in zip(layers_, loss, dead, strict=True)
    ).join(["<table><tr><th>layer</th><th>balance loss</th><th>dead experts</th></tr>", "</table>"])


def _pathway_chart(plt: Any, rows: npt.NDArray[np.void], path: Path) -> str:
    transitions = rows["transitions"].sum(axis=0)
    pairs = transitions.shape[0]
    fig, axes = plt.subplots(1, pairs, figsize=(3.4 * pairs, 3.4), squeeze=False)
    for pair, ax in enumerate(axes[0]):
        image = ax.imshow(transitions[pair], cmap="magma")
        ax.set_title(f"layer {pair} -> {pair + 1}")
        ax.set_xlabel("expert at next layer")
        ax.set_ylabel("expert")
        fig.colorbar(image, ax=ax, label="tokens")
    fig.suptitle(f"Top-1 expert transitions over {int(rows['tokens'].sum())} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    entropy = float(np.mean(rows["path_entropy"]))
    return f"<p>mean path entropy per window: {entropy:.3f} nats</p>"


def _dimension_chart(plt: Any, rows: npt.NDArray[np.void], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(rows["layer"], rows["dimension"], s=14, alpha=0.5, label="window")
    layers, means = per_layer_means(rows, "dimension")
    ax.plot(layers, means, "o-", color="black", label="mean")
    ax.set_xlabel("layer")
    ax.set_ylabel("TwoNN intrinsic dimension")
    ax.set_xticks(layers)
    ax.legend()
    ax.set_title("Intrinsic dimension of hidden states per layer")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "".join(
        f"<tr><td>{layer}</td><td>{d:.2f}</td></tr>" for layer, d in zip(layers, means, strict=True)
    ).join(["<table><tr><th>layer</th><th>intrinsic dimension</th></tr>", "</table>"])


_Chart = Callable[[Any, npt.NDArray[np.void], Path], str]
CHARTS: tuple[tuple[str, str, Layout, str, _Chart], ...] = (
    (qk.DEFAULT.spectra_layout, "qk_by_layer.png", qk.SIGNALS.outputs[0],
     "Q/K spectra per layer", _qk_chart),
    (experts.DEFAULT.output, "expert_load.png", experts.SIGNALS.outputs[0],
     "Expert load", _load_chart),
    (pathways.DEFAULT.output, "pathway_transitions.png", pathways.SIGNALS.outputs[0],
     "Pathway transitions", _pathway_chart),
    (twonn.DEFAULT.output, "intrinsic_dimension.png", twonn.SIGNALS.outputs[0],
     "Intrinsic dimension", _dimension_chart),
)  # fmt: skip


def write_report(transport: Transport, out: Path, *, prefix: str = "") -> list[Path]:
    """Charts for every signal table found (``prefix`` + default name) and
    ``out/index.html``; returns the files written.  No table with rows:
    :class:`NoSignalTables`, naming those missing and those empty; ``out``
    is made only once there is a chart to write in it, so a report that
    fails before that leaves nothing behind."""
    plt = _pyplot()
    written: list[Path] = []
    sections = []
    missing: list[str] = []
    empty: list[str] = []
    for name, filename, layout, title, draw in CHARTS:
        table = prefix + name
        if not _exists(transport, table):
            missing.append(table)
            continue
        rows = load_rows(transport, table, layout)
        if len(rows) == 0:
            empty.append(table)
            sections.append(f"<h2>{html.escape(title)}</h2><p>table {table} is empty</p>")
            continue
        out.mkdir(parents=True, exist_ok=True)
        numbers = draw(plt, rows, out / filename)
        written.append(out / filename)
        sections.append(
            f"<h2>{html.escape(title)}</h2><p>from table <code>{html.escape(table)}</code>, "
            f"{len(rows)} rows</p><img src='{filename}' alt='{html.escape(title)}'>{numbers}"
        )
    if not written:
        raise NoSignalTables(transport.description, missing, empty)
    index = out / "index.html"
    index.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>taproute signals</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        "img{max-width:100%}td,th{padding:2px 10px;text-align:right}</style></head><body>"
        f"<h1>taproute signals</h1><p>{html.escape(transport.description)}</p>"
        + "".join(sections)
        + "</body></html>\n"
    )
    written.append(index)
    return written
