"""Recovery fine-tuning: a 0.3-pruned model before and after LoRA (merged), as retained fractions of dense.

Same tasks as benchmarks.quality (WordNet cloze accuracy, Persuasion word perplexity), plus the
token perplexity on held-out Persuasion paragraphs. LoRA trains on the calibration texts only.
Usage: python -m benchmarks.recovery [--model DIR] [--steps 80] [--ratio 0.3] [--unit width]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, write
from benchmarks.quality import evaluate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--unit", default="width")
    parser.add_argument("--limit", type=int, default=300)
    args = parser.parse_args()
    from pip_core import io, schedule
    from pip_core.perplexity import perplexity
    from pip_core.recovery import recover_lora

    scratch = Path(tempfile.mkdtemp())
    model, tok = io.load(args.model)
    pairs, texts = calibration_pairs(args.model, 32, seed=0)
    held = [json.loads(line)["text"] for line in open(args.model / "tasks" / "persuasion.jsonl")][:30]
    stages = {"dense": {"token_ppl": perplexity(model, tok, held)["perplexity"],
                        **evaluate(model, tok, args.model, args.limit, scratch)}}
    schedule.prune_iteratively(model, tok, schedule.ScoringOptions("pip", args.unit), args.ratio, 2, pairs=pairs,
                               texts=texts, progress=False)
    stages["pruned"] = {"token_ppl": perplexity(model, tok, held)["perplexity"],
                        **evaluate(model, tok, args.model, args.limit, scratch)}
    train = [json.loads(line)["text"] for line in open(args.model / "calibration" / "calibration.jsonl")]
    start = time.perf_counter()
    model, report = recover_lora(model, tok, train, steps=args.steps, progress=False)
    seconds = time.perf_counter() - start
    stages["recovered"] = {"token_ppl": perplexity(model, tok, held)["perplexity"],
                           **evaluate(model, tok, args.model, args.limit, scratch)}
    dense = stages["dense"]
    for stage in stages.values():
        stage["cloze_retained"] = stage["cloze_acc"] / dense["cloze_acc"]
        stage["word_ppl_ratio"] = stage["word_perplexity"] / dense["word_perplexity"]
    payload = {"args": vars(args), "stages": stages, "lora_seconds": seconds, "first_loss": report.first_loss,
               "last_loss": report.last_loss}
    print(json.dumps(payload, indent=1, default=str))
    table = [f"# Recovery fine-tuning ({args.model.name}, PIP {args.unit} pruning at {args.ratio}, "
             f"LoRA r=8, {args.steps} steps, merged; {seconds:.0f} s)", "",
             "| model | token ppl (Persuasion) | word ppl / dense | cloze acc | cloze acc retained |",
             "|---|---|---|---|---|"]
    table += [f"| {name} | {s['token_ppl']:.1f} | {s['word_ppl_ratio']:.2f} | {s['cloze_acc']:.3f} | "
              f"{s['cloze_retained']:.3f} |" for name, s in stages.items()]
    print(write("recovery", payload, table))


if __name__ == "__main__":
    main()
