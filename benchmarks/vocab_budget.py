"""Vocabulary + width against width alone at the same ratio (issue 49): two compress runs as a user types them.

`pipprune compress --model <the SmolLM2 GGUF> --ratio 0.2 --out A` and the same with `--vocab-corpus public --out B`,
each in a fresh PIPPRUNE_HOME (benchmarks.first_run's harness), then the dense model, A and B measured on text
none of them was scored, trimmed or trained on: the general held-out set (Persuasion windows, left out of the
`public` corpus) and WordNet definitions. The models tokenize differently (B drops tokens), so each document is
predicted whole after the start token and scored in nats per UTF-8 byte; a ratio "per dense token" is
exp(delta nats per byte x bytes per dense token), the perplexity ratio the dense tokenization would show. The
verdict pairs the documents: B - A in nats per byte with a 95% bootstrap interval.
Writes benchmarks/results/vocab_budget.{json,md}.

Usage: python -m benchmarks.vocab_budget [--ratio 0.2] [--windows 256] [--wordnet-docs 100]
       [--reuse DIR [--rerun vocab+width]]  (measure an earlier invocation's outputs, rerunning the arms named)
       [--options "--align 1 --calibration DIR" --name vocab_budget_align1]  (both arms get the options)
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import write

ARMS = {"width": [], "vocab+width": ["--vocab-corpus", "public"]}
RUNS_FILE = "runs.json"
N_BOOT = 2000


def doc_nats(model, tokenizer, texts: list[str], start: int) -> list[tuple[float, int, int]]:
    """(nats, UTF-8 bytes, tokens) of each text, predicted whole after `start`."""
    import torch

    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([[start, *tokenizer(text, add_special_tokens=False)["input_ids"]]])
            logits = model(input_ids=ids).logits[0, :-1].float()
            nats = float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            out.append((nats, len(text.encode("utf-8")), ids.shape[1] - 1))
    return out


def per_byte(docs: list[tuple[float, int, int]]) -> float:
    return sum(d[0] for d in docs) / sum(d[1] for d in docs)


def paired(a: list[tuple[float, int, int]], b: list[tuple[float, int, int]], seed: int = 0) -> dict:
    """b - a in nats per byte over the same documents, with a 95% bootstrap interval (documents resampled)."""
    import numpy as np

    nats_a, nats_b = np.array([d[0] for d in a]), np.array([d[0] for d in b])
    size = np.array([d[1] for d in a], dtype=float)
    point = float((nats_b.sum() - nats_a.sum()) / size.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(N_BOOT, len(a)))
    boot = (nats_b[idx].sum(1) - nats_a[idx].sum(1)) / size[idx].sum(1)
    low, high = (float(x) for x in np.percentile(boot, [2.5, 97.5]))
    verdict = "better" if high < 0 else "worse" if low > 0 else "no difference"
    return {"point": point, "low": low, "high": high, "verdict": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--windows", type=int, default=256, help="general-set (Persuasion) windows measured")
    parser.add_argument("--wordnet-docs", type=int, default=100)
    parser.add_argument("--reuse", type=Path, default=None, help="the temporary directory of an earlier invocation: "
                        "measure its two outputs again without rerunning them")
    parser.add_argument("--options", default="", help="compress options both arms get (one string, shell-split)")
    parser.add_argument("--name", default="vocab_budget", help="results file name (benchmarks/results/NAME.{json,md})")
    parser.add_argument("--rerun", action="append", choices=list(ARMS), default=[],
                        help="with --reuse: run this arm afresh (after a change that only it sees) and reuse the other")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.divergence import wordnet_documents
    from benchmarks.first_run import default_model, run_command, stop_stack
    from infra.eval_kit import eval_kit
    from infra.model_source import local_model_dir
    from infra.vocab_source import cached_copy_dir
    from pip_core.io import model_fingerprint

    gguf = default_model()
    runs = json.loads((args.reuse / RUNS_FILE).read_text()) if args.reuse else {}
    fresh = [arm for arm in ARMS if not args.reuse or arm in args.rerun]
    if fresh:
        root = Path(tempfile.mkdtemp(prefix="pipprune-vocab-budget-"))
        for arm in fresh:
            home = root / arm.replace("+", "_")
            home.mkdir()
            out = home / "out"
            try:
                argv, wall, summary, log = run_command(gguf, args.ratio, home, [*ARMS[arm], *shlex.split(args.options),
                                                                                  "--out", str(out)])
            finally:
                stop_stack(home)
            runs[arm] = {"argv": argv, "wall_s": wall, "out": str(out), "summary": summary, "log": log,
                         "home": str(home)}
            print(f"{arm}: {wall:.0f} s, {summary['params_before']:,} -> {summary['params_after']:,} parameters",
                  flush=True)
        (root / RUNS_FILE).write_text(json.dumps(runs))
    dense_dir = Path(local_model_dir(str(gguf)))
    dense_tok = AutoTokenizer.from_pretrained(dense_dir)
    sets = {"persuasion": eval_kit().general_set(dense_tok).texts()[: args.windows],
            "wordnet": wordnet_documents(args.wordnet_docs)}
    start_text = "<|endoftext|>" if "<|endoftext|>" in dense_tok.get_vocab() else dense_tok.bos_token
    docs: dict[str, dict[str, list]] = {}
    vocab = runs["vocab+width"]["summary"]["vocab"]
    trimmed = cached_copy_dir(model_fingerprint(dense_dir), vocab["corpus_sha256"],
                              Path(runs["vocab+width"]["home"]) / "cache")
    models = (("dense", dense_dir), ("vocabulary alone", trimmed), *((arm, Path(run["out"])) for arm, run in runs.items()))
    for name, folder in models:
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        start = tok.convert_tokens_to_ids(start_text)
        docs[name] = {s: doc_nats(model, tok, texts, start) for s, texts in sets.items()}
        del model
    figures = {}
    for s in sets:
        dense = docs["dense"][s]
        bytes_per_token = sum(d[1] for d in dense) / sum(d[2] for d in dense)
        figures[s] = {"documents": len(dense), "bytes": sum(d[1] for d in dense),
                      "dense_tokens": sum(d[2] for d in dense), "dense_nats_per_byte": per_byte(dense)}
        for arm in ("vocabulary alone", *runs):
            npb = per_byte(docs[arm][s])
            figures[s][arm] = {"nats_per_byte": npb, "tokens": sum(d[2] for d in docs[arm][s]),
                               "ppl_ratio": math.exp((npb - per_byte(dense)) * bytes_per_token)}
        figures[s]["vocab+width - width"] = paired(docs["width"][s], docs["vocab+width"][s])
    result = {"ratio": args.ratio, "options": args.options, "model": str(gguf),
              "runs": {arm: {k: v for k, v in run.items() if k != "summary"} | {"summary": _summary_figures(run["summary"])}
                       for arm, run in runs.items()},
              "figures": figures, "nproc": subprocess.getoutput("nproc")}
    print(write(args.name, result, table(result)))


def _summary_figures(summary: dict) -> dict:
    """What each run's own summary says: parameters, its vocabulary record, its verdict and general-set figures."""
    keys = ("params_before", "params_after", "achieved_ratio", "vocab", "quality", "stage_seconds", "peak_rss_bytes")
    return {k: summary.get(k) for k in keys} | {"general_ppl_ratio": summary["metrics_after"].get("general_ppl_ratio")}


def table(result: dict) -> list[str]:
    runs, figures = result["runs"], result["figures"]
    vocab = runs["vocab+width"]["summary"]["vocab"] or {}
    out = [f"## Vocabulary + width against width alone at ratio {result['ratio']:g} (SmolLM2-135M-Instruct GGUF)", "",
           "`pipprune compress --model SmolLM2-135M-Instruct.Q4_1.gguf --ratio "
           f"{result['ratio']:g}{(' ' + result['options']) if result.get('options') else ''}` with and without "
           "`--vocab-corpus public`, defaults otherwise; each output measured on "
           "held-out text in nats per byte (the tokenizers differ), shown as the perplexity ratio to the dense model "
           "per dense token; the verdict pairs documents (95% bootstrap interval of the difference in nats per byte).",
           "", "| | vocabulary alone (no pruning) | width alone | vocabulary + width |", "|---|---|---|---|"]
    w, v = runs["width"]["summary"], runs["vocab+width"]["summary"]
    alone = (f"{vocab['params_before']:,} -> {vocab['params_after']:,} "
             f"({1 - vocab['params_after'] / vocab['params_before']:.1%})") if vocab else ""
    out.append(f"| parameters | {alone} | {w['params_before']:,} -> {w['params_after']:,} ({w['achieved_ratio']:.1%}) | "
               f"{v['params_before']:,} -> {v['params_after']:,} ({v['achieved_ratio']:.1%}) |")
    if vocab:
        out.append(f"| vocabulary | {vocab['vocab_after']:,} | {vocab['vocab_before']:,} | {vocab['vocab_after']:,} "
                   f"({vocab['params_before'] - vocab['params_after']:,} parameters) |")
    for s, f in figures.items():
        label = {"persuasion": f"Persuasion ({f['documents']} windows)",
                 "wordnet": f"WordNet ({f['documents']} documents)"}[s]
        alone = f"{f['vocabulary alone']['ppl_ratio']:.3f}" if "vocabulary alone" in f else ""
        out.append(f"| {label}: perplexity ratio to dense | {alone} | {f['width']['ppl_ratio']:.3f} | "
                   f"{f['vocab+width']['ppl_ratio']:.3f} |")
    out.append(f"| the run's verdict | | {w['quality'].get('verdict')} | {v['quality'].get('verdict')} |")
    out.append(f"| wall time | | {runs['width']['wall_s'] / 60:.1f} min | {runs['vocab+width']['wall_s'] / 60:.1f} min |")
    if len({Path(run["home"]).parent for run in runs.values()}) > 1:
        out += ["", "The two arms ran in separate invocations (`--reuse` with `--rerun`): their wall times are of "
                    "different moments of the machine."]
    for s, f in figures.items():
        if "vocabulary alone" in f:
            more = f["vocabulary alone"]["tokens"] / f["dense_tokens"] - 1
            out += ["", f"{s}: the trimmed tokenizer needs {more:+.1%} tokens (words the kept corpus never used, now "
                        f"split into pieces the model rarely saw), and the trim alone changes perplexity by "
                        f"{f['vocabulary alone']['ppl_ratio'] - 1:+.1%}."]
    out += ["", "| held-out | vocabulary + width - width alone, nats per byte | verdict |", "|---|---|---|"]
    for s, f in figures.items():
        d = f["vocab+width - width"]
        out.append(f"| {s} | {d['point']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] | {d['verdict']} |")
    return out


if __name__ == "__main__":
    main()
