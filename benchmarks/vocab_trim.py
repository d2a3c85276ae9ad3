"""Vocabulary trimming on the real model: `pipprune trim-vocab --model <the SmolLM2 GGUF> --corpus public`.

What it keeps (tokens, parameters), that the kept corpus encodes as before (the command checks every text; this
re-checks a sample), and what it costs on English the corpus does not hold: the general held-out set (Persuasion,
left out of the corpus) and WordNet's definitions (modern and technical English, never in the corpus), measured in
nats per byte, so a text that now encodes in more pieces is compared fairly.
Each window is predicted whole, after the start token, by the dense model and by the trimmed one (fp32).
Writes benchmarks/results/vocab_trim.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write
from benchmarks.vocab_budget import doc_nats, per_byte

#: issue 49: perplexity on English held-out text changes by less than 1%
MAX_PPL_CHANGE = 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=256, help="general-set windows measured")
    parser.add_argument("--wordnet-docs", type=int, default=100, help="WordNet documents measured")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.divergence import wordnet_documents
    from benchmarks.first_run import default_model
    from infra.eval_kit import eval_kit
    from infra.model_source import local_model_dir
    from infra.vocab_source import corpus_texts, read_trim_record
    from pip_core.vocab_trim import VocabTrim

    torch.set_num_threads(max(1, torch.get_num_threads()))
    gguf = default_model()
    out = Path(tempfile.mkdtemp(prefix="pipprune-vocab-")) / "trimmed"
    argv = [str(Path(sys.executable).with_name("pipprune")), "trim-vocab", "--model", str(gguf), "--corpus", "public",
            "--out", str(out)]
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-3000:]}")
    record = read_trim_record(out)
    trim = VocabTrim(tuple(record["kept_ids"]), record["vocab_before"])
    dense_dir = Path(local_model_dir(str(gguf)))
    dense_tok, small_tok = AutoTokenizer.from_pretrained(dense_dir), AutoTokenizer.from_pretrained(out)
    from infra.settings import Settings

    _, corpus = corpus_texts("public", Settings().home / "cache")
    sample = corpus[:: max(1, len(corpus) // 2000)]
    exact = all(small_tok(t, add_special_tokens=False)["input_ids"]
                == trim.remap(dense_tok(t, add_special_tokens=False)["input_ids"]) for t in sample)
    sets = {"Persuasion": eval_kit().general_set(dense_tok).texts()[: args.windows],
            "WordNet": wordnet_documents(args.wordnet_docs)}
    start = dense_tok.convert_tokens_to_ids("<|endoftext|>")
    figures: dict[str, dict] = {name: {} for name in sets}
    params = {}
    for arm, folder, tok, first in (("dense", dense_dir, dense_tok, start),
                                    ("trimmed", out, small_tok, trim.mapping[start])):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        params[arm] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        for name, texts in sets.items():
            docs = doc_nats(model, tok, texts, first)
            figures[name][arm] = {"nats_per_byte": per_byte(docs), "bytes": sum(d[1] for d in docs),
                                  "tokens": sum(d[2] for d in docs)}
        del model
    for f in figures.values():
        f["perplexity_change"] = math.exp((f["trimmed"]["nats_per_byte"] - f["dense"]["nats_per_byte"])
                                          * f["dense"]["bytes"] / f["dense"]["tokens"]) - 1
    met = exact and all(abs(f["perplexity_change"]) < MAX_PPL_CHANGE for f in figures.values())
    result = {"command": argv, "seconds": round(seconds, 1), "record": {k: v for k, v in record.items()
                                                                       if k != "kept_ids"},
              "corpus_sample_texts": len(sample), "round_trip_exact": exact,
              "documents": {name: len(texts) for name, texts in sets.items()}, "params": params,
              "figures": figures, "target": {"max_perplexity_change": MAX_PPL_CHANGE, "met": met}}
    table = [
        "## Vocabulary trimming: `pipprune trim-vocab --model SmolLM2-135M-Instruct.Q4_1.gguf --corpus public`", "",
        f"{record['corpus_texts']:,} texts of {record['corpus']}; {seconds:.0f} s on {subprocess.getoutput('nproc')} "
        "cores.", "",
        "| figure | dense | trimmed |", "|---|---|---|",
        f"| vocabulary | {record['vocab_before']:,} | {record['vocab_after']:,} |",
        f"| parameters | {record['params_before']:,} | {record['params_after']:,} "
        f"({1 - record['params_after'] / record['params_before']:.1%} fewer) |",
    ]
    for name, f in figures.items():
        table += [f"| {name}, {len(sets[name])} documents: tokens | {f['dense']['tokens']:,} | "
                  f"{f['trimmed']['tokens']:,} |",
                  f"| {name}: nats per byte (perplexity change) | {f['dense']['nats_per_byte']:.4f} | "
                  f"{f['trimmed']['nats_per_byte']:.4f} ({f['perplexity_change']:+.2%}) |"]
    table += [
        "",
        f"Round trip: {len(sample)} corpus texts re-encoded, {'all' if exact else 'NOT all'} the same tokens "
        f"renumbered (the command checks all {record['corpus_texts']:,}). Perplexity change per byte, expressed per "
        f"dense token, on text the corpus does not hold (target: under {MAX_PPL_CHANGE:.0%} on each set: "
        f"{'met' if met else 'missed'}). Kept ids sha256 {record['kept_sha256'][:16]}.",
    ]
    shutil.rmtree(out.parent)  # the trimmed copy (~0.5 GB) was only measured
    print(write("vocab_trim", result, table))


if __name__ == "__main__":
    main()
