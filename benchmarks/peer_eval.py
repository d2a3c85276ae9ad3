"""Score externally pruned models (the Torch-Pruning peer) with the same lm-eval tasks as benchmarks.quality.

Each model dir must hold the `peer_report.json` written by benchmarks/peer_torch_pruning.py.
Results go to benchmarks/results/peer.{json,md}, relative to the dense model and to the PIP
width runs of benchmarks/results/quality.json on the same model.

Usage: python -m benchmarks.peer_eval --model DIR PRUNED_DIR [PRUNED_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, RESULTS, write
from benchmarks.quality import score_dir
from infra.layout import model_dir_layout


def _ours(ratio: float) -> dict[str, dict[str, float]]:
    """Mean retained figures per width method at `ratio` from the quality benchmark, if it ran."""
    path = RESULTS / "quality.json"
    if not path.is_file():
        return {}
    runs = [r for r in json.loads(path.read_text())["runs"] if r["unit"] == "width" and abs(r["ratio"] - ratio) < 1e-9]
    methods = sorted({r["method"] for r in runs})
    return {m: {"cloze_retained": statistics.mean(r["cloze_retained"] for r in runs if r["method"] == m),
                "ppl_ratio": statistics.mean(r["ppl_ratio"] for r in runs if r["method"] == m),
                "seeds": sum(r["method"] == m for r in runs)} for m in methods}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the dense source model")
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("pruned", type=Path, nargs="+")
    args = parser.parse_args()
    tasks = model_dir_layout(args.model).tasks
    dense = score_dir(args.model, tasks, args.limit)
    rows = []
    for pruned in args.pruned:
        report = json.loads((pruned / "peer_report.json").read_text())
        metrics = score_dir(pruned, tasks, args.limit)
        rows.append({**report, **metrics, "cloze_retained": metrics["cloze_acc"] / dense["cloze_acc"],
                     "ppl_ratio": metrics["word_perplexity"] / dense["word_perplexity"]})
        print(rows[-1], flush=True)
    table = [f"# External peer: Torch-Pruning ({args.model.name}, dense cloze acc {dense['cloze_acc']:.3f}, "
             f"word ppl {dense['word_perplexity']:.1f}, limit {args.limit})", "",
             "| target | peer | width ratio | removed | cloze acc retained | word ppl / dense | "
             "PIP width (quality.json): cloze retained, ppl / dense |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        ours = _ours(row["target_ratio"]).get("pip")
        mine = f"{ours['cloze_retained']:.3f}, {ours['ppl_ratio']:.2f} ({ours['seeds']} seeds)" if ours else "not run"
        scope = "+".join((["heads"] if row.get("prune_heads", True) else []) + ["MLP"]
                         + (["hidden"] if row["prune_hidden"] else []))
        table.append(f"| {row['target_ratio']:.1f} | torch-pruning {row['torch_pruning']} ({scope}) | "
                     f"{row['width_ratio']:.3f} | {row['achieved_ratio']:.3f} | {row['cloze_retained']:.3f} | "
                     f"{row['ppl_ratio']:.2f} | {mine} |")
    print(write("peer", {"dense": dense, "runs": rows}, table))


if __name__ == "__main__":
    main()
