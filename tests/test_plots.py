"""The run's plots render readable: labelled axes, the dense reference line, marked units, no overlapping ticks."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from infra import plots


def _tick_overlaps(fig) -> list[str]:
    """Pairs of visible tick labels (per axis) whose rendered window extents intersect."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        for name, labels in (("x", ax.get_xticklabels()), ("y", ax.get_yticklabels())):
            shown = [t for t in labels if t.get_visible() and t.get_text()]
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in shown]
            for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
                if a.overlaps(b):
                    found.append(f"{name}: {ta!r} overlaps {tb!r}")
    return found


def _history(total: int, steps: int, recovery: bool = False) -> list[dict]:
    rows = [{"iteration": 0, "num_params": total, "heldout_perplexity": 40.0}]
    for i in range(1, steps + 1):
        rows.append({"iteration": i, "num_params": int(total * (1 - 0.2 * i / steps)),
                     "heldout_perplexity": 40.0 + 7.3 * i})
    if recovery:
        rows.append({"iteration": steps + 1, "num_params": rows[-1]["num_params"], "heldout_perplexity": 45.0,
                     "recovery_seconds": 3.0})
    return rows


def _table(layers: int, per_layer: int, kind: str, protect: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for layer in range(layers):
        for j in range(per_layer):
            rows.append({"unit_id": f"{kind}:{layer}:{j}", "kind": kind, "layer": layer,
                         "index": float(j) if kind != "block" else np.nan, "num_params": 100,
                         "score": float(rng.gamma(2.0, 1e-4)), "rank": 0, "selected": False})
    table = pd.DataFrame(rows)
    eligible = table[(table["layer"] >= protect) & (table["layer"] < layers - protect)]
    table.loc[eligible.nsmallest(max(1, len(eligible) // 5), "score").index, "selected"] = True
    return table


@pytest.mark.parametrize("total,steps,recovery", [(3_250_000, 2, False), (8_030_000_000, 8, True), (70_000, 1, False)])
def test_quality_curve_is_readable(total, steps, recovery):
    fig = plots.quality_curve(_history(total, steps, recovery))
    ax = fig.axes[0]
    assert _tick_overlaps(fig) == []
    assert ax.get_xlabel() == "parameters removed" and "perplexity" in ax.get_ylabel()
    assert all(t.get_text().endswith("%") for t in ax.get_xticklabels() if t.get_text())
    dense = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dense) == 1 and set(dense[0].get_ydata()) == {40.0}, "the dense model's value as a reference line"
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted([f"step {i}" for i in range(1, steps + 1)] + (["recovery"] if recovery else []))
    plots.save(fig, __import__("pathlib").Path("/dev/null"))


@pytest.mark.parametrize("layers,per_layer,kind,protect", [(4, 1, "block", 1), (32, 1, "block", 2),
                                                            (32, 8, "attn", 1), (80, 64, "mlp", 1)])
def test_unit_scores_marks_removed_and_protected(layers, per_layer, kind, protect):
    table = _table(layers, per_layer, kind, protect)
    fig = plots.unit_scores(table, "step 1", protect, protect)
    ax = fig.axes[0]
    assert _tick_overlaps(fig) == []
    handles, names = ax.get_legend_handles_labels()
    assert {"kept", "removed", "protected layer"} <= set(names)
    bands = [p for p in ax.patches]  # axvspan patches: one per protected layer
    assert len(bands) == 2 * protect
    removed = ax.collections[1]  # scatter order: kept, then removed
    assert len(removed.get_offsets()) == int(table["selected"].sum())
    assert f"{int(table['selected'].sum())} of {len(table)} units removed" in ax.get_title()


def test_overlap_check_can_fail():
    """The checker itself: raw parameter counts on a narrow axis (the old plot) do overlap."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([3_250_000, 3_000_000, 2_600_000], [1, 2, 3])
    ax.ticklabel_format(style="plain")
    ax.set_xticks(np.linspace(2_600_000, 3_250_000, 12))
    assert _tick_overlaps(fig)
    plt.close(fig)
