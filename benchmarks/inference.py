"""Inference gain of pruned models: generation tokens/s vs the ideal 1/(1 - FLOP reduction).

Usage: python -m benchmarks.inference [--model DIR]
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, write


def flops_per_token(model) -> int:  # noqa: ANN001
    """2 x multiply-adds of every matmul a token goes through (decoder layers + LM head)."""
    layer_params = sum(p.numel() for layer in model.model.layers for _, p in layer.named_parameters()
                       if p.dim() == 2)
    head = model.lm_head.weight.numel()
    return 2 * (layer_params + head)


@torch.no_grad()
def tokens_per_second(model, batch: int, new_tokens: int = 48, repeats: int = 3) -> float:  # noqa: ANN001
    prompt = torch.randint(10, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
        best = min(best, time.perf_counter() - start)
    return batch * new_tokens / best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--ratio", type=float, default=0.2)
    args = parser.parse_args()
    from pipprune.pip_core import io, schedule

    dense, tok = io.load(args.model)
    pairs, texts = calibration_pairs(args.model, 16, seed=0)
    rows = []
    for unit in ("block", "width"):
        pruned = copy.deepcopy(dense)
        schedule.prune_iteratively(pruned, tok, "pip", unit, args.ratio, 2, pairs=pairs, texts=texts, progress=False)
        reduction = 1 - flops_per_token(pruned) / flops_per_token(dense)
        for batch in (1, 8):
            d, p = tokens_per_second(dense, batch), tokens_per_second(pruned, batch)
            ideal = 1 / (1 - reduction)
            rows.append({"unit": unit, "batch": batch, "flop_reduction": reduction, "dense_tok_s": d,
                         "pruned_tok_s": p, "speedup": p / d, "ideal": ideal, "fraction_of_ideal": (p / d) / ideal})
            print(rows[-1], flush=True)
    table = [f"# Inference gain at ratio {args.ratio} (PIP, CPU, greedy generation of 48 tokens)", "",
             "| unit | batch | FLOP reduction | dense tok/s | pruned tok/s | speedup | ideal | of ideal |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['unit']} | {r['batch']} | {r['flop_reduction']:.3f} | {r['dense_tok_s']:.0f} | "
              f"{r['pruned_tok_s']:.0f} | {r['speedup']:.2f} | {r['ideal']:.2f} | {r['fraction_of_ideal']:.0%} |"
              for r in rows]
    print(write("inference", {"rows": rows, "ratio": args.ratio}, table))


if __name__ == "__main__":
    main()
