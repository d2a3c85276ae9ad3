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

The recovery curve: `--steps 10,20,40` runs every recovery at each budget (separate runs from the same
pruned weights: a budget's learning-rate schedule spans its own steps), `--method block_influence
--unit block` prunes with the method the quality grid supports, `--cloze-limit 100` adds WordNet cloze
accuracy (lm-eval, retained fraction of dense), `--resume FILE` keeps finished runs (a long curve on a
real model is finished over several runs) and `--name` names the result; the JSON gains a `curve` (KL,
perplexity ratio and cloze retained against recovery tokens) and NAME.png plots it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import DEFAULT_MODEL, calibration_pairs, write
from benchmarks.quality import evaluate
from infra.layout import model_dir_layout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--steps", default="80", help="recovery steps; --compare: a comma list of budgets")
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
    parser.add_argument("--method", default="pip", help="--compare: pruning method (pip, block_influence, taylor, ...)")
    parser.add_argument("--pairs", type=int, default=32, help="--compare: calibration pairs of the pruning")
    parser.add_argument("--cloze-limit", type=int, default=0,
                        help="--compare: WordNet cloze items per model (lm-eval; 0: off)")
    parser.add_argument("--variants", default="none,lora_lm,kd_lora,kd_full",
                        help="--compare: the recoveries run (a comma list of none, lora_lm, kd_lora, kd_full)")
    parser.add_argument("--resume", type=Path, default=None, help="--compare: JSONL of finished recovery runs")
    parser.add_argument("--calibration", default="corpus", choices=("corpus", "self"),
                        help="--compare: pruning pairs and training texts from the reference corpus, or sampled from "
                             "the dense model itself (--train-texts of them)")
    parser.add_argument("--train-texts", type=int, default=256, help="--compare --calibration self: texts to train on")
    parser.add_argument("--name", default="recovery_compare", help="--compare: result name")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
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
    held = [json.loads(line)["text"] for line in open(model_dir_layout(args.model).heldout)][:30]
    stages = {"dense": {"token_ppl": perplexity(model, tok, held)["perplexity"],
                        **evaluate(model, tok, args.model, args.limit, scratch)}}
    schedule.prune_iteratively(model, CalibrationData(tok, pairs, texts=texts), schedule.ScoringOptions("pip", args.unit),
                               args.ratio, 2, progress=False)
    stages["pruned"] = {"token_ppl": perplexity(model, tok, held)["perplexity"],
                        **evaluate(model, tok, args.model, args.limit, scratch)}
    train = [json.loads(line)["text"] for line in open(model_dir_layout(args.model).calibration)]
    start = time.perf_counter()
    model, report = recover_lora(model, tok, train, RecoveryOptions(steps=int(args.steps), progress=False))
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


def budgets(steps: str | int) -> list[int]:
    """The recovery budgets of --steps ('80' or '10,20,40'), ascending."""
    values = sorted({int(v) for v in str(steps).split(",") if v.strip()})
    if not values or values[0] < 1:
        raise SystemExit(f"--steps needs positive step counts, got {steps!r}")
    return values


def chosen(names: str) -> list[tuple]:
    """The VARIANTS named in --variants ('none,lora_lm'), in VARIANTS' order."""
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {v[0] for v in VARIANTS}
    if unknown or not wanted:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; use a comma list of {', '.join(v[0] for v in VARIANTS)}")
    return [v for v in VARIANTS if v[0] in wanted]


def run_label(run: dict) -> str:
    """A run's row: its variant, and its budget when the result sweeps several (`kd_lora@40`)."""
    return run["variant"] if run["variant"] == "none" or run.get("steps") is None else f"{run['variant']}@{run['steps']}"


def at_budget(label: str, variant: str) -> str:
    """The row of `variant` at the same budget as `label` (`kd_lora@40` -> `lora_lm@40`; `kd_lora` -> `lora_lm`)."""
    _, at, steps = label.partition("@")
    return variant + at + steps


def _resume_config(args: argparse.Namespace) -> dict:
    """Everything besides (variant, seed, steps) that changes a recovery run's figures."""
    from benchmarks.divergence import model_identity

    keys = ("ratio", "unit", "method", "iterations", "pairs", "batch_size", "max_length", "lr", "full_lr", "temperature",
            "heldout", "cloze_limit")
    extra = {} if args.calibration == "corpus" else {"calibration": args.calibration, "train_texts": args.train_texts}
    return {**extra, "model": model_identity(Path(args.model)), **{k: getattr(args, k) for k in keys}}


def _load_runs(path: Path | None, config: dict) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if path and path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else None
            if record and record["config"] == config:
                done[record["key"]] = record["run"]
    return done


def compare(args: argparse.Namespace) -> None:
    """Prune once, then each recovery from the same pruned weights and the same batches; KL + ppl with intervals."""
    import copy

    from benchmarks.divergence import heldout_texts
    from pip_core import io, schedule
    from pip_core.importance import CalibrationData
    from pip_core.self_calibration import SamplingOptions, sampled_texts

    seeds, steps_list, variants = [int(s) for s in args.seeds.split(",")], budgets(args.steps), chosen(args.variants)
    config = _resume_config(args)
    done = _load_runs(args.resume, config)
    scratch = Path(tempfile.mkdtemp())
    dense, tok = io.load(args.model, dtype="float32")
    dense_cloze = _cloze(dense, tok, args, scratch) if args.cloze_limit else None
    pairs, texts = calibration_pairs(args.model, args.pairs, 0, None, args.calibration, dense, tok)
    pruned = copy.deepcopy(dense)
    schedule.prune_iteratively(pruned, CalibrationData(tok, pairs, texts=texts),
                               schedule.ScoringOptions(args.method, args.unit), args.ratio, args.iterations, progress=False)
    sets = {name: heldout_texts(args.model, name) for name in args.heldout.split(",")}
    if args.calibration == "self":  # distillation on the dense model's own texts, as --calibration self trains
        train = sampled_texts(dense, tok, SamplingOptions(n=args.train_texts, new_tokens=args.max_length, seed=1))
    else:
        train = [json.loads(line)["text"] for line in open(model_dir_layout(args.model).calibration)]
    held = {t for texts_, _ in sets.values() for t in texts_}
    train = [t for t in train if t not in held]
    bench = Bench(args, dense, pruned, tok, train, sets, scratch)
    runs = []
    for seed in seeds:
        for steps in steps_list:
            for name, kind, params in variants:
                if name == "none" and (seed != seeds[0] or steps != steps_list[0]):
                    continue  # no training: the same model for every seed and budget
                key = f"{name}|{seed}|{steps}"
                if key not in done:
                    done[key] = bench.run(name, kind, params, seed, steps)
                    if args.resume:
                        with args.resume.open("a") as fh:
                            fh.write(json.dumps({"key": key, "config": config, "run": done[key]}) + "\n")
                run = done[key]
                runs.append(run)
                print(f"{run_label(run)} seed {seed}: {run['train_seconds']:.0f} s, " + ", ".join(
                    f"{k} KL {_stats(run, k).metrics()['kl']:.4f}" for k in sets), flush=True)
                # written after every run: a run cut short still leaves every figure measured so far
                payload = {"args": vars(args), "params_dense": io.param_count(dense),
                           "params_pruned": io.param_count(pruned), "dense_cloze_acc": dense_cloze, "runs": runs,
                           "summary": summarise(runs, list(sets))}
                payload["curve"] = curve(payload)
                path = write(args.name, payload, compare_table(payload))
    if len(steps_list) > 1:
        plot_curve(payload, path.with_suffix(".png"))
    print(path)


@dataclass
class Bench:
    """What every recovery of one --compare run shares: the dense and pruned models, the training and held-out
    texts."""

    args: argparse.Namespace
    dense: object  # nn.Module
    pruned: object
    tok: object
    train: list[str]
    sets: dict
    scratch: Path

    def run(self, name: str, kind: str | None, params: str | None, seed: int, steps: int) -> dict:
        """One recovery of a copy of the pruned model and its held-out figures (and cloze accuracy when asked)."""
        import copy

        from pip_core.divergence import doc_stats
        from pip_core.recovery import RecoveryOptions, recover_kd, recover_lora

        args, model = self.args, copy.deepcopy(self.pruned)
        start = time.perf_counter()
        report = None
        options = RecoveryOptions(steps=steps, lr=args.lr, batch_size=args.batch_size, max_length=args.max_length,
                                  seed=seed, progress=False)
        if kind == "lora":
            model, report = recover_lora(model, self.tok, self.train, options)
        elif kind == "kd":
            options = dataclasses.replace(options, kd_params=params, temperature=args.temperature,
                                          lr=args.lr if params == "lora" else args.full_lr)
            model, report = recover_kd(model, self.dense, self.tok, self.train, options)
        seconds = time.perf_counter() - start
        run = {"variant": name, "seed": seed, "steps": steps if kind else 0, "train_seconds": seconds,
               "tokens": report.tokens if report else 0, "first_loss": report.first_loss if report else None,
               "last_loss": report.last_loss if report else None, "heldout": {}}
        for set_name, (texts_, digest) in self.sets.items():
            stats = doc_stats(self.dense, model, self.tok, texts_, max_length=256)
            run["heldout"][set_name] = {"sha256": digest, "docs": stats.to_json()}
        if args.cloze_limit:
            run["cloze_acc"] = _cloze(model, self.tok, args, self.scratch)
        return run


def _cloze(model, tok, args: argparse.Namespace, scratch: Path) -> float:
    """WordNet cloze accuracy (lm-eval, the reference build's local task) on --cloze-limit items."""
    from benchmarks.quality import CLOZE, saved
    from infra.lmeval import run_lmeval

    out = saved(model, tok, scratch)
    return float(run_lmeval(out, [CLOZE], include_path=model_dir_layout(args.model).tasks, limit=args.cloze_limit)[CLOZE]["acc"])


def curve(payload: dict) -> list[dict]:
    """Per recovery and budget, on the first held-out set: tokens trained, KL, perplexity ratio (points pooled over
    seeds) and cloze accuracy retained (mean over seeds, when measured)."""
    main = next(iter(payload["summary"]))
    rows = []
    for label, row in payload["summary"][main]["variants"].items():
        mine = [r for r in payload["runs"] if run_label(r) == label]
        cloze = [r["cloze_acc"] for r in mine if r.get("cloze_acc") is not None]
        dense_cloze = payload.get("dense_cloze_acc")
        rows.append({"recovery": label, "variant": mine[0]["variant"], "steps": mine[0].get("steps", 0),
                     "tokens": statistics.mean(r["tokens"] for r in mine), "kl": row["kl"]["point"],
                     "ppl_ratio": row["ppl_ratio"]["point"],
                     "cloze_acc": statistics.mean(cloze) if cloze else None,
                     "cloze_retained": statistics.mean(cloze) / dense_cloze if cloze and dense_cloze else None,
                     "train_seconds": statistics.mean(r["train_seconds"] for r in mine), "heldout": main})
    return rows


def plot_curve(payload: dict, path: Path) -> Path:
    """KL and perplexity ratio against recovery tokens, one line per recovery kind (no recovery: a flat line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["curve"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "kl", "KL(dense || model), nats/token"), (axes[1], "ppl_ratio", "perplexity / dense")):
        base = next((r[metric] for r in rows if r["variant"] == "none"), None)
        for variant in [v for v, _, _ in VARIANTS if v != "none"]:
            points = sorted((r["tokens"], r[metric]) for r in rows if r["variant"] == variant)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=LABELS[variant])
        if base is not None:
            ax.axhline(base, color="grey", linestyle="--", label="no recovery")
        if metric == "ppl_ratio":
            ax.axhline(1.5, color="red", linestyle=":", label="target 1.5")
        ax.set_xlabel("recovery tokens")
        ax.set_title(f"{title} ({rows[0]['heldout']})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
            by.setdefault(run_label(r), []).append(_stats(r, heldout))
        rows = {}
        for name, stats in by.items():
            row = {"seeds": len(stats)}
            for metric in ("kl", "ppl_pruned", "ppl_ratio"):
                row[metric] = bootstrap.interval(stats, metric, n_boot).as_dict()
            rows[name] = row
        verdicts = []
        pairs = [(v, "none") for v in by if v != "none"]
        pairs += [(v, at_budget(v, "lora_lm")) for v in by if v.startswith("kd") and at_budget(v, "lora_lm") in by]
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
    tokens = {run_label(r): r["tokens"] for r in payload["runs"] if r["seed"] == payload["runs"][0]["seed"]}
    seconds = {}
    for r in payload["runs"]:
        seconds.setdefault(run_label(r), []).append(r["train_seconds"])
    budget = sorted({t for v, t in tokens.items() if v != "none"})
    method = args.get("method", "pip")
    lines = [f"# Recovery: no recovery vs LoRA (LM loss) vs distillation ({Path(args['model']).name}, "
             f"{'PIP' if method == 'pip' else method} {args['unit']} pruning at {args['ratio']} in "
             f"{args['iterations']} steps, "
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
            for b, against in (("none", "none"), ("lora_lm", at_budget(name, "lora_lm"))):
                for m, fmt in (("kl", "+.4f"), ("ppl_pruned", "+.2f")):
                    v = verdicts.get((name, against, m))
                    vs[b, m] = f"{v['verdict']} ({v['diff']['point']:{fmt}})" if v else "-"
            secs = statistics.mean(seconds[name])
            variant, _, steps = name.partition("@")
            label = LABELS.get(variant, variant) + (f", {steps} steps" if steps else "")
            lines.append(f"| {label} | {cells['kl']} | {cells['ppl_pruned']} | "
                         f"{row['ppl_ratio']['point']:.3f} | {secs:.0f} | {vs['none', 'kl']} | {vs['none', 'ppl_pruned']} | "
                         f"{vs['lora_lm', 'kl']} | {vs['lora_lm', 'ppl_pruned']} |")
        lines.append("")
    rows = payload.get("curve") or []
    if any(r["steps"] for r in rows) and len({r["steps"] for r in rows if r["steps"]}) > 1:
        dense = payload.get("dense_cloze_acc")
        lines += [f"Recovery curve ({rows[0]['heldout']}; cloze: WordNet, {args.get('cloze_limit')} items, dense "
                  f"{dense if dense is None else f'{dense:.3f}'}; plot: {args.get('name', 'recovery_compare')}.png):",
                  "", "| recovery | steps | tokens | KL | ppl / dense | cloze retained | train s |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["variant"], r["steps"])):
            cloze = "-" if r["cloze_retained"] is None else f"{r['cloze_retained']:.1%}"
            lines.append(f"| {LABELS.get(r['variant'], r['variant'])} | {r['steps']} | {r['tokens']:,.0f} | "
                         f"{r['kl']:.4f} | {r['ppl_ratio']:.3f} | {cloze} | {r['train_seconds']:.0f} |")
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
