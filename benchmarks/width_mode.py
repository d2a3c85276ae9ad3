"""What per-layer widths buy over uniform widths: same model, scores, ratio and seeds; only the cut differs.

Uniform widths save as the family's stock config (any engine loads them); per-layer widths need
pipprune's modeling file. Metrics as the fraction of the unpruned model's (as in `quality`).
Usage: python -m benchmarks.width_mode [--model DIR] [--ratios 0.2] [--seeds 0,1,2] [--limit 300]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, write
from benchmarks.quality import evaluate

MODES = ("uniform", "per_layer")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--ratios", default="0.2")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--method", default="pip")
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from pip_core import io, schedule

    base, tokenizer = io.load(args.model)
    scratch = Path(tempfile.mkdtemp())
    dense = evaluate(base, tokenizer, args.model, args.limit, scratch)
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            pairs, texts = calibration_pairs(args.model, args.pairs, seed)
            for mode in MODES:
                model = copy.deepcopy(base)
                options = schedule.ScoringOptions(args.method, "width", width_mode=mode)
                result = schedule.prune_iteratively(model, tokenizer, options, ratio, args.iterations, pairs=pairs,
                                                    texts=texts, seed=seed, progress=False)
                metrics = evaluate(model, tokenizer, args.model, args.limit, scratch)
                stock = not (scratch / "m" / "modeling_pipprune.py").exists()
                row = {"ratio": ratio, "mode": mode, "seed": seed, "achieved_ratio": result.achieved_ratio,
                       "stock_config": stock, **metrics, "cloze_retained": metrics["cloze_acc"] / dense["cloze_acc"],
                       "ppl_ratio": metrics["word_perplexity"] / dense["word_perplexity"]}
                rows.append(row)
                print(row, flush=True)
    summary = []
    for ratio in sorted({r["ratio"] for r in rows}):
        for mode in MODES:
            sel = [r for r in rows if r["ratio"] == ratio and r["mode"] == mode]
            summary.append({"ratio": ratio, "mode": mode, "seeds": len(sel),
                            "stock_config": all(r["stock_config"] for r in sel),
                            "achieved_ratio": statistics.mean(r["achieved_ratio"] for r in sel),
                            "cloze_retained": statistics.mean(r["cloze_retained"] for r in sel),
                            "ppl_ratio": statistics.mean(r["ppl_ratio"] for r in sel)})
    table = [f"# Width mode: uniform vs per-layer ({args.model.name}, {args.method}, dense cloze acc "
             f"{dense['cloze_acc']:.3f}, word ppl {dense['word_perplexity']:.1f}, limit {args.limit})", "",
             "| target | width mode | seeds | stock config | removed | cloze acc retained | word ppl / dense |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {s['ratio']:.1f} | {s['mode']} | {s['seeds']} | {s['stock_config']} | {s['achieved_ratio']:.3f} | "
              f"{s['cloze_retained']:.3f} | {s['ppl_ratio']:.2f} |" for s in summary]
    print(write("width_mode", {"dense": dense, "args": vars(args), "runs": rows, "summary": summary}, table))


if __name__ == "__main__":
    main()
