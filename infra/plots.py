"""The run's two plots, built as matplotlib figures so tests can check what a reader sees.

- `quality_curve`: held-out perplexity against parameters removed (%), the dense model as a
  reference line, every point labelled with its step (recovery included).
- `unit_scores`: one step's per-unit scores along depth; removed units and protected layers marked.

Tick labels come from small locators (at most ~8 per axis) with short formatters, so they never
overlap whatever the model size; `tests/test_plots.py` checks their window extents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # the backend must be chosen first
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

#: axis label of the quality curve; lower perplexity is better
QUALITY_METRIC = "heldout_perplexity"


def quality_curve(history: list[dict[str, Any]], metric: str = QUALITY_METRIC) -> Figure:
    """Quality after each step against the share of parameters removed; row 0 is the dense model."""
    dense = history[0]
    total = float(dense["num_params"])
    xs = [100.0 * (total - float(h["num_params"])) / total for h in history]
    ys = [float(h.get(metric, float("nan"))) for h in history]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.axhline(ys[0], color="0.45", linestyle="--", linewidth=1, label=f"dense model ({ys[0]:.2f})")
    ax.plot(xs, ys, marker="o", color="tab:blue", label="after each step")
    for i, (x, y, row) in enumerate(zip(xs, ys, history, strict=True)):
        if i == 0:
            continue
        name = "recovery" if row.get("stage") == "recovery" or "recovery_seconds" in row else f"step {row['iteration']}"
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.xaxis.set_major_formatter(PercentFormatter(decimals=0 if max(xs) >= 6 else 1))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.set_xlim(left=min(0.0, min(xs)) - 0.5, right=max(xs) * 1.15 + 0.5)
    ax.set_xlabel("parameters removed")
    ax.set_ylabel("held-out perplexity (lower is better)" if metric == QUALITY_METRIC else metric)
    ax.set_title(f"Quality vs compression ({int(total):,} parameters dense)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def unit_scores(table: pd.DataFrame, title: str, protect_first: int = 0, protect_last: int = 0) -> Figure:
    """Per-unit importance along depth: kept, removed (red x) and protected layers (grey band).

    `table` is a step's validated score table (columns layer, index, score, selected). Units of
    one layer are spread across [layer - 0.4, layer + 0.4] so channels and heads stay visible.
    """
    layers = sorted(int(v) for v in table["layer"].unique())
    num_layers = max(layers) + 1 if layers else 0
    index = table["index"].fillna(0.0)
    per_layer = table.assign(_i=index).groupby("layer")["_i"].transform("max").fillna(0.0) + 1.0
    position = table["layer"] + (index + 0.5) / per_layer * 0.8 - 0.4
    position = position.where(table["index"].notna(), table["layer"].astype(float))
    fig, ax = plt.subplots(figsize=(8.0, 3.8))
    protected = sorted(set(range(min(protect_first, num_layers))) |
                       set(range(max(0, num_layers - protect_last), num_layers)))
    for n, layer in enumerate(protected):
        ax.axvspan(layer - 0.5, layer + 0.5, color="0.85", zorder=0, label="protected layer" if n == 0 else None)
    kept, gone = ~table["selected"].astype(bool), table["selected"].astype(bool)
    ax.scatter(position[kept], table["score"][kept], s=8, color="tab:blue", label="kept", zorder=2)
    ax.scatter(position[gone], table["score"][gone], s=22, color="tab:red", marker="x", label="removed", zorder=3)
    ax.set_xlim(-0.6, max(num_layers - 0.4, 0.6))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    ax.set_xlabel("layer")
    ax.set_ylabel("importance score")
    ax.set_title(f"{title}: {int(gone.sum())} of {len(table)} units removed", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def save(fig: Figure, out: Path) -> Path:
    """Write `fig` as PNG and free it."""
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def serving_speed(dense: dict[str, Any], pruned: dict[str, Any], ideal: float) -> Figure:
    """Decode tokens/s of the dense and the pruned model at each batch size, with the ideal speedup's bar."""
    batches = [b["batch"] for b in dense["batches"]]
    xs = range(len(batches))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    d = [b["decode_tokens_per_s"] for b in dense["batches"]]
    p = [b["decode_tokens_per_s"] for b in pruned["batches"]]
    ax.bar([x - 0.2 for x in xs], d, width=0.4, color="0.6", label="dense")
    ax.bar([x + 0.2 for x in xs], p, width=0.4, color="tab:blue", label="pruned")
    ax.scatter([x + 0.2 for x in xs], [v * ideal for v in d], marker="_", s=400, color="tab:red",
               label=f"ideal (x{ideal:.2f}: 1 / (1 - FLOP cut))", zorder=3)
    ax.set_xticks(list(xs), [f"batch {b}" for b in batches])
    ax.set_ylabel(f"decode tokens/s ({dense['backend']}, {dense['device']})")
    ax.yaxis.set_major_locator(MaxNLocator(8))
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig
