"""Recovery fine-tuning after pruning.

Default mode: a 0.3-pruned model before and after LoRA (merged), as retained fractions of dense.
Same tasks as benchmarks.quality (WordNet cloze accuracy, Persuasion word perplexity), plus the
token perplexity on held-out Persuasion paragraphs. LoRA trains on the calibration texts only.
Usage: python -m benchmarks.recovery [--model DIR] [--steps 80] [--ratio 0.3] [--unit width]

`--compare`: no recovery vs LoRA on the LM loss vs distillation from the dense model (KD through
LoRA adapters, KD on every weight), at the same token budget (the same batches of calibration
texts, drawn with the same seeds), on one pruned model. Reported: KL(dense || model) per token and
perplexity on held-out text, with 95% paired-bootstrap intervals over documents (pooled over the
recovery seeds) and verdicts of each recovery against no recovery and KD against LoRA.
Usage: python -m benchmarks.recovery --compare --model DIR [--steps 80] [--seeds 0,1]
       [--heldout persuasion,wordnet] (writes recovery_compare.json / .md)
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    parser.add_argument("--compare", action="store_true", help="no recovery vs LoRA (LM loss) vs KD, with intervals")
    parser.add_argument("--iterations", type=int, default=2, help="--compare: pruning steps")
    parser.add_argument("--seeds", default="0,1", help="--compare: recovery seeds (batch draws, adapter init)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3, help="--compare: LoRA learning rate (LM loss and KD)")
    parser.add_argument("--full-lr", type=float, default=2e-4, help="--compare: full-weight KD learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="--compare: KD temperature")
    parser.add_argument("--heldout", default="persuasion,wordnet", help="--compare: held-out sets (first = main)")
    args = parser.parse_args()
    if args.compare:
        compare(args)
        return
    from pip_core import io, schedule
    from pip_core.importance import CalibrationData
    from pip_core.perplexity import perplexity
    from pip_core.recovery import RecoveryOptions, recover_lora

    scratch = Path(tempfile.mkdtemp())
    model, tok = io.load(args.model)
    pairs, texts = calibration_pairs(args.model, 32, seed=0)
    held = [json.loads(line)["text"] for line in open(args.model / "tasks" / "persuasion.jsonl")][:30]
    stages = {"dense": {"token_ppl": perplexity(model, tok, held)["perplexity"],
                        **evaluate(model, tok, args.model, args.limit, scratch)}}
    schedule.prune_iteratively(model, CalibrationData(tok, pairs, texts=texts), schedule.ScoringOptions("pip", args.unit),
                               args.ratio, 2, progress=False)
    stages["pruned"] = {"token_ppl": perplexity(model, tok, held)["perplexity"],
                        **evaluate(model, tok, args.model, args.limit, scratch)}
    train = [json.loads(line)["text"] for line in open(args.model / "calibration" / "calibration.jsonl")]
    start = time.perf_counter()
    model, report = recover_lora(model, tok, train, RecoveryOptions(steps=args.steps, progress=False))
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


#: the compared recoveries: (name, kind, weights trained)
VARIANTS = (("none", None, None), ("lora_lm", "lora", "lora"), ("kd_lora", "kd", "lora"), ("kd_full", "kd", "full"))
LABELS = {"none": "no recovery", "lora_lm": "LoRA, LM loss", "kd_lora": "KD, LoRA", "kd_full": "KD, full weights"}
N_BOOT = 2000


def compare(args: argparse.Namespace) -> None:
    """Prune once, then each recovery from the same pruned weights and the same batches; KL + ppl with intervals."""
    import copy

    from benchmarks.divergence import heldout_texts
    from pip_core import io, schedule
    from pip_core.divergence import doc_stats
    from pip_core.importance import CalibrationData
    from pip_core.recovery import RecoveryOptions, recover_kd, recover_lora

    seeds = [int(s) for s in args.seeds.split(",")]
    dense, tok = io.load(args.model, dtype="float32")
    pairs, texts = calibration_pairs(args.model, 32, seed=0)
    pruned = copy.deepcopy(dense)
    schedule.prune_iteratively(pruned, CalibrationData(tok, pairs, texts=texts), schedule.ScoringOptions("pip", args.unit),
                               args.ratio, args.iterations, progress=False)
    sets = {name: heldout_texts(args.model, name) for name in args.heldout.split(",")}
    train = [json.loads(line)["text"] for line in open(args.model / "calibration" / "calibration.jsonl")]
    held = {t for texts_, _ in sets.values() for t in texts_}
    train = [t for t in train if t not in held]
    runs = []
    for seed in seeds:
        for name, kind, params in VARIANTS:
            if name == "none" and seed != seeds[0]:
                continue  # no training: the same model for every seed
            model = copy.deepcopy(pruned)
            start = time.perf_counter()
            report = None
            if kind == "lora":
                model, report = recover_lora(model, tok, train, RecoveryOptions(
                    steps=args.steps, lr=args.lr, batch_size=args.batch_size, max_length=args.max_length, seed=seed,
                    progress=False))
            elif kind == "kd":
                model, report = recover_kd(model, dense, tok, train, RecoveryOptions(
                    steps=args.steps, kd_params=params, lr=args.lr if params == "lora" else args.full_lr,
                    batch_size=args.batch_size, max_length=args.max_length, temperature=args.temperature, seed=seed,
                    progress=False))
            seconds = time.perf_counter() - start
            run = {"variant": name, "seed": seed, "train_seconds": seconds,
                   "tokens": report.tokens if report else 0,
                   "first_loss": report.first_loss if report else None,
                   "last_loss": report.last_loss if report else None, "heldout": {}}
            for set_name, (texts_, digest) in sets.items():
                stats = doc_stats(dense, model, tok, texts_, max_length=256)
                run["heldout"][set_name] = {"sha256": digest, "docs": stats.to_json()}
            runs.append(run)
            print(f"{name} seed {seed}: {seconds:.0f} s, " + ", ".join(
                f"{k} KL {_stats(run, k).metrics()['kl']:.4f}" for k in sets), flush=True)
            # written after every run: a run cut short still leaves every figure measured so far
            payload = {"args": vars(args), "params_dense": io.param_count(dense),
                       "params_pruned": io.param_count(pruned), "runs": runs, "summary": summarise(runs, list(sets))}
            path = write("recovery_compare", payload, compare_table(payload))
    print(path)


def _stats(run: dict, heldout: str):  # pip_core.divergence.DocStats
    from pip_core.divergence import DocStats

    return DocStats.from_json(run["heldout"][heldout]["docs"])


def summarise(runs: list[dict], heldouts: list[str], n_boot: int = N_BOOT) -> dict:
    """Per held-out set: each variant's KL / ppl / ppl ratio with 95% intervals (pooled over seeds, paired over
    documents) and verdicts of each recovery against no recovery and of KD against LoRA on the LM loss."""
    from pip_core import bootstrap

    out = {}
    for heldout in heldouts:
        by = {}
        for r in runs:
            by.setdefault(r["variant"], []).append(_stats(r, heldout))
        rows = {}
        for name, stats in by.items():
            row = {"seeds": len(stats)}
            for metric in ("kl", "ppl_pruned", "ppl_ratio"):
                row[metric] = bootstrap.interval(stats, metric, n_boot).as_dict()
            rows[name] = row
        verdicts = []
        pairs = [(v, "none") for v in by if v != "none"] + [(v, "lora_lm") for v in by if v.startswith("kd")]
        for a, b in pairs:
            for metric in ("kl", "ppl_pruned"):
                diff = bootstrap.paired_difference(by[a], by[b], metric, n_boot)
                verdicts.append({"a": a, "b": b, "metric": metric, "diff": diff.as_dict(),
                                 "verdict": bootstrap.verdict(diff)})
        out[heldout] = {"variants": rows, "verdicts": verdicts, "documents": len(by["none"][0].tokens),
                        "tokens": float(by["none"][0].tokens.sum())}
    return out


def compare_table(payload: dict) -> list[str]:
    """The markdown of a --compare run, computed from its JSON (benchmarks.report re-renders it from the file)."""
    args = payload["args"]
    tokens = {r["variant"]: r["tokens"] for r in payload["runs"] if r["seed"] == payload["runs"][0]["seed"]}
    seconds = {}
    for r in payload["runs"]:
        seconds.setdefault(r["variant"], []).append(r["train_seconds"])
    budget = sorted({t for v, t in tokens.items() if v != "none"})
    lines = [f"# Recovery: no recovery vs LoRA (LM loss) vs distillation ({Path(args['model']).name}, PIP "
             f"{args['unit']} pruning at {args['ratio']} in {args['iterations']} steps, "
             f"{payload['params_dense']:,} -> {payload['params_pruned']:,} parameters)", "",
             f"Same token budget for every recovery: {args['steps']} steps x {args['batch_size']} calibration texts "
             f"of up to {args['max_length']} tokens ({', '.join(f'{t:,}' for t in budget)} tokens per seed; the "
             f"same batches for every kind), seeds {args['seeds']}; LoRA r=8 at lr {args['lr']:g} (LM loss and KD), "
             f"full-weight KD at lr {args['full_lr']:g}, KD temperature {args['temperature']:g}. KL(dense || model) "
             "per token and perplexity on held-out text the models never trained on; mean over seeds with a 95% "
             "paired bootstrap over documents (2000 resamples). Verdicts: the interval of the paired difference "
             "excludes 0 (lower is better).", ""]
    if payload.get("note"):
        lines += [f"Note: {payload['note']}", ""]
    for heldout, s in payload["summary"].items():
        lines += [f"Held-out **{heldout}** ({s['documents']} documents, {s['tokens']:,.0f} predicted tokens):", "",
                  "| recovery | KL to dense [95%] | perplexity [95%] | ppl / dense | train s | vs none: KL | vs none: ppl "
                  "| vs LoRA LM loss: KL | vs LoRA LM loss: ppl |", "|---|---|---|---|---|---|---|---|---|"]
        verdicts = {(v["a"], v["b"], v["metric"]): v for v in s["verdicts"]}
        for name, row in s["variants"].items():
            cells = {m: f"{row[m]['point']:{fmt}} [{row[m]['low']:{fmt}}, {row[m]['high']:{fmt}}]"
                     for m, fmt in (("kl", ".4f"), ("ppl_pruned", ".2f"))}
            vs = {}
            for b in ("none", "lora_lm"):
                for m, fmt in (("kl", "+.4f"), ("ppl_pruned", "+.2f")):
                    v = verdicts.get((name, b, m))
                    vs[b, m] = f"{v['verdict']} ({v['diff']['point']:{fmt}})" if v else "-"
            secs = statistics.mean(seconds[name])
            lines.append(f"| {LABELS.get(name, name)} | {cells['kl']} | {cells['ppl_pruned']} | "
                         f"{row['ppl_ratio']['point']:.3f} | {secs:.0f} | {vs['none', 'kl']} | {vs['none', 'ppl_pruned']} | "
                         f"{vs['lora_lm', 'kl']} | {vs['lora_lm', 'ppl_pruned']} |")
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
