"""What per-layer widths buy over uniform widths: same model, scores, ratio and seeds; only the cut differs.

Uniform widths save as the family's stock config (any engine loads them); per-layer widths need
pipprune's modeling file. Metrics as the fraction of the unpruned model's (as in `quality`), and KL to
the dense model on the reference's held-out Persuasion chunks, with paired-bootstrap 95% intervals of
per-layer minus uniform (pooled over seeds), because cloze accuracy barely moves at this scale.
Usage: python -m benchmarks.width_mode [--model DIR] [--ratios 0.2] [--seeds 0,1,2] [--limit 300]
"""

from __future__ import annotations

import copy
import logging
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, quality_grid_parser, write
from benchmarks.quality import evaluate

MODES = ("uniform", "per_layer")


def main() -> None:
    parser = quality_grid_parser(DEFAULT_MODEL, "0.2")
    parser.add_argument("--method", default="pip")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from benchmarks.divergence import N_BOOT, ci, heldout_texts
    from pip_core import bootstrap, io, schedule
    from pip_core.divergence import DocStats, doc_stats
    from pip_core.importance import CalibrationData

    base, tokenizer = io.load(args.model)
    heldout, heldout_digest = heldout_texts(args.model, "persuasion")
    scratch = Path(tempfile.mkdtemp())
    dense = evaluate(base, tokenizer, args.model, args.limit, scratch)
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            pairs, texts = calibration_pairs(args.model, args.pairs, seed)
            for mode in MODES:
                model = copy.deepcopy(base)
                options = schedule.ScoringOptions(args.method, "width", width_mode=mode)
                result = schedule.prune_iteratively(model, CalibrationData(tokenizer, pairs, texts=texts), options, ratio,
                                                    args.iterations, seed=seed, progress=False)
                metrics = evaluate(model, tokenizer, args.model, args.limit, scratch)
                stock = not (scratch / "m" / "modeling_pipprune.py").exists()
                stats = doc_stats(base, model, tokenizer, heldout)
                row = {"ratio": ratio, "mode": mode, "seed": seed, "achieved_ratio": result.achieved_ratio,
                       "stock_config": stock, **metrics, "cloze_retained": metrics["cloze_acc"] / dense["cloze_acc"],
                       "ppl_ratio": metrics["word_perplexity"] / dense["word_perplexity"],
                       "kl": stats.metrics()["kl"], "docs": stats.to_json()}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "docs"}, flush=True)
    summary = []
    for ratio in sorted({r["ratio"] for r in rows}):
        for mode in MODES:
            sel = [r for r in rows if r["ratio"] == ratio and r["mode"] == mode]
            summary.append({"ratio": ratio, "mode": mode, "seeds": len(sel),
                            "stock_config": all(r["stock_config"] for r in sel),
                            "achieved_ratio": statistics.mean(r["achieved_ratio"] for r in sel),
                            "cloze_retained": statistics.mean(r["cloze_retained"] for r in sel),
                            "ppl_ratio": statistics.mean(r["ppl_ratio"] for r in sel),
                            "kl": bootstrap.interval([DocStats.from_json(r["docs"]) for r in sel], "kl",
                                                     n_boot=N_BOOT).as_dict()})
        by_mode = {mode: [DocStats.from_json(r["docs"]) for r in sorted(rows, key=lambda r: r["seed"])
                          if r["ratio"] == ratio and r["mode"] == mode] for mode in MODES}
        diff = bootstrap.paired_difference(by_mode["per_layer"], by_mode["uniform"], "kl", n_boot=N_BOOT)
        summary[-1]["kl_diff_vs_uniform"] = {**diff.as_dict(), "verdict": bootstrap.verdict(diff)}
    table = [f"# Width mode: uniform vs per-layer ({args.model.name}, {args.method}, dense cloze acc "
             f"{dense['cloze_acc']:.3f}, word ppl {dense['word_perplexity']:.1f}, limit {args.limit})", "",
             "| target | width mode | seeds | stock config | removed | cloze acc retained | word ppl / dense "
             "| KL(dense‖pruned), held-out | per-layer − uniform KL | per-layer vs uniform |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    for s in summary:
        diff = s.get("kl_diff_vs_uniform")
        table.append(f"| {s['ratio']:.1f} | {s['mode']} | {s['seeds']} | {s['stock_config']} | {s['achieved_ratio']:.3f} | "
                     f"{s['cloze_retained']:.3f} | {s['ppl_ratio']:.2f} | {ci(s['kl'])} | "
                     f"{ci(diff) if diff else ''} | {diff['verdict'] if diff else ''} |")
    meta = {"heldout": "persuasion", "heldout_sha256": heldout_digest, "documents": len(heldout),
            "bootstrap": {"n_boot": N_BOOT, "level": 0.95, "over": "held-out documents, paired, pooled over seeds"}}
    print(write("width_mode", {"dense": dense, "args": vars(args), **meta, "runs": rows, "summary": summary}, table))


if __name__ == "__main__":
    main()
