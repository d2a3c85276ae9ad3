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
from pip_core.importance import CalibrationData


def flops_per_token(model) -> int:
    """2 x multiply-adds of every matmul a token goes through (decoder layers + LM head)."""
    layer_params = sum(p.numel() for layer in model.model.layers for _, p in layer.named_parameters()
                       if p.dim() == 2)
    head = model.lm_head.weight.numel()
    return 2 * (layer_params + head)


@torch.no_grad()
def _generate_seconds(model, prompt: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def paired_tokens_per_second(dense, pruned, batch: int, new_tokens: int = 48,
                             repeats: int = 5) -> tuple[float, float]:
    """Best-of-`repeats` tokens/s of both models, measured alternately so machine noise hits both alike."""
    prompt = torch.randint(10, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    _generate_seconds(dense, prompt, 4), _generate_seconds(pruned, prompt, 4)  # warm-up
    best_d = best_p = float("inf")
    for _ in range(repeats):
        best_d = min(best_d, _generate_seconds(dense, prompt, new_tokens))
        best_p = min(best_p, _generate_seconds(pruned, prompt, new_tokens))
    return batch * new_tokens / best_d, batch * new_tokens / best_p


def random_llama(hidden: int, layers: int, vocab: int = 8192):
    """A random-init GQA Llama: speed depends on shapes, not on training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--large-hidden", type=int, default=1024, help="random-init model, 0 to skip")
    args = parser.parse_args()
    from pip_core import io, schedule

    dense, tok = io.load(args.model)
    pairs, texts = calibration_pairs(args.model, 16, seed=0)
    subjects = [(args.model.name, dense, "pip")]
    if args.large_hidden:  # compute-bound regime; magnitude needs no data (a random model has nothing to keep)
        subjects.append((f"random h{args.large_hidden}-L8", random_llama(args.large_hidden, 8), "magnitude"))
    rows = []
    for name, model, method in subjects:
        for unit in ("block", "width"):
            pruned = copy.deepcopy(model)
            schedule.prune_iteratively(pruned, CalibrationData(tok, pairs, texts=texts),
                                       schedule.ScoringOptions(method, unit), args.ratio, 2, progress=False)
            reduction = 1 - flops_per_token(pruned) / flops_per_token(model)
            for batch in (1, 8):
                d, p = paired_tokens_per_second(model, pruned, batch)
                ideal = 1 / (1 - reduction)
                rows.append({"model": name, "params": io.param_count(model), "method": method, "unit": unit,
                             "batch": batch, "flop_reduction": reduction, "dense_tok_s": d, "pruned_tok_s": p,
                             "speedup": p / d, "ideal": ideal, "fraction_of_ideal": (p / d) / ideal})
                print(rows[-1], flush=True)
    table = [f"# Inference gain at ratio {args.ratio} (CPU, {torch.get_num_threads()} threads, greedy generation "
             "of 48 tokens, dense and pruned timed alternately, best of 5)", "",
             "| model | params | method | unit | batch | FLOP reduction | dense tok/s | pruned tok/s | speedup | "
             "ideal | of ideal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['model']} | {r['params']:,} | {r['method']} | {r['unit']} | {r['batch']} | "
              f"{r['flop_reduction']:.3f} | {r['dense_tok_s']:.0f} | {r['pruned_tok_s']:.0f} | {r['speedup']:.2f} | "
              f"{r['ideal']:.2f} | {r['fraction_of_ideal']:.0%} |" for r in rows]
    print(write("inference", {"rows": rows, "ratio": args.ratio}, table))


if __name__ == "__main__":
    main()
