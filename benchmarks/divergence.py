"""KL to the dense model with paired-bootstrap intervals: PIP against each baseline, per unit kind and ratio.

Every run prunes a copy of the same model with the same calibration pairs and seed, then measures
KL(dense || pruned), top-1 agreement and the perplexity ratio on the reference's held-out
Persuasion chunks (never calibration text). Per-document sums are stored in the JSON, so every
interval and verdict in the table is recomputed from them (pip_core.bootstrap).
`--fresh-perturbation` redraws each step's perturbed views (same texts, a new perturbation seed per
step), which with `--iterations` = the number of blocks to remove is the paper's schedule (one block
per iteration, new perturbed texts after each removal). `--resume FILE` keeps finished runs in a
JSONL file and reuses them, so an interrupted benchmark loses at most the run in progress.
Usage: python -m benchmarks.divergence [--model DIR] [--ratios 0.1,0.2,0.3] [--units width,block]
       [--methods pip,pip_l2,...] [--pairs 32] [--iterations 2] [--rate 0.15] [--fresh-perturbation]
       [--seeds 0] [--width-mode uniform|per_layer] [--heldout persuasion,wordnet] [--resume runs.jsonl]
       [--name divergence] [--report-only]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import CALIBRATIONS, DEFAULT_MODEL, add_harness_args, calibration_pairs, write
from infra.layout import model_dir_layout
from pip_core.importance import CalibrationData

#: `pip` is one of the named forms (importance.default_form), so it is not run twice
METHODS = {"block": ["pip_l2", "pip_first_order", "pip_removal", "random", "magnitude", "taylor", "block_influence"],
           "width": ["pip_l2", "pip_first_order", "random", "magnitude", "taylor", "minitron", "wanda_sp"]}
#: what each PIP form is compared with; pip_single_view and pip_removal_single_view are the no-perturbation
#: ablations
BASELINES = ("random", "magnitude", "taylor", "block_influence", "minitron", "wanda_sp", "pip_single_view",
             "pip_removal_single_view")
N_BOOT = 2000


def wordnet_documents(n_docs: int = 100, per_doc: int = 12, seed: int = 0) -> list[str]:
    """Dictionary prose the reference never trained on: WordNet definitions ("lemma: gloss."), 12 per document."""
    import random
    import re

    from infra.reference import sources

    entries = []
    for pos in ("noun", "verb", "adj"):
        for line in (sources.WORDNET / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith(" ") or " | " not in line:
                continue
            head, _, gloss = line.partition(" | ")
            definition = re.sub(r'"[^"]*"', "", gloss).split(";")[0].strip()
            if len(definition.split()) >= 4:
                entries.append(f"{head.split()[4].replace('_', ' ')}: {definition}.")
    rng = random.Random(seed)
    picked = rng.sample(entries, n_docs * per_doc)
    return [" ".join(picked[i * per_doc:(i + 1) * per_doc]) for i in range(n_docs)]


def heldout_texts(model_dir: Path, which: str) -> tuple[list[str], str]:
    """Held-out documents ('persuasion': the reference's held-out novel chunks; 'wordnet'; or a file) + digest."""
    from pip_core.divergence import read_texts

    if which == "wordnet":
        texts = wordnet_documents()
    else:
        texts = read_texts(model_dir_layout(model_dir).heldout if which == "persuasion" else Path(which))
    return texts, hashlib.sha256("\n\x00".join(texts).encode()).hexdigest()


def metric_intervals(stats, seed: int, n_boot: int = N_BOOT) -> dict[str, dict]:  # DocStats
    """95% bootstrap interval of KL, top-1 agreement and ppl ratio over the held-out documents."""
    from pip_core import bootstrap

    return {m: bootstrap.interval(stats, m, n_boot=n_boot, seed=seed).as_dict() for m in ("kl", "top1_agreement", "ppl_ratio")}


def kl_comparison(a, b, seed: int = 0, n_boot: int = N_BOOT) -> dict:  # DocStats or lists of them
    """Paired KL difference a - b over the same documents, relative to b, and its verdict for a."""
    from pip_core import bootstrap

    diff = bootstrap.paired_difference(a, b, "kl", n_boot=n_boot, seed=seed)
    b_list = b if isinstance(b, list) else [b]
    ref = sum(s.metrics()["kl"] for s in b_list) / len(b_list)
    return {"kl_diff": diff.as_dict(), "relative": diff.point / ref, "verdict": bootstrap.verdict(diff)}


def summarise(runs: list[dict], n_boot: int = N_BOOT) -> tuple[list[dict], list[dict]]:
    """Per (unit, ratio, method): KL/agreement/ppl-ratio intervals; per PIP form vs baseline: paired verdicts."""
    from pip_core.divergence import DocStats

    summary, verdicts = [], []
    keys = sorted({(r["unit"], r["ratio"], r["seed"]) for r in runs})
    for unit, ratio, seed in keys:
        cell = {r["method"]: r for r in runs if (r["unit"], r["ratio"], r["seed"]) == (unit, ratio, seed)}
        group = {method: DocStats.from_json(r["docs"]) for method, r in cell.items()}
        for method, stats in group.items():
            removed = {"removed_layers": cell[method]["removed_layers"]} if "removed_layers" in cell[method] else {}
            summary.append({"unit": unit, "ratio": ratio, "seed": seed, "method": method,
                            **metric_intervals(stats, seed, n_boot), **removed})
        for pip in [m for m in group if m.startswith("pip") and m not in BASELINES]:
            for base in [m for m in group if m in BASELINES]:
                verdicts.append({"unit": unit, "ratio": ratio, "seed": seed, "pip": pip, "baseline": base,
                                 **kl_comparison(group[pip], group[base], seed, n_boot)})
    for unit, ratio in sorted({(r["unit"], r["ratio"]) for r in runs}):
        cell = [r for r in runs if (r["unit"], r["ratio"]) == (unit, ratio)]
        seeds = sorted({r["seed"] for r in cell})
        if len(seeds) < 2:
            continue
        by_method: dict[str, dict[int, object]] = {}
        for r in cell:
            by_method.setdefault(r["method"], {})[r["seed"]] = DocStats.from_json(r["docs"])
        for pip in [m for m in by_method if m.startswith("pip") and m not in BASELINES]:
            for base in [m for m in by_method if m in BASELINES]:
                common = sorted(set(by_method[pip]) & set(by_method[base]))  # a partial grid pools what both ran
                if len(common) < 2:
                    continue
                verdicts.append({"unit": unit, "ratio": ratio, "seed": "mean of " + ",".join(map(str, common)),
                                 "pip": pip, "baseline": base,
                                 **kl_comparison([by_method[pip][s] for s in common],
                                                 [by_method[base][s] for s in common], 0, n_boot)})
    return summary, verdicts


def fresh_pairs(model_dir: Path, n: int, seed: int, rate: float | None = None) -> Callable[[int], list[tuple[str, str]]]:
    """Pairs for step k (1-based): the same calibration texts as `calibration_pairs(model_dir, n, seed)`,
    perturbed anew at every step (step 1 gives exactly the default pairs)."""
    from pip_core.perturb import Perturber
    from pip_core.wordlist import WordList

    _, texts = calibration_pairs(model_dir, n, seed, rate)
    words = WordList.from_file(model_dir_layout(model_dir).wordlist)

    def for_step(step: int) -> list[tuple[str, str]]:
        perturber = Perturber(words, seed=seed + 10007 * (step - 1), **({} if rate is None else {"rate": rate}))
        return [(p.original, p.perturbed) for p in perturber.perturb_many(texts).pairs]
    return for_step


class _DecoderCache(nn.Module):
    """The dense decoder's last hidden state per held-out document, computed once per benchmark."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder, self.memo = decoder, {}

    def forward(self, input_ids: torch.Tensor, **kwargs: object):
        key = (tuple(input_ids.shape), hashlib.sha256(input_ids.cpu().numpy().tobytes()).hexdigest())
        if key not in self.memo:
            self.memo[key] = self.decoder(input_ids=input_ids, **kwargs).last_hidden_state.detach()
        return type("Hidden", (), {"last_hidden_state": self.memo[key]})()


class CachedDense(nn.Module):
    """`base` as doc_stats sees it (decoder, head, config), with the decoder's outputs memoised: the
    dense side of every run's KL is the same computation, so it is done once (exact, not approximated)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base, self.cache = base, _DecoderCache(base.get_decoder())
        self.config = base.config

    def get_decoder(self) -> nn.Module:
        return self.cache

    def get_output_embeddings(self) -> nn.Module:
        return self.base.get_output_embeddings()


def prune_and_measure(base, tokenizer, options, ratio: float, iterations: int,
                      pairs: list[tuple[str, str]] | Callable[[int], list[tuple[str, str]]],
                      texts: list[str], seed: int, sets: dict[str, tuple[list[str], str]], max_length: int, /,
                      dense: nn.Module | None = None, same_model: dict | None = None,
                      **labels: object) -> dict[str, dict]:
    """Prune a deep copy of `base` (schedule.prune_iteratively), then one run record per held-out set.

    The arguments are positional only, so `labels` may reuse their names (ratio=, seed=). `pairs` may be
    a function of the step (1-based) for pairs drawn anew at each step. `dense`: what KL is measured
    against (default `base`; a `CachedDense(base)` gives the same figures faster). `same_model`: for block
    units, per-document sums already measured for a set of removed layers (`removed_set_key`), reused when
    this run removes the same set (the pruned model is then the same model); new measurements are added
    to it. Each record holds
    `labels`, the metrics, the per-document sums (`docs`), the blocks removed at each step and their
    scores (block units), the pruning seconds and the seconds since pruning began (pruning plus the
    held-out sets measured so far).
    """
    from pip_core import schedule
    from pip_core.divergence import DocStats, doc_stats
    from pip_core.units import decoder_layers, param_count

    started = time.perf_counter()
    model = copy.deepcopy(base)
    total = param_count(model)
    steps, alive, removed, scores = [], list(range(len(decoder_layers(model)))), [], []
    for i, target in enumerate(schedule.plan(ratio, iterations), start=1):
        spec = schedule.step_spec(i, target, total, param_count(model), seed)
        step_pairs = pairs(i) if callable(pairs) else pairs
        report = schedule.step(model, CalibrationData(tokenizer, step_pairs, texts=texts), spec, options, total, progress=False)
        steps.append(report)
        if options.kind == "block":  # layers by their index in the source model
            scores.append({alive[u.layer]: s for u, s in zip(report.units, report.scores, strict=True)})
            gone = {u.layer for u in report.removed}
            removed.append(sorted(alive[j] for j in gone))
            alive = [layer for j, layer in enumerate(alive) if j not in gone]
    achieved = (total - param_count(model)) / total
    prune_seconds = time.perf_counter() - started
    trace = {"removed_layers": removed, "block_scores": scores} if options.kind == "block" else {}
    out = {}
    for held, (held_texts, digest) in sets.items():
        key = removed_set_key(removed, digest, max_length) if options.kind == "block" else None
        if same_model is not None and key in same_model:
            stats, reused = DocStats.from_json(same_model[key]), True
        else:
            stats = doc_stats(dense if dense is not None else base, model, tokenizer, held_texts, max_length=max_length)
            reused = False
            if same_model is not None and key is not None:
                same_model[key] = stats.to_json()
        out[held] = {**labels, "heldout": held, "achieved_ratio": achieved, **stats.metrics(), **trace,
                     "docs": stats.to_json(), "prune_seconds": prune_seconds, "seconds": time.perf_counter() - started,
                     **({"measurement_reused": True} if reused else {})}
    return out


def removed_set_key(removed: list[list[int]], digest: str, max_length: int) -> str:
    """Identifies a block-pruned model's held-out measurement: the source layers removed (in any steps)."""
    return f"{sorted(layer for step in removed for layer in step)}|{digest}|{max_length}"


def ci(d: dict) -> str:
    return f"{d['point']:.4f} [{d['low']:.4f}, {d['high']:.4f}]"


def tables(model: str, summary: list[dict], verdicts: list[dict], docs: int, heldout: str) -> list[str]:
    layers = any("removed_layers" in s for s in summary)  # block runs since the candidates: which layers went
    lines = [f"# KL to the dense model ({model}, {docs} held-out {heldout} documents, paired bootstrap 95%)", "",
             "| unit | ratio | seed | method | KL(dense‖pruned) | top-1 agreement | ppl / dense |"
             + (" source layers removed, by step |" if layers else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if layers else "")]
    lines += [f"| {s['unit']} | {s['ratio']:.1f} | {s['seed']} | {s['method']} | {ci(s['kl'])} | "
              f"{ci(s['top1_agreement'])} | {ci(s['ppl_ratio'])} |"
              + (f" {' / '.join(','.join(map(str, step)) for step in s.get('removed_layers', []))} |" if layers else "")
              for s in summary]
    lines += ["", "## Verdicts: PIP form vs baseline on KL (paired difference PIP - baseline, 95%)", "",
              "| unit | ratio | seed | PIP form | baseline | KL difference | relative | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {v['unit']} | {v['ratio']:.1f} | {v['seed']} | {v['pip']} | {v['baseline']} | {ci(v['kl_diff'])} | "
              f"{v['relative']:+.1%} | {v['verdict']} |" for v in verdicts]
    return lines


def run_key(unit: str, ratio: float, seed: int, method: str, args: argparse.Namespace) -> str:
    """What identifies one run in a --resume file: every argument that changes its figures."""
    return (f"{unit}|{ratio:g}|{seed}|{method}|{args.pairs}|{args.iterations}|{args.rate}|"
            f"{int(args.fresh_perturbation)}|{args.width_mode}|{args.max_length}"
            + ("" if args.calibration == "corpus" else f"|{args.calibration}"))


def model_identity(model: Path) -> str:
    """What a --resume record is matched on: a reference build's weights, config and calibration digests (from
    its manifest), so a committed runs file is reused from any checkout path; other models: the path."""
    manifest = model / "manifest.json"
    if not manifest.is_file():
        return str(model)
    files = json.loads(manifest.read_text()).get("files", {})
    parts = {name: files.get(name) for name in ("config.json", "model.safetensors", "calibration/calibration.jsonl",
                                                 "calibration/wordlist.txt")}
    return "sha256:" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load_done(path: Path | None, model: Path, digests: dict[str, str]) -> dict[str, dict]:
    """Finished runs of a --resume file for this model that measured (at least) these held-out sets, with the
    same contents; only these sets' records are kept. Other lines are ignored."""
    done: dict[str, dict] = {}
    identity = model_identity(model)
    if path and path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                same = record.get("model_id", record["model"]) in (identity, str(model))
                if same and all(record["digests"].get(h) == d for h, d in digests.items()):
                    done[record["key"]] = {h: record["runs"][h] for h in digests}
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--ratios", default="0.1,0.2,0.3")
    parser.add_argument("--units", default="width,block")
    parser.add_argument("--methods", default=None, help="comma list; default: every method of the unit kind")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--pairs", type=int, default=128, help="calibration pairs (128: the product default)")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--rate", type=float, default=None, help="perturbation rate (default: the Perturber's, 0.15)")
    parser.add_argument("--calibration", default="corpus", choices=CALIBRATIONS,
                        help="calibration texts: the reference corpus, sampled from the model itself, or half each")
    parser.add_argument("--fresh-perturbation", action="store_true",
                        help="perturb the calibration texts anew at every step (the paper's schedule with "
                             "--iterations = blocks to remove)")
    add_harness_args(parser)
    parser.add_argument("--report-only", action="store_true",
                        help="only tabulate the runs already in --resume (none is computed); the grid's runs not "
                             "there yet are listed as missing")
    parser.add_argument("--name", default="divergence")
    args = parser.parse_args()
    if args.report_only and not args.resume:
        parser.error("--report-only needs --resume FILE (the finished runs to tabulate)")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    from pip_core import io, schedule
    from pip_core.vocabulary import BLOCK_ONLY_METHODS

    base, tokenizer = io.load(args.model)
    dense = CachedDense(base)
    sets = {h: heldout_texts(args.model, h) for h in args.heldout.split(",")}
    digests = {h: d for h, (_, d) in sets.items()}
    identity = model_identity(args.model)
    done = load_done(args.resume, args.model, digests)
    same_model = {removed_set_key(r["removed_layers"], digests[held], args.max_length): r["docs"]
                  for key, measured in done.items() if key.endswith(f"|{args.max_length}")
                  for held, r in measured.items() if r.get("removed_layers") is not None and r.get("unit") == "block"}
    runs: dict[str, list[dict]] = {h: [] for h in sets}
    missing: list[str] = []
    for unit in args.units.split(","):
        methods = args.methods.split(",") if args.methods else METHODS[unit]
        for ratio in [float(r) for r in args.ratios.split(",")]:
            for seed in [int(s) for s in args.seeds.split(",")]:
                pairs, calib = calibration_pairs(args.model, args.pairs, seed, args.rate, args.calibration, base,
                                                 tokenizer)
                step_pairs = fresh_pairs(args.model, args.pairs, seed, args.rate) if args.fresh_perturbation else pairs
                for method in methods:
                    if method in BLOCK_ONLY_METHODS and unit != "block":
                        continue
                    key = run_key(unit, ratio, seed, method, args)
                    if key not in done and args.report_only:
                        missing.append(key)
                        continue
                    if key not in done:
                        options = schedule.ScoringOptions(method, unit, width_mode=args.width_mode)
                        done[key] = prune_and_measure(
                            base, tokenizer, options, ratio, args.iterations, step_pairs, calib, seed, sets,
                            args.max_length, dense=dense, same_model=same_model, unit=unit, ratio=ratio, seed=seed, method=method,
                            pairs=args.pairs, iterations=args.iterations, rate=args.rate,
                            fresh_perturbation=args.fresh_perturbation)
                        if args.resume:
                            with args.resume.open("a") as fh:
                                fh.write(json.dumps({"key": key, "model": str(args.model),
                                                     "model_id": identity, "runs": done[key],
                                                     "digests": digests}) + "\n")
                    for held, run in done[key].items():
                        runs[held].append(run)
                        print({k: v for k, v in run.items() if k not in ("docs", "block_scores")}, flush=True)
    for n, (held, (texts, digest)) in enumerate(sets.items()):
        summary, verdicts = summarise(runs[held])
        meta = {"heldout": held, "heldout_sha256": digest, "documents": len(texts),
                "bootstrap": {"n_boot": N_BOOT, "level": 0.95, "over": "held-out documents, paired"}}
        name = args.name if n == 0 else f"{args.name}_{Path(held).stem}"
        table = tables(args.model.name, summary, verdicts, len(texts), held)
        if missing:
            table += ["", f"Not run yet ({len(missing)} of the grid; key: unit|ratio|seed|method|pairs|iterations|"
                      "rate|fresh|width mode|max length): " + ", ".join(f"`{k}`" for k in missing)]
        print(write(name, {"args": vars(args), **meta, "runs": runs[held], "summary": summary, "verdicts": verdicts,
                           "missing": missing}, table))


if __name__ == "__main__":
    main()
