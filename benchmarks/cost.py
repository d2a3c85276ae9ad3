"""Cost of PIP scoring against its physical limit, across model sizes spanning >10x.

The limit is the two forward+backward passes a pair inherently needs (one per view). Peak memory
is reported relative to the weights. Each size runs in a fresh subprocess so peak RSS is its own.
Usage: python -m benchmarks.cost [--pairs 12]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, write

SIZES = {"h128-L4": (128, 4, 4, 2, 344), "h256-L6": (256, 6, 8, 4, 688), "h512-L8": (512, 8, 8, 4, 1376),
         "h1024-L8": (1024, 8, 16, 4, 2752)}


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(size: str, pairs_n: int) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pip_core import importance, units
    from pip_core.importance import _batch, _encode, per_sequence_loss

    hidden, layers, heads, kv, inter = SIZES[size]
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                                         tie_word_embeddings=True)).eval()
    pairs, _ = calibration_pairs(DEFAULT_MODEL, pairs_n, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    weights_mb = n_params * 4 / 2**20
    found = units.discover(model, "width")
    importance.score(model, "pip", found, tokenizer=tok, pairs=pairs[:2], progress=False)  # warm-up
    rss_before = _rss_mb()
    start = time.perf_counter()
    importance.score(model, "pip", found, tokenizer=tok, pairs=pairs, progress=False)
    t_pip = time.perf_counter() - start
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra_mb = max(0.0, peak_after - rss_before)  # upper bound: the process peak may predate scoring
    originals = _encode(tok, [p[0] for p in pairs], 128)
    perturbed = _encode(tok, [p[1] for p in pairs], 128)
    start = time.perf_counter()
    for a, b in zip(originals, perturbed):
        for seq in (a, b):  # the physical limit: one forward+backward per view
            model.zero_grad(set_to_none=True)
            ids, mask = _batch([seq], 0, torch.device("cpu"))
            per_sequence_loss(model, ids, mask).sum().backward()
    t_limit = time.perf_counter() - start
    return {"size": size, "params": n_params, "weights_mb": weights_mb, "pairs": len(pairs),
            "pip_seconds": t_pip, "two_pass_seconds": t_limit, "cost_ratio": t_pip / t_limit,
            "peak_extra_mb": extra_mb, "peak_over_weights": (weights_mb + extra_mb) / weights_mb}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--one", default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.pairs)))
        return
    rows = []
    for size in SIZES:
        out = subprocess.run([sys.executable, "-m", "benchmarks.cost", "--one", size, "--pairs", str(args.pairs)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    table = ["# Cost of one PIP scoring pass (width units: attention groups + MLP channels)", "",
             "Limit = two forward+backward passes per pair (one per view); peak = (weights + extra RSS during "
             "scoring) / weights.", "",
             "| model | params | pip s | two-pass s | cost / limit | peak / weights |", "|---|---|---|---|---|---|"]
    table += [f"| {r['size']} | {r['params']:,} | {r['pip_seconds']:.2f} | {r['two_pass_seconds']:.2f} | "
              f"{r['cost_ratio']:.2f} | {r['peak_over_weights']:.2f} |" for r in rows]
    print(write("cost", {"rows": rows}, table))


if __name__ == "__main__":
    main()
