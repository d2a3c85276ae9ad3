"""Recovery fine-tuning: held-out perplexity of a 0.3-pruned model before and after LoRA (merged).

Usage: python -m benchmarks.recovery [--model DIR] [--steps 80]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, write


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--ratio", type=float, default=0.3)
    args = parser.parse_args()
    from pipprune.pip_core import io, schedule
    from pipprune.pip_core.perplexity import perplexity
    from pipprune.pip_core.recovery import recover_lora

    model, tok = io.load(args.model)
    pairs, texts = calibration_pairs(args.model, 32, seed=0)
    held = [json.loads(line)["text"] for line in open(args.model / "tasks" / "persuasion.jsonl")][:30]
    dense = perplexity(model, tok, held)["perplexity"]
    schedule.prune_iteratively(model, tok, "pip", "width", args.ratio, 2, pairs=pairs, texts=texts, progress=False)
    pruned = perplexity(model, tok, held)["perplexity"]
    train = [json.loads(line)["text"] for line in open(args.model / "calibration" / "calibration.jsonl")]
    start = time.perf_counter()
    model, report = recover_lora(model, tok, train, steps=args.steps, progress=False)
    seconds = time.perf_counter() - start
    recovered = perplexity(model, tok, held)["perplexity"]
    row = {"ratio": args.ratio, "unit": "width", "method": "pip", "steps": args.steps, "dense_ppl": dense,
           "pruned_ppl": pruned, "recovered_ppl": recovered, "lora_seconds": seconds}
    print(row)
    table = [f"# Recovery fine-tuning ({args.model.name}, PIP width pruning at {args.ratio}, LoRA r=8, merged)", "",
             "| dense ppl | pruned ppl | after LoRA ppl | steps | seconds |", "|---|---|---|---|---|",
             f"| {dense:.1f} | {pruned:.1f} | {recovered:.1f} | {args.steps} | {seconds:.0f} |"]
    print(write("recovery", {"row": row}, table))


if __name__ == "__main__":
    main()
