"""External peer: Torch-Pruning's LLM width pruning, run on the same model to the same parameter reduction.

Runs in its own environment (`make peer-venv`: torch 2.13, transformers 4.55.4, torch-pruning
1.5.2): torch-pruning 1.6.x loops forever building the dependency graph of a GQA Llama
(VainF/Torch-Pruning#527, seen here in get_all_groups), 1.5.2 does not; its LLM example targets
transformers 4.x while pipprune needs >= 4.56. It imports neither pipprune nor anything
beyond torch, transformers and torch_pruning; the pruned model is saved as an ordinary HF
directory and scored by `benchmarks.peer_eval` in the main environment with the same lm-eval
tasks as `benchmarks.quality`.

Method, as in Torch-Pruning's examples/LLMs/prune_llm.py: uniform (local) pruning of attention
heads, MLP channels and the hidden size with GroupMagnitudeImportance (L2, mean over the group),
lm_head ignored, head dims kept (RoPE). Torch-Pruning takes a width ratio, not a parameter
ratio, so the width ratio is found by bisection until the removed-parameter fraction is
closest to the target. On the small reference (6 query heads over 2 KV heads) TP's head grouping
fails (it views the 64 KV channels as 6 groups), so heads stay and hidden + MLP are pruned; the
report records that.

Usage: .venv-peer/bin/python benchmarks/peer_torch_pruning.py --model DIR --ratio 0.2 --out DIR
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import shutil
import time
from pathlib import Path

import torch


def prune_width(model, tokenizer, width_ratio: float, prune_hidden: bool, prune_heads: bool = True):
    """Prune a deep copy of `model` with Torch-Pruning's LLM recipe; returns the pruned copy.

    `prune_heads=False` leaves attention untouched (q/k/v never roots): the fallback when TP's
    GQA head grouping fails on the model's head counts.
    """
    import torch_pruning as tp

    model = copy.deepcopy(model)
    config = model.config
    example = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    num_heads = {}
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            num_heads[module.q_proj] = config.num_attention_heads
            num_heads[module.k_proj] = config.num_key_value_heads
            num_heads[module.v_proj] = config.num_key_value_heads
    ignored = [model.lm_head]
    if not prune_heads:
        num_heads = {}
        ignored += [m for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj"))]
    if not prune_hidden:  # keep the residual width: only heads and MLP channels go
        ignored += [model.model.embed_tokens, model.model.norm]
        ignored += [m for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))]
    pruner = tp.pruner.BasePruner(
        model, example_inputs=example, importance=tp.importance.GroupMagnitudeImportance(p=2, group_reduction="mean"),
        global_pruning=False, output_transform=lambda out: out.logits, pruning_ratio=width_ratio,
        ignored_layers=ignored, num_heads=num_heads, prune_num_heads=prune_heads, prune_head_dims=False,
        head_pruning_ratio=width_ratio,
        round_to=config.num_attention_heads)  # HF requires hidden_size % num_heads == 0 (TP's example: 4)
    for group in pruner.step(interactive=True):
        group.prune()
    _sync_config(model)
    return model


def _sync_config(model) -> None:
    """Write the pruned shapes back into the config and the attention modules (as the TP example does)."""
    config = model.config
    config.hidden_size = model.lm_head.in_features
    if config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        # TP prunes the two modules separately, leaving two (equal) tensors: tie them again
        if not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
            raise RuntimeError("Torch-Pruning pruned the tied embedding and LM head differently")
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            head_dim = module.head_dim
            q_heads = module.q_proj.out_features // head_dim
            kv_heads = module.k_proj.out_features // head_dim
            config.num_attention_heads, config.num_key_value_heads = q_heads, kv_heads
            config.head_dim = head_dim
            if hasattr(module, "num_key_value_groups"):
                module.num_key_value_groups = q_heads // kv_heads
        elif name.endswith("mlp"):
            config.intermediate_size = module.gate_proj.out_features


def param_count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def check_forward(model, tokenizer) -> float:
    """Loss on a sentence: a pruned model that no longer runs must fail here, not in evaluation."""
    ids = torch.tensor([tokenizer.encode("It is a truth universally acknowledged, that a single man.")])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ratio", type=float, required=True, help="target fraction of parameters removed")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--keep-hidden", action="store_true", help="prune only heads and MLP channels")
    args = parser.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    # the tokenizer config is written by transformers 5; 4.55 reads the tokenizer.json itself
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(args.model / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    total = param_count(model)
    started = time.perf_counter()
    lo, hi, best = 0.0, 0.9, None
    prune_heads, head_error = True, None
    try:
        prune_width(model, tokenizer, 0.3, prune_hidden=not args.keep_hidden)
    except RuntimeError as exc:  # e.g. 6 query heads over 2 KV heads: TP views 64 k channels as 6 groups
        prune_heads, head_error = False, f"{type(exc).__name__}: {exc}"
        print(f"Torch-Pruning cannot prune GQA heads of this model ({head_error}); pruning hidden + MLP only")
    for _ in range(10):  # bisection on the width ratio
        mid = (lo + hi) / 2
        pruned = prune_width(model, tokenizer, mid, prune_hidden=not args.keep_hidden, prune_heads=prune_heads)
        removed = 1 - param_count(pruned) / total
        if best is None or abs(removed - args.ratio) < abs(best[1] - args.ratio):
            best = (mid, removed, pruned)
        lo, hi = (mid, hi) if removed < args.ratio else (lo, mid)
    width_ratio, removed, pruned = best
    seconds = time.perf_counter() - started
    loss = check_forward(pruned, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    pruned.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (args.model / name).is_file():  # the source's tokenizer files, byte for byte
            shutil.copy2(args.model / name, args.out / name)
    report = {"peer": "torch-pruning", "torch_pruning": importlib.metadata.version("torch-pruning"),
              "transformers": transformers.__version__,
              "torch": torch.__version__, "target_ratio": args.ratio, "achieved_ratio": removed,
              "width_ratio": width_ratio, "prune_hidden": not args.keep_hidden, "prune_heads": prune_heads,
              "head_pruning_error": head_error, "params_before": total,
              "params_after": param_count(pruned), "search_seconds": seconds, "sanity_loss": loss,
              "config": {k: getattr(pruned.config, k) for k in ("hidden_size", "num_attention_heads",
                                                                  "num_key_value_heads", "intermediate_size")}}
    (args.out / "peer_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
