"""Cost of PIP scoring against its physical limit, across model sizes spanning >10x, a 128k vocabulary
and bf16 weights.

The limit is the two forward+backward passes a pair inherently needs (one per view). Peak memory
is reported relative to the weights (in the row's dtype). Each row runs in a fresh subprocess so
peak RSS is its own. Inputs are self-contained (synthetic texts, a BPE tokenizer trained on them),
so the benchmark needs no reference build; the vocabulary size is the row's.
Usage: python -m benchmarks.cost [--pairs 12] [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from benchmarks.common import RESULTS, environment, write

#: name -> (hidden, layers, heads, kv heads, intermediate, vocab, seq, dtype, pairs or None for --pairs)
ROWS = {
    "h128-L4": (128, 4, 4, 2, 344, 8192, 128, "float32", None),
    "h256-L6": (256, 6, 8, 4, 688, 8192, 128, "float32", None),
    "h512-L8": (512, 8, 8, 4, 1376, 8192, 128, "float32", None),
    "h1024-L8": (1024, 8, 16, 4, 2752, 8192, 128, "float32", None),
    "h512-L8-bf16": (512, 8, 8, 4, 1376, 8192, 128, "bfloat16", None),
    "h1024-L8-bf16": (1024, 8, 16, 4, 2752, 8192, 128, "bfloat16", None),
    "h512-L8-v128k-s512": (512, 8, 8, 4, 1376, 128256, 512, "float32", 2),
    "h512-L8-v128k-s512-bf16": (512, 8, 8, 4, 1376, 128256, 512, "bfloat16", 2),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(name: str, pairs_n: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu_check import build_inputs
    from pip_core import importance, units
    from pip_core.importance import CalibrationData, _batch, _encode, per_sequence_loss

    hidden, layers, heads, kv, inter, vocab, seq, dtype, row_pairs = ROWS[name]
    pairs_n = row_pairs or pairs_n
    tok, pairs = build_inputs(pairs_n + 1, seed=0, words_per_text=max(96, seq))  # ~1.3 tokens per word
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                                         tie_word_embeddings=True)).to(getattr(torch, dtype)).eval()
    n_params = sum(p.numel() for p in model.parameters())
    weights_mb = n_params * model.dtype.itemsize / 2**20
    found = units.discover(model, "width")
    warm, pairs = pairs[:1], pairs[1:]
    importance.score(model, "pip", found, CalibrationData(tok, warm), max_length=seq, progress=False)  # warm-up
    rss_before = _rss_mb()
    start = time.perf_counter()
    importance.score(model, "pip", found, CalibrationData(tok, pairs), max_length=seq, progress=False)
    t_pip = time.perf_counter() - start
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra_mb = max(0.0, peak_after - rss_before)  # upper bound: the process peak may predate scoring
    originals = _encode(tok, [p[0] for p in pairs], seq)
    perturbed = _encode(tok, [p[1] for p in pairs], seq)
    tokens = sum(a.numel() + b.numel() for a, b in zip(originals, perturbed, strict=True))
    start = time.perf_counter()
    for a, b in zip(originals, perturbed, strict=True):
        for one in (a, b):  # the physical limit: one forward+backward per view
            model.zero_grad(set_to_none=True)
            ids, mask = _batch([one], 0, torch.device("cpu"))
            per_sequence_loss(model, ids, mask).sum().backward()
    t_limit = time.perf_counter() - start
    return {"size": name, "params": n_params, "dtype": dtype, "vocab": vocab, "seq": seq,
            "tokens_per_view": tokens / (2 * len(pairs)), "weights_mb": weights_mb, "pairs": len(pairs),
            "pip_seconds": t_pip, "two_pass_seconds": t_limit, "cost_ratio": t_pip / t_limit,
            "peak_extra_mb": extra_mb, "peak_over_weights": (weights_mb + extra_mb) / weights_mb}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--one", default=None)
    parser.add_argument("--only", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the other rows of results/cost.json (slow rows)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.pairs)))
        return
    names = args.only.split(",") if args.only else list(ROWS)
    measured = {}
    for name in names:
        out = subprocess.run([sys.executable, "-m", "benchmarks.cost", "--one", name, "--pairs", str(args.pairs)],
                             capture_output=True, text=True, check=True)
        measured[name] = {**json.loads(out.stdout.strip().splitlines()[-1]), "when": environment()["when"]}
        print(measured[name], flush=True)
    previous = json.loads((RESULTS / "cost.json").read_text())["rows"] if args.keep else []
    kept = {r["size"]: r for r in previous if r["size"] in ROWS and "when" in r}
    rows = [measured.get(name) or kept[name] for name in ROWS if name in measured or name in kept]
    table = ["# Cost of one PIP scoring pass (width units: attention groups + MLP channels)", "",
             "Limit = two forward+backward passes per pair (one per view); peak = (weights + extra RSS during "
             "scoring) / weights, weights in the row's dtype. The causal-LM loss is computed in slices of the "
             "sequence through the LM head (pip_core.chunked_loss), so no row holds a whole logits tensor.", "",
             "| model | params | dtype | vocab | tokens/view | pip s | two-pass s | cost / limit | peak / weights |",
             "|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['size']} | {r['params']:,} | {r['dtype']} | {r['vocab']:,} | {r['tokens_per_view']:.0f} | "
              f"{r['pip_seconds']:.2f} | {r['two_pass_seconds']:.2f} | {r['cost_ratio']:.2f} | "
              f"{r['peak_over_weights']:.2f} |" for r in rows]
    print(write("cost", {"rows": rows, "args": vars(args)}, table))


if __name__ == "__main__":
    main()
