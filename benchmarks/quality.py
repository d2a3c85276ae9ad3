"""Quality at equal parameter reduction: PIP vs random, magnitude, Taylor and block influence.

Same model, same calibration pairs, same seeds; metrics as the fraction of the unpruned model's.
Usage: python -m benchmarks.quality [--model DIR] [--ratios 0.1,0.2,0.3] [--seeds 0,1,2] [--limit 300]
"""

from __future__ import annotations

import copy
import logging
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, quality_grid_parser, write
from infra.layout import model_dir_layout

METHODS = {"block": ["pip", "random", "magnitude", "taylor", "block_influence"],
           "width": ["pip", "random", "magnitude", "taylor"]}
CLOZE, PPL = "pipprune_wordnet_cloze", "pipprune_persuasion"


def score_dir(model_dir: Path, tasks_dir: Path, limit: int) -> dict[str, float]:
    """Cloze accuracy and Persuasion word perplexity of a saved model (also used for external peers)."""
    from infra.lmeval import run_lmeval

    results = run_lmeval(model_dir, [CLOZE, PPL], include_path=tasks_dir, limit=limit)
    return {"cloze_acc": results[CLOZE]["acc"], "word_perplexity": results[PPL]["word_perplexity"]}


def saved(model, tokenizer, scratch: Path) -> Path:
    """`model` saved as a plain directory in `scratch` (replacing the last one), for lm-eval to load."""
    from pip_core import io

    out = scratch / "m"
    shutil.rmtree(out, ignore_errors=True)
    io.save_pruned(model, tokenizer, out)
    return out


def evaluate(model, tokenizer, model_dir: Path, limit: int, scratch: Path) -> dict[str, float]:
    return score_dir(saved(model, tokenizer, scratch), model_dir_layout(model_dir).tasks, limit)


def main() -> None:
    parser = quality_grid_parser(DEFAULT_MODEL, "0.1,0.2,0.3")
    parser.add_argument("--seeds-other-ratios", default="0")
    parser.add_argument("--units", default="block,width")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from pip_core import io, schedule
    from pip_core.importance import CalibrationData

    base, tokenizer = io.load(args.model)
    scratch = Path(tempfile.mkdtemp())
    dense = evaluate(base, tokenizer, args.model, args.limit, scratch)
    rows = []
    ratios = [float(r) for r in args.ratios.split(",")]
    for unit in args.units.split(","):
        for ratio in ratios:
            seeds = args.seeds if abs(ratio - 0.2) < 1e-9 else args.seeds_other_ratios
            for method in METHODS[unit]:
                for seed in [int(s) for s in seeds.split(",")]:
                    pairs, texts = calibration_pairs(args.model, args.pairs, seed)
                    model = copy.deepcopy(base)
                    result = schedule.prune_iteratively(model, CalibrationData(tokenizer, pairs, texts=texts),
                                                        schedule.ScoringOptions(method, unit), ratio, args.iterations,
                                                        seed=seed, progress=False)
                    metrics = evaluate(model, tokenizer, args.model, args.limit, scratch)
                    row = {"unit": unit, "ratio": ratio, "method": method, "seed": seed,
                           "achieved_ratio": result.achieved_ratio, **metrics,
                           "cloze_retained": metrics["cloze_acc"] / dense["cloze_acc"],
                           "ppl_ratio": metrics["word_perplexity"] / dense["word_perplexity"]}
                    rows.append(row)
                    print(row, flush=True)
    summary = []
    for unit in args.units.split(","):
        for ratio in ratios:
            for method in METHODS[unit]:
                sel = [r for r in rows if r["unit"] == unit and r["ratio"] == ratio and r["method"] == method]
                if sel:
                    summary.append({"unit": unit, "ratio": ratio, "method": method, "seeds": len(sel),
                                    "achieved_ratio": statistics.mean(r["achieved_ratio"] for r in sel),
                                    "cloze_retained": statistics.mean(r["cloze_retained"] for r in sel),
                                    "ppl_ratio": statistics.mean(r["ppl_ratio"] for r in sel)})
    table = [f"# Quality at equal parameter reduction ({args.model.name}, dense cloze acc "
             f"{dense['cloze_acc']:.3f}, word ppl {dense['word_perplexity']:.1f}, limit {args.limit})", "",
             "| unit | target | method | seeds | removed | cloze acc retained | word ppl / dense |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {s['unit']} | {s['ratio']:.1f} | {s['method']} | {s['seeds']} | {s['achieved_ratio']:.3f} | "
              f"{s['cloze_retained']:.3f} | {s['ppl_ratio']:.2f} |" for s in summary]
    print(write("quality", {"dense": dense, "args": vars(args), "runs": rows, "summary": summary}, table))


if __name__ == "__main__":
    main()
