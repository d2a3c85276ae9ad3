"""Serving speed of budgeted, aligned pruning: achieved parameter ratio, decode speedup, fraction of ideal, KL.

Block and uniform width pruning (PIP, 2 steps) at two ratios, width with MLP alignment 64 and 1,
each planned by `pip_core.budget` and measured by `pip_core.serving.measure` (the code the compress
flow's serving task runs) against the dense model on the same prompts.

Usage: python -m benchmarks.serving [--model DIR] [--ratios 0.2,0.3] [--name serving]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import ROOT, calibration_pairs, write
from pip_core.importance import CalibrationData


def default_model() -> Path:
    built = ROOT / ".pipprune" / "reference" / "tiny"
    if (built / "config.json").is_file():
        return built
    cached = sorted((ROOT / ".pipprune" / "test-cache").glob("tiny*/config.json"), key=lambda p: p.stat().st_mtime)
    if not cached:
        raise SystemExit("no tiny reference model: run `pipprune reference build --size tiny --out .pipprune/reference/tiny`")
    return cached[-1].parent


@torch.no_grad()
def kl_to_dense(dense, pruned, tokenizer, texts: list[str]) -> float:
    """Mean per-token KL(dense || pruned) of the next-token distributions on `texts`."""
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=128)["input_ids"]
        p = torch.log_softmax(dense(ids).logits.float(), -1)
        q = torch.log_softmax(pruned(ids).logits.float(), -1)
        total += float((p.exp() * (p - q)).sum(-1).sum())
        count += ids.shape[1]
    return total / count


def speed_row(dense, pruned, tokenizer, prompts: torch.Tensor, measure: dict, plan, unit: str, align: int,
              ratio: float) -> dict:
    """One table row: the planned cut's shapes and the pruned model's decode speed against the dense one's,
    both measured now on the same prompts (dense beside each row, so both see the same machine noise)."""
    from pip_core import serving

    base = serving.measure(dense, tokenizer, prompts, **measure)
    got = serving.measure(pruned, tokenizer, prompts, **measure)
    cmp = serving.compare(base, got)
    return {"unit": unit, "align": align if unit != "block" else None, "target_ratio": ratio,
            "achieved_ratio": plan.achieved_ratio, "params_after": plan.params_after,
            "mlp": pruned.config.intermediate_size, "kv_heads": pruned.config.num_key_value_heads,
            "layers": pruned.config.num_hidden_layers, "decode_speedup_b1": cmp.per_batch[1],
            "decode_speedup_b8": cmp.per_batch[8], "ideal_speedup": cmp.ideal_speedup,
            "fraction_of_ideal_b1": cmp.fraction_of_ideal, "dense": base.as_dict(), "pruned": got.as_dict()}


def _write(model_dir: Path, config: dict, args: argparse.Namespace, rows: list[dict]) -> Path:
    table = [f"# Serving speed of budgeted pruning ({model_dir.name}: {config['model_type']}, "
             f"intermediate {config['intermediate_size']}, CPU {torch.get_num_threads()} threads, "
             "greedy decoding with the KV cache, "
             f"{args.new_tokens} new tokens, median of {args.repeats})", "",
             "Written by `python -m benchmarks.serving` from benchmarks/results/serving.json. Decode speedup = pruned / "
             "dense decode tokens/s on the same prompts, dense measured beside each row; ideal = 1 / (1 - matmul FLOP "
             "cut). On a shared 2-core CPU timings are noisy (see the dense figures in the JSON).", "",
             "| unit | align | target | achieved ratio | MLP width | KV heads | layers | decode x (b1) | decode x (b8) "
             "| ideal x | fraction of ideal (b1) | KL to dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['unit']} | {r['align'] or '-'} | {r['target_ratio']:.2f} | {r['achieved_ratio']:.4f} | "
                     f"{r['mlp']} | {r['kv_heads']} | {r['layers']} | {r['decode_speedup_b1']:.3f} | "
                     f"{r['decode_speedup_b8']:.3f} | {r['ideal_speedup']:.3f} | {r['fraction_of_ideal_b1']:.2f} | "
                     f"{r['kl_to_dense']:.4f} |")
    return write(args.name, {"model": str(model_dir), "rows": rows}, table)


def main() -> None:
    from pip_core import io, schedule, serving
    from pip_core.budget import plan_budget
    from pip_core.rules import Selection

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--ratios", default="0.2,0.3")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="serving", help="results name (benchmarks/results/NAME.json + .md)")
    args = parser.parse_args()
    model_dir = args.model or default_model()
    config = json.loads((model_dir / "config.json").read_text())
    pairs, texts = calibration_pairs(model_dir, 16, seed=0)
    heldout = texts[-8:]
    dense, tokenizer = io.load(model_dir)
    prompts = serving.prompt_ids(tokenizer, texts, 4, 32)
    measure = dict(new_tokens=args.new_tokens, batch_sizes=(1, 8), repeats=args.repeats)
    runs = [("block", 1), ("width", 64), ("width", 1)]
    rows = []
    for ratio in [float(r) for r in args.ratios.split(",")]:
        for unit, align in runs:
            plan = plan_budget(config, f"ratio={ratio}", Selection(unit=unit, align=align), iterations=2)
            pruned, _ = io.load(model_dir)
            options = schedule.ScoringOptions("pip", unit, width_mode="uniform", align=plan.effective_align)
            schedule.prune_iteratively(pruned, CalibrationData(tokenizer, pairs), options, plan.ratio, 2, progress=False)
            rows.append({**speed_row(dense, pruned, tokenizer, prompts, measure, plan, unit, align, ratio),
                         "kl_to_dense": kl_to_dense(dense, pruned, tokenizer, heldout)})
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("dense", "pruned")}), flush=True)
            _write(model_dir, config, args, rows)  # after every row: a cut-short run still leaves its rows
    print(_write(model_dir, config, args, rows))


if __name__ == "__main__":
    main()
